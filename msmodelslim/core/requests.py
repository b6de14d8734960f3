"""What a processor asks of the runner while it transforms one unit.

A processor's `process_unit(ctx)` may be a generator: it yields one of these requests and receives the runner's
answer, so it never runs a calibration forward, registers a hook or issues a collective itself:

    stats = yield Observe(absmax=("mlp.down_proj",))      # -> Stats, reduced over data-parallel ranks
    red = yield Reduce("max", {"w": local_max})            # -> dict, combined over ranks
    results = yield Jobs([Job("mlp.down_proj", ...)])      # -> {key: {output: tensor}}, shared by every rank
    yield Rescaled(("mlp.down_proj",), s)                  # -> None: it divided those modules' inputs by s

Every answer is identical on every rank, and on a rerun or resume with as many ranks: statistics reduce by max
(exact), as integer sums (exact) or, for the replicated linears' Hessians, as float32 sums (their last bits may
depend on the rank count: pipeline/statistics.py); a job runs on exactly one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch


@dataclass(frozen=True)
class Observe:
    """Statistics of modules' inputs (of `quant_error`'s, also outputs) over one pass of the unit as it is now.

    - `absmax`: per input channel, max |x| (float32 [d]).
    - `hessian`: X^T X over every token (float32 [d, d], float32 sums of exact products in a fixed order:
      `pipeline/statistics.py`), and the number of those tokens (`tokens`). Readers of one input get one tensor
      (read-only). No pass of its own: it needs no range.
    - `token_ranges`: module -> inverse channel scales [c, d] of c candidates: per candidate the sum over tokens
      of (max_j |x_j| * inv_j)^2 (float32 [c]), the spread a per-token activation quantizer meets after the input
      is divided by that candidate's scale (integer sums on a grid of the candidate's bound, needs `ranges`), and
      the number of those tokens (`range_tokens`).
    - `head_ranges`: module -> (heads, ratio) for a module whose input is [batch, heads, seq, dim] (an attention's
      FA3 point): per head the narrowest range [low, high] holding `ratio` of each sample's values (ratio 1:
      min/max), then the min of the lows and the max of the highs over samples and ranks (float32 [heads] each;
      exact in any order).
    - `quant_error`: quantized linears (QuantLinear): the quant report's sums of their input (in the weight's basis),
      of what the kernel multiplied by in its place and of their output (`quant.sensitivity.InputSums`), read off
      each call's input and output; float32 sums over ranks (a diagnostic: kept to 4 significant digits).

    `tokens`: observe only the samples of the first `tokens` calibration tokens of the global order
    (`assembly.first_places`, the same on any number of ranks): a statistic that does not need every token costs
    nothing past them. None: every sample. A capped pass gathers nothing ahead for later processors.

    `sample`, `sample_tokens`: the processor will later ask a capped Observe (`tokens` = `sample_tokens`) of these
    modules only: the runner keeps their inputs over those samples from this pass and answers that request from
    them, the same statistics without a forward (a pass saved; pipeline/answers.py).
    """

    absmax: Sequence[str] = ()
    hessian: Sequence[str] = ()
    token_ranges: Mapping[str, torch.Tensor] = field(default_factory=dict)
    ranges: Mapping[str, torch.Tensor] | None = None
    head_ranges: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    quant_error: Sequence[str] = ()
    tokens: int | None = None
    sample: Sequence[str] = ()
    sample_tokens: int | None = None

    def modules(self) -> set[str]:
        """Every module whose inputs this request's statistics read."""
        return {*self.absmax, *self.hessian, *self.token_ranges, *self.head_ranges, *self.quant_error}


@dataclass
class Stats:
    absmax: dict[str, torch.Tensor] = field(default_factory=dict)
    hessian: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    token_ranges: dict[str, torch.Tensor] = field(default_factory=dict)
    range_tokens: dict[str, int] = field(default_factory=dict)
    head_ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # (low, high)
    quant_error: dict[str, Any] = field(default_factory=dict)  # quant.sensitivity.InputSums


@dataclass(frozen=True)
class Reduce:
    """Tensors a processor computed from rank-local modules (routed experts under EP), combined over ranks.

    `max` is exact. `sum` is exact where at most one rank holds a nonzero per element (e.g. one row per expert),
    which is the only way processors use it."""

    op: Literal["max", "sum"]
    tensors: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Job:
    """Heavy per-linear work (a scale search, GPTQ). `run` returns tensors of the declared shapes and dtypes.

    A job on replicated weights runs on one rank (largest cost first onto the least-loaded rank) and its result
    is broadcast; a `local` job (a rank's own experts) runs on its rank only."""

    key: str
    cost: float
    run: Callable[[], dict[str, torch.Tensor]]
    outputs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    local: bool = False


@dataclass(frozen=True)
class Jobs:
    jobs: Sequence[Job]


@dataclass(frozen=True)
class Rescaled:
    """The processor has divided the inputs of `modules` by `scale` (per input channel; smoothing moved it into
    their weights): the runner rescales what it carries for them (pipeline/answers.py). Answered with None."""

    modules: Sequence[str]
    scale: torch.Tensor
