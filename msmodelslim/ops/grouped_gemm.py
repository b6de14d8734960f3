"""The grouped experts' GEMMs as one Triton kernel (CUDA): int8 with their scales, and 16-bit.

A rank's routed experts each multiply their rows (sorted by expert: group g is rows bounds[g]) by their own int8
weight [out, in]. As one `torch._int_mm` per expert that is 112 launches per linear position at Kimi-K3's EP-8 rank,
each behind its host-side work, then the scales (ops/group_scales.py). Here one launch: a table of row tiles (each
inside one group, made on the host from the bounds it already has) and a table of the experts' weight addresses
(no stacked copy of the weights), int32 sums per tile as the int8 GEMM makes them, then the same epilogue as
`group_scales`: the sum rounded to float32, times the row's token scale, times the expert's weight scale, two
products each rounded, nothing fused. Integer sums are exact in any order, so the output is bit-identical to the
per-expert GEMMs and their scales. The 16-bit form (a float expert's linears in the statistics pass) sums in float32
in another order than a GEMM per expert: within its rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from msmodelslim.core.device import host_values

# tile sizes and launch options (bench/grouped_gemm.py compares others)
CONFIG = {"BLOCK_ROWS": 64, "BLOCK_COLS": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


@triton.jit
def _grouped_kernel(X, TOKEN_SCALES, WEIGHTS, WEIGHT_SCALES, TILES, OUT, inner, cols,
                    INTEGER: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_K: tl.constexpr):
    """INTEGER: int8 rows and weights, int32 sums, then the scales; else 16-bit rows and weights summed in float32."""
    tile = tl.program_id(0)
    group = tl.load(TILES + 3 * tile)
    first = tl.load(TILES + 3 * tile + 1)
    end = tl.load(TILES + 3 * tile + 2)
    # this expert's [cols, inner]: a loaded address has no known alignment, and without one every load is split
    # into single elements (torch's allocations are 512-byte aligned)
    weight = tl.multiple_of(tl.load(WEIGHTS + group).to(tl.pointer_type(X.dtype.element_ty)), 16)
    r = first + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_mask = r < end
    col_mask = c < cols
    sums = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.int32 if INTEGER else tl.float32)
    for k0 in range(0, inner, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < inner
        a = tl.load(X + r.to(tl.int64)[:, None] * inner + k[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0)
        b = tl.load(weight + c.to(tl.int64)[None, :] * inner + k[:, None], mask=col_mask[None, :] & k_mask[:, None],
                    other=0)
        if INTEGER:
            sums = tl.dot(a, b, sums, out_dtype=tl.int32)
        else:
            # 16-bit values are exact in TF32, whose products sum in float32 (Triton's interpreter multiplies
            # bfloat16 tiles as their bits: it checks this form)
            sums = tl.dot(a.to(tl.float32), b.to(tl.float32), sums, input_precision="tf32", out_dtype=tl.float32)
    if INTEGER:
        weight_scale = tl.multiple_of(tl.load(WEIGHT_SCALES + group).to(tl.pointer_type(tl.float32)), 16)  # [cols]
        token_scale = tl.load(TOKEN_SCALES + r, mask=row_mask, other=0.0)
        scale = tl.load(weight_scale + c, mask=col_mask, other=0.0)
        out = (sums.to(tl.float32) * token_scale[:, None]) * scale[None, :]
    else:
        out = sums
    tl.store(OUT + r.to(tl.int64)[:, None] * cols + c[None, :], out, mask=row_mask[:, None] & col_mask[None, :])


def row_tiles(bounds: Sequence[tuple[int, int]], block_rows: int) -> list[int]:
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
    scales = [s.reshape(-1) for s in weight_scales]
    cols = weights[0].shape[0]
    if any(not s.is_contiguous() or s.dtype != torch.float32 or s.numel() != cols for s in scales):
        raise ValueError(f"grouped_int8_gemm: every weight scale must be float32 [{cols}]")
    return _launch(rows, token_scales.contiguous(), weights, scales, bounds, integer=True)


def grouped_gemm(rows: torch.Tensor, weights: Sequence[torch.Tensor], bounds: Sequence[tuple[int, int]]
                 ) -> torch.Tensor:
    """float32 [n, out]: row i of group g is rows[i] . weights[g][j], summed in float32, for 16-bit rows [n, in]
    (contiguous) and weights [out, in] of their dtype. Not bit-identical to a GEMM per group (the float32 sums run in
    another order): within their rounding."""
    return _launch(rows, rows.new_empty(0, dtype=torch.float32), weights, [], bounds, integer=False)


def _launch(rows: torch.Tensor, token_scales: torch.Tensor, weights: Sequence[torch.Tensor],
            scales: Sequence[torch.Tensor], bounds: Sequence[tuple[int, int]], integer: bool) -> torch.Tensor:
    n, inner = rows.shape
    cols = weights[0].shape[0]
    out = torch.empty(n, cols, dtype=torch.float32, device=rows.device)
    tiles = row_tiles(bounds, CONFIG["BLOCK_ROWS"])
    if not tiles:
        return out
    if not rows.is_contiguous() or any(not w.is_contiguous() or tuple(w.shape) != (cols, inner)
                                       or w.dtype != rows.dtype for w in weights):
        raise ValueError(f"grouped GEMM: contiguous rows and every weight a contiguous {rows.dtype} [{cols}, {inner}]")
    # the tables in one copy to the device, without waiting for it
    table = host_values([*(w.data_ptr() for w in weights), *(s.data_ptr() for s in scales), *tiles], rows.device)
    groups, scaled = len(weights), len(scales)
    grid = (len(tiles) // 3, triton.cdiv(cols, CONFIG["BLOCK_COLS"]))
    _grouped_kernel[grid](rows, token_scales, table[:groups], table[groups:groups + scaled] if scaled else table,
                          table[groups + scaled:], out, inner, cols, INTEGER=integer, **CONFIG, enable_fp_fusion=False)
    return out
