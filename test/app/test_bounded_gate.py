"""Kimi-K3's released config may bound the KDA forget gate (`linear_attn_config.gate_lower_bound`, -5.0 in the
public kernel tests): g = lb * sigmoid(exp(A_log) * (g + dt_bias)) instead of -exp(A_log) * softplus(g + dt_bias).
Reference: the tiny Kimi-K3 with that field (its presets' default) and without it (null: the softplus gate); our
gate kernel is called with the bound (a spy on
ops.kda.kda_gate; the kernel itself is held to fla's naive bounded gate in test/ops/test_kda.py), quant and eval run,
and a bound outside vLLM's [-5, 0) is one error line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from msmodelslim.cli.main import main
from msmodelslim.ops import kda

pytestmark = pytest.mark.slow  # a whole quantization run

REPO = Path(__file__).resolve().parents[2]


def bounded_copy(tiny_k3_checkpoint: Path, tmp_path: Path, bound: object) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_k3_checkpoint, model)
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["linear_attn_config"]["gate_lower_bound"] = bound
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


@pytest.mark.parametrize("bound", [-5.0, None], ids=["bounded (the presets' default)", "unbounded (null)"])
def test_a_checkpoint_calibrates_with_its_gate_bound_and_evaluates(tiny_k3_checkpoint, tmp_path, monkeypatch, bound):
    model = bounded_copy(tiny_k3_checkpoint, tmp_path, bound)
    bounds, real = [], kda.kda_gate

    def spy(*args, lower_bound=None, **kwargs):
        bounds.append(lower_bound)
        return real(*args, lower_bound=lower_bound, **kwargs)

    monkeypatch.setattr(kda, "kda_gate", spy)
    practice = yaml.safe_load((REPO / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml").read_text())
    practice["spec"].update(max_samples=3, max_seq_len=64)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(practice, sort_keys=False))
    out = tmp_path / "out"
    assert main(["quant", "--model_path", str(model), "--save_path", str(out), "--device", "cpu", "--model_type",
                 "Kimi-K3", "--config_path", str(path), "--trust_remote_code", "True"]) == 0
    assert bounds and set(bounds) == {bound}
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    assert main(["eval", "--model_path", str(model), "--quant_path", str(out), "--dataset", str(text),
                 "--trust_remote_code", "True", "--max-windows", "1", "--seq-len", "64"]) == 0


def test_a_gate_bound_outside_vllms_range_is_one_error_line(tiny_k3_checkpoint, tmp_path, capsys):
    model = bounded_copy(tiny_k3_checkpoint, tmp_path, -7.5)
    code = main(["quant", "--model_path", str(model), "--save_path", str(tmp_path / "out"), "--device", "cpu",
                 "--model_type", "Kimi-K3", "--quant_type", "w4a8", "--trust_remote_code", "True"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].endswith("text_config.linear_attn_config.gate_lower_bound must be a number in [-5, 0), got -7.5")
