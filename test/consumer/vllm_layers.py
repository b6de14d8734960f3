"""The layers vLLM builds for Kimi-Linear / Kimi-K3 and looks up in quant_model_description.json: data read off
vLLM 0.23.0 (`vllm/model_executor/models/kimi_linear.py`), vLLM 0.33.0 (`vllm/models/kimi_k3/nvidia/model.py`,
`mla.py`, `kda.py`; `kimi_gdn_linear_attn.py` for Kimi-Linear's KDA) and vllm-ascend's own Kimi-K3 class of branch
`releases/v0.26.0rc` (the only consumer that serves Kimi-K3 on Ascend), file:line in the comments.

A row is (prefix template, layer kind, which layers have it, condition): `{lm}` is the language model's prefix
("" for KimiLinearForCausalLM, "language_model." inside KimiK3ForConditionalGeneration, model.py:1674-1680), `{i}`
the decoder layer. Layers built with quant_config=None (embed_tokens, the router `gate`, conv1d, the attention
residual projections) are never looked up and are not listed.
"""

from __future__ import annotations

V023 = {
    "version": "vllm 0.23.0",
    # no class of kimi_linear.py declares packed_modules_mapping (kimi_linear.py:556-558): vllm-ascend falls back
    # to vLLM's mapping, which stays {} (layers/quantization/base_config.py:76)
    "packed_modules_mapping": {},
    "rows": [
        ("{lm}model.layers.{i}.self_attn.q_proj", "linear", "kda", None),        # gdn:120-126
        ("{lm}model.layers.{i}.self_attn.k_proj", "linear", "kda", None),        # gdn:127-133
        ("{lm}model.layers.{i}.self_attn.v_proj", "linear", "kda", None),        # gdn:134-140
        ("{lm}model.layers.{i}.self_attn.f_a_proj", "linear", "kda", None),      # gdn:142-148
        ("{lm}model.layers.{i}.self_attn.f_b_proj", "linear", "kda", None),      # gdn:150-156
        ("{lm}model.layers.{i}.self_attn.b_proj", "linear", "kda", None),        # gdn:163-169
        ("{lm}model.layers.{i}.self_attn.g_a_proj", "linear", "kda", None),      # gdn:205-211
        ("{lm}model.layers.{i}.self_attn.g_b_proj", "linear", "kda", None),      # gdn:212-218
        ("{lm}model.layers.{i}.self_attn.o_proj", "linear", "kda", None),        # gdn:220-226
        ("{lm}model.layers.{i}.self_attn.kv_a_proj_with_mqa", "linear", "mla", None),  # kimi_linear.py:216-222
        ("{lm}model.layers.{i}.self_attn.q_proj", "linear", "mla", None),              # :223-229 (no q-LoRA, :214)
        ("{lm}model.layers.{i}.self_attn.kv_b_proj", "linear", "mla", None),           # :234-240
        ("{lm}model.layers.{i}.self_attn.o_proj", "linear", "mla", None),              # :241-247
        ("{lm}model.layers.{i}.mlp.gate_up_proj", "linear", "dense", None),            # :75-81
        ("{lm}model.layers.{i}.mlp.down_proj", "linear", "dense", None),               # :82-89
        ("{lm}model.layers.{i}.block_sparse_moe.shared_experts.gate_up_proj", "linear", "moe", "shared"),  # :139-148
        ("{lm}model.layers.{i}.block_sparse_moe.shared_experts.down_proj", "linear", "moe", "shared"),
        ("{lm}model.layers.{i}.block_sparse_moe.experts", "moe", "moe", None),         # FusedMoE :152-167
        ("{lm}lm_head", "lm_head", "top", None),                                       # :569-575
    ],
}

