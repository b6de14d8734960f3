"""The serving target's rules applied to a linear plan, before any compute: what the engine would refuse at load
is one error line naming the linear, the rule and the profile that accepts it; `--plan` prints the verdict of every
profile.

The rules are the profile's data (serving/profiles.py) and the fused tables (serving/fused.py); what vllm-ascend
needs of every profile alike (one group size per model, schemes it serves for routed experts only, input widths the
blocks divide) is here too.
"""

from __future__ import annotations

from typing import Any

from msmodelslim.errors import UserError
from msmodelslim.quant.modules import SCHEMES
from msmodelslim.serving.ascendv1 import FLOAT
from msmodelslim.serving.fused import fused_groups, split_of
from msmodelslim.serving.linear_plan import LinearPlan
from msmodelslim.serving.profiles import PROFILES, Profile

# Inputs a weight's in_features must be a multiple of: W4A8_MXFP / W4A4_MXFP4 pair their E8M0 scales without
# padding (vllm-ascend `w4a8_mxfp4.py:90-96`, `w4a4_mxfp4.py:104-115`), every MX scheme has blocks of 32.
_MX_INPUT_MULTIPLE = {"W4A8_MXFP": 64, "W4A4_MXFP4": 64}
_MX = tuple(name for name, scheme in SCHEMES.items() if scheme.is_mx)

Groups = list[tuple[str, list[str]]]


def check_plan(plan: LinearPlan, target: Profile, adapter: Any) -> None:
    """Every rule of the serving target `target` on `plan` (of the model `adapter`): UserError at the first broken,
    naming the targets that load the plan."""
    refused = refusal(target, plan, adapter)
    if refused is not None:
        loading = [p.name for p in PROFILES.values() if p is not target and refusal(p, plan, adapter) is None]
        raise UserError(f"{refused}" + (f"; --target {' or '.join(loading)} loads it" if loading else ""))


def verdict(plan: LinearPlan, adapter: Any) -> dict[str, str]:
    """Profile name -> "loads" (with what a user should know) or the first rule it refuses the plan by (--plan)."""
    out = {}
    for name, candidate in PROFILES.items():
        groups = _groups_under(candidate, plan, adapter)
        refused = _first_refusal(candidate, plan, groups)
        out[name] = f"refuses: {refused}" if refused is not None else "loads" + _notes(candidate, plan, groups)
    return out


def refusal(target: Profile, plan: LinearPlan, adapter: Any) -> UserError | None:
    """The first rule of `target` the plan breaks, or None: the target loads it."""
    return _first_refusal(target, plan, _groups_under(target, plan, adapter))


def _first_refusal(target: Profile, plan: LinearPlan, groups: Groups) -> UserError | None:
    for rule in (_fused, _served, _group_sizes, _attentions):
        try:
            rule(target, groups, plan=plan)
        except UserError as exc:
            return exc
    return None


def _groups_under(target: Profile, plan: LinearPlan, adapter: Any) -> Groups:
    return fused_groups(list(plan.linears), target.layouts_for(adapter.serving_model_type()))


def _notes(target: Profile, plan: LinearPlan, groups: Groups) -> str:
    """What a profile does with a plan it loads that a user should know."""
    notes = []
    split = sum(1 for group, shards in groups if _is_split(group, shards, plan))
    if split:
        notes.append(f"{split} KDA in_proj_qkvgfab split at load (q/k/v quantized, g/f_a/b FLOAT)")
    mtp = sum(1 for linear in plan.linears.values() if linear.kind == "mtp")
    if mtp:
        notes.append(f"MTP layers described ({mtp} linears)" if target.mtp_described
                     else "MTP layers are skipped by its loader")
    return f" ({'; '.join(notes)})" if notes else ""


def _is_split(group: str, shards: list[str], plan: LinearPlan) -> bool:
    """Whether a fused layer's shards take the accepted split: the split members all FLOAT, the others one
    quantized scheme."""
    split = split_of(group)
    if not split:
        return False
    floats = {plan.scheme(s) for s in shards if s.rsplit(".", 1)[-1] in split}
    rest = {plan.scheme(s) for s in shards if s.rsplit(".", 1)[-1] not in split}
    return floats == {FLOAT} and len(rest) == 1 and FLOAT not in rest


