"""The grouped experts' int8 GEMMs and their scales as one Triton kernel (CUDA).

A rank's routed experts each multiply their rows (sorted by expert: group g is rows bounds[g]) by their own int8
weight [out, in]. As one `torch._int_mm` per expert that is 112 launches per linear position at Kimi-K3's EP-8 rank,
each behind its host-side work, then the scales (ops/group_scales.py). Here one launch: a table of row tiles (each
inside one group, made on the host from the bounds it already has) and a table of the experts' weight addresses
(no stacked copy of the weights), int32 sums per tile as the int8 GEMM makes them, then the same epilogue as
`group_scales`: the sum rounded to float32, times the row's token scale, times the expert's weight scale, two
products each rounded, nothing fused. Integer sums are exact in any order, so the output is bit-identical to the
per-expert GEMMs and their scales.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from msmodelslim.core.device import host_values

_BLOCK_ROWS, _BLOCK_COLS, _BLOCK_K = 64, 128, 64


@triton.jit
def _grouped_int8_kernel(X, TOKEN_SCALES, WEIGHTS, WEIGHT_SCALES, TILES, OUT, inner, cols,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    group = tl.load(TILES + 3 * tile)
    first = tl.load(TILES + 3 * tile + 1)
    end = tl.load(TILES + 3 * tile + 2)
    weight = tl.load(WEIGHTS + group).to(tl.pointer_type(tl.int8))  # this expert's [cols, inner], contiguous
    weight_scale = tl.load(WEIGHT_SCALES + group).to(tl.pointer_type(tl.float32))  # its [cols]
    r = first + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_mask = r < end
    col_mask = c < cols
    sums = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.int32)
    for k0 in range(0, inner, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < inner
        a = tl.load(X + r.to(tl.int64)[:, None] * inner + k[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0)
        b = tl.load(weight + c.to(tl.int64)[None, :] * inner + k[:, None], mask=col_mask[None, :] & k_mask[:, None],
                    other=0)
        sums = tl.dot(a, b, sums, out_dtype=tl.int32)
    token_scale = tl.load(TOKEN_SCALES + r, mask=row_mask, other=0.0)
    scale = tl.load(weight_scale + c, mask=col_mask, other=0.0)
    out = (sums.to(tl.float32) * token_scale[:, None]) * scale[None, :]
    tl.store(OUT + r.to(tl.int64)[:, None] * cols + c[None, :], out, mask=row_mask[:, None] & col_mask[None, :])


def row_tiles(bounds: Sequence[tuple[int, int]], block_rows: int = _BLOCK_ROWS) -> list[int]:
    """(group, first row, end row) of every tile of at most `block_rows` rows, each inside one group, flat."""
    tiles: list[int] = []
    for g, (start, end) in enumerate(bounds):
        for first in range(start, end, block_rows):
            tiles += (g, first, end)
    return tiles


def grouped_int8_gemm(rows: torch.Tensor, token_scales: torch.Tensor, weights: Sequence[torch.Tensor],
                      weight_scales: Sequence[torch.Tensor], bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """float32 [n, out]: row i of group g (rows bounds[g]) is (float32(rows[i] . weights[g][j]) * token_scales[i])
    * weight_scales[g][j]. rows int8 [n, in] (contiguous), token_scales float32 [n], weights int8 [out, in] and
    weight_scales float32 [out] (or [out, 1]) per group; the bounds tile the rows in order. Rows of no group are
    left unwritten."""
    n, inner = rows.shape
    cols = weights[0].shape[0]
    out = torch.empty(n, cols, dtype=torch.float32, device=rows.device)
    tiles = row_tiles(bounds)
    if not tiles:
        return out
    if any(not w.is_contiguous() or tuple(w.shape) != (cols, inner) for w in weights):
        raise ValueError(f"grouped_int8_gemm: every weight must be a contiguous int8 [{cols}, {inner}]")
    scales = [s.reshape(-1) for s in weight_scales]
    if any(not s.is_contiguous() or s.dtype != torch.float32 or s.numel() != cols for s in scales):
        raise ValueError(f"grouped_int8_gemm: every weight scale must be float32 [{cols}]")
    # the tables in one copy to the device, without waiting for it
    table = host_values([*(w.data_ptr() for w in weights), *(s.data_ptr() for s in scales), *tiles], rows.device)
    groups = len(weights)
    grid = (len(tiles) // 3, triton.cdiv(cols, _BLOCK_COLS))
    _grouped_int8_kernel[grid](rows, token_scales.contiguous(), table[:groups], table[groups:2 * groups],
                               table[2 * groups:], out, inner, cols, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS,
                               BLOCK_K=_BLOCK_K, num_warps=4, num_stages=3, enable_fp_fusion=False)
    return out
