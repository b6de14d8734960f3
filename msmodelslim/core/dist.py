"""Process-group context and the few collectives the runners use (always in a fixed order).

Collectives carry only what HCCL takes on Atlas A2/A3 (float32, bf16, fp16, int64, int32; bytes for broadcast):
maxima in float32, sums in int64 (exact) or float32 (where one rank contributes per element). Every one of them is
shown to the Ascend op check first, also on a single rank, so a CPU run finds a collective the NPU would refuse.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from msmodelslim.core.ascend_check import check_collective
from msmodelslim.errors import RankLost


@contextmanager
def peer_loss_is_one_line(name: str, rank: int, world_size: int) -> Iterator[None]:
    """A collective that fails because a peer is gone becomes one line naming this rank (`RankLost`), not a
    backend traceback on every surviving rank."""
    try:
        yield
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())[:160]
        raise RankLost(f"rank {rank} of {world_size}: {name} failed, another rank stopped or cannot be reached; the "
                       f"first rank to fail says why ({detail})") from None


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in a (possibly single-process) run."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _collective(self, name: str) -> AbstractContextManager[None]:
        return peer_loss_is_one_line(name, self.rank, self.world_size)

    def barrier(self) -> None:
        if self.is_distributed:
            with self._collective("barrier"):
                torch_dist.barrier()

    def all_reduce_max(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Element-wise max of same-shaped statistics over ranks: one collective, names in sorted order.

        Max is exact in floating point, so every rank ends with bit-identical statistics whatever the rank count.
        Tensors of one float dtype travel in it (float32 for the runner's statistics).
        """
        return self._all_reduce(stats, torch_dist.ReduceOp.MAX)

    def all_reduce_sum(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Element-wise sum over ranks: one collective, names in sorted order, in int64 when every tensor is an
        integer (exact in any order), else in the tensors' float dtype, which rounds in an order that depends on
        the rank count: the replicated linears' Hessians (statistics.py) and the quant report's sums
        (pipeline/report.py, kept to 4 significant digits). The same ranks in the same order give the same bytes."""
        return self._all_reduce(stats, torch_dist.ReduceOp.SUM)

    def _all_reduce(self, stats: dict[str, torch.Tensor], op: torch_dist.ReduceOp) -> dict[str, torch.Tensor]:
        if not stats:
            return stats
        names = sorted(stats)
        dtypes = {stats[n].dtype for n in names}
        if any(t.is_floating_point for t in dtypes):
            if len(dtypes) > 1:
                raise TypeError(f"one all-reduce of several float dtypes {sorted(map(str, dtypes))}: cast first")
            dtype = dtypes.pop()
        else:
            dtype = torch.int64
        check_collective("all_reduce", dtype)
        if not self.is_distributed:
            return stats
        flat = torch.cat([stats[n].reshape(-1).to(self.device, dtype) for n in names])
        with self._collective("all_reduce"):
            torch_dist.all_reduce(flat, op=op)
        out, offset = {}, 0
        for n in names:
            numel = stats[n].numel()
            out[n] = flat[offset : offset + numel].view_as(stats[n]).to(stats[n].device, stats[n].dtype)
            offset += numel
        return out

    def all_gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's row block of a 2-D tensor (row counts may differ), in rank order."""
        if not self.is_distributed:
            return [t]
        check_collective("all_gather", t.dtype)
        count = torch.tensor([t.shape[0]], dtype=torch.int64, device=self.device)
        counts = [torch.zeros_like(count) for _ in range(self.world_size)]
        with self._collective("all_gather"):
            torch_dist.all_gather(counts, count)
        sizes = [int(c.item()) for c in counts]
        padded = t.new_zeros((max(sizes), t.shape[1]))
        padded[: t.shape[0]] = t
        blocks = [torch.empty_like(padded) for _ in range(self.world_size)]
        with self._collective("all_gather"):
            torch_dist.all_gather(blocks, padded.contiguous())
        return [b[:n] for b, n in zip(blocks, sizes)]

    def exchange_sum(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """parts[j]: what this rank computed for rank j. Returns the sum over ranks of their parts for this rank
        (one all-to-all: each rank receives only its own blocks, W times less than an all-reduce of them all).
        Exact where at most one rank contributes per element, the only way expert parallelism uses it."""
        mine = parts[self.rank]
        if not self.is_distributed:
            return mine
        check_collective("all_to_all", mine.dtype)
        send = torch.cat([p.reshape(-1) for p in parts])
        recv = torch.empty(self.world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        with self._collective("all_to_all"):
            torch_dist.all_to_all_single(recv, send, [mine.numel()] * self.world_size, [p.numel() for p in parts])
        return recv.view(self.world_size, *mine.shape).sum(dim=0)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """`src`'s values in `tensor` on every rank (in place; moved through this rank's device and back)."""
        check_collective("broadcast", tensor.dtype)
        if not self.is_distributed:
            return tensor
        buf = tensor.to(self.device)
        with self._collective("broadcast"):
            torch_dist.broadcast(buf, src=src)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor


SINGLE = DistContext()


# The rank whose tokens the code in progress computes on: an expert under expert parallelism computes on every
# rank's tokens, one rank's block at a time (model/common/expert_parallel.py); None: this rank's own.
_TOKEN_SOURCE: ContextVar[int | None] = ContextVar("token_source", default=None)


@contextmanager
def token_source(rank: int) -> Iterator[None]:
    reset = _TOKEN_SOURCE.set(rank)
    try:
        yield
    finally:
        _TOKEN_SOURCE.reset(reset)


def current_token_source() -> int | None:
    return _TOKEN_SOURCE.get()