V033 = {
    "version": "vllm 0.33.0",
    # KimiLinearModel.packed_modules_mapping (model.py:934-941), put into the quant config by SupportsQuant
    # (models/interfaces.py:1298-1299); the K3 wrapper adds none
    "packed_modules_mapping": {
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvgfab": ["q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj"],
        "conv1d": ["q_conv1d", "k_conv1d", "v_conv1d"],
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
        "fused_qkv_a_g_proj": ["q_a_proj", "kv_a_proj_with_mqa", "g_proj"],
    },
    # KimiK3ForConditionalGeneration.hf_to_vllm_mapper (model.py:1584-1590), applied to the description keys
    # through vllm-ascend's apply_vllm_mapper (interfaces.py:1296-1297, modelslim_config.py:511-543)
    "k3_prefix_mapper": {"language_model.layers.": "language_model.model.layers.",
                         "mm_projector.proj.0": "mm_projector.linear_1", "mm_projector.proj.2": "mm_projector.linear_2"},
    "rows": [
        ("{lm}model.layers.{i}.self_attn.in_proj_qkvgfab", "linear", "kda", None),   # kda.py:643-662, gdn:218-226
        ("{lm}model.layers.{i}.self_attn.f_b_proj", "linear", "kda", None),          # kda.py:664-670
        ("{lm}model.layers.{i}.self_attn.o_proj", "linear", "kda", None),            # kda.py:878-884
        ("{lm}model.layers.{i}.self_attn.g_a_proj", "linear", "kda", "low_rank_gate"),  # gdn:290-296
        ("{lm}model.layers.{i}.self_attn.g_b_proj", "linear", "kda", "low_rank_gate"),  # gdn:297-303
        ("{lm}model.layers.{i}.self_attn.fused_qkv_a_g_proj", "linear", "mla", "q_lora_gate"),     # mla.py:220-231
        ("{lm}model.layers.{i}.self_attn.fused_qkv_a_proj", "linear", "mla", "q_lora_no_gate"),    # mla.py:240-250
        ("{lm}model.layers.{i}.self_attn.q_b_proj", "linear", "mla", "q_lora"),                    # mla.py:253-259
        ("{lm}model.layers.{i}.self_attn.q_proj", "linear", "mla", "no_q_lora"),                   # mla.py:263-269
        ("{lm}model.layers.{i}.self_attn.kv_a_proj_with_mqa", "linear", "mla", "no_q_lora"),       # mla.py:270-276
        ("{lm}model.layers.{i}.self_attn.g_proj", "linear", "mla", "no_q_lora_gate"),              # mla.py:277-285
        ("{lm}model.layers.{i}.self_attn.kv_b_proj", "linear", "mla", None),                       # mla.py:288-294
        ("{lm}model.layers.{i}.self_attn.o_proj", "linear", "mla", None),                          # mla.py:297-303
        ("{lm}model.layers.{i}.mlp.gate_up_proj", "linear", "dense", None),                        # model.py:241-248
        ("{lm}model.layers.{i}.mlp.down_proj", "linear", "dense", None),                           # model.py:249-259
        ("{lm}model.layers.{i}.block_sparse_moe.shared_experts.gate_up_proj", "linear", "moe", "shared"),  # :449-468
        ("{lm}model.layers.{i}.block_sparse_moe.shared_experts.down_proj", "linear", "moe", "shared"),
        ("{lm}model.layers.{i}.block_sparse_moe.routed_expert_down_proj", "linear", "moe", "latent"),  # :477-483
        ("{lm}model.layers.{i}.block_sparse_moe.routed_expert_up_proj", "linear", "moe", "latent"),    # :494-500
        ("{lm}model.layers.{i}.block_sparse_moe.experts", "moe", "moe", None),  # RoutedExperts, routed_experts.py:237
        ("{lm}lm_head", "lm_head", "top", None),                                # model.py:1421-1427
    ],
}

