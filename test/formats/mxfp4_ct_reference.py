"""compressed-tensors 0.20 as the independent MXFP4 reference for the tests in this folder."""

from __future__ import annotations

import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams

MXFP4_ARGS = QuantizationArgs(
    num_bits=4,
    type="float",
    strategy="group",
    symmetric=True,
    group_size=32,
    scale_dtype=torch.uint8,
    zp_dtype=torch.uint8,
)
MXFP4_SCHEME = QuantizationScheme(targets=["Linear"], weights=MXFP4_ARGS)


def ct_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max observer qparams + MXFP4PackedCompressor.compress, as llm-compressor produces them."""
    groups = weight.unflatten(-1, (-1, 32))
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), MXFP4_ARGS)
    out = MXFP4PackedCompressor.compress(
        {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, MXFP4_SCHEME
    )
    return out["weight_packed"], out["weight_scale"]


def ct_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4PackedCompressor.decompress: bf16 [out, in]."""
    return MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, MXFP4_SCHEME)["weight"]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (distinguishes -0.0 from 0.0, compares inf exactly)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))
