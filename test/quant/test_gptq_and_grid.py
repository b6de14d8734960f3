"""GPTQ and the grid scale search.

References: an independent float64 GPTQ written here from the paper's column-by-column equations (the inverse
Hessian updated by removing each quantized column, no Cholesky, no blocks); round-to-nearest with the same scales;
min/max and ssz scales. Tolerances are stated per test.
"""

from __future__ import annotations

import pytest
import torch

from msmodelslim.quant import gptq
from msmodelslim.quant.functional import grid_scale_search, minmax_scale, quantize_with_scale, ssz_scale_search
from msmodelslim.quant.gptq import GPTQOptions, gptq_quantize
from msmodelslim.quant.granularity import PerChannel, int4
from msmodelslim.quant.modules import quantize_weight


def correlated_inputs(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=g, dtype=torch.float64) / width**0.5 + torch.eye(width, dtype=torch.float64)
    return torch.randn(tokens, width, generator=g, dtype=torch.float64) @ mix


def output_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> float:
    d = (wq - w).double()
    return float(((d @ h) * d).sum())


def reference_gptq(w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, damp: float) -> torch.Tensor:
    """GPTQ as first stated: quantize column i, spread its error with row i of the current H^-1, then remove i."""
    w = w.double().clone()
    h = h.double().clone()
    h += torch.eye(h.shape[0], dtype=h.dtype) * damp * torch.diagonal(h).mean()
    hinv = torch.linalg.inv(h)
    s = scale.double().reshape(-1)
    q = torch.zeros_like(w)
    for i in range(w.shape[1]):
        q[:, i] = torch.clamp(torch.round(w[:, i] / s), int4.qmin, int4.qmax)
        err = (w[:, i] - q[:, i] * s) / hinv[i, i]
        w[:, i:] -= err[:, None] * hinv[i, i:][None, :]
        hinv = hinv - hinv[:, i:i + 1] @ hinv[i:i + 1, :] / hinv[i, i]
    return q.to(torch.int8)


