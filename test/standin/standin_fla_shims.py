"""Test-only pure-PyTorch stand-ins for the FLA kernels the remote Kimi code calls.

Temporary until msmodelslim.model.kimi_k3.runtime_patches lands: `fla_shims(modeling_module)` swaps the
module's `chunk_kda` / `fused_recurrent_kda` / `fused_kda_gate` globals for fla's own naive torch references
and the forwards of ShortConvolution / FusedRMSNormGated for torch code, then restores everything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.nn.functional as F
from fla.ops.kda.gate import naive_kda_gate
from fla.ops.kda.naive import naive_recurrent_kda


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
         use_qk_l2norm_in_kernel=False, **kwargs):
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q).to(q.dtype), _l2norm(k).to(k.dtype)
    o, s = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state)
    return o, s


def _kda_gate(g, A_log, dt_bias=None, lower_bound=None, output_dtype=torch.float32):
    assert lower_bound is None
    return naive_kda_gate(g, A_log, dt_bias=dt_bias, output_dtype=output_dtype)


def _short_conv_forward(self, x, residual=None, mask=None, cache=None, output_final_state=False,
                        cu_seqlens=None, **kwargs):
    assert cu_seqlens is None and residual is None
    if mask is not None:
        x = x * mask.unsqueeze(-1)
    B, T, D = x.shape
    W = self.kernel_size[0]
    xt = x.transpose(1, 2)  # [B, D, T]
    hist = cache if cache is not None else xt.new_zeros(B, D, W)
    full = torch.cat([hist.to(xt.dtype), xt], dim=-1)
    y = F.conv1d(full[..., -(T + W - 1):], self.weight, self.bias, groups=D)
    y = F.silu(y) if self.activation in ("silu", "swish") else y
    new_cache = full[..., -W:].contiguous() if output_final_state else None
    return y.transpose(1, 2).to(x.dtype), new_cache


def _rms_norm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
    gf = g.float()
    gate = torch.sigmoid(gf) if self.activation == "sigmoid" else F.silu(gf)
    return (xf * gate).to(dtype)


@contextlib.contextmanager
def fla_shims(modeling: ModuleType) -> Iterator[None]:
    saved_globals = {n: getattr(modeling, n) for n in ("chunk_kda", "fused_recurrent_kda", "fused_kda_gate")}
    conv_cls, norm_cls = modeling.ShortConvolution, modeling.FusedRMSNormGated
    saved_fwd = (conv_cls.forward, norm_cls.forward)
    modeling.chunk_kda = _kda
    modeling.fused_recurrent_kda = _kda
    modeling.fused_kda_gate = _kda_gate
    conv_cls.forward = _short_conv_forward
    norm_cls.forward = _rms_norm_gated_forward
    try:
        yield
    finally:
        for n, f in saved_globals.items():
            setattr(modeling, n, f)
        conv_cls.forward, norm_cls.forward = saved_fwd
