"""Every tensor of a generated Kimi-K3 checkpoint is a name vLLM 0.33's Kimi-K3 loads, and every parameter vLLM's
model builds is in the checkpoint.

Reference: vLLM 0.33.0's `KimiK3ForConditionalGeneration.load_weights` and `KimiK3MTP.load_weights`, whose rules
are written down below with the file and line they come from (paths under `vllm/` of the vllm-0.33.0 wheel; the
extraction is docs/dev/facts/kimi_k3_in_vllm_0.33.md). The vLLM parameter set is written from the vLLM modules'
constructors, not from our model, so a name our stand-in invents has nothing to match. Exact string equality; no
tolerance.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

# models/kimi_k3/nvidia/model.py:1584-1590 (hf_to_vllm_mapper)
MAPPER_PREFIXES = (("language_model.layers.", "language_model.model.layers."),
                   ("mm_projector.proj.0", "mm_projector.linear_1"),
                   ("mm_projector.proj.2", "mm_projector.linear_2"))


def stacked_params_mapping(cfg: dict) -> list[tuple[str, str, int]]:
    """(param, checkpoint substring, shard id): models/kimi_k3/nvidia/model.py:1252-1283."""
    full_rank = bool(cfg["linear_attn_config"].get("use_full_rank_gate"))
    beta = 5 if full_rank else 3  # model.py:1253-1256
    out = [(".in_proj_qkvgfab", ".q_proj", 0), (".in_proj_qkvgfab", ".k_proj", 1), (".in_proj_qkvgfab", ".v_proj", 2),
           (".in_proj_qkvgfab", ".b_proj", beta), (".in_proj_qkvgfab", ".f_a_proj", 4),
           (".conv1d", ".q_conv1d", 0), (".conv1d", ".k_conv1d", 1), (".conv1d", ".v_conv1d", 2),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
    if full_rank:
        out.append((".in_proj_qkvgfab", ".g_proj", 3))
    if cfg.get("q_lora_rank") is not None and cfg.get("mla_use_output_gate"):
        out += [(".fused_qkv_a_g_proj", ".q_a_proj", 0), (".fused_qkv_a_g_proj", ".kv_a_proj_with_mqa", 1),
                (".fused_qkv_a_g_proj", ".g_proj", 2)]
    elif cfg.get("q_lora_rank") is not None:
        out += [(".fused_qkv_a_proj", ".q_a_proj", 0), (".fused_qkv_a_proj", ".kv_a_proj_with_mqa", 1)]
    return out


def layer_params(cfg: dict, idx: int, attn_res: bool) -> set[str]:
    """vLLM's parameters of KimiDecoderLayer `idx` (relative names)."""
    kda = (idx + 1) in cfg["linear_attn_config"]["kda_layers"]  # configs/kimi_linear.py:157-161 (1-indexed)
    moe = cfg.get("num_experts") is not None and idx >= cfg.get("first_k_dense_replace", 0) \
        and idx % cfg.get("moe_layer_freq", 1) == 0  # model.py:701-706
    out = {"input_layernorm.weight", "post_attention_layernorm.weight"}  # model.py:791-794
    if attn_res:  # model.py:804-821
        out |= {"self_attention_res_norm.weight", "self_attention_res_proj.weight", "mlp_res_norm.weight",
                "mlp_res_proj.weight"}
    a = "self_attn."
    if kda:  # kda.py:634-884 (Kimi-K3) / gdn kimi_gdn_linear_attn.py:213-311 (Kimi-Linear)
        out |= {a + n for n in ("in_proj_qkvgfab.weight", "f_b_proj.weight", "conv1d.weight", "A_log", "dt_bias",
                                "o_norm.weight", "o_proj.weight")}
        if not cfg["linear_attn_config"].get("use_full_rank_gate"):
            out |= {a + "g_a_proj.weight", a + "g_b_proj.weight"}
    else:  # mla.py:217-303
        out |= {a + n for n in ("kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")}
        if cfg.get("q_lora_rank") is not None:
            fused = "fused_qkv_a_g_proj" if cfg.get("mla_use_output_gate") else "fused_qkv_a_proj"
            out |= {a + f"{fused}.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"}
        else:
            out |= {a + "q_proj.weight", a + "kv_a_proj_with_mqa.weight"}
            if cfg.get("mla_use_output_gate"):
                out.add(a + "g_proj.weight")
    if moe:  # model.py:437-500; routed_experts.py:1219-1289 (compressed-tensors MXFP4 expert params)
        m = "block_sparse_moe."
        out |= {m + n for n in ("gate.weight", "gate.e_score_correction_bias", "experts.routed_experts.w13_weight_packed",
                                "experts.routed_experts.w13_weight_scale", "experts.routed_experts.w2_weight_packed",
                                "experts.routed_experts.w2_weight_scale")}
        if cfg.get("num_shared_experts") is not None:  # model.py:449-468
            out |= {m + "shared_experts.gate_up_proj.weight", m + "shared_experts.down_proj.weight"}
        if cfg.get("routed_expert_hidden_size") is not None:
            out |= {m + "routed_expert_down_proj.weight", m + "routed_expert_up_proj.weight"}
            if cfg.get("latent_moe_use_norm"):
                out.add(m + "routed_expert_norm.weight")
    else:
        out |= {"mlp.gate_up_proj.weight", "mlp.down_proj.weight"}  # model.py:241-259
    return out


