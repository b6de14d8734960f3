"""Dynamic per-token quantization of activations as one Triton kernel (CUDA).

`quant.functional.quantize_per_token` in PyTorch is nine passes over a [rows, d] input (a float32 copy, |x|, the
row maxima, the scales, the quotient, its rounding and clamp, the int8 cast): ~47 bytes of memory traffic per
element of a bfloat16 input, at every quantized linear of a calibration pass. Here one program per row reads the row
twice (its maximum, then its integers; the second read mostly from cache) and writes one byte per element.

The same float32 arithmetic as those passes on CUDA, element by element: |x| maximised (exact); the scale max x
float32(1 / qmax) (aten's CUDA division by a host scalar multiplies by its float32 reciprocal; the CPU divides), 1
where it is 0; each element divided by it correctly (`div_rn`, as torch divides two tensors), rounded half to even,
clamped (grid_search's `_quantized`), made int8: bit-identical to the PyTorch passes on CUDA for finite input.
(A row holding a NaN gets another scale than torch's; either way its integers mean nothing.)
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from msmodelslim.ops.grid_search import _quantized

_BLOCK = 1024


@triton.jit
def _per_token_kernel(X, Q, SCALES, cols, inv_qmax, QMIN: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * cols
    q_row = Q + row * cols
    peak = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        c = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + c, mask=c < cols, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    scale = tl.max(peak, axis=0) * inv_qmax
    scale = tl.where(scale > 0, scale, 1.0)
    tl.store(SCALES + row, scale)
    for start in range(0, cols, BLOCK):
        c = start + tl.arange(0, BLOCK)
        mask = c < cols
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_row + c, _quantized(x, scale, QMIN, QMAX).to(tl.int8), mask=mask)


@functools.cache
def _reciprocal(qmax: int) -> float:
    """float32(1 / qmax) as aten's CUDA division by a host scalar rounds it (once per grid, not per call)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / qmax)


def per_token_int8(x: torch.Tensor, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., d], scale float32 [..., 1]) of `x` [..., d] (16- or 32-bit floats, any leading shape) with one
    symmetric scale per row of the last dimension: scale = max|x| * float32(1 / qmax) (1 for a zero row), q =
    clamp(round(x / scale), qmin, qmax), rounded half to even."""
    cols = x.shape[-1]
    rows = x.reshape(-1, cols).contiguous()
    q = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0] and cols:
        _per_token_kernel[(rows.shape[0],)](rows, q, scales, cols, _reciprocal(qmax), QMIN=float(qmin),
                                            QMAX=float(qmax), BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)
    return q.view(x.shape), scales.view(*x.shape[:-1], 1)
