"""MX quantizers (quant/mx.py) against independent references.

References:
- a float64 brute force of the OCP MX v1.0 rules written here: the element grid enumerated from its definition,
  the nearest grid value by exhaustive search (ties to the even code, or away from zero), the shared exponent from
  math.frexp; tolerance none (bitwise equality of float32 results);
- torch's own float8_e4m3fn cast (round to nearest even) for E4M3 elements and bit patterns; tolerance none;
- compressed-tensors 0.20's MXFP4 compressor for MXFP4 weights (formats/mxfp4_ct_reference.py); bytes equal.
"""

from __future__ import annotations

import math

import pytest
import torch
from formats.mxfp4_ct_reference import ct_encode

from msmodelslim.core import ascend_check
from msmodelslim.quant.mx import (
    MXFP4,
    MXFP8,
    decode_weight,
    dequantize_blocks,
    element_codes,
    element_values,
    fake_quant_mx,
    grid_exponents,
    quantize_blocks,
    quantize_mx_weight,
    round_to_elements,
    shared_exponents,
)

FORMATS = [MXFP4, MXFP8]


def reference_grid(fmt) -> list[float]:
    """Non-negative values of the element format from its definition (subnormals, normals up to max_norm)."""
    step = 2.0 ** -fmt.mbits
    values = {m * step * 2.0 ** fmt.emin for m in range(1 << fmt.mbits)}
    for e in range(fmt.emin, fmt.emax + 1):
        values |= {(1 + m * step) * 2.0 ** e for m in range(1 << fmt.mbits)}
    return sorted(v for v in values if v <= fmt.max_norm)


def reference_round(x: float, grid: list[float], rounding: str = "rint") -> float:
    a = min(abs(x), grid[-1])
    best = min(range(len(grid)), key=lambda i: abs(grid[i] - a))
    ties = [i for i in range(len(grid)) if abs(grid[i] - a) == abs(grid[best] - a)]
    if len(ties) > 1:
        best = max(ties) if rounding == "round" else next(i for i in ties if i % 2 == 0)  # code = index
    return math.copysign(grid[best], x) if x < 0 else grid[best]


def reference_exponent(amax: float, emax: int) -> int:
    if amax == 0:
        return -127
    return max(-127, min(127, math.frexp(amax)[1] - 1 - emax))


def probe_values(fmt, n: int = 3000) -> torch.Tensor:
    """Random values across the format's range plus every grid point and every midpoint (the ties), signed."""
    grid = torch.tensor(reference_grid(fmt), dtype=torch.float64)
    mids = (grid[1:] + grid[:-1]) / 2
    rand = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(fmt.emin - fmt.mbits - 2, fmt.emax + 2))
    values = torch.cat([grid, mids, rand, torch.tensor([fmt.max_norm * 1.2, 1e30])]).to(torch.float32)
    return torch.cat([values, -values])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rounding", ["rint", "round"])
def test_elements_round_to_the_nearest_grid_value_as_the_float64_brute_force(fmt, rounding):
    torch.manual_seed(0)
    values = probe_values(fmt)
    grid = reference_grid(fmt)
    expected = torch.tensor([reference_round(float(v), grid, rounding) for v in values], dtype=torch.float32)
    assert torch.equal(round_to_elements(values, fmt, rounding), expected)


def test_e4m3_elements_and_codes_equal_torch_float8_e4m3fn():
    torch.manual_seed(1)
    values = probe_values(MXFP8)
    ours = round_to_elements(values, MXFP8)
    assert torch.equal(ours, values.clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32))
    assert torch.equal(element_codes(ours, MXFP8), ours.to(torch.float8_e4m3fn).view(torch.uint8))
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # all but the NaNs
    assert torch.equal(element_values(codes, MXFP8), codes.view(torch.float8_e4m3fn).to(torch.float32))


def test_e2m1_codes_are_sign_then_exponent_then_mantissa():
    codes = torch.arange(16, dtype=torch.uint8)
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert element_values(codes, MXFP4).tolist() == expected
    assert torch.equal(element_codes(element_values(codes, MXFP4), MXFP4), codes)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_shared_exponent_is_the_ocp_floor_rule(fmt):
    torch.manual_seed(2)
    amax = torch.cat([torch.exp2(torch.empty(2000).uniform_(-140, 127.9)), torch.exp2(torch.arange(-130.0, 128.0)),
                      torch.tensor([0.0, 1.75, 1.7499999, 3.0])])
    expected = torch.tensor([reference_exponent(float(a), fmt.emax) for a in amax], dtype=torch.int32)
    assert torch.equal(shared_exponents(amax, fmt), expected)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rounding", ["rint", "round"])
