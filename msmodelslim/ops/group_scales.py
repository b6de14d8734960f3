"""The epilogue of the grouped experts' int8 GEMMs as one Triton kernel (CUDA).

A rank's routed experts multiply their rows into one int32 buffer (`quant.modules._products_in_one_buffer`); each
row's sums then become float32, times the row's token scale, times its expert's weight scales, cast to the model
dtype. In PyTorch that is a conversion, a per-token product and one product per expert over its rows (112 launches
per linear position at Kimi-K3's EP-8 rank, each a few microseconds of work behind its host-side launch): here one
launch, which reads each row's expert from a table, and torch's cast.

The same float32 operations in the same order, element by element: the int32 sum rounded to float32 (to nearest),
times the token scale, times the weight scale (two products, each rounded, nothing fused), so the output is
bit-identical to the PyTorch epilogue's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_ROWS, _BLOCK_COLS = 32, 128


@triton.jit
def _group_scales_kernel(SUMS, TOKEN_SCALES, WEIGHT_SCALES, GROUPS, OUT, rows, cols,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_mask = r < rows
    mask = row_mask[:, None] & (c < cols)[None, :]
    offsets = r.to(tl.int64)[:, None] * cols + c[None, :]
    sums = tl.load(SUMS + offsets, mask=mask, other=0).to(tl.float32)
    token_scale = tl.load(TOKEN_SCALES + r, mask=row_mask, other=0.0)
    group = tl.load(GROUPS + r, mask=row_mask, other=0)
    weight_scale = tl.load(WEIGHT_SCALES + group.to(tl.int64)[:, None] * cols + c[None, :], mask=mask, other=0.0)
    tl.store(OUT + offsets, (sums * token_scale[:, None]) * weight_scale, mask=mask)


def group_scales(sums: torch.Tensor, token_scales: torch.Tensor, weight_scales: torch.Tensor, groups: torch.Tensor
                 ) -> torch.Tensor:
    """(float32(sums) * token_scales) * weight_scales[groups], float32: sums int32 [N, C] (contiguous), token_scales
    float32 [N], weight_scales float32 [G, C], groups int32 [N] (each row's index into weight_scales). The cast to
    the model dtype stays torch's (Triton's interpreter casts to bfloat16 toward zero)."""
    rows, cols = sums.shape
    out = torch.empty(rows, cols, dtype=torch.float32, device=sums.device)
    if rows:
        grid = (triton.cdiv(rows, _BLOCK_ROWS), triton.cdiv(cols, _BLOCK_COLS))
        _group_scales_kernel[grid](sums, token_scales.contiguous(), weight_scales.contiguous(), groups.contiguous(),
                                   out, rows, cols, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS, num_warps=4,
                                   enable_fp_fusion=False)
    return out
