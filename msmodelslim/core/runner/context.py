"""The runner's view of one unit while processors transform it, and the service that answers their requests.

`run_processor(processor, ctx)` drives a processor: a plain `process_unit` just runs; a generator one yields
requests (`core/runner/requests.py`) that `serve` answers here. This module owns the calibration passes, the hooks
and every collective a processor needs, so processors are transforms and stay rank-agnostic.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from msmodelslim.core.dist import DistContext
from msmodelslim.core.runner.requests import Job, Jobs, Observe, Reduce, Stats
from msmodelslim.errors import UserError
from msmodelslim.model.base import ModelAdapter, Unit

HESSIAN_GRID_BITS = 15  # x is rounded to 2^15 steps of its channel range: products <= 2^30, exact float64 sums
HESSIAN_MAX_TOKENS = 1 << (53 - 2 * HESSIAN_GRID_BITS)  # sums of products stay integers below 2^53
TOKEN_RANGE_GRID_BITS = 40  # (max|x| / bound)^2 in steps of 2^-40: exact int64 sums up to 2^23 tokens


@dataclass
class UnitContext:
    unit: Unit
    module: nn.Module
    adapter: ModelAdapter
    dist: DistContext
    # Runs this rank's calibration samples through the unit as it is now (no state is kept).
    run_samples: Callable[[], None]

    @property
    def device(self) -> torch.device:
        return self.dist.device


def run_processor(processor: Any, ctx: UnitContext) -> None:
    """Apply one processor to the unit, answering each request it yields."""
    steps = processor.process_unit(ctx)
    if not inspect.isgenerator(steps):
        return
    reply: Any = None
    while True:
        try:
            request = steps.send(reply)
        except StopIteration:
            return
        reply = serve(ctx, request)


def serve(ctx: UnitContext, request: Any) -> Any:
    if isinstance(request, Observe):
        return observe(ctx, request)
    if isinstance(request, Reduce):
        return reduce_tensors(ctx.dist, request)
    if isinstance(request, Jobs):
        return run_jobs(ctx.dist, request.jobs)
    raise TypeError(f"unit {ctx.unit.name}: a processor asked for {type(request).__name__}, which the runner "
                    f"does not serve")


# ---------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------
def _flat_input(args: tuple) -> torch.Tensor:
    x = args[0]
    return x.detach().reshape(-1, x.shape[-1])


def _grid_step(ranges: torch.Tensor) -> torch.Tensor:
    r = ranges.double()
    return torch.where(r > 0, r / (1 << HESSIAN_GRID_BITS), torch.ones_like(r))


class _Recorder:
    """The hooks of one pass: each records into its own accumulators (no collective inside a hook)."""

    def __init__(self, request: Observe, ranges: dict[str, torch.Tensor]) -> None:
        self.absmax: dict[str, torch.Tensor] = {}
        self.hessian: dict[str, torch.Tensor] = {}  # sums on the grid: integers, held exactly in float64
        self.tokens: dict[str, torch.Tensor] = {}  # int64 [1]: rows the Hessian summed
        self.token_ranges: dict[str, torch.Tensor] = {}  # int64 sums on the grid
        self.request = request
        self.steps = {n: _grid_step(ranges[n]) for n in request.hessian}
        self.range_quanta: dict[str, torch.Tensor] = {}
        for name, inv in request.token_ranges.items():
            bound = (ranges[name].double()[None, :] * inv.double()).amax(dim=-1)  # [c]: max over tokens can reach
            self.range_quanta[name] = torch.where(bound > 0, bound * bound, torch.ones_like(bound)) \
                * 2.0 ** -TOKEN_RANGE_GRID_BITS
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (input, step, its X^T X)
        self.head_ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hooks(self, name: str) -> list[Callable]:
        if name in self.request.head_ranges:
            return [self._head_range]  # a [batch, heads, seq, dim] input: not a linear's
        out = []
        if name in self.request.absmax:
            out.append(self._absmax)
        if name in self.steps:
            out.append(self._hessian)
        if name in self.range_quanta:
            out.append(self._token_range)
        return out

    def _absmax(self, name: str, x: torch.Tensor) -> None:
        amax = x.abs().amax(dim=0).float()
        prev = self.absmax.get(name)
        self.absmax[name] = amax if prev is None else torch.maximum(prev, amax)

    def _hessian(self, name: str, x: torch.Tensor) -> None:
        step = self.steps[name].to(x.device)
        last = self._last
        if last is not None and last[0].data_ptr() == x.data_ptr() and last[0].shape == x.shape \
                and last[0]._version == x._version and torch.equal(last[1], step):
            h = last[2]  # q, k, v reading one tensor: one product (holding x keeps its address unique)
        else:
            limit = float(1 << HESSIAN_GRID_BITS)
            grid = torch.round(x.double() / step).clamp_(-limit, limit)
            h = grid.t() @ grid  # exact: every partial sum is an integer below 2^53
            self._last = (x, step, h)
        prev = self.hessian.get(name)
        self.hessian[name] = h.clone() if prev is None else prev.add_(h)
        count = torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)
        self.tokens[name] = count if name not in self.tokens else self.tokens[name].add_(count)
        if int(self.tokens[name]) > HESSIAN_MAX_TOKENS:
            raise UserError(_too_many_tokens(name))

    def _token_range(self, name: str, x: torch.Tensor) -> None:
        inv = self.request.token_ranges[name].to(x.device, torch.float64)
        quanta = self.range_quanta[name].to(x.device)
        xa = x.abs().double()
        sums = torch.stack([torch.round((xa * inv[c]).amax(dim=-1).square() / quanta[c]).to(torch.int64).sum()
                            for c in range(inv.shape[0])])
        prev = self.token_ranges.get(name)
        self.token_ranges[name] = sums if prev is None else prev.add_(sums)

    def _head_range(self, name: str, x: torch.Tensor) -> None:
        heads, ratio = self.request.head_ranges[name]
        if x.dim() != 4 or x.shape[1] != heads:
            raise ValueError(f"{name}: expected an input [batch, {heads}, seq, dim], got {list(x.shape)}")
        low, high = recall_window(x.detach().transpose(0, 1).reshape(heads, -1), ratio)
        prev = self.head_ranges.get(name)
        self.head_ranges[name] = (low, high) if prev is None else (torch.minimum(prev[0], low),
                                                                   torch.maximum(prev[1], high))


def recall_window(x: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x [rows, n]: the narrowest range [low, high] of sorted values that holds int(ratio * n) of
    them (the first such window on ties), as msModelSlim's RecallWindowObserver picks it; float32 [rows] each.
    Only the n - keep + 1 smallest and largest values can bound such a window, so two top-k's find it."""
    x = x.float()
    n = x.shape[1]
    keep = int(ratio * n)
    if keep >= n or keep < 1:
        return x.amin(dim=1), x.amax(dim=1)
    count = n - keep + 1
    lows = torch.topk(x, count, dim=1, largest=False, sorted=True).values  # sorted[i], i = 0 .. n - keep
    highs = torch.topk(x, count, dim=1, largest=True, sorted=True).values.flip(1)  # sorted[keep - 1 + i]
    best = (highs.double() - lows.double()).argmin(dim=1, keepdim=True)
    return lows.gather(1, best).squeeze(1), highs.gather(1, best).squeeze(1)


