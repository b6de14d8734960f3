"""`msmodelslim eval` beyond perplexity: the KL divergence of the quantized model's next-token distribution from the
original's, top-1 agreement and the perplexity delta, each with a standard error over windows.

References: float64 recomputation of each metric from the two models' logits (test_eval_ppl.py's whole-model
references give the logits there), and on kimi-linear-mini (a trained model) a planted outlier: one input column
of an o_proj times 30, left in and quantized with min/max W8A8 (its rows' scales then 30 times coarser), must raise
the KL by more than 2 standard errors over the same practice (the o_projs W8A8) on the unplanted model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from reliability.faults import planted_outlier

from msmodelslim.eval.perplexity import _divergence, _mean_se

REPO = Path(__file__).resolve().parents[2]
MINI = REPO.parent / "shared" / "models" / "kimi-linear-mini"
TEXT = REPO.parent / "shared" / "data" / "text" / "python_tutorial.txt"
OUTLIER = "model.layers.2.self_attn.o_proj"


def test_the_divergence_of_a_window_is_the_float64_kl_and_argmax_agreement():
    """Reference: KL(p || q) = sum p (log p - log q) per position in float64 from the same logits; tolerance 1e-4
    relative (fp32 log-softmax)."""
    gen = torch.Generator().manual_seed(0)
    orig, quant = torch.randn(1, 9, 50, generator=gen), torch.randn(1, 9, 50, generator=gen)
    quant[0, :4] = orig[0, :4]  # four positions identical: KL 0 there, argmax agrees
    kl, agree = _divergence(orig, quant)
    p, q = torch.log_softmax(orig[0, :-1].double(), -1), torch.log_softmax(quant[0, :-1].double(), -1)
    assert kl == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-4)
    assert agree == int((p.argmax(-1) == q.argmax(-1)).sum()) and agree >= 4


def test_the_standard_error_is_the_sample_deviation_over_the_square_root_of_the_count():
    assert _mean_se([1.0, 2.0, 3.0, 6.0]) == pytest.approx((3.0, math.sqrt(14 / 3 / 4)))
    assert _mean_se([5.0]) == (5.0, None)


def minmax_practice(dest: Path) -> Path:
    """The shipped Kimi-Linear W8A8 practice cut to one min/max W8A8_DYNAMIC entry (per channel) over the attention
    output projections, with no rotation or smoothing that would spread a planted column: the rest stays float, so
    the KL measures those linears alone."""
    practice = yaml.safe_load((REPO / "lab_practice" / "kimi_k3" / "kimi_linear_w8a8.yaml").read_text())
    practice["spec"]["process"] = [{
        "type": "linear_quant", "include": ["*.self_attn.o_proj"],
        "qconfig": {"act": {"scope": "per_token", "dtype": "int8"},
                    "weight": {"scope": "per_channel", "dtype": "int8", "method": "minmax"}}}]
    practice["spec"].update(max_samples=4, max_seq_len=128)
    dest.write_text(yaml.safe_dump(practice))
    return dest


def eval_json(model: Path, out: Path, capsys) -> dict:
    from msmodelslim.cli.main import main

    assert main(["eval", "--model_path", str(model), "--quant_path", str(out), "--dataset", str(TEXT), "--seq_len",
                 "128", "--max_windows", "8", "--model_type", "Kimi-Linear", "--metrics", "kl"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  KL ") and " +- " in line for line in lines), lines
    return json.loads(lines[-1])


@pytest.mark.slow
@pytest.mark.skipif(not (MINI / "config.json").is_file() or not TEXT.is_file(), reason="../shared not available")
def test_a_planted_outlier_left_in_raises_the_kl_by_more_than_two_standard_errors(tmp_path, capsys):
    from msmodelslim.app.quant import QuantArgs, quant

    practice = minmax_practice(tmp_path / "p.yaml")
    measured = {}
    for name, model in (("plain", MINI), ("planted", planted_outlier(MINI, tmp_path / "planted", OUTLIER, 5))):
        quant(QuantArgs(model_path=str(model), save_path=str(tmp_path / f"{name}_out"), device="cpu",
                        model_type="Kimi-Linear", config_path=str(practice)))
        measured[name] = eval_json(model, tmp_path / f"{name}_out", capsys)
    plain, planted = measured["plain"], measured["planted"]
    for result in (plain, planted):
        assert {"kl", "kl_se", "top1", "ppl_delta", "ppl_delta_se"} <= set(result)
        assert result["kl"] > 0 and result["kl_se"] > 0 and 0 < result["top1"] <= 1
    assert planted["kl"] - plain["kl"] > 2 * math.hypot(planted["kl_se"], plain["kl_se"]), (plain, planted)
