"""IterSmooth (SmoothQuant per unit): move activation outliers of X into the weights that read X.

For a subgraph (producers of X -> linears reading X), per input channel j:
    s_j = clamp(max|X_j|^alpha / max|W_:,j|^(1 - alpha), min=scale_min)      (W: every quantized reader)
    X <- X / s   folded into the producers (a norm's weight, or a linear's output rows and bias)
    W[:, j] <- W[:, j] * s_j   for every reader (including float readers such as the router)
A channel that saw no activation (an expert that received no token) or has an all-zero weight column keeps s_j = 1.

The model knowledge is data: `adapter.smooth_subgraphs(unit, module) -> list[Subgraph]`. Statistics come from one
`ctx.collect_input_absmax` call per unit (the runner reduces replicated modules over data-parallel ranks); the
"iteration" is the runner's: each unit is calibrated on the outputs of already-processed upstream units.

Expert parallelism: a subgraph whose readers are the routed experts (`across_ranks=True`: routed_expert_down_proj -> every
expert's w1/w3, or the norm -> experts of a plain MoE) must get the same scale on every rank, but a rank holds only
some experts. Its statistics (max over the local experts' inputs and weight columns) are max-reduced over ranks with
`ctx.dist.all_reduce_max` -- one fixed-order collective per such subgraph (at most one per MoE layer), issued by
every rank in the same order whatever experts it holds, together with the include/exclude decision, so every rank
ends with bit-identical replicated weights.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from msmodelslim.core.runner.context import UnitContext
from msmodelslim.processor.base import Processor, ProcessorConfig, register_processor
from msmodelslim.processor.spans import WHOLE, Span

logger = logging.getLogger(__name__)

UP_DOWN = "up-down"  # up_proj (w3) rows -> down_proj (w2) columns
OV = "ov"  # MLA kv_b_proj V rows -> o_proj columns
LINEAR_LINEAR = "linear-linear"  # low-rank pairs (f_a -> f_b, g_a -> g_b), latent down -> experts, experts -> latent up
GATED_NORM_LINEAR = "gated-norm-linear"  # KDA o_norm (gated RMSNorm, weight shared by heads) -> o_proj
NORM_LINEAR = "norm-linear"  # RMSNorm -> every linear reading it (and the router, compensated)
SUBGRAPH_TYPES = (UP_DOWN, OV, LINEAR_LINEAR, GATED_NORM_LINEAR, NORM_LINEAR)  # processing order

SubgraphType = Literal["up-down", "ov", "linear-linear", "gated-norm-linear", "norm-linear"]


@dataclass(frozen=True)
class Subgraph:
    """Producers of one activation X and the linears reading it (live names inside the unit)."""

    type: str
    sources: tuple[str, ...]  # producers: a norm (weight /= s) or linears (output rows and bias /= s)
    targets: tuple[str, ...]  # quantized readers: max|X| from their inputs, max|W| from their columns; W *= s
    float_targets: tuple[str, ...] = ()  # readers that stay float (router): only compensated, W *= s
    source_rows: Span = WHOLE  # a linear producer's rows that make X (ov: each head's V rows of kv_b_proj)
    heads: int = 1  # X is `heads` equal blocks sharing one scale (o_norm's weight [V] is shared by the heads)
    across_ranks: bool = False  # targets are routed experts spread over EP ranks: statistics max-reduced over ranks

    def __post_init__(self) -> None:
        if self.type not in SUBGRAPH_TYPES:
            raise ValueError(f"Subgraph {self.sources} -> {self.targets}: unknown type {self.type!r}")


# ---------------------------------------------------------------------------------------------------------------
# The equations
# ---------------------------------------------------------------------------------------------------------------
def smooth_scale(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float, scale_min: float) -> torch.Tensor:
    """s = clamp(max|X|^alpha / max|W|^(1-alpha), min=scale_min); s = 1 where X or W carries no information."""
    x, w = x_absmax.double(), w_absmax.double()
    s = (x.pow(alpha) / w.pow(1.0 - alpha)).clamp(min=scale_min)
    return torch.where((x > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s))


@torch.no_grad()
def divide_norm(gamma: torch.Tensor, s: torch.Tensor) -> None:
    """gamma <- gamma / s (the norm's output X becomes X / s)."""
    gamma.copy_((gamma.double() / s.to(gamma.device)).to(gamma.dtype))


@torch.no_grad()
def divide_rows(linear: nn.Linear, s: torch.Tensor, rows: Span = WHOLE) -> None:
    """W[i, :] <- W[i, :] / s_i and b_i <- b_i / s_i on the span's rows (the linear's output becomes X / s)."""
    idx = rows.index(linear.weight.shape[0], linear.weight.device).reshape(-1)
    s = s.to(linear.weight.device)
    w = linear.weight.data
    w[idx] = (w[idx].double() / s[:, None]).to(w.dtype)
    if linear.bias is not None:
        b = linear.bias.data
        b[idx] = (b[idx].double() / s).to(b.dtype)


@torch.no_grad()
def multiply_columns(weight: torch.Tensor, s: torch.Tensor) -> None:
    """W[:, j] <- W[:, j] * s_j (the reader sees X / s and computes the same output)."""
    weight.copy_((weight.double() * s.to(weight.device)).to(weight.dtype))


# ---------------------------------------------------------------------------------------------------------------
# Config and processor
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class IterSmoothConfig(ProcessorConfig):
    alpha: float = 0.9  # migration strength: 1 moves all of the activation range into the weights
    scale_min: float = 1e-5
    enable_subgraph_type: list[SubgraphType] = field(default_factory=lambda: list(SUBGRAPH_TYPES))
    include: list[str] = field(default_factory=lambda: ["*"])  # fnmatch globs on the readers' checkpoint names
    exclude: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"iter_smooth.alpha must be in [0, 1], got {self.alpha!r}")
        if not self.scale_min > 0.0:
            raise ValueError(f"iter_smooth.scale_min must be > 0, got {self.scale_min!r}")
        bad = [t for t in self.enable_subgraph_type if t not in SUBGRAPH_TYPES]
        if bad:
            raise ValueError(f"iter_smooth.enable_subgraph_type: unknown type {bad[0]!r} (known: {', '.join(SUBGRAPH_TYPES)})")