V026RC = {
    "version": "vllm-ascend releases/v0.26.0rc",
    # vllm-ascend's own Kimi-K3 class (vllm_ascend/models/kimi_k3.py at cf0baa38df; KDA in ops/kimi_kda.py): its
    # packed_modules_mapping (kimi_k3.py:1261-1266), the same WeightsMapper as vLLM's (:453-459). Its lookup code
    # (quantization/modelslim_config.py) differs from 0.23.0.post1's only in other models' tables and the MoE class
    # check, so the 0.23 lookup runs these layers as the branch would.
    "packed_modules_mapping": {
        "fused_qkv": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "experts": ["experts.0.w1", "experts.0.w3", "experts.0.w2"],
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
    },
    "k3_prefix_mapper": V033["k3_prefix_mapper"],
    "rows": [
        ("{lm}model.layers.{i}.self_attn.fused_qkv", "linear", "kda", None),        # kimi_kda.py:179-190
        ("{lm}model.layers.{i}.self_attn.f_a_proj", "linear", "kda", None),         # the vLLM base class's
        ("{lm}model.layers.{i}.self_attn.f_b_proj", "linear", "kda", None),         # separate linears (gdn rows
        ("{lm}model.layers.{i}.self_attn.b_proj", "linear", "kda", None),           # of V023)
        ("{lm}model.layers.{i}.self_attn.g_proj", "linear", "kda", "full_rank_gate"),  # kimi_kda.py:199-209
        ("{lm}model.layers.{i}.self_attn.g_a_proj", "linear", "kda", "low_rank_gate"),
        ("{lm}model.layers.{i}.self_attn.g_b_proj", "linear", "kda", "low_rank_gate"),
        ("{lm}model.layers.{i}.self_attn.o_proj", "linear", "kda", None),
        ("{lm}model.layers.{i}.self_attn.fused_qkv_a_proj", "linear", "mla", None),  # kimi_k3.py:829-834 (q-LoRA
        ("{lm}model.layers.{i}.self_attn.q_b_proj", "linear", "mla", None),          # and the output gate are
        ("{lm}model.layers.{i}.self_attn.kv_b_proj", "linear", "mla", None),         # required, :810-813)
        ("{lm}model.layers.{i}.self_attn.g_proj", "linear", "mla", None),            # :851-857
        ("{lm}model.layers.{i}.self_attn.o_proj", "linear", "mla", None),            # :858-864
        ("{lm}model.layers.{i}.mlp.gate_up_proj", "linear", "dense", None),          # KimiK3MLP :642-656
        ("{lm}model.layers.{i}.mlp.down_proj", "linear", "dense", None),
        ("{lm}model.layers.{i}.block_sparse_moe.shared_experts.gate_up_proj", "linear", "moe", "shared"),  # :745-756
        ("{lm}model.layers.{i}.block_sparse_moe.shared_experts.down_proj", "linear", "moe", "shared"),
        ("{lm}model.layers.{i}.block_sparse_moe.routed_expert_down_proj", "linear", "moe", "latent"),  # :723-739,
        ("{lm}model.layers.{i}.block_sparse_moe.routed_expert_up_proj", "linear", "moe", "latent"),    # ascend only
        ("{lm}model.layers.{i}.block_sparse_moe.experts", "moe", "moe", None),       # FusedMoE :758-781
        ("{lm}lm_head", "lm_head", "top", None),                                     # :1276-1281
        # the vision tower and projector keep the ascend quant config (:478, :514-522): looked up too
        ("vision_tower.encoder.blocks.{v}.wqkv", "linear", "vision", None),          # :1480-1488
        ("vision_tower.encoder.blocks.{v}.wo", "linear", "vision", None),            # :1490-1496
        ("vision_tower.encoder.blocks.{v}.mlp.fc0", "linear", "vision", None),       # :1422-1428
        ("vision_tower.encoder.blocks.{v}.mlp.fc1", "linear", "vision", None),       # :1430-1436
        ("mm_projector.linear_1", "linear", "top", None),                            # :1675-1681
        ("mm_projector.linear_2", "linear", "top", None),                            # :1682-1688
        # mm_projector.rot_proj is built with quant_config=None (:1694-1700): never looked up
    ],
}

