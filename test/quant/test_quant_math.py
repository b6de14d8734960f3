"""Quantizer math against float64 formulas written out in the tests."""

import pytest
import torch

from msmodelslim.quant import (
    PerChannel,
    dequantize,
    fake_quant_per_token,
    pack_int4,
    quantize_symmetric,
    quantize_with_scale,
    ssz_scale_search,
    unpack_int4,
)
from msmodelslim.quant.functional import quant_mse


@pytest.mark.parametrize("bits,qmax", [(8, 127), (4, 7)])
def test_per_channel_minmax_matches_float64_formula(bits, qmax):
    """Reference: scale = max|w_row| / qmax, q = clamp(round(w / scale)), all in float64; exact equality."""
    torch.manual_seed(0)
    w = torch.randn(16, 64, dtype=torch.float64)
    q, scale = quantize_symmetric(w, bits, PerChannel())
    ref_scale = w.abs().amax(dim=1, keepdim=True) / qmax
    ref_q = torch.clamp(torch.round(w / ref_scale), -qmax - 1, qmax)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (16, 1)
    torch.testing.assert_close(scale, ref_scale.float(), rtol=0, atol=0)
    assert torch.equal(q.long(), ref_q.long())


@pytest.mark.parametrize("bits", [4, 8])
def test_round_trip_error_is_at_most_half_a_step(bits):
    """|w - dequant(quant(w))| <= scale / 2 per element (min/max scales never clip); float64 reference."""
    torch.manual_seed(1)
    w = torch.randn(32, 128) * torch.linspace(0.01, 3, 32)[:, None]
    q, scale = quantize_symmetric(w, bits, PerChannel())
    err = (w.double() - dequantize(q, scale, dtype=torch.float64)).abs()
    assert bool((err <= scale.double() / 2 * (1 + 1e-6)).all())


def test_zero_rows_get_unit_scale_and_zero_integers():
    w = torch.zeros(3, 8)
    w[1] = torch.arange(8) - 4.0
    q, s = quantize_symmetric(w, 8)
    assert float(s[0]) == 1.0 and int(q[0].abs().sum()) == 0


def test_fake_quant_per_token_is_really_per_row():
    """Each row [..., d] gets its own scale max|row| / 127; scaling one token must not change the others."""
    torch.manual_seed(2)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    y = fake_quant_per_token(x, 8)
    ref_s = x.abs().amax(-1, keepdim=True) / 127
    ref = torch.clamp(torch.round(x / ref_s), -128, 127) * ref_s
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    x2 = x.clone()
    x2[0, 0] *= 1000.0  # a per-tensor (all-dims) reduction would coarsen every other token
    y2 = fake_quant_per_token(x2, 8)
    torch.testing.assert_close(y2[0, 1:], y[0, 1:], rtol=0, atol=0)
    torch.testing.assert_close(y2[1], y[1], rtol=0, atol=0)
    assert y.dtype == x.dtype


def test_fake_quant_per_token_keeps_bf16_dtype_and_int4_grid():
    x = torch.randn(7, 32).bfloat16()
    y = fake_quant_per_token(x, 4)
    assert y.dtype == torch.bfloat16
    steps = y.float() / (x.float().abs().amax(-1, keepdim=True) / 7)
    assert bool(((steps - steps.round()).abs() < 0.02).all()) and bool((steps.round().abs() <= 8).all())


@pytest.mark.parametrize("bits", [4, 8])
def test_ssz_mse_never_exceeds_minmax_per_row(bits):
    """Per-row float64 error of ssz scales <= that of min/max scales; ssz strictly better in total for int4."""
    torch.manual_seed(3)
    w = torch.randn(64, 256)
    w[::7] *= torch.rand(256) * 4  # a few heavy-tailed rows
    _, s_mm = quantize_symmetric(w, bits)
    s_ssz = ssz_scale_search(w, bits, iters=50)
    e_mm, e_ssz = quant_mse(w, s_mm, bits), quant_mse(w, s_ssz, bits)
    assert bool((e_ssz <= e_mm * (1 + 1e-9)).all())
    if bits == 4:
        assert float(e_ssz.sum()) < 0.9 * float(e_mm.sum())


def test_ssz_scale_is_least_squares_fixed_point():
    """At the returned scale s, re-rounding q and solving s' = <w,q>/<q,q> gives no lower error (float64)."""
    torch.manual_seed(4)
    w = torch.randn(8, 128, dtype=torch.float64)
    s = ssz_scale_search(w, 4, iters=200).double()
    q = quantize_with_scale(w, s, 4).double()
    s2 = (w * q).sum(-1, keepdim=True) / (q * q).sum(-1, keepdim=True)
    assert bool((quant_mse(w, s, 4) <= quant_mse(w, s2, 4) * (1 + 1e-9)).all())


def test_pack_unpack_round_trip_including_extremes():
    """unpack(pack(q)) == q for every int4 value incl. -8 and 7, along dim 0 (AscendV1) and dim -1."""
    vals = torch.arange(-8, 8, dtype=torch.int8)
    q = torch.stack([vals.roll(i) for i in range(16)])  # [16, 16], every pair of values appears
    for dim in (0, -1, 1):
        packed = pack_int4(q, dim=dim)
        assert packed.dtype == torch.int8
        assert packed.shape[dim] == q.shape[dim] // 2
        assert torch.equal(unpack_int4(packed, dim=dim), q)


def test_pack_layout_low_nibble_is_even_output_row():
    """Documented byte layout: packed[j, k] = (q[2j+1, k] << 4) | (q[2j, k] & 0xF), two's complement nibbles."""
    q = torch.tensor([[-8, 7, 1], [7, -1, -8]], dtype=torch.int8)  # [out=2, in=3]
    packed = pack_int4(q)
    assert packed.shape == (1, 3)
    expected = [((7 & 0xF) << 4) | (-8 & 0xF), ((-1 & 0xF) << 4) | (7 & 0xF), ((-8 & 0xF) << 4) | (1 & 0xF)]
    assert [int(b) & 0xFF for b in packed[0]] == expected


def test_pack_rejects_out_of_range_and_odd_sizes():
    with pytest.raises(ValueError, match="outside"):
        pack_int4(torch.tensor([[8], [0]], dtype=torch.int8))
    with pytest.raises(ValueError, match="odd"):
        pack_int4(torch.zeros(3, 2, dtype=torch.int8))


def test_quantizers_accept_parameters_that_require_grad():
    w = torch.nn.Parameter(torch.randn(4, 16))
    s = ssz_scale_search(w, 4)
    q, _ = quantize_symmetric(w, 4)
    assert s.shape == (4, 1) and not s.requires_grad and q.dtype == torch.int8
