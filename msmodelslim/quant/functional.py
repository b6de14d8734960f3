"""Quantizer math on tensors: symmetric integer quantization, per-token fake quantization, ssz scale search.

Nothing here knows about modules. All arithmetic is done in float32 (or float64 when the input is float64);
results are `q` (torch.int8 holding the integer values) and `scale` (float32, broadcastable against `q`). Dequantised value = q * scale. Symmetric: no zero point (offset is 0).
"""

from __future__ import annotations

import logging
import os

import torch

from msmodelslim.core.placement import not_on_npu
from msmodelslim.ops.checked_kernel import CheckedKernel
from msmodelslim.quant.granularity import Granularity, IntDtype, PerChannel, PerToken, int_dtype

logger = logging.getLogger(__name__)

# Rows per piece of a per-token computation on the CPU (quantization, a quantized product's epilogue): a piece's
# float32 temporaries fit the cache, which the whole micro-batch's do not. bench/launches.py, which counts on the CPU
# the operators an accelerator would launch, turns the pieces off through the variable.
CPU_PIECE_ROWS = int(os.environ.get("MSMODELSLIM_CPU_PIECE_ROWS", "1024"))


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _as_dtype(bits: int | str | IntDtype) -> IntDtype:
    return bits if isinstance(bits, IntDtype) else int_dtype(bits)


def _absmax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """max |x| over the last dim, keepdim: PerChannel on weight rows [out, in] -> [out, 1]; PerToken [..., d] -> [..., 1]."""
    if isinstance(granularity, (PerChannel, PerToken)):
        return x.abs().amax(dim=-1, keepdim=True)
    raise TypeError(f"unknown granularity {granularity!r}")


