"""GPTQ (Frantar et al., 2022) for per-channel symmetric integer weights, with the scales fixed beforehand.

Columns are quantized one at a time (largest diag(H) first with `act_order`); each column's rounding error is
spread over the columns not yet quantized through the Cholesky factor of H^-1, so the output error on the
calibration inputs, tr(dW H dW^T) with H = X^T X, is what is minimised rather than the weight error. `damp` adds
damp * mean(diag H) to the diagonal (msModelSlim's `percdamp`); a column no token reached (diag 0) is rounded to
nearest and passes no error on.

With few tokens per input channel (a routed expert sees ~ top_k / n_experts of the calibration tokens) X^T X is a
noisy estimate of the input covariance, and GPTQ fits the noise: on kimi-linear-mini an expert with 235 tokens for
512 inputs got 2.1x the held-out error of plain ssz rounding. When the token count n is known, H is shrunk toward its
diagonal by gamma = d / (n + d) (d inputs; a Ledoit-Wolf-style prior that keeps each channel's weight): the same
expert then lands at 0.99x, and matrices with many tokens are unchanged (bench/layer_error.py). The per-row scale is a grid search weighted by diag(H) (`grid_scale_search`):
with the scale fixed, the GPTQ updates cannot move the clipping range, so it is chosen for the weighted error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from msmodelslim.core.placement import HOST, host_section, not_on_npu
from msmodelslim.quant.functional import grid_scale_search
from msmodelslim.quant.granularity import IntDtype
from msmodelslim.quant.mx import MXFormat, round_to_elements

logger = logging.getLogger(__name__)

# float32 Hessians per batched GPTQ of experts, one counted per linear reading it (an expert's w1 and w3: twice; the
# batch's weights and temporaries are a few times this)
GPTQ_BATCH_BYTES = 2 << 30
# on the CPU, where a batch saves no launches and its temporaries take the host memory every rank shares (with 2 GiB
# batches the bench preset's first MoE layer peaked at 16.3 GB of host memory, with these 6.4 GB: BENCHMARKS.md)
GPTQ_BATCH_BYTES_CPU = 256 << 20


@dataclass(frozen=True)
class GPTQOptions:
    damp: float = 0.01  # msModelSlim's `percdamp`
    block_size: int = 128
    act_order: bool = True


DEFAULT_GPTQ = GPTQOptions()


def hessian_diagonals(hessian: torch.Tensor | None) -> torch.Tensor:
    """diag(H) of each matrix's Hessian ([..., in]): GPTQ's scales and exponents are searched weighted by it."""
    if hessian is None:
        raise ValueError("weight method 'gptq' needs the input Hessian")
    return torch.diagonal(hessian, dim1=-2, dim2=-1)


def gptq_scale(w: torch.Tensor, hessian: torch.Tensor, dtype: IntDtype) -> torch.Tensor:
    """The per-row scale GPTQ quantizes against: the diag(H)-weighted grid search ([..., out, 1])."""
    return grid_scale_search(w, dtype, importance=hessian_diagonals(hessian))


def shrunk_hessian(hessian: torch.Tensor, tokens: int | torch.Tensor | None) -> torch.Tensor:
    """(1 - gamma) H + gamma diag(H), gamma = d / (tokens + d) per matrix; H itself when the count is unknown
    (float32 unless H is float64, a new tensor; `hessian` [..., d, d], `tokens` a count or one per matrix)."""
    work = torch.float64 if hessian.dtype == torch.float64 else torch.float32
    h = hessian.to(work)
    if tokens is None:
        return h.clone()
    d = h.shape[-1]
    n = torch.as_tensor(tokens, device=h.device).to(work).clamp_min(0).reshape(-1, 1, 1)
    gamma = (d / (n + d)).reshape(*h.shape[:-2], 1, 1) if h.dim() > 2 else d / (float(n) + d)
    out = h * (1.0 - gamma)
    diag_gamma = gamma[..., 0] if isinstance(gamma, torch.Tensor) else gamma  # [..., 1] against the diagonal
    torch.diagonal(out, dim1=-2, dim2=-1).add_(torch.diagonal(h, dim1=-2, dim2=-1) * diag_gamma)
    return out


def inverse_cholesky_upper(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U) for a batch [B, d, d] of positive definite H, on the host.

    Ascend has no `cholesky_inverse` kernel, and its Cholesky takes float32 only and falls back to the CPU through
    `linalg_cholesky_ex`, so off CUDA this runs deliberately on the host, batched, as msModelSlim does. The host
    computes in float64 and rounds once to float32: float32 factors computed with another thread count differ in
    their last bits, float64 ones almost never after the rounding, which keeps a DP run's output that of one
    device. One factorisation and one triangular inverse: with J the
    reversal, J H J = K K^T gives H = R R^T for the upper R = J K J, so H^-1 = (R^-1)^T R^-1 and U = R^-1 (upper,
    positive diagonal: the unique factor)."""
    device = h.device
    if device.type == "cuda":  # cuSOLVER factors on the GPU in float32, deterministically
        with not_on_npu("CUDA's Cholesky; an NPU factors on the host (its linalg_cholesky_ex falls back to the CPU)"):
            k = torch.linalg.cholesky(h.detach().float().flip(-2, -1))
            eye = torch.eye(h.shape[-1], dtype=torch.float32, device=device).expand_as(k)
            return torch.linalg.solve_triangular(k.flip(-2, -1), eye, upper=True)
    with host_section("GPTQ: Cholesky factor of H^-1 (Ascend has no cholesky_inverse, no float64 Cholesky)"):
        host = h.detach().to(HOST, torch.float64)
        k, info = torch.linalg.cholesky_ex(host.flip(-2, -1))
        if bool(info.any()):
            raise RuntimeError(f"GPTQ: a Hessian is not positive definite even after dampening (matrix "
                               f"{int(info.nonzero()[0])} of the batch)")
        r = k.flip(-2, -1)
        eye = torch.eye(h.shape[-1], dtype=torch.float64).expand_as(r)
        u = torch.linalg.solve_triangular(r, eye, upper=True).to(torch.float32)
    return u.to(device)


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, dtype: IntDtype | MXFormat,
                  options: GPTQOptions = DEFAULT_GPTQ, tokens: int | torch.Tensor | None = None) -> torch.Tensor:
    """Integers q (torch.int8 [..., out, in]) for `w` against per-row `scale` [..., out, 1] (or one scale per
    weight, [..., out, in]: per-group scales repeated over their group), minimising
    tr(dW H dW^T) (H shrunk toward its diagonal when `tokens`, the rows it summed, is given).

    Leading dims are a batch of independent matrices of one shape, each with its Hessian (`hessian` [B, d, d],
    `tokens` [B]; a layer's routed experts): one column loop runs them all, so the loop's per-column kernel launches
    are paid once per batch, not once per expert. Readers of one input (an expert's w1 and w3) are one matrix, their
    rows stacked (linear_quant).

    With an MX format `dtype` the scale is per weight (2^e of each block of 32) and a column rounds to the
    format's elements (quant/mx.py): the result is those element values, float16 (which holds every E2M1 and E4M3
    value exactly), not integers."""
    if w.dim() == 2:
        return gptq_quantize(w[None], hessian[None], scale[None], dtype, options,
                             None if tokens is None else torch.as_tensor(tokens).reshape(1))[0]
    damp, block_size, act_order = options.damp, options.block_size, options.act_order
    batch, _, cols = w.shape
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    H = shrunk_hessian(hessian.to(w.device), tokens).to(work)
    diag = torch.diagonal(H, dim1=-2, dim2=-1)
    dead = diag <= 0  # [B, in]: no token reached the channel
    live = (~dead).to(H.dtype)
    H.mul_(live[:, :, None]).mul_(live[:, None, :])  # H is shrunk_hessian's own new tensor
    torch.diagonal(H, dim1=-2, dim2=-1).add_(dead.to(H.dtype))  # a dead channel: 1 on the diagonal
    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H, dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)  # [B, in]
        H = torch.gather(torch.gather(H, 1, perm[:, :, None].expand_as(H)), 2, perm[:, None, :].expand_as(H))
    torch.diagonal(H, dim1=-2, dim2=-1).add_((damp * torch.diagonal(H, dim1=-2, dim2=-1).mean(dim=-1))[:, None])
    # Upper Cholesky factor of H^-1 (its rows are the update directions of the column-by-column solve).
    Hinv = inverse_cholesky_upper(H).to(work)
    del H
    # Columns of W as contiguous rows ([B, in, out], act-order applied): the loop reads one column and updates
    # the ones after it. One float copy of the batch; the integers are kept as int8.
    Wt = w.detach().transpose(1, 2)
    if perm is not None:
        Wt = torch.gather(Wt, 1, perm[:, :, None].expand_as(Wt))
    Wt = torch.empty(Wt.shape, dtype=work, device=Wt.device).copy_(Wt)  # never w itself, even in float32
    per_column = scale.shape[-1] != 1
    if per_column:  # like the columns: [B, in, out], act-order applied
        S = scale.to(w.device, work).transpose(-2, -1).reshape(batch, cols, -1)
        S = torch.gather(S, 1, perm[:, :, None].expand_as(S)) if perm is not None else S.contiguous()
    else:
        row_scale = scale.to(w.device, work).reshape(batch, 1, -1)
    Qt = torch.empty(Wt.shape, dtype=torch.float16 if isinstance(dtype, MXFormat) else torch.int8, device=Wt.device)
    Qb = torch.empty_like(Wt[:, :block_size])  # a block's integers, in float
    Err = torch.empty_like(Qb)
    graph = None  # on CUDA, a full block's loop captured once (`_BlockGraph`) after the first block ran eagerly
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        n = end - start
        Hb = Hinv[:, start:end, start:end]
        if graph is not None and n == block_size:
            graph.run(Wt[:, start:end], Hb, S[:, start:end] if per_column else None)
        else:
            scales = S[:, start:end].split(1, dim=1) if per_column else [row_scale] * n
            _column_block(Wt[:, start:end], Hb, scales, Qb, Err, dtype)
            if start == 0 and n == block_size and cols > block_size and _graphs_on(Wt.device):
                graph = _BlockGraph.capture(Wt[:, :block_size], Hb, S[:, :block_size] if per_column else row_scale,
                                            per_column, Qb, Err, dtype)
        Qt[:, start:end] = Qb[:, :n]
        Wt[:, end:].baddbmm_(Hinv[:, start:end, end:].transpose(1, 2), Err[:, :n], alpha=-1.0)  # no temporary
    Q = Qt.transpose(1, 2)
    if perm is not None:
        Q = torch.gather(Q, 2, torch.argsort(perm, dim=-1)[:, None, :].expand_as(Q))
    return Q.contiguous()


