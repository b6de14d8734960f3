"""A second model family is cheap: a plain dense Llama (transformers' LlamaForCausalLM, random weights) with the
small adapter of llama_adapter.py, registered the way a user registers one (a config.ini group), quantizes end to
end through `msmodelslim quant` with the W8A8 processors.

References: the description's scheme per tensor kind (exact strings), and each written W8A8 weight against the
source weight: per output row, |W - q * scale| (float32) <= scale / 2 with scale = max|W_row| / 127 (min/max int8 rounding;
plus 1e-6 for float32 arithmetic); the float tensors are the source's bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from msmodelslim.app import quant as quant_app
from msmodelslim.app.quant import QuantArgs, quant
from msmodelslim.model.registry import load_registry
from msmodelslim.serving.ascendv1 import AscendV1Reader

pytestmark = pytest.mark.slow  # a whole quantization run

REPO = Path(__file__).resolve().parents[2]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PRACTICE = """\
apiversion: modelslim_v1
metadata:
  config_id: llama_w8a8_test
  score: 10
  verified_model_types: [Llama-test]
  label: {{w_bit: 8, a_bit: 8}}
spec:
  process:
    - type: linear_quant
      qconfig:
        act: {{scope: per_token, dtype: int8, symmetric: true, method: minmax}}
        weight: {{scope: per_channel, dtype: int8, symmetric: true, method: minmax}}
      include: ["*_proj"]
  dataset: {dataset}
  max_samples: 3
  max_seq_len: 32
  save: [{{type: ascendv1_saver}}]
"""
REGISTRY = """\
[ModelAdapter]
Llama = Llama-test

[ModelAdapterEntryPoints]
Llama = architecture.llama_adapter:LlamaModelAdapter
"""


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "example" / "multimodal_vlm" / "Kimi-K3"))
    from make_checkpoint import train_tokenizer

    out = tmp_path_factory.mktemp("llama") / "Llama-tiny"
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    train_tokenizer(config.vocab_size, out)
    return out


def test_a_dense_llama_quantizes_w8a8_end_to_end_with_a_small_adapter(llama_checkpoint, tmp_path, monkeypatch):
    records = tmp_path / "calib.jsonl"
    records.write_text("".join(json.dumps({"text": f"Sample {i}: the quick brown fox jumps over the lazy dog."})
                               + "\n" for i in range(3)))
    practice = tmp_path / "llama_w8a8.yaml"
    practice.write_text(PRACTICE.format(dataset=records))
    registry = tmp_path / "config.ini"
    registry.write_text(REGISTRY)
    monkeypatch.setattr(quant_app, "load_registry", lambda: load_registry(registry))

    out = tmp_path / "Llama-tiny-w8a8"
    quant(QuantArgs(model_path=str(llama_checkpoint), save_path=str(out), model_type="Llama-test", device="cpu",
                    config_path=str(practice)))

    description = json.loads((out / "quant_model_description.json").read_text())
    source = load_file(str(llama_checkpoint / "model.safetensors"))
    linears = [f"model.layers.{i}.{part}.{name}.weight" for i in range(2)
               for part, names in (("self_attn", LINEARS[:4]), ("mlp", LINEARS[4:])) for name in names]
    assert {description[n] for n in linears} == {"W8A8_DYNAMIC"}
    floats = [n for n in source if n not in linears]
    assert {description[n] for n in floats} == {"FLOAT"}
    reader = AscendV1Reader(out)
    for name in linears:
        w = source[name].float()
        q, scale = reader.quantized_weight(name.removesuffix(".weight"))
        error = (q.float() * scale - w).abs().amax(dim=1)
        assert bool((error <= w.abs().amax(dim=1) / 127 / 2 + 1e-6).all()), name
    for name in floats:
        assert torch.equal(reader.get(name), source[name]), name
