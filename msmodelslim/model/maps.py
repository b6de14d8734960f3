"""Model maps: the vocabulary in which an adapter describes a model to the processors, as data.

- `Span`: which channels of one weight dimension a rotation or a smoothing scale acts on.
- QuaRot's plan (`QuaRotPlan` of `FuseNorm` / `Rotate` over named spaces): `adapter.quarot_plan(unit, module)`.
- Smoothing subgraphs (`Subgraph`): `adapter.smooth_subgraphs(unit, module)`.
The adapter builds them from live names; processor/quarot.py and processor/iter_smooth.py apply them.

Spans

A span is `count` equal blocks of `width` channels, block h starting at channel h * period + offset. Examples
(MLA, H heads): kv_b_proj's V rows `Span(offset=nope, width=v, period=nope + v, count=H)`; o_proj's per-head input
columns `Span(width=v, period=v, count=H)`; kv_a_proj_with_mqa's non-rope rows `Span(width=kv_lora_rank)`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass(frozen=True)
class Span:
    width: int | None = None  # None: the whole dimension (one block)
    offset: int = 0
    period: int = 0
    count: int = 1

    def index(self, size: int, device: torch.device | None = None) -> torch.Tensor:
        """LongTensor [count, width] of channel indices into a dimension of `size` channels."""
        width = size if self.width is None else self.width
        starts = torch.arange(self.count, device=device) * self.period + self.offset
        idx = starts[:, None] + torch.arange(width, device=device)[None, :]
        if idx.numel() and int(idx.max()) >= size:
            raise ValueError(f"{self} reaches channel {int(idx.max())} of a dimension of size {size}")
        return idx

    def block_width(self, size: int) -> int:
        return size if self.width is None else self.width


WHOLE = Span()


# ---------------------------------------------------------------------------------------------------------------
# QuaRot's spaces: residual-like spaces, each rotated by one Q per size
# ---------------------------------------------------------------------------------------------------------------
HIDDEN = "hidden"  # the residual stream
LATENT = "latent"  # latent MoE: routed_expert_down_proj outputs / expert inputs, expert outputs / up_proj inputs
KV_LORA = "kv_lora"  # MLA compressed kv (kv_a non-rope rows -> kv_a_layernorm -> kv_b_proj inputs)
MLA_V = "mla_v"  # MLA per-head values (kv_b_proj V rows -> attention -> o_proj inputs), one Q of v_head_dim
SPACES = (HIDDEN, LATENT, KV_LORA, MLA_V)


# ---------------------------------------------------------------------------------------------------------------
# QuaRot's plan
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FuseNorm:
    """W <- W diag(gamma) for every reader, then gamma <- 1 (needed before `space` is rotated). `span` picks the
    reader columns the norm feeds (MTP's eh_proj reads [enorm(e) | hnorm(h)])."""

    norm: str
    readers: tuple[str, ...]
    space: str = HIDDEN
    span: Span = WHOLE


@dataclass(frozen=True)
class Rotate:
    """side "in": W <- W Q on the last weight dim (readers, embedding tables);
    side "out": W <- Q^T W, b <- Q^T b on the first weight dim (writers). `span` picks the rotated channels
    (each block of the span takes the same Q of the block's width)."""

    name: str
    side: str
    space: str = HIDDEN
    span: Span = WHOLE

    def __post_init__(self) -> None:
        if self.side not in ("in", "out"):
            raise ValueError(f"Rotate({self.name!r}): side must be 'in' or 'out', got {self.side!r}")
        if self.space not in SPACES:
            raise ValueError(f"Rotate({self.name!r}): unknown space {self.space!r} (known: {SPACES})")


@dataclass(frozen=True)
class AppendRotation:
    """A writer of `space` whose output no stored weight can rotate (it ends in a norm: RMSNorm(u) diag(w) Q is no
    RMSNorm of any rotated u) gets an explicit stored linear `name` [size, size], W = Q^T, applied to `module`'s
    output (y = x W^T = x Q) by the serving engine: Kimi-K3's projector and vllm-ascend's `mm_projector.rot_proj`."""

    module: str
    name: str
    size: int
    space: str = HIDDEN


@dataclass
class QuaRotPlan:
    fuse: list[FuseNorm] = field(default_factory=list)
    rotate: list[Rotate] = field(default_factory=list)
    online: list[str] = field(default_factory=list)  # down projections whose input takes an online Hadamard
    append: list[AppendRotation] = field(default_factory=list)  # explicit rotations after norm-ended writers


# ---------------------------------------------------------------------------------------------------------------
# Smoothing subgraphs
# ---------------------------------------------------------------------------------------------------------------
UP_DOWN = "up-down"  # up_proj (w3) rows -> down_proj (w2) columns
OV = "ov"  # MLA kv_b_proj V rows -> o_proj columns
LINEAR_LINEAR = "linear-linear"  # low-rank pairs (f_a -> f_b, g_a -> g_b), latent down -> experts, experts -> latent up
GATED_NORM_LINEAR = "gated-norm-linear"  # KDA o_norm (gated RMSNorm, weight shared by heads) -> o_proj
NORM_LINEAR = "norm-linear"  # RMSNorm -> every linear reading it (and the router, compensated)
SubgraphType = Literal["up-down", "ov", "linear-linear", "gated-norm-linear", "norm-linear"]
SUBGRAPH_TYPES: tuple[str, ...] = typing.get_args(SubgraphType)  # processing order


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
