"""On a CUDA GPU: msmodelslim's torch KDA equals fla's Triton `chunk_kda`, with fla's own tolerance (the bounded
"safe" gate of vLLM 0.33's Kimi-K3 too).

Reference: fla 0.6 `chunk_kda` (Triton). Inputs bf16 with Kimi-magnitude gates (A_log ~ log U(1,16), raw gate of
several units), T not a multiple of 64, an initial state, q/k l2-normalised in the kernel. Tolerance: relative RMS
error 0.005 for output and final state (what fla's tests use for bf16 against fp32). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FLA_TOL = 0.005


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def kda_inputs(T: int, seed: int) -> dict:
    """bf16 q/k/v, Kimi-magnitude gate parameters (A_log ~ log U(1, 16)), a raw gate of several units, beta and an
    initial state, on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, H, K, V = 2, 4, 128, 128

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    return {"q": randn(B, T, H, K).bfloat16(), "k": randn(B, T, H, K).bfloat16(), "v": randn(B, T, H, V).bfloat16(),
            "A_log": torch.empty(H, device="cuda").uniform_(1, 16, generator=gen).log(), "dt_bias": randn(H * K),
            "raw": 3 * randn(B, T, H, K), "beta": torch.rand(B, T, H, device="cuda", generator=gen).bfloat16(),
            "h0": randn(B, H, K, V), "scale": K**-0.5}


@pytest.mark.parametrize("T", [200, 1000])
def test_torch_chunk_kda_matches_fla_triton_on_cuda(T: int):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from msmodelslim.ops.kda import chunk_kda, kda_gate

    x = kda_inputs(T, seed=0)
    g = kda_gate(x["raw"], x["A_log"], x["dt_bias"]).float()
    kw = {"scale": x["scale"], "initial_state": x["h0"], "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    ref_o, ref_s = fla_chunk_kda(x["q"], x["k"], x["v"], g, x["beta"], **kw)
    out_o, out_s = chunk_kda(x["q"], x["k"], x["v"], g, x["beta"], **kw)
    assert rel(out_o, ref_o) < FLA_TOL
    assert rel(out_s, ref_s) < FLA_TOL


@pytest.mark.parametrize("T", [200, 1000])
def test_bounded_gate_in_kernel_matches_fla_safe_gate_on_cuda(T: int):
    # vLLM 0.33's Kimi-K3 KDA with linear_attn_config.gate_lower_bound = -5.0 (the released value): the gate
    # lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) computed in the kernel. Reference: fla 0.6's Triton
    # chunk_kda(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0) and its fused_kda_gate; tolerances: fla's
    # 0.005 relative RMS for the kernel, float32 rounding (1e-5 relative RMS) for the gate alone.
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda.gate import fused_kda_gate as fla_gate

    from msmodelslim.ops.kda import chunk_kda, kda_gate

    x = kda_inputs(T, seed=1)
    gate = kda_gate(x["raw"], x["A_log"], x["dt_bias"], lower_bound=-5.0)
    assert rel(gate, fla_gate(x["raw"], x["A_log"], x["dt_bias"], lower_bound=-5.0)) < 1e-5
    kw = {"scale": x["scale"], "initial_state": x["h0"], "output_final_state": True, "use_qk_l2norm_in_kernel": True,
          "use_gate_in_kernel": True, "A_log": x["A_log"], "dt_bias": x["dt_bias"], "lower_bound": -5.0}
    ref_o, ref_s = fla_chunk_kda(x["q"], x["k"], x["v"], x["raw"], x["beta"], safe_gate=True, **kw)
    out_o, out_s = chunk_kda(x["q"], x["k"], x["v"], x["raw"], x["beta"], **kw)
    assert rel(out_o, ref_o) < FLA_TOL
    assert rel(out_s, ref_s) < FLA_TOL