CUDA_GRAPHS = True  # replay a full block's column loop as one CUDA graph (bench/quant_jobs.py turns it off to compare)


def _graphs_on(device: torch.device) -> bool:
    return CUDA_GRAPHS and device.type == "cuda"


def _eager_after_failed_capture(exc: RuntimeError) -> None:
    """A capture failed: the column loops of the rest of the run go eagerly (said once)."""
    global CUDA_GRAPHS
    CUDA_GRAPHS = False
    logger.warning("GPTQ: capturing the column loop as a CUDA graph failed (%s); the loops run eagerly from now on: "
                   "the same integers, slower", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _column_block(W1: torch.Tensor, Hb: torch.Tensor, scales: list[torch.Tensor], Qb: torch.Tensor,
                  Err: torch.Tensor, dtype: IntDtype | MXFormat) -> None:
    """GPTQ's sequential solve of one block of columns, in place: W1 [B, n, out] (the block's columns as rows,
    updated), Hb [B, n, n] (its part of the inverse factor), `scales` (n tensors [B, 1, out] or [B, 1, 1]); writes
    the block's integers (in float) to Qb[:, :n] and its scaled errors to Err[:, :n].

    Each column costs a fixed number of small kernels whatever the batch holds (seven: divide, round, clamp,
    multiply, subtract, scale, update; no temporaries), so the loop is launch-bound: fewer ops per column is time
    saved on every device, and more so under the Ascend check, which sees each op in Python. The per-column views are
    cut once per block (split / unbind) for the same reason; on CUDA a full block is replayed as a graph."""
    n = W1.shape[1]
    mx = isinstance(dtype, MXFormat)
    diag = torch.diagonal(Hb, dim1=-2, dim2=-1)[:, :, None, None].unbind(1)  # n x [B, 1, 1]
    rows = Hb[:, :, :, None].unbind(1)  # n x [B, n, 1]: row i spreads column i's error
    views = zip(W1.split(1, dim=1), Qb[:, :n].split(1, dim=1), Err[:, :n].split(1, dim=1), scales)
    for i, (col, q, err, s) in enumerate(views):
        torch.div(col, s, out=q)
        if mx:
            q.copy_(round_to_elements(q, dtype))
        else:
            q.round_().clamp_(dtype.qmin, dtype.qmax)
        torch.sub(col, torch.mul(q, s, out=err), out=err)  # not addcmul: its fused rounding moves integers
        err.div_(diag[i])
        W1[:, i + 1:].addcmul_(rows[i][:, i + 1:], err, value=-1.0)


class _BlockGraph:
    """The column loop of a full block captured once as a CUDA graph over its own copies of the block's inputs, and
    replayed for each later full block: ~900 kernels a block (128 columns x 7) whose launches, not their arithmetic,
    bound the loop (bench/quant_jobs.py). The same elementwise kernels in the same order as `_column_block` run
    eagerly: the same bits. The block's columns need no copy back (nothing reads them after their block). Captured
    with the graph's own calls, not `torch.cuda.graph`, which empties the allocator's cache at every capture."""

    def __init__(self, W1: torch.Tensor, Hb: torch.Tensor, S: torch.Tensor | None,
                 graph: torch.cuda.CUDAGraph) -> None:
        self.W1, self.Hb, self.S, self.graph = W1, Hb, S, graph

    @classmethod
    def capture(cls, W1: torch.Tensor, Hb: torch.Tensor, scale: torch.Tensor, per_column: bool, Qb: torch.Tensor,
                Err: torch.Tensor, dtype: IntDtype | MXFormat) -> _BlockGraph | None:
        """The loop of `_column_block` over new buffers shaped like the block's (filled by `run`); a per-row
        `scale` is the same for every block and is read where it is. None where the capture fails: the loop then
        runs eagerly (the same integers, slower), and so does every later one.

        Captured on a stream of its own in thread-local mode: the runner's loading thread allocates and copies on
        the same device meanwhile, which a global-mode capture forbids. A capture records the kernels without
        running them: the block's own results are the eager loop's, already in Qb and Err."""
        with not_on_npu("CUDA graphs; an NPU runs the loop eagerly"):
            own = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (W1, Hb)]
            S = torch.empty(scale.shape, dtype=scale.dtype, device=scale.device) if per_column else None
            scales = S.split(1, dim=1) if per_column else [scale] * W1.shape[1]
            graph = torch.cuda.CUDAGraph()
            main, side = torch.cuda.current_stream(W1.device), torch.cuda.Stream(W1.device)
            side.wait_stream(main)  # the work queued so far is done before the captured work reads its buffers
            try:
                with torch.cuda.stream(side):
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        _column_block(own[0], own[1], scales, Qb, Err, dtype)
                    finally:
                        graph.capture_end()
            except RuntimeError as exc:
                _eager_after_failed_capture(exc)
                return None
            finally:
                main.wait_stream(side)
            return cls(own[0], own[1], S, graph)

    def run(self, W1: torch.Tensor, Hb: torch.Tensor, S: torch.Tensor | None) -> None:
        with not_on_npu("CUDA graphs; an NPU runs the loop eagerly"):
            self.W1.copy_(W1)
            self.Hb.copy_(Hb)
            if self.S is not None:
                self.S.copy_(S)
            self.graph.replay()
