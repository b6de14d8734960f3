"""IterSmooth (SmoothQuant per unit): move activation outliers of X into the weights that read X.

For a subgraph (producers of X -> linears reading X), per input channel j:
    s_j = clamp(max|X_j|^alpha / max|W_:,j|^(1 - alpha), min=scale_min)      (W: every quantized reader)
    X <- X / s   folded into the producers (a norm's weight, or a linear's output rows and bias)
    W[:, j] <- W[:, j] * s_j   for every reader (including float readers such as the router)
A channel that saw no activation (an expert that received no token) or has an all-zero weight column keeps s_j = 1.

The model knowledge is data: `adapter.smooth_subgraphs(unit, module) -> list[Subgraph]`. Statistics are the
runner's: the processor asks for the readers' input absmax (`Observe`), and the runner reduces them over
data-parallel ranks; the "iteration" is the runner's too: each unit is calibrated on the outputs of already-processed
upstream units.

Searched strength (`search: true`): per subgraph, the candidates are "no smoothing" and every alpha of
`search_alphas`; the one of least modelled quantized output error on the calibration tokens is applied (ties keep
the earlier, so "no smoothing" wins unless smoothing helps). For each quantized reader W (scheme from the
practice's linear_quant plan), with D = diag(1/s):
    weight part      tr(dW D H D dW^T),  dW = RTN(W diag(s)) - W diag(s),  H = X^T X
    activation part  ||W diag(s)||_F^2 * sum_t (max_j |x_tj| / s_j)^2 / (12 qmax_a^2)
(the second is the per-token quantizer's uniform rounding noise on X / s). H is over every calibration token when
the first pass gathered it for a GPTQ entry after this one; else it is taken over the sample. The per-token ranges
are summed over the samples of the first `search_tokens` calibration tokens (the same on any number of ranks),
whose inputs the runner keeps from the first pass (the candidates need that pass's maxima first, so the sums come
after it, from the kept inputs: one pass, `Observe.sample`), and scaled to H's tokens, so past that sample a token
costs the search nothing. The ranges are
exact integer sums and H is what pipeline/statistics.py guarantees, so the choice is the same on a rerun, on a
resume, and across rank counts as far as H is.

Expert parallelism: a subgraph whose readers are the routed experts (`across_ranks=True`: routed_expert_down_proj -> every
expert's w1/w3, or the norm -> experts of a plain MoE) must get the same scale on every rank, but a rank holds only
some experts. Its statistics (max over the local experts' inputs and weight columns) are max-reduced over ranks by
the runner (a `Reduce` request, issued by every rank in the same order whatever experts it holds, together with the
include/exclude decision); a searched one also sums its readers' errors over ranks, as integers on a grid of the
largest, so every rank ends with bit-identical replicated weights.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from msmodelslim.core.device import tensor_core_fp32_matmuls
from msmodelslim.core.placement import HOST, host_section
from msmodelslim.core.requests import Job, Jobs, Observe, Reduce, Rescaled, Stats
from msmodelslim.errors import UserError
from msmodelslim.model.maps import SUBGRAPH_TYPES, WHOLE, Span, Subgraph, SubgraphType
from msmodelslim.processor.base import Changes, Processor, ProcessorConfig, UnitContext, register_processor
from msmodelslim.processor.globs import selected
from msmodelslim.quant.functional import minmax_scale, quantize_with_scale
from msmodelslim.quant.granularity import PerChannel
from msmodelslim.quant.modules import get_scheme
from msmodelslim.serving.ascendv1 import FLOAT

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------
# The equations
# ---------------------------------------------------------------------------------------------------------------
def smooth_scale(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float, scale_min: float) -> torch.Tensor:
    """s = clamp(max|X|^alpha / max|W|^(1-alpha), min=scale_min); s = 1 where X or W carries no information."""
    x, w = x_absmax.float(), w_absmax.float()
    s = (x.pow(alpha) / w.pow(1.0 - alpha)).clamp(min=scale_min)
    return torch.where((x > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s))


@torch.no_grad()
def divide_norm(gamma: torch.Tensor, s: torch.Tensor) -> None:
    """gamma <- gamma / s (the norm's output X becomes X / s)."""
    gamma.copy_((gamma.float() / s.to(gamma.device, torch.float32)).to(gamma.dtype))


@torch.no_grad()
def divide_rows(linear: nn.Linear, s: torch.Tensor, rows: Span = WHOLE) -> None:
    """W[i, :] <- W[i, :] / s_i and b_i <- b_i / s_i on the span's rows (the linear's output becomes X / s)."""
    idx = rows.index(linear.weight.shape[0], linear.weight.device).reshape(-1)
    s = s.to(linear.weight.device, torch.float32)
    w = linear.weight.data
    w[idx] = (w[idx].float() / s[:, None]).to(w.dtype)
    if linear.bias is not None:
        b = linear.bias.data
        b[idx] = (b[idx].float() / s).to(b.dtype)


@torch.no_grad()
def multiply_columns(weight: torch.Tensor, s: torch.Tensor) -> None:
    """W[:, j] <- W[:, j] * s_j (the reader sees X / s and computes the same output)."""
    weight.copy_((weight.float() * s.to(weight.device, torch.float32)).to(weight.dtype))


def error_parts(weight: torch.Tensor, candidates: Sequence[torch.Tensor], hessian: torch.Tensor,
                w_bits: Any) -> torch.Tensor:
    """Per candidate smoothing s, the two sums of one reader's modelled error (module docstring), float32 [C, 2]
    on the device: the weight part through the Hessian and the smoothed weight's sum of squares, which the
    activation part scales (`modelled_errors`). They only rank candidates, so the product through the Hessian takes
    the tensor cores' float32 (TF32 / HF32: ~1e-3 relative, 3x faster than float32 on the H100, bench/quant_jobs.py;
    a candidate it ranks differently is one within that of the best, as good by the model), and the same inputs give
    the same bits on every rank. Nothing is read back, so the device runs the candidates back to back."""
    work = torch.float32
    w = weight.to(work)
    h = hessian.to(w.device, work)
    parts = []
    for s in candidates:
        s = s.to(w.device, work)
        ws = w * s
        scale = minmax_scale(ws, w_bits, PerChannel())
        m = (quantize_with_scale(ws, scale, w_bits).to(work) * scale - ws) / s
        with tensor_core_fp32_matmuls(w.device):
            through = m @ h
        parts.append(torch.stack([(through * m).sum(), ws.square().sum()]))
    return torch.stack(parts)


_FLOAT64_SUMS = "float64 sums of the smoothing search's errors (no float64 arithmetic on an NPU)"


def modelled_errors(parts: torch.Tensor, token_ranges: torch.Tensor, a_bits: Any) -> torch.Tensor:
    """The modelled errors (float64 [..., C], on the host) of `error_parts` [..., C, 2] and each candidate's token
    range [..., C]: the weight part plus the per-token activation rounding noise, in float64 on the host (an NPU
    has no float64 arithmetic)."""
    with host_section(_FLOAT64_SUMS):
        parts, ranges = parts.to(HOST, torch.float64), token_ranges.to(HOST, torch.float64)
        return parts[..., 0] + parts[..., 1] * ranges / (12.0 * a_bits.qmax ** 2)


# ---------------------------------------------------------------------------------------------------------------
# Config and processor
# ---------------------------------------------------------------------------------------------------------------
SEARCH_ALPHAS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9]
# the search's token ranges are taken on the first 65,536 calibration tokens and scaled to all of them: an average
# that many tokens pin down, so past them a token costs the search nothing (the Hessians see every token)
DEFAULT_SEARCH_TOKENS = 1 << 16
ERROR_GRID_BITS = 40  # readers' errors summed over ranks as integers in steps of 2^-40 of the largest


