"""What a processor sees of the runner while it transforms one unit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from msmodelslim.core.dist import DistContext
from msmodelslim.model.base import ModelAdapter, Unit


@dataclass
class UnitContext:
    unit: Unit
    module: nn.Module
    adapter: ModelAdapter
    dist: DistContext
    # Runs this rank's calibration samples through the unit as it is now (no state is kept).
    run_samples: Callable[[], None]

    def collect_input_absmax(self, live_names: list[str]) -> dict[str, torch.Tensor]:
        """Per-input-channel max |x| seen by each named module over the calibration set.

        Hooks only record (no collectives inside hooks); replicated modules are then reduced over data-parallel
        ranks in one sorted-name all-reduce. Expert modules (rank-local under EP) already saw every rank's tokens.
        A module that saw no token reports zeros, so every rank reduces the same names.
        """
        modules = dict(self.module.named_modules())
        missing = [n for n in live_names if n not in modules]
        if missing:
            raise KeyError(f"unit {self.unit.name}: no module named {missing[0]!r}")
        stats: dict[str, torch.Tensor] = {}
        handles = []

        def make_hook(name: str) -> Callable:
            def hook(_mod: nn.Module, args: tuple) -> None:
                x = args[0]
                if x.numel() == 0:
                    return
                amax = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
                prev = stats.get(name)
                stats[name] = amax if prev is None else torch.maximum(prev, amax)

            return hook

        for name in live_names:
            handles.append(modules[name].register_forward_pre_hook(make_hook(name)))
        try:
            self.run_samples()
        finally:
            for h in handles:
                h.remove()
        for name in live_names:
            if name not in stats:
                mod = modules[name]
                width = getattr(mod, "in_features", None) or mod.weight.shape[-1]
                stats[name] = torch.zeros(width, dtype=torch.float32, device=self.dist.device)
        replicated = {n: v for n, v in stats.items() if not self.adapter.is_expert(n)}
        stats.update(self.dist.all_reduce_max(replicated))
        return stats
