"""$MSMODELSLIM_PROFILE (pipeline/profile.py): the per-pass profile a benchmark reads, and where its host time goes."""

import torch

from msmodelslim.pipeline.profile import WHERE_ENV, PassProfiler
from msmodelslim.quant.functional import quantize_per_token


def test_the_where_file_charges_an_operator_to_the_package_function_that_called_it(tmp_path, monkeypatch):
    """Two passes of one kind calling quantize_per_token: the profile counts both passes, and the .where file
    charges the quantization's division to functional.py's quantize_with_scale (its innermost own caller)."""
    monkeypatch.setenv(WHERE_ENV, "1")
    profiler = PassProfiler(torch.device("cpu"))
    x = torch.randn(64, 32)
    for _ in range(2):
        with profiler.profiled("calibrate"):
            quantize_per_token(x)
    profiler.write(tmp_path / "p.rank0")
    assert (tmp_path / "p.rank0").read_text().startswith("== calibrate: 2 passes")
    where = (tmp_path / "p.rank0.where").read_text().splitlines()
    assert where[0].startswith("== calibrate")
    assert any("quantize_with_scale" in line.split("<")[0] and line.endswith("aten::div") for line in where[1:])


def test_without_the_where_switch_no_where_file_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(WHERE_ENV, raising=False)
    profiler = PassProfiler(torch.device("cpu"))
    with profiler.profiled("calibrate"):
        quantize_per_token(torch.randn(8, 8))
    profiler.write(tmp_path / "p.rank0")
    assert (tmp_path / "p.rank0").is_file() and not (tmp_path / "p.rank0.where").exists()