def _fused(target: Profile, groups: Groups, plan: LinearPlan) -> None:
    """One scheme per fused layer: vllm-ascend loads such a layer with one scheme and rejects a mixed one
    (`modelslim_config.py:695-700`), but for the split its profile accepts (vllm-ascend 0.27's KDA layout)."""
    for group, shards in groups:
        by_scheme: dict[str, str] = {}
        for shard in shards:
            by_scheme.setdefault(plan.scheme(shard), shard)
        if len(by_scheme) == 1 or (target.kda_split and _is_split(group, shards, plan)):
            continue
        detail = "; ".join(f"{shard} is {scheme}" for scheme, shard in by_scheme.items())
        members = sorted({s.rsplit(".", 1)[-1] if ".experts." not in s else "experts.*" for s in shards})
        split = split_of(group) if target.kda_split else ()
        rest = [leaf for s in shards if (leaf := s.rsplit(".", 1)[-1]) not in split]
        accepted = f", or {', '.join(rest)} of one quantized scheme with {', '.join(split)} FLOAT" if split else ""
        raise UserError(f"spec.process: {target.name} runs {group} as one layer with one scheme{accepted}, but the "
                        f"practice splits it ({detail}); include or exclude {', '.join(members)} together")


def _served(target: Profile, groups: Groups, plan: LinearPlan) -> None:
    """The schemes the engine serves where the plan puts them: W4A16_MXFP4 and per-channel W4A8_DYNAMIC on routed
    experts only (vllm-ascend serves them for MoE layers, not for linears), per-group W4A8 where the profile loads
    it, and input widths the blocks or groups divide."""
    for name, linear in plan.linears.items():
        entry = plan.entry_of(name)
        if entry is None:
            continue
        if entry.scheme == "W4A16_MXFP4" and not linear.rank_local:
            raise UserError(f"spec.process: {name} would be W4A16_MXFP4, which vllm-ascend serves for routed experts "
                            f"only; include it in another linear_quant entry (e.g. W8A8_MXFP8)")
        if entry.scheme == "W4A8_DYNAMIC" and entry.group_size and not target.per_group_w4a8:
            # vllm-ascend 0.27 methods/w4a8.py: W4A8_DYNAMIC for MoE only, group_size > 0 refused at init
            fix = "quantize it per channel" if linear.rank_local else "include it in a W8A8_DYNAMIC entry"
            raise UserError(f"spec.process: {name} would be W4A8_DYNAMIC per group of {entry.group_size}, which "
                            f"{target.name} refuses at load (its W4A8_DYNAMIC is for MoE layers, per channel); "
                            f"{fix}")
        if entry.scheme == "W4A8_DYNAMIC" and not entry.group_size and not linear.rank_local:
            # vllm-ascend's W4A8_DYNAMIC linear (methods/w4a8.py AscendW4A8DynamicLinearMethod) is weight-only with
            # weight groups of the description's group_size: per channel (0) it divides by zero building the layer
            raise UserError(f"spec.process: {name} would be W4A8_DYNAMIC per channel, which vllm-ascend serves for "
                            f"routed experts only (its W4A8 linear is weight-only and per group); include it in a "
                            f"W8A8_DYNAMIC entry")
        is_mx = entry.scheme in _MX
        multiple = _MX_INPUT_MULTIPLE.get(entry.scheme, 32) if is_mx else entry.group_size
        if multiple and linear.in_features % multiple:
            raise UserError(f"spec.process: {name} has {linear.in_features} inputs, which {entry.scheme}"
                            f"{'' if is_mx else f' per group of {multiple}'} needs in multiples of {multiple}; "
                            f"exclude it from that linear_quant entry")


def _attentions(target: Profile, groups: Groups, plan: LinearPlan) -> None:
    """FA3 scales only where the engine loads them (vllm-ascend 0.27 maps their names twice: serving/profiles.py)."""
    if plan.fa3 and not target.loads_fa3:
        raise UserError(f"spec.process: fa3_quant writes FA3 scales, which {target.name} cannot load (its "
                        f"cache-scale name mapper runs twice, so no stored name reaches its parameter); leave "
                        f"fa3_quant out")


def _group_sizes(target: Profile, groups: Groups, plan: LinearPlan) -> None:
    description_group_size(plan)


def description_group_size(plan: LinearPlan) -> int | None:
    """The description's one `group_size` for the plan's quantized linears (None: no scheme reads it), refusing a
    mix the engine cannot serve: vllm-ascend reads one group size per model, W4A8_DYNAMIC's MoE kernel as its
    weight groups (0: per channel) and every MX scheme as its block (32)."""
    sizes: dict[int, str] = {}
    used = {linear.entry for linear in plan.linears.values() if linear.entry is not None}
    for index in sorted(used):
        entry = plan.entries[index]
        if entry.scheme in _MX:
            sizes.setdefault(32, entry.scheme)
        elif entry.scheme == "W4A8_DYNAMIC":
            group = entry.group_size
            sizes.setdefault(group, f"W4A8_DYNAMIC {f'per group of {group}' if group else 'per channel'}")
    if len(sizes) > 1:
        raise UserError(f"spec.process: vllm-ascend reads one group_size for the whole model, but the practice needs "
                        f"{' and '.join(f'{g} ({who})' for g, who in sorted(sizes.items()))}; use one of them")
    return next(iter(sizes), None)