V027 = {
    "version": "vllm-ascend 0.27 (PR #14454 at e4f0a9e5) on vLLM 0.27.1",
    # vLLM 0.27.1's KimiLinearModel.packed_modules_mapping (nvidia/model.py:1014-1019: no fused_qkv_a_g_proj) and
    # what vllm-ascend adds to it (quantization/modelslim_config.py:415-435: the experts, the KDA split)
    "packed_modules_mapping": {
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvgfab": ["q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"],
        "conv1d": ["q_conv1d", "k_conv1d", "v_conv1d"],
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
        "experts": ["experts.0.w1", "experts.0.w2", "experts.0.w3"],
        "in_proj_qkv": ["q_proj", "k_proj", "v_proj"],
        "in_proj_gfab": ["g_proj", "f_a_proj", "b_proj"],
    },
    "k3_prefix_mapper": V033["k3_prefix_mapper"],
    # vLLM 0.33's rows but the MLA's: q_a + kv_a fused with q-LoRA, the output gate a layer of its own (vLLM 0.27.1
    # models/kimi_k3/amd/linear.py:346-353, 404-411)
    "rows": [row for row in V033["rows"] if "fused_qkv_a" not in row[0] and not row[0].endswith("self_attn.g_proj")]
    + [("{lm}model.layers.{i}.self_attn.fused_qkv_a_proj", "linear", "mla", "q_lora"),
       ("{lm}model.layers.{i}.self_attn.g_proj", "linear", "mla", "mla_gate")],
}

# serving/fused.py's layout names -> the layers of that consumer class
LAYOUTS = {"vllm-ascend-0.23": V023, "vllm-ascend-0.26rc": V026RC, "vllm-0.33": V033, "vllm-ascend-0.27": V027}


def served_specs(out, multimodal: bool) -> list[dict]:
    """The consumer classes of the serving target an output was written for (its copied practice's `spec.target`,
    default the newest; serving/profiles.py), for this model's type."""
    import yaml

    from msmodelslim.serving.profiles import profile

    practice = yaml.safe_load(next(out.glob("*_best_practice.yaml")).read_text())
    layouts = profile(practice["spec"].get("target")).layouts_for("kimi_k3" if multimodal else "kimi_linear")
    return [LAYOUTS[name] for name in layouts]


def model_flags(text_config: dict) -> set[str]:
    """The row conditions a text config satisfies."""
    lac = text_config.get("linear_attn_config") or {}
    q_lora = text_config.get("q_lora_rank") is not None
    gate = bool(text_config.get("mla_use_output_gate"))
    flags = {"q_lora"} if q_lora else {"no_q_lora"}
    flags.add({(True, True): "q_lora_gate", (True, False): "q_lora_no_gate",
               (False, True): "no_q_lora_gate", (False, False): "no_q_lora_no_gate"}[(q_lora, gate)])
    if gate:
        flags.add("mla_gate")
    flags.add("full_rank_gate" if lac.get("use_full_rank_gate") else "low_rank_gate")
    if text_config.get("num_shared_experts"):
        flags.add("shared")
    if text_config.get("routed_expert_hidden_size"):
        flags.add("latent")
    return flags


def layer_kinds(text_config: dict) -> list[tuple[str, str]]:
    """(attention kind, MLP kind) per decoder layer, by vLLM's rules (kimi_linear.py config :157-161, model.py
    :701-706): KDA iff i+1 in kda_layers; MoE iff i >= first_k_dense_replace (moe_layer_freq 1)."""
    kda = set((text_config.get("linear_attn_config") or {}).get("kda_layers") or [])
    first_dense = int(text_config.get("first_k_dense_replace", 0))
    return [("kda" if i + 1 in kda else "mla", "moe" if i >= first_dense else "dense")
            for i in range(int(text_config["num_hidden_layers"]))]


def serving_layers(spec: dict, text_config: dict, lm: str, vision_blocks: int = 0) -> list[tuple[str, str]]:
    """(prefix, kind) of every layer vLLM looks up for this model (`vision_blocks`: the vision tower's blocks, for a
    model class that looks them up)."""
    flags = model_flags(text_config)
    out = []
    for i, (attn, mlp) in enumerate(layer_kinds(text_config)):
        for template, kind, applies, cond in spec["rows"]:
            if applies in (attn, mlp) and (cond is None or cond in flags):
                out.append((template.format(lm=lm, i=i), kind))
    out += [(t.format(v=v), k) for v in range(vision_blocks) for t, k, a, _ in spec["rows"] if a == "vision"]
    out += [(t.format(lm=lm), k) for t, k, a, _ in spec["rows"] if a == "top" and (lm or "{lm}" in t)]
    return out
