"""The bytes of an output are a function of its input on a given machine: the same run again gives the same files.

This is what holds everywhere. Bytes recorded on one machine do not hold on another: oneDNN / MKL pick other float
kernels on another microarchitecture (two AVX512 CPUs, one with VNNI, differed in layer shards), so the suite holds
no cross-machine record. "A refactor kept the outputs" is checked against the base commit's outputs built on the
same machine in the same sitting: `python bench/output_hashes.py --against REV`.

Other machine-independent identities are held elsewhere: 1 rank vs 2 ranks vs torchrun
(test/runner/test_data_parallel.py, test_torchrun.py), a resumed run vs an uninterrupted one (test_resume.py)."""

from __future__ import annotations

import pytest

from .outputs import build_one, file_hashes

pytestmark = pytest.mark.slow  # whole quantization runs


def test_a_shipped_practice_run_twice_gives_identical_bytes(outputs, tiny_k3_checkpoint, tmp_path):
    """Reference: the session's tiny Kimi-K3 W4A8C8 output (the shipped practice, shrunk, min/max weights), built
    again in this process from the same checkpoint and practice. Tolerance: none, every file's SHA-256 (the quant
    report included: its floats are rounded from the same sums)."""
    again = build_one(tmp_path, tiny_k3_checkpoint, "tiny_k3", "w4a8c8")
    first = outputs[("tiny_k3", "w4a8c8")]
    assert file_hashes(again, report=True) == file_hashes(first, report=True)


def test_the_shipped_numerics_run_twice_give_identical_bytes(tiny_k3_checkpoint, tmp_path):
    """The same with the practice's own numerics (GPTQ, the searched smoothing: thread pools and float64 sums),
    W4A8 on the tiny Kimi-K3, two runs in this process. Tolerance: none."""
    runs = [build_one(tmp_path / str(i), tiny_k3_checkpoint, "tiny_k3", "w4a8", plain_numerics=False)
            for i in range(2)]
    assert file_hashes(runs[0], report=True) == file_hashes(runs[1], report=True)
