# Stand-in for the vendor's Kimi-K3 configuration file (remote code, loaded with trust_remote_code=True).
#
# Field names, defaults and the nesting follow the public Kimi-K3 implementation (vLLM 0.33.0,
# `vllm/transformers_utils/configs/kimi_k3.py` and `kimi_linear.py`): a `kimi_k3` config holding a Kimi-Linear
# `text_config` and a MoonViT `vision_config` with `vt_*` fields. Written in the classic `__init__` style so it
# loads under transformers 4.57 (the release's environment) and 5.x alike.
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class KimiLinearConfig(PretrainedConfig):
    """Kimi-Linear text model: hybrid KDA / NoPE-MLA attention, (latent) MoE, attention residuals, MTP layers."""

    model_type = "kimi_linear"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 4096,
        head_dim: int | None = None,
        intermediate_size: int = 11008,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        hidden_act: str = "silu",
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        moe_intermediate_size: int | None = None,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        num_experts: int | None = None,
        num_experts_per_token: int | None = None,
        num_shared_experts: int = 0,
        routed_scaling_factor: float = 1.0,
        first_k_dense_replace: int = 0,
        moe_layer_freq: int = 1,
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        q_lora_rank: int | None = None,
        kv_lora_rank: int | None = None,
        qk_nope_head_dim: int | None = None,
        qk_rope_head_dim: int | None = None,
        v_head_dim: int | None = None,
        mla_use_nope: bool = False,
        mla_use_output_gate: bool = False,
        num_nextn_predict_layers: int = 0,
        linear_attn_config: dict | None = None,
        attn_res_block_size: int | None = None,
        latent_moe_use_norm: bool = False,
        activation_situ_beta: float | None = None,
        activation_situ_linear_beta: float | None = None,
        max_position_embeddings: int = 4096,
        routed_expert_hidden_size: int | None = None,
        topk_method: str = "noaux_tc",
        **kwargs: Any,
    ) -> None:
        if moe_router_activation_func not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_router_activation_func must be 'softmax' or 'sigmoid', got "
                             f"{moe_router_activation_func!r}")
        if hidden_act not in ("silu", "situ"):
            raise ValueError(f"hidden_act must be 'silu' or 'situ', got {hidden_act!r}")
        if linear_attn_config is not None:
            for key in ("kda_layers", "full_attn_layers"):
                if linear_attn_config.get(key) is None:
                    raise ValueError(f"linear_attn_config.{key} is required")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_renormalize = moe_renormalize
        self.moe_router_activation_func = moe_router_activation_func
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.routed_scaling_factor = routed_scaling_factor
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.linear_attn_config = linear_attn_config
        self.attn_res_block_size = attn_res_block_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.max_position_embeddings = max_position_embeddings
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.topk_method = topk_method
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    # Layer indices below are 0-indexed (module indices); linear_attn_config lists are 1-indexed.
    def is_kda_layer(self, layer_idx: int) -> bool:
        return self.linear_attn_config is not None and (layer_idx + 1) in self.linear_attn_config["kda_layers"]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.is_moe and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    def get_text_config(self, *args: Any, **kwargs: Any) -> KimiLinearConfig:
        return self


class KimiK3VisionConfig(PretrainedConfig):
    """MoonViT (Kimi-K2.5 style) vision tower and the patchmergerv2 projector."""

    model_type = "kimi_k3_vision"
    base_config_key = "vision_config"

    def __init__(
        self,
        patch_size: int = 14,
        init_pos_emb_height: int = 64,
        init_pos_emb_width: int = 64,
        init_pos_emb_time: int = 4,
        pos_emb_type: str = "divided_fixed",
        vt_num_attention_heads: int = 12,
        vt_num_hidden_layers: int = 27,
        vt_hidden_size: int = 1024,
        vt_intermediate_size: int = 4096,
        merge_kernel_size: tuple[int, int] | list[int] = (2, 2),
        video_attn_type: str = "spatial_temporal",
        merge_type: str = "sd2_tpool",
        mm_projector_type: str = "patchmergerv2",
        mm_hidden_size: int | None = None,
        projector_hidden_act: str = "gelu",
        projector_ln_eps: float = 1e-5,
        qkv_hidden_size: int = 1536,
        norm_type: str = "rmsnorm",
        attn_bias: bool = False,
        patch_embed_proj_bias: bool = False,
        mlp_type: str = "mlp2",
        linear_bias: bool = False,
        activation_func: str = "gelu_pytorch_tanh",
        pos_emb_interpolation_mode: str = "bilinear",
        text_hidden_size: int = 2304,
        **kwargs: Any,
    ) -> None:
        for key, value, allowed in (("pos_emb_type", pos_emb_type, ("divided_fixed",)),
                                    ("mm_projector_type", mm_projector_type, ("patchmergerv2",)),
                                    ("norm_type", norm_type, ("rmsnorm",)), ("mlp_type", mlp_type, ("mlp2",)),
                                    ("merge_type", merge_type, ("sd2_tpool",))):
            if value not in allowed:
                raise ValueError(f"vision_config.{key}={value!r}: this model supports {allowed}")
        if qkv_hidden_size % vt_num_attention_heads:
            raise ValueError(f"vision_config.qkv_hidden_size {qkv_hidden_size} not divisible by "
                             f"vt_num_attention_heads {vt_num_attention_heads}")
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.pos_emb_type = pos_emb_type
        self.vt_num_attention_heads = vt_num_attention_heads
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.merge_kernel_size = tuple(int(v) for v in merge_kernel_size)
        self.video_attn_type = video_attn_type
        self.merge_type = merge_type
        self.mm_projector_type = mm_projector_type
        self.mm_hidden_size = vt_hidden_size if mm_hidden_size is None else mm_hidden_size
        self.projector_hidden_act = projector_hidden_act
        self.projector_ln_eps = projector_ln_eps
        self.qkv_hidden_size = qkv_hidden_size
        self.norm_type = norm_type
        self.attn_bias = attn_bias
        self.patch_embed_proj_bias = patch_embed_proj_bias
        self.mlp_type = mlp_type
        self.linear_bias = linear_bias
        self.activation_func = activation_func
        self.pos_emb_interpolation_mode = pos_emb_interpolation_mode
        self.text_hidden_size = text_hidden_size
        super().__init__(**kwargs)


class KimiK3Config(PretrainedConfig):
    """Kimi-K3: MoonViT vision tower + patchmergerv2 projector + Kimi-Linear language model."""

    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiLinearConfig, "vision_config": KimiK3VisionConfig}
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        text_config: dict | KimiLinearConfig | None = None,
        vision_config: dict | KimiK3VisionConfig | None = None,
        ignore_index: int = -100,
        media_placeholder_token_id: int = 163605,
        pad_token_id: int = 0,
        image_placeholder: str = "<|kimi_image_placeholder|>",
        **kwargs: Any,
    ) -> None:
        if not isinstance(text_config, KimiLinearConfig):
            text_config = KimiLinearConfig(**(text_config or {}))
        if not isinstance(vision_config, KimiK3VisionConfig):
            vision_config = KimiK3VisionConfig(**(vision_config or {}))
        vision_config.text_hidden_size = text_config.hidden_size
        self.text_config = text_config
        self.vision_config = vision_config
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        self.image_placeholder = image_placeholder
        super().__init__(pad_token_id=pad_token_id, **kwargs)

    def get_text_config(self, *args: Any, **kwargs: Any) -> KimiLinearConfig:
        return self.text_config


__all__ = ["KimiK3Config", "KimiK3VisionConfig", "KimiLinearConfig"]