@dataclass
class IterSmoothConfig(ProcessorConfig):
    alpha: float = 0.9  # migration strength: 1 moves all of the activation range into the weights
    scale_min: float = 1e-5
    enable_subgraph_type: list[SubgraphType] = field(default_factory=lambda: list(SUBGRAPH_TYPES))
    include: list[str] = field(default_factory=lambda: ["*"])  # fnmatch globs on the readers' checkpoint names
    exclude: list[str] = field(default_factory=list)
    search: bool = False  # per subgraph: no smoothing or the best of search_alphas (module docstring); alpha unused
    search_alphas: list[float] = field(default_factory=lambda: list(SEARCH_ALPHAS))
    search_tokens: int | None = DEFAULT_SEARCH_TOKENS  # the token ranges' sample (module docstring); null: all

    def validate(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"iter_smooth.alpha must be in [0, 1], got {self.alpha!r}")
        if not self.scale_min > 0.0:
            raise ValueError(f"iter_smooth.scale_min must be > 0, got {self.scale_min!r}")
        if not self.search_alphas or not all(0.0 <= a <= 1.0 for a in self.search_alphas):
            raise ValueError(f"iter_smooth.search_alphas must be a non-empty list of values in [0, 1], "
                             f"got {self.search_alphas!r}")
        if self.search_tokens is not None and self.search_tokens < 1:
            raise ValueError(f"iter_smooth.search_tokens must be a positive number of tokens or null, "
                             f"got {self.search_tokens!r}")


