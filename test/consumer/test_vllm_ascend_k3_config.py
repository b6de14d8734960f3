"""Our Kimi-K3 outputs' config.json as vllm-ascend's own Kimi-K3 class checks it (branch releases/v0.26.0rc,
`vllm_ascend/models/kimi_k3.py` at cf0baa38df; the checks run when the class is built, so a config that fails one
cannot be served). Facts, file:line: the SiTU activation and `routed_expert_hidden_size` (:703-706), the NoPE-only
MLA with its output gate (:810-813), `attn_res_block_size` (:998-999), the vision tower's RMSNorm, `sd2_tpool` merge
and `patchmergerv2` projector (:1464-1465, :1658-1659, :1673-1674), vision heads dividing `qkv_hidden_size` (:1460),
and the optional bounded gate (`linear_attn_config.gate_lower_bound`, a negative number when present; vLLM 0.33).
Reference: those rules, applied to the config.json of every tiny-K3 output the consumer tests build."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # the outputs are whole quantization runs


def k3_class_refusals(config: dict) -> list[str]:
    text, vision = config["text_config"], config["vision_config"]
    checks = {
        "hidden_act is situ": text.get("hidden_act") == "situ",
        "routed_expert_hidden_size set": text.get("routed_expert_hidden_size") is not None,
        "mla_use_nope true and mla_use_rope false": bool(text.get("mla_use_nope")) and not text.get("mla_use_rope"),
        "mla_use_output_gate true": bool(text.get("mla_use_output_gate")),
        "attn_res_block_size set": text.get("attn_res_block_size") is not None,
        "vision norm_type rmsnorm": vision.get("norm_type") == "rmsnorm",
        "merge_type sd2_tpool": vision.get("merge_type") == "sd2_tpool",
        "mm_projector_type patchmergerv2": vision.get("mm_projector_type") == "patchmergerv2",
        "vision heads divide qkv_hidden_size": vision["qkv_hidden_size"] % vision["vt_num_attention_heads"] == 0,
        "gate_lower_bound absent or negative":
            (text.get("linear_attn_config") or {}).get("gate_lower_bound", -1.0) < 0,
    }
    return [name for name, ok in checks.items() if not ok]


def test_every_kimi_k3_output_config_passes_vllm_ascends_kimi_k3_class_checks(outputs):
    k3 = {key: out for key, out in outputs.items() if key[0] == "tiny_k3"}
    assert len(k3) >= 6
    for key, out in sorted(k3.items()):
        assert k3_class_refusals(json.loads((out / "config.json").read_text())) == [], key


def test_the_checks_refuse_a_config_without_the_nope_flag(outputs):
    config = json.loads((outputs[("tiny_k3", "w4a8c8")] / "config.json").read_text())
    config["text_config"].pop("mla_use_nope", None)
    assert k3_class_refusals(config) == ["mla_use_nope true and mla_use_rope false"]
