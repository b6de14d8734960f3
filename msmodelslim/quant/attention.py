"""Quantized attention inputs (FA3): the placeholders the adapter puts into an attention, and what replaces them.

An attention's FA3 points are `fa_q`, `fa_k`, `fa_v`: submodules that see a tensor [batch, heads, seq, dim] (the
query, the key cache, the value side; in an absorbed MLA the key and value side is the one latent cache, heads = 1).
- `FA3QuantPlaceHolder` is the identity; it carries the share of values the calibration window keeps (`ratio`).
- `AttentionFakeQuant` quantizes and dequantizes its input as the attention kernel will:
    per_head  static: one scale per head from calibration, x -> clamp(round(x / s), -128, 127) * s (int8) or
              x -> e4m3(x / s) * s (fp8, |x / s| <= 448: rounded to the E4M3 grid in float32, quant/mx.py, with no
              fp8 dtype, so an Atlas A2/A3 can calibrate the fp8 cache of an Ascend 950 practice);
    per_token dynamic: one scale per (token, head) over the head dim, max|x| / bound, computed at run time.
  `observe_only` keeps the input as it is: the value side of an absorbed MLA is the same latent cache the key side
  already quantized, so its scale is written for the format but the kernel dequantizes V with K's scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from msmodelslim.quant.mx import MXFP8, round_to_elements

FA3_BRANCHES = ("fa_q", "fa_k", "fa_v")
FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
_EPS = torch.finfo(torch.float32).eps
_FP8_EPS = 1e-12

AttnDType = Literal["int8", "fp8_e4m3"]
AttnScope = Literal["per_head", "per_token"]


@dataclass(frozen=True)
class AttentionQuantSpec:
    dtype: AttnDType = "int8"
    scope: AttnScope = "per_head"

    @property
    def static(self) -> bool:
        return self.scope == "per_head"

    @property
    def bound(self) -> float:
        return INT8_MAX if self.dtype == "int8" else FP8_E4M3_MAX

    @property
    def floor(self) -> float:
        """The smallest scale (msModelSlim's: float32 eps for int8, 1e-12 for fp8)."""
        return _EPS if self.dtype == "int8" else _FP8_EPS


def head_scales(low: torch.Tensor, high: torch.Tensor, spec: AttentionQuantSpec) -> torch.Tensor:
    """Symmetric per-head scales [heads] from each head's calibration range [low, high], as msModelSlim
    computes them (`ir/api/impl/int_quantization.py`, `fp_quantization.py`), rounded to bfloat16 values (float32
    [heads]): vllm-ascend holds them in the model dtype (kv_c8.py `create_weights`), so that is the scale the
    kernel uses, and msModelSlim's saved scales are bf16 values too."""
    amax = torch.maximum(low.float().neg().clamp(min=0), high.float().clamp(min=0))
    return (amax / spec.bound).clamp(min=spec.floor).to(torch.bfloat16).float()


def fake_quant(x: torch.Tensor, scale: torch.Tensor, dtype: AttnDType) -> torch.Tensor:
    """Quantize-dequantize x by `scale` (broadcast to x), in float32, returned in x's dtype."""
    xs = x.float() / scale
    if dtype == "int8":
        q = torch.round(xs).clamp_(-INT8_MAX - 1, INT8_MAX)  # the int8 range: a clipped outlier may reach -128
    else:
        q = round_to_elements(xs, MXFP8)  # E4M3, saturating at 448, ties to even: torch's fp8 cast, without fp8
    return (q * scale).to(x.dtype)


def token_scales(x: torch.Tensor, spec: AttentionQuantSpec) -> torch.Tensor:
    """Dynamic scales [..., 1]: max |x| over the last (head) dim of each (token, head) row."""
    return (x.float().abs().amax(dim=-1, keepdim=True) / spec.bound).clamp_(min=spec.floor)


class FA3QuantPlaceHolder(nn.Module):
    """The identity at an FA3 point, until fa3_quant replaces it. Set by the adapter, which knows the point:
    `heads` of its input, `ratio` (the share of each head's values the calibration range keeps: the narrowest
    window holding that share; 1.0 is min/max), `observe_only` (the kernel reads this input quantized elsewhere)."""

    def __init__(self, heads: int, ratio: float = 1.0, observe_only: bool = False) -> None:
        super().__init__()
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"FA3 placeholder ratio must be in (0, 1], got {ratio!r}")
        self.heads = int(heads)
        self.ratio = float(ratio)
        self.observe_only = observe_only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"heads={self.heads}, ratio={self.ratio}" + (", observe only" if self.observe_only else "")


class AttentionFakeQuant(nn.Module):
    """An FA3 point quantized: input [batch, heads, seq, dim]. `scale` [heads] (static) is a non-persistent buffer:
    the saver writes it as `<point>.scale` [heads, 1] with the format's offset, not as a model tensor."""

    def __init__(self, spec: AttentionQuantSpec, scale: torch.Tensor | None = None, observe_only: bool = False) -> None:
        super().__init__()
        if spec.static and scale is None:
            raise ValueError("a per_head attention quantizer needs its calibrated scales")
        self.spec = spec
        self.observe_only = observe_only
        self.register_buffer("scale", None if scale is None else scale.float().reshape(-1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.observe_only:
            return x
        if self.spec.static:
            if x.shape[1] != self.scale.numel():
                raise ValueError(f"attention quantizer has {self.scale.numel()} head scales, input has "
                                 f"{x.shape[1]} heads")
            return fake_quant(x, self.scale.to(x.device).view(1, -1, 1, 1), self.spec.dtype)
        return fake_quant(x, token_scales(x, self.spec), self.spec.dtype)

    def extra_repr(self) -> str:
        return f"{self.spec.dtype}, {self.spec.scope}" + (", observe only" if self.observe_only else "")


def install_quantizers(attention: nn.Module, points: dict[str, tuple[AttentionQuantSpec, torch.Tensor | None]]) -> None:
    """Replace the attention's placeholders named in `points` (branch -> (spec, per-head scales or None)) by
    their quantizers; a placeholder not named stays the identity."""
    for branch, (spec, scale) in points.items():
        holder = attention._modules.get(branch)
        if not isinstance(holder, FA3QuantPlaceHolder):
            raise ValueError(f"attention has no FA3 placeholder {branch!r}")
        if scale is not None and scale.numel() != holder.heads:
            raise ValueError(f"{branch}: {scale.numel()} head scales for an input of {holder.heads} heads")
        setattr(attention, branch, AttentionFakeQuant(spec, scale, observe_only=holder.observe_only))