@register_processor("iter_smooth", IterSmoothConfig)
class IterSmoothProcessor(Processor):
    config: IterSmoothConfig

    def __init__(self, config: IterSmoothConfig) -> None:
        super().__init__(config)
        self.counts: dict[str, int] = {}  # subgraphs smoothed per type on this rank (logging and tests)
        self.chosen: dict[str, list[float | None]] = {}  # searched: alpha (None: not smoothed) per type, this rank
        self.skipped_online = 0  # subgraphs skipped because their reader takes an online rotation
        self.schemes: dict[str, str] = {}  # reader checkpoint name -> planned scheme (for the search)

    def changes(self, ctx: UnitContext) -> Changes:
        # smoothing divides its readers' inputs by the scales it reports (`Rescaled`): the runner carries a later
        # GPTQ entry's Hessians, gathered in these passes, through it
        return Changes(inputs_rescaled=True)

    def preflight(self, adapter: Any, schemes: dict[str, str]) -> None:
        self.schemes = dict(schemes)
        mx = sorted({s for s in schemes.values() if s != FLOAT and get_scheme(s).is_mx})
        if self.config.search and mx:
            raise UserError(f"iter_smooth: the strength search models the integer schemes' error, and the practice "
                            f"quantizes with {', '.join(mx)}; set search: false (a fixed alpha) or leave it out")

    def selected(self, ctx: UnitContext, sg: Subgraph) -> bool:
        """Every reader's checkpoint name matches an include glob and no exclude glob."""
        cfg = self.config
        return all(selected(ctx.adapter.checkpoint_name(ctx.unit, t), cfg.include, cfg.exclude) for t in sg.targets)

    def process_unit(self, ctx: UnitContext) -> Any:
        enabled = set(self.config.enable_subgraph_type)
        modules = dict(ctx.module.named_modules())
        subgraphs = []
        for sg in ctx.adapter.smooth_subgraphs(ctx.unit, ctx.module):
            missing = [n for n in sg.sources + sg.targets + sg.float_targets if n not in modules]
            if missing:
                raise KeyError(f"smoothing subgraph {sg.type} of unit {ctx.unit.name}: no module named {missing[0]!r}")
            if sg.type not in enabled:
                continue
            for name in sg.sources + sg.targets + sg.float_targets:
                self.require_float_weight(ctx.unit.name, name, modules[name])
            if any(hasattr(modules[t], "online_rotation") for t in sg.targets):
                # the reader sees T x (online Hadamard): a scale folded into the producer of x cannot reach it
                self.skipped_online += 1
                continue
            subgraphs.append(sg)
        if not subgraphs:  # decided on structure and config only, so every rank skips (or calibrates) alike
            return
        # include/exclude can differ between ranks for rank-local experts: every rank still runs the samples (the
        # EP forward is collective) and cross-rank subgraphs are always measured, their decision reduced over ranks
        subgraphs = [sg for sg in subgraphs if sg.across_ranks or self.selected(ctx, sg)]
        names = sorted({t for sg in subgraphs for t in sg.targets})
        readers = [self._reader_schemes(ctx, sg) for sg in subgraphs] if self.config.search else []
        groups = [_input_groups(tuple(r), ctx.adapter.is_rank_local) for r in readers]
        # the search's token sample is kept from this pass (its ranges need this pass's maxima first): one pass
        sample = tuple(group[0] for g in groups for group in g) if self.config.search_tokens is not None else ()
        absmax = (yield Observe(absmax=tuple(names), sample=sample, sample_tokens=self.config.search_tokens)).absmax
        alphas: dict[int, float | None] = {i: self.config.alpha for i in range(len(subgraphs))}
        if self.config.search:
            alphas = yield from self._search(ctx, subgraphs, modules, absmax, readers, groups)
        for kind in SUBGRAPH_TYPES:
            for i, sg in enumerate(subgraphs):
                if sg.type == kind:
                    yield from self._smooth(ctx, sg, modules, absmax, alphas[i])

    def _statistics(self, ctx: UnitContext, sg: Subgraph, modules: dict[str, nn.Module],
                    absmax: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(max|X_j| over the readers, max|W_:,j| over the readers, 1.0 if this rank excludes the subgraph)."""
        device = ctx.device
        width = modules[sg.targets[0]].weight.shape[-1] if sg.targets else _source_width(modules, sg)
        x_max = torch.zeros(width, dtype=torch.float32, device=device)
        w_max = torch.zeros(width, dtype=torch.float32, device=device)
        for t in sg.targets:
            x_max = torch.maximum(x_max, absmax[t].to(device, torch.float32))
            w_max = torch.maximum(w_max, modules[t].weight.data.abs().amax(dim=0).to(device, torch.float32))
        return x_max, w_max, 0.0 if self.selected(ctx, sg) else 1.0

    def _scale(self, sg: Subgraph, x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
        if sg.heads > 1:  # one scale per channel shared by all heads: the max over heads of both statistics
            x_max = x_max.view(sg.heads, -1).amax(dim=0)
            w_max = w_max.view(sg.heads, -1).amax(dim=0)
        return smooth_scale(x_max, w_max, alpha, self.config.scale_min)

    def _reduced_statistics(self, ctx: UnitContext, sg: Subgraph, modules: dict[str, nn.Module],
                            absmax: dict[str, torch.Tensor]) -> Any:
        x_max, w_max, skip = self._statistics(ctx, sg, modules, absmax)
        if sg.across_ranks:
            red = yield Reduce("max", {"skip": torch.tensor([skip], device=ctx.device), "w": w_max, "x": x_max})
            x_max, w_max, skip = red["x"], red["w"], float(red["skip"])
        return x_max, w_max, skip

    def _smooth(self, ctx: UnitContext, sg: Subgraph, modules: dict[str, nn.Module],
                absmax: dict[str, torch.Tensor], alpha: float | None) -> Any:
        x_max, w_max, skip = yield from self._reduced_statistics(ctx, sg, modules, absmax)
        if skip > 0 or alpha is None:
            return
        s = self._scale(sg, x_max, w_max, alpha)
        for name in sg.sources:
            src = modules[name]
            if isinstance(src, nn.Linear):
                divide_rows(src, s, sg.source_rows)
            else:
                if src.weight.shape != s.shape:
                    raise ValueError(f"unit {ctx.unit.name}: norm {name} has {tuple(src.weight.shape)} channels, "
                                     f"the smoothing scale {tuple(s.shape)}")
                divide_norm(src.weight.data, s)
        full = s.repeat(sg.heads)
        for name in sg.targets + sg.float_targets:
            multiply_columns(modules[name].weight.data, full)
        yield Rescaled(tuple(sg.targets + sg.float_targets), full)
        self.counts[sg.type] = self.counts.get(sg.type, 0) + 1

    # --- the search ---------------------------------------------------------------------------------------------
    def _reader_schemes(self, ctx: UnitContext, sg: Subgraph) -> dict[str, Any]:
        """Quantized readers of the subgraph -> their planned scheme (float readers add no error)."""
        out = {}
        for t in sg.targets:
            scheme = self.schemes.get(ctx.adapter.checkpoint_name(ctx.unit, t), FLOAT)
            if scheme != FLOAT:
                out[t] = get_scheme(scheme)
        return out

    def _search(self, ctx: UnitContext, subgraphs: list[Subgraph], modules: dict[str, nn.Module],
                absmax: dict[str, torch.Tensor], readers: list[dict[str, Any]],
                groups: list[list[tuple[str, ...]]]) -> Any:
        """alpha (or None: no smoothing) per subgraph index, minimising the modelled error. `readers`: each
        subgraph's quantized readers and their schemes; `groups`: those readers by input (the first one is
        measured)."""
        candidates: dict[int, list[torch.Tensor]] = {}  # subgraph -> full-width scales, "none" first
        token_ranges: dict[str, torch.Tensor] = {}
        for i, sg in enumerate(subgraphs):
            x_max, w_max, _ = yield from self._reduced_statistics(ctx, sg, modules, absmax)
            ones = torch.ones_like(x_max, dtype=torch.float32)
            candidates[i] = [ones] + [self._scale(sg, x_max, w_max, a).repeat(sg.heads)
                                      for a in self.config.search_alphas]
            inv = 1.0 / torch.stack(candidates[i])
            for group in groups[i]:
                if group[0] in token_ranges:
                    raise ValueError(f"unit {ctx.unit.name}: {group[0]} reads two smoothing subgraphs")
                token_ranges[group[0]] = inv
        stats = Stats()
        if token_ranges:
            reps = tuple(token_ranges)
            stats = yield Observe(hessian=reps, token_ranges=token_ranges, ranges={n: absmax[n] for n in reps},
                                  tokens=self.config.search_tokens)
        jobs = []  # the error model is the heavy part: replicated subgraphs are spread over the ranks
        for i, sg in enumerate(subgraphs):
            rows = [(modules[t].weight.data, readers[i][t], stats.hessian[group[0]], _every_token(stats, group[0]))
                    for group in groups[i] for t in group]
            cost = len(candidates[i]) * sum(w.numel() * w.shape[-1] for w, *_ in rows)
            local = sg.across_ranks or any(ctx.adapter.is_rank_local(t) for t in readers[i])
            jobs.append(Job(str(i), cost, partial(_candidate_errors, rows, candidates[i]),
                            outputs={"errors": ((len(rows), len(candidates[i])), torch.float32)}, local=local))
        results = yield Jobs(jobs)
        errors = {i: results[str(i)]["errors"] for i in range(len(subgraphs))}
        shared = [i for i, sg in enumerate(subgraphs) if sg.across_ranks]
        totals = {i: errors[i].sum(dim=0) for i in errors}
        if shared:  # rank-local readers: sum their errors over ranks exactly, as integers on one grid
            top = yield Reduce("max", {str(i): errors[i].amax().reshape(1).float() if errors[i].numel() else
                                       torch.zeros(1) for i in shared})
            tops = {i: float(top[str(i)]) or 1.0 for i in shared}  # errors / top <= 1: a float32-safe grid
            ints = {str(i): torch.round(errors[i] / tops[i] * 2.0 ** ERROR_GRID_BITS).to(torch.int64).sum(dim=0)
                    for i in shared}
            summed = yield Reduce("sum", ints)
            totals.update({i: summed[str(i)] for i in shared})  # int64: compared exactly
        chosen = {}
        for i, sg in enumerate(subgraphs):
            best = int(torch.argmin(totals[i])) if readers[i] or sg.across_ranks else 0  # first of equal minima
            chosen[i] = None if best == 0 else self.config.search_alphas[best - 1]
            self.chosen.setdefault(sg.type, []).append(chosen[i])
        return chosen

    def resume_state(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "chosen": {k: list(v) for k, v in self.chosen.items()},
                "skipped_online": self.skipped_online}

    def restore_state(self, state: dict[str, Any]) -> None:
        self.counts, self.skipped_online = dict(state["counts"]), state["skipped_online"]
        self.chosen = {k: list(v) for k, v in state["chosen"].items()}

    def describe(self) -> dict[str, Any]:
        """{"iter_smooth": the settings}; per-rank counts stay out (the description must not depend on the ranks)."""
        strength = {"search_alphas": list(self.config.search_alphas), "search_tokens": self.config.search_tokens} \
            if self.config.search else {"alpha": self.config.alpha}
        return {"iter_smooth": {**strength, "scale_min": self.config.scale_min,
                                "subgraph_types": list(self.config.enable_subgraph_type)}}


def _candidate_errors(rows: list[tuple], candidates: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"errors": [reader, candidate]} of the modelled error (rows: weight, scheme, Hessian, token ranges)."""
    if not rows:
        return {"errors": torch.zeros(0, len(candidates))}
    parts = torch.stack([error_parts(w, candidates, h, scheme.weight) for w, scheme, h, _ in rows]).to(HOST)
    with host_section(_FLOAT64_SUMS):
        errors = [modelled_errors(p, r, scheme.act) for p, (_, scheme, _, r) in zip(parts, rows, strict=True)]
        return {"errors": torch.stack(errors).float()}