def _too_many_tokens(name: str) -> str:
    return (f"{name}: more than {HESSIAN_MAX_TOKENS} calibration tokens reach this linear; its Hessian would no "
            f"longer sum exactly (lower spec.max_samples or spec.max_seq_len)")


def _width(module: nn.Module) -> int:
    return getattr(module, "in_features", None) or module.weight.shape[-1]


def _record(ctx: UnitContext, request: Observe, ranges: dict[str, torch.Tensor]) -> _Recorder:
    modules = dict(ctx.module.named_modules())
    names = sorted({*request.absmax, *request.hessian, *request.token_ranges, *request.head_ranges})
    missing = [n for n in names if n not in modules]
    if missing:
        raise KeyError(f"unit {ctx.unit.name}: no module named {missing[0]!r}")
    recorder = _Recorder(request, ranges)
    handles = []

    def make_hook(name: str, record: list[Callable]) -> Callable:
        def hook(_mod: nn.Module, args: tuple) -> None:
            x = args[0] if name in request.head_ranges else _flat_input(args)
            if x.numel():
                for fn in record:
                    fn(name, x)

        return hook

    for name in names:
        handles.append(modules[name].register_forward_pre_hook(make_hook(name, recorder.hooks(name))))
    try:
        with torch.no_grad():
            ctx.run_samples()
    finally:
        for h in handles:
            h.remove()
    # a module that saw no token (an expert nobody routed to) reports zeros, so every rank reduces the same names
    device = ctx.device
    for name in request.absmax:
        recorder.absmax.setdefault(name, torch.zeros(_width(modules[name]), dtype=torch.float32, device=device))
    for name in request.hessian:
        d = _width(modules[name])
        recorder.hessian.setdefault(name, torch.zeros(d, d, dtype=torch.float64, device=device))
        recorder.tokens.setdefault(name, torch.zeros(1, dtype=torch.int64, device=device))
    for name, inv in request.token_ranges.items():
        recorder.token_ranges.setdefault(name, torch.zeros(inv.shape[0], dtype=torch.int64, device=device))
    for name, (heads, _) in request.head_ranges.items():  # a range always holds 0 (symmetric scales read |x|)
        zeros = torch.zeros(heads, dtype=torch.float32, device=device)
        recorder.head_ranges.setdefault(name, (zeros, zeros.clone()))
    return recorder


