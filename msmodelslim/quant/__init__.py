"""Quantizer math (granularity, symmetric int4/int8, scale searches, GPTQ, int4 packing) and QuantLinear."""

from msmodelslim.quant.functional import (
    dequantize,
    fake_quant_per_token,
    minmax_scale,
    quantize_per_token,
    quantize_symmetric,
    quantize_with_scale,
    ssz_scale_search,
)
from msmodelslim.quant.granularity import PerChannel, PerToken, int4, int8, int_dtype
from msmodelslim.quant.modules import SCHEMES, QuantLinear, QuantScheme, get_scheme
from msmodelslim.quant.packing import pack_int4, unpack_int4

__all__ = [
    "SCHEMES", "PerChannel", "PerToken", "QuantLinear", "QuantScheme", "dequantize",
    "fake_quant_per_token", "get_scheme", "int4", "int8", "int_dtype", "minmax_scale", "pack_int4",
    "quantize_per_token", "quantize_symmetric", "quantize_with_scale", "ssz_scale_search", "unpack_int4",
]
