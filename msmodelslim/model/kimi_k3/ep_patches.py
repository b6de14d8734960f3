"""Expert parallelism by monkey-patching the checkpoint's own MoE class (never its files).

Rank r holds only the experts in `resolve_expert_ep_range(E, r, W)`; the others are never built or loaded.
The routed part of the MoE forward becomes: gather every rank's tokens, run the local experts, and send each rank
the slots of its own tokens (one all-to-all, core/dist). Shared experts and latent projections stay replicated and are computed once per rank.

Bit-exactness with a single device: each (token, top-k slot) output is computed by exactly one rank into its own
slot of a zero buffer, so summing what the ranks send back only ever adds zeros (exact), and the k slots are then summed in a
fixed order on every rank. Each expert runs on the tokens of one source rank at a time, so its matmuls see the same
rows as on a single device that processes the same sample.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from msmodelslim.core.dist import SINGLE, DistContext, token_source
from msmodelslim.core.routing import routed_rows
from msmodelslim.model.common.utils import resolve_expert_ep_range
from msmodelslim.model.kimi_k3.experts import KimiExpertMLP
from msmodelslim.quant.modules import linears_over_row_groups

logger = logging.getLogger(__name__)

_EP_ATTR = "_msmodelslim_ep"


@dataclass
class _BlockEP:
    dist: DistContext
    expert_width: int  # input width of a routed expert (latent size for a latent MoE)
    top_k: int
    all_tokens: bool = False  # every local expert computes on every token (`all_experts_compute`)
    affinity: bool = False  # each expert's rows carry their router weights (`experts_weigh_rows`)
    balanced: bool = False  # experts topped up to their balanced share (`experts_balance_tokens`), with
    scores: torch.Tensor | None = None  # the router's logits [tokens, experts] of the gate call in progress


def is_native_moe(block: nn.Module) -> bool:
    """transformers' native Kimi-Linear MoE: router `gate` returns (logits, weights, indices)."""
    return type(block).__module__.startswith("transformers.models.kimi_linear")


def is_moe_block(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("gate", "experts", "shared_experts"))


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


# Expert classes computing w2(act_fn(w1 x, w3 x)) and nothing else: the stand-in's (remote code, built from vLLM's
# Kimi-K3) and ours for transformers' fused experts. Another class is run expert by expert.
GROUPABLE_EXPERTS = frozenset({"KimiBlockSparseMLP", "KimiExpertMLP"})


def _groupable(experts: nn.ModuleDict, spans: list[tuple[nn.Module, int, int]]) -> bool:
    """Whether the routed experts can run as one group: a known class, one activation, no hook on an expert itself
    (a NaN trace hooks every module: it runs expert by expert), and their (token, slot) picks consecutive in the
    sorted order (this rank's experts are one range)."""
    first = spans[0][0]
    kind = (type(first), type(first.act_fn), first.act_fn.extra_repr()) if hasattr(first, "act_fn") else None
    if kind is None or kind[0].__name__ not in GROUPABLE_EXPERTS:
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


def _standin_moe_infer(self: nn.Module, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weight: torch.Tensor) -> torch.Tensor:
    ep: _BlockEP = getattr(self, _EP_ATTR)
    scores, ep.scores = ep.scores, None
    return ep_moe_infer(self.experts, x, topk_idx, topk_weight, ep.dist, ep.all_tokens, ep.affinity, scores)


def _native_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    shape = hidden_states.shape
    _, topk_weight, topk_idx = self.gate(hidden_states)
    flat = hidden_states.reshape(-1, shape[-1])
    ep: _BlockEP = getattr(self, _EP_ATTR)
    scores, ep.scores = ep.scores, None
    routed = ep_moe_infer(self.experts, flat, topk_idx, topk_weight, ep.dist, ep.all_tokens, ep.affinity, scores)
    return routed.view(shape) + self.shared_experts(hidden_states)


