"""Causal depthwise short convolution (KDA's q/k/v conv) in plain PyTorch, with decode-state update.

``y[t, c] = act(sum_i w[c, i] * x[t - (W-1) + i, c] + bias[c])`` with x = 0 (or the cached inputs) before the start;
``w[:, W-1]`` multiplies the current token. The cache (fla layout) is ``[N, D, W]``: the last W inputs per channel,
oldest first, the newest (current) token last.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kda import _from_padded, _seq_index, _to_padded

__all__ = ["ShortConvolution", "causal_conv1d", "causal_conv1d_update", "short_conv_forward"]


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"short convolution: unsupported activation {activation!r} (expected 'silu'/'swish'/None)")


def _weight_2d(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(weight.shape[0], weight.shape[-1])  # [D, 1, W] or [D, W] -> [D, W]


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    backend: str | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill: x [B, T, D] (B=1 with ``cu_seqlens``), weight [D, W] or [D, 1, W], initial_state [N, D, W].

    Returns ``(y [B, T, D] in x's dtype, final_state [N, D, W] or None)``; the final state holds the last W inputs
    of each sequence (earlier cached inputs where a sequence is shorter than W). ``residual`` is added to y.
    ``backend`` and extra keyword arguments of fla (``chunk_indices``...) are accepted and ignored.
    """
    w = _weight_2d(weight)
    D, W = w.shape
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (packed sequences), got {x.shape[0]}")
        index, valid, _ = _seq_index(cu_seqlens)
        y, state = causal_conv1d(_to_padded(x, index, valid), w, bias, None, initial_state, output_final_state,
                                 activation, seq_lengths=valid.sum(-1))
        y = _from_padded(y, valid)
        return (y if residual is None else y + residual), state
    B, T, _ = x.shape
    xt = x.transpose(1, 2)  # [B, D, T]
    hist = initial_state.to(x.dtype) if initial_state is not None else xt.new_zeros(B, D, W)
    full = torch.cat([hist, xt], dim=-1)  # [B, D, W+T]: token t at index W+t
    # fp32 accumulation (as fla's kernels); cast back once
    y = F.conv1d(full[..., 1:].float(), w.float().unsqueeze(1), None if bias is None else bias.float(), groups=D)
    y = _act(y, activation).to(x.dtype).transpose(1, 2)
    if residual is not None:
        y = y + residual
    state = None
    if output_final_state:
        lengths = kwargs.get("seq_lengths")
        if lengths is None:
            state = full[..., -W:]
        else:  # padded varlen: the last W real inputs of each sequence (indices L .. L+W-1)
            pos = lengths.view(-1, 1) + torch.arange(W, device=x.device).view(1, -1)  # [N, W]
            state = full.gather(-1, pos.unsqueeze(1).expand(B, D, W))
        state = state.contiguous()
    return y, state


def causal_conv1d_update(
    x: torch.Tensor,
    cache: torch.Tensor,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode one token per sequence: x [N, D], [N, 1, D] or [1, N, D]; cache [N, D, W] updated IN PLACE.

    Returns ``(y shaped like x, cache)``.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # [N, D]
    w = _weight_2d(weight)
    cache.copy_(torch.cat([cache[..., 1:], x2.unsqueeze(-1).to(cache.dtype)], dim=-1))
    y = (cache.float() * w.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    y = _act(y, activation).to(x.dtype).reshape(shape)
    if residual is not None:
        y = y + residual
    return y, cache


def short_conv_forward(
    self: nn.Conv1d,
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    cache: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``forward`` of fla's ``ShortConvolution`` (any fla version), in torch. Usable as a replacement method.

    Single-token calls without autograd update ``cache`` in place (as fla); others return a new state when
    ``output_final_state``. ``mask`` [B, T] zeroes padded inputs.
    """
    B, T = x.shape[:2]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if mask is not None:
        if cu_seqlens is not None:
            raise ValueError("short convolution: `mask` and `cu_seqlens` cannot both be given")
        x = x * mask.unsqueeze(-1).to(x.dtype)
    activation = getattr(self, "activation", "silu")
    if cache is not None and not torch.is_grad_enabled() and B * T == N:
        y, cache = causal_conv1d_update(x, cache, residual, self.weight, self.bias, activation)
        return y, (cache if output_final_state else None)
    return causal_conv1d(x, self.weight, self.bias, residual, cache, output_final_state, activation,
                         cu_seqlens=cu_seqlens)


class ShortConvolution(nn.Conv1d):
    """Drop-in for fla's ``ShortConvolution`` (same constructor, parameters and forward contract), pure torch."""

    def __init__(
        self,
        hidden_size: int,
        kernel_size: int,
        bias: bool = False,
        activation: str | None = "silu",
        backend: str | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        **kwargs,
    ) -> None:
        super().__init__(hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, groups=hidden_size,
                         bias=bias, device=device, dtype=dtype)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"ShortConvolution: unsupported activation {activation!r}")
        self.hidden_size = hidden_size
        self.activation = activation
        self.backend = "torch"

    forward = short_conv_forward

    def step(self, x, residual=None, cache=None, output_final_state=False, cu_seqlens=None):
        B = x.shape[0]
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        if cache is None:
            cache = x.new_zeros(N, self.hidden_size, self.kernel_size[0])
        y, cache = causal_conv1d_update(x, cache, residual, self.weight, self.bias, self.activation)
        return y, (cache if output_final_state else None)

    @property
    def state_size(self) -> int:
        return self.hidden_size * self.kernel_size[0]