def keep_better(best: torch.Tensor, best_err: torch.Tensor, candidate: torch.Tensor, err: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(best, best_err) updated elementwise with `candidate` where its `err` is strictly lower (a search's step)."""
    better = err < best_err
    return torch.where(better, candidate, best), torch.where(better, err, best_err)


def minmax_scale(x: torch.Tensor, bits: int | str | IntDtype, granularity: Granularity) -> torch.Tensor:
    """Symmetric min/max scale absmax / qmax; an all-zero slice gets scale 1 (its integers are 0 anyway)."""
    d = _as_dtype(bits)
    amax = _absmax(x.to(_work_dtype(x)), granularity)
    scale = amax / d.qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, bits: int | str | IntDtype) -> torch.Tensor:
    """q = clamp(round(x / scale), qmin, qmax) as torch.int8 (round half to even, like torch.round)."""
    d = _as_dtype(bits)
    xw = x.to(_work_dtype(x))
    # rounded and clamped in place in the quotient (a fresh tensor): on the CPU each large temporary is a fresh
    # mapping whose pages fault in again (core/memory.py); the values are those of the out-of-place ops
    return torch.div(xw, scale.to(xw.dtype)).round_().clamp_(d.qmin, d.qmax).to(torch.int8)


def quantize_symmetric(w: torch.Tensor, bits: int | str | IntDtype,
                       granularity: Granularity | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max symmetric quantization (default PerChannel): returns (q int8 tensor, scale float32)."""
    granularity = PerChannel() if granularity is None else granularity
    work = w.to(_work_dtype(w))  # one copy in the work dtype for the scale and the integers
    scale = minmax_scale(work, bits, granularity)
    q = quantize_with_scale(work, scale, bits)
    return q, scale.to(torch.float32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in float32 (float64 when asked for), cast to `dtype`."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(work) * scale.to(work)).to(dtype)


def fake_quant_per_token(x: torch.Tensor, bits: int | str | IntDtype = 8) -> torch.Tensor:
    """Quantise-dequantise with one symmetric scale per token (row over the LAST dim only), in x's dtype.

    The public msModelSlim reduces over all dims here (per-tensor); runtime dynamic quantization is per token.
    """
    if x.numel() == 0:
        return x
    d = _as_dtype(bits)
    xw = x.to(_work_dtype(x))
    scale = minmax_scale(xw, d, PerToken())
    q = torch.clamp(torch.round(xw / scale), d.qmin, d.qmax)
    return (q * scale).to(x.dtype)


def quantize_per_token(x: torch.Tensor, bits: int | str | IntDtype = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization as the runtime does it: (q int8 [..., d], scale float32 [..., 1]).

    On CUDA one Triton kernel (`ops/token_quant.py`: the same values, one launch and one read of 16-bit rows
    instead of nine passes; bench/token_quant.py). On the CPU in pieces of CPU_PIECE_ROWS rows (each row is its own
    computation, so the values are the same): a piece's float32 temporaries stay in cache instead of streaming
    through memory (4.5x at 8192 x 1536)."""
    if TOKEN_QUANT_KERNEL.enabled and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        with not_on_npu("per-token quantization as a Triton kernel on CUDA (and its check); an NPU runs the passes"):
            found = _checked_per_token(x, _as_dtype(bits))
        if found is not None:
            return found
    if x.device.type != "cpu" or x.numel() <= CPU_PIECE_ROWS * x.shape[-1]:
        return quantize_symmetric(x, bits, PerToken())
    rows = x.reshape(-1, x.shape[-1])
    q = torch.empty(rows.shape, dtype=torch.int8)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32)
    for start in range(0, rows.shape[0], CPU_PIECE_ROWS):
        end = start + CPU_PIECE_ROWS
        q[start:end], scale[start:end] = quantize_symmetric(rows[start:end], bits, PerToken())
    return q.view(x.shape), scale.view(*x.shape[:-1], 1)


# CUDA: the per-token quantization as one Triton kernel, held to the passes (`_checked_per_token`)
TOKEN_QUANT_KERNEL = CheckedKernel("per-token activation quantization", "it runs as PyTorch passes from now on: the "
                                   "same integers, more passes over memory", logger)


def _checked_per_token(x: torch.Tensor, d: IntDtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`quantize_symmetric(x, d, PerToken())` by ops/token_quant.py; its first result in a process is held to the
    passes' integers and scales bit for bit. None when the kernel cannot be built here or differs (the passes run
    from then on, said once)."""
    def kernel() -> tuple[torch.Tensor, torch.Tensor]:
        from msmodelslim.ops import token_quant

        return token_quant.per_token_int8(x, d.qmin, d.qmax)

    def check(found: tuple[torch.Tensor, torch.Tensor]) -> str | None:
        q, scale = quantize_symmetric(x, d, PerToken())
        return None if torch.equal(found[0], q) and torch.equal(found[1], scale) else \
            "gave other integers or scales than the passes"

    return TOKEN_QUANT_KERNEL.run(kernel, check)


def ssz_scale_search(w: torch.Tensor, bits: int | str | IntDtype, iters: int = 50) -> torch.Tensor:
    """Per-channel symmetric scales refined by alternating least squares ("ssz"), starting from min/max.

    For each row: q = clamp(round(w / s)); s = <w, q> / <q, q> (the least-squares scale for fixed q); repeat.
    Each step cannot increase the row's error ||w - s q||^2 (rounding is the best q for s, the projection the best
    s for q); the best scale seen per row is kept, judged by its residual ||w - s q||^2 in the work dtype, and a
    final check keeps min/max for any row where it is not worse, so the result never loses to min/max. Returns float32 scales [out, 1]; stops early when no row's scale changes.
    """
    d = _as_dtype(bits)
    work = _work_dtype(w)
    w2 = w.detach().to(work).reshape(w.shape[0], -1)
    s0 = minmax_scale(w2, d, PerChannel())
    # Two weight-sized buffers reused by every step: a weight-sized temporary per step would be a fresh mapping whose
    # pages fault in again (glibc maps blocks over 1 MiB individually, see core/memory.py), 5x the arithmetic.
    q, prod = torch.empty_like(w2), torch.empty_like(w2)

    def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # sum(a * b) per row, [out, 1]
        return torch.mul(a, b, out=prod).sum(dim=-1, keepdim=True)

    def rounded(scale: torch.Tensor) -> torch.Tensor:  # q(scale)
        torch.div(w2, scale, out=q)
        return q.round_().clamp_(d.qmin, d.qmax)

    s = s0
    best_s, best_err = s0, None
    for step in range(iters + 1):
        rounded(s)
        wq = rowdot(w2, q)
        qq = rowdot(q, q)
        residual = torch.sub(w2, q * s, out=prod)  # the error itself: no float64 needed on the device
        err = rowdot(residual, residual)
        best_s, best_err = (s, err) if best_err is None else keep_better(best_s, best_err, s, err)
        if step == iters:
            break
        new_s = torch.where((qq > 0) & (wq > 0), wq / qq.clamp_min(1), s)
        if torch.equal(new_s, s):
            break
        s = new_s
    # Exact guard against rounding in the dot-product error: min/max wins every row where it is not worse.
    exact = {}
    for key, scale in (("ssz", best_s), ("minmax", s0)):
        residual = torch.sub(w2, rounded(scale).mul_(scale), out=prod)
        exact[key] = rowdot(residual, residual)
    best_s = torch.where(exact["ssz"] < exact["minmax"], best_s, s0)
    return best_s.to(torch.float32)


def quant_mse(w: torch.Tensor, scale: torch.Tensor, bits: int | str | IntDtype,
              importance: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row squared error ||w - dequant(quant(w))||^2 for per-channel scales [..., out, 1] (float64), each input's
    term weighted by `importance` [..., 1, in] when given."""
    q = quantize_with_scale(w.double(), scale.double(), bits)
    error = (w.double() - q.double() * scale.double()) ** 2
    return (error if importance is None else error * importance.double()).sum(dim=-1)


