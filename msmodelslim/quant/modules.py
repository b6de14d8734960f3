"""QuantLinear: the deployed computation of a dynamically quantized linear, used during and after calibration.

Forward (what vLLM-Ascend computes for W8A8_DYNAMIC / W4A8_DYNAMIC):
    x  <- x @ online_rotation^T                    (if the layer has one; see below)
    qx, sx = per-token symmetric quantization of x  (one scale per token over the last dim, int8 or int4)
    y  = (qx @ qweight^T) * sx * weight_scale^T    (integer GEMM, see _integer_matmul), cast to x's dtype
    y += bias
so the next unit calibrates on what inference will see.

Online rotation convention (shared with the QuaRot processor): a linear whose input must be rotated at run time
carries a buffer `online_rotation` T [in, in] (orthogonal); the runtime input is `x~ = x @ T^T = F.linear(x, T)`
(i.e. T x for a column vector, as in QuaRot), and the weight is stored rotated, W' = W @ T^T, so that
`x~ @ W'^T == x @ W^T`. processor/quarot.py sets it on plain nn.Linear modules (with a float pre-hook that does the
rotation); `QuantLinear.from_linear` carries the buffer over (the hook is not needed: forward rotates), and the
saver writes it as `<linear>.online_rotation`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from msmodelslim.core.placement import not_on_npu
from msmodelslim.quant.functional import (
    dequantize,
    grid_scale_search,
    quantize_per_token,
    quantize_symmetric,
    quantize_with_scale,
    ssz_scale_search,
)
from msmodelslim.quant.gptq import DEFAULT_GPTQ, GPTQOptions, gptq_quantize, gptq_scale
from msmodelslim.quant.granularity import IntDtype, PerChannel, int4, int8

ONLINE_ROTATION = "online_rotation"


@dataclass(frozen=True)
class QuantScheme:
    """A dynamic (per-token activation) scheme with per-channel symmetric weights; `name` is its AscendV1 type.

    `engine_scale_dtype`: the dtype the serving engine holds the weight scale in. vllm-ascend keeps W8A8_DYNAMIC
    scales in the model dtype (bf16; `w8a8_dynamic.py:71`) but W4A8_DYNAMIC MoE scales in fp32 (`w4a8.py:449-486`),
    so W8A8 weights are quantized against the bf16-rounded scale: the stored integers are exact for the scale the
    engine multiplies by (an fp32 scale would carry a per-channel gain error of up to 2^-9 = 0.2 %)."""

    name: str
    weight: IntDtype
    act: IntDtype
    engine_scale_dtype: torch.dtype = torch.float32


W8A8_DYNAMIC = QuantScheme("W8A8_DYNAMIC", int8, int8, engine_scale_dtype=torch.bfloat16)
W4A8_DYNAMIC = QuantScheme("W4A8_DYNAMIC", int4, int8)
W4A4_DYNAMIC = QuantScheme("W4A4_DYNAMIC", int4, int4)  # stress variant: int4 per-token activations
SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (W8A8_DYNAMIC, W4A8_DYNAMIC, W4A4_DYNAMIC)}
# minmax: max|w| / qmax; ssz: least-squares refinement of minmax; grid: clipping grid + refinement (no data);
# gptq: the diag(H)-weighted grid scale, then GPTQ's error-compensating rounding (needs the input Hessian).
WEIGHT_METHODS = ("ssz", "minmax", "grid", "gptq")


def get_scheme(scheme: str | QuantScheme) -> QuantScheme:
    if isinstance(scheme, QuantScheme):
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {sorted(SCHEMES)}")
    return SCHEMES[scheme]


def scheme_for(weight: IntDtype, act: IntDtype) -> QuantScheme:
    """The scheme with these weight / activation dtypes (ValueError when there is none)."""
    for s in SCHEMES.values():
        if s.weight == weight and s.act == act:
            return s
    raise ValueError(f"no dynamic scheme with {weight.name} weights and {act.name} activations")


def apply_online_rotation(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x @ T^T (= F.linear(x, T)) computed in float32, returned in x's dtype."""
    return F.linear(x.to(torch.float32), rotation.to(device=x.device, dtype=torch.float32)).to(x.dtype)