def vllm_params(config: dict) -> set[str]:
    """Every parameter of vLLM's KimiK3ForConditionalGeneration plus its KimiK3MTP drafter (`mtp.` prefix)."""
    cfg, vc = config["text_config"], config["vision_config"]
    n, attn_res = cfg["num_hidden_layers"], cfg.get("attn_res_block_size") is not None
    lm = "language_model."
    out = {lm + "model.embed_tokens.weight", lm + "model.norm.weight", lm + "lm_head.weight"}  # model.py:969-1004,1421
    if attn_res:  # model.py:1005-1015
        out |= {lm + "model.output_attn_res_norm.weight", lm + "model.output_attn_res_proj.weight"}
    for i in range(n):
        out |= {f"{lm}model.layers.{i}.{p}" for p in layer_params(cfg, i, attn_res)}
    # vision tower: no custom loader, names as built (kimi_k25_vit.py:213-565)
    v = "vision_tower."
    out |= {v + "patch_embed.proj.weight", v + "patch_embed.pos_emb.weight", v + "encoder.final_layernorm.weight"}
    for j in range(vc["vt_num_hidden_layers"]):
        out |= {f"{v}encoder.blocks.{j}.{p}" for p in ("norm0.weight", "norm1.weight", "wqkv.weight", "wo.weight",
                                                      "mlp.fc0.weight", "mlp.fc1.weight")}
    out |= {"mm_projector.linear_1.weight", "mm_projector.linear_2.weight", "mm_projector.post_norm.weight"}
    # MTP drafter (mtp.py:71-173): its decoder block runs without attention residuals (mtp.py:96-106); its
    # model.embed_tokens is the target's at run time (spec_decode/llm_base_proposer.py:1466-1503), not listed
    for k in range(cfg.get("num_nextn_predict_layers", 0)):
        i = n + k
        out |= {f"mtp.model.layers.{i}.{p}" for p in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                     "shared_head.norm.weight", "shared_head.head.weight")}
        out |= {f"mtp.model.layers.{i}.mtp_block.{p}" for p in layer_params(cfg, i, attn_res=False)}
    return out


def load(names: list[str], config: dict) -> dict[str, set]:
    """vLLM param -> the set of (shard id / expert, shard) loaded into it, applying load_weights' rules."""
    cfg = config["text_config"]
    n, n_mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    stacked = stacked_params_mapping(cfg)
    params = vllm_params(config)
    loaded: dict[str, set] = {}

    def put(param: str, shard: object, name: str) -> None:
        assert param in params, f"checkpoint tensor {name} loads into {param}, which vLLM's model does not have"
        assert shard not in loaded.setdefault(param, set()), f"{name}: shard {shard} of {param} loaded twice"
        loaded[param].add(shard)

    def text_rules(name: str, base: str) -> None:
        """model.py:1330-1397 (main model) / mtp.py:332-397 (drafter): stacked params (first match whose rewritten
        name is a param), then the expert mapping, then a plain load."""
        m = re.search(r"experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale)$", name)
        if m:  # model.py:1293-1302, 1356-1376; w1/w3 -> w13 shards 0/1 (routed_experts.py:346-349)
            e, w, kind = int(m.group(1)), m.group(2), m.group(3)
            assert e < cfg["num_experts"], name
            target = "w13_" if w in ("w1", "w3") else "w2_"
            put(base + name[: m.start()] + f"experts.routed_experts.{target}{kind}", (e, w), name)
            return
        for param, sub, shard in stacked:
            if sub in name and base + name.replace(sub, param) in params:
                put(base + name.replace(sub, param), shard, name)
                return
        put(base + name, None, name)

    for name in names:
        for old, new in MAPPER_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
        if name.startswith(("vision_tower.", "mm_projector.")):
            put(name, None, name)
            continue
        assert name.startswith("language_model."), f"{name}: not under language_model./vision_tower./mm_projector."
        rest = name[len("language_model."):]
        mtp = re.match(r"model\.layers\.(\d+)\.(.*)$", rest)
        if mtp and int(mtp.group(1)) >= n:  # main loader skips layers.{N+i}. (model.py:1323-1325)
            idx, tail = int(mtp.group(1)), mtp.group(2)
            assert idx < n + n_mtp, f"{name}: layer {idx} is neither a decoder nor an MTP layer"
            # mtp.py:426-457: enorm/hnorm/eh_proj/shared_head stay, the rest goes into the mtp_block
            if tail.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head"):
                put(f"mtp.model.layers.{idx}.{tail}", None, name)
            else:
                text_rules(tail, f"mtp.model.layers.{idx}.mtp_block.")
            continue
        if rest == "lm_head.weight":
            put(name, None, name)
            continue
        text_rules(rest, "language_model.")
    return loaded


