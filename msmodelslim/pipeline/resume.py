"""Resumable runs: after every unit each rank keeps what the rest of the run depends on, so a run stopped at unit
k of 61 (a crash, a preempted node, SIGTERM, kill -9) continues after the last unit every rank finished.

The state lives in the run's temporary output (`.<name>.partial/` beside `--save_path`, the same folder whatever
process runs it), under `resume/`:

- `fingerprint.json`: what the state belongs to (the source's config and index hashes, the practice's bytes, the
  content of every file the practice reads (fallback names files and reports, the calibration records and their
  images), the toolkit version, the device type and the rank count); `--resume` refuses state of another run,
  naming what differs;
- `rank<r>/unit<k>.pt`, per rank after unit k (after every `spec.resume_every`-th unit and the last): the
  calibration state entering unit k + 1 (hidden states, attention residual blocks, MTP inputs; none after the last
  unit, which nothing follows), the savers' and the processors' state. Written to a temporary name, fsynced,
  renamed, the folder fsynced: a file with its final name is complete. Written in the background while the next
  unit computes (pipeline/layer_wise.py). Each rank keeps its last three (ranks finish a unit in lock-step, so the
  slowest rank is at most one unit behind the fastest, and its write at most one more);
- incremental: a state tensor already in an earlier kept file of the rank, unchanged (the same tensor object at the
  same version: a unit passes its finished attention-residual blocks, MTP inputs and token ids through untouched,
  `layer_wise.HostCopies`), is recorded as a `StoredTensor` reference to it instead of written again, unless that
  would keep much more of that file than it uses (`spill.referable`). A Kimi-K3 unit then writes its new hidden
  state, ~14 of the ~140 KiB per token. A file that a kept file refers to is kept too;
- `rank<r>/unit<k>.json`, written before the `.pt` gets its name: the checksum (CRC-32, `files.file_checksum`;
  that file's taken as it is written) of that file, of the files it refers to and of every shard the rank's savers
  had written by then. `--resume` checks them all before any compute (a damaged file that is still a valid
  archive, a truncated shard) and refuses with one line;
- the quantized tensors themselves are the savers' shards in the temporary output, written once: a saver closes
  its shard at the end of every unit, so a finished unit's tensors are on disk and nothing is written twice.

A resumed run restores every rank at the last unit all of them finished, drops what a rank wrote after it (and a
shard a killed rank left half-written), and runs the remaining units; its output is byte-identical to an
uninterrupted run's. Before the savers merge their shards into the output's names the state is dropped
(`invalidate`: one rename), so a stop after that point never leaves state that claims to be resumable.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from msmodelslim.core.files import ChecksumWriter, file_checksum
from msmodelslim.errors import UserError
from msmodelslim.pipeline.spill import TensorOrigins, map_state, save_without_crc

STATE_DIR = "resume"
FINGERPRINT = "fingerprint.json"
_UNIT_FILE = re.compile(r"^unit(\d{5})\.pt$")
_DROPPED = "resume.dropped"  # the state's folder renamed away, then deleted
KEEP = 3  # unit files per rank


def fingerprint(source: dict[str, str], practice: bytes, inputs: dict[str, str], device_type: str,
                world_size: int) -> dict[str, Any]:
    """What the state belongs to: the run's input (`input_identity`), the toolkit and the ranks."""
    from msmodelslim import __version__

    return {**input_identity(source, practice, inputs), "toolkit": __version__, "device_type": device_type,
            "world_size": world_size}


def input_identity(source: dict[str, str], practice: bytes, inputs: dict[str, str]) -> dict[str, Any]:
    """Everything that decides a run's output: the checkpoint's identity, the practice's bytes and the content of
    every file the practice reads (`inputs`: a name a user knows the file by -> sha256, app/quant.py
    `practice_inputs`). A resume and every torchrun rank must agree on all of it (`identity_difference`)."""
    return {"source": source, "practice_sha256": hashlib.sha256(practice).hexdigest(), "inputs": inputs}


def identity_difference(recorded: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """The first part of `input_identity` (or of a `fingerprint`) that differs, in words naming the file, else
    None."""
    from msmodelslim.source.checkpoint import different_source

    key = different_source(recorded.get("source") or {}, actual["source"])
    if key is not None or set(recorded.get("source") or {}) != set(actual["source"]):
        return f"the checkpoint (--model_path) differs (its {key or 'identity'})"
    if recorded.get("practice_sha256") != actual["practice_sha256"]:
        return "the practice differs (its bytes)"
    before, now = recorded.get("inputs") or {}, actual["inputs"]
    changed = sorted(name for name in set(before) | set(now) if before.get(name) != now.get(name))
    return f"{changed[0]} differs (its content)" if changed else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Any) -> None:
    """`write(tmp)` then fsync, rename onto `path`, fsync the folder: `path` exists only complete."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@dataclass(frozen=True)
class StoredTensor:
    """A state tensor kept in this rank's earlier file of `unit`: the tensor at `path` (keys and indices) in that
    file's `states[sample]`."""

    unit: int
    sample: int
    path: tuple[Any, ...]


