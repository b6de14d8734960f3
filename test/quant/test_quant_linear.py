"""QuantLinear: construction from nn.Linear and a forward equal to the explicit deployed math."""

import pytest
import torch
from torch import nn

from msmodelslim.quant import QuantLinear, dequantize, quantize_symmetric, ssz_scale_search
from msmodelslim.quant.functional import quantize_with_scale
from msmodelslim.quant.granularity import int4


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


def test_a_cpu_product_in_row_pieces_has_the_bytes_of_the_whole_product():
    """More rows than CPU_PIECE_ROWS (3D input, a short last piece): the output equals, bit for bit, the engine's
    formula over all rows at once, int32 GEMM -> float32 * sx * weight_scale -> bf16 (written out here)."""
    from msmodelslim.quant.functional import CPU_PIECE_ROWS, quantize_per_token

    torch.manual_seed(0)
    ql = QuantLinear.from_linear(nn.Linear(64, 48, bias=False), "W8A8_DYNAMIC", weight_method="minmax")
    x = torch.randn(3, CPU_PIECE_ROWS - 100, 64).bfloat16()  # 2,772 rows: pieces of 1,024, 1,024 and 724
    qx, sx = quantize_per_token(x, 8)
    whole = torch._int_mm(qx.reshape(-1, 64), ql.qweight.t()).to(torch.float32) * sx.reshape(-1, 1) \
        * ql.weight_scale.t()
    assert torch.equal(ql(x), whole.to(torch.bfloat16).view(3, -1, 48))


@pytest.mark.parametrize("scheme, inputs", [("W4A8_DYNAMIC", 4096), ("W8A8_DYNAMIC", 512), ("W8A8_DYNAMIC", 4096)],
                         ids=["W4A8 float32", "W8A8 narrow float32", "W8A8 wide float64"])
