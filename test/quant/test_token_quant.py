"""Dynamic per-token quantization of activations as one Triton kernel on CUDA (ops/token_quant.py), held to the
PyTorch passes of `quantize_per_token`: run by Triton's interpreter on the CPU, compiled for sm_90 without a GPU, and
the fallback to the passes when the kernel cannot be built or differs."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
import torch

from msmodelslim.quant.functional import quantize_symmetric
from msmodelslim.quant.granularity import PerToken, int8

TOKEN_QUANT_CHECK = """
import os
os.environ["TRITON_INTERPRET"] = "1"  # the kernel run by Triton's interpreter, on the CPU
import torch
from msmodelslim.ops.token_quant import per_token_int8
from msmodelslim.quant.functional import quantize_with_scale

g = torch.Generator().manual_seed(7)
x = torch.randn(60, 1100, generator=g) * torch.logspace(-3, 3, 60)[:, None]  # two blocks, the second masked in part
x[1] = 0  # a zero row: scale 1
x[2, :40] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5] * 8) * (x[2].abs().max() / 127)  # halves: ties to even
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    xs = x.to(dtype)
    q, s = per_token_int8(xs.view(3, 20, 1100), -128, 127)
    work = xs.float()
    peak = work.abs().amax(-1, keepdim=True)
    # the passes as CUDA runs them: aten divides by the host scalar 127 as a product with float32(1 / 127)
    scale = peak * (torch.tensor(1.0) / 127)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    print(torch.equal(s.view(60, 1), scale), torch.equal(q.view(60, 1100), quantize_with_scale(work, scale, 8)),
          bool((scale != peak / 127).any()))  # rows where a division would give another scale
q, s = per_token_int8(x, -8, 7)  # int4 activations
scale = x.abs().amax(-1, keepdim=True) * (torch.tensor(1.0) / 7)
scale = torch.where(scale > 0, scale, torch.ones_like(scale))
print(torch.equal(s, scale), torch.equal(q, quantize_with_scale(x, scale, 4)))
"""


def test_the_per_token_kernel_gives_the_passes_integers_and_scales_as_cuda_computes_them():
    """ops/token_quant.py run by Triton's interpreter on the CPU, against the PyTorch passes as aten runs them on CUDA
    (the row maximum times float32(1 / 127): its CUDA division by a host scalar; a tensor divided by the scales,
    rounded half to even, clamped): 60 rows of 1,100 (two column blocks, the second partly masked) over six decades,
    a zero row, exact halves; bfloat16, float16 and float32 inputs, in a [3, 20, 1100] shape; int4's grid too.
    Tolerance none. The data holds rows where dividing by 127 gives another scale, so a kernel that divided would
    fail. A fresh interpreter: TRITON_INTERPRET must be set before the kernel's module is imported."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", TOKEN_QUANT_CHECK], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True"] * 11, out.stdout


def test_the_per_token_kernel_compiles_for_hopper_with_the_passes_rounding(hopper_ptx):
    """The kernel as CUDA runs it, compiled by Triton's own compiler for sm_90 (H100 / H200) without a GPU: it builds,
    the scale is a rounded product (`mul.rn.f32`), each element's quotient a correctly rounded division (`div.rn`,
    no approximate one), no fused multiply-add, and the rounding constant's add and subtract (half to even) are not
    folded away. Reference: the PTX text."""
    from msmodelslim.ops.token_quant import _BLOCK, _per_token_kernel

    signature = {"X": "*bf16", "Q": "*i8", "SCALES": "*fp32", "cols": "i32", "inv_qmax": "fp32",
                 "QMIN": "constexpr", "QMAX": "constexpr", "BLOCK": "constexpr"}
    ptx = hopper_ptx(_per_token_kernel, signature, {"QMIN": -128.0, "QMAX": 127.0, "BLOCK": _BLOCK}, aligned=(0, 1, 3))
    assert "mul.rn.f32" in ptx and "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "fma.rn.f32" not in ptx
    assert "0f4B400000" in ptx and "0fCB400000" in ptx  # + 1.5 * 2^23, then - 1.5 * 2^23


def _compiler_failure(*_args: object) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError("PassManager::run failed\n(the compiler's log)")


def _off_by_one(x: torch.Tensor, *_args: object) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_symmetric(x, int8, PerToken())
    return q.clamp(-127, 126) + 1, s  # what a kernel that rounded the other way somewhere would give


@pytest.mark.parametrize(("kernel", "said"), [(_compiler_failure, r"failed \(PassManager::run failed\)"),
                                              (_off_by_one, r"gave other integers or scales than the passes")],
                         ids=["cannot be built", "differs"])
def test_a_per_token_kernel_that_cannot_be_built_or_differs_leaves_the_quantization_to_the_passes(
        kernel, said, monkeypatch, caplog):
    """If Triton cannot build the kernel on a GPU, or its first result in a process is not the passes' integers and
    scales bit for bit, the run goes on with the passes (the same values) and says so once. Reference: the kernel's
    launcher replaced by one that raises as a compiler failure does, and by one off by one integer; the passes."""
    from msmodelslim.ops import token_quant
    from msmodelslim.quant import functional

    monkeypatch.setattr(token_quant, "per_token_int8", kernel)
    monkeypatch.setattr(functional.TOKEN_QUANT_KERNEL, "enabled", True)
    monkeypatch.setattr(functional.TOKEN_QUANT_KERNEL, "checked", False)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="msmodelslim.quant.functional"):
        assert functional._checked_per_token(x, int8) is None
        assert functional._checked_per_token(x, int8) is None  # off now
    assert functional.TOKEN_QUANT_KERNEL.enabled is False
    assert len(caplog.records) == 1 and re.fullmatch(
        rf"per-token activation quantization: the Triton kernel {said}; it runs as PyTorch passes from now on: the "
        r"same integers, more passes over memory", caplog.records[0].getMessage()), caplog.records[0].getMessage()


def test_a_per_token_kernel_with_the_passes_values_is_kept(monkeypatch, caplog):
    """A kernel whose first result is the passes' integers and scales is used from then on without a word.
    Reference: the passes' own values as the kernel's."""
    from msmodelslim.ops import token_quant
    from msmodelslim.quant import functional

    monkeypatch.setattr(token_quant, "per_token_int8", lambda x, *_a: quantize_symmetric(x, int8, PerToken()))
    monkeypatch.setattr(functional.TOKEN_QUANT_KERNEL, "enabled", True)
    monkeypatch.setattr(functional.TOKEN_QUANT_KERNEL, "checked", False)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.WARNING, logger="msmodelslim.quant.functional"):
        found = functional._checked_per_token(x, int8)
    q, s = quantize_symmetric(x, int8, PerToken())
    assert found is not None and torch.equal(found[0], q) and torch.equal(found[1], s) and not caplog.records
    assert functional.TOKEN_QUANT_KERNEL.enabled is True and functional.TOKEN_QUANT_KERNEL.checked is True