def _only_for_ep_blocks(patched: Callable, original: Callable) -> Callable:
    """The class-level patch serves blocks set up for EP; any other instance of the class keeps its own code."""

    @functools.wraps(original)
    def method(self: nn.Module, *args: object, **kwargs: object) -> torch.Tensor:
        if hasattr(self, _EP_ATTR):
            return patched(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return method


def ep_idle(block: nn.Module) -> None:
    """Join the routed-expert collectives of `block` with zero tokens (a rank that ran out of samples)."""
    ep: _BlockEP = getattr(block, _EP_ATTR)
    device = next(iter(block.experts.values())).w1.weight.device
    dtype = next(iter(block.experts.values())).w1.weight.dtype
    x = torch.empty((0, ep.expert_width), device=device, dtype=dtype)
    idx = torch.empty((0, ep.top_k), device=device, dtype=torch.long)
    # with balanced experts every rank's rows carry the router's logits (the gathered rows are one width)
    scores = torch.empty((0, block.gate.weight.shape[0]), device=device) if ep.balanced else None
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
    """Within: every EP block's router logits (its gate's linear scores, x W_gate^T, for every expert) are kept for
    its dispatch, which tops each expert's rows up to its balanced share for its observers (`ep_moe_infer`'s
    `scores`, `spec.balanced_experts`), while each block's output is as ever."""
    def keeper(ep: _BlockEP) -> Callable[..., None]:
        def keep(gate: nn.Module, args: tuple, _out: object) -> None:
            ep.scores = torch.nn.functional.linear(args[0].reshape(-1, gate.weight.shape[1]).float(),
                                                   gate.weight.float())
        return keep

    blocks = [m for m in model.modules() if hasattr(m, _EP_ATTR)]
    handles = [block.gate.register_forward_hook(keeper(getattr(block, _EP_ATTR))) for block in blocks]
    for block in blocks:
        getattr(block, _EP_ATTR).balanced = True
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for block in blocks:
            ep = getattr(block, _EP_ATTR)
            ep.balanced, ep.scores = False, None


@contextlib.contextmanager
def _every_block(model: nn.Module, switch: str) -> Iterator[None]:
    """Within: the `_BlockEP` switch on for every EP block of `model`."""
    blocks = [getattr(m, _EP_ATTR) for m in model.modules() if hasattr(m, _EP_ATTR)]
    for ep in blocks:
        setattr(ep, switch, True)
    try:
        yield
    finally:
        for ep in blocks:
            setattr(ep, switch, False)


@dataclass
class EPHandle:
    """Undo information of `apply_ep_patches`."""

    restore_methods: list[tuple[type, str, Callable]] = field(default_factory=list)
    restore_experts: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)

    def undo(self) -> None:
        for cls, name, original in reversed(self.restore_methods):
            setattr(cls, name, original)
        for block, experts in self.restore_experts:
            block.experts = experts
            delattr(block, _EP_ATTR)
        self.restore_methods.clear()
        self.restore_experts.clear()

    def __enter__(self) -> EPHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def _local_experts(block: nn.Module, local: range, num_experts: int, moe_intermediate_size: int) -> nn.ModuleDict:
    experts = block.experts
    if isinstance(experts, nn.ModuleList):  # remote code: one module per expert
        if len(experts) != num_experts:
            raise ValueError(f"MoE block has {len(experts)} experts, config says num_experts={num_experts}")
        return nn.ModuleDict({str(e): experts[e] for e in local})
    if hasattr(experts, "gate_up_proj"):  # native transformers: fused 3-D experts -> one module per expert
        param = experts.gate_up_proj
        width = param.shape[-1]
        return nn.ModuleDict({str(e): KimiExpertMLP(width, moe_intermediate_size, device=param.device,
                                                    dtype=param.dtype) for e in local})
    raise TypeError(f"unsupported experts container {type(experts).__name__}")


def apply_ep_patches(model: nn.Module, text_config: object, dist: DistContext = SINGLE) -> EPHandle:
    """Keep only this rank's experts in every MoE block of `model` and patch the MoE classes' forward.

    Also used with one device: the same code path then runs with no collectives, which is what makes a W-rank run
    reproduce the single-device bytes.
    """
    num_experts = int(text_config.num_experts)
    local = resolve_expert_ep_range(num_experts, dist.rank, dist.world_size)
    top_k = int(text_config.num_experts_per_token if hasattr(text_config, "num_experts_per_token")
                else text_config.num_experts_per_tok)
    handle = EPHandle()
    patched: set[type] = set()
    blocks = [m for m in model.modules() if is_moe_block(m)]
    for block in blocks:
        cls = type(block)
        if cls not in patched:
            name, fn = ("forward", _native_forward) if is_native_moe(block) else ("moe_infer", _standin_moe_infer)
            if not hasattr(cls, name):
                raise TypeError(f"{cls.__name__} has no {name}(); cannot patch it for expert parallelism")
            original = cls.__dict__.get(name, getattr(cls, name))
            handle.restore_methods.append((cls, name, original))
            setattr(cls, name, _only_for_ep_blocks(fn, original))
            patched.add(cls)
        original = block.experts
        block.experts = _local_experts(block, local, num_experts, int(text_config.moe_intermediate_size))
        width = next(iter(block.experts.values())).w1.in_features
        setattr(block, _EP_ATTR, _BlockEP(dist=dist, expert_width=width, top_k=top_k))
        handle.restore_experts.append((block, original))
    logger.info("expert parallelism: rank %d/%d holds experts %d..%d of %d in %d MoE blocks", dist.rank,
                dist.world_size, local.start, local.stop - 1, num_experts, len(blocks))
    return handle
