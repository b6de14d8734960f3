"""The linear plan: what the run does to every linear of the model, built once before any compute.

The linear_quant entries say which linears they take (processor/plan.py `linear_plan`, the first entry in
YAML order wins), spec.fallback and spec.mtp have moved some up (a W8A8 fallback is one more entry, run by the
practice's first linear_quant), and the serving target has checked the whole (serving/rules.py). The run (carried
in each unit's context: linear_quant quantizes what it says), `--plan`, `analyze` and `tune` read this object; none
of them asks the processors again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from msmodelslim.serving.ascendv1 import FLOAT


@dataclass(frozen=True)
class PlanEntry:
    """One linear_quant entry of the practice, as the plan summarises it."""

    scheme: str  # its description type (W8A8_DYNAMIC, W4A8_DYNAMIC, W4A8_MXFP, ...)
    method: str  # its weight method (minmax, ssz, gptq, ...)
    group_size: int  # weight group size (0: per channel or an MX scheme's own blocks)
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    config: Any = field(default=None, compare=False, repr=False)  # the linear_quant config that quantizes them
    runs_with: Any = field(default=None, compare=False, repr=False)  # the config of the linear_quant that runs it


@dataclass(frozen=True)
class PlannedLinear:
    name: str  # serving (checkpoint) name
    unit: str  # the unit it is in ("layers.3")
    kind: str  # that unit's kind ("decoder", "mtp", ...)
    in_features: int
    out_features: int
    entry: int | None  # index into LinearPlan.entries; None: FLOAT
    rank_local: bool  # a routed expert under EP: its rank writes it

    @property
    def quantized(self) -> bool:
        return self.entry is not None


@dataclass(frozen=True)
class LinearPlan:
    entries: tuple[PlanEntry, ...]
    linears: dict[str, PlannedLinear]  # in the model's order
    fa3: bool = False  # the practice quantizes attentions too (fa3_quant: FA3 scales beside the linears)

    def entry_of(self, name: str) -> PlanEntry | None:
        index = self.linears[name].entry
        return None if index is None else self.entries[index]

    def scheme(self, name: str) -> str:
        entry = self.entry_of(name)
        return FLOAT if entry is None else entry.scheme

    @property
    def schemes(self) -> dict[str, str]:
        """Serving name -> the description type each linear gets (FLOAT when none)."""
        return {name: self.scheme(name) for name in self.linears}

    def entries_run_by(self, config: Any) -> list[int]:
        """The entries the linear_quant processor of `config` runs, in plan order."""
        return [i for i, entry in enumerate(self.entries) if entry.runs_with is config]

    def quantized(self) -> list[str]:
        """The linears some entry quantizes, in the model's order."""
        return [name for name, linear in self.linears.items() if linear.quantized]
