"""The runner's answers to what processors ask while they transform a unit.

`run_processor(processor, ctx)` drives a processor: a plain `process_unit` just runs; a generator one yields
requests (`core/requests.py`) that `answer` answers here. This module owns the calibration passes, the hooks,
every collective a processor needs and the Hessians carried from one processor's pass to a later one (`Carried`),
so processors are transforms, stay rank-agnostic and know nothing of each other.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from msmodelslim.core.dist import DistContext
from msmodelslim.core.requests import Job, Jobs, Observe, Reduce, Rescaled, Stats
from msmodelslim.core.routing import routed_rows, row_weights
from msmodelslim.pipeline.statistics import Statistic, kinds_for
from msmodelslim.processor.base import UnitContext
from msmodelslim.quant.modules import RECORD_CALL_GROUPS, RECORD_ROW_GROUPS


class Sample:
    """The inputs of some modules over the samples of the first `tokens` calibration tokens, as a pass met them, in
    its order (readers of one input share one copy), kept on the device until the processor that asked for them
    (`Observe.sample`) makes its capped Observe of them, which `replayed` answers from them without a forward:
    what the hooks of that pass would have recorded, in the same calls and order, so the same statistics. The
    smoothing search's sample: its first 65,536 tokens' inputs of a subgraph's measured readers (at Kimi-K3's
    widths ~4 GB on one EP-8 rank: the hidden-state readers 2 x 0.9, o_proj 1, the local experts 0.9)."""

    def __init__(self, names: Sequence[str], tokens: int | None) -> None:
        self.names = frozenset(names)
        self.tokens = tokens
        # per call (module, its input, the router weights of its rows: core/routing.py), or per grouped call
        # (its modules, their input, each one's rows of it: `record_groups`)
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor | None]
                         | tuple[tuple[str, ...], torch.Tensor, tuple[tuple[int, int], ...]]] = []
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (the input as the pass met it, its copy)

    def _copy(self, x: torch.Tensor) -> torch.Tensor:
        last = self._last
        if last is None or not _same_input(last[0], x):
            last = self._last = (x, x.clone())  # holding x keeps its address its own while it is compared
        return last[1]

    def record(self, name: str, x: torch.Tensor) -> None:
        self.calls.append((name, self._copy(x), row_weights()))

    def record_groups(self, names: Sequence[str], x: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> None:
        self.calls.append((tuple(names), self._copy(x), tuple(bounds)))

    def serves(self, request: Observe) -> bool:
        return request.tokens == self.tokens and request.modules() <= self.names and not request.quant_error


def _same_input(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a._version == b._version


class Carried:
    """What the runner keeps between the requests of one unit: the Hessians (with their token counts) a pass
    gathered for a processor that runs later on the same unit, and the inputs sample a processor asked to be kept
    for its own capped Observe (`Sample`). Which Hessians a pass gathers and how far they go follow from what each
    processor declares (`Processor.hessians`, `Processor.changes`); no processor knows its peers."""

    def __init__(self) -> None:
        self.hessian: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self.sample: Sample | None = None

    def rescale(self, modules: Sequence[str], scale: torch.Tensor) -> None:
        """H <- D H D with D = diag(1 / s) for the carried Hessians of `modules`, whose inputs became X / s. Readers
        of one input keep sharing one (new) tensor; the old one is left as it was (an earlier request may hold it).
        Exact but for the rounding of the smoothed 16-bit weights, which moves every later input by about one
        rounding of those weights (docs/dev/architecture.md)."""
        done: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for name in modules:
                h = self.hessian.get(name)
                if h is None:
                    continue
                if id(h) not in done:
                    inv = 1.0 / scale.to(h.device, torch.float32)
                    done[id(h)] = h * torch.outer(inv, inv)  # the outer product is symmetric, so the result stays so
                self.hessian[name] = done[id(h)]

    def keep_only(self, names: set[str]) -> None:
        """Free what no later processor asks for (a linear that kept its checkpoint bytes needs no Hessian)."""
        for name in [n for n in self.hessian if n not in names]:
            del self.hessian[name], self.tokens[name]


def run_processor(processor: Any, ctx: UnitContext,
                  stage: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
                  following: Sequence[Any] = (), carried: Carried | None = None) -> None:
    """Apply one processor to the unit, answering each request it yields. Each answer runs inside `stage(kind)`
    (kind: observe, reduce, jobs), where the runner times it and records its device memory, so a run's statistics
    show where a processor's time and memory go: calibration passes, collectives or its own heavy work.
    `following`: the processors that run after it on this unit; its passes gather the Hessians they will ask for
    where those survive what runs in between (`gatherable`), kept in `carried` (a new one: nothing carried)."""
    carried = Carried() if carried is None else carried
    steps = processor.process_unit(ctx)
    if inspect.isgenerator(steps):
        reply: Any = None
        while True:
            try:
                request = steps.send(reply)
            except StopIteration:
                break
            reply = None  # the processor has it: held here it would outlive what the processor frees (its Hessians)
            if isinstance(request, Rescaled):
                carried.rescale(request.modules, request.scale)
                continue
            with stage(type(request).__name__.lower()) if stage is not None else contextlib.nullcontext():
                ahead = gatherable(ctx, processor, following) if isinstance(request, Observe) else ()
                reply = answer(ctx, request, ahead, carried)
    carried.sample = None  # kept for this processor only
    carried.keep_only({name for later in following for name in later.hessians(ctx)})


def gatherable(ctx: UnitContext, asking: Any, following: Sequence[Any]) -> tuple[str, ...]:
    """The Hessians the processors after `asking` will ask for that a pass of `asking` can gather, in order, each
    once: those every processor from `asking` up to the one asking leaves as they are, or changes in a way the
    runner carries them through (`Changes`), or in a way the one asking accepts (`Processor.true_sequential`)."""
    names: dict[str, None] = {}
    for i, later in enumerate(following):
        wanted = later.hessians(ctx)
        if wanted:
            names.update(dict.fromkeys(_surviving(ctx, wanted, (asking, *following[:i]), later.true_sequential)))
    return tuple(names)


def _surviving(ctx: UnitContext, names: Sequence[str], between: Sequence[Any], sequential: bool) -> list[str]:
    """`names` whose Hessians gathered before `between` still hold after it: through a processor that rescales
    inputs by a diagonal every one (the runner rescales them, `Rescaled`); through one that changes weights of named
    linears, the others, where the asker is not true-sequential; where it is, only through one that changes
    routed experts' weights, and only those that do not read the experts' outputs (`adapter.reads_routed_experts`:
    attention, shared experts, the latent down-projection); through any other, none. So iter_smooth's first pass
    gathers every linear_quant entry's Hessians, and true-sequential Kimi-K3's latent up-projection needs a pass of
    its own."""
    names = list(names)
    for processor in between:
        changes = processor.changes(ctx)
        if changes.inputs_rescaled:
            continue
        if changes.weights is None:
            return []
        if not sequential:
            names = [n for n in names if n not in changes.weights]
            continue
        if not all(ctx.adapter.is_rank_local(n) for n in changes.weights):
            return []
        if changes.weights:
            names = [n for n in names if n not in changes.weights and not ctx.adapter.reads_routed_experts(n)]
    return names


def answer(ctx: UnitContext, request: Any, ahead: Sequence[str] = (), carried: Carried | None = None) -> Any:
    if isinstance(request, Observe):
        return observe_gathering(ctx, request, ahead, Carried() if carried is None else carried)
    if isinstance(request, Reduce):
        return reduce_tensors(ctx.dist, request)
    if isinstance(request, Jobs):
        return run_jobs(ctx.dist, request.jobs)
    raise TypeError(f"unit {ctx.unit.name}: a processor asked for {type(request).__name__}, which the runner "
                    f"does not serve")


# ---------------------------------------------------------------------------------------------------------------
# Statistics (the kinds and their exact reductions: statistics.py)
# ---------------------------------------------------------------------------------------------------------------
def observe(ctx: UnitContext, request: Observe, sample: Sample | None = None) -> Stats:
    """One calibration pass with a hook per observed module, then each kind's reduction over data-parallel ranks
    for the replicated modules (routed experts under EP already saw every rank's tokens). `sample`: the inputs of
    its modules over its first tokens are kept into it in the same pass."""
    kinds = kinds_of(ctx, request)
    with recording(ctx, request, kinds, sample), ctx.adapter.statistics_pass():
        if request.tokens is None or ctx.run_first is None:
            ctx.run_samples()
        else:
            ctx.run_first(request.tokens)
    return finished(ctx, kinds)


@contextlib.contextmanager
def recording(ctx: UnitContext, request: Observe, kinds: Sequence[Statistic],
              sample: Sample | None = None) -> Iterator[None]:
    """Hooks on the observed modules while the pass runs: each kind records the calls of the samples of the first
    `request.tokens` calibration tokens (all: None); `sample` keeps its modules' inputs over its own first tokens.
    Input kinds record from a pre-hook, those that read the output (`Statistic.reads_output`) from a forward
    hook."""
    modules = dict(ctx.module.named_modules())
    keeping = sample.names if sample is not None else frozenset()
    names = sorted({n for k in kinds for n in k.names} | keeping)
    missing = [n for n in names if n not in modules]
    if missing:
        raise KeyError(f"unit {ctx.unit.name}: no module named {missing[0]!r}")

    def observed() -> bool:
        return request.tokens is None or ctx.within_first(request.tokens)

    inputs = [k for k in kinds if not k.reads_output]

    def record_row_groups(group_names: Sequence[str], x: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> None:
        """The pre-hooks' calls of a grouped position at once (quant/modules.py: `linears_over_row_groups`)."""
        x = x.detach()
        if sample is not None and ctx.within_first(sample.tokens):
            kept = [(n, b) for n, b in zip(group_names, bounds, strict=True) if n in keeping]
            if kept:
                sample.record_groups([n for n, _ in kept], x, [b for _, b in kept])
        if observed():
            _record_groups(inputs, group_names, x, bounds)

    def input_hook(name: str) -> Callable:
        watching = [k for k in kinds if name in k.names and not k.reads_output]
        keep = sample if name in keeping else None

        def hook(_mod: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            if not x.numel():
                return
            if keep is not None and ctx.within_first(keep.tokens):
                keep.record(name, x)
            if watching and observed():
                _record(watching, name, x)

        setattr(hook, RECORD_ROW_GROUPS, record_row_groups)  # one object for every hook of the pass
        hook.observed_name = name  # type: ignore[attr-defined]
        return hook

    outputs = [k for k in kinds if k.reads_output]

    def record_call_groups(group_names: Sequence[str], group_modules: Sequence[nn.Module], x: torch.Tensor,
                           y: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> None:
        """The forward hooks' calls of a grouped position at once (`linears_over_row_groups`)."""
        if not observed():
            return
        for k in outputs:
            mine = [g for g, name in enumerate(group_names) if name in k.name_set]
            if mine:
                k.record_call_groups([group_names[g] for g in mine], [group_modules[g] for g in mine], x.detach(),
                                     y.detach(), [bounds[g] for g in mine])

    def output_hook(name: str, watching: list[Statistic]) -> Callable:
        def hook(module: nn.Module, args: tuple, y: torch.Tensor) -> None:
            if args[0].numel() and observed():
                for k in watching:
                    k.record_call(name, module, args[0].detach(), y.detach())

        setattr(hook, RECORD_CALL_GROUPS, record_call_groups)  # one object for every hook of the pass
        hook.observed_name = name  # type: ignore[attr-defined]
        return hook

    handles = []
    for name in names:
        if name in keeping or any(name in k.names and not k.reads_output for k in kinds):
            handles.append(modules[name].register_forward_pre_hook(input_hook(name)))
        watching = [k for k in kinds if name in k.names and k.reads_output]
        if watching:
            handles.append(modules[name].register_forward_hook(output_hook(name, watching)))
    try:
        with torch.no_grad():
            yield
    finally:
        for h in handles:
            h.remove()


def replayed(ctx: UnitContext, request: Observe, sample: Sample) -> Stats:
    """`observe` of a capped request over a kept `sample` of its modules' inputs (`Sample.serves`): the same calls
    in the same order reach the same kinds, so the same statistics, and no forward runs."""
    kinds = kinds_of(ctx, request)
    with torch.no_grad():
        for name, x, extra in sample.calls:
            if isinstance(name, tuple):  # a grouped call: its modules and their rows
                _record_groups(kinds, name, x, extra)
                continue
            watching = [k for k in kinds if name in k.names]
            if watching:
                with routed_rows(extra) if extra is not None else contextlib.nullcontext():
                    _record(watching, name, x)
    return finished(ctx, kinds)


def kinds_of(ctx: UnitContext, request: Observe) -> list[Statistic]:
    missing_ranges = [n for n in request.token_ranges if n not in (request.ranges or {})]
    if missing_ranges:
        raise ValueError(f"unit {ctx.unit.name}: token ranges of {missing_ranges[0]} need the ranges they were "
                         f"computed from")
    return [kind(request, dict(request.ranges or {}), ctx.device) for kind in kinds_for(request)]


def _record(kinds: Sequence[Statistic], name: str, x: torch.Tensor) -> None:
    flat = x.reshape(-1, x.shape[-1])
    for k in kinds:
        k.record(name, flat if k.flat_input else x)


def _record_groups(kinds: Sequence[Statistic], names: Sequence[str], x: torch.Tensor,
                   bounds: Sequence[tuple[int, int]]) -> None:
    """A grouped call (names[g] read rows bounds[g] of x) to each kind, with the names it watches."""
    for k in kinds:
        mine = [g for g, name in enumerate(names) if name in k.name_set]
        if len(mine) == len(names):
            k.record_groups(names, x, bounds)
        elif mine:
            k.record_groups([names[g] for g in mine], x, [bounds[g] for g in mine])


def finished(ctx: UnitContext, kinds: Sequence[Statistic]) -> Stats:
    """Each kind's zero-fill and reduction over data-parallel ranks (replicated modules only), into one Stats."""
    stats = Stats()
    modules = dict(ctx.module.named_modules())
    with torch.no_grad():
        for k in kinds:  # the same kinds in the same order on every rank: the collectives line up
            k.finish(modules, ctx.dist, lambda n: not ctx.adapter.is_rank_local(n), stats)
    return stats


def observe_gathering(ctx: UnitContext, request: Observe, ahead: Sequence[str], carried: Carried) -> Stats:
    """`observe`, with the Hessians of `ahead` gathered in the same pass and kept for a later processor
    (`carried`), and the Hessians an earlier pass gathered for this request handed over instead of observed (kept
    too where `ahead` names them again: then it is one object in both places, and whoever changes it makes a new
    one): no pass at all when nothing else is asked. A request that asks for a sample gets it kept in `carried`; a
    capped one the kept sample serves is answered from it (`replayed`), also without a pass."""
    # a capped pass gathers nothing: later processors want Hessians of every token
    gathering = () if request.tokens is not None else ahead
    kept = [n for n in request.hessian if n in carried.hessian]
    extra = [n for n in gathering if n not in request.hessian and n not in carried.hessian]
    if kept or extra:
        request = replace(request, hessian=(*(n for n in request.hessian if n not in kept), *extra))
    sample = Sample(request.sample, request.sample_tokens) if request.sample else None
    if not request.modules() and sample is None:
        stats = Stats()
    elif sample is None and carried.sample is not None and carried.sample.serves(request):
        stats, carried.sample = replayed(ctx, request, carried.sample), None
    else:
        stats = observe(ctx, request, sample)
    if sample is not None:
        carried.sample = sample
    for name in extra:
        carried.hessian[name], carried.tokens[name] = stats.hessian.pop(name), stats.tokens.pop(name)
    ahead_set = set(ahead)
    for name in kept:
        h, tokens = (carried.hessian[name], carried.tokens[name]) if name in ahead_set else \
            (carried.hessian.pop(name), carried.tokens.pop(name))
        stats.hessian[name], stats.tokens[name] = h, tokens
    return stats


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
