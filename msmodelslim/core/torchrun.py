"""Runs started by torchrun: one rank per process, the ranks meet through torchrun's environment (env://).

    torchrun --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT] \\
        -m msmodelslim.cli.main quant ... --device npu

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR / MASTER_PORT and TORCHELASTIC_RUN_ID in
every process it starts; that last one is how a process knows it was started by torchrun (a user's MASTER_ADDR alone
keeps the built-in launcher). Nothing is spawned then: expert and data parallelism span every process of every node,
and `--save_path` must be one directory that every node sees (a shared file system), which the run checks before
any compute. The collectives here are the launch's own (sharing the work directory, agreeing on a verdict); the
runner's are in core/dist.py.
"""

from __future__ import annotations

import os
import socket
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

from msmodelslim.core.dist import peer_loss_is_one_line
from msmodelslim.errors import UserError

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
_NEEDED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunRank:
    """Where this process stands in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master: str  # MASTER_ADDR:MASTER_PORT, for messages

    @classmethod
    def from_environment(cls) -> TorchrunRank | None:
        """This process's place when torchrun started it, else None."""
        if RUN_ID_ENV not in os.environ:
            return None
        missing = [name for name in _NEEDED if name not in os.environ]
        if missing:
            raise UserError(f"${RUN_ID_ENV} is set (a torchrun launch) but ${missing[0]} is not; start the run with "
                            f"torchrun, or unset ${RUN_ID_ENV} to use the built-in launcher")
        values = {}
        for name in _NEEDED[:4]:
            raw = os.environ[name]
            if not raw.isdigit():
                raise UserError(f"${name}={raw!r}: expected a non-negative integer (torchrun sets it)")
            values[name] = int(raw)
        rank, world, local, local_world = (values[n] for n in _NEEDED[:4])
        if not (rank < world and local < local_world <= world):
            raise UserError(f"torchrun environment is inconsistent: RANK={rank} WORLD_SIZE={world} "
                            f"LOCAL_RANK={local} LOCAL_WORLD_SIZE={local_world}")
        return cls(rank, world, local, local_world, f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"torchrun rank {self.rank} of {self.world_size} (local {self.local_rank} of {self.local_world_size})"


def join(place: TorchrunRank, backend: str, device: torch.device) -> None:
    """Join the job's process group (env://: torchrun's store, already up when it starts the processes); a rank
    that cannot fails with one line. Collectives keep torch's default timeout, as in the built-in launch."""
    try:
        torch_dist.init_process_group(backend, init_method="env://", rank=place.rank, world_size=place.world_size,
                                      device_id=device if device.type != "cpu" else None)
    except (RuntimeError, OSError, ValueError) as exc:
        raise UserError(f"{place.describe()}: cannot join the ranks at {place.master} "
                        f"({' '.join(str(exc).split())[:200]})") from None


def leave() -> None:
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def share(value: Any, src: int = 0) -> Any:
    """`src`'s value on every rank (a small picklable object)."""
    box = [value]
    with _collective("sharing the output folder"):
        torch_dist.broadcast_object_list(box, src=src)
    return box[0]


def gather(value: Any) -> list[Any]:
    """Every rank's value, in rank order (small picklable objects)."""
    out: list[Any] = [None] * torch_dist.get_world_size()
    with _collective("checking the output folder"):
        torch_dist.all_gather_object(out, value)
    return out


def _collective(what: str) -> AbstractContextManager[None]:
    return peer_loss_is_one_line(what, torch_dist.get_rank(), torch_dist.get_world_size())


def host() -> str:
    return socket.gethostname()
