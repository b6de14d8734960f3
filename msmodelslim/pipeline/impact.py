"""The quant report's loss-aware score, `impact`: how much of its unit's output error a linear's quantization causes.

A linear's own relative error (`error`) says how badly its output is rounded, not how much the rest of the model
depends on that output: falling back the linears it ranks worst recovered less of the perplexity delta than a random
choice under the same budget (BENCHMARKS.md, issue 33). The rest of the model reads a unit through its output (the
hidden state, read again through a norm), so the score measures each serving group's part in that output's error.

Per unit, on the samples of the first `spec.report_impact_tokens` calibration tokens and before the forward that
makes the next unit's inputs, the runner forwards the processed unit over each sample's inputs once per variant
(`LayerWiseRunner._probe`): with every linear a processor replaced swapped back for its float form (y_f), as
processed (y_q), and once per serving group g of the unit's quantized linears with g alone float (y_g). Summed over
the tokens and every tensor the unit computes (not those it passes on): E_q = ||y_q - y_f||^2, E_g = ||y_g - y_f||^2,
F = ||y_f||^2. A group's impact is (E_q - E_g) / F: the part of the unit output's relative error that falling back
the group removes, measured with the rest quantized as it will be served (negative where its error cancelled
another's). The group's impact is shared among its linears by their absolute output error (the report's error x
output_energy), so the impacts of a group sum to the group's and a ranking by it moves groups by what they remove
per linear moved, as `processor/fallback.worst_within` spends its budget.

The float linears come from the processors that replaced them (`UnitContext.keep_replaced`), kept on the host
until the probe; a group is one fused serving layer (a layer's routed experts, q/k/v, ...) or a linear in none.
Later units' sensitivity is not weighed: a layer-wise run has none of them at hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from msmodelslim.core.dist import DistContext
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.pipeline.spill import map_state


def _computed(out: Any, inputs: set[int]) -> list[torch.Tensor]:
    """The floating tensors of a unit's output that are not one of its inputs passed on."""
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor, _path: tuple) -> torch.Tensor:
        if t.is_floating_point() and id(t) not in inputs:
            found.append(t)
        return t

    map_state(out, visit)
    return found


def _tensor_ids(state: Any) -> set[int]:
    ids: set[int] = set()
    map_state(state, lambda t, _p: ids.add(id(t)))
    return ids


