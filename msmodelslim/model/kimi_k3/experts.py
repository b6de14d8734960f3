"""Per-expert modules for checkpoints whose runtime class fuses the routed experts into 3-D tensors.

transformers' native Kimi-Linear keeps all experts in two fused parameters; quantization needs one nn.Linear per
expert projection (w1 gate, w3 up, w2 down), named as in the checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from msmodelslim.model.common.expert_parallel import register_gated_mlp_experts


class SiluGated(nn.Module):
    """act(gate, up) = silu(gate) * up, the activation of transformers' native Kimi-Linear experts."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class KimiExpertMLP(nn.Module):
    """One routed expert: w2(act_fn(w1 x, w3 x)), act_fn = silu(gate) * up."""

    def __init__(self, hidden_size: int, intermediate_size: int, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": False}
        self.w1 = nn.Linear(hidden_size, intermediate_size, **kw)
        self.w3 = nn.Linear(hidden_size, intermediate_size, **kw)
        self.w2 = nn.Linear(intermediate_size, hidden_size, **kw)
        self.act_fn = SiluGated()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x), self.w3(x)))


# w2(act_fn(w1 x, w3 x)) and nothing else: the stand-in's expert class (remote code, built from vLLM's Kimi-K3) and
# ours for transformers' fused experts; their routed calls run as one group
register_gated_mlp_experts("KimiBlockSparseMLP", KimiExpertMLP.__name__)
