"""QuantLinear: construction from nn.Linear and a forward equal to the explicit deployed math."""

import pytest
import torch
from torch import nn

from msmodelslim.quant import QuantLinear, dequantize, quantize_symmetric, ssz_scale_search
from msmodelslim.quant.functional import quantize_with_scale


def _reference_forward(x, qweight, wscale, act_bits, bias=None, rot=None):
    """Explicit float64 math: rotate, per-token quantise-dequantise x, x_dq @ W_dq^T + b."""
    xd = x.double()
    if rot is not None:
        xd = (x.float() @ rot.float().t()).to(x.dtype).double()
    qmax = 2 ** (act_bits - 1) - 1
    s = xd.abs().amax(-1, keepdim=True) / qmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    x_dq = torch.clamp(torch.round(xd / s), -qmax - 1, qmax) * s
    y = x_dq @ dequantize(qweight, wscale, dtype=torch.float64).t()
    if bias is not None:
        y = y + bias.double()
    return y


@pytest.mark.parametrize("scheme,wbits,abits", [("W8A8_DYNAMIC", 8, 8), ("W4A8_DYNAMIC", 4, 8),
                                                ("W4A4_DYNAMIC", 4, 4)])
def test_forward_equals_explicit_dequantised_math(scheme, wbits, abits):
    """Reference: float64 per-token quant-dequant of x times dequantised weights; tol 1e-4 relative (fp32 acc)."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=True)
    ql = QuantLinear.from_linear(lin, scheme, weight_method="minmax")
    q_ref, s_ref = quantize_symmetric(lin.weight.detach(), wbits)
    if wbits == 8:  # W8A8 scales are the bf16 value the engine holds (see the bf16 test below)
        s_ref = s_ref.to(torch.bfloat16).to(torch.float32)
        q_ref = quantize_with_scale(lin.weight.detach(), s_ref, wbits)
    assert torch.equal(ql.qweight, q_ref) and torch.equal(ql.weight_scale, s_ref)
    x = torch.randn(2, 9, 96)
    ref = _reference_forward(x, ql.qweight, ql.weight_scale, abits, lin.bias.detach())
    out = ql(x)
    assert out.dtype == x.dtype and out.shape == (2, 9, 40)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_ssz_weights_use_ssz_scales_and_stay_in_int4_range():
    torch.manual_seed(1)
    lin = nn.Linear(64, 16, bias=False)
    ql = QuantLinear.from_linear(lin, "W4A8_DYNAMIC", weight_method="ssz")
    s = ssz_scale_search(lin.weight.detach(), 4)
    assert torch.equal(ql.weight_scale, s)
    assert torch.equal(ql.qweight, quantize_with_scale(lin.weight.detach(), s, 4))
    assert int(ql.qweight.min()) >= -8 and int(ql.qweight.max()) <= 7
    assert ql.in_features == 64 and ql.out_features == 16 and ql.bias is None


def test_online_rotation_is_carried_over_and_applied_before_activation_quant():
    """A Linear with buffer online_rotation R: QuantLinear computes quant(x @ R^T) @ W_dq^T (float64 reference)."""
    torch.manual_seed(2)
    lin = nn.Linear(32, 8, bias=False)
    rot, _ = torch.linalg.qr(torch.randn(32, 32))
    lin.register_buffer("online_rotation", rot)
    ql = QuantLinear.from_linear(lin, "W8A8_DYNAMIC")
    assert torch.equal(ql.online_rotation, rot)
    x = torch.randn(5, 32)
    ref = _reference_forward(x, ql.qweight, ql.weight_scale, 8, rot=rot)
    torch.testing.assert_close(ql(x).double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_bf16_input_gives_bf16_output_close_to_float_linear():
    """W8A8 of a bf16 linear stays within 2% relative (max-norm) of the float output."""
    torch.manual_seed(3)
    lin = nn.Linear(128, 64).bfloat16()
    ql = QuantLinear.from_linear(lin, "W8A8_DYNAMIC")
    x = torch.randn(4, 128).bfloat16()
    with torch.no_grad():
        y, ref = ql(x), lin(x)
    assert y.dtype == torch.bfloat16 and ql.weight.dtype == torch.bfloat16
    assert float((y.float() - ref.float()).abs().max()) < 0.02 * float(ref.float().abs().max())


def test_empty_batch_and_bad_scheme():
    ql = QuantLinear.from_linear(nn.Linear(8, 4), "W8A8_DYNAMIC")
    assert ql(torch.zeros(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="W9A9"):
        QuantLinear.from_linear(nn.Linear(8, 4), "W9A9")
    with pytest.raises(ValueError, match="weight method"):
        QuantLinear.from_linear(nn.Linear(8, 4), "W8A8_DYNAMIC", weight_method="gptq")


@pytest.mark.parametrize("method", ["minmax", "ssz"])
def test_w8a8_weight_scales_are_exact_in_bf16_the_dtype_vllm_ascend_holds_them_in(method):
    # reference: vllm-ascend keeps W8A8_DYNAMIC weight_scale in the model dtype (bf16); the integers must be the
    # rounding of w at exactly that scale (tolerance: none, bitwise)
    from msmodelslim.quant.functional import quantize_with_scale
    from msmodelslim.quant.granularity import int8
    from msmodelslim.quant.modules import W8A8_DYNAMIC, quantize_weight

    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.logspace(-3, 1, 48)[:, None]
    q, s = quantize_weight(w, int8, method, scale_dtype=W8A8_DYNAMIC.engine_scale_dtype)
    assert s.dtype == torch.float32 and torch.equal(s.to(torch.bfloat16).to(torch.float32), s)
    assert torch.equal(q, quantize_with_scale(w, s, int8))
    linear = torch.nn.Linear(256, 48, bias=False)
    linear.weight.data.copy_(w)
    ql = QuantLinear.from_linear(linear, W8A8_DYNAMIC, weight_method=method)
    assert torch.equal(ql.weight_scale.to(torch.bfloat16).to(torch.float32), ql.weight_scale)


def test_w4a8_weight_scales_keep_full_fp32_precision():
    # vllm-ascend's W4A8_DYNAMIC MoE parameters are fp32: rounding them to bf16 would only lose accuracy
    from msmodelslim.quant.modules import W4A8_DYNAMIC

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 48, bias=False)
    ql = QuantLinear.from_linear(linear, W4A8_DYNAMIC, weight_method="minmax")
    assert not torch.equal(ql.weight_scale.to(torch.bfloat16).to(torch.float32), ql.weight_scale)
