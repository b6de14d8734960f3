"""The samples' state between units, past a host-memory budget: one file per micro-batch, read back memory-mapped.

At Kimi-K3 scale the state is about 140 KiB per calibration token (hidden state, attention-residual blocks, MTP
inputs; `assembly.host_state`), so a million tokens do not fit in a rank's host memory. The runner keeps micro-batch
outputs in memory until they reach `budget` bytes and writes the rest to `<folder>/unit<k>/<i>.pt` as they are made.
A spilled state is read back with `torch.load(mmap=True)`: its pages come from the file as the forward reads them,
and the kernel may drop them again (they are clean), so the resident state stays near the budget. The files are the
state: the resumable state of a unit records their names and sizes instead of their tensors.

Incremental, like the resumable state: a tensor a unit passes through untouched (the same tensor object it read
from a spill file, at the same version: Kimi-K3's finished attention-residual blocks, MTP inputs and token ids,
`layer_wise.HostCopies`) is written as a `SpillRef` to the file that holds it, so a decoder unit writes its new
hidden state, ~14 of the ~140 KiB per token. A reference always names the file the bytes are in (one read back
through a reference is remembered at its origin), so references never chain, and not where a reference would keep
much more of that file than it uses (`referable`). Each unit folder lists the folders its files refer to
(`refers.json`); a folder is deleted once no live or kept unit's folder is it or refers to it.

Budget: `$MSMODELSLIM_HOST_STATE_GIB` per rank, else half of the host memory available at the start divided over
the ranks of the host.
"""

from __future__ import annotations

import json
import os
import shutil
import weakref
from collections.abc import Callable
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
class SpillRef:
    """In a spill file: a tensor kept unchanged in an earlier one, at `keys` (the keys and indices) of its state."""

    path: str
    keys: tuple[Any, ...]


@dataclass(frozen=True)
class Spilled:
    """A micro-batch's state kept in a file; `refers`: the earlier files (path, bytes) its `SpillRef`s point into."""

    path: str
    bytes: int
    refers: tuple[tuple[str, int], ...] = ()

    def missing(self) -> str | None:
        """The first of its files that is gone or has another size than when it was written, if any."""
        for path, size in ((self.path, self.bytes), *self.refers):
            if not os.path.isfile(path) or os.path.getsize(path) != size:
                return path
        return None


