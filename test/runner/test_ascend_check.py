"""The Ascend op check (core/ascend_check.py) names what an Atlas A2/A3 NPU cannot run, and only that.

Reference: the rule table `core/ascend_a2a3_rules.json` (op-plugin / torch_npu sources); placement rule of
core/placement.py (on a CPU run every op outside a host section is device work). Each planted violation must be
named with its op, its dtype and the toolkit's file:line; the shipped practices must run with none
(test/runner/test_data_parallel.py and test_practices_under_the_check below run them under the check).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml

from msmodelslim.cli.main import main
from msmodelslim.core import ascend_check
from msmodelslim.core.ascend_check import AscendOpViolation
from msmodelslim.core.dist import DistContext
from msmodelslim.core.placement import host_section
from msmodelslim.quant.gptq import inverse_cholesky_upper

from .dp_helpers import REPO, shrunken_practice


@pytest.fixture
def checking_cpu():
    ascend_check.start(torch.device("cpu"))
    try:
        with ascend_check.watching():
            yield
    finally:
        ascend_check.stop()


@contextmanager
def violation(match: str):
    """The check refuses what the block does, with a message matching `match` (then the run may go on)."""
    with pytest.raises(AscendOpViolation, match=match):
        yield
    ascend_check._active.first = None  # expected here: not a violation the run swallowed


def test_a_float64_all_reduce_is_refused_even_on_one_rank(checking_cpu):
    with host_section("test data"):
        h = torch.zeros(3, dtype=torch.float64)
    with violation(r"all_reduce of float64: HCCL on A2/A3 takes .*float32.*ProcessGroupHCCL\.cpp"):
        DistContext().all_reduce_sum({"h": h})


def test_int64_sums_and_float32_maxima_pass_the_collective_rules(checking_cpu):
    DistContext().all_reduce_sum({"n": torch.zeros(3, dtype=torch.int64)})
    DistContext().all_reduce_max({"x": torch.zeros(3)})
    DistContext().broadcast(torch.zeros(4, dtype=torch.uint8), 0)


def test_float64_on_the_device_is_refused_and_named_by_the_toolkit_line(checking_cpu):
    from msmodelslim.processor.iter_smooth import multiply_columns

    with host_section("test data"):
        weight = torch.ones(2, 2, dtype=torch.float64)  # a float64 weight reaches toolkit code on the device
    with violation(r"aten\.\w+ on float64 on the device .* at msmodelslim/processor/iter_smooth\.py:\d+"):
        multiply_columns(weight, torch.ones(2))


def test_host_sections_are_exempt_on_a_cpu_run(checking_cpu):
    with host_section("a test's float64 on the host"):
        torch.ones(4, 4, dtype=torch.float64) @ torch.ones(4, 4, dtype=torch.float64)
        torch.linalg.cholesky_ex(torch.eye(3))


def test_an_op_without_an_npu_kernel_is_refused(checking_cpu):
    # linalg_cholesky_ex is in neither op-plugin's nor torch_npu's function list
    eye = torch.eye(3)
    with violation(r"aten\.linalg_cholesky_ex has no NPU kernel"):
        torch.linalg.cholesky_ex(eye)


def test_gptq_factors_h_inverse_on_the_host_without_violations(checking_cpu):
    # and the factor is the float64 reference's (upper Cholesky of H^-1), float32 tolerance
    a = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    h = (a.t() @ a + torch.eye(16))[None]
    u = inverse_cholesky_upper(h)
    with host_section("the float64 reference"):
        ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h.double())), upper=True)
        assert torch.allclose(u.double(), ref, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gptq_factor_on_cuda_equals_the_host_factor():
    a = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    h = (a.t() @ a + torch.eye(16))[None]
    assert torch.allclose(inverse_cholesky_upper(h.cuda()).cpu(), inverse_cholesky_upper(h), rtol=1e-4, atol=1e-6)


def test_on_an_accelerator_run_cpu_tensors_are_host_work():
    check = ascend_check._Check(torch.device("cuda"))
    cpu = torch.ones(2, dtype=torch.float64)
    assert check.device_tensors([cpu]) == []


def test_the_rule_table_cites_its_sources():
    data = ascend_check.rules()
    assert "mm" in data["npu_ops"] and "cholesky_inverse" not in data["npu_ops"]
    assert "float64" not in data["collectives"]["all_reduce"]
    assert all(source for _, source in data["dtype_rules"].values())


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cpu:0,1"])
def test_a_float64_quarot_practice_fails_the_run_with_one_line(tiny_k3_checkpoint: Path, tmp_path: Path,
                                                                monkeypatch, capsys, device: str):
    practice = shrunken_practice(REPO / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml", tmp_path / "p.yaml",
                                 max_samples=2, max_seq_len=16)
    data = yaml.safe_load(practice.read_text())
    next(step for step in data["spec"]["process"] if step["type"] == "quarot")["compute_dtype"] = "float64"
    practice.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv(ascend_check.ENV, "1")
    code = main(["quant", "--model_path", str(tiny_k3_checkpoint), "--save_path", str(tmp_path / "out"),
                 "--device", device, "--model_type", "Kimi-K3", "--config_path", str(practice),
                 "--trust_remote_code", "True"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert re.match(r"msmodelslim: error: (rank \d: )?Ascend op check: aten\.", err[-1])  # a rank names itself
    assert "float64" in err[-1] and "msmodelslim/processor/quarot.py:" in err[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("practice", ["kimi_k3_w4a4c8_mxfp", "kimi_k3_w4a8_pergroup"])
def test_the_ascend_950_and_per_group_practices_run_under_the_a2_a3_check(tiny_k3_checkpoint: Path, tmp_path: Path,
                                                                          monkeypatch, practice):
    # MXFP4 / MXFP8 weights and activations and the fp8 FA3 cache are float32 and integer arithmetic: an Atlas A2/A3
    # (no fp8 dtype) can calibrate an Ascend 950 practice. Reference: the A2/A3 rule table; zero violations.
    source = shrunken_practice(REPO / f"lab_practice/kimi_k3/{practice}.yaml", tmp_path / "p.yaml", max_samples=2,
                               max_seq_len=16)
    source.write_text(source.read_text().replace("group_size: 256", "group_size: 32"))  # the tiny experts' 64 inputs
    monkeypatch.setenv(ascend_check.ENV, "1")
    code = main(["quant", "--model_path", str(tiny_k3_checkpoint), "--save_path", str(tmp_path / "out"),
                 "--device", "cpu", "--model_type", "Kimi-K3", "--config_path", str(source),
                 "--trust_remote_code", "True"])
    assert code == 0
    assert (tmp_path / "out" / "quant_model_description.json").is_file()
