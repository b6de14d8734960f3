"""Resumable runs: after every unit each rank keeps what the rest of the run depends on, so a run stopped at unit
k of 61 (a crash, a preempted node, SIGTERM, kill -9) continues after the last unit every rank finished.

The state lives in the run's temporary output (`.<name>.partial/` beside `--save_path`, the same folder whatever
process runs it), under `resume/`:

- `fingerprint.json`: what the state belongs to (the source's config and index hashes, the practice's bytes, the
  toolkit version, the device type and the rank count); `--resume` refuses state of another run;
- `rank<r>/unit<k>.pt`, per rank after unit k: the calibration state entering unit k + 1 (hidden states, attention
  residual blocks, MTP inputs), the savers' and the processors' state. Written to a temporary name, fsynced,
  renamed, the folder fsynced: a file with its final name is complete. Written in the background while the next
  unit computes (pipeline/layer_wise.py). Each rank keeps its last three (ranks finish a unit in lock-step, so the
  slowest rank is at most one unit behind the fastest, and its write at most one more);
- the quantized tensors themselves are the savers' shards in the temporary output, written once: a saver closes
  its shard at the end of every unit, so a finished unit's tensors are on disk and nothing is written twice.

A resumed run restores every rank at the last unit all of them finished, drops what a rank wrote after it, and
runs the remaining units; its output is byte-identical to an uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from msmodelslim.errors import UserError

STATE_DIR = "resume"
FINGERPRINT = "fingerprint.json"
_UNIT_FILE = re.compile(r"^unit(\d{5})\.pt$")
KEEP = 3  # unit files per rank


def fingerprint(source: dict[str, str], practice: bytes, device_type: str, world_size: int) -> dict[str, Any]:
    from msmodelslim import __version__

    return {"source": source, "practice_sha256": hashlib.sha256(practice).hexdigest(), "toolkit": __version__,
            "device_type": device_type, "world_size": world_size}


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


@dataclass
class ResumeState:
    """The resumable state of one run's temporary output `work_dir`."""

    work_dir: Path

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

    def finished(self, rank: int) -> list[int]:
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

    def save(self, rank: int, unit: int, state: dict[str, Any]) -> None:
        folder = self.root / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / f"unit{unit:05d}.pt", lambda p: torch.save(state, p))
        for old in self.finished(rank)[:-KEEP]:
            (folder / f"unit{old:05d}.pt").unlink(missing_ok=True)

    def check_readable(self, unit: int, world_size: int) -> None:
        """Every rank's file of `unit` opens (torch.save writes a zip whose directory is at its end, so a truncated
        file fails here without reading it all); a damaged one refuses the resume with one line."""
        for rank in range(world_size):
            path = self.root / f"rank{rank}" / f"unit{unit:05d}.pt"
            try:
                with zipfile.ZipFile(path) as archive:
                    archive.namelist()
            except (OSError, zipfile.BadZipFile) as exc:
                raise UserError(f"{path}: the resumable state is damaged ({exc}); discard it with --fresh") from None

    def load(self, rank: int, unit: int) -> dict[str, Any]:
        path = self.root / f"rank{rank}" / f"unit{unit:05d}.pt"
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # a truncated or damaged file: any unpickling error
            raise UserError(f"{path}: the resumable state is damaged ({' '.join(str(exc).split())[:120]}); "
                            f"discard it with --fresh") from None


def check_fingerprint(recorded: dict[str, Any] | None, expected: dict[str, Any], where: Path) -> None:
    """Refuse state of another run, naming the first thing that differs."""
    if recorded is None:
        raise UserError(f"--resume: {where} holds no resumable state; run without --resume")
    labels = {"source": "the checkpoint (--model_path)", "practice_sha256": "the practice",
              "toolkit": "the toolkit version", "device_type": "the device type", "world_size": "the rank count"}
    for key, label in labels.items():
        if recorded.get(key) != expected.get(key):
            raise UserError(f"--resume: the state in {where} belongs to another run: {label} differs (state "
                            f"{recorded.get(key)!r}, now {expected.get(key)!r}); resume with the same arguments, "
                            f"or discard the state with --fresh")
