"""msmodelslim.ops.kda (pure-PyTorch KDA) against float64 and fla references, with Kimi-magnitude gates.

References: a float64 recurrence (``naive_recurrent_kda_fp64``, the delta-rule loop in float64) and fla's own
``naive_recurrent_kda`` / ``naive_kda_gate`` (plain torch, import on CPU). Gates: A_log ~ log U(1, 16), raw gate
3*N(0,1) plus dt_bias N(0,1) -> per-step log-decay down to about -150 (64-step cumsums of thousands).
Tolerances (relative RMS error ||out - ref|| / ||ref||):
- fp32 chunked vs float64 recurrence: 1e-6 (measured ~1.2e-7, fp32 rounding: decays are products, not exp of a
  cumsum);
- fp32 recurrent vs float64 / fla naive: 1e-5;
- bf16 inputs vs fp32 reference: 0.005 (fla's own test tolerance);
- gradients of the fp32 chunked kernel vs float64 autograd through the recurrence: 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_recurrent_kda

from msmodelslim.core.device import tensor_core_fp32_matmuls
from msmodelslim.ops import kda
from msmodelslim.ops.kda import (
    chunk_kda,
    fused_kda_gate,
    fused_recurrent_kda,
    kda_gate,
    l2norm,
    naive_recurrent_kda_fp64,
)

FP32_CHUNK_TOL = 1e-6
FP32_RECURRENT_TOL = 1e-5
FLA_TOL = 0.005
GRAD_TOL = 1e-3


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def kimi_inputs(B=2, T=150, H=2, K=32, V=16, seed=0, HV=None):
    gen = torch.Generator().manual_seed(seed)
    HV = HV or H
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    A_log = torch.empty(HV).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.randn(HV * K, generator=gen)
    raw = 3 * torch.randn(B, T, HV, K, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return q, k, v, raw, A_log, dt_bias, beta, h0


def test_gates_reach_kimi_magnitudes():
    q, k, v, raw, A_log, dt_bias, beta, h0 = kimi_inputs()
    g = kda_gate(raw, A_log, dt_bias)
    assert g.min() < -100 and g.max() <= 0
    assert g.cumsum(1)[:, :64].min() < -2000  # a chunk's cumsum would overflow exp(-Gamma) in fp32


@pytest.mark.parametrize("T", [1, 63, 150, 200])
@pytest.mark.parametrize("chunk_size", [None, 2, 64])  # None: the device default (16 on CPU, 64 on accelerators)
def test_chunk_matches_float64_recurrence(T, chunk_size):
    q, k, v, raw, A_log, dt_bias, beta, h0 = kimi_inputs(T=T)
    g = kda_gate(raw, A_log, dt_bias)
    ref_o, ref_s = naive_recurrent_kda_fp64(l2norm(q), l2norm(k), v, g, beta, initial_state=h0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                     chunk_size=chunk_size)
    assert o.dtype == torch.float32 and s.dtype == torch.float32 and s.shape == h0.shape
    assert rel(o, ref_o) < FP32_CHUNK_TOL
    assert rel(s, ref_s) < FP32_CHUNK_TOL


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_stays_accurate_with_correlated_keys_and_slow_decay(chunk_size):
    """Nearly parallel keys, decay ~1 and beta ~1 make (I + beta Akk) badly conditioned: its inverse must be formed
    stably (a Neumann product of powers of Akk measured 1.4e-5 at C=16 and 1e24 at C=64 here; measured now ~1e-6)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 256, 2, 32, 16
    k = torch.randn(1, 1, H, K, generator=gen) + 0.05 * torch.randn(B, T, H, K, generator=gen)
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    g = -0.01 * torch.rand(B, T, H, K, generator=gen)
    beta = 0.5 + 0.5 * torch.rand(B, T, H, generator=gen)
    ref_o, ref_s = naive_recurrent_kda_fp64(l2norm(q), l2norm(k), v, g, beta)
    o, s = chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    assert rel(o, ref_o) < 1e-5 and rel(s, ref_s) < 1e-5


def test_chunk_result_does_not_depend_on_the_grouping(monkeypatch):
    """Chunks run in groups that share one set of buffers and hand the state on; four groups of at most 3 chunks (the
    last one shorter, padded) give what one group of all 10 chunks gives."""
    q, k, v, raw, A_log, dt_bias, beta, h0 = kimi_inputs(T=150)
    g = kda_gate(raw, A_log, dt_bias)
    kwargs = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=16)
    with torch.inference_mode():
        o_one, s_one = chunk_kda(q, k, v, g, beta, **kwargs)
        B, _, H, K = q.shape
        monkeypatch.setattr(kda, "GROUP_BUDGET", 3 * B * H * 16 * K)
        o_grouped, s_grouped = chunk_kda(q, k, v, g, beta, **kwargs)
    assert rel(o_grouped, o_one) < FP32_CHUNK_TOL and rel(s_grouped, s_one) < FP32_CHUNK_TOL