# CUDA: the search as one Triton kernel, held to the passes (`_grid_kernel`; bench/gptq_batched.py turns it off to
# compare)
GRID_KERNEL = CheckedKernel("grid scale search", "the search runs as elementwise passes from now on: the same "
                            "scales, slower", logger)


def grid_scale_search(w: torch.Tensor, bits: int | str | IntDtype, importance: torch.Tensor | None = None,
                      steps: int = 48, min_ratio: float = 0.3, refine: int = 4) -> torch.Tensor:
    """Per-channel scales from a clipping grid, then a few least-squares refinements ("grid").

    Each row tries s = r * max|w| / qmax for `steps` ratios r from 1 down to `min_ratio` and keeps the one of least
    error sum_j imp_j (w_j - s q_j)^2 (imp = 1, or the input's second moment diag(X^T X) when known: the output
    error of a weight column scales with it). The grid reaches the scales a descent from min/max cannot: on
    MXFP4-decoded experts the rows sit on the FP4 grid and ssz stays in the first basin. From the best grid point,
    `refine` alternating least-squares steps (as ssz, weighted) keep any row that improves. `w` is [..., out, in]
    (leading dims: a batch of matrices), `importance` [..., in]; returns float32 [..., out, 1]. On CUDA the search
    is one Triton kernel (`ops/grid_search.py`: each row read once for all the tries instead of eight passes over
    the batch per try; the same elementwise arithmetic, sums in another order).
    """
    d = _as_dtype(bits)
    work = _work_dtype(w)
    w2 = w.detach().to(work)
    imp = torch.ones(w2.shape[-1], dtype=work, device=w2.device) if importance is None else \
        importance.to(w2.device, work).clamp_min(0)
    imp = imp.unsqueeze(-2)  # [..., 1, in]
    base = minmax_scale(w2, d, PerChannel())
    if GRID_KERNEL.enabled and w2.is_cuda and work == torch.float32:
        with not_on_npu("the grid search as a Triton kernel on CUDA (and its check); an NPU runs the passes"):
            found = _grid_kernel(w2, imp, base, d, steps, min_ratio, refine)
        if found is not None:
            return found
    return _grid_passes(w2, imp, base, d, steps, min_ratio, refine)


