"""The model adapter: everything the toolkit knows about a model family, and nothing else, as two protocols by reader.

- `ModelStructure`, what processors, the serving target and the forward read: the units and their modules, the
  linears and their serving names, what the saver writes, the maps for rotation / smoothing / FA3, the forward;
- `ModelRuntime`, what the runner and the launch need: the config check and the model's facts (model/facts.py),
  the serving target and expert-calibration switches a run sets, loading and freeing units, the samples, the
  source's MXFP4 bytes, the idle forward of expert parallelism, and closing.

A family adapter (`ModelAdapter`) implements both; each protocol stays small enough to read at once (<= 15
methods, test/model/test_protocols.py). The runner drives units (`vision`, `embed`, `layers.{i}`, `head`) through
it; processors ask it for model knowledge as data.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msmodelslim.core.routing import ExpertStatistics
from msmodelslim.errors import UserError
from msmodelslim.model.facts import ModelFacts
from msmodelslim.serving.profiles import Profile, profile


@dataclass(frozen=True)
class Unit:
    """One piece of the model that is loaded, calibrated, processed, saved and freed at once."""

    name: str  # "vision", "embed", "layers.3", "head"
    kind: str  # "vision" | "embed" | "decoder" | "head"
    prefix: str  # checkpoint-name prefix of the unit's tensors, ending with "."
    index: int | None = None  # decoder layer index

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class ModelLinear:
    """One nn.Linear of the model, as its skeleton has it (no weights needed)."""

    unit: Unit
    name: str  # serving (checkpoint) name
    in_features: int
    out_features: int


class ModelStructure(ABC):
    """What processors, the serving target and the forward read of a model."""

    @abstractmethod
    def units(self) -> list[Unit]:
        """Units in execution order."""

    def unit_module(self, unit: Unit) -> nn.Module:
        """The unit's module as built on the meta device, before loading (for plans made before any compute)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose unit skeletons")

    def linears(self) -> list[ModelLinear]:
        """Every nn.Linear of the model, from the skeletons (no weights needed).

        Walked once, on the first call (the practice checks and the saver all ask before any processor runs; later,
        linear_quant has replaced these linears by QuantLinears, and the answer is still the model's linears)."""
        cached = self.__dict__.get("_linear_walk")
        if cached is None:
            cached = [ModelLinear(unit, self.checkpoint_name(unit, live_name), mod.in_features, mod.out_features)
                      for unit in self.units()
                      for live_name, mod in self.unit_module(unit).named_modules()
                      if live_name and isinstance(mod, nn.Linear)]
            self.__dict__["_linear_walk"] = cached
        return cached

    @abstractmethod
    def checkpoint_name(self, unit: Unit, live_name: str) -> str:
        """Full checkpoint name of a tensor/module given its name inside the unit module."""

    @abstractmethod
    def checkpoint_state(self, unit: Unit, module: nn.Module) -> Iterator[tuple[str, Any]]:
        """(checkpoint name, Tensor or quantized module) pairs the saver writes for this unit."""

    @abstractmethod
    def forward_unit(self, unit: Unit, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """Run one sample's state through a unit and return the state for the next unit."""

    def is_rank_local(self, live_name: str) -> bool:
        """True for modules owned by one expert-parallel rank (their statistics are not reduced across ranks)."""
        return False

    def reads_routed_experts(self, live_name: str) -> bool:
        """Whether a module's input, within its unit, depends on the routed experts' outputs (so it changes when
        they are quantized). Unknown models say yes: nothing is gathered ahead of the experts' quantization."""
        return True

    def serving_model_type(self) -> str | None:
        """The model type the serving target's profiles know the model by (config.json's `model_type`; None:
        unknown, nothing is fused)."""
        return None

    def lookup_aliases(self, name: str) -> list[str]:
        """Other names a serving engine looks the description entry `name` up by (none by default)."""
        return []

    def output_config(self, config: dict[str, Any], description: dict[str, str]) -> dict[str, Any]:
        """The source config.json as the output carries it (flags the serving engine reads added); `description`
        is the output's tensor name -> scheme map."""
        return config

    # --- algorithm maps (model knowledge as data) ------------------------------------------------------------
    def fa3_attentions(self) -> list[str]:
        """Checkpoint names of the attentions that have FA3 points (from the skeletons; none by default)."""
        return []

    def inject_fa3_placeholders(self, unit: Unit, module: nn.Module, should_inject: Any) -> list[str]:
        """Put FA3 points (`fa_q`, `fa_k`, `fa_v`: quant.attention placeholders) into the unit's attentions whose
        checkpoint name `should_inject` accepts, where the attention kernel sees Q, K and V; returns their live
        names. Models without such points refuse fa3_quant."""
        raise UserError(f"{type(self).__name__} has no FA3 attention points: fa3_quant cannot run on this model")

    def quarot_plan(self, unit: Unit, module: nn.Module) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no QuaRot plan")

    def smooth_subgraphs(self, unit: Unit, module: nn.Module) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} has no smoothing subgraphs")


