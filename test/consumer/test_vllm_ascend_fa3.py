"""Our W4A8C8 outputs' FA3 tensors through vllm-ascend 0.23.0.post1's own FA-quant code (run as shipped on CPU):
the description turns FA quant on for exactly the MLA layers, the attention lookup gives its FAKQuant scheme, and
the scheme's parameters load our tensors and derive the K-cache quant scale from them.

Reference: the model's config (MLA layers: 1-based `linear_attn_config.full_attn_layers`, plus the MTP layers),
and our own reader's stored scales (bitwise). The attention prefix is vLLM 0.33's (`...layers.{i}.self_attn`:
its Kimi MLA module is the attention layer, so `self_attn.fa_k.scale` names its parameter).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from msmodelslim.serving.ascendv1 import AscendV1Reader

from . import vllm_ascend_cpu as ascend

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)


def _model(out: Path) -> tuple[dict, str, str]:
    config = json.loads((out / "config.json").read_text())
    if "text_config" in config:
        return config["text_config"], config.get("model_type", "kimi_k3"), "language_model."
    return config, "kimi_linear", ""


def _mla_layers(text: dict) -> list[int]:
    layers = [i for i in range(text["num_hidden_layers"]) if i + 1 in text["linear_attn_config"]["full_attn_layers"]]
    return layers + list(range(text["num_hidden_layers"], text["num_hidden_layers"]
                               + text.get("num_nextn_predict_layers", 0)))


def _config(vllm_ascend, out: Path):
    text, model_type, _ = _model(out)
    config = vllm_ascend.AscendModelSlimConfig(json.loads((out / "quant_model_description.json").read_text()))
    ascend.set_vllm_config(model_type, config, kv_lora_rank=text["kv_lora_rank"],
                           qk_rope_head_dim=text["qk_rope_head_dim"])
    return config


@pytest.mark.parametrize("model", ["mini", "tiny_k3"])
def test_fa_quant_is_on_for_exactly_the_mla_layers(vllm_ascend, outputs, model):
    if (model, "w4a8c8") not in outputs:
        pytest.skip("kimi-linear-mini not available")
    out = outputs[(model, "w4a8c8")]
    config = _config(vllm_ascend, out)
    assert config.enable_fa_quant and not config.enable_c8_quant
    assert set(config.kvcache_quant_layers) == set(_mla_layers(_model(out)[0]))


@pytest.mark.parametrize("model", ["mini", "tiny_k3"])
def test_every_mla_attention_loads_our_scales_into_the_fakquant_scheme(vllm_ascend, outputs, model):
    if (model, "w4a8c8") not in outputs:
        pytest.skip("kimi-linear-mini not available")
    out = outputs[(model, "w4a8c8")]
    text, _, lm = _model(out)
    config = _config(vllm_ascend, out)
    reader = AscendV1Reader(out)
    registered = {cls: name for (name, kind), cls in vllm_ascend.SCHEME_REGISTRY.items() if kind == "attention"}
    checked = 0
    for index in _mla_layers(text):
        if index >= text["num_hidden_layers"]:
            continue  # the MTP drafter's attention: its own model class, not looked up here
        prefix = f"{lm}model.layers.{index}.self_attn"
        layer = ascend.AttentionLayerBase()
        layer.num_heads, layer.num_kv_heads = text["num_attention_heads"], 1
        method = config.get_quant_method(layer, prefix)
        assert registered[type(method.quant_method)] == "FAKQuant"
        method.create_weights(layer)
        for name, param in layer.named_parameters():  # fa_q.scale, fa_q.offset, ... as vLLM's loader feeds them
            stored = reader.get_stored(f"{prefix}.{name}")
            param.weight_loader(param, stored)
            assert torch.equal(param.data, stored.to(param.dtype)), name
        method.process_weights_after_loading(layer)
        fa_k = reader.get_stored(f"{prefix}.fa_k.scale").to(layer.fa_k.scale.dtype).float()
        assert layer.quant_kscale.shape == (1, text["kv_lora_rank"])
        assert torch.equal(layer.quant_kscale, (1.0 / fa_k).expand(1, text["kv_lora_rank"]))
        checked += 1
    assert checked >= 1