def _grid_ratios(steps: int, min_ratio: float) -> list[float]:
    """The grid's fractions of the min/max scale, 1 down to `min_ratio` (both searches try the same scales)."""
    return [1.0 - k * (1.0 - min_ratio) / (steps - 1) for k in range(steps)]


def _grid_passes(w2: torch.Tensor, imp: torch.Tensor, base: torch.Tensor, d: IntDtype, steps: int, min_ratio: float,
                 refine: int) -> torch.Tensor:
    """The search as elementwise passes over the whole batch (`imp` [..., 1, in], `base` the min/max scales)."""
    q, prod = torch.empty_like(w2), torch.empty_like(w2)

    def error(scale: torch.Tensor) -> torch.Tensor:  # sum_j imp_j (w_j - s q_j)^2 per row, [..., out, 1]
        torch.div(w2, scale, out=q).round_().clamp_(d.qmin, d.qmax)
        torch.sub(w2, q.mul_(scale), out=prod)
        return prod.square_().mul_(imp).sum(dim=-1, keepdim=True)

    best_s, best_err = base, error(base)
    for ratio in _grid_ratios(steps, min_ratio)[1:]:
        s = base * ratio
        best_s, best_err = keep_better(best_s, best_err, s, error(s))
    for _ in range(refine):
        torch.div(w2, best_s, out=q).round_().clamp_(d.qmin, d.qmax)
        wq = torch.mul(w2, q, out=prod).mul_(imp).sum(dim=-1, keepdim=True)
        qq = q.square().mul_(imp).sum(dim=-1, keepdim=True)
        s = torch.where((qq > 0) & (wq > 0), wq / qq.clamp_min(1e-30), best_s)
        best_s, best_err = keep_better(best_s, best_err, s, error(s))
    return best_s.to(torch.float32)


def _grid_kernel(w2: torch.Tensor, imp: torch.Tensor, base: torch.Tensor, d: IntDtype, steps: int, min_ratio: float,
                 refine: int) -> torch.Tensor | None:
    """`grid_scale_search` by ops/grid_search.py. Its first search in a process is held to the elementwise passes
    on the batch's first matrix: no row's weighted error above theirs by more than their float32 sums' rounding.
    None when the kernel cannot be built here (Triton's compiler for this GPU) or fails that check: the run then
    searches with the passes, and says so once (`GRID_KERNEL`)."""
    *lead, rows, cols = w2.shape
    ratios = _grid_ratios(steps, min_ratio)
    weights = imp.expand(*lead, 1, cols).reshape(-1, 1, cols)

    def kernel() -> torch.Tensor:
        from msmodelslim.ops.grid_search import grid_search

        return grid_search(w2.reshape(-1, rows, cols), weights.reshape(-1, cols), base.reshape(-1, rows, 1), ratios,
                           d.qmin, d.qmax, refine)

    def check(found: torch.Tensor) -> str | None:
        first = w2.reshape(-1, rows, cols)[:1]
        passes = _grid_passes(first, weights[:1], base.reshape(-1, rows, 1)[:1], d, steps, min_ratio, refine)
        ours, theirs = (quant_mse(first, s, d, importance=weights[:1]) for s in (found[:1], passes))
        # Both searches compare float32 sums of `cols` non-negative terms, each within (cols - 1) * 2^-24 of its
        # exact value in any order, so a tie broken the other way costs at most twice that: a wrong kernel
        # (rounding, a skipped try) costs orders of magnitude more.
        excess = float(((ours - theirs) / theirs.clamp_min(1e-300)).max())
        return None if excess <= 2 * cols * 2.0 ** -24 else \
            f"gave scales whose error is {excess:.2e} above the elementwise search's"

    found = GRID_KERNEL.run(kernel, check)
    return None if found is None else found.view(*lead, rows, 1)
