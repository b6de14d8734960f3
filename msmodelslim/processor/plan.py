"""The run's linear plan built from its processors (serving/linear_plan.py): the linear_quant entries in YAML order,
the first selecting a linear wins, as `LinearQuantProcessor.process_unit` applies them; spec.fallback and spec.mtp
have already moved linears up (processor/fallback.py) when `pipeline/assembly.prepare_run` builds it."""

from __future__ import annotations

import logging
from typing import Any

from msmodelslim.processor.base import Processor
from msmodelslim.processor.linear_quant import LinearQuantConfig, LinearQuantProcessor, select
from msmodelslim.serving.linear_plan import LinearPlan, PlanEntry, PlannedLinear

logger = logging.getLogger(__name__)


def planned_configs(processors: list[Processor], adapter: Any) -> dict[str, LinearQuantConfig | None]:
    """Serving name -> the linear_quant entry that will quantize each linear of the model: the first one (in YAML
    order) selecting it, as process_unit applies them, or None (FLOAT)."""
    quantizers = [p.config for p in processors if isinstance(p, LinearQuantProcessor)]
    return {lin.name: next((q for q in quantizers if select(lin.name, lin.unit.kind, q.include, q.exclude)), None)
            for lin in adapter.linears()}


def linear_plan(processors: list[Processor], adapter: Any) -> LinearPlan:
    """The run's linear plan (serving/linear_plan.py) from the processors after spec.fallback and spec.mtp."""
    quantizers = [p.config for p in processors if isinstance(p, LinearQuantProcessor)]
    index = {id(cfg): i for i, cfg in enumerate(quantizers)}
    entries = tuple(PlanEntry(cfg.scheme.name, cfg.qconfig.weight.method, cfg.qconfig.weight.group_size or 0,
                              tuple(cfg.include), tuple(cfg.exclude)) for cfg in quantizers)
    planned = planned_configs(processors, adapter)
    linears = {lin.name: PlannedLinear(lin.name, lin.unit.name, lin.unit.kind, lin.in_features, lin.out_features,
                                       None if planned[lin.name] is None else index[id(planned[lin.name])],
                                       bool(adapter.is_rank_local(lin.name)))
               for lin in adapter.linears()}
    return LinearPlan(entries, linears)


def report_native_mxfp4(processors: list[Processor], plan: LinearPlan, adapter: Any) -> None:
    """Log, before any compute, how many linears will keep the checkpoint's MXFP4 bytes."""
    earlier: list[str] = []
    entry = 0
    for processor in processors:
        if isinstance(processor, LinearQuantProcessor):
            cfg = processor.config
            if cfg.scheme.is_mx and cfg.scheme.weight.bits == 4:
                chosen = [name for name, linear in plan.linears.items() if linear.entry == entry]
                stored = sum(adapter.stores_mxfp4(name) for name in chosen)
                if not earlier:
                    fate = "all of them keep the checkpoint's bytes (no processor before this one changes weights)"
                else:
                    fate = (f"{', '.join(earlier)} run first: those whose weights they change are quantized again "
                            f"(the log says how many per layer), the others keep the checkpoint's bytes")
                logger.info("linear_quant %s: %d of its %d linears are MXFP4 in the checkpoint; %s", cfg.scheme.name,
                            stored, len(chosen), fate)
            entry += 1
        elif not getattr(processor, "quantizes_attention", False):
            earlier.append(processor.name)
