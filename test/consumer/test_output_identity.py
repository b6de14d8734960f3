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


def _passes(stats_prefix) -> dict[str, int]:
    import json

    return json.loads(stats_prefix.with_name(stats_prefix.name + ".rank0").read_text())["calibration_passes"]


@pytest.fixture(scope="module")
def mini_shipped_w4a8_passes(tmp_path_factory):
    """Calibration passes per unit of kimi-linear-mini quantized with its shipped W4A8 practice and own numerics
    (2 records of <= 64 tokens)."""
    from msmodelslim.pipeline.launch import STATS_ENV

    from .outputs import MINI

    if not (MINI / "config.json").is_file():
        pytest.skip(f"{MINI} not available")
    root = tmp_path_factory.mktemp("mini_shipped")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(STATS_ENV, str(root / "stats"))
        build_one(root, MINI, "mini", "w4a8", plain_numerics=False)
    return _passes(root / "stats")


def test_every_decoder_unit_of_a_shipped_w4a8_run_takes_two_calibration_passes(shipped_numerics_runs,
                                                                               mini_shipped_w4a8_passes):
    """Bar 21: one statistics pass (iter_smooth's ranges, which also keeps its search's token sample and gathers
    every GPTQ entry's Hessians) and the forward that makes the next unit's inputs, per decoder and MTP unit of the
    tiny Kimi-K3 and of kimi-linear-mini; the units without calibrated linears take one forward. Held exactly: 4 on
    Kimi-K3 and 3 on Kimi-Linear before issue 50."""
    root, _ = shipped_numerics_runs
    assert _passes(root / "stats0") == {"vision": 1, "embed": 1, "layers.0": 2, "layers.1": 2, "layers.2": 2,
                                        "layers.3": 2, "head": 1, "mtp.0": 2}
    decoder = {unit: n for unit, n in mini_shipped_w4a8_passes.items() if unit.startswith("layers.")}
    assert decoder and set(decoder.values()) == {2}
    assert all(n == 1 for unit, n in mini_shipped_w4a8_passes.items() if unit not in decoder)
