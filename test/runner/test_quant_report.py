"""The quant report's expert coverage (pipeline/report.py): how many calibration tokens the routed experts saw, and
a warning naming those whose Hessian the tokens could not fill. Reference: the counts given (exact)."""

from __future__ import annotations

import logging

from msmodelslim.pipeline.report import expert_coverage


def test_experts_with_fewer_tokens_than_inputs_are_counted_and_named_in_a_warning(caplog):
    experts = {f"m.experts.{e}.w1": {"tokens": t, "inputs": 64} for e, t in enumerate([0, 10, 64, 500, 900])}
    with caplog.at_level(logging.WARNING, logger="msmodelslim.pipeline.report"):
        coverage = expert_coverage(experts)
    assert coverage == {"calibration": "routed", "linears": 5, "tokens_min": 0, "tokens_median": 64, "tokens_max": 900,
                        "below_inputs": ["m.experts.0.w1", "m.experts.1.w1"], "no_token": ["m.experts.0.w1"]}
    assert "2 of 5 routed-expert linears saw fewer calibration tokens than their inputs (1 saw none): " \
           "m.experts.0.w1, m.experts.1.w1" in caplog.text


def test_a_model_without_routed_experts_has_no_coverage_and_no_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert expert_coverage({}) is None
    assert not caplog.records
