"""`spec.report_impact_tokens`: the quant report's loss-aware `impact` (pipeline/impact.py) in a whole run of the tiny
Kimi-K3 (expert-parallel MoE patches, attention residuals, an MTP layer) with the shipped W4A8 practice cut to 4
records of <= 64 tokens. References: the same run without it (the weights and the description byte for byte: the
probe's forwards change nothing), and per unit the group sums of the impacts (its routed experts restored to float
must lower the unit output's error: a swap that did not take would give 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from msmodelslim.app.quant import QuantArgs, quant

pytestmark = pytest.mark.slow  # whole quantization runs

REPO = Path(__file__).resolve().parents[2]


def run(checkpoint: Path, tmp_path: Path, name: str, **spec) -> Path:
    practice = yaml.safe_load((REPO / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml").read_text())
    practice["spec"].update(max_samples=4, max_seq_len=64, **spec)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(practice, sort_keys=False))
    quant(QuantArgs(model_path=str(checkpoint), save_path=str(tmp_path / name), device="cpu", model_type="Kimi-K3",
                    config_path=str(path), trust_remote_code=True))
    return tmp_path / name


def test_the_impact_probe_measures_every_quantized_linear_and_changes_no_byte_of_the_output(tiny_k3_checkpoint,
                                                                                            tmp_path):
    plain = run(tiny_k3_checkpoint, tmp_path, "plain")
    probed = run(tiny_k3_checkpoint, tmp_path, "probed", report_impact_tokens=64)
    weights = sorted(p.name for p in plain.iterdir() if p.suffix in (".safetensors", ".json") and
                     p.name != "quant_report.json")
    assert weights and all((plain / f).read_bytes() == (probed / f).read_bytes() for f in weights)

    before = json.loads((plain / "quant_report.json").read_text())["linears"]
    after = json.loads((probed / "quant_report.json").read_text())["linears"]
    assert after.keys() == before.keys()
    assert all({k: v for k, v in after[n].items() if k != "impact"} == before[n] for n in before)
    assert all(e.get("impact") is not None for e in after.values()) and not any("impact" in e for e in before.values())
    experts: dict[str, float] = {}
    for name, entry in after.items():
        if ".experts." in name and "shared" not in name:
            experts[entry["unit"]] = experts.get(entry["unit"], 0.0) + entry["impact"]
    assert experts and all(value > 0 for value in experts.values()), experts
