"""`spec.fallback`: linears kept in higher precision than the practice's quantizers would give them.

msModelSlim's accuracy loop (evaluate; past a 1 % drop, find the sensitive linears and keep them in higher precision;
quantize again) needs a way to say "these linears, not as the practice says". Each `spec.fallback` item names
linears (core/config.py `FallbackConfig`: globs, a names file, or the top k of a quant report) and a target:

- `FLOAT`: the linears are excluded from every linear_quant entry;
- `W8A8_DYNAMIC` / `W8A8_MXFP8`: an entry of the run's linear plan of that scheme selecting exactly them comes
  before the practice's own (the first matching entry wins), run by the practice's first linear_quant (no processor
  of its own). It takes the qconfig of the practice's first entry of that scheme, else min/max activations with ssz
  (integer) or min/max (MX) weights.

The result is data for the plan (processor/plan.py `Fallback`); the practice's processors are not changed.

Only linears the practice quantizes move; a glob that reaches none of them is an error. The serving engine runs a
fused group (q/k/v, gate/up, a layer's routed experts) as one layer with one scheme, so a member moves its whole
group, and the log says how many linears moved for how many named. A report's `top_k` is a budget of linears: its
worst linears are taken with their groups, worst first, and a group that would pass the budget is skipped for the
next (`worst_within`, which `msmodelslim tune` uses too). FLOAT wins over a W8A8 fallback of the same linear.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from typing import Any

from msmodelslim.core.config import FallbackConfig
from msmodelslim.errors import UserError
from msmodelslim.processor.globs import WILDCARD, any_match, check_globs
from msmodelslim.processor.linear_quant import (
    ActQConfig,
    LinearQuantConfig,
    LinearQuantProcessor,
    QConfig,
    WeightQConfig,
)
from msmodelslim.processor.plan import Fallback, linear_plan

logger = logging.getLogger(__name__)

_DEFAULT_QCONFIG = {
    "W8A8_DYNAMIC": QConfig(act=ActQConfig(), weight=WeightQConfig(dtype="int8", method="ssz")),
    "W8A8_MXFP8": QConfig(act=ActQConfig(scope="per_block", dtype="mxfp8"),
                          weight=WeightQConfig(scope="per_block", dtype="mxfp8", method="minmax")),
}


def serving_groups(fused: list[tuple[str, list[str]]]) -> dict[str, list[str]]:
    """Linear -> the members of the fused serving layer it is in, of the serving target's `fused_groups` (linears in
    no group are absent)."""
    return {shard: shards for _, shards in fused for shard in shards}


def worst_within(ranking: list[str], groups: dict[str, list[str]], movable: set[str], budget: int) -> set[str]:
    """The linears of `ranking` (worst first) that move, each with the movable members of its fused group, as long as
    at most `budget` linears move in all: a group that would pass the budget is skipped for the next one."""
    chosen: set[str] = set()
    for name in ranking:
        if name in chosen or name not in movable:
            continue
        group = {m for m in groups.get(name, [name]) if m in movable}
        if len(chosen) + len(group) <= budget:
            chosen |= group
    return chosen


def _chosen(entry: FallbackConfig, index: int, quantized: list[str], groups: dict[str, list[str]]) -> set[str]:
    """The quantized linears `entry` names; a glob that names none of them is an error. One pass over the linears
    whatever the number of globs (compiled once, processor/globs.py): a few hundred globs over Kimi-K3's
    ~250k linears took minutes one glob at a time."""
    try:
        check_globs(entry.globs)
    except ValueError as exc:
        where = f" (with names_file {entry.names_file})" if entry.names_file else ""
        raise UserError(f"spec.fallback[{index}].names{where}: {exc}") from None
    chosen = {name for name in quantized if any_match(name, entry.globs)}
    unmatched = [g for g in entry.globs if not WILDCARD.search(g) and g not in chosen]
    pending = {g: re.compile(fnmatch.translate(g)) for g in entry.globs if WILDCARD.search(g)}
    for name in chosen:  # each pattern until its first hit
        for glob in [g for g, pattern in pending.items() if pattern.match(name)]:
            del pending[glob]
        if not pending:
            break
    unmatched += list(pending)
    if unmatched:
        glob = next(g for g in entry.globs if g in unmatched)
        raise UserError(f"spec.fallback[{index}]: {glob!r} names none of the model's {len(quantized)} quantized "
                        f"linears (checkpoint names without .weight, e.g. {quantized[len(quantized) // 2]})")
    if entry.report is not None:
        picked = worst_within(entry.ranking, groups, set(quantized), entry.top_k)
        if not picked:
            raise UserError(f"spec.fallback[{index}]: the report {entry.report} ranks none of the model's "
                            f"{len(quantized)} quantized linears within top_k {entry.top_k}")
        chosen |= picked
    return chosen


def with_groups(chosen: set[str], fused: list[tuple[str, list[str]]]) -> list[str]:
    """`chosen` and every other member of a fused group one of them is in, as globs: a group whose shards all sit
    under its fused name (a layer's experts) as one `<group>.*`, other shards by name."""
    globs: set[str] = set()
    grouped: set[str] = set()
    for group, shards in fused:
        if not chosen.intersection(shards):
            continue
        grouped.update(shards)
        if all(s.startswith(group + ".") for s in shards):
            globs.add(group + ".*")
        else:
            globs.update(shards)
    return sorted(globs | (chosen - grouped))


def apply_fallback(processors: list[Any], entries: list[FallbackConfig], adapter: Any) -> Fallback:
    """What `entries` change in the run's linear plan (module docstring), for `linear_plan`."""
    if not entries:
        return Fallback()
    quantized = sorted(linear_plan(processors, adapter).quantized())  # as the practice alone would have it
    fused = adapter.target.fused_groups(adapter)
    groups = serving_groups(fused)
    quantizers = [p for p in processors if isinstance(p, LinearQuantProcessor)]
    to_float: list[str] = []
    higher: list[tuple[str, list[str]]] = []  # (scheme, globs)
    for i, entry in enumerate(entries):
        chosen = _chosen(entry, i, quantized, groups)
        globs = with_groups(chosen, fused)
        moved = sum(1 for name in quantized if any_match(name, globs))
        logger.info("spec.fallback[%d]: %d linears to %s (%d named, the rest share a fused serving layer with one)",
                    i, moved, entry.to, len(chosen))
        if entry.to == "FLOAT":
            to_float += globs
        else:
            higher.append((entry.to, globs))
    return Fallback(to_float, [LinearQuantConfig(
        qconfig=next((q.config.qconfig for q in quantizers if q.config.scheme.name == scheme), None)
        or _DEFAULT_QCONFIG[scheme], include=globs, exclude=to_float) for scheme, globs in higher])
