"""Gated RMSNorm (KDA's output norm) in plain PyTorch.

``y = x / sqrt(mean(x^2) + eps) * weight * act(g)`` per row of the last dim (a head's V channels), in fp32, cast back to
x's dtype once; ``weight`` [V] is shared by all heads; ``act`` is sigmoid for Kimi (swish/silu also supported).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FusedRMSNormGated", "gated_rmsnorm_forward", "rms_norm_gated"]


def rms_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    activation: str = "sigmoid",
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    eps: float = 1e-5,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fla's ``rms_norm_gated`` contract: returns y, or ``(y, x + residual)`` when ``prenorm``."""
    h = x.float()
    if residual is not None:
        h = h + residual.float()
    res_out = h.to(torch.float32 if residual_in_fp32 else (residual.dtype if residual is not None else x.dtype))
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    gf = g.float()
    if activation == "sigmoid":
        y = y * torch.sigmoid(gf)
    elif activation in ("swish", "silu"):
        y = y * F.silu(gf)
    else:
        raise ValueError(f"rms_norm_gated: unsupported activation {activation!r}")
    y = y.to(x.dtype)
    return (y, res_out) if prenorm else y


def gated_rmsnorm_forward(
    self: nn.Module,
    x: torch.Tensor,
    g: torch.Tensor,
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``forward`` of fla's ``FusedRMSNormGated`` in torch; usable as a replacement method on fla instances."""
    return rms_norm_gated(x, g, self.weight, getattr(self, "bias", None), getattr(self, "activation", "sigmoid"),
                          residual, prenorm, residual_in_fp32, getattr(self, "eps", 1e-5))


class FusedRMSNormGated(nn.Module):
    """Drop-in for fla's ``FusedRMSNormGated`` (same constructor, parameters and forward), pure torch."""

    def __init__(
        self,
        hidden_size: int,
        elementwise_affine: bool = True,
        eps: float = 1e-5,
        activation: str = "swish",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"FusedRMSNormGated: unsupported activation {activation!r}")
        self.hidden_size = hidden_size
        self.elementwise_affine = elementwise_affine
        self.eps = eps
        self.activation = activation
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.register_parameter("bias", None)

    forward = gated_rmsnorm_forward

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, activation={self.activation}"
