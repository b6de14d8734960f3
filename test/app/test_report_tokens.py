"""`spec.report_tokens`: the quant report observes only the first calibration samples of the dealing order, the
last unit (which feeds nothing) is forwarded for the report on those samples alone, and GPTQ still sees every token.
Reference: the tiny Kimi-K3 and the shipped W4A8 practice cut to 4 records of <= 64 tokens, with a cap of 1 token
(exactly the first sample); token counts are exact (`--plan`'s total; the MTP layer reads one token fewer of each
record, test_calibrate_all_experts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from msmodelslim.app.quant import QuantArgs, plan, quant

pytestmark = pytest.mark.slow  # a whole quantization run

REPO = Path(__file__).resolve().parents[2]


def test_a_capped_report_observes_the_first_sample_in_every_unit_and_gptq_every_token(tiny_k3_checkpoint, tmp_path):
    practice = yaml.safe_load((REPO / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml").read_text())
    practice["spec"].update(max_samples=4, max_seq_len=64, report_tokens=1)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(practice, sort_keys=False))
    args = QuantArgs(model_path=str(tiny_k3_checkpoint), save_path=str(tmp_path / "out"), device="cpu",
                     model_type="Kimi-K3", config_path=str(path), trust_remote_code=True)
    total = plan(args)["calibration"]["tokens"]
    quant(args)
    report = json.loads((tmp_path / "out" / "quant_report.json").read_text())
    per_unit: dict[str, set[tuple[int, int | None]]] = {}
    for name, entry in report["linears"].items():
        if ".experts." not in name and "language_model" in name:  # replicated: every token of the sample
            per_unit.setdefault(entry["unit"], set()).add((entry["tokens"], entry["hessian_tokens"]))
    decoders = [u for u in per_unit if u.startswith("layers.")]
    first = per_unit[decoders[0]]
    assert len(first) == 1 and all(per_unit[u] == first for u in decoders), per_unit
    (observed, hessian), = first
    assert 0 < observed < total and hessian == total
    # the last unit, forwarded for the report alone; the first sample is one image record (they forward alone)
    assert per_unit["mtp.0"] == {(observed - 1, total - 4)}