def test_tensor_core_matmuls_are_scoped_to_accelerators():
    """TF32 for the kernel's (and the Hessians') fp32 matmuls is switched on only for the call on CUDA (16-bit inputs) and restored after,
    also on errors; CPUs are left alone."""
    flags = torch.backends.cuda.matmul
    name, on = ("fp32_precision", "tf32") if hasattr(flags, "fp32_precision") else ("allow_tf32", True)
    before = getattr(flags, name)
    with tensor_core_fp32_matmuls(torch.device("cuda"), True):
        assert getattr(flags, name) == on
    assert getattr(flags, name) == before
    with pytest.raises(ValueError), tensor_core_fp32_matmuls(torch.device("cuda"), True):
        raise ValueError("inside the kernel")
    assert getattr(flags, name) == before
    for device, enabled in ((torch.device("cuda"), False), (torch.device("cpu"), True)):
        with tensor_core_fp32_matmuls(device, enabled):
            assert getattr(flags, name) == before


def test_recurrent_matches_fla_naive_and_float64():
    q, k, v, raw, A_log, dt_bias, beta, h0 = kimi_inputs(T=40)
    g = kda_gate(raw, A_log, dt_bias)
    qn, kn = l2norm(q), l2norm(k)
    ref_o, ref_s = naive_recurrent_kda_fp64(qn, kn, v, g, beta, initial_state=h0)
    fla_o, fla_s = naive_recurrent_kda(qn, kn, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
    assert rel(o, ref_o) < FP32_RECURRENT_TOL and rel(s, ref_s) < FP32_RECURRENT_TOL
    assert rel(o, fla_o) < FP32_RECURRENT_TOL and rel(s, fla_s) < FP32_RECURRENT_TOL


def test_chunk_matches_fla_naive_recurrent():
    q, k, v, raw, A_log, dt_bias, beta, h0 = kimi_inputs(T=130)
    g = kda_gate(raw, A_log, dt_bias)
    fla_o, fla_s = naive_recurrent_kda(l2norm(q), l2norm(k), v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel(o, fla_o) < FP32_CHUNK_TOL and rel(s, fla_s) < FP32_CHUNK_TOL


def test_bf16_inputs_within_fla_tolerance():
    q, k, v, raw, A_log, dt_bias, beta, h0 = kimi_inputs(T=150)
    g = kda_gate(raw, A_log, dt_bias)
    ref_o, ref_s = naive_recurrent_kda_fp64(l2norm(q), l2norm(k), v, g, beta, initial_state=h0)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    for fn in (chunk_kda, fused_recurrent_kda):
        o, s = fn(qb, kb, vb, g, beta.bfloat16(), initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        assert rel(o, ref_o) < FLA_TOL and rel(s, ref_s) < FLA_TOL


def test_gate_in_kernel_equals_precomputed_gate():
    q, k, v, raw, A_log, dt_bias, beta, h0 = kimi_inputs(T=100)
    g = kda_gate(raw, A_log, dt_bias)
    for fn in (chunk_kda, fused_recurrent_kda):
        o1, s1 = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        o2, s2 = fn(q, k, v, raw, beta, initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
                    A_log=A_log, dt_bias=dt_bias)
        torch.testing.assert_close(o1, o2, rtol=0, atol=0)
        torch.testing.assert_close(s1, s2, rtol=0, atol=0)


def test_bounded_gate_equals_fla_naive_lower_bound_gate_and_stays_in_its_bounds():
    # vLLM 0.33's Kimi-K3 KDA with linear_attn_config.gate_lower_bound: g = lb * sigmoid(exp(A_log) * (g + dt_bias));
    # reference fla's naive_kda_lowerbound_gate (plain torch), float32 tolerance; the released value -5.0
    _, _, _, raw, A_log, dt_bias, _, _ = kimi_inputs(T=64)
    for lb in (-5.0, -1.0):
        ours = kda_gate(raw, A_log, dt_bias, lower_bound=lb)
        ref = naive_kda_lowerbound_gate(raw, A_log, dt_bias, lower_bound=lb)
        torch.testing.assert_close(ours, ref.to(ours.dtype), rtol=1e-6, atol=1e-6)
        assert bool((ours >= lb).all()) and bool((ours <= 0).all())  # (lb, 0), reaching the ends in float32
        torch.testing.assert_close(fused_kda_gate(raw, A_log, dt_bias, lower_bound=lb), ours, rtol=0, atol=0)
    q, k, v, _, _, _, beta, h0 = kimi_inputs(T=100)
    g = kda_gate(raw[:, :1].expand(-1, 100, -1, -1).contiguous(), A_log, dt_bias, lower_bound=-5.0)
    o1, s1 = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = chunk_kda(q, k, v, raw[:, :1].expand(-1, 100, -1, -1).contiguous(), beta, initial_state=h0,
                       output_final_state=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                       lower_bound=-5.0)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(s1, s2, rtol=0, atol=0)


def test_varlen_equals_separate_sequences():
    lengths = [37, 130, 64, 1]
    q, k, v, raw, A_log, dt_bias, beta, _ = kimi_inputs(B=1, T=sum(lengths))
    g = kda_gate(raw, A_log, dt_bias)
    h0 = torch.randn(len(lengths), 2, 32, 16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for fn in (chunk_kda, fused_recurrent_kda):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=cu)
        for n in range(len(lengths)):
            sl = slice(int(cu[n]), int(cu[n + 1]))
            ref_o, ref_s = naive_recurrent_kda_fp64(l2norm(q[:, sl]), l2norm(k[:, sl]), v[:, sl], g[:, sl],
                                                    beta[:, sl], initial_state=h0[n : n + 1])
            assert rel(o[:, sl], ref_o) < FP32_CHUNK_TOL
            assert rel(s[n : n + 1], ref_s) < FP32_CHUNK_TOL


def test_prefill_then_decode_continues_the_state():
    q, k, v, raw, A_log, dt_bias, beta, h0 = kimi_inputs(T=100)
    g = kda_gate(raw, A_log, dt_bias)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    full_o, full_s = chunk_kda(q, k, v, g, beta, initial_state=h0, **kw)
    o, s = chunk_kda(q[:, :97], k[:, :97], v[:, :97], g[:, :97], beta[:, :97], initial_state=h0, **kw)
    outs = [o]
    for t in range(97, 100):
        o, s = fused_recurrent_kda(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                   beta[:, t : t + 1], initial_state=s, **kw)
        outs.append(o)
    assert rel(torch.cat(outs, 1), full_o) < FP32_CHUNK_TOL
    assert rel(s, full_s) < FP32_CHUNK_TOL


def test_grouped_value_heads_equal_repeated_qk_heads():
    q, k, v, raw, A_log, dt_bias, beta, h0 = kimi_inputs(T=70, H=2, HV=4)
    g = kda_gate(raw, A_log, dt_bias)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    qr, kr = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    ref_o, ref_s = naive_recurrent_kda_fp64(qr, kr, v, g, beta, initial_state=h0)
    assert rel(o, ref_o) < FP32_CHUNK_TOL and rel(s, ref_s) < FP32_CHUNK_TOL


def test_chunk_gradients_finite_and_match_float64():
    q, k, v, raw, A_log, dt_bias, beta, h0 = kimi_inputs(B=1, T=90, K=16, V=8)
    g = kda_gate(raw, A_log, dt_bias)
    gen = torch.Generator().manual_seed(1)
    do, ds = torch.randn(1, 90, 2, 8, generator=gen), torch.randn(1, 2, 16, 8, generator=gen)

    def grads(fn, dtype):
        leaves = [x.to(dtype).clone().requires_grad_() for x in (q, k, v, g, beta)]
        o, s = fn(*leaves)
        ((o * do.to(dtype)).sum() + (s * ds.to(dtype)).sum()).backward()
        return [x.grad for x in leaves]

    ours = grads(lambda *a: chunk_kda(*a, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True), torch.float32)
    ref = grads(lambda qq, kk, vv, gg, bb: naive_recurrent_kda_fp64(l2norm(qq), l2norm(kk), vv, gg, bb,
                                                                    initial_state=h0), torch.float64)
    for name, a, b in zip("q k v g beta".split(), ours, ref):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < GRAD_TOL, name


def test_fused_kda_gate_accepts_fla04_and_fla06_calls():
    _, _, _, raw, A_log, dt_bias, _, _ = kimi_inputs(T=10)
    ref = naive_kda_gate(raw, A_log, dt_bias)
    new = fused_kda_gate(raw, A_log, dt_bias)  # fla 0.6: g [..., H, K]
    old = fused_kda_gate(raw.flatten(-2), A_log.view(1, 1, -1, 1), raw.shape[-1], g_bias=dt_bias)  # fla 0.4
    torch.testing.assert_close(new, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(old, ref, rtol=1e-6, atol=1e-6)
    assert old.shape == raw.shape
    # softplus switches to identity above 20, so huge raw gates stay finite
    big = fused_kda_gate(torch.full_like(raw, 1e4), A_log, dt_bias)
    assert torch.isfinite(big).all()
