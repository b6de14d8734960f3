"""The router's weight of each row an expert computes on, for the statistics that weigh rows by it.

MoEQuant's affinity-guided GPTQ (`spec.affinity_guided_experts`): a routed expert's Hessian weighs each token by the
router's weight for that expert, sum_t w_t x_t x_t^T, so the tokens the router sends it with conviction shape its
quantization more than those it barely chose. The MoE forward (model/common/expert_parallel.py) says, around an
expert's call, which weight each of its rows has; the Hessian statistic (pipeline/statistics.py) reads it. Nothing
else changes: the expert's output, its ranges and the quant report see the rows as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal

import torch

# how routed experts are calibrated in the statistics passes (ModelAdapter.calibrate_experts)
ExpertStatistics = Literal["routed", "all_tokens", "affinity", "balanced"]
_ROW_WEIGHTS: ContextVar[torch.Tensor | None] = ContextVar("row_weights", default=None)


@contextlib.contextmanager
def routed_rows(weights: torch.Tensor) -> Iterator[None]:
    """Within: the rows reaching an expert's linears carry these router weights (float32 [rows])."""
    reset = _ROW_WEIGHTS.set(weights)
    try:
        yield
    finally:
        _ROW_WEIGHTS.reset(reset)


def row_weights() -> torch.Tensor | None:
    """The router weights of the rows in progress (None: rows are not weighted)."""
    return _ROW_WEIGHTS.get()
