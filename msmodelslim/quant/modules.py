"""QuantLinear: the deployed computation of a quantized linear, used during and after calibration.

Forward (what vLLM-Ascend computes), so the next unit calibrates on what inference will see:
    x  <- x @ online_rotation^T                    (if the layer has one; see below)
  integer schemes (W8A8_DYNAMIC / W4A8_DYNAMIC / W4A4_DYNAMIC, Atlas A2/A3):
    qx, sx = per-token symmetric quantization of x  (one scale per token over the last dim, int8 or int4)
    y  = (qx @ qweight^T) * sx * weight_scale^T    (integer GEMM: `int8_gemm_fits`, `_integer_matmul`), cast to
                                                   x's dtype;
         with per-group weight scales [out, in / group] (W4A8_DYNAMIC, group_size > 0) the same sum over
         qx * (q * group scale), in float32
  MX schemes (W4A16_MXFP4 / W4A8_MXFP / W8A8_MXFP8 / W4A4_MXFP4, Ascend 950):
    xq = x, or x quantized per block of 32 to MXFP8 / MXFP4 as the kernel does it (quant/mx.py), dequantised
    y  = xq @ W^T with W the MX weight dequantised (exact in bfloat16), in x's dtype
    y += bias

Online rotation convention (shared with the QuaRot processor): a linear whose input must be rotated at run time
carries a buffer `online_rotation` T [in, in] (orthogonal); the runtime input is `x~ = x @ T^T = F.linear(x, T)`
(i.e. T x for a column vector, as in QuaRot), and the weight is stored rotated, W' = W @ T^T, so that
`x~ @ W'^T == x @ W^T`. processor/quarot.py sets it on plain nn.Linear modules (with a float pre-hook that does the
rotation); `QuantLinear.from_linear` carries the buffer over (the hook is not needed: forward rotates), and the
saver writes it as `<linear>.online_rotation`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from msmodelslim.core.device import host_values, tensor_core_fp32_matmuls
from msmodelslim.core.placement import not_on_npu
from msmodelslim.ops.checked_kernel import CheckedKernel
from msmodelslim.quant.functional import (
    CPU_PIECE_ROWS,
    dequantize,
    grid_scale_search,
    minmax_scale,
    quantize_per_token,
    quantize_with_scale,
    ssz_scale_search,
)
from msmodelslim.quant.gptq import DEFAULT_GPTQ, GPTQOptions, gptq_quantize, gptq_scale, hessian_diagonals
from msmodelslim.quant.granularity import IntDtype, PerChannel, int4, int8
from msmodelslim.quant.mx import (
    BLOCK,
    MXFP4,
    MXFP8,
    MXFormat,
    decode_weight,
    encode_weight,
    fake_quant_mx,
    grid_exponents,
    quantize_mx_weight,
)
from msmodelslim.quant.sensitivity import WeightError

logger = logging.getLogger(__name__)

ONLINE_ROTATION = "online_rotation"


@dataclass(frozen=True)
class QuantScheme:
    """A serving scheme; `name` is its AscendV1 type. Integer schemes quantize activations per token at run time
    and weights per channel (or per group); MX schemes use blocks of 32 with E8M0 exponents for both, and
    `act` None keeps activations in the model dtype.

    `engine_scale_dtype`: the dtype the serving engine holds an integer weight scale in. vllm-ascend keeps
    W8A8_DYNAMIC scales in the model dtype (bf16; `w8a8_dynamic.py:71`) but W4A8_DYNAMIC MoE scales in fp32
    (`w4a8.py:449-486`), so W8A8 weights are quantized against the bf16-rounded scale: the stored integers are exact
    for the scale the engine multiplies by (an fp32 scale would carry a per-channel gain error of up to 2^-9). The
    per-group W4A8 MoE kernel multiplies by fp16(weight_scale * weight_scale_second) (`w4a8.py` `process_scale`):
    per-group scales are fp16 values. `act_rounding`: how the kernel rounds MX activations (vllm-ascend asks
    `npu_dynamic_mx_quant` for "round", half away from zero, in W4A4_MXFP4 only; "rint" otherwise)."""

    name: str
    weight: IntDtype | MXFormat
    act: IntDtype | MXFormat | None
    engine_scale_dtype: torch.dtype = torch.float32
    act_rounding: str = "rint"

    @property
    def is_mx(self) -> bool:
        return isinstance(self.weight, MXFormat)


W8A8_DYNAMIC = QuantScheme("W8A8_DYNAMIC", int8, int8, engine_scale_dtype=torch.bfloat16)
W4A8_DYNAMIC = QuantScheme("W4A8_DYNAMIC", int4, int8)
W4A4_DYNAMIC = QuantScheme("W4A4_DYNAMIC", int4, int4)  # stress variant: int4 per-token activations
W4A16_MXFP4 = QuantScheme("W4A16_MXFP4", MXFP4, None)  # vllm-ascend serves it for MoE experts only
W4A8_MXFP = QuantScheme("W4A8_MXFP", MXFP4, MXFP8)
W8A8_MXFP8 = QuantScheme("W8A8_MXFP8", MXFP8, MXFP8)
W4A4_MXFP4 = QuantScheme("W4A4_MXFP4", MXFP4, MXFP4, act_rounding="round")
GROUP_SCALE_DTYPE = torch.float16  # per-group W4A8 scales: what the MoE kernel multiplies by
SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (W8A8_DYNAMIC, W4A8_DYNAMIC, W4A4_DYNAMIC, W4A16_MXFP4,
                                                        W4A8_MXFP, W8A8_MXFP8, W4A4_MXFP4)}
# minmax: max|w| / qmax; ssz: least-squares refinement of minmax; grid: clipping grid + refinement (no data);
# gptq: the diag(H)-weighted grid scale, then GPTQ's error-compensating rounding (needs the input Hessian).
WEIGHT_METHODS = ("ssz", "minmax", "grid", "gptq")


def get_scheme(scheme: str | QuantScheme) -> QuantScheme:
    if isinstance(scheme, QuantScheme):
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {sorted(SCHEMES)}")
    return SCHEMES[scheme]


def scheme_for(weight: IntDtype | MXFormat, act: IntDtype | MXFormat | None) -> QuantScheme:
    """The scheme with these weight / activation dtypes (ValueError when there is none)."""
    for s in SCHEMES.values():
        if s.weight == weight and s.act == act:
            return s
    pairs = ", ".join(f"{s.weight.name}/{s.act.name if s.act else 'none'}" for s in SCHEMES.values())
    raise ValueError(f"no serving scheme has {weight.name} weights with "
                     f"{act.name if act else 'unquantized'} activations (weight/act pairs: {pairs})")


def apply_online_rotation(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x @ T^T (= F.linear(x, T)) computed in float32, returned in x's dtype."""
    return F.linear(x.to(torch.float32), rotation.to(device=x.device, dtype=torch.float32)).to(x.dtype)