def expected_shards(param: str, config: dict) -> set:
    cfg = config["text_config"]
    if "routed_experts.w13_" in param:
        return {(e, w) for e in range(cfg["num_experts"]) for w in ("w1", "w3")}
    if "routed_experts.w2_" in param:
        return {(e, "w2") for e in range(cfg["num_experts"])}
    shards = {p: set() for p, _, _ in stacked_params_mapping(cfg)}
    for p, _, shard in stacked_params_mapping(cfg):
        shards[p].add(shard)
    for p, ids in shards.items():
        if param.endswith(p + ".weight"):
            return ids
    return {None}


@pytest.fixture(scope="module")
def checkpoint(tiny_k3_checkpoint: Path) -> tuple[list[str], dict]:
    index = json.loads((tiny_k3_checkpoint / "model.safetensors.index.json").read_text())
    return sorted(index["weight_map"]), json.loads((tiny_k3_checkpoint / "config.json").read_text())


def test_every_checkpoint_tensor_is_a_name_vllm_kimi_k3_loads(checkpoint):
    names, config = checkpoint
    loaded = load(names, config)  # asserts per tensor inside
    assert loaded


def test_every_vllm_kimi_k3_parameter_is_in_the_checkpoint_with_all_its_shards(checkpoint):
    names, config = checkpoint
    loaded = load(names, config)
    missing = sorted(vllm_params(config) - set(loaded))
    assert not missing, f"vLLM parameters with no checkpoint tensor: {missing[:5]}"
    for param, shards in loaded.items():
        want = expected_shards(param, config)
        assert shards == want, f"{param}: loaded shards {sorted(map(str, shards))}, vLLM needs {sorted(map(str, want))}"


def test_tiny_preset_exercises_every_kimi_k3_feature(checkpoint):
    """The names test only means something if the tiny preset has every feature vLLM's loader branches on."""
    _, config = checkpoint
    cfg = config["text_config"]
    assert cfg["attn_res_block_size"] and cfg["hidden_act"] == "situ" and cfg["activation_situ_linear_beta"]
    assert cfg["latent_moe_use_norm"] and cfg["routed_expert_hidden_size"]
    assert cfg["q_lora_rank"] and cfg["mla_use_output_gate"] and cfg["mla_use_nope"]
    assert cfg["linear_attn_config"]["use_full_rank_gate"] and cfg["num_nextn_predict_layers"] >= 1
    assert cfg["first_k_dense_replace"] >= 1 and config["vision_config"]["mm_projector_type"] == "patchmergerv2"


@pytest.mark.parametrize("old,new", [("routed_expert_down_proj", "latent_down_proj"),  # the pre-release stand-in
                                     ("vision_tower.encoder.blocks.", "vision_tower.blocks."),
                                     ("language_model.model.layers.4.", "language_model.model.layers.9.")])
def test_a_name_vllm_does_not_build_is_refused(checkpoint, old, new):
    """The rules above can fail: a renamed tensor matches no vLLM parameter (or no layer)."""
    names, config = checkpoint
    renamed = [n.replace(old, new, 1) for n in names]
    assert renamed != names
    with pytest.raises(AssertionError):
        load(renamed, config)
