"""Process-group context and the few collectives the runners use (always in a fixed order)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as torch_dist


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

    def barrier(self) -> None:
        if self.is_distributed:
            torch_dist.barrier()

    def all_reduce_max(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Element-wise max of same-shaped statistics over ranks: one collective, names in sorted order.

        Max is exact in floating point, so every rank ends with bit-identical statistics whatever the rank count.
        """
        return self._all_reduce(stats, torch_dist.ReduceOp.MAX, torch.float32)

    def all_reduce_sum(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Element-wise sum over ranks: one collective, names in sorted order, in int64 when every tensor is an
        integer, else in float64. Exact in any order for integer values (below 2^53 in float64) and where one rank
        contributes per element; the runner sums nothing else."""
        exact = all(not t.is_floating_point() for t in stats.values())
        return self._all_reduce(stats, torch_dist.ReduceOp.SUM, torch.int64 if exact else torch.float64)

    def _all_reduce(self, stats: dict[str, torch.Tensor], op: torch_dist.ReduceOp,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
        if not self.is_distributed or not stats:
            return stats
        names = sorted(stats)
        flat = torch.cat([stats[n].reshape(-1).to(self.device, dtype) for n in names])
        torch_dist.all_reduce(flat, op=op)
        out, offset = {}, 0
        for n in names:
            numel = stats[n].numel()
            out[n] = flat[offset : offset + numel].view_as(stats[n]).to(stats[n].device, stats[n].dtype)
            offset += numel
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """`src`'s values in `tensor` on every rank (in place; moved through this rank's device and back)."""
        if not self.is_distributed:
            return tensor
        buf = tensor.to(self.device)
        torch_dist.broadcast(buf, src=src)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor


SINGLE = DistContext()
