"""MX (OCP Microscaling) quantization: FP4 E2M1 and FP8 E4M3 elements sharing one E8M0 exponent per block of 32.

A block of 32 consecutive values along the last dim (a weight row's input dim, an activation's features) is stored
as 32 elements of the format and one exponent e: value = element * 2^e. E8M0 stores e + 127 in a byte (0..254).

Shared exponent (OCP MX spec v1.0, section 6.3: e = floor(log2(max |x|)) - emax_elem, clamped to E8M0's range):
- activations: the spec's rule for every format, as the serving kernel computes it (CANN's aclnnDynamicMxQuant,
  scale_alg 0, which vllm-ascend's `npu_dynamic_mx_quant` calls: ops-nn `quant/dynamic_mx_quant/docs/
  aclnnDynamicMxQuant.md:31-49`), elements rounded half to even ("rint", its default) or half away from zero
  ("round", what vllm-ascend's W4A4_MXFP4 asks for), saturating;
- MXFP8 weights: the spec's rule too (msModelSlim 26.1.0 `ir/api/impl/mx_quantization.py` `calculate_mx_qparam`);
- MXFP4 weights: the block maximum rounded up to the next power of two when its mantissa is >= 1.75, i.e.
  floor(log2(amax * 8/7)) - 2 (msModelSlim's `calculate_mxfp4_qparam`; compressed-tensors' MXFP4 compressor does
  the same, so the weights of an unchanged checkpoint get its exponents back): a maximum that would saturate from
  7 or more to 6 takes the next exponent instead.
Weight elements are rounded half to even (compressed-tensors; msModelSlim rounds half away from zero, which differs
only on exact ties). All of it is float32 arithmetic on powers of two and integer bit operations, with no float8 or
float4 dtype: Atlas A2/A3 NPUs, which can calibrate a model for Ascend 950 too, have none (the kernels above run on
Ascend 950 only).

Storage (what vllm-ascend's MX schemes load, `methods/w4a8_mxfp4.py`, `w8a8_mxfp8.py`, `w4a16_mxfp4.py`):
- FP4 elements as 4-bit codes (bit 3 = sign, then 2 exponent and 1 mantissa bits), two per byte along the last dim,
  element 2j in the LOW nibble: uint8 [..., K/2] (compressed-tensors' and torch's float4_e2m1fn_x2 order);
- FP8 elements as their E4M3 bit patterns: uint8 [..., K] (viewed as float8_e4m3fn only when written);
- exponents as uint8 [..., K/32].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msmodelslim.core.placement import on_host
from msmodelslim.quant.functional import keep_better

BLOCK = 32
E8M0_BIAS = 127
_E_MIN, _E_MAX = -127, 127  # the unbiased exponents E8M0 holds (255 is NaN)


@dataclass(frozen=True)
class MXFormat:
    """An MX element format: `mbits` explicit mantissa bits, normal exponents [emin, emax], bias = 1 - emin."""

    name: str
    bits: int
    mbits: int
    emin: int
    emax: int
    max_norm: float

    @property
    def ebits(self) -> int:
        return self.bits - 1 - self.mbits


MXFP4 = MXFormat("mxfp4", bits=4, mbits=1, emin=0, emax=2, max_norm=6.0)
MXFP8 = MXFormat("mxfp8", bits=8, mbits=3, emin=-6, emax=8, max_norm=448.0)
ROUNDINGS = ("rint", "round")
MX_FORMATS: dict[str, MXFormat] = {f.name: f for f in (MXFP4, MXFP8)}


def mx_format(name: str) -> MXFormat:
    if name not in MX_FORMATS:
        raise ValueError(f"unknown MX format {name!r}; expected one of {sorted(MX_FORMATS)}")
    return MX_FORMATS[name]


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) as int32 for a > 0, exact: log2's float rounding near a power of two is corrected against
    the power itself (a 0 gives a large negative number; callers clamp)."""
    p = torch.floor(torch.log2(a)).clamp_(-200, 200)
    p = torch.where(torch.exp2(p) > a, p - 1, p)
    p = torch.where(torch.exp2(p + 1) <= a, p + 1, p)
    return p.to(torch.int32)


