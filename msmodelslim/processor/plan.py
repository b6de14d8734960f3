"""The run's linear plan built from its processors (serving/linear_plan.py): the linear_quant entries in YAML order,
the first selecting a linear wins; spec.fallback and spec.mtp (processor/fallback.py `Fallback`) exclude the
linears they keep FLOAT from every entry and put their W8A8 entries first, run by the practice's first linear_quant.
`LinearQuantProcessor.process_unit` quantizes what the plan says; `pipeline/assembly.prepare_run` builds it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from msmodelslim.processor.base import Processor
from msmodelslim.processor.fa3_quant import FA3QuantProcessor
from msmodelslim.processor.linear_quant import LinearQuantConfig, LinearQuantProcessor, select
from msmodelslim.serving.linear_plan import LinearPlan, PlanEntry, PlannedLinear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fallback:
    """What spec.fallback and spec.mtp change in the plan (processor/fallback.py `apply_fallback`)."""

    to_float: list[str] = field(default_factory=list)  # globs of the linears kept FLOAT: out of every entry
    higher: list[LinearQuantConfig] = field(default_factory=list)  # W8A8 entries, before the practice's own


def linear_plan(processors: list[Processor], adapter: Any, fallback: Fallback = Fallback()) -> LinearPlan:
    """The run's linear plan (serving/linear_plan.py) from the processors and what `fallback` moves: each linear to
    the first entry selecting it (the fallback's W8A8 entries first), FLOAT where none does or the fallback says so."""
    quantizers = [p.config for p in processors if isinstance(p, LinearQuantProcessor)]
    configs = [*fallback.higher, *quantizers]
    runs_with = [quantizers[0] if quantizers else None] * len(fallback.higher) + quantizers
    # the linears kept FLOAT leave every entry of the practice (a fallback entry's excludes name them already)
    excludes = [list(cfg.exclude) for cfg in fallback.higher] + [cfg.exclude + fallback.to_float for cfg in quantizers]
    entries = tuple(PlanEntry(cfg.scheme.name, cfg.qconfig.weight.method, cfg.qconfig.weight.group_size or 0,
                              tuple(cfg.include), tuple(exclude), config=cfg, runs_with=runner)
                    for cfg, exclude, runner in zip(configs, excludes, runs_with, strict=True))
    linears = {}
    for lin in adapter.linears():
        entry = next((i for i, (cfg, exclude) in enumerate(zip(configs, excludes, strict=True))
                      if select(lin.name, lin.unit.kind, cfg.include, exclude)), None)
        linears[lin.name] = PlannedLinear(lin.name, lin.unit.name, lin.unit.kind, lin.in_features, lin.out_features,
                                          entry, bool(adapter.is_rank_local(lin.name)))
    if fallback.to_float:  # an entry whose linears all fell back to FLOAT is said; the label check says what was lost
        used = {linear.entry for linear in linears.values()}
        for index in range(len(fallback.higher), len(entries)):
            if index not in used:
                logger.info("spec.fallback: every linear of the linear_quant %s entry fell back to FLOAT; it "
                            "quantizes nothing", entries[index].scheme)
    return LinearPlan(entries, linears, fa3=any(isinstance(p, FA3QuantProcessor) for p in processors))


def report_native_mxfp4(processors: list[Processor], plan: LinearPlan, adapter: Any) -> None:
    """Log, before any compute, how many linears will keep the checkpoint's MXFP4 bytes."""
    earlier: list[str] = []
    for processor in processors:
        if isinstance(processor, LinearQuantProcessor):
            for index in plan.entries_run_by(processor.config):
                cfg = plan.entries[index].config
                if not (cfg.scheme.is_mx and cfg.scheme.weight.bits == 4):
                    continue
                chosen = [name for name, linear in plan.linears.items() if linear.entry == index]
                stored = sum(adapter.stores_mxfp4(name) for name in chosen)
                if not earlier:
                    fate = "all of them keep the checkpoint's bytes (no processor before this one changes weights)"
                else:
                    fate = (f"{', '.join(earlier)} run first: those whose weights they change are quantized again "
                            f"(the log says how many per layer), the others keep the checkpoint's bytes")
                logger.info("linear_quant %s: %d of its %d linears are MXFP4 in the checkpoint; %s", cfg.scheme.name,
                            stored, len(chosen), fate)
        elif not getattr(processor, "quantizes_attention", False):
            earlier.append(processor.name)
