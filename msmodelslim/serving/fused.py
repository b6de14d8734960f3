"""What the serving engines fuse: groups of checkpoint linears that run as one layer, hence with one scheme.

An AscendV1 output is served by vllm-ascend, whose layers come from one of these model classes (a "serving layout"):
- `vllm-ascend-0.23`: vllm-ascend 0.23 on vLLM 0.23's Kimi-Linear class: every KDA and MLA linear separate
  (`kimi_linear.py:556-558` declares no packed modules; test/consumer/vllm_layers.py `V023`);
- `vllm-ascend-0.26rc`: the Kimi-K3 class of vllm-ascend `releases/v0.26.0rc` (`vllm_ascend/models/kimi_k3.py:1261-1266`
  `packed_modules_mapping`, `:1189-1197` `stacked_params_mapping`; `ops/kimi_kda.py:179-190`): KDA q/k/v as
  `fused_qkv`, MLA q_a + kv_a as `fused_qkv_a_proj`; KDA b/f_a/f_b/g/o and the MLA output gate separate;
- `vllm-0.33`: vLLM 0.33's Kimi-Linear / Kimi-K3 classes (`vllm/models/kimi_k3/nvidia/model.py:935-941`, `load_weights`
  :1252-1283): KDA q/k/v/g/b/f_a as `in_proj_qkvgfab`, MLA q_a + kv_a (+ the output gate) as `fused_qkv_a(_g)_proj`.
- `vllm-ascend-0.27`: vllm-ascend 0.27 (PR #14454) on vLLM 0.27.1: KDA q/k/v/g/b/f_a as `in_proj_qkvgfab`, which it
  also loads split: q/k/v of one quantized type, g/f_a/b FLOAT (`FusedRule.split`; `modelslim_config.py:415-435,
  678-695`); MLA q_a + kv_a as `fused_qkv_a_proj`, its output gate a layer of its own (vLLM 0.27.1
  `models/kimi_k3/amd/linear.py:347-352,405-410`; bench/consumer_k3.py loads both forms).
Every layout runs dense and shared MLPs' gate/up as `gate_up_proj` and a MoE's routed experts as one layer
(vllm-ascend reads one scheme for a FusedMoE, `modelslim_config.py:71-303`). `conv1d` is fused too, but convolutions
are never quantized. The serving target (a profile) names the layouts of each model type.

A rule applies under a parent module that holds its `marker`; the group is every listed member present there.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

LAYOUTS = ("vllm-ascend-0.23", "vllm-ascend-0.26rc", "vllm-0.33", "vllm-ascend-0.27")


@dataclass(frozen=True)
class FusedRule:
    name: str  # the serving engine's fused layer
    members: tuple[str, ...]  # last name components of its shards, in the engine's shard order
    marker: str  # a member whose presence identifies the parent (g_proj alone is ambiguous: KDA or MLA)
    layouts: tuple[str, ...] = LAYOUTS  # the serving layouts that fuse it
    # the description names it (`<fused layer>.weight`, a lookup-only key) for lookups that find it in no packed
    # table; vllm-ascend's Kimi-K3 class lists its own groups (kimi_k3.py:1261-1266), so they need none
    lookup_key: bool = True
    # members that may all be FLOAT while the others share one quantized scheme, where the profile accepts the split
    split: tuple[str, ...] = ()


FUSED_RULES = (
    FusedRule("in_proj_qkvgfab", ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj"), marker="b_proj",
              layouts=("vllm-0.33", "vllm-ascend-0.27"), split=("g_proj", "b_proj", "f_a_proj")),
    FusedRule("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa", "g_proj"), marker="q_a_proj",
              layouts=("vllm-0.33",)),  # fused_qkv_a_g_proj when the output gate is there
    FusedRule("fused_qkv", ("q_proj", "k_proj", "v_proj"), marker="b_proj", layouts=("vllm-ascend-0.26rc",),
              lookup_key=False),
    FusedRule("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa"), marker="q_a_proj",
              layouts=("vllm-ascend-0.26rc", "vllm-ascend-0.27"), lookup_key=False),
    FusedRule("gate_up_proj", ("gate_proj", "up_proj"), marker="gate_proj"),
)


_EXPERT = re.compile(r"^(?P<moe>.*\.experts)\.\d+\.w[123]$")


def fused_groups(linear_names: list[str], layouts: Collection[str],
                 lookup_keys: bool = False) -> list[tuple[str, list[str]]]:
    """(`<parent>.<fused name>`, shard names) of every fused group among `linear_names` (serving names) in any of
    `layouts` (`lookup_keys`: only those the description names)."""
    by_parent: dict[str, set[str]] = {}
    experts: dict[str, list[str]] = {}
    for name in linear_names:
        parent, _, leaf = name.rpartition(".")
        by_parent.setdefault(parent, set()).add(leaf)
        match = _EXPERT.match(name)
        if match:
            experts.setdefault(match["moe"], []).append(name)
    rules = [rule for rule in FUSED_RULES if set(rule.layouts) & set(layouts) and (rule.lookup_key or not lookup_keys)]
    groups = []
    for parent, leaves in sorted(by_parent.items()):
        for rule in rules:
            present = [m for m in rule.members if m in leaves]
            if rule.marker in leaves and len(present) > 1:
                name = "fused_qkv_a_g_proj" if rule.name == "fused_qkv_a_proj" and "g_proj" in present else rule.name
                groups.append((f"{parent}.{name}", [f"{parent}.{m}" for m in present]))
    groups += [(moe, names) for moe, names in sorted(experts.items())]
    return groups


def split_of(group: str) -> tuple[str, ...]:
    """The members of fused layer `group` (a name of `fused_groups`) that may all be FLOAT beside the others' one
    quantized scheme, where the profile accepts the split."""
    leaf = group.rsplit(".", 1)[-1]
    return next((rule.split for rule in FUSED_RULES if rule.name == leaf and rule.split), ())
