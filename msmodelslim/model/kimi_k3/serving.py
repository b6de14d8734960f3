"""What the serving engines fuse: groups of checkpoint linears that run as one layer, hence with one scheme.

Data from vLLM 0.33's Kimi-Linear / Kimi-K3 model (`vllm/models/kimi_k3/nvidia/model.py:935-941`
`packed_modules_mapping`, and the `stacked_params_mapping` of `load_weights`, model.py:1252-1283, which adds `g_proj`
to `in_proj_qkvgfab` with the full-rank KDA gate and to `fused_qkv_a_g_proj` with the MLA output gate) and from
vllm-ascend 0.23's lookup, which reads one scheme for a whole FusedMoE layer (`modelslim_config.py:71-303`, the
`experts` entries). `conv1d` (q/k/v_conv1d) is fused too, but convolutions are never quantized.

A rule applies under a parent module that holds its `marker`; the group is every listed member present there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class FusedRule:
    name: str  # the serving engine's fused layer
    members: tuple[str, ...]  # last name components of its shards, in the engine's shard order
    marker: str  # a member whose presence identifies the parent (g_proj alone is ambiguous: KDA or MLA)


FUSED_RULES = (
    FusedRule("in_proj_qkvgfab", ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj"), marker="b_proj"),
    FusedRule("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa", "g_proj"), marker="q_a_proj"),
    FusedRule("gate_up_proj", ("gate_proj", "up_proj"), marker="gate_proj"),
)
_EXPERT = re.compile(r"^(?P<moe>.*\.experts)\.\d+\.w[123]$")


def fused_groups(linear_names: list[str]) -> list[tuple[str, list[str]]]:
    """(`<parent>.<fused name>`, shard names) of every fused group among `linear_names` (serving names)."""
    by_parent: dict[str, set[str]] = {}
    experts: dict[str, list[str]] = {}
    for name in linear_names:
        parent, _, leaf = name.rpartition(".")
        by_parent.setdefault(parent, set()).add(leaf)
        match = _EXPERT.match(name)
        if match:
            experts.setdefault(match["moe"], []).append(name)
    groups = []
    for parent, leaves in sorted(by_parent.items()):
        for rule in FUSED_RULES:
            present = [m for m in rule.members if m in leaves]
            if rule.marker in leaves and len(present) > 1:
                name = "fused_qkv_a_g_proj" if rule.name == "fused_qkv_a_proj" and "g_proj" in present else rule.name
                groups.append((f"{parent}.{name}", [f"{parent}.{m}" for m in present]))
    groups += [(moe, names) for moe, names in sorted(experts.items())]
    return groups
