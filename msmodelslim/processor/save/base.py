"""Saver protocol and registry: a saver writes each unit's tensors as the runner finishes it, then merges.

Contract (docs/dev/architecture.md):
    saver = SAVERS[type](config, adapter, work_dir, dist)
    saver.save_unit(unit, module)   # every rank, after the unit is processed; each rank writes what it owns
    saver.finish_rank()             # every rank: flush and record its part
    saver.merge(metadata, extras)   # rank 0, after the runner's barrier: merge the ranks' parts
A saver writes only into `work_dir` (a temporary directory the app publishes after success).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from msmodelslim.core.config import StrictConfig
from msmodelslim.core.dist import DistContext

if TYPE_CHECKING:
    from msmodelslim.model.base import ModelAdapter, Unit


@dataclass
class SaverConfig(StrictConfig):
    """Base of every saver config; subclasses are dataclasses whose fields are the YAML keys (checked by the
    schema builder, from a practice or from `build(**fields)`)."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field for values out of range."""


class Saver(ABC):
    config_cls: type[SaverConfig] = SaverConfig

    def __init__(self, config: SaverConfig, adapter: ModelAdapter, work_dir: Path, dist: DistContext) -> None:
        self.config = config
        self.adapter = adapter
        self.work_dir = Path(work_dir)
        self.dist = dist

    @abstractmethod
    def save_unit(self, unit: Unit, module: nn.Module) -> None:
        """Write (or buffer) what this rank owns of `unit`."""

    @abstractmethod
    def finish_rank(self) -> None:
        """Flush what this rank holds and record its part (every rank)."""

    @abstractmethod
    def resume_state(self) -> dict[str, Any]:
        """What this rank has written so far (after a unit: nothing may be held back in memory then)."""

    @abstractmethod
    def restore_state(self, state: dict[str, Any]) -> None:
        """Continue from `resume_state()`'s value, dropping anything this rank wrote after it."""

    def written_files(self, state: dict[str, Any]) -> dict[str, str]:
        """The files a `resume_state()` value counts (relative to the work dir) -> their checksum, once `in_flight()`
        of that moment is done: the resumable state records them with every unit and `--resume` checks them."""
        return {}

    def write_behind(self) -> None:
        """From now on write files in a background thread while the next unit computes (`in_flight()` says which
        writes are not known done; `finish_rank()` waits for them all). Without it, in line."""

    def in_flight(self) -> list[Future]:
        """The writes handed to the background thread and not yet waited for (a failure is raised by its result)."""
        return []

    def close(self) -> None:
        """The run ended, done or failed: no write of this saver left running."""

    @abstractmethod
    def merge(self, metadata: dict[str, Any], extras: Any = None) -> None:
        """Rank 0, once every rank has finished: merge the parts into the final index/description."""

    def finalize(self, metadata: dict[str, Any], extras: Any = None) -> None:
        """Both steps, in a single-process run (the runner does them with barriers between the ranks)."""
        if self.dist.is_distributed:
            raise RuntimeError("finalize is for single-process runs; the runner finishes distributed ones")
        self.finish_rank()
        self.merge(metadata, extras)


SAVERS: dict[str, type[Saver]] = {}


def register_saver(name: str, config_cls: type[SaverConfig]) -> Callable[[type[Saver]], type[Saver]]:
    def wrap(cls: type[Saver]) -> type[Saver]:
        if name in SAVERS:
            raise ValueError(f"saver type {name!r} registered twice")
        cls.config_cls = config_cls
        config_cls._yaml_type = name
        SAVERS[name] = cls
        return cls

    return wrap
