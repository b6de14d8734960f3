"""Helpers shared by model adapters."""

from __future__ import annotations


def resolve_expert_ep_range(num_experts: int, rank: int, world_size: int) -> range:
    """Contiguous range of routed experts owned by `rank` under expert parallelism.

    Every rank owns the same number of experts, so the expert count must divide evenly; anything else is a
    configuration error that must stop the run before any weight is loaded.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts % world_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the number of devices ({world_size}); "
            f"choose a device count that divides {num_experts}"
        )
    per_rank = num_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)
