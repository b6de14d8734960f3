"""`spec.mtp`: what a practice does with Kimi-K3's MTP layers (layers.{N + k}). Reference: the tiny Kimi-K3
(4 decoder layers, one MTP layer at layers.4) and the shipped W4A8 practice cut to 4 records; exact schemes, tensor
names and config values; `eval` must run on each output (it reads the head's logits, not the MTP layer's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from msmodelslim.cli.main import main

pytestmark = pytest.mark.slow  # whole quantization runs

REPO = Path(__file__).resolve().parents[2]
MTP = ".layers.4."


def quantized(tiny_k3_checkpoint: Path, tmp_path: Path, mtp: str) -> tuple[dict, dict]:
    practice = yaml.safe_load((REPO / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml").read_text())
    practice["spec"].update(mtp=mtp, max_samples=4, max_seq_len=64)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(practice, sort_keys=False))
    out = tmp_path / "out"
    assert main(["quant", "--model_path", str(tiny_k3_checkpoint), "--save_path", str(out), "--device", "cpu",
                 "--model_type", "Kimi-K3", "--config_path", str(path), "--trust_remote_code", "True"]) == 0
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    assert main(["eval", "--model_path", str(tiny_k3_checkpoint), "--quant_path", str(out), "--dataset", str(text),
                 "--trust_remote_code", "True", "--max-windows", "1", "--seq-len", "64"]) == 0
    description = json.loads((out / "quant_model_description.json").read_text())
    return description, json.loads((out / "config.json").read_text())["text_config"]


def test_mtp_float_keeps_every_mtp_linear_float_and_quantizes_the_rest(tiny_k3_checkpoint, tmp_path):
    description, config = quantized(tiny_k3_checkpoint, tmp_path, "float")
    mtp = {k: v for k, v in description.items() if MTP in k and k.endswith(".weight") and isinstance(v, str)}
    assert mtp and set(mtp.values()) == {"FLOAT"}
    assert description["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"] == "W4A8_DYNAMIC"
    assert config["num_nextn_predict_layers"] == 1


def test_mtp_drop_leaves_the_mtp_layer_out_of_the_output_and_the_config(tiny_k3_checkpoint, tmp_path):
    description, config = quantized(tiny_k3_checkpoint, tmp_path, "drop")
    assert not [k for k in description if MTP in k or ".mtp_block." in k]
    assert description["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"] == "W4A8_DYNAMIC"
    assert config["num_nextn_predict_layers"] == 0