class ImpactProbe:
    """One run's impact measurements (module docstring): the replaced float linears of the unit in progress, the
    sums of its probe forwards, and per unit the groups' impacts."""

    def __init__(self, adapter: ModelAdapter, dist: DistContext, tokens: int | None) -> None:
        self.adapter = adapter
        self.dist = dist
        # the samples probed: those of the first `tokens` calibration tokens of the global order (the runner's
        # capped selection, `assembly.first_places`; None: every sample)
        self.tokens = tokens
        self._group_of: dict[str, str] | None = None  # checkpoint name -> its fused serving layer (built once)
        self._replaced: dict[str, nn.Module] = {}  # live name -> the float linear, on the host
        self._groups: list[tuple[str, list[str]]] = []  # (group, live names), the unit in progress
        self._sums: dict[str, torch.Tensor] = {}
        self.impacts: dict[str, float] = {}  # group -> impact, of the unit probed last (`finish`)

    def keep(self, live_name: str, linear: nn.Module) -> None:
        """`UnitContext.keep_replaced`: a linear a processor replaced, kept float (on the host) until the probe."""
        self._replaced[live_name] = linear.to("cpu")

    def group_of(self, name: str) -> str:
        """The serving group of a checkpoint name: its fused layer, or itself."""
        if self._group_of is None:
            self._group_of = {shard: fused for fused, shards in self.adapter.target.fused_groups(self.adapter)
                              for shard in shards}
        return self._group_of.get(name, name)

    def start(self, unit: Unit) -> int:
        """The unit's groups (the same on every rank: a layer's routed experts are one group on each); returns the
        forwards per probed sample (0: nothing replaced, no probe)."""
        groups: dict[str, list[str]] = {}
        for live in self._replaced:
            groups.setdefault(self.group_of(self.adapter.checkpoint_name(unit, live)), []).append(live)
        self._groups = sorted(groups.items())
        self._sums = {}
        return self.variants

    @property
    def variants(self) -> int:
        """Forwards per probed sample of the unit in progress: float, processed, one per group (0: no group)."""
        return 2 + len(self._groups) if self._groups else 0

    @contextlib.contextmanager
    def _float(self, module: nn.Module, names: list[str]) -> Iterator[None]:
        quantized = {name: module.get_submodule(name) for name in names}
        for name in names:
            module.set_submodule(name, self._replaced[name])
        try:
            yield
        finally:
            for name, quant in quantized.items():
                module.set_submodule(name, quant)

    def on_device(self, device: torch.device) -> None:
        """The float linears to the run's device for the probe's forwards."""
        for linear in self._replaced.values():
            linear.to(device)

    @torch.no_grad()
    def measure(self, module: nn.Module, forward: Callable[[], Any], inputs: Any, counted: bool = True) -> None:
        """One sample: the float, the processed and each group-float unit forwarded (`forward()` gives the output
        of the unit as `module` is at the call); `counted`: its errors are summed (else forwarded only)."""
        if not counted:
            for _ in range(self.variants):
                forward()
            return
        passed_on = _tensor_ids(inputs)
        everything = [name for _, names in self._groups for name in names]
        with self._float(module, everything):
            reference = [t.float() for t in _computed(forward(), passed_on)]

        def squares(tensors: list[torch.Tensor]) -> torch.Tensor:
            total = torch.zeros((), dtype=torch.float32, device=self.dist.device)
            for t in tensors:  # float32: an NPU has no float64 arithmetic, HCCL no float64 reduction (docs/npu.md)
                total += t.square().sum()
            return total

        def error() -> torch.Tensor:
            out = _computed(forward(), passed_on)
            return squares([t.float() - r for t, r in zip(out, reference, strict=True)])

        self._add("signal", squares(reference))
        self._add("quantized", error())
        for group, names in self._groups:
            with self._float(module, names):
                self._add(f"float/{group}", error())

    def _add(self, key: str, value: torch.Tensor) -> None:
        self._sums[key] = self._sums[key] + value if key in self._sums else value

    def finish(self) -> None:
        """`impacts` of the unit just probed, summed over every rank's samples; the float linears go."""
        zero = torch.zeros((), dtype=torch.float32, device=self.dist.device)
        keys = ["signal", "quantized", *(f"float/{group}" for group, _ in self._groups)]
        sums = self.dist.all_reduce_sum({k: self._sums.get(k, zero) for k in keys})
        signal, quantized = float(sums["signal"]), float(sums["quantized"])
        self.impacts = {group: (quantized - float(sums[f"float/{group}"])) / signal
                        for group, _ in self._groups} if signal > 0 else {}
        self._replaced.clear()
        self._groups, self._sums = [], {}

    def shares(self, absolute: dict[str, float], replicated: set[str]) -> dict[str, float]:
        """Each linear's part of its group's impact (checkpoint name -> impact), from the linears' absolute output
        errors on this rank (`absolute`, of the unit just probed); the rank-local linears' totals per group are
        summed over the ranks (a layer's routed experts are spread over them), the replicated ones are every rank's.
        The impacts are taken: a unit's are shared once."""
        group = {name: self.group_of(name) for name in absolute}
        local: dict[str, float] = {}
        total: dict[str, float] = {}
        for name, value in absolute.items():
            into = total if name in replicated else local
            into[group[name]] = into.get(group[name], 0.0) + value
        keys = sorted(self.impacts)  # every rank's groups, the same keys in the same order
        summed = self.dist.all_reduce_sum({g: torch.tensor(local.get(g, 0.0), dtype=torch.float32,
                                                           device=self.dist.device) for g in keys})
        for g in keys:
            total[g] = total.get(g, 0.0) + float(summed[g])
        members = {g: sum(1 for n in group if group[n] == g) for g in keys}
        impacts, self.impacts = self.impacts, {}
        # no output error at all (nothing reached the group): its impact split evenly among this rank's members
        return {name: impacts[g] * (absolute[name] / total[g] if total[g] > 0 else 1 / members[g])
                for name, g in group.items() if g in impacts}