_APPENDED_HOOKS = "_appended_linear_hooks"


def append_output_linear(module: nn.Module, name: str, weight: torch.Tensor) -> nn.Linear:
    """module(x) <- child `name`(module(x)): a new bias-free linear holding `weight` [out, in], applied to the
    module's output as the serving engine applies a stored linear after it (vllm-ascend's `mm_projector.rot_proj`,
    a residual rotation that no weight of a projector ending in a norm can absorb). The weight's dtype is the
    compute dtype, as the engine computes it."""
    if hasattr(module, name):
        raise ValueError(f"{type(module).__name__} already has a child {name!r}")
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    module.add_module(name, linear)
    hooks = module.__dict__.setdefault(_APPENDED_HOOKS, {})
    hooks[name] = module.register_forward_hook(lambda _m, _args, out: linear(out))
    return linear


def remove_output_linear(module: nn.Module, name: str) -> None:
    """Undo `append_output_linear` (nothing when the module has none of that name)."""
    hook = module.__dict__.get(_APPENDED_HOOKS, {}).pop(name, None)
    if hook is not None:
        hook.remove()
        delattr(module, name)


def quantize_weight(w: torch.Tensor, dtype: IntDtype | MXFormat, method: str = "ssz", ssz_iters: int = 50,
                    scale_dtype: torch.dtype = torch.float32, hessian: torch.Tensor | None = None,
                    tokens: int | torch.Tensor | None = None, gptq: GPTQOptions = DEFAULT_GPTQ,
                    group_size: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight quantization of w [..., out, in] for one scheme's weight dtype.

    Integer dtypes: (q int8 [..., out, in], scale float32 [..., out, 1], or [..., out, in / group_size] per group).
    The scale is a value of `scale_dtype` (rounded to nearest; a scale that would round to 0 stays the smallest
    positive one), and q is computed against exactly that value. gptq reads `hessian` (X^T X of the input) and
    `tokens` (how many rows it summed); a batch [B, out, in] reads `hessian` [B, d, d] and `tokens` [B].
    MX formats: (stored elements uint8, E8M0 scales uint8 [..., out, in / 32]) as quant/mx.py stores them; `minmax`,
    `grid` (the exponent search) or `gptq` (`_quantize_mx`)."""
    if isinstance(dtype, MXFormat):
        return _quantize_mx(w, dtype, method, hessian, tokens, gptq)
    if group_size:
        return _quantize_groups(w, dtype, method, ssz_iters, hessian, tokens, gptq, group_size)
    scale = _representable(_row_scales(w, dtype, method, ssz_iters, hessian), scale_dtype)
    if method == "gptq":
        return gptq_quantize(w, hessian, scale, dtype, gptq, tokens), scale
    return quantize_with_scale(w, scale, dtype), scale


def _row_scales(w: torch.Tensor, dtype: IntDtype, method: str, ssz_iters: int,
                hessian: torch.Tensor | None = None) -> torch.Tensor:
    """The per-row scales [..., rows, 1] `method` chooses (gptq: the diag(H)-weighted grid)."""
    if method == "minmax":
        return minmax_scale(w, dtype, PerChannel())
    if method == "ssz":
        return ssz_scale_search(w, dtype, iters=ssz_iters)
    if method == "grid":
        return grid_scale_search(w, dtype)
    if method == "gptq":
        return gptq_scale(w, hessian, dtype)
    raise ValueError(f"unknown weight method {method!r}; expected one of {list(WEIGHT_METHODS)}")


def _quantize_mx(w: torch.Tensor, fmt: MXFormat, method: str, hessian: torch.Tensor | None, tokens: Any,
                 gptq: GPTQOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """MX weights: `minmax` / `grid` (quant/mx.py), or `gptq`: the diag(H)-weighted exponent search, then GPTQ's
    error-compensating rounding to the elements against those fixed exponents."""
    if method != "gptq":
        return quantize_mx_weight(w, fmt, method)
    exponents = grid_exponents(w, fmt, hessian_diagonals(hessian))
    per_weight = torch.exp2(exponents.to(torch.float32)).repeat_interleave(BLOCK, dim=-1)
    elements = gptq_quantize(w, hessian, per_weight, fmt, gptq, tokens)
    return encode_weight(elements.to(torch.float32), exponents, fmt)


def _representable(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """float32 scales rounded to values of `scale_dtype` (never below its smallest normal)."""
    if scale_dtype != torch.float32:
        scale = scale.to(scale_dtype).to(torch.float32).clamp_min(torch.finfo(scale_dtype).tiny)
    return scale.to(torch.float32)


def _quantize_groups(w: torch.Tensor, dtype: IntDtype, method: str, ssz_iters: int,
                     hessian: torch.Tensor | None, tokens: Any, gptq: GPTQOptions,
                     group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group integer weights: each run of `group_size` inputs of a row has its own scale, a value of
    GROUP_SCALE_DTYPE (the W4A8 MoE kernel's), found by `method` on the group as if it were a row; gptq rounds
    against those fixed scales with the Hessian of the whole input."""
    *lead, out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not divisible by group_size {group_size}")
    groups = in_f // group_size
    rows = w.reshape(*lead, out_f * groups, group_size)  # one row per (output channel, group)
    if method == "gptq":
        diag = hessian_diagonals(hessian)
        by_group = w.reshape(*lead, out_f, groups, group_size).transpose(-3, -2)  # [..., G, out, g]
        imp = diag.reshape(*diag.shape[:-1], groups, group_size)  # [..., G, g]
        scale = grid_scale_search(by_group, dtype, importance=imp).transpose(-3, -2)  # [..., out, G, 1]
    else:
        scale = _row_scales(rows, dtype, method, ssz_iters)
    scale = _representable(scale.reshape(*lead, out_f, groups), GROUP_SCALE_DTYPE)
    per_column = scale.repeat_interleave(group_size, dim=-1)
    if method == "gptq":
        return gptq_quantize(w, hessian, per_column, dtype, gptq, tokens), scale
    return quantize_with_scale(w, per_column, dtype), scale


def dequantize_weight(scheme: QuantScheme, qweight: torch.Tensor, weight_scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [out, in] the engine multiplies by, of QuantLinear's storage (float32 math, cast to `dtype`)."""
    if scheme.is_mx:
        return decode_weight(qweight, weight_scale, scheme.weight, dtype)
    group = qweight.shape[1] // weight_scale.shape[1]
    scale = weight_scale.repeat_interleave(group, dim=1) if weight_scale.shape[1] > 1 else weight_scale
    return dequantize(qweight, scale, dtype=dtype)


CPU_FLOAT_PRODUCT = "the CPU's exact float product of integers (float64 for wide W8A8 rows); an NPU multiplies in float32"
INT8_GEMM = "CUDA's int8 GEMM with int32 sums; an NPU multiplies the integers in float32 on HF32 tensor cores"
INT8_GEMM_MIN_ROWS = 17  # torch._int_mm on CUDA takes more than 16 rows: fewer are padded with zero rows


def int8_gemm_fits(device: torch.device, in_features: int, out_features: int) -> bool:
    """Whether a per-channel integer product runs as an int8 GEMM with int32 sums (`_int8_gemm`): on CUDA, for
    the widths cuBLASLt's int8 kernels take (multiples of 8). Its integers are exact at every width, as the
    deployed kernel's are (TF32 rounds W8A8 sums past 2^24), the int8 weights are multiplied as stored (no float32
    copy of each weight per call) and the tensor cores run int8 at twice TF32's rate."""
    return device.type == "cuda" and in_features % 8 == 0 and out_features % 8 == 0


def _int8_gemm(rows: torch.Tensor, qweight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [m, in] int8 @ qweight [out, in]^T as int32 (`torch._int_mm`), written into `out` [m, out] if given."""
    with not_on_npu(INT8_GEMM):
        if rows.shape[0] >= INT8_GEMM_MIN_ROWS:
            return torch._int_mm(rows, qweight.t()) if out is None else torch._int_mm(rows, qweight.t(), out=out)
        padded = rows.new_zeros(INT8_GEMM_MIN_ROWS, rows.shape[1])
        padded[:rows.shape[0]] = rows
        product = torch._int_mm(padded, qweight.t())[:rows.shape[0]]
        return product if out is None else out.copy_(product)


def integer_weight(qweight: torch.Tensor, act_bits: int, weight_bits: int) -> torch.Tensor:
    """The integers of `qweight` [out, in] as `_integer_matmul` multiplies by them. On the CPU in a float type whose
    GEMM is exact for these bit widths, as the deployed int8 GEMM is: every partial sum of qx * q is an integer of
    at most in * 2^(act_bits - 1) * 2^(weight_bits - 1), exact in float32 up to 2^24 (W4A8 up to 16,384 inputs) and
    in float64 beyond (W8A8 rows over 1,024 inputs), so the order of the sums cannot change a bit. The CPU's own
    int32 GEMM (`torch._int_mm`) gives the same integers, but without VNNI it ran 15x slower than the float32 GEMM
    (AVX2: 11.5 vs 0.74 s for 8192 x 2048 -> 1024). Elsewhere (an NPU; CUDA where `int8_gemm_fits` does not)
    float32, multiplied on TF32 / HF32 tensor cores, which hold 8-bit integers exactly: exact while the sums stay
    below 2^24 (always for W4A8; W8A8 rows over ~1000 inputs can round in the last bits)."""
    if qweight.device.type == "cpu" and qweight.shape[-1] << (act_bits - 1 + weight_bits - 1) > 1 << 24:
        with not_on_npu(CPU_FLOAT_PRODUCT):
            return qweight.to(torch.float64)
    return qweight.to(torch.float32)


def _integer_matmul(qx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """qx @ weight^T as float32, of int8 qx and `integer_weight`'s weight."""
    if qx.device.type == "cpu":
        with not_on_npu(CPU_FLOAT_PRODUCT):
            return (qx.to(weight.dtype) @ weight.t()).to(torch.float32)
    with tensor_core_fp32_matmuls(qx.device):
        return qx.to(torch.float32) @ weight.t()


class QuantLinear(nn.Module):
    """A quantized linear as the serving engine computes it (module docstring).

    Buffers: `qweight` and `weight_scale` in the scheme's storage, optional `bias` (compute dtype) and optional
    `online_rotation` [in, in]:
      integer schemes: qweight int8 [out, in] (int4 values in [-8, 7], unpacked), weight_scale float32 [out, 1]
                       (per channel) or [out, in / group_size] (per group);
      MX schemes:      qweight uint8, FP4 codes packed two a byte [out, in / 2] or E4M3 bits [out, in], and
                       weight_scale uint8 E8M0 exponents [out, in / 32] (quant/mx.py).
    """

    def __init__(self, in_features: int, out_features: int, scheme: str | QuantScheme, qweight: torch.Tensor,
                 weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 online_rotation: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.bfloat16,
                 group_size: int | None = None) -> None:
        """`group_size`: the per-group size the weight was quantized with, when known; without it the size is read
        off the scale's columns, which cannot tell one group of `in_features` from per channel."""
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = get_scheme(scheme)
        self.compute_dtype = compute_dtype
        if self.scheme.is_mx:
            self.group_size = 32
            q_shape = (out_features, in_features // (2 if self.scheme.weight.bits == 4 else 1))
            q_dtype, s_dtype, s_cols = torch.uint8, torch.uint8, (in_features // 32,)
        else:
            groups = weight_scale.shape[-1] if weight_scale.dim() == 2 else 1
            self.group_size = group_size or (0 if groups == 1 else in_features // groups)
            q_shape, q_dtype, s_dtype = (out_features, in_features), torch.int8, torch.float32
            s_cols = (in_features // group_size,) if group_size else \
                (1, in_features // max(self.group_size, 1)) if self.group_size else (1,)
        if tuple(qweight.shape) != q_shape or qweight.dtype != q_dtype:
            raise ValueError(f"{self.scheme.name} qweight must be {q_dtype} {list(q_shape)}, got {qweight.dtype} "
                             f"{list(qweight.shape)}")
        if weight_scale.dim() != 2 or weight_scale.shape[0] != out_features or weight_scale.shape[1] not in s_cols \
                or (self.group_size and in_features % self.group_size):
            raise ValueError(f"{self.scheme.name} weight_scale must be [{out_features}, one of {list(s_cols)}] "
                             f"for {in_features} inputs, got {list(weight_scale.shape)}")
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale.to(s_dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(compute_dtype))
        if online_rotation is not None and tuple(online_rotation.shape) != (in_features, in_features):
            raise ValueError(f"online_rotation must be [{in_features}, {in_features}], "
                             f"got {list(online_rotation.shape)}")
        self.register_buffer(ONLINE_ROTATION, online_rotation)
        # What linear_quant knew of the rounding, for the quant report (quant/sensitivity.py; its input sums are a
        # statistic the runner reads off the unit's forward): a plain attribute, never saved.
        self.weight_error: WeightError | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str | QuantScheme, weight_method: str = "ssz",
                    ssz_iters: int = 50, quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                    group_size: int | None = None) -> QuantLinear:
        """Quantize `linear`'s weight (per channel, on its device) and carry over bias and online rotation.

        `quantized` = (q, scale) as `quantize_weight` returns them for this weight, when already computed.
        """
        sch = get_scheme(scheme)
        w = linear.weight.detach()
        q, scale = quantized if quantized is not None else quantize_weight(w, sch.weight, weight_method, ssz_iters,
                                                                           sch.engine_scale_dtype)
        rot = getattr(linear, ONLINE_ROTATION, None)
        return cls(linear.in_features, linear.out_features, sch, q, scale,
                   bias=None if linear.bias is None else linear.bias.detach(),
                   online_rotation=None if rot is None else rot.detach().clone(), compute_dtype=w.dtype,
                   group_size=group_size)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the engine multiplies by (float32 math), cast to `dtype`."""
        return dequantize_weight(self.scheme, self.qweight, self.weight_scale, dtype)

    @property
    def weight(self) -> torch.Tensor:
        """Dequantised weight in the compute dtype, for model code that reads `.weight.dtype` / `.weight.device`."""
        return self.dequantized_weight(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype
        if self.online_rotation is not None:
            x = apply_online_rotation(x, self.online_rotation)
        act = self.scheme.act
        if isinstance(act, IntDtype):
            qx, sx = quantize_per_token(x, act)
            y = self.integer_product(qx, sx, out_dtype)
        else:  # MX: elements times powers of two are exact in the model dtype
            y = F.linear(x if act is None else fake_quant_mx(x, act, self.scheme.act_rounding),
                         self.dequantized_weight(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y

    def kernel_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For an input x of `forward`: the input in the weight's basis (after the online rotation) and what the
        kernel multiplies by in its place (float32; None where activations stay float), as `forward` computes them
        (the same values: per-token quantization is a per-row computation)."""
        if self.online_rotation is not None:
            x = apply_online_rotation(x, self.online_rotation)
        act = self.scheme.act
        if isinstance(act, IntDtype):
            qx, sx = quantize_per_token(x, act)
            return x, qx.to(torch.float32) * sx
        return x, None if act is None else fake_quant_mx(x, act, self.scheme.act_rounding)

    def integer_product(self, qx: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The output before the bias, computed in float32 and cast to `dtype`, of per-token quantized inputs (qx
        int8, sx float32 [..., 1]). On the CPU in pieces of CPU_PIECE_ROWS rows: each piece's float32 epilogue
        (scales, cast) runs in cache, not through memory (3.5x at 8192 x 512 -> 1536); the values are the same,
        row by row."""
        per_group = self.weight_scale.shape[-1] > 1  # its scales do not factor out of the sum: float32 products
        if not per_group and int8_gemm_fits(qx.device, self.in_features, self.out_features):
            product = _int8_gemm(qx.reshape(-1, self.in_features), self.qweight).to(torch.float32)
            product = product.mul_(sx.reshape(-1, 1)).mul_(self.weight_scale.t())
            return product.to(dtype).view(*qx.shape[:-1], self.out_features)
        weight = self.dequantized_weight() if per_group else \
            integer_weight(self.qweight, self.scheme.act.bits, self.scheme.weight.bits)  # once for every piece
        if qx.device.type != "cpu" or qx.numel() <= CPU_PIECE_ROWS * qx.shape[-1]:
            product = self._float_product(qx, sx, weight, per_group)
            return product if product.dtype == dtype else product.to(dtype)
        rows = qx.reshape(-1, qx.shape[-1])
        scales = sx.reshape(-1, 1)
        out = torch.empty(rows.shape[0], self.out_features, dtype=dtype)
        for start in range(0, rows.shape[0], CPU_PIECE_ROWS):
            end = start + CPU_PIECE_ROWS
            out[start:end] = self._float_product(rows[start:end], scales[start:end], weight, per_group)
        return out.view(*qx.shape[:-1], self.out_features)

    def _float_product(self, qx: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor,
                       per_group: bool) -> torch.Tensor:
        if per_group:
            return (qx.to(torch.float32) @ weight.t()).mul_(sx)
        return _integer_matmul(qx, weight).mul_(sx).mul_(self.weight_scale.t())  # in place: a fresh product

    def extra_repr(self) -> str:
        rot = ", online_rotation" if self.online_rotation is not None else ""
        group = f", group_size={self.group_size}" if self.group_size and not self.scheme.is_mx else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"
                f"{group}, bias={self.bias is not None}{rot}")


def _shares_quantized_rows(module: nn.Module) -> bool:
    """A QuantLinear whose input rows can be quantized once for every reader of them: per-token integer
    activations, no rotation or bias, and no pre-hook that must see the call (an input statistic)."""
    return isinstance(module, QuantLinear) and isinstance(module.scheme.act, IntDtype) \
        and module.online_rotation is None and module.bias is None and not module._forward_pre_hooks


def linears_over_row_groups(readers: Sequence[Sequence[nn.Module]], x: torch.Tensor,
                            bounds: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Row group g of x (rows bounds[g]) is read by the linears readers[g] (a routed expert's w1 and w3, or its
    w2); returns, per reader position j, the concatenation over groups of readers[g][j](x[rows of g]).

    Bit-identical to calling each module on its rows (but for a statistics pass's float experts on CUDA:
    `_float_products_in_one_buffer`), with fewer launches: the QuantLinears of
    `_shares_quantized_rows` take the per-token quantization of all rows at once (a per-row computation) and only
    their products per group (on accelerators into one buffer per position: `_products_in_one_buffer`), and their
    forward hooks (statistics of input and output: the quant report's) are called with the group's rows and output
    as the module's call would; a position whose modules' only hooks are the runner's statistics hands them every
    group's rows in one call instead (before: `_recorded_at_once`, then it runs unhooked; after, with its whole
    output: `_call_recorder`); any other module is called as usual. Calls and hooks come group by group, each
    group's readers one after the other with the same tensor: that is how readers of one input share a Hessian
    (pipeline/statistics.py)."""
    quantized: dict[IntDtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def quantized_rows(module: QuantLinear) -> tuple[torch.Tensor, torch.Tensor]:
        act = module.scheme.act
        if act not in quantized:
            quantized[act] = quantize_per_token(x, act)
        return quantized[act]

    on_accelerator = x.device.type != "cpu"
    # the CPU casts each group's product while it is in cache; accelerators cast the concatenation (one launch)
    product_dtype = torch.float32 if on_accelerator else x.dtype
    positions = [[group[j] for group in readers] for j in range(len(readers[0]) if readers else 0)]
    # one buffer is the concatenation only where the groups tile x's rows in order (the grouped experts' do)
    tiled = bool(bounds) and bounds[0][0] == 0 and bounds[-1][1] == x.shape[0] and \
        all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    # a position whose pre-hooks are the runner's statistics records every group in one call, then runs unhooked
    recorded = [_recorded_at_once(modules, x, bounds) for modules in positions]
    buffers = [_products_in_one_buffer(modules, quantized_rows(modules[0]), bounds, x.dtype)
               if tiled and _buffers_products(x) and _one_product_buffer(modules)
               else _float_products_in_one_buffer(modules, x, bounds)
               if tiled and recorded_here and _one_float_buffer(modules, x) else None
               for modules, recorded_here in zip(positions, recorded)]
    # a position whose forward hooks are the runner's output statistics (the quant report) gets them for every
    # group in one call, after its output is whole
    after = [tiled and _call_recorder(modules) for modules in positions]
    pieces: list[list[torch.Tensor]] = [[] for _ in positions]
    for group, (start, end) in zip(readers, bounds, strict=True):
        rows = x[start:end]
        for j, module in enumerate(group):
            if buffers[j] is not None:
                y = buffers[j][start:end]
            elif _shares_quantized_rows(module):
                qx, sx = quantized_rows(module)
                y = module.integer_product(qx[start:end], sx[start:end], product_dtype)
                pieces[j].append(y)
            else:
                pieces[j].append(module.forward(rows) if recorded[j] else module(rows))
                continue
            if after[j]:
                continue
            for hook in module._forward_hooks.values():
                if hook(module, (rows,), y.to(x.dtype)) is not None:
                    raise RuntimeError(f"a forward hook of {module} replaced the output of a grouped expert call")
    outputs = [buffer if buffer is not None else torch.cat(p).to(x.dtype) for buffer, p in zip(buffers, pieces)]
    for modules, output, recorder in zip(positions, outputs, after):
        if recorder:
            record, names = recorder
            record(names, modules, x, output, bounds)
    return outputs


# A forward pre-hook carrying this attribute (the runner's statistics: pipeline/answers.py) takes a grouped
# position's calls at once: f(names, x, bounds), names[g] read rows bounds[g] of x; the same object on every hook
# of one pass, whose `observed_name` says the module's name
RECORD_ROW_GROUPS = "record_row_groups"


# The same for a forward hook (the runner's statistics of input and output: the quant report): f(names, modules,
# x, y, bounds), y the position's whole output
RECORD_CALL_GROUPS = "record_call_groups"


def _shared_recorder(hooks: Sequence[dict[int, Callable[..., Any]]], attribute: str
                     ) -> tuple[Callable[..., None], list[str]] | None:
    """The runner's grouped recorder of a position and its modules' names, when each module's only hook of this kind
    carries `attribute`, the same object for all."""
    if not hooks or any(len(h) != 1 for h in hooks):
        return None
    firsts = [next(iter(h.values())) for h in hooks]
    record = getattr(firsts[0], attribute, None)
    if record is None or any(getattr(h, attribute, None) is not record for h in firsts):
        return None
    return record, [h.observed_name for h in firsts]


def _call_recorder(modules: Sequence[nn.Module]) -> tuple[Callable[..., None], list[str]] | None:
    """The position's grouped output recorder and names, when each module's only hook is a forward hook carrying it
    and each shares its quantized rows (its output is computed here, not by a call)."""
    if not all(_shares_quantized_rows(m) for m in modules):
        return None
    return _shared_recorder([m._forward_hooks for m in modules], RECORD_CALL_GROUPS)


def _recorded_at_once(modules: Sequence[nn.Module], x: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> bool:
    """Hand a position's calls to its modules' grouped recorder, when each module's only hook is that pre-hook
    (its calls then record nothing more): True when it took them, and the modules are to run unhooked."""
    found = None if any(m._forward_hooks for m in modules) else \
        _shared_recorder([m._forward_pre_hooks for m in modules], RECORD_ROW_GROUPS)
    if found is None:
        return False
    record, names = found
    kept = [(name, b) for name, b in zip(names, bounds, strict=True) if b[1] > b[0]]
    record([name for name, _ in kept], x, [b for _, b in kept])
    return True


def row_groups(bounds: Sequence[tuple[int, int]], rows: int, device: torch.device,
               dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Each of `rows` rows' group (`bounds`, in order, not overlapping), len(bounds) for a row of none: [rows] of
    `dtype`, made on the device from the host's bounds without waiting for it."""
    ids, lengths, at = [], [], 0
    for g, (start, end) in enumerate(bounds):
        if start > at:
            ids.append(len(bounds))
            lengths.append(start - at)
        ids.append(g)
        lengths.append(end - start)
        at = end
    if at < rows:
        ids.append(len(bounds))
        lengths.append(rows - at)
    table = host_values([*ids, *lengths], device)
    return torch.repeat_interleave(table[:len(ids)].to(dtype), table[len(ids):],
                                   output_size=rows)  # its size said: no wait for the device


def _buffers_products(x: torch.Tensor) -> bool:
    """Whether grouped products of x's rows go into one buffer per reader position: on accelerators, where each
    launch costs; the CPU computes each group's product and its cast while they are in cache."""
    return x.device.type != "cpu"


def _one_product_buffer(modules: Sequence[nn.Module]) -> bool:
    """Per-channel QuantLinears sharing quantized rows, of one activation type and output width: their products
    can share one buffer and one per-token scaling (`_products_in_one_buffer`, on accelerators)."""
    first = modules[0]
    return all(_shares_quantized_rows(m) and m.scheme.act == first.scheme.act and m.out_features == first.out_features
               and m.weight_scale.shape[-1] == 1 for m in modules)


def _one_float_buffer(modules: Sequence[nn.Module], x: torch.Tensor) -> bool:
    """Plain 16-bit linears without bias, of x's dtype and one output width, on CUDA: one grouped kernel can
    compute every group's product (`_float_products_in_one_buffer`)."""
    first = modules[0]
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and FLOAT_GROUPED_KERNEL.enabled and all(
        type(m) is nn.Linear and m.bias is None and m.weight.dtype == x.dtype and m.weight.is_contiguous()
        and m.out_features == first.out_features for m in modules)


# CUDA: a float expert position's GEMMs as one Triton kernel (ops/grouped_gemm.py), held to the GEMMs per group
# within their rounding; only where the runner's statistics recorded the position at once (the statistics pass,
# whose products feed statistics only: a plain or propagating forward keeps its GEMMs per group)
FLOAT_GROUPED_KERNEL = CheckedKernel("grouped experts' float GEMMs", "they run as one GEMM per expert from now on: "
                                     "more launches", logger)


def _float_products_in_one_buffer(modules: Sequence[nn.Module], x: torch.Tensor,
                                  bounds: Sequence[tuple[int, int]]) -> torch.Tensor | None:
    """Every group's x[rows] @ weight^T in one buffer of x's dtype, by one kernel (float32 sums in its own order);
    None where the kernel cannot run (the modules are then called group by group). Its first result in a process
    is held to the GEMMs per group: each element within one rounding of the output dtype plus the float32 sums'
    bound (in x 2^-23 sum_i |x_i w_i|)."""
    from msmodelslim.ops.grouped_gemm import grouped_gemm

    rows = x.contiguous()
    weights = [m.weight.detach() for m in modules]

    def within_rounding(found: torch.Tensor) -> str | None:
        for w, (start, end) in zip(weights, bounds, strict=True):
            reference = F.linear(rows[start:end], w).float()
            bound = reference.abs() * 2.0 ** -7 + \
                (rows[start:end].float().abs() @ w.float().abs().t()) * (rows.shape[1] * 2.0 ** -23)
            if not bool(((found[start:end].float() - reference).abs() <= bound).all()):
                return "gave other values than the GEMMs per group (beyond their rounding)"
        return None

    return FLOAT_GROUPED_KERNEL.run(lambda: grouped_gemm(rows, weights, bounds).to(x.dtype), within_rounding)


def _products_in_one_buffer(modules: Sequence[QuantLinear], quantized: tuple[torch.Tensor, torch.Tensor],
                            bounds: Sequence[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """Each module's `integer_product` of its rows, written into one buffer, as `dtype`: the int8 rows made float32
    once, each group's matmul into its rows, then the per-token scales over all rows at once and each module's
    weight scales over its rows: the same float32 operations in the same order as `_float_product` per group
    (rows x sx, then x the weight scale), two launches per group fewer. Where `int8_gemm_fits`, the int8 rows go
    into int8 GEMMs: on CUDA one Triton kernel for every group, sums and scales (`_checked_grouped_gemm`), else
    one GEMM per group into one int32 buffer and the scales after (`_int8_gemms`)."""
    qx, sx = quantized
    rows = qx.reshape(-1, qx.shape[-1])
    first = modules[0]
    if int8_gemm_fits(rows.device, first.in_features, first.out_features):
        if GROUPED_GEMM_KERNEL.enabled and rows.is_cuda:
            with not_on_npu("the grouped int8 GEMM as a Triton kernel on CUDA (and its check)"):
                found = _checked_grouped_gemm(modules, rows, sx.reshape(-1), bounds, dtype)
            if found is not None:
                return found
        return _int8_gemms(modules, rows, sx.reshape(-1), bounds, dtype)
    rows = rows.to(torch.float32)
    out = torch.empty(rows.shape[0], first.out_features, dtype=torch.float32, device=rows.device)
    with tensor_core_fp32_matmuls(rows.device):
        for m, (start, end) in zip(modules, bounds, strict=True):
            torch.mm(rows[start:end], integer_weight(m.qweight, m.scheme.act.bits, m.scheme.weight.bits).t(),
                     out=out[start:end])
    return _scale_passes(out, sx.reshape(-1), modules, bounds, dtype)


def _int8_gemms(modules: Sequence[QuantLinear], rows: torch.Tensor, sx: torch.Tensor,
                bounds: Sequence[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """Each group's int8 GEMM into one int32 buffer, then the scales (`_scaled_sums`). A group of fewer rows than
    the GEMM takes multiplies the rows after it too, into the rows of the sums after its own: the next groups,
    computed after it, overwrite them, and the last group's spill lands in INT8_GEMM_MIN_ROWS rows of padding (no
    zero-padded copy per small group: one launch per group)."""
    total, pad = rows.shape[0], INT8_GEMM_MIN_ROWS
    padded = torch.empty(total + pad, rows.shape[1], dtype=rows.dtype, device=rows.device)
    padded[:total] = rows
    sums = torch.empty(total + pad, modules[0].out_features, dtype=torch.int32, device=rows.device)
    for m, (start, end) in zip(modules, bounds, strict=True):
        if end > start:
            stop = max(end, start + pad)
            _int8_gemm(padded[start:stop], m.qweight, out=sums[start:stop])
    return _scaled_sums(sums[:total], sx, modules, bounds, dtype)


# CUDA: the grouped experts' int8 GEMMs and their scales as one Triton kernel (ops/grouped_gemm.py), held to the
# GEMMs per group and their scales
GROUPED_GEMM_KERNEL = CheckedKernel("grouped experts' int8 GEMMs", "they run as one GEMM per expert from now on: "
                                    "the same values, more launches", logger)


def _checked_grouped_gemm(modules: Sequence[QuantLinear], rows: torch.Tensor, sx: torch.Tensor,
                          bounds: Sequence[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor | None:
    """ops/grouped_gemm.py's products as `dtype`, bit-identical to `_int8_gemms`: its first result in a process is
    held to theirs; None when the kernel cannot be built or differs (the GEMMs per group from then on, said once)."""
    from msmodelslim.ops.grouped_gemm import grouped_int8_gemm

    return GROUPED_GEMM_KERNEL.run(
        lambda: grouped_int8_gemm(rows, sx, [m.qweight for m in modules], [m.weight_scale for m in modules],
                                  bounds).to(dtype),
        lambda found: None if torch.equal(found, _int8_gemms(modules, rows, sx, bounds, dtype))
        else "gave other values than the GEMMs per group")


def _scale_passes(out: torch.Tensor, sx: torch.Tensor, modules: Sequence[QuantLinear],
                  bounds: Sequence[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """float32 products `out` (modified) times each row's token scale, then times its module's weight scales, as
    `dtype`."""
    out.mul_(sx.reshape(-1, 1))
    for m, (start, end) in zip(modules, bounds, strict=True):
        out[start:end].mul_(m.weight_scale.t())
    return out.to(dtype)


# CUDA: the grouped int8 GEMMs' scales as one Triton kernel (ops/group_scales.py), held to the passes
GROUP_SCALES_KERNEL = CheckedKernel("grouped experts' scales", "they are scaled in passes from now on: the same "
                                    "values, more launches", logger)


def _scaled_sums(sums: torch.Tensor, sx: torch.Tensor, modules: Sequence[QuantLinear],
                 bounds: Sequence[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """The int32 sums [rows, out] of the groups' int8 GEMMs, scaled as `_scale_passes` scales them; on CUDA by one
    kernel for every group (`_checked_group_scales`)."""
    if GROUP_SCALES_KERNEL.enabled and sums.is_cuda:
        with not_on_npu("the grouped scales as a Triton kernel on CUDA (and its check); an NPU multiplies in passes"):
            found = _checked_group_scales(sums, sx, modules, bounds, dtype)
        if found is not None:
            return found
    return _scale_passes(sums.to(torch.float32), sx, modules, bounds, dtype)


def _checked_group_scales(sums: torch.Tensor, sx: torch.Tensor, modules: Sequence[QuantLinear],
                          bounds: Sequence[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor | None:
    """`_kernel_scaled_sums` as `dtype`, bit-identical to the passes: its first result in a process is held to
    theirs; None when the kernel cannot be built or differs (the passes scale from then on, said once)."""
    return GROUP_SCALES_KERNEL.run(
        lambda: _kernel_scaled_sums(sums, sx, modules, bounds).to(dtype),
        lambda found: None if torch.equal(found, _scale_passes(sums.to(torch.float32), sx, modules, bounds, dtype))
        else "gave other values than the passes")


def _kernel_scaled_sums(sums: torch.Tensor, sx: torch.Tensor, modules: Sequence[QuantLinear],
                        bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """`_scale_passes`'s float32 values by ops/group_scales.py: each row's module from a table (its group's index,
    repeated over its rows), the modules' weight scales stacked: 3 small launches and the kernel's, for any number of
    groups."""
    from msmodelslim.ops.group_scales import group_scales

    groups = row_groups(bounds, sums.shape[0], sums.device, torch.int32)
    weight_scales = torch.cat([m.weight_scale.reshape(1, -1) for m in modules])
    return group_scales(sums, sx, weight_scales, groups)