@dataclass
class ResumeState:
    """The resumable state of one run's temporary output `work_dir`."""

    work_dir: Path
    # the state tensors of the last file written or read: their StoredTensors
    _stored: TensorOrigins = field(default_factory=TensorOrigins, init=False, repr=False)

    @property
    def root(self) -> Path:
        return self.work_dir / STATE_DIR

    def start(self, print_: dict[str, Any]) -> None:
        """A fresh run: record what the state will belong to."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.root / FINGERPRINT, lambda p: p.write_text(json.dumps(print_, sort_keys=True)))

    def recorded_fingerprint(self) -> dict[str, Any] | None:
        path = self.root / FINGERPRINT
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise UserError(f"{path}: the resumable state's fingerprint is unreadable; discard the state with "
                            f"--fresh") from None

    def _unit_path(self, rank: int, unit: int, suffix: str = ".pt") -> Path:
        return self.root / f"rank{rank}" / f"unit{unit:05d}{suffix}"

    def finished(self, rank: int) -> list[int]:
        """The units whose file this rank holds (its manifest is written before it gets its name)."""
        folder = self.root / f"rank{rank}"
        if not folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _UNIT_FILE.match(p.name)))

    def resume_point(self, world_size: int) -> int | None:
        """The last unit every rank finished (and still holds), or None."""
        per_rank = [set(self.finished(r)) for r in range(world_size)]
        common = set.intersection(*per_rank) if per_rank else set()
        return max(common) if common else None

    def has_units(self) -> bool:
        """Some rank kept some unit (whatever the rank count)."""
        return self.root.is_dir() and any(_UNIT_FILE.match(p.name) for p in self.root.glob("rank*/*"))

    def save(self, rank: int, unit: int, state: dict[str, Any], shards: dict[str, str]) -> None:
        """Keep `state` after `unit`; `shards`: the files (relative to the work dir) the rank's savers have written
        so far, with their checksums."""
        folder = self.root / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        path = self._unit_path(rank, unit)
        tmp = path.with_name(path.name + ".tmp")
        states, refers = self._share_stored(rank, unit, state["states"])
        with open(tmp, "wb") as f:
            written = ChecksumWriter(f)  # its checksum as it is written: not read back for it
            save_without_crc({**state, "states": states}, written)
            f.flush()
            os.fsync(f.fileno())
        manifest = {"checksum": written.checksum, "shards": shards,
                    "refers": {str(u): self._manifest(rank, u)["checksum"] for u in sorted(refers)}}
        write_atomic(self._unit_path(rank, unit, ".json"), lambda p: p.write_text(json.dumps(manifest)))
        os.replace(tmp, path)
        _fsync_dir(folder)
        finished = self.finished(rank)
        needed = {int(u) for kept in finished[-KEEP:] for u in self._manifest(rank, kept).get("refers", {})}
        for old in finished[:-KEEP]:
            if old not in needed:
                self._unit_path(rank, old).unlink(missing_ok=True)
                self._unit_path(rank, old, ".json").unlink(missing_ok=True)

    def latest(self, rank: int) -> list[int]:
        """The units a resume may continue after (the last KEEP this rank holds; older files that they refer to
        are kept for their tensors alone)."""
        return self.finished(rank)[-KEEP:]

    def _manifest(self, rank: int, unit: int) -> dict[str, Any]:
        return json.loads(self._unit_path(rank, unit, ".json").read_text(encoding="utf-8"))

    def _share_stored(self, rank: int, unit: int, states: list[Any]) -> tuple[list[Any], dict[int, int]]:
        """`states` with every tensor already kept in an earlier file, unchanged, replaced by its `StoredTensor`
        where that file is `referable`, and the units referred to (with their files' sizes); the registry then
        holds the tensors of these states."""
        refers = self._stored.referable_files(states, lambda where: where.unit,
                                              lambda u: self._unit_path(rank, u).stat().st_size)
        stored = TensorOrigins()

        def share(value: torch.Tensor, sample: int, path: tuple[Any, ...]) -> Any:
            where = self._stored.where(value)
            if where is not None and where.unit in refers:
                stored.remember(value, where)
                return where
            stored.remember(value, StoredTensor(unit, sample, path))
            return value

        shared = [map_state(s, lambda v, path, i=i: share(v, i, path)) for i, s in enumerate(states)]
        self._stored = stored
        return shared, refers

    def verify(self, unit: int, world_size: int) -> None:
        """Every rank's file of `unit` and every shard it counts have the bytes recorded when the unit was kept;
        anything else refuses the resume with one line naming the file."""
        checks: list[tuple[Path, str]] = []
        for rank in range(world_size):
            manifest_path = self._unit_path(rank, unit, ".json")
            try:
                manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
                checks.append((self._unit_path(rank, unit), manifest["checksum"]))
                checks += [(self._unit_path(rank, int(u)), digest)
                           for u, digest in sorted(manifest.get("refers", {}).items())]
                checks += [(self.work_dir / name, digest) for name, digest in sorted(manifest["shards"].items())]
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UserError(f"{manifest_path}: the resumable state is damaged (its checksums are unreadable: "
                                f"{exc.__class__.__name__}); discard it with --fresh") from None

        def damaged(check: tuple[Path, str]) -> str | None:
            path, digest = check
            try:
                actual = file_checksum(path)
            except OSError as exc:
                return f"{path}: {exc.strerror or exc}"
            return None if actual == digest else f"{path}: its checksum differs from the one recorded with the unit"

        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            problems = [p for p in pool.map(damaged, checks) if p is not None]
        if problems:
            raise UserError(f"the resumable state is damaged ({problems[0]}; {len(problems)} file(s)); discard it "
                            f"with --fresh")

    def drop_interrupted_writes(self) -> None:
        """Remove the files a killed rank was writing when it died: safetensors writes a shard to `.tmpXXXXXX` in
        the temporary output and renames it when complete, so a kill mid-write leaves one that would be
        published with the output."""
        for path in self.work_dir.iterdir():
            if path.name.startswith(".tmp") and path.is_file():
                path.unlink(missing_ok=True)

    def _read(self, rank: int, unit: int, mmap: bool = False) -> dict[str, Any]:
        path = self._unit_path(rank, unit)
        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        except Exception as exc:  # a truncated or damaged file: any unpickling error
            raise UserError(f"{path}: the resumable state is damaged ({' '.join(str(exc).split())[:120]}); "
                            f"discard it with --fresh") from None

    def load(self, rank: int, unit: int) -> dict[str, Any]:
        """The state kept after `unit`, its references resolved (the files referred to are read memory-mapped: only
        the tensors taken are read); the registry then holds its tensors, so the next file refers to them."""
        kept = self._read(rank, unit)
        earlier: dict[int, dict[str, Any]] = {}
        stored = TensorOrigins()

        def resolve(value: torch.Tensor | StoredTensor, sample: int, path: tuple[Any, ...]) -> torch.Tensor:
            where = value if isinstance(value, StoredTensor) else StoredTensor(unit, sample, path)
            if isinstance(value, StoredTensor):
                if value.unit not in earlier:
                    earlier[value.unit] = self._read(rank, value.unit, mmap=True)
                value = earlier[value.unit]["states"][value.sample]
                for key in where.path:
                    value = value[key]
            stored.remember(value, where)
            return value

        kept["states"] = [map_state(s, lambda v, path, i=i: resolve(v, i, path), (torch.Tensor, StoredTensor))
                          for i, s in enumerate(kept["states"])]
        self._stored = stored
        return kept

    def invalidate(self) -> None:
        """Drop the state at once (one rename), then delete it: from here on the run cannot be resumed."""
        dropped = self.work_dir / _DROPPED
        shutil.rmtree(dropped, ignore_errors=True)  # left by a drop that a crash cut short
        if self.root.exists():
            os.replace(self.root, dropped)
            _fsync_dir(self.work_dir)
            shutil.rmtree(dropped, ignore_errors=True)


def check_fingerprint(recorded: dict[str, Any] | None, expected: dict[str, Any], where: Path) -> None:
    """Refuse state of another run, naming the first thing that differs."""
    if recorded is None:
        raise UserError(f"--resume: {where} holds no resumable state; run without --resume")
    differs = identity_difference(recorded, expected)
    labels = {"toolkit": "the toolkit version", "device_type": "the device type", "world_size": "the rank count"}
    for key, label in labels.items():
        if differs is None and recorded.get(key) != expected.get(key):
            differs = f"{label} differs (state {recorded.get(key)!r}, now {expected.get(key)!r})"
    if differs is not None:
        raise UserError(f"--resume: the state in {where} belongs to another run: {differs}; resume with the same "
                        f"arguments and files, or discard the state with --fresh")