def _every_token(stats: Stats, name: str) -> torch.Tensor:
    """The token ranges of `name` summed over every token its Hessian saw: those of the search's sample, times the
    Hessian's tokens over the sample's (1 when the sample is every token, so the sums are unchanged). A reader the
    sample did not reach (a routed expert) gets none."""
    seen, every = stats.range_tokens[name], stats.tokens[name]
    ranges = stats.token_ranges[name]
    return ranges * (every / seen) if seen else torch.zeros_like(ranges)


def _input_groups(readers: tuple[str, ...], is_rank_local: Any) -> list[tuple[str, ...]]:
    """Readers of a subgraph that see one input: one routed expert's (w1 and w3), or all the others."""
    groups: dict[str, list[str]] = {}
    for name in readers:
        groups.setdefault(name.rpartition(".")[0] if is_rank_local(name) else "", []).append(name)
    return [tuple(g) for g in groups.values()]


def _source_width(modules: dict[str, nn.Module], sg: Subgraph) -> int:
    """Channels of X when this rank holds no reader (an EP rank without local targets still joins the reduction)."""
    src = modules[sg.sources[0]]
    if isinstance(src, nn.Linear):
        return sg.source_rows.index(src.weight.shape[0]).numel()
    return src.weight.shape[0] * sg.heads