def test_activation_fake_quant_equals_the_blockwise_reference(fmt, rounding):
    torch.manual_seed(3)
    x = torch.randn(3, 80) * torch.exp2(torch.randint(-6, 6, (3, 1)).float())  # 80: a padded last block
    x[0, :32] = 0.0  # an all-zero block
    grid = reference_grid(fmt)
    expected = torch.empty_like(x, dtype=torch.float64)
    for r in range(x.shape[0]):
        for b0 in range(0, x.shape[1], 32):
            block = x[r, b0:b0 + 32].double()
            e = reference_exponent(float(block.abs().max()), fmt.emax)
            for j, v in enumerate(block.tolist()):
                expected[r, b0 + j] = reference_round(v / 2.0 ** e, grid, rounding) * 2.0 ** e
    assert torch.equal(fake_quant_mx(x, fmt, rounding), expected.to(torch.float32))


def test_mxfp4_minmax_weights_are_the_bytes_compressed_tensors_writes():
    torch.manual_seed(4)
    w = (torch.randn(64, 256) * torch.exp2(torch.randint(-8, 3, (64, 1)).float())).to(torch.bfloat16)
    w[0, :32] = 0.0
    w[1, :32] = torch.linspace(-1.75, 1.75, 32).to(torch.bfloat16)  # a maximum on the round-up boundary
    w[2, :32] = torch.linspace(-1.74, 1.74, 32).to(torch.bfloat16)
    packed, scale = quantize_mx_weight(w, MXFP4)
    ct_packed, ct_scale = ct_encode(w)
    assert torch.equal(scale, ct_scale)
    assert torch.equal(packed, ct_packed)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_stored_weights_decode_to_the_quantized_values(fmt):
    torch.manual_seed(5)
    w = torch.randn(16, 128)
    stored, scale = quantize_mx_weight(w, fmt)
    elements, e = quantize_blocks(w, fmt, round_up=fmt.bits == 4)
    assert stored.shape == (16, 128 // (2 if fmt.bits == 4 else 1)) and scale.shape == (16, 4)
    assert stored.dtype == scale.dtype == torch.uint8
    assert torch.equal(decode_weight(stored, scale, fmt), dequantize_blocks(elements, e))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_grid_exponents_are_never_worse_than_minmax_per_block_and_better_overall(fmt):
    torch.manual_seed(6)
    w = torch.randn(64, 256) * (1 + 4 * (torch.rand(64, 256) > 0.99))  # rare outliers: clipping can pay
    imp = torch.rand(256) + 0.1

    def block_error(method):
        stored, scale = quantize_mx_weight(w, fmt, method, importance=imp if method == "grid" else None)
        return ((decode_weight(stored, scale, fmt) - w).square() * imp).reshape(64, 8, 32).sum(-1)

    minmax, grid = block_error("minmax"), block_error("grid")
    assert bool((grid <= minmax).all())
    assert float(grid.sum()) < float(minmax.sum())
    assert grid_exponents(w, fmt).shape == (64, 8)


def test_mx_math_uses_no_op_or_dtype_an_atlas_a2_a3_refuses():
    # reference: the A2/A3 rule table (core/ascend_a2a3_rules.json): no float8 dtype, every op with an NPU kernel
    torch.manual_seed(7)
    w, x = torch.randn(8, 64), torch.randn(4, 64).to(torch.bfloat16)
    ascend_check.start(torch.device("cpu"))
    try:
        with ascend_check.watching():
            for fmt in FORMATS:
                stored, scale = quantize_mx_weight(w, fmt, "grid")
                decode_weight(stored, scale, fmt)
                fake_quant_mx(x, fmt)
    finally:
        ascend_check.stop()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_mx_gptq_lowers_the_output_error_of_its_fixed_exponents(fmt):
    # reference: tr(dW H dW^T) in float64 with H = X^T X, against round-to-nearest with the same exponents; the
    # stored elements decode exactly to values of the format (decode(encode) equals the dequantised weight)
    from msmodelslim.quant.modules import quantize_weight

    torch.manual_seed(8)
    x = torch.randn(1024, 128) @ torch.randn(128, 128) * 0.2
    w = torch.randn(24, 128)
    h = x.t() @ x
    stored, scale = quantize_weight(w, fmt, "gptq", hessian=h, tokens=1024)
    exponents = scale.to(torch.int32) - 127
    rtn = dequantize_blocks(quantize_blocks(w, fmt, exponents)[0], exponents)

    def err(wq):
        d = wq.double() - w.double()
        return float(torch.einsum("oi,ij,oj->", d, h.double(), d))

    assert torch.equal(grid_exponents(w, fmt, torch.diagonal(h)), exponents)
    assert err(decode_weight(stored, scale, fmt)) < 0.85 * err(rtn)