def _read(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as exc:  # a removed, truncated or damaged file: any unpickling error
        raise UserError(f"{path}: a spilled calibration state is unreadable "
                        f"({' '.join(str(exc).split())[:120]}); discard the run with --fresh") from None


def save_without_crc(obj: Any, path: Path | str | Any) -> None:
    """`torch.save` (to a path or a binary file) without the archive's CRC-32 of every record, which torch never
    checks on load (the resumable state checks its files with `file_checksum`): 40 % of the save's time. The switch
    is process-wide; two threads saving at once may leave it off, which changes no file torch reads."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.6 always computes it
        torch.save(obj, path)
        return
    previous, config.save.compute_crc32 = config.save.compute_crc32, False
    try:
        torch.save(obj, path)
    finally:
        config.save.compute_crc32 = previous


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


def referable(used: int, size: int) -> bool:
    """Whether a new file refers to an earlier file of `size` bytes for `used` bytes of its tensors, rather than
    writing them again. A reference keeps the whole file on disk: not where that keeps over three times the referred
    bytes, and over 1 MiB, for nothing (the token ids alone would keep the vision unit's pixels there all run)."""
    return size - used <= max(3 * used, 1 << 20)


class TensorOrigins:
    """Which earlier file holds a tensor: the same tensor object, at the version it had when that file was written or
    read back, is the tensor in that file (`where`: its place there). Weak references, so it never keeps a replaced
    state alive. The spill and the resumable state refer to earlier files through it."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, int, Any]] = {}

    def remember(self, value: torch.Tensor, where: Any) -> None:
        self._known[id(value)] = (weakref.ref(value), value._version, where)

    def where(self, value: torch.Tensor) -> Any | None:
        known = self._known.get(id(value))
        return known[2] if known is not None and known[0]() is value and known[1] == value._version else None

    def drop_dead(self) -> None:
        self._known = {key: known for key, known in self._known.items() if known[0]() is not None}

    def referable_files(self, states: list[Any], file_of: Callable[[Any], Any],
                        size: Callable[[Any], int]) -> dict[Any, int]:
        """The earlier files (`file_of(where)`) that hold tensors of `states` and are `referable` for them, with
        their sizes."""
        used: dict[Any, int] = {}

        def count(value: torch.Tensor, _keys: tuple[Any, ...]) -> None:
            if (where := self.where(value)) is not None:
                used[file_of(where)] = used.get(file_of(where), 0) + value.numel() * value.element_size()

        for state in states:
            map_state(state, count)
        sizes = {file: size(file) for file in used}
        return {file: sizes[file] for file, n in used.items() if referable(n, sizes[file])}


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
        self._origins = TensorOrigins()  # the tensors of the spilled states read back: their SpillRefs

    def unit_folder(self, unit: int) -> Path:
        return self.folder / f"unit{unit:05d}"

    def load(self, state: Any) -> Any:
        """A state as the forward takes it: a spilled one read back (memory-mapped, its references resolved), each
        tensor remembered with the file that holds it."""
        if not isinstance(state, Spilled):
            return state
        self._origins.drop_dead()
        earlier: dict[str, Any] = {}

        def resolve(value: torch.Tensor | SpillRef, keys: tuple[Any, ...]) -> torch.Tensor:
            where = value if isinstance(value, SpillRef) else SpillRef(state.path, keys)
            if isinstance(value, SpillRef):
                if value.path not in earlier:
                    earlier[value.path] = _read(value.path)
                value = earlier[value.path]
                for key in where.keys:
                    value = value[key]
            self._origins.remember(value, where)
            return value

        return map_state(_read(state.path), resolve, (torch.Tensor, SpillRef))

    def keep(self, unit: int, index: int, state: Any, kept_bytes: int) -> Any:
        """`state` (micro-batch `index` of unit `unit`'s outputs, on the host) as the runner keeps it: itself while
        the outputs kept so far (`kept_bytes`, this one included) fit the budget, else a file (the tensors read
        back from a spill file and passed through unchanged as references to it)."""
        if kept_bytes <= self.budget:
            return state
        folder = self.unit_folder(unit)
        folder.mkdir(parents=True, exist_ok=True)

        refers = self._origins.referable_files([state], lambda where: where.path, os.path.getsize)

        def share(value: torch.Tensor, _keys: tuple[Any, ...]) -> Any:
            where = self._origins.where(value)
            return where if where is not None and where.path in refers else value

        path = folder / f"{index:06d}.pt"
        save_without_crc(map_state(state, share), path)
        self._note_refers(folder, {Path(p).parent.name for p in refers})
        return Spilled(str(path), path.stat().st_size, tuple(sorted(refers.items())))

    def _note_refers(self, folder: Path, names: set[str]) -> None:
        listed = folder / "refers.json"
        known = set(json.loads(listed.read_text())) if listed.is_file() else set()
        if not names <= known:
            tmp = listed.with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(known | names)))
            os.replace(tmp, listed)

    def drop_before(self, unit: int, keep: set[int] = frozenset()) -> None:
        """Delete the folders of units before `unit` but those of `keep` (the units a kept state belongs to) and
        those that the folders of these units and of units from `unit` on refer to."""
        if not self.folder.is_dir():
            return
        units = {int(child.name[4:]): child for child in self.folder.iterdir()
                 if child.name.startswith("unit") and child.name[4:].isdigit()}
        live = {k for k in units if k >= unit or k in keep}
        needed = {units[k].name for k in live}
        for k in live:
            listed = units[k] / "refers.json"
            if listed.is_file():
                needed.update(json.loads(listed.read_text()))
        for child in units.values():
            if child.name not in needed:
                shutil.rmtree(child, ignore_errors=True)

    def close(self) -> None:
        """Remove the folder (and its parent when that is left empty: the temporary output's `.spill`)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            self.folder.parent.rmdir()
        except OSError:
            pass