def test_the_cpu_float_product_of_integers_is_the_exact_integer_gemm(scheme, inputs):
    """The CPU multiplies the integers as floats (float64 where a sum can pass 2^24: W8A8 over 1,024 inputs).
    Reference: torch's int32 GEMM of the same integers, each row of one sign and near the end of its range, so the
    sums are as large as they get (W8A8 at 4,096 inputs: ~6e7, where float32 holds integers up to 1.7e7); tolerance
    none (the product before the scales, and the output, bit for bit)."""
    from msmodelslim.quant.modules import _integer_matmul, integer_weight

    def near_the_end(rows: int, top: int, g: torch.Generator) -> torch.Tensor:
        sign = torch.randint(0, 2, (rows, 1), generator=g) * 2 - 1
        return (sign * torch.randint(top - top // 4, top + 1, (rows, inputs), generator=g)).to(torch.int8)

    g = torch.Generator().manual_seed(5)
    ql = QuantLinear.from_linear(nn.Linear(inputs, 32, bias=False), scheme, weight_method="minmax")
    ql.qweight.copy_(near_the_end(32, 7 if scheme.startswith("W4") else 127, g))
    qx = near_the_end(64, 127, g)
    exact = torch._int_mm(qx, ql.qweight.t()).to(torch.float32)
    product = _integer_matmul(qx, integer_weight(ql.qweight, 8, ql.scheme.weight.bits))
    assert torch.equal(product, exact)
    sx = torch.rand(64, 1, generator=g) + 0.5
    assert torch.equal(ql.integer_product(qx, sx), exact * sx * ql.weight_scale.t())


@pytest.mark.parametrize("scheme, inputs, rows", [("W4A8_DYNAMIC", 4096, 64), ("W8A8_DYNAMIC", 4096, 64),
                                                   ("W8A8_DYNAMIC", 512, 5), ("W8A8_DYNAMIC", 512, 0)],
                         ids=["W4A8", "W8A8 wide", "5 rows padded", "no rows"])
def test_the_int8_gemm_gives_the_cpus_exact_products(monkeypatch, scheme, inputs, rows):
    """On CUDA a per-channel integer product is an int8 GEMM with int32 sums (`torch._int_mm`, run here on the CPU's
    tensors): fewer than 17 rows are padded with zero rows. Reference: the CPU's exact float product of the same
    integers (float64 for wide W8A8 rows, whose sums pass 2^24 where TF32 would round), with the same per-token and
    weight scales; tolerance none (the output, bit for bit)."""
    from msmodelslim.quant import modules

    g = torch.Generator().manual_seed(6)
    ql = QuantLinear.from_linear(nn.Linear(inputs, 32, bias=False), scheme, weight_method="minmax")
    top = 7 if scheme.startswith("W4") else 127
    ql.qweight.copy_(torch.randint(top - 2, top + 1, (32, inputs), generator=g).to(torch.int8))  # large sums
    qx = torch.randint(120, 128, (rows, inputs), generator=g).to(torch.int8)
    sx = torch.rand(rows, 1, generator=g) + 0.5
    exact = ql.integer_product(qx, sx, torch.bfloat16)
    gemms = []
    monkeypatch.setattr(modules, "int8_gemm_fits", lambda _device, i, o: i % 8 == 0 and o % 8 == 0)
    monkeypatch.setattr(modules, "_int8_gemm", lambda *a, _f=modules._int8_gemm, **k: gemms.append(1) or _f(*a, **k))
    assert torch.equal(ql.integer_product(qx, sx, torch.bfloat16), exact)
    assert gemms, "the int8 GEMM was not taken"


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


def test_per_group_int4_scales_are_fp16_values_and_beat_per_channel():
    # reference: float64 weight error of the dequantised weight; scales must survive fp16 (the MoE kernel's dtype)
    from msmodelslim.quant.modules import quantize_weight

    torch.manual_seed(3)
    w = torch.randn(32, 256) * torch.linspace(0.1, 3, 256)  # input channels of different scale
    q, s = quantize_weight(w, int4, "minmax", group_size=64)
    assert q.shape == (32, 256) and s.shape == (32, 4) and int(q.abs().max()) <= 8
    assert torch.equal(s, s.to(torch.float16).to(torch.float32))
    grouped = (q.double() * s.double().repeat_interleave(64, 1) - w.double()).square().sum()
    q1, s1 = quantize_weight(w, int4, "minmax")
    assert float(grouped) < 0.5 * float((q1.double() * s1.double() - w.double()).square().sum())


def test_per_group_gptq_lowers_the_output_error_of_its_fixed_scales():
    # reference: tr(dW H dW^T) in float64 with H = X^T X, GPTQ against round-to-nearest with the same group scales
    from msmodelslim.quant.modules import quantize_weight

    torch.manual_seed(4)
    x = torch.randn(512, 128) @ torch.randn(128, 128) * 0.3
    w = torch.randn(16, 128)
    h = x.t() @ x
    q, s = quantize_weight(w, int4, "gptq", hessian=h, tokens=512, group_size=32)
    per_col = s.repeat_interleave(32, 1)
    rtn = quantize_with_scale(w, per_col, int4)

    def err(qq):
        d = (qq.double() * per_col.double() - w.double())
        return float(torch.einsum("oi,ij,oj->", d, h.double(), d))

    assert err(q) < 0.8 * err(rtn)


@pytest.mark.parametrize("scheme", ["W4A16_MXFP4", "W4A8_MXFP", "W8A8_MXFP8", "W4A4_MXFP4"])
def test_mx_forward_is_the_block_quantized_input_times_the_decoded_weight(scheme):
    # reference: quant/mx.py's activation quantizer (tested against a float64 brute force) and decoder; exact
    from msmodelslim.quant.modules import get_scheme
    from msmodelslim.quant.mx import decode_weight, fake_quant_mx, quantize_mx_weight

    torch.manual_seed(5)
    sch = get_scheme(scheme)
    w, x = torch.randn(24, 64), torch.randn(5, 64).to(torch.bfloat16)
    stored, scale = quantize_mx_weight(w, sch.weight)
    layer = QuantLinear(64, 24, sch, stored, scale, bias=torch.ones(24))
    xq = x if sch.act is None else fake_quant_mx(x, sch.act, sch.act_rounding)
    expected = torch.nn.functional.linear(xq, decode_weight(stored, scale, sch.weight, torch.bfloat16)) + 1
    assert torch.equal(layer(x), expected)


def test_w4a16_mxfp4_of_compressed_tensors_bytes_computes_with_its_decoded_weight():
    # reference: compressed-tensors' own MXFP4 encoder and decoder (formats/mxfp4_ct_reference.py); exact in fp32
    from formats.mxfp4_ct_reference import ct_decode, ct_encode

    torch.manual_seed(6)
    w = torch.randn(16, 96).to(torch.bfloat16)
    packed, scale = ct_encode(w)
    layer = QuantLinear(96, 16, "W4A16_MXFP4", packed, scale, compute_dtype=torch.float32)
    x = torch.randn(3, 96)
    assert torch.equal(layer(x), x @ ct_decode(packed, scale).float().t())


def test_per_group_forward_sums_token_quantized_inputs_times_group_dequantised_weights():
    from msmodelslim.quant.functional import quantize_per_token
    from msmodelslim.quant.modules import quantize_weight

    torch.manual_seed(7)
    w, x = torch.randn(8, 128), torch.randn(4, 128)
    q, s = quantize_weight(w, int4, "minmax", group_size=32)
    layer = QuantLinear(128, 8, "W4A8_DYNAMIC", q, s, compute_dtype=torch.float32)
    assert layer.group_size == 32
    qx, sx = quantize_per_token(x, 8)
    expected = (qx.double() @ (q.double() * s.double().repeat_interleave(32, 1)).t()) * sx.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-6, atol=1e-6)  # float32 sums
