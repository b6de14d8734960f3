"""The clipping-grid scale search of `quant.functional.grid_scale_search` as one Triton kernel (CUDA).

The search tries `steps` scales per weight row and then refines the best by least squares; in elementwise PyTorch
each try is eight passes over the whole batch of weights (a layer's 112 routed experts: 2.5G float32 values for w1 /
w3), so the search is memory-bound: 4.8 of the 7.1 s that GPTQ of those experts takes on an H100, where the column
loop takes 2.3 (BENCHMARKS.md, session 35). Here one program takes one row and reads it once for all the tries
(the refinements re-read it from cache), so the search costs about one read of the weights.

The same arithmetic as the PyTorch search, element by element: the quotient rounded correctly (`div_rn`), rounding
half to even, the products rounded before they are subtracted (no fused multiply-add); the sums over a row run in
another order, so a row whose two best candidates tie to the last bits can pick the other one (their errors differ
by rounding only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_HALF_EVEN = tl.constexpr(12582912.0)  # 1.5 * 2^23: (x + c) - c rounds a float32 |x| < 2^22 to the nearest integer, ties to even


@triton.jit
def _quantized(w, s, qmin, qmax):
    q = tl.math.div_rn(w, s)
    q = (q + _HALF_EVEN) - _HALF_EVEN  # beyond 2^22 the clamp decides anyway
    return tl.minimum(tl.maximum(q, qmin), qmax)


@triton.jit
def _block(w_row, imp_row, start, cols, BLOCK: tl.constexpr):
    """Inputs start .. start + BLOCK of the row and their weights (0 past the row's end: they add nothing)."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < cols
    return tl.load(w_row + offs, mask=mask, other=0.0), tl.load(imp_row + offs, mask=mask, other=0.0)


@triton.jit
def _row_error(w_row, imp_row, cols, s, qmin, qmax, BLOCK: tl.constexpr):
    """sum_j imp_j (w_j - s q_j)^2 for one scale s."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        w, imp = _block(w_row, imp_row, start, cols, BLOCK)
        r = w - _quantized(w, s, qmin, qmax) * s
        acc += r * r * imp
    return tl.sum(acc, axis=0)


@triton.jit
def _grid_search_kernel(W, IMP, BASE, RATIOS, OUT, cols, rows_per_matrix, qmin, qmax,
                        STEPS: tl.constexpr, STEPS_P2: tl.constexpr, REFINE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    w_row = W + row.to(tl.int64) * cols
    imp_row = IMP + (row // rows_per_matrix).to(tl.int64) * cols
    base = tl.load(BASE + row)
    k = tl.arange(0, STEPS_P2)
    ratios = tl.load(RATIOS + k, mask=k < STEPS, other=1.0)
    scales = base * ratios  # [STEPS_P2]: ratios[0] = 1, the min/max scale itself
    # the grid: every candidate's error in one read of the row
    errors = tl.zeros([STEPS_P2], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        w, imp = _block(w_row, imp_row, start, cols, BLOCK)
        r = w[None, :] - _quantized(w[None, :], scales[:, None], qmin, qmax) * scales[:, None]
        errors += tl.sum(r * r * imp[None, :], axis=1)
    errors = tl.where(k < STEPS, errors, float("inf"))
    best_err = tl.min(errors, axis=0)
    best = tl.min(tl.where(errors == best_err, k, STEPS_P2), axis=0)  # the first of the least (strictly better wins)
    best_s = tl.sum(tl.where(k == best, scales, 0.0), axis=0)
    # least-squares refinements from the best grid point, each kept where it is strictly better
    for _ in tl.static_range(REFINE):
        wq = tl.zeros([BLOCK], dtype=tl.float32)
        qq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            w, imp = _block(w_row, imp_row, start, cols, BLOCK)
            q = _quantized(w, best_s, qmin, qmax)
            wq += w * q * imp
            qq += q * q * imp
        wq_sum = tl.sum(wq, axis=0)
        qq_sum = tl.sum(qq, axis=0)
        s = tl.where((qq_sum > 0) & (wq_sum > 0), tl.math.div_rn(wq_sum, tl.maximum(qq_sum, 1e-30)), best_s)
        err = _row_error(w_row, imp_row, cols, s, qmin, qmax, BLOCK)
        better = err < best_err
        best_s = tl.where(better, s, best_s)
        best_err = tl.where(better, err, best_err)
    tl.store(OUT + row, best_s)


def grid_search(w: torch.Tensor, importance: torch.Tensor, base: torch.Tensor, ratios: list[float], qmin: int,
                qmax: int, refine: int) -> torch.Tensor:
    """The searched scale of every row of `w` [M, out, in] (float32) with `importance` [M, in] (float32) and the
    min/max scales `base` [M, out, 1], trying base * r for each r of `ratios` (the first 1.0), then `refine`
    least-squares steps. Returns float32 [M, out, 1]."""
    matrices, rows, cols = w.shape
    steps = len(ratios)
    out = torch.empty(matrices * rows, dtype=torch.float32, device=w.device)
    ratio_values = torch.tensor(ratios, dtype=torch.float32).to(w.device)
    _grid_search_kernel[(matrices * rows,)](
        w.contiguous(), importance.contiguous(), base.reshape(-1).contiguous(), ratio_values, out, cols, rows,
        float(qmin), float(qmax), STEPS=steps, STEPS_P2=triton.next_power_of_2(steps), REFINE=refine, BLOCK=64,
        num_warps=4, enable_fp_fusion=False)
    return out.view(matrices, rows, 1)
