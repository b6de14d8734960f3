"""Expert parallelism for Kimi's MoE, by monkey-patching the checkpoint's own MoE class (never its files).

The dispatch, the statistics passes' switches and the undo are family-independent (model/common/expert_parallel.py);
this module knows Kimi's blocks: which modules are MoE blocks (a `gate` router, `experts`, `shared_experts`), the
two expert containers (the stand-in's one module per expert; transformers' native fused 3-D tensors, split into
`KimiExpertMLP`s) and which method of each class runs the routed part.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from msmodelslim.core.dist import SINGLE, DistContext
from msmodelslim.model.common.expert_parallel import (
    EP_ATTR,
    BlockEP,
    EPHandle,
    ep_routed,
    only_for_ep_blocks,
    resolve_expert_ep_range,
)
from msmodelslim.model.kimi_k3.experts import KimiExpertMLP

logger = logging.getLogger(__name__)


def is_native_moe(block: nn.Module) -> bool:
    """transformers' native Kimi-Linear MoE: router `gate` returns (logits, weights, indices)."""
    return type(block).__module__.startswith("transformers.models.kimi_linear")


def is_moe_block(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("gate", "experts", "shared_experts"))


def _standin_moe_infer(self: nn.Module, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weight: torch.Tensor) -> torch.Tensor:
    return ep_routed(self, x, topk_idx, topk_weight)


def _native_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    shape = hidden_states.shape
    _, topk_weight, topk_idx = self.gate(hidden_states)
    flat = hidden_states.reshape(-1, shape[-1])
    routed = ep_routed(self, flat, topk_idx, topk_weight)
    return routed.view(shape) + self.shared_experts(hidden_states)


def _local_experts(block: nn.Module, local: range, num_experts: int, moe_intermediate_size: int) -> nn.ModuleDict:
    experts = block.experts
    if isinstance(experts, nn.ModuleList):  # remote code: one module per expert
        if len(experts) != num_experts:
            raise ValueError(f"MoE block has {len(experts)} experts, config says num_experts={num_experts}")
        return nn.ModuleDict({str(e): experts[e] for e in local})
    if hasattr(experts, "gate_up_proj"):  # native transformers: fused 3-D experts -> one module per expert
        param = experts.gate_up_proj
        width = param.shape[-1]
        return nn.ModuleDict({str(e): KimiExpertMLP(width, moe_intermediate_size, device=param.device,
                                                    dtype=param.dtype) for e in local})
    raise TypeError(f"unsupported experts container {type(experts).__name__}")


def apply_ep_patches(model: nn.Module, text_config: object, dist: DistContext = SINGLE) -> EPHandle:
    """Keep only this rank's experts in every MoE block of `model` and patch the MoE classes' forward.

    Also used with one device: the same code path then runs with no collectives, which is what makes a W-rank run
    reproduce the single-device bytes.
    """
    num_experts = int(text_config.num_experts)
    local = resolve_expert_ep_range(num_experts, dist.rank, dist.world_size)
    top_k = int(text_config.num_experts_per_token if hasattr(text_config, "num_experts_per_token")
                else text_config.num_experts_per_tok)
    handle = EPHandle()
    patched: set[type] = set()
    blocks = [m for m in model.modules() if is_moe_block(m)]
    for block in blocks:
        cls = type(block)
        if cls not in patched:
            name, fn = ("forward", _native_forward) if is_native_moe(block) else ("moe_infer", _standin_moe_infer)
            if not hasattr(cls, name):
                raise TypeError(f"{cls.__name__} has no {name}(); cannot patch it for expert parallelism")
            original = cls.__dict__.get(name, getattr(cls, name))
            handle.restore_methods.append((cls, name, original))
            setattr(cls, name, only_for_ep_blocks(fn, original))
            patched.add(cls)
        original = block.experts
        block.experts = _local_experts(block, local, num_experts, int(text_config.moe_intermediate_size))
        width = next(iter(block.experts.values())).w1.in_features
        setattr(block, EP_ATTR, BlockEP(dist=dist, router=block.gate, expert_width=width, top_k=top_k))
        handle.restore_experts.append((block, original))
    logger.info("expert parallelism: rank %d/%d holds experts %d..%d of %d in %d MoE blocks", dist.rank,
                dist.world_size, local.start, local.stop - 1, num_experts, len(blocks))
    return handle
