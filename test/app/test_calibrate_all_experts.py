"""`spec.calibrate_all_experts: true`: in the statistics passes every routed expert computes on every token, so each
expert's Hessian sees all the calibration tokens (not the ~top-k / E its router sends it), while the layers'
outputs keep the router's choice. Reference: the tiny Kimi-K3 and the shipped W4A8 practice cut to 4 records; the
token count of each routed expert's Hessian (linear_quant's coverage line) equals the tokens every unit forwards,
exactly; `--plan` says so before the run; the output evaluates."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import yaml

from msmodelslim.app.quant import QuantArgs, plan, quant

pytestmark = pytest.mark.slow  # a whole quantization run

REPO = Path(__file__).resolve().parents[2]


def run_args(checkpoint: Path, tmp_path: Path, option: str) -> QuantArgs:
    """The shipped W4A8 practice cut to 4 records of <= 64 tokens, with spec.<option> on."""
    practice = yaml.safe_load((REPO / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml").read_text())
    practice["spec"].update({option: True, "max_samples": 4, "max_seq_len": 64})
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(practice, sort_keys=False))
    return QuantArgs(model_path=str(checkpoint), save_path=str(tmp_path / "out"), device="cpu", model_type="Kimi-K3",
                     config_path=str(path), trust_remote_code=True)


def hessian_tokens(log: str) -> list[tuple[int, int, int]]:
    """(min, median, max) tokens of the routed experts' Hessians per unit, from linear_quant's coverage lines."""
    return [tuple(map(int, m.groups())) for m in
            re.finditer(r"routed experts' Hessians saw (\d+) / (\d+) / (\d+) tokens", log)]


def test_every_routed_expert_hessian_sees_every_calibration_token(tiny_k3_checkpoint, tmp_path, caplog):
    args = run_args(tiny_k3_checkpoint, tmp_path, "calibrate_all_experts")
    planned = plan(args)
    tokens = planned["calibration"]["tokens"]
    coverage = planned["calibration"]["expert_coverage"]
    assert coverage["all_tokens"] and coverage["tokens_per_expert_even_routing"] == tokens
    with caplog.at_level(logging.INFO, logger="msmodelslim.processor.linear_quant"):
        quant(args)
    seen = hessian_tokens(caplog.text)
    assert seen[:-1] == [(tokens,) * 3] * 3, (seen, tokens)  # the 3 MoE decoder layers
    assert seen[-1] == (tokens - 4,) * 3, (seen, tokens)  # the MTP layer reads one token fewer of each of 4 records


def test_balanced_experts_top_every_routed_expert_hessian_up_to_its_share(tiny_k3_checkpoint, tmp_path, caplog):
    """`spec.balanced_experts: true`: each routed expert's Hessian sees at least its balanced share of every
    micro-batch (ceil(tokens x top-k / experts)), so the fewest tokens an expert saw is at least `--plan`'s even
    routing count, tokens x top-k / experts (reference: exact counts; the stand-in's router alone leaves some expert
    with none at this size, BENCHMARKS.md); the report says how the experts were calibrated."""
    args = run_args(tiny_k3_checkpoint, tmp_path, "balanced_experts")
    even = plan(args)["calibration"]["expert_coverage"]["tokens_per_expert_even_routing"]
    with caplog.at_level(logging.INFO, logger="msmodelslim.processor.linear_quant"):
        quant(args)
    report = json.loads((tmp_path / "out" / "quant_report.json").read_text())
    assert report["expert_coverage"]["calibration"] == "balanced"
    seen = hessian_tokens(caplog.text)
    assert len(seen) == 4 and all(low >= even for low, _, _ in seen[:-1]), (seen, even)  # 3 MoE layers, then MTP
