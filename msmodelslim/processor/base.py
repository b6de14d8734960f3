"""Processor protocol and registry: a processor is a validated config plus a transform applied per unit."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from msmodelslim.core.config import SchemaError, StrictConfig
from msmodelslim.core.dist import DistContext
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.processor.globs import check_globs
from msmodelslim.serving.linear_plan import LinearPlan


@dataclass
class UnitContext:
    """What a processor is given for one unit: the unit, its loaded module, the model's adapter and the rank."""

    unit: Unit
    module: nn.Module
    adapter: ModelAdapter
    dist: DistContext
    # Runs this rank's calibration samples through the unit as it is now (no state is kept).
    run_samples: Callable[[], None]
    # The same over the samples of the first N calibration tokens only (`Observe.tokens`; None: every sample).
    run_first: Callable[[int], None] | None = None
    # During any pass: whether the tokens in progress come from the samples of the first N calibration tokens (None:
    # every token): a capped statistic's hooks record only then.
    within_first: Callable[[int | None], bool] = lambda tokens: True
    # Where a processor that replaces a linear by its quantized form hands over the float one (live name, module),
    # when a service of the runner reads it later in the unit (the quant report's impact); None: none does.
    keep_replaced: Callable[[str, nn.Module], None] | None = None
    # The run's linear plan (serving/linear_plan.py): what linear_quant does to each linear; None for a processor run
    # on its own (tests, benchmarks), which then selects by its own globs.
    plan: LinearPlan | None = None

    @property
    def device(self) -> torch.device:
        return self.dist.device



@dataclass(frozen=True)
class Changes:
    """What a processor changes in a unit, declared before it runs, for the Hessians carried past it:
    - `inputs_rescaled`: it rescales the inputs of the linears it touches by diagonals it yields as `Rescaled`
      requests, and changes nothing else another module reads (smoothing);
    - `weights`: the linears whose weights it changes and nothing else (quantization); their readers' inputs change;
    - neither: unknown, anything may change."""

    inputs_rescaled: bool = False
    weights: frozenset[str] | None = None


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

    def __init__(self, config: ProcessorConfig) -> None:
        self.config = config

    def preflight(self, adapter: ModelAdapter, schemes: dict[str, str]) -> None:
        """Check the plan against the whole model before any compute (raise UserError for one that cannot work).

        `schemes`: serving name -> the scheme each linear will get from the practice's linear_quant entries."""

    @abstractmethod
    def process_unit(self, ctx: UnitContext) -> Any:
        """Transform `ctx.module` in place. A processor that needs calibration statistics, cross-rank reductions
        or shared heavy work is a generator yielding requests the runner answers (`core/requests.py`)."""

    def hessians(self, ctx: UnitContext) -> tuple[str, ...]:
        """Modules of the unit as it is now whose input Hessians over every token this processor will ask for
        (`Observe.hessian`). The runner may gather them in an earlier processor's pass (pipeline/answers.py)."""
        return ()

    def changes(self, ctx: UnitContext) -> Changes:
        """What this processor does to the unit, as far as a Hessian gathered before it is concerned (default:
        anything, so nothing gathered before it is carried past it)."""
        return Changes()

    @property
    def true_sequential(self) -> bool:
        """Whether the Hessians this processor asks for must see the outputs of the linears an earlier processor of
        the unit quantized (GPTQModel's and AutoGPTQ's `true_sequential`). False: the unit's inputs before that
        quantization will do (as llm-compressor's sequential pipeline calibrates a whole subgraph in one pass), so
        an earlier pass may gather them (pipeline/answers.py)."""
        return True

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
