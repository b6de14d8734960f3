"""Channel spans: which channels of one weight dimension a rotation or a smoothing scale acts on.

A span is `count` equal blocks of `width` channels, block h starting at channel h * period + offset. Examples
(MLA, H heads): kv_b_proj's V rows `Span(offset=nope, width=v, period=nope + v, count=H)`; o_proj's per-head input
columns `Span(width=v, period=v, count=H)`; kv_a_proj_with_mqa's non-rope rows `Span(width=kv_lora_rank)`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
