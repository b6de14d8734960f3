"""The samples' state between units, past a host-memory budget: one file per micro-batch, read back memory-mapped.

At Kimi-K3 scale the state is about 126 KiB per calibration token (hidden state, attention-residual blocks, MTP
inputs; `assembly.host_state`), so a million tokens do not fit in a rank's host memory. The runner keeps micro-batch
outputs in memory until they reach `budget` bytes and writes the rest to `<folder>/unit<k>/<i>.pt` as they are made.
A spilled state is read back with `torch.load(mmap=True)`: its pages come from the file as the forward reads them,
and the kernel may drop them again (they are clean), so the resident state stays near the budget. The files are the
state: the resumable state of a unit records their names and sizes instead of their tensors, and a unit's folder is
deleted once no kept unit refers to it.

Budget: `$MSMODELSLIM_HOST_STATE_GIB` per rank, else half of the host memory available at the start divided over
the ranks of the host.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from msmodelslim.core.memory import available_host_bytes
from msmodelslim.errors import UserError

BUDGET_ENV = "MSMODELSLIM_HOST_STATE_GIB"  # host memory per rank the samples' state may take before it spills
SPILL_DIR = ".spill"  # in the temporary output, for runs that keep no resumable state (removed at the end)
GIB = 1024**3


@dataclass(frozen=True)
class Spilled:
    """A micro-batch's state kept in a file."""

    path: str
    bytes: int

    def load(self) -> Any:
        try:
            return torch.load(self.path, map_location="cpu", mmap=True, weights_only=False)
        except Exception as exc:  # a removed, truncated or damaged file: any unpickling error
            raise UserError(f"{self.path}: a spilled calibration state is unreadable "
                            f"({' '.join(str(exc).split())[:120]}); discard the run with --fresh") from None


def map_state(value: Any, fn: Any, leaves: tuple[type, ...] = (torch.Tensor,), path: tuple[Any, ...] = ()) -> Any:
    """A sample's state with `fn(leaf, path)` in place of every leaf (a tensor, or an instance of `leaves`) in its
    dicts, lists and tuples; `path`: the keys and indices that lead to the leaf."""
    if isinstance(value, leaves):
        return fn(value, path)
    if isinstance(value, dict):
        return {k: map_state(v, fn, leaves, (*path, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_state(v, fn, leaves, (*path, i)) for i, v in enumerate(value))
    return value


def state_bytes(state: Any) -> int:
    """Bytes of every tensor of a sample's state (tensors in dicts, lists and tuples)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def loaded(state: Any) -> Any:
    """A state as the forward takes it (a spilled one read back)."""
    return state.load() if isinstance(state, Spilled) else state


def host_budget(local_ranks: int) -> int:
    """Bytes of samples' state one rank keeps in host memory."""
    value = os.environ.get(BUDGET_ENV)
    if value is not None:
        try:
            gib = float(value)
        except ValueError:
            gib = -1.0
        if not gib >= 0:
            raise UserError(f"${BUDGET_ENV}: expected a number of GiB >= 0, got {value!r}")
        return int(gib * GIB)
    available = available_host_bytes()
    return available // (2 * max(local_ranks, 1)) if available else 1 << 62


class StateSpill:
    """One rank's spill folder: `folder/unit<k>/<i>.pt` for micro-batch i of the states unit k made."""

    def __init__(self, folder: Path, budget: int) -> None:
        self.folder = folder
        self.budget = budget

    def unit_folder(self, unit: int) -> Path:
        return self.folder / f"unit{unit:05d}"

    def keep(self, unit: int, index: int, state: Any, kept_bytes: int) -> Any:
        """`state` (micro-batch `index` of unit `unit`'s outputs, on the host) as the runner keeps it: itself while
        the outputs kept so far (`kept_bytes`, this one included) fit the budget, else a file."""
        if kept_bytes <= self.budget:
            return state
        folder = self.unit_folder(unit)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{index:06d}.pt"
        torch.save(state, path)
        return Spilled(str(path), path.stat().st_size)

    def drop_before(self, unit: int, keep: set[int] = frozenset()) -> None:
        """Delete the folders of units before `unit` but those of `keep` (the units a kept state refers to)."""
        if not self.folder.is_dir():
            return
        for child in self.folder.iterdir():
            if child.name.startswith("unit") and child.name[4:].isdigit() and int(child.name[4:]) < unit \
                    and int(child.name[4:]) not in keep:
                shutil.rmtree(child, ignore_errors=True)

    def close(self) -> None:
        """Remove the folder (and its parent when that is left empty: the temporary output's `.spill`)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            self.folder.parent.rmdir()
        except OSError:
            pass
