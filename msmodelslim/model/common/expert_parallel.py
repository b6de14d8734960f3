"""Expert parallelism for any MoE family: which experts a rank owns, the routed dispatch over ranks, and the switches
the statistics passes turn on (every expert on every token, router-weighted rows, balanced top-ups).

A family's patch (model/kimi_k3/ep_patches.py is one) keeps only this rank's experts in each MoE block, marks the
block with a `BlockEP` (its router module, the experts' input width, top-k) and routes the block's routed part
through `ep_moe_infer`. Rank r holds only the experts in `resolve_expert_ep_range(E, r, W)`; the others are never
built or loaded. The routed part becomes: gather every rank's tokens, run the local experts, and send each rank the
slots of its own tokens (one all-to-all, core/dist). Shared experts and latent projections stay replicated.

Bit-exactness with a single device: each (token, top-k slot) output is computed by exactly one rank into its own
slot of a zero buffer, so summing what the ranks send back only ever adds zeros (exact), and the k slots are then
summed in a fixed order on every rank. Each expert runs on the tokens of one source rank at a time, so its matmuls
see the same rows as on a single device that processes the same sample.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from msmodelslim.core.dist import DistContext, token_source
from msmodelslim.core.routing import routed_rows
from msmodelslim.quant.modules import linears_over_row_groups

EP_ATTR = "_msmodelslim_ep"


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


@dataclass
class BlockEP:
    """What the dispatch needs of one MoE block set up for EP (the family's patch sets it as EP_ATTR)."""

    dist: DistContext
    router: nn.Module  # the block's router; its linear scores the experts (its `weight` [experts, width])
    expert_width: int  # input width of a routed expert (latent size for a latent MoE)
    top_k: int
    all_tokens: bool = False  # every local expert computes on every token (`all_experts_compute`)
    affinity: bool = False  # each expert's rows carry their router weights (`experts_weigh_rows`)
    balanced: bool = False  # experts topped up to their balanced share (`experts_balance_tokens`), with
    scores: torch.Tensor | None = None  # the router's logits [tokens, experts] of the gate call in progress


def ep_routed(block: nn.Module, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """The routed part of an EP block's forward: `ep_moe_infer` over its local experts, with its switches and the
    router logits its router's call in progress left (taken: each gate call scores one forward)."""
    ep: BlockEP = getattr(block, EP_ATTR)
    scores, ep.scores = ep.scores, None
    return ep_moe_infer(block.experts, x, topk_idx, topk_weight, ep.dist, ep.all_tokens, ep.affinity, scores)


def ep_moe_infer(experts: nn.ModuleDict, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                 dist: DistContext, all_tokens: bool = False, affinity: bool = False,
                 scores: torch.Tensor | None = None) -> torch.Tensor:
    """Routed-expert output for this rank's tokens; `experts` holds only this rank's experts, keyed by index.
    `all_tokens`: each expert computes on every token (its observers see them all), and only the rows the router
    chose enter the output. `affinity`: each expert is called on its rows with their router weights said
    (`core.routing.routed_rows`: affinity-guided Hessians), expert by expert. `scores` (the router's logits
    [tokens, experts], `experts_balance_tokens`): an expert the router sends fewer than its balanced share of a
    source's tokens (tokens x k / experts) computes on its routed rows and, for its observers only, on the
    highest-scored others up to that share (MoEQuant's expert balance, from the calibration tokens themselves)."""
    k = topk_idx.shape[-1]
    width = x.shape[-1]
    if dist.is_distributed:
        parts = [x.float(), topk_idx.float(), topk_weight.float(), *([] if scores is None else [scores.float()])]
        packed = torch.cat(parts, dim=1).to(dist.device)
        sources = [(b[:, :width].to(x.dtype), b[:, width : width + k].long(), b[:, width + k : width + 2 * k],
                    None if scores is None else b[:, width + 2 * k :]) for b in dist.all_gather_rows(packed)]
    else:
        sources = [(x, topk_idx, topk_weight.float(), scores)]

    slots = []
    for source, (xs, idx, w, logits) in enumerate(sources):  # each rank's tokens (the report observes some ranks' only)
        out = torch.zeros((xs.shape[0], k, width), dtype=torch.float32, device=x.device)
        # (token, slot) pairs grouped by expert with one host sync per source; the stable sort keeps each expert's
        # rows in token order, so its matmuls see the rows a per-expert scan would give
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat + 1).tolist() if flat.numel() else []  # +1: a router's -1 (no expert) sorts first
        starts = [0, *itertools.accumulate(counts)]
        with token_source(source if dist.is_distributed else dist.rank):
            spans = [(expert, starts[e], starts[e + 1]) for key, expert in experts.items()
                     if (e := int(key) + 1) < len(counts) and counts[e]]
            if not all_tokens and not affinity and logits is None and spans and _groupable(experts, spans):
                first, end = spans[0][1], spans[-1][2]
                sel = order[first:end]
                rows, cols = sel // k, sel % k
                y = _grouped_experts(spans, xs[rows], first)
                out[rows, cols] = y.float() * w[rows, cols, None]
            else:
                for key, expert in experts.items():
                    e = int(key) + 1
                    routed = e < len(counts) and counts[e]
                    if all_tokens and xs.shape[0]:
                        y = expert(xs)
                    if logits is not None and xs.shape[0]:
                        sel = order[starts[e]:starts[e + 1]] if routed else order[:0]
                        rows, cols = sel // k, sel % k
                        share = -(-xs.shape[0] * k // logits.shape[1])  # ceil(tokens x k / experts)
                        y_rows = _balanced_call(expert, xs, rows, logits[:, e - 1], share)
                        if routed:
                            out[rows, cols] = y_rows.float() * w[rows, cols][:, None]
                        continue
                    if routed:
                        sel = order[starts[e]:starts[e + 1]]
                        rows, cols = sel // k, sel % k
                        weights = w[rows, cols]
                        if all_tokens:
                            y_rows = y[rows]
                        else:
                            with routed_rows(weights) if affinity else contextlib.nullcontext():
                                y_rows = expert(xs[rows])
                        out[rows, cols] = y_rows.float() * weights[:, None]
        slots.append(out)
    own = dist.exchange_sum(slots)  # each rank gets back only its own tokens' slots
    return own.sum(dim=1).to(x.dtype)


def _balanced_call(expert: nn.Module, xs: torch.Tensor, rows: torch.Tensor, logits: torch.Tensor,
                   share: int) -> torch.Tensor:
    """`expert` on its routed `rows` of xs, topped up for its observers with the highest-`logits` other rows to
    `share` rows in all; the routed rows' outputs."""
    extra = share - rows.numel()
    if extra <= 0:
        return expert(xs[rows])
    others = logits.float().clone()
    others[rows] = float("-inf")
    added = torch.topk(others, min(extra, xs.shape[0] - rows.numel())).indices
    return expert(xs[torch.cat([rows, added])])[: rows.numel()]


# Expert classes computing w2(act_fn(w1 x, w3 x)) and nothing else, by class name (a family registers its own,
# model/kimi_k3/experts.py): their routed calls run as one group. Another class is run expert by expert.
GATED_MLP_EXPERTS: set[str] = set()


def register_gated_mlp_experts(*class_names: str) -> None:
    """Say that experts of these classes compute w2(act_fn(w1 x, w3 x)) and nothing else."""
    GATED_MLP_EXPERTS.update(class_names)


def _groupable(experts: nn.ModuleDict, spans: list[tuple[nn.Module, int, int]]) -> bool:
    """Whether the routed experts can run as one group: a known class, one activation, no hook on an expert itself
    (a NaN trace hooks every module: it runs expert by expert), and their (token, slot) picks consecutive in the
    sorted order (this rank's experts are one range)."""
    first = spans[0][0]
    kind = (type(first), type(first.act_fn), first.act_fn.extra_repr()) if hasattr(first, "act_fn") else None
    if kind is None or kind[0].__name__ not in GATED_MLP_EXPERTS:
        return False
    return all((type(m), type(m.act_fn), m.act_fn.extra_repr()) == kind and not m._forward_hooks
               and not m._forward_pre_hooks for m in experts.values()) \
        and all(a[2] == b[1] for a, b in zip(spans, spans[1:]))


def _grouped_experts(spans: list[tuple[nn.Module, int, int]], x: torch.Tensor, offset: int) -> torch.Tensor:
    """Every routed expert's output on its rows of x (the experts' picks, sorted by expert; `spans` their
    (expert, start, end) in the sort, from `offset`), bit-identical to calling each expert on its rows: one
    activation over all rows, and the linears through `linears_over_row_groups`, whose per-row work runs once."""
    bounds = [(start - offset, end - offset) for _, start, end in spans]
    gate, up = linears_over_row_groups([(m.w1, m.w3) for m, _, _ in spans], x, bounds)
    hidden = spans[0][0].act_fn(gate, up)
    (y,) = linears_over_row_groups([(m.w2,) for m, _, _ in spans], hidden, bounds)
    return y


def only_for_ep_blocks(patched: Callable, original: Callable) -> Callable:
    """The class-level patch serves blocks set up for EP; any other instance of the class keeps its own code."""

    @functools.wraps(original)
    def method(self: nn.Module, *args: object, **kwargs: object) -> torch.Tensor:
        if hasattr(self, EP_ATTR):
            return patched(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return method


def ep_idle(block: nn.Module) -> None:
    """Join the routed-expert collectives of `block` with zero tokens (a rank that ran out of samples)."""
    ep: BlockEP = getattr(block, EP_ATTR)
    device = next(iter(block.experts.values())).w1.weight.device
    dtype = next(iter(block.experts.values())).w1.weight.dtype
    x = torch.empty((0, ep.expert_width), device=device, dtype=dtype)
    idx = torch.empty((0, ep.top_k), device=device, dtype=torch.long)
    # with balanced experts every rank's rows carry the router's logits (the gathered rows are one width)
    scores = torch.empty((0, ep.router.weight.shape[0]), device=device) if ep.balanced else None
    ep_moe_infer(block.experts, x, idx, torch.empty((0, ep.top_k), device=device), ep.dist, scores=scores)


def experts_weigh_rows(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within: every EP block's experts are called with their rows' router weights said (MoEQuant's
    affinity-guided Hessians, `spec.affinity_guided_experts`), while each block's output is as ever."""
    return _every_block(model, "affinity")


def all_experts_compute(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within: every local expert of every EP block of `model` computes on every token (llm-compressor's
    "calibrate all experts": an expert's statistics see all of its rank's tokens, not the ~top-k / E the router
    sends it), while each block's output keeps the router's choice."""
    return _every_block(model, "all_tokens")


@contextlib.contextmanager
def experts_balance_tokens(model: nn.Module) -> Iterator[None]:
    """Within: every EP block's router logits (its router's linear scores, x W^T, for every expert) are kept for
    its dispatch, which tops each expert's rows up to its balanced share for its observers (`ep_moe_infer`'s
    `scores`, `spec.balanced_experts`), while each block's output is as ever."""
    def keeper(ep: BlockEP) -> Callable[..., None]:
        def keep(router: nn.Module, args: tuple, _out: object) -> None:
            ep.scores = torch.nn.functional.linear(args[0].reshape(-1, router.weight.shape[1]).float(),
                                                   router.weight.float())
        return keep

    blocks = [getattr(m, EP_ATTR) for m in model.modules() if hasattr(m, EP_ATTR)]
    handles = [ep.router.register_forward_hook(keeper(ep)) for ep in blocks]
    for ep in blocks:
        ep.balanced = True
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for ep in blocks:
            ep.balanced, ep.scores = False, None


@contextlib.contextmanager
def _every_block(model: nn.Module, switch: str) -> Iterator[None]:
    """Within: the `BlockEP` switch on for every EP block of `model`."""
    blocks = [getattr(m, EP_ATTR) for m in model.modules() if hasattr(m, EP_ATTR)]
    for ep in blocks:
        setattr(ep, switch, True)
    try:
        yield
    finally:
        for ep in blocks:
            setattr(ep, switch, False)


@dataclass
class EPHandle:
    """Undo information of a family's EP patch: the classes' methods and the blocks' expert containers."""

    restore_methods: list[tuple[type, str, Callable]] = field(default_factory=list)
    restore_experts: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)

    def undo(self) -> None:
        for cls, name, original in reversed(self.restore_methods):
            setattr(cls, name, original)
        for block, experts in self.restore_experts:
            block.experts = experts
            delattr(block, EP_ATTR)
        self.restore_methods.clear()
        self.restore_experts.clear()

    def __enter__(self) -> EPHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