def observe(ctx: UnitContext, request: Observe) -> Stats:
    """One calibration pass with hooks, then one max-reduce and one integer sum-reduce over data-parallel ranks
    of the replicated modules' statistics (routed experts under EP already saw every rank's tokens)."""
    needs_ranges = sorted({*request.hessian, *request.token_ranges})
    ranges = dict(request.ranges or {})
    unknown = [n for n in needs_ranges if n not in ranges]
    if unknown:
        if request.token_ranges and any(n in unknown for n in request.token_ranges):
            raise ValueError(f"unit {ctx.unit.name}: token ranges of {unknown[0]} need the ranges they were "
                             f"computed from")
        ranges.update(observe(ctx, Observe(absmax=tuple(unknown))).absmax)
    rec = _record(ctx, request, ranges)

    def replicated(stats: dict[str, torch.Tensor], prefix: int = 0) -> dict[str, torch.Tensor]:
        return {k: v for k, v in stats.items() if not ctx.adapter.is_expert(k[prefix:])}

    absmax = {**rec.absmax, **ctx.dist.all_reduce_max(replicated(rec.absmax))}
    # Hessians: integer-valued float64 (exact sums in any order); counts and token ranges: int64
    hessian = {**rec.hessian, **ctx.dist.all_reduce_sum(replicated(rec.hessian))}
    counts = {**{f"n:{n}": v for n, v in rec.tokens.items()}, **{f"t:{n}": v for n, v in rec.token_ranges.items()}}
    counts.update(ctx.dist.all_reduce_sum(replicated(counts, prefix=2)))
    for name in request.hessian:  # to X^T X in place: no second copy of a layer's Hessians
        if int(counts[f"n:{name}"]) > HESSIAN_MAX_TOKENS:  # over all ranks
            raise UserError(_too_many_tokens(name))
        step = _grid_step(ranges[name]).to(ctx.device)
        hessian[name].mul_(step[:, None]).mul_(step[None, :])
    token_ranges = {name: counts[f"t:{name}"].double() * rec.range_quanta[name].to(ctx.device)
                    for name in request.token_ranges}
    tokens = {name: int(counts[f"n:{name}"]) for name in request.hessian}
    bounds = {f"low:{n}": -low for n, (low, _) in rec.head_ranges.items()}
    bounds.update({f"high:{n}": high for n, (_, high) in rec.head_ranges.items()})
    if bounds:  # attention is replicated: every rank holds every head
        bounds = ctx.dist.all_reduce_max(bounds)
    head_ranges = {n: (-bounds[f"low:{n}"], bounds[f"high:{n}"]) for n in request.head_ranges}
    return Stats(absmax=absmax, hessian=hessian, tokens=tokens, token_ranges=token_ranges, head_ranges=head_ranges)


def reduce_tensors(dist: DistContext, request: Reduce) -> dict[str, torch.Tensor]:
    tensors = dict(request.tensors)
    return dist.all_reduce_max(tensors) if request.op == "max" else dist.all_reduce_sum(tensors)


# ---------------------------------------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------------------------------------
def assign_owners(costs: dict[str, float], world: int) -> dict[str, int]:
    """Rank that does the work for each item: largest first onto the least-loaded rank (lowest rank on ties).
    Deterministic, so every rank computes the same plan without communicating."""
    owner, load = {}, [0.0] * world
    for name in sorted(costs, key=lambda n: -costs[n]):  # stable: equal costs keep their order
        owner[name] = load.index(min(load))
        load[owner[name]] += costs[name]
    return owner


def run_jobs(dist: DistContext, jobs: list[Job] | tuple[Job, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """Every job's result on every rank that needs it: local jobs here; shared ones on their owner, then one
    broadcast per owning rank of all its results as bytes (the same plan on every rank)."""
    keys = [j.key for j in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate job keys: {sorted(k for k in set(keys) if keys.count(k) > 1)[:3]}")
    shared = [j for j in jobs if not j.local] if dist.is_distributed else []
    owner = assign_owners({j.key: float(j.cost) for j in shared}, dist.world_size)
    results = {j.key: j.run() for j in jobs if owner.get(j.key, dist.rank) == dist.rank}
    for src in range(dist.world_size if shared else 0):
        owned = [j for j in shared if owner[j.key] == src]
        if not owned:
            continue
        layout = [(j.key, out, shape, dtype) for j in owned for out, (shape, dtype) in sorted(j.outputs.items())]
        nbytes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                  for _, _, shape, dtype in layout]
        if src == dist.rank:
            flat = torch.cat([results[k][out].to(dist.device).contiguous().reshape(-1).view(torch.uint8)
                              for k, out, _, _ in layout])
        else:
            flat = torch.empty(sum(nbytes), dtype=torch.uint8, device=dist.device)
        dist.broadcast(flat, src)
        if src != dist.rank:
            offset = 0
            for (key, out, shape, dtype), size in zip(layout, nbytes):
                results.setdefault(key, {})[out] = flat[offset:offset + size].clone().view(dtype).reshape(shape)
                offset += size
    return results
