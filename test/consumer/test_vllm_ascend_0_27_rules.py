"""Our outputs written for the default serving target, vllm-ascend 0.27, against that engine's load rules as read in
docs/dev/facts/vllm_ascend_0.27_kimi_k3.md (written out again here, not imported from msmodelslim/serving/): no
W4A8_DYNAMIC outside the routed experts and none per group; each KDA attention's six packed shards of one type, or
q/k/v of one quantized type with g/f_a/b FLOAT; every MTP layer's linears and lm_head described (MTP blocks are
built with the quant config); a rotated residual's `global_rotation` file named and present; no FA3 scales. Exact:
strings.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from safetensors import safe_open

pytestmark = pytest.mark.slow  # the consumer tests' outputs

KDA = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")
EXPERT = re.compile(r"\.experts(\.\d+\.w[123])?\.")  # an expert's tensors or its layer's key


def kda_types_load(types: dict[str, str]) -> bool:
    """`types`: the shards the attention has (a low-rank gate, Kimi-Linear's g_a/g_b, is no shard of the layer)."""
    if len(set(types.values())) == 1:
        return True
    qkv = {types[p] for p in KDA[:3]}
    return len(qkv) == 1 and qkv != {"FLOAT"} and {types[p] for p in KDA[3:] if p in types} == {"FLOAT"}


def default_target_outputs(outputs: dict) -> dict:
    chosen = {}
    for key, out in outputs.items():
        practice = yaml.safe_load(next(out.glob("*_best_practice.yaml")).read_text())
        if practice["spec"].get("target") in (None, "vllm-ascend-0.27"):
            chosen[key] = out
    return chosen


def test_every_output_for_0_27_holds_what_its_loader_requires(outputs):
    checked = default_target_outputs(outputs)
    assert {model for model, _ in checked} >= {"tiny_k3"}
    for (model, quant_type), out in checked.items():
        where = f"{model} {quant_type}"
        description = json.loads((out / "quant_model_description.json").read_text())
        config = json.loads((out / "config.json").read_text())
        text = config.get("text_config", config)
        weights = json.loads((out / "quant_model_weights.safetensors.index.json").read_text())["weight_map"]
        for name, kind in description.items():
            if kind == "W4A8_DYNAMIC":
                assert EXPERT.search(name), f"{where}: {name} is W4A8_DYNAMIC outside the routed experts"
        if "W4A8_DYNAMIC" in description.values():
            assert description["group_size"] == 0, f"{where}: W4A8 MoE per group"
        attentions = {k[:-len(".b_proj.weight")] for k in description if k.endswith(".self_attn.b_proj.weight")}
        for attention in attentions:
            types = {p: description[f"{attention}.{p}.weight"] for p in KDA if f"{attention}.{p}.weight" in description}
            assert kda_types_load(types), f"{where}: {attention} {types}"
        assert any(k.endswith("lm_head.weight") for k in description), where
        # its cache-scale mapper runs twice: no FA3 scale would load (bench/consumer_k3.py)
        assert "fa_quant_type" not in description and not any(".fa_" in n for n in weights), where
        first, count = text["num_hidden_layers"], text.get("num_nextn_predict_layers", 0)
        mtp = [n for n in weights if any(f"layers.{first + k}." in n for k in range(count))]
        assert bool(mtp) == bool(count) and all(n in description for n in mtp), where
        rotation = description["optional"].get("quarot", {}).get("rotation_map", {}).get("global_rotation")
        if rotation is not None:
            with safe_open(str(out / rotation), framework="pt") as f:
                assert "global_rotation" in f.keys(), where
