"""Processor protocol and registry: a processor is a validated config plus a transform applied per unit."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from msmodelslim.core.config import SchemaError, StrictConfig
from msmodelslim.core.dist import DistContext
from msmodelslim.core.requests import Stats
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.processor.globs import check_globs


@dataclass
class UnitContext:
    """What a processor is given for one unit: the unit, its loaded module, the model's adapter and the rank."""

    unit: Unit
    module: nn.Module
    adapter: ModelAdapter
    dist: DistContext
    # Runs this rank's calibration samples through the unit as it is now (no state is kept).
    run_samples: Callable[[], None]
    # The same over the samples of the first N calibration tokens only (`Observe.tokens`; None: every sample), and
    # during such a pass whether the tokens in progress come from those samples (a hook records only then).
    run_first: Callable[[int], None] | None = None
    observing: Callable[[], bool] = lambda: True
    # Hessians (and their token counts) a pass gathered for a later processor (`Processor.hessians_ahead`)
    gathered: Stats = field(default_factory=Stats)

    @property
    def device(self) -> torch.device:
        return self.dist.device



@dataclass
class ProcessorConfig(StrictConfig):
    """Base of every processor config; subclasses are dataclasses whose fields are the YAML keys, checked by the
    schema builder whether they come from a practice or from `build(**fields)`."""

    GLOB_FIELDS = ("include", "exclude")  # checked here for every processor that selects by name

    def __post_init__(self) -> None:
        for key in self.GLOB_FIELDS:
            if isinstance(getattr(self, key, None), list):
                try:
                    check_globs(getattr(self, key))
                except ValueError as exc:
                    raise SchemaError(key, str(exc)) from None
        super().__post_init__()

    def validate(self) -> None:
        """Raise ValueError naming the offending field for values out of range."""


@dataclass
class OutputExtras:
    """What processors add to an output besides the weights: entries of the description's top-level `optional`
    block and extra tensor files (path relative to the output -> tensors), written once, by rank 0."""

    optional: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def update(self, other: OutputExtras | None) -> None:
        if other is not None:
            self.optional.update(other.optional)
            self.files.update(other.files)


class Processor(ABC):
    config_cls: type[ProcessorConfig] = ProcessorConfig
    name: str = ""  # the YAML `type`, set by register_processor
    # What the practice check asks of the processors listed: a label below 16 bits needs one that quantizes
    # linears, `kv_cache: true` one that quantizes attention (so a practice cannot promise what it never does).
    quantizes_linears: bool = False
    quantizes_attention: bool = False
    # Its transforms scale the inputs of the linears they touch by a known diagonal, and it rescales the Hessians
    # gathered for later processors to match (`ctx.gathered`): a later processor may gather in its passes.
    carries_hessians: bool = False

    def __init__(self, config: ProcessorConfig) -> None:
        self.config = config

    def preflight(self, adapter: ModelAdapter, schemes: dict[str, str]) -> None:
        """Check the plan against the whole model before any compute (raise UserError for one that cannot work).

        `schemes`: serving name -> the scheme each linear will get from the practice's linear_quant entries."""

    @abstractmethod
    def process_unit(self, ctx: UnitContext) -> Any:
        """Transform `ctx.module` in place. A processor that needs calibration statistics, cross-rank reductions
        or shared heavy work is a generator yielding requests the runner answers (`core/requests.py`)."""

    def hessians_ahead(self, ctx: UnitContext, before: Sequence[Processor]) -> tuple[str, ...]:
        """Modules whose Hessians this processor will ask for that the pass of `before[0]` can gather: what the
        processors `before` it (the asking one first) do to the unit after that pass leaves them the same, or
        `carries_hessians`. The runner keeps them in `ctx.gathered` and hands them over when asked (a pass fewer).
        None by default."""
        return ()

    def describe(self) -> dict[str, Any]:
        """Metadata for quant_model_description.json (e.g. the QuaRot seed)."""
        return {}

    def extras(self) -> OutputExtras | None:
        """Files and `optional` description entries the serving side reads (e.g. QuaRot's global rotation)."""
        return None

    def resume_state(self) -> dict[str, Any]:
        """What this processor carries from one unit to the next that its output depends on (describe, extras):
        kept after every unit of a resumable run and handed back to `restore_state` when it resumes."""
        return {}

    def restore_state(self, state: dict[str, Any]) -> None:
        """Continue from `resume_state()`'s value."""

    def require_float_weight(self, unit_name: str, name: str, module: nn.Module) -> None:
        """Refuse a module whose weight is already integer: float transforms must run before linear_quant."""
        weight = module._parameters.get("weight")  # a QuantLinear's `.weight` is a dequantised copy
        if weight is None or not weight.is_floating_point():
            raise ValueError(f"{self.name}: {unit_name}/{name} has no float weight (is it already quantized? "
                             f"{self.name} must come before linear_quant in the practice)")


PROCESSORS: dict[str, type[Processor]] = {}


def register_processor(name: str, config_cls: type[ProcessorConfig]) -> Callable[[type[Processor]], type[Processor]]:
    def wrap(cls: type[Processor]) -> type[Processor]:
        if name in PROCESSORS:
            raise ValueError(f"processor type {name!r} registered twice")
        cls.config_cls = config_cls
        cls.name = name
        config_cls._yaml_type = name
        PROCESSORS[name] = cls
        return cls

    return wrap
