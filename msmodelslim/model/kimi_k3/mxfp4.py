"""Kimi-K3's MXFP4 weights to BF16 (msModelSlim's ``convert_mxfp4_to_bf16``), delegating to ``source``."""

from __future__ import annotations

import torch

from msmodelslim.source.mxfp4 import decode_mxfp4
from msmodelslim.source.quant_scheme import mxfp4_exponent_bias

__all__ = ["convert_mxfp4_to_bf16"]


def convert_mxfp4_to_bf16(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    scheme_version: str | None = None,
    device: torch.device | str | None = None,
    name: str = "weight",
) -> torch.Tensor:
    """Dequantize one compressed-tensors MXFP4 linear weight to BF16 [out, in].

    Args:
        weight_packed: uint8 [out, in/2], two E2M1 codes per byte (element 2j in the low nibble).
        weight_scale: uint8 [out, in/32], E8M0 exponents (255 = NaN is rejected).
        scheme_version: ``quantization_config.version`` of the checkpoint. ``"0.13.x"`` selects exponent
            bias 125 (compressed-tensors 0.13 stored exponents 2 too low); anything else, or ``None``, 127.
        device: where to decode (the raw bytes are moved there first); default: ``weight_packed.device``.
        name: checkpoint key used in error messages.

    Returns:
        The exact BF16 weight ``E2M1(code) * 2**(e - bias)`` on ``device``.
    """
    if device is not None:
        weight_packed = weight_packed.to(device)
        weight_scale = weight_scale.to(device)
    return decode_mxfp4(
        weight_packed, weight_scale, dtype=torch.bfloat16, exponent_bias=mxfp4_exponent_bias(scheme_version), name=name
    )
