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


@pytest.fixture(scope="module")
def shipped_numerics_runs(tiny_k3_checkpoint, tmp_path_factory):
    """W4A8 on the tiny Kimi-K3 with the practice's own numerics (GPTQ, the searched smoothing), run twice in this
    process; each run's statistics file beside it."""
    from msmodelslim.pipeline.launch import STATS_ENV

    root = tmp_path_factory.mktemp("shipped_numerics")
    runs = []
    with pytest.MonkeyPatch.context() as env:
        for i in range(2):
            env.setenv(STATS_ENV, str(root / f"stats{i}"))
            runs.append(build_one(root / str(i), tiny_k3_checkpoint, "tiny_k3", "w4a8", plain_numerics=False))
    return root, runs


def test_the_shipped_numerics_run_twice_give_identical_bytes(shipped_numerics_runs):
    """The same with the practice's own numerics (thread pools and float64 sums). Tolerance: none."""
    _, runs = shipped_numerics_runs
    assert file_hashes(runs[0], report=True) == file_hashes(runs[1], report=True)


# Calibration passes per unit of the shipped W4A8 practice on the tiny Kimi-K3, as the runner scheduled them before
# the passes were the runner's (8e244dc): iter_smooth's absmax pass (which also gathers the GPTQ Hessians a later
# entry can take), its search pass, the latent up-projection's GPTQ pass after the experts are quantized, and the
# forward that makes the next unit's inputs. Held exactly: the schedule must not add a pass.
SHIPPED_W4A8_PASSES = {"vision": 1, "embed": 1, "layers.0": 3, "layers.1": 4, "layers.2": 4, "layers.3": 4, "head": 1,
                       "mtp.0": 4}


def test_the_runner_schedules_no_more_passes_than_before(shipped_numerics_runs):
    import json

    root, _ = shipped_numerics_runs
    passes = json.loads((root / "stats0.rank0").read_text())["calibration_passes"]
    assert passes == SHIPPED_W4A8_PASSES