class ModelRuntime(ABC):
    """What the runner and the launch need of a model."""

    @classmethod
    def check_config(cls, config: dict[str, Any], config_file: Path, model_type: str) -> None:
        """Raise UserError for a config.json the adapter cannot serve as `model_type` (before anything runs)."""

    @property
    def facts(self) -> ModelFacts:
        """Hidden size, routed experts, top-k, the samples' state per token: from config.json, read once."""
        raise NotImplementedError(f"{type(self).__name__} states no model facts")

    def serve_on(self, target: Profile) -> None:
        """Write for the serving target `target` (serving/profiles.py): its classes decide which linears are fused."""
        self.__dict__["_target"] = target

    @property
    def target(self) -> Profile:
        return self.__dict__.get("_target") or profile(None)

    expert_statistics: ExpertStatistics = "routed"  # as `calibrate_experts` set it

    def calibrate_experts(self, how: ExpertStatistics) -> None:
        """How routed experts are calibrated in every statistics pass (`statistics_pass`): "routed" on the tokens
        the router sends them; "all_tokens" (`spec.calibrate_all_experts`) each on every token of its rank, while
        the layer's output keeps the router's choice; "affinity" (`spec.affinity_guided_experts`) on their routed
        tokens, each weighed by the router's weight in their Hessians (core/routing.py); "balanced"
        (`spec.balanced_experts`) on their routed tokens topped up, for the statistics, with the tokens the router
        scores highest for them, to the share of each micro-batch a balanced router would send them."""
        if how != "routed":
            key = {"all_tokens": "calibrate_all_experts", "affinity": "affinity_guided_experts",
                   "balanced": "balanced_experts"}[how]
            raise UserError(f"spec.{key}: {type(self).__name__} has no routed experts to calibrate")

    def statistics_pass(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around each calibration pass that gathers statistics (not the forward that makes the next unit's
        inputs)."""
        return contextlib.nullcontext()

    def drop_units(self, kind: str) -> list[Unit]:
        """Leave the units of `kind` out of the run (`spec.mtp: drop`); returns those dropped."""
        raise NotImplementedError(f"{type(self).__name__} cannot leave units out")

    @abstractmethod
    def load_unit(self, unit: Unit, device: torch.device, reader: Any = None) -> nn.Module:
        """Build `unit` from the checkpoint's own classes and load its weights strictly (missing -> error)."""

    def free_unit(self, unit: Unit, module: nn.Module) -> None:
        """Release a unit's memory after it was saved."""
        module.to("meta")

    @abstractmethod
    def prepare_samples(self, records: list[Any]) -> list[dict[str, torch.Tensor]]:
        """Turn calibration records into per-sample model inputs (CPU tensors)."""

    def idle_unit(self, unit: Unit, module: nn.Module) -> None:
        """Take part in a unit's collectives without a sample (data parallelism with uneven sample counts)."""

    def source_mxfp4(self, unit: Unit, live_name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The source checkpoint's own MXFP4 bytes of linear `live_name` of `unit`: (codes uint8 [out, in/2],
        E8M0 exponents uint8 [out, in/32], bias 127), or None when the source stores it otherwise."""
        return None

    def stores_mxfp4(self, name: str) -> bool:
        """Whether the source checkpoint stores linear `name` (a serving name) as MXFP4 (headers only)."""
        return False

    def close(self) -> None:
        """Undo whatever the adapter patched into the checkpoint's classes (idempotent)."""


class ModelAdapter(ModelStructure, ModelRuntime):
    """Model knowledge for one family: both protocols. Subclasses are registered in config/config.ini."""

    def __init__(self, model_path: str | Path, trust_remote_code: bool = False) -> None:
        self.model_path = Path(model_path)
        self.trust_remote_code = trust_remote_code

    def __enter__(self) -> ModelAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