def quantize_weight(w: torch.Tensor, dtype: IntDtype, method: str = "ssz", ssz_iters: int = 50,
                    scale_dtype: torch.dtype = torch.float32, hessian: torch.Tensor | None = None,
                    tokens: int | torch.Tensor | None = None, gptq: GPTQOptions = DEFAULT_GPTQ,
                    hessian_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric weight quantization: (q int8 [out, in], scale float32 [out, 1]).

    The scale is a value of `scale_dtype` (rounded to nearest; a scale that would round to 0 stays the smallest
    positive one), and q is computed against exactly that value. gptq reads `hessian` (X^T X of the input) and
    `tokens` (how many rows it summed); for a batch [B, out, in], `hessian_index` [B] picks each matrix's Hessian
    among `hessian` [U, d, d] (readers of one input share one)."""
    if method == "minmax":
        _, scale = quantize_symmetric(w, dtype, PerChannel())
    elif method == "ssz":
        scale = ssz_scale_search(w, dtype, iters=ssz_iters)
    elif method == "grid":
        scale = grid_scale_search(w, dtype)
    elif method == "gptq":
        if hessian is None:
            raise ValueError("weight method 'gptq' needs the input Hessian")
        scale = gptq_scale(w, hessian, dtype, hessian_index)
    else:
        raise ValueError(f"unknown weight method {method!r}; expected one of {list(WEIGHT_METHODS)}")
    if scale_dtype != torch.float32:
        tiny = torch.finfo(scale_dtype).tiny
        scale = scale.to(scale_dtype).to(torch.float32).clamp_min(tiny)
    if method == "gptq":
        return gptq_quantize(w, hessian, scale, dtype, gptq, tokens, hessian_index), scale.to(torch.float32)
    return quantize_with_scale(w, scale, dtype), scale.to(torch.float32)


def _integer_matmul(qx: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """qx @ qweight^T of int8 tensors as float32. On CPUs an int32 GEMM, exact like the deployed int8 GEMM and
    without a float copy of the weight (a 4 MB temporary per expert call otherwise); elsewhere float32 products,
    exact while the sums stay below 2^24 (always for W4A8; W8A8 rows over ~1000 inputs can round in the last bits)."""
    if qx.device.type == "cpu":
        with not_on_npu("the CPU's int32 GEMM; an NPU takes the float32 product (no _int_mm kernel)"):
            return torch._int_mm(qx.reshape(-1, qx.shape[-1]), qweight.t()).to(torch.float32).view(
                *qx.shape[:-1], qweight.shape[0])
    return qx.to(torch.float32) @ qweight.to(torch.float32).t()


class QuantLinear(nn.Module):
    """A linear with per-channel symmetric integer weights and dynamic per-token activation quantization.

    Buffers: `qweight` int8 [out, in] (integer values, int4 ones in [-8, 7], unpacked), `weight_scale` float32
    [out, 1], optional `bias` (compute dtype) and optional `online_rotation` [in, in].
    """

    def __init__(self, in_features: int, out_features: int, scheme: str | QuantScheme, qweight: torch.Tensor,
                 weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 online_rotation: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = get_scheme(scheme)
        self.compute_dtype = compute_dtype
        if tuple(qweight.shape) != (out_features, in_features) or qweight.dtype != torch.int8:
            raise ValueError(f"qweight must be int8 [{out_features}, {in_features}], got {qweight.dtype} "
                             f"{list(qweight.shape)}")
        if tuple(weight_scale.shape) != (out_features, 1):
            raise ValueError(f"weight_scale must be [{out_features}, 1], got {list(weight_scale.shape)}")
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale.to(torch.float32))
        self.register_buffer("bias", None if bias is None else bias.detach().to(compute_dtype))
        if online_rotation is not None and tuple(online_rotation.shape) != (in_features, in_features):
            raise ValueError(f"online_rotation must be [{in_features}, {in_features}], "
                             f"got {list(online_rotation.shape)}")
        self.register_buffer(ONLINE_ROTATION, online_rotation)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str | QuantScheme, weight_method: str = "ssz",
                    ssz_iters: int = 50, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> QuantLinear:
        """Quantize `linear`'s weight per channel (on its device) and carry over bias and online rotation.

        `quantized` = (q, scale) as `quantize_weight` returns them for this weight, when already computed.
        """
        sch = get_scheme(scheme)
        w = linear.weight.detach()
        q, scale = quantized if quantized is not None else quantize_weight(w, sch.weight, weight_method, ssz_iters,
                                                                           sch.engine_scale_dtype)
        rot = getattr(linear, ONLINE_ROTATION, None)
        return cls(linear.in_features, linear.out_features, sch, q, scale,
                   bias=None if linear.bias is None else linear.bias.detach(),
                   online_rotation=None if rot is None else rot.detach().clone(), compute_dtype=w.dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """qweight * weight_scale (float32 math), cast to `dtype`."""
        return dequantize(self.qweight, self.weight_scale, dtype=dtype)

    @property
    def weight(self) -> torch.Tensor:
        """Dequantised weight in the compute dtype, for model code that reads `.weight.dtype` / `.weight.device`."""
        return self.dequantized_weight(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype
        if self.online_rotation is not None:
            x = apply_online_rotation(x, self.online_rotation)
        qx, sx = quantize_per_token(x, self.scheme.act)
        acc = _integer_matmul(qx, self.qweight)
        y = (acc * sx * self.weight_scale.t()).to(out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y

    def extra_repr(self) -> str:
        rot = ", online_rotation" if self.online_rotation is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
                f"bias={self.bias is not None}{rot}")
