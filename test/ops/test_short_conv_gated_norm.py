"""Short convolution and gated RMSNorm (msmodelslim.ops) against plain formulas.

Short conv reference: ``torch.nn.functional.conv1d`` (depthwise, left padding W-1) + SiLU, in float64.
Gated RMSNorm reference: the float64 formula ``x / sqrt(mean(x^2) + eps) * weight * sigmoid(g)``.
Tolerances: fp32 vs float64 references 1e-5 absolute on O(1) values; decode / varlen / chunked-prefill paths must
equal the one-shot prefill to 1e-6 absolute plus 1e-6 relative (the same fp32 arithmetic summed in another order is a
few ulps off: an absolute 1e-6 alone failed for 6 of 300 random draws, where outputs reach ~8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from msmodelslim.ops.gated_norm import FusedRMSNormGated, rms_norm_gated
from msmodelslim.ops.short_conv import ShortConvolution, causal_conv1d, causal_conv1d_update

ATOL = 1e-5


def conv_reference(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    D, W = weight.shape
    y = F.conv1d(x.double().transpose(1, 2), weight.double().unsqueeze(1), None if bias is None else bias.double(),
                 padding=W - 1, groups=D)[..., : x.shape[1]]
    return F.silu(y).transpose(1, 2)


def test_prefill_matches_conv1d_reference():
    x, w, b = torch.randn(2, 37, 24), torch.randn(24, 4), torch.randn(24)
    y, state = causal_conv1d(x, w, b, activation="silu", output_final_state=True)
    torch.testing.assert_close(y.double(), conv_reference(x, w, b), rtol=0, atol=ATOL)
    torch.testing.assert_close(state, x[:, -4:].transpose(1, 2))


def test_decode_steps_equal_prefill():
    x, w = torch.randn(3, 20, 16), torch.randn(16, 4)
    ref, _ = causal_conv1d(x, w, activation="silu")
    y, cache = causal_conv1d(x[:, :5], w, activation="silu", output_final_state=True)
    outs = [y]
    for t in range(5, 20):
        yt, cache2 = causal_conv1d_update(x[:, t], cache, weight=w, activation="silu")
        assert cache2 is cache  # updated in place, as fla's
        outs.append(yt.unsqueeze(1))
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache, x[:, -4:].transpose(1, 2))


def test_prefill_with_state_continues_and_short_sequences_keep_history():
    x, w = torch.randn(2, 30, 8), torch.randn(8, 4)
    ref, ref_state = causal_conv1d(x, w, activation="silu", output_final_state=True)
    y1, s1 = causal_conv1d(x[:, :2], w, activation="silu", output_final_state=True)  # shorter than W
    y2, s2 = causal_conv1d(x[:, 2:], w, activation="silu", initial_state=s1, output_final_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s2, ref_state)


def test_varlen_equals_separate_sequences():
    lengths = [5, 1, 17, 3]
    w = torch.randn(8, 4)
    x = torch.randn(1, sum(lengths), 8)
    h0 = torch.randn(len(lengths), 8, 4)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    y, s = causal_conv1d(x, w, activation="silu", initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n in range(len(lengths)):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        yn, sn = causal_conv1d(x[:, sl], w, activation="silu", initial_state=h0[n : n + 1], output_final_state=True)
        torch.testing.assert_close(y[:, sl], yn, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s[n : n + 1], sn)


def test_short_convolution_module_matches_reference_and_fla_contract():
    conv = ShortConvolution(hidden_size=12, kernel_size=4, activation="silu")
    assert conv.weight.shape == (12, 1, 4)
    x = torch.randn(2, 9, 12)
    with torch.no_grad():
        y, state = conv(x, output_final_state=True)
        torch.testing.assert_close(y.double(), conv_reference(x, conv.weight[:, 0]), rtol=0, atol=ATOL)
        # single-token call without autograd: in-place cache update, as fla
        x1 = torch.randn(2, 1, 12)
        y1, state1 = conv(x1, cache=state, output_final_state=True)
        assert state1 is state
        ref1 = conv_reference(torch.cat([x, x1], 1), conv.weight[:, 0])[:, -1:]
        torch.testing.assert_close(y1.double(), ref1, rtol=0, atol=ATOL)


def gated_norm_reference(x, g, w, eps):
    x, g, w = x.double(), g.double(), w.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w * torch.sigmoid(g)


def test_gated_rmsnorm_matches_float64_formula():
    x, g, w = torch.randn(2, 5, 4, 32), torch.randn(2, 5, 4, 32), torch.randn(32)
    y = rms_norm_gated(x, g, w, activation="sigmoid", eps=1e-5)
    torch.testing.assert_close(y.double(), gated_norm_reference(x, g, w, 1e-5), rtol=0, atol=ATOL)
    norm = FusedRMSNormGated(32, eps=1e-5, activation="sigmoid")
    with torch.no_grad():
        norm.weight.copy_(w)
    # bf16 in -> bf16 out, computed in fp32 (one rounding at the end)
    yb = norm(x.bfloat16(), g.bfloat16())
    assert yb.dtype == torch.bfloat16
    ref_b = gated_norm_reference(x.bfloat16(), g.bfloat16(), w, 1e-5)
    torch.testing.assert_close(yb.double(), ref_b.bfloat16().double(), rtol=0.01, atol=0.01)


def test_gated_rmsnorm_swish_and_prenorm_residual():
    x, g, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(3, 16), torch.rand(16)
    y, res = rms_norm_gated(x, g, w, activation="swish", residual=r, prenorm=True, eps=1e-6)
    h = (x + r).double()
    ref = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double() * F.silu(g.double())
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=ATOL)
    torch.testing.assert_close(res, x + r)