def shared_exponents(amax: torch.Tensor, fmt: MXFormat, round_up: bool = False) -> torch.Tensor:
    """Unbiased shared exponents (int32, in [-127, 127]) of blocks with maxima `amax` (float32 >= 0): the spec's
    rule, or with `round_up` the MXFP4 weight rule; an all-zero block gets -127 (E8M0 byte 0, as compressed-tensors
    writes it)."""
    amax = amax.to(torch.float32)
    p = _floor_log2(amax)
    if round_up:
        p = torch.where(amax >= torch.exp2(p.to(torch.float32)) * 1.75, p + 1, p)
    e = (p - fmt.emax).clamp_(_E_MIN, _E_MAX)
    return torch.where(amax > 0, e, torch.full_like(e, _E_MIN))


def round_to_elements(v: torch.Tensor, fmt: MXFormat, rounding: str = "rint") -> torch.Tensor:
    """The nearest value of the element format (float32; ties to the even mantissa with "rint", away from zero with
    "round"; saturating at max_norm). Below 2^emin the grid is the subnormal one: step 2^(emin - mbits)."""
    a = v.to(torch.float32).abs()
    p = _floor_log2(a.clamp(min=2.0 ** fmt.emin)).clamp_(fmt.emin, fmt.emax)
    step = torch.exp2((p - fmt.mbits).to(torch.float32))
    q = a / step
    q = torch.round(q) if rounding == "rint" else torch.floor(q.add_(0.5))
    q = q.mul_(step).clamp_(max=fmt.max_norm)
    return torch.where(v < 0, -q, q)  # a negative value rounded to zero keeps its sign; an exact -0.0 does not