def test_gptq_equals_the_column_by_column_reference():
    """Blocked Cholesky GPTQ (blocks of 8 over 24 columns, no act-order) == the reference: every integer equal."""
    x = correlated_inputs(400, 24)
    h = x.t() @ x
    w = torch.randn(16, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    scale = minmax_scale(w, int4, PerChannel())
    ours = gptq_quantize(w, h, scale, int4, GPTQOptions(damp=0.01, block_size=8, act_order=False))
    assert torch.equal(ours, reference_gptq(w, h, scale, 0.01))


def test_gptq_with_an_identity_hessian_is_round_to_nearest():
    """No correlation between inputs: no column's error can be compensated; the integers are RTN's exactly."""
    w = torch.randn(8, 32, dtype=torch.float64)
    scale = minmax_scale(w, int4, PerChannel())
    q = gptq_quantize(w, torch.eye(32, dtype=torch.float64), scale, int4)
    assert torch.equal(q, quantize_with_scale(w, scale, int4))


def test_gptq_lowers_the_output_error_of_correlated_inputs():
    """tr(dW H dW^T) of GPTQ (act-order) <= 0.8x that of RTN with the same scales (measured ~0.5x)."""
    x = correlated_inputs(2000, 64, seed=2)
    h = x.t() @ x
    w = torch.randn(32, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    scale = minmax_scale(w, int4, PerChannel())
    rtn = quantize_with_scale(w, scale, int4).double() * scale
    gptq = gptq_quantize(w, h, scale, int4).double() * scale
    assert output_error(w, gptq, h) <= 0.8 * output_error(w, rtn, h)


def test_gptq_leaves_a_column_no_token_reached_round_to_nearest():
    """A dead input channel (zero row and column of H) is rounded to nearest, so the weight is kept for inference."""
    x = correlated_inputs(300, 16)
    x[:, 5] = 0
    h = x.t() @ x
    w = torch.randn(8, 16, dtype=torch.float64)
    scale = minmax_scale(w, int4, PerChannel())
    q = gptq_quantize(w, h, scale, int4)
    assert torch.equal(q[:, 5], quantize_with_scale(w, scale, int4)[:, 5])


def fp4_grid_rows(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows on the MXFP4 grid: FP4 E2M1 values times a power-of-two scale per 32 elements (decoded experts)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)
    mags = values[torch.multinomial(torch.tensor([8, 10, 10, 8, 6, 4, 2, 1.0]), rows * cols, True, generator=g)]
    signs = torch.where(torch.rand(rows * cols, generator=g) < 0.5, -1.0, 1.0)
    block_exp = torch.randint(-9, -6, (rows, cols // 32), generator=g).float()
    return (mags * signs).reshape(rows, cols) * torch.exp2(block_exp).repeat_interleave(32, dim=1)


def row_error(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w - quantize_with_scale(w, scale, int4).float() * scale).square().sum(-1)


def test_grid_search_is_never_worse_than_min_max_per_row():
    """r = 1 is a grid point and refinements only replace a row that improves: per-row error <= min/max's."""
    w = torch.randn(64, 256) * torch.rand(64, 1)
    grid, base = grid_scale_search(w, int4), minmax_scale(w, int4, PerChannel())
    assert bool((row_error(w, grid) <= row_error(w, base) * (1 + 1e-6)).all())


def test_grid_search_beats_ssz_on_mxfp4_decoded_rows():
    """On rows of the FP4 grid, ssz's descent from min/max stalls; the grid's median row error <= 0.95x ssz's
    (measured 0.93)."""
    w = fp4_grid_rows(128, 512)
    ratio = row_error(w, grid_scale_search(w, int4)) / row_error(w, ssz_scale_search(w, int4))
    assert float(ratio.median()) <= 0.95


def test_quantize_weight_gptq_needs_the_hessian():
    w = torch.randn(4, 8)
    try:
        quantize_weight(w, int4, "gptq")
    except ValueError as exc:
        assert "Hessian" in str(exc)
    else:
        raise AssertionError("gptq without a Hessian was accepted")


def test_with_few_tokens_the_shrunk_hessian_keeps_gptq_from_fitting_noise():
    """40 calibration tokens for 64 inputs: plain GPTQ fits their noise and loses to round-to-nearest on 4000
    held-out tokens of the same distribution; with the token count (H shrunk toward its diagonal) it beats RTN."""
    x = correlated_inputs(4040, 64, seed=4)
    cal, held_out = x[:40], x[40:]
    h, h_test = cal.t() @ cal, held_out.t() @ held_out
    w = torch.randn(48, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    scale = minmax_scale(w, int4, PerChannel())
    rtn = output_error(w, quantize_with_scale(w, scale, int4).double() * scale, h_test)
    plain = output_error(w, gptq_quantize(w, h, scale, int4).double() * scale, h_test)
    shrunk = output_error(w, gptq_quantize(w, h, scale, int4, tokens=40).double() * scale, h_test)
    assert plain > rtn > shrunk


def test_a_batch_of_experts_gets_the_integers_each_would_get_alone():
    """Batched GPTQ (the layer's experts of one shape in one column loop) == GPTQ per matrix, bit for bit
    (float64 on CPU; act-order permutations and token counts differ per matrix)."""
    g = torch.Generator().manual_seed(6)
    xs = [correlated_inputs(n, 32, seed=10 + i) for i, n in enumerate((500, 40, 300))]
    hs = torch.stack([x.t() @ x for x in xs])
    ws = torch.randn(3, 16, 32, dtype=torch.float64, generator=g)
    scales = minmax_scale(ws, int4, PerChannel())
    tokens = torch.tensor([500, 40, 300])
    batched = gptq_quantize(ws, hs, scales, int4, GPTQOptions(block_size=8), tokens=tokens)
    for i in range(3):
        alone = gptq_quantize(ws[i], hs[i], scales[i], int4, GPTQOptions(block_size=8), tokens=int(tokens[i]))
        assert torch.equal(batched[i], alone), i


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: a CUDA device only")
@pytest.mark.parametrize("group_size", [0, 64])
def test_on_cuda_the_replayed_block_graph_gives_the_eager_loops_integers(monkeypatch, group_size):
    """Reference: the same GPTQ with the column loop run eagerly (gptq.CUDA_GRAPHS off); exact equality, since the
    graph replays the same elementwise kernels. 5 blocks of 128 columns and a short last one of 64; per-row and
    per-group scales."""
    x = correlated_inputs(1024, 704).float().cuda()
    h = x.t() @ x
    w = torch.randn(96, 704, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    monkeypatch.setattr(gptq, "CUDA_GRAPHS", False)
    q_eager, s_eager = quantize_weight(w, int4, "gptq", hessian=h, tokens=1024, group_size=group_size)
    monkeypatch.setattr(gptq, "CUDA_GRAPHS", True)
    q_graphs, s_graphs = quantize_weight(w, int4, "gptq", hessian=h, tokens=1024, group_size=group_size)
    assert torch.equal(s_graphs, s_eager) and torch.equal(q_graphs, q_eager)


GRID_KERNEL_CHECK = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"  # the kernel run by Triton's interpreter, on the CPU
import torch
from msmodelslim.ops.grid_search import grid_search
from msmodelslim.quant.functional import grid_scale_search, minmax_scale
from msmodelslim.quant.granularity import PerChannel, int4

g = torch.Generator().manual_seed(7)
w = torch.randn(3, 4, 200, generator=g) * torch.exp(torch.randn(3, 4, 1, generator=g))
w[0, 0] = 0.0                                                    # an all-zero row (scale 1)
w[1, 1, 5] = 40.0                                                # an outlier the grid clips
imp = torch.exp(2 * torch.randn(3, 200, generator=g))
imp[2, :50] = 0.0                                                # inputs no token reached
ratios = [1.0 - k * 0.7 / 47 for k in range(48)]
for importance in (imp, None):
    eager = grid_scale_search(w, int4, importance=importance)    # PyTorch on the CPU: the reference
    i = torch.ones(3, 200) if importance is None else importance
    kernel = grid_search(w, i, minmax_scale(w, int4, PerChannel()), ratios, int4.qmin, int4.qmax, 4)

    def error(s):
        q = torch.div(w.double(), s.double()).round().clamp(int4.qmin, int4.qmax)
        return ((w.double() - q * s.double()) ** 2 * i.double()[:, None, :]).sum(-1)

    same = float((kernel == eager).double().mean())
    worse = float((error(kernel) / error(eager).clamp_min(1e-300)).max())
    print(same, worse)
# the search's own check of the kernel's first result in a process (quant/functional.py) accepts it
from msmodelslim.quant import functional
checked = functional._grid_kernel(w, imp[:, None, :], minmax_scale(w, int4, PerChannel()), int4, 48, 0.3, 4)
print(checked is not None and functional.GRID_KERNEL.checked)
"""


def test_the_grid_search_kernel_finds_the_scales_of_the_pytorch_search():
    """ops/grid_search.py (CUDA's path of `grid_scale_search`), run by Triton's interpreter on the CPU, against the
    PyTorch search on the same rows (with and without input weights, an all-zero row, an outlier, dead inputs):
    each row's scale has the weighted error of the search's to 1e-6 (float64; the sums run in another order, so
    the least-squares refinements differ in their last bits: here 40-85 % of the scales are bit-identical, the rest
    within 6e-12 in error). A fresh interpreter: TRITON_INTERPRET must be set before the kernel's module is
    imported."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", GRID_KERNEL_CHECK], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    assert len(lines) == 5 and all(abs(float(worse) - 1) < 1e-6 for worse in lines[1:4:2]), out.stdout
    assert lines[4] == "True", out.stdout  # and the run's check of the kernel passes it


def _min_max_scales(w: torch.Tensor, *_args: object) -> torch.Tensor:
    return minmax_scale(w, int4, PerChannel())  # what a kernel that never clipped would give


def _compiler_failure(*_args: object) -> torch.Tensor:
    raise RuntimeError("PassManager::run failed\n(the compiler's log)")


@pytest.mark.parametrize(("kernel", "said"), [
    (_compiler_failure, r"failed \(PassManager::run failed\)"),
    (_min_max_scales, r"gave scales whose error is \d\.\d+e[-+]\d+ above the elementwise search's")])
def test_a_grid_kernel_that_cannot_be_built_or_disagrees_leaves_the_search_to_the_elementwise_passes(
        kernel, said, monkeypatch, caplog):
    """If Triton cannot build the kernel on a GPU, or its first search in the process is off the PyTorch search's
    on the batch's first matrix (a row's weighted error above theirs by more than float32 sums of its inputs can
    differ: (cols - 1) * 2^-24 for each search), the run goes on with the PyTorch search and says so
    once. Reference: the kernel's launcher replaced by one that raises as a compiler failure does, and by one that
    returns the unsearched min/max scales."""
    import logging
    import re

    from msmodelslim.ops import grid_search as kernel_module
    from msmodelslim.quant import functional

    monkeypatch.setattr(kernel_module, "grid_search", kernel)
    monkeypatch.setattr(functional.GRID_KERNEL, "enabled", True)
    monkeypatch.setattr(functional.GRID_KERNEL, "checked", False)
    w = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    w[:, :, 0] = 9.0  # an outlier per row, which the search clips
    with caplog.at_level(logging.WARNING, logger="msmodelslim.quant.functional"):
        assert functional._grid_kernel(w, torch.ones(2, 1, 64), minmax_scale(w, int4, PerChannel()), int4, 48, 0.3,
                                       4) is None
    assert functional.GRID_KERNEL.enabled is False
    assert len(caplog.records) == 1 and re.fullmatch(
        rf"grid scale search: the Triton kernel {said}; the search runs as elementwise passes from now on: the "
        r"same scales, slower", caplog.records[0].getMessage()), caplog.records[0].getMessage()


def test_a_grid_kernel_off_the_passes_by_float32_sums_noise_is_kept(monkeypatch, caplog):
    """The check tolerates what summing a row's 1,024 terms in another order can change (on an H100 the kernel's
    first search was 6.2e-6 above the passes' on one row of 6,144 inputs, a tie broken the other way): a kernel
    whose scales are the passes' times (1 + 3e-4), its worst row's weighted error above theirs by more than 1e-6
    and less than the bound 2 * 1024 * 2^-24 (float64, `quant_mse`), is kept and its scales returned. Reference: the
    elementwise passes."""
    import logging

    from msmodelslim.ops import grid_search as kernel_module
    from msmodelslim.quant import functional
    from msmodelslim.quant.functional import quant_mse

    w = torch.randn(2, 8, 1024, generator=torch.Generator().manual_seed(1))
    imp, base = torch.ones(2, 1, 1024), minmax_scale(w, int4, PerChannel())
    searched = functional._grid_passes(w, imp, base, int4, 48, 0.3, 4)
    nudged = searched * (1 + 3e-4)
    excess = (quant_mse(w, nudged, int4, importance=imp) / quant_mse(w, searched, int4, importance=imp) - 1)[0]
    assert 1e-6 < float(excess.max()) < 2 * 1024 * 2.0 ** -24  # the case the check must tolerate

    monkeypatch.setattr(kernel_module, "grid_search", lambda *_args: nudged.reshape(-1, 8, 1))
    monkeypatch.setattr(functional.GRID_KERNEL, "enabled", True)
    monkeypatch.setattr(functional.GRID_KERNEL, "checked", False)
    with caplog.at_level(logging.WARNING, logger="msmodelslim.quant.functional"):
        found = functional._grid_kernel(w, imp, base, int4, 48, 0.3, 4)
    assert found is not None and torch.equal(found, nudged) and not caplog.records
    assert functional.GRID_KERNEL.enabled is True and functional.GRID_KERNEL.checked is True


def test_the_grid_search_kernel_compiles_for_hopper_with_the_searchs_rounding(hopper_ptx):
    """The kernel as CUDA runs it, compiled by Triton's own compiler for sm_90 (H100 / H200) without a GPU: it builds
    (a global it cannot read, a shape it cannot broadcast would stop it here, not on the user's GPU), and the PTX
    keeps the search's arithmetic: correctly rounded division (`div.rn`), no fused multiply-add, and the rounding
    constant's add and subtract (round half to even) not folded away. Reference: the PTX text."""
    from msmodelslim.ops.grid_search import _grid_search_kernel

    signature = {"W": "*fp32", "IMP": "*fp32", "BASE": "*fp32", "RATIOS": "*fp32", "OUT": "*fp32", "cols": "i32",
                 "rows_per_matrix": "i32", "qmin": "fp32", "qmax": "fp32", "STEPS": "constexpr",
                 "STEPS_P2": "constexpr", "REFINE": "constexpr", "BLOCK": "constexpr"}
    ptx = hopper_ptx(_grid_search_kernel, signature, {"STEPS": 48, "STEPS_P2": 64, "REFINE": 4, "BLOCK": 64})
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "fma.rn.f32" not in ptx
    assert "0f4B400000" in ptx and "0fCB400000" in ptx  # + 1.5 * 2^23, then - 1.5 * 2^23