@register_processor("iter_smooth", IterSmoothConfig)
class IterSmoothProcessor(Processor):
    config: IterSmoothConfig

    def __init__(self, config: IterSmoothConfig, adapter: Any) -> None:
        super().__init__(config, adapter)
        self.counts: dict[str, int] = {}  # subgraphs smoothed per type on this rank (logging and tests)
        self.skipped_online = 0  # subgraphs skipped because their reader takes an online rotation

    def selected(self, ctx: UnitContext, sg: Subgraph) -> bool:
        """Every reader's checkpoint name matches an include glob and no exclude glob."""
        for name in sg.targets:
            full = ctx.adapter.checkpoint_name(ctx.unit, name)
            if not any(fnmatch.fnmatchcase(full, g) for g in self.config.include):
                return False
            if any(fnmatch.fnmatchcase(full, g) for g in self.config.exclude):
                return False
        return True

    def process_unit(self, ctx: UnitContext) -> None:
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
        stats = ctx.collect_input_absmax(names)
        for kind in SUBGRAPH_TYPES:
            for sg in subgraphs:
                if sg.type == kind:
                    self.smooth(ctx, sg, modules, stats)

    def smooth(self, ctx: UnitContext, sg: Subgraph, modules: dict[str, nn.Module],
               stats: dict[str, torch.Tensor]) -> None:
        device = ctx.dist.device
        weights = [modules[t].weight.data for t in sg.targets]
        width = weights[0].shape[-1] if weights else _source_width(modules, sg)
        x_max = torch.zeros(width, dtype=torch.float32, device=device)
        w_max = torch.zeros(width, dtype=torch.float32, device=device)
        for t, w in zip(sg.targets, weights):
            x_max = torch.maximum(x_max, stats[t].to(device, torch.float32))
            w_max = torch.maximum(w_max, w.abs().amax(dim=0).to(device, torch.float32))
        if sg.across_ranks:
            skip = torch.tensor([0.0 if self.selected(ctx, sg) else 1.0], device=device)
            red = ctx.dist.all_reduce_max({"skip": skip, "w": w_max, "x": x_max})
            if float(red["skip"]) > 0:
                return
            x_max, w_max = red["x"], red["w"]
        if sg.heads > 1:  # one scale per channel shared by all heads: the max over heads of both statistics
            x_max = x_max.view(sg.heads, -1).amax(dim=0)
            w_max = w_max.view(sg.heads, -1).amax(dim=0)
        s = smooth_scale(x_max, w_max, self.config.alpha, self.config.scale_min)

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
        self.counts[sg.type] = self.counts.get(sg.type, 0) + 1

    def describe(self) -> dict[str, Any]:
        """{"iter_smooth": the settings}; per-rank counts stay out (the description must not depend on the ranks)."""
        return {"iter_smooth": {
            "alpha": self.config.alpha,
            "scale_min": self.config.scale_min,
            "subgraph_types": list(self.config.enable_subgraph_type),
        }}


def _source_width(modules: dict[str, nn.Module], sg: Subgraph) -> int:
    """Channels of X when this rank holds no reader (an EP rank without local targets still joins the reduction)."""
    src = modules[sg.sources[0]]
    if isinstance(src, nn.Linear):
        return sg.source_rows.index(src.weight.shape[0]).numel()
    return src.weight.shape[0] * sg.heads