def to_blocks(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., K/32, 32] (K padded with zeros to a multiple of 32)."""
    k = x.shape[-1]
    pad = -k % BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, BLOCK)


def _block_scale(e: torch.Tensor) -> torch.Tensor:
    return torch.exp2(e.to(torch.float32)).unsqueeze(-1)


def quantize_blocks(x: torch.Tensor, fmt: MXFormat, exponents: torch.Tensor | None = None, round_up: bool = False,
                    rounding: str = "rint") -> tuple[torch.Tensor, torch.Tensor]:
    """(element values float32 [..., K], unbiased exponents int32 [..., ceil(K/32)]) of x; min/max exponents
    (`shared_exponents`) unless `exponents` are given."""
    k = x.shape[-1]
    blocks = to_blocks(x.to(torch.float32))
    e = shared_exponents(blocks.abs().amax(dim=-1), fmt, round_up) if exponents is None else exponents
    elements = round_to_elements(blocks / _block_scale(e), fmt, rounding)
    return elements.reshape(*x.shape[:-1], -1)[..., :k], e


def dequantize_blocks(elements: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """element * 2^e per block of 32, float32 [..., K]."""
    k = elements.shape[-1]
    return (to_blocks(elements.to(torch.float32)) * _block_scale(exponents)).reshape(
        *elements.shape[:-1], -1)[..., :k]


def fake_quant_mx(x: torch.Tensor, fmt: MXFormat, rounding: str = "rint") -> torch.Tensor:
    """Dynamic MX quantization of an activation as the serving kernel does it (per block of 32 of the last dim, the
    spec's exponent), dequantised, in x's dtype."""
    if x.numel() == 0:
        return x
    elements, e = quantize_blocks(x, fmt, rounding=rounding)
    return dequantize_blocks(elements, e).to(x.dtype)


def grid_exponents(w: torch.Tensor, fmt: MXFormat, importance: torch.Tensor | None = None) -> torch.Tensor:
    """A clipping search: per block, the exponent of least squared error sum_j imp_j (w_j - q_j 2^e)^2 among the
    min/max exponent e0 and its neighbours e0 - 1 (clips the maximum, finer steps) and e0 + 1. `importance`
    [..., in] weights the input channels (diag(X^T X): a column's output error scales with it)."""
    blocks = to_blocks(w.to(torch.float32))
    imp = None if importance is None else \
        to_blocks(importance.to(blocks.device, torch.float32).clamp_min(0)).unsqueeze(-3)  # [..., 1, in/32, 32]

    def error(e: torch.Tensor) -> torch.Tensor:  # per block
        scale = _block_scale(e)
        err = (blocks - round_to_elements(blocks / scale, fmt) * scale).square_()
        return (err if imp is None else err.mul_(imp)).sum(dim=-1)

    e0 = shared_exponents(blocks.abs().amax(dim=-1), fmt, round_up=fmt.bits == 4)
    best_e, best_err = e0, error(e0)
    for shift in (-1, 1):
        e = (e0 + shift).clamp(_E_MIN, _E_MAX)
        best_e, best_err = keep_better(best_e, best_err, e, error(e))
    return best_e


# --- element codes --------------------------------------------------------------------------------------------
@on_host("the element-code table is built once in float64, where every value is exact")
def _code_values(fmt: MXFormat) -> torch.Tensor:
    """float32 [2^bits]: the value of every element code (sign bit first; E4M3's 0x7F / 0xFF NaN map to 0, never
    produced)."""
    codes = torch.arange(1 << fmt.bits)
    sign = torch.where(codes >> (fmt.bits - 1) == 1, -1.0, 1.0)
    biased = (codes >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mant = (codes & ((1 << fmt.mbits) - 1)).to(torch.float64)
    bias = 1 - fmt.emin
    normal = (1 + mant / (1 << fmt.mbits)) * torch.exp2((biased - bias).to(torch.float64))
    subnormal = mant / (1 << fmt.mbits) * 2.0 ** fmt.emin
    value = torch.where(biased > 0, normal, subnormal) * sign
    return torch.where(value.abs() > fmt.max_norm, 0.0, value).to(torch.float32)


def element_codes(values: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """uint8 codes of element values (exactly on the format's grid; -0.0 and +0.0 both give code 0 unless the
    value is negative zero from rounding a negative number, which keeps its sign bit as compressed-tensors does)."""
    v = values.to(torch.float32)
    a = v.abs()
    p = _floor_log2(a.clamp(min=2.0 ** fmt.emin)).clamp_(fmt.emin, fmt.emax)
    normal = a >= 2.0 ** fmt.emin
    biased = torch.where(normal, p - fmt.emin + 1, torch.zeros_like(p))
    unit = torch.exp2((torch.where(normal, p, torch.full_like(p, fmt.emin)) - fmt.mbits).to(torch.float32))
    mant = torch.round(a / unit).to(torch.int32) - torch.where(normal, 1 << fmt.mbits, 0)
    sign = torch.signbit(v).to(torch.int32) << (fmt.bits - 1)
    return (sign | (biased << fmt.mbits) | mant).to(torch.uint8)


_tables: dict[tuple[str, str], torch.Tensor] = {}


def element_values(codes: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """float32 values of uint8 element codes (a table lookup)."""
    key = (fmt.name, str(codes.device))
    if key not in _tables:
        _tables[key] = _code_values(fmt).to(codes.device)
    return _tables[key][codes.to(torch.int64)]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit codes [..., K] -> bytes [..., K/2], element 2j in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_fp4`."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


# --- weights ----------------------------------------------------------------------------------------------------
MX_WEIGHT_METHODS = ("minmax", "grid", "gptq")


def encode_weight(elements: torch.Tensor, exponents: torch.Tensor, fmt: MXFormat
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored elements: packed FP4 codes uint8 [out, in/2] or E4M3 bits uint8 [out, in], E8M0 uint8 [out, in/32])."""
    codes = element_codes(elements, fmt)
    stored = pack_fp4(codes) if fmt.bits == 4 else codes
    return stored.contiguous(), (exponents + E8M0_BIAS).to(torch.uint8).contiguous()


def decode_weight(stored: torch.Tensor, scale: torch.Tensor, fmt: MXFormat, dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """The dequantised weight [out, in] of stored elements and E8M0 scales (exact in float32)."""
    codes = unpack_fp4(stored) if fmt.bits == 4 else stored
    exponents = scale.to(torch.int32) - E8M0_BIAS
    return dequantize_blocks(element_values(codes, fmt), exponents).to(dtype)


def quantize_mx_weight(w: torch.Tensor, fmt: MXFormat, method: str = "minmax",
                       importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MX weight quantization of w [..., out, in] (in % 32 == 0): (stored elements, E8M0 scales) as
    `encode_weight`. `minmax`: the weight exponent rule of the format (module docstring); `grid`: the clipping
    search of `grid_exponents`, weighted by `importance` [..., in] when given."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MX weights need in_features divisible by {BLOCK}, got {w.shape[-1]}")
    if method == "minmax":
        exponents = None
    elif method == "grid":
        exponents = grid_exponents(w, fmt, importance)
    else:
        raise ValueError(f"unknown MX weight method {method!r}; expected one of {list(MX_WEIGHT_METHODS)}")
    elements, e = quantize_blocks(w, fmt, exponents, round_up=fmt.bits == 4)
    return encode_weight(elements, e, fmt)
