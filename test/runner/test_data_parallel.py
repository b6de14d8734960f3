"""Data + expert parallelism over several CPU processes (gloo) gives the single-device output, to a stated tolerance.

Reference: the same command on `--device cpu` (one process). What must be equal: the description JSON and every
tensor's name, shape and dtype. What may differ: the replicated linears' Hessians are float32 sums added over
ranks (pipeline/statistics.py), so their last bits move with the rank count, and a GPTQ rounding or a smoothing
choice near a tie can flip and spread to later layers. Tolerance, on the real trained kimi-linear-mini: the
perplexity of the one- and two-rank outputs within 0.5 % of each other (measured 0.27 %; it was equal before the
CPU's Hessians took bf16 dot products, only because this fixture's micro-batches of 128 rows lined up with the
float32 GEMM's blocks of the sum: 100 + 156 rows did not). Everything else a rank
count could change is exact: maxima, integer sums, each routed-expert output in its own (token, slot) of a zero
buffer, micro-batches made before they are dealt to ranks. The same rank count reproduces the same bytes (the
resume and torchrun tests).

These runs are also the shipped practices under the Ascend op check (MSMODELSLIM_ASCEND_CHECK=1, docs/npu.md):
W4A8C8 (the W4A8 practice plus fa3_quant) and W8A8 on the tiny Kimi-K3 on one and two ranks (the four-rank run
unchecked: the same collectives, at ~2.5x its time), W4A8C8 on kimi-linear-mini on one. A violation would fail the
run; the single-process run reports how many device ops it checked.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from msmodelslim.app.quant import QuantArgs, quant
from msmodelslim.core import ascend_check
from msmodelslim.pipeline.launch import STATS_ENV, split_samples
from msmodelslim.pipeline.resume import ResumeState
from msmodelslim.serving.ascendv1 import AscendV1Reader

from .dp_helpers import REPO, assert_same_layout, read_output, shrunken_practice

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)



@pytest.fixture
def tiny_k3(tiny_k3_checkpoint: Path) -> Path:
    return tiny_k3_checkpoint


def _quant(model: Path, out: Path, device: str, model_type: str, practice: Path) -> None:
    quant(QuantArgs(model_path=str(model), save_path=str(out), device=device, model_type=model_type,
                    config_path=str(practice), trust_remote_code=True))


@pytest.fixture
def ascend_checked(monkeypatch, tmp_path: Path):
    """Runs under the Ascend op check; returns how many device ops the last single-process run checked."""
    monkeypatch.setenv(ascend_check.ENV, "1")
    monkeypatch.setenv(STATS_ENV, str(tmp_path / "stats"))
    return lambda: json.loads((tmp_path / "stats.rank0").read_text())["ascend_ops_checked"]


def _quantized_attentions(out: Path) -> int:
    return sum(k.endswith(".fa_k.scale") for k in read_output(out)[1])


def test_dp_output_has_the_single_device_layout_on_tiny_kimi_k3(tiny_k3: Path, tmp_path: Path, ascend_checked,
                                                              monkeypatch):
    # the W4A8C8 practice: the W4A8 one plus fa3_quant, whose per-head ranges are reduced over ranks too
    practice = shrunken_practice(REPO / "lab_practice/kimi_k3/kimi_k3_w4a8c8.yaml", tmp_path / "p.yaml",
                                 max_samples=5, max_seq_len=96)
    _quant(tiny_k3, tmp_path / "one", "cpu", "Kimi-K3", practice)
    assert _quantized_attentions(tmp_path / "one") > 0
    assert ascend_checked() > 10_000
    for devices in ("cpu:0,1", "cpu:0,1,2,3"):
        out = tmp_path / devices.replace(":", "_").replace(",", "")
        if devices == "cpu:0,1,2,3":
            monkeypatch.delenv(ascend_check.ENV)
        _quant(tiny_k3, out, devices, "Kimi-K3", practice)
        assert assert_same_layout(tmp_path / "one", out) > 100


def test_w8a8_dp_output_has_the_single_device_layout_on_tiny_kimi_k3(tiny_k3: Path, tmp_path: Path, ascend_checked):
    practice = shrunken_practice(REPO / "lab_practice/kimi_k3/kimi_k3_w8a8.yaml", tmp_path / "p.yaml",
                                 max_samples=3, max_seq_len=48)
    _quant(tiny_k3, tmp_path / "one", "cpu", "Kimi-K3", practice)
    assert ascend_checked() > 10_000
    _quant(tiny_k3, tmp_path / "two", "cpu:0,1", "Kimi-K3", practice)
    assert assert_same_layout(tmp_path / "one", tmp_path / "two") > 100


def test_dp_output_is_as_accurate_as_single_device_on_kimi_linear_mini(mini_runs):
    """Each rank forwards its own micro-batch here (mini_runs), so the replicated Hessians are summed over ranks."""
    from msmodelslim.eval.perplexity import evaluate

    assert _quantized_attentions(mini_runs.one) > 0
    assert mini_runs.ascend_ops_checked > 10_000
    assert assert_same_layout(mini_runs.one, mini_runs.two) > 100
    text = REPO.parent / "shared" / "data" / "text" / "python_tutorial.txt"
    one, two = (evaluate(mini_runs.model, out, text, seq_len=256, max_windows=4, model_type="Kimi-Linear")
                for out in (mini_runs.one, mini_runs.two))
    assert two["ppl_quant"] == pytest.approx(one["ppl_quant"], rel=5e-3)


def test_the_quant_report_covers_every_quantized_linear_and_agrees_across_rank_counts(mini_runs):
    """quant_report.json of the one- and two-rank runs: an entry per quantized linear of the description (experts
    written by their rank included), the same scheme, the same tokens at every replicated linear and the same total
    at each layer's routed experts. The replicated linears' Hessians are float32 sums whose last bits move with the
    rank count (docs/dev/architecture.md), which can flip a GPTQ rounding near a tie; downstream a near-tied routing
    can then move a token to another expert. So: the first decoder layer (the same inputs on any rank count) to the
    report's 4 significant digits (rel 2e-3: its float32 sums reduced in another order, a flipped rounding), the
    layers after it to a median relative difference of 2 % (measured 0.6 % on this fixture, whose experts see 3 to
    120 tokens each)."""
    one, two = (json.loads((out / "quant_report.json").read_text())["linears"]
                for out in (mini_runs.one, mini_runs.two))
    reader = AscendV1Reader(mini_runs.one)
    try:
        quantized = set(reader.quantized_linears())
    finally:
        reader.close()
    assert len(quantized) > 100 and quantized == set(one) == set(two)
    experts_per_layer: dict[str, list[int]] = {}
    for name, entry in one.items():
        assert entry["scheme"] == two[name]["scheme"], name
        if ".experts." in name:
            layer = name.split(".experts.")[0]
            experts_per_layer.setdefault(layer, [0, 0])
            experts_per_layer[layer][0] += entry["tokens"]
            experts_per_layer[layer][1] += two[name]["tokens"]
        else:
            assert entry["tokens"] == two[name]["tokens"], name
    assert experts_per_layer and all(a == b for a, b in experts_per_layer.values())
    later = []
    for name, entry in one.items():
        for key in ("error", "weight_error", "act_error", "act_absmax", "impact"):  # None: no token reached it
            mine, other = entry[key], two[name][key]
            if name.startswith("model.layers.0."):
                assert mine == (None if other is None else pytest.approx(other, rel=2e-3)), (name, key)
            elif mine is not None and other is not None and key == "error":
                later.append(abs(mine - other) / abs(other))
    assert statistics.median(later) < 0.02
    assert sum(e["error"] is not None for e in one.values()) > 80


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_fails_the_whole_run_fast_and_publishes_nothing(tiny_k3: Path, tmp_path: Path, how: str):
    fail = [{"type": "fail_on_rank", "rank": 1, "unit": "layers.1", "how": how}]
    practice = shrunken_practice(REPO / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml", tmp_path / "p.yaml",
                                 max_samples=2, max_seq_len=32, extra_process=fail)
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        _quant(tiny_k3, tmp_path / "out", "cpu:0,1", "Kimi-K3", practice)
    assert time.monotonic() - start < 120
    message = str(info.value)
    assert ("injected failure on rank 1" in message) if how == "raise" else ("rank 1 was killed by SIGKILL" in message)
    assert not (tmp_path / "out").exists()
    # what stays is the resumable state of the units before layers.1 (vision, embed, layers.0), nothing published;
    # a killed rank may die while layers.0's state is still being written (in the background): then embed's is kept
    assert ResumeState(tmp_path / ".out.partial").resume_point(2) == 2 if how == "raise" else \
        ResumeState(tmp_path / ".out.partial").resume_point(2) in (1, 2)


def test_samples_are_dealt_largest_first_so_lock_step_ranks_stay_balanced():
    sizes = [5, 300, 7, 280, 6, 290, 8]  # image samples (large) first in file order would all land on one rank
    samples = [{"input_ids": torch.zeros(1, n, dtype=torch.long)} for n in sizes]
    shares = [split_samples(samples, rank, 2) for rank in range(2)]
    got = [[s["input_ids"].shape[1] for s in share] for share in shares]
    assert got == [[300, 280, 7, 5], [290, 8, 6]]
    assert sorted(n for share in got for n in share) == sorted(sizes)  # every sample exactly once
    assert split_samples(samples, 0, 1) == sorted(samples, key=lambda s: -s["input_ids"].shape[1])


def test_a_capped_statistic_observes_the_first_samples_of_the_dealing_order_up_to_its_token_cap():
    from msmodelslim.pipeline.assembly import first_places, place_tokens

    def report_positions(samples, tokens):
        return first_places(place_tokens(samples), tokens)

    sizes = [5, 300, 7, 280, 6, 290, 8]  # dealing order: 300, 290, 280, 8, 7, 6, 5
    samples = [{"input_ids": torch.zeros(1, n, dtype=torch.long)} for n in sizes]
    assert report_positions(samples, 580) == {0, 1}  # 300 + 290 tokens reach the cap
    assert report_positions(samples, 591) == {0, 1, 2}
    assert report_positions(samples, 1) == {0}  # at least one sample
    assert report_positions(samples, None) is None  # null: every sample
    # rank r forwards place s * world + r at step s: the places pick the same samples on any rank count
    for world in (1, 2, 3):
        picked = [split_samples(samples, rank, world)[step]["input_ids"].shape[1]
                  for place in sorted(report_positions(samples, 580)) for rank, step in [(place % world, place // world)]]
        assert picked == [300, 290], world


def test_the_quant_report_observes_its_token_cap_on_any_rank_count_while_gptq_sees_every_token(mini_runs):
    """spec.report_tokens 128 (conftest): the report's statistics come from the first micro-batch of the dealing
    order (2 records of 64 tokens) on one rank and on two (rank 0 forwards it; rank 1's routed experts compute its
    tokens too and observe them, not rank 1's own); the GPTQ Hessians of the same linears saw all 256 tokens, and
    the expert coverage counts the Hessians'. Reference: the token counts (exact); the experts' report counts are
    compared across rank counts by the test above."""
    for out in (mini_runs.one, mini_runs.two):
        report = json.loads((out / "quant_report.json").read_text())
        linears = report["linears"]
        replicated = [e for n, e in linears.items() if ".experts." not in n and e["hessian_tokens"] is not None]
        assert replicated and all(e["tokens"] == 128 and e["hessian_tokens"] == 256 for e in replicated)
        experts = [e for n, e in linears.items() if ".experts." in n]
        assert all(e["tokens"] <= e["hessian_tokens"] for e in experts)
        assert sum(e["tokens"] for e in experts) < sum(e["hessian_tokens"] for e in experts)
        assert report["expert_coverage"]["tokens_max"] == max(e["hessian_tokens"] for e in experts)


def test_the_rank_that_failed_first_is_reported(tmp_path: Path):
    from msmodelslim.pipeline.launch import _first_failure

    assert _first_failure(tmp_path) is None
    (tmp_path / "rank0").write_text('{"time": 20.5, "error": "Connection reset by peer"}')
    (tmp_path / "rank1").write_text('{"time": 20.1, "error": "injected failure on rank 1"}')
    assert _first_failure(tmp_path) == (1, "injected failure on rank 1", False, False)
    (tmp_path / "rank0").write_text('{"time": 20.0, "error": "config.json: bad", "user": true}')
    assert _first_failure(tmp_path) == (0, "config.json: bad", True, False)  # a bad input: one line, exit 2
    (tmp_path / "rank0").write_text('{"time": 19.0, "error": "disk full", "user": true, "resumable": true}')
    assert _first_failure(tmp_path) == (0, "disk full", True, True)  # one line, exit 2, the state kept
