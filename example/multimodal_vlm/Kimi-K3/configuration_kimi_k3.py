# Stand-in for the vendor's Kimi-K3 configuration file (remote code, loaded with trust_remote_code=True).
#
# The text config reads a Hugging Face Kimi-Linear config.json as it is (hub field names, `linear_attn_config`
# with 1-indexed layer lists); Kimi-K3 adds `moe_latent_size` (routed experts work in a latent space) and
# `media_placeholder_token_id`. model_type "kimi_linear" belongs to transformers' native class, so the remote
# classes use their own model types.
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class KimiK3TextConfig(PretrainedConfig):
    """Kimi-Linear text config with hub field names, plus Kimi-K3's latent MoE size."""

    model_type = "kimi_k3_text"
    keys_to_ignore_at_inference = ["past_key_values"]
    # Aliases transformers' native KimiLinearConfig also accepts.
    attribute_map = {
        "num_experts_per_tok": "num_experts_per_token",
        "n_routed_experts": "num_experts",
        "num_local_experts": "num_experts",
        "n_shared_experts": "num_shared_experts",
        "n_group": "num_expert_group",
        "norm_topk_prob": "moe_renormalize",
    }

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 3072
    num_hidden_layers: int = 4
    num_attention_heads: int = 64
    num_key_value_heads: int | None = None
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.446
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    moe_latent_size: int | None = None
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    linear_attn_config: dict | None = None
    media_placeholder_token_id: int | None = None
    model_max_length: int = 8192
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if not self.moe_latent_size:
            self.moe_latent_size = None  # 0 and null both mean: no latent projections (plain Kimi-Linear)
        lac = dict(self.linear_attn_config or {})
        # Hub default: every 4th layer (1-indexed) is MLA, the rest KDA.
        n = self.num_hidden_layers
        lac.setdefault("full_attn_layers", [i for i in range(1, n + 1) if i % 4 == 0])
        lac.setdefault("kda_layers", [i for i in range(1, n + 1) if i not in lac["full_attn_layers"]])
        lac.setdefault("num_heads", 32)
        lac.setdefault("head_dim", 128)
        lac.setdefault("short_conv_kernel_size", 4)
        both = set(lac["kda_layers"]) & set(lac["full_attn_layers"])
        covered = set(lac["kda_layers"]) | set(lac["full_attn_layers"])
        if both or covered != set(range(1, n + 1)):
            raise ValueError(
                f"linear_attn_config: kda_layers {lac['kda_layers']} and full_attn_layers {lac['full_attn_layers']} "
                f"must partition layers 1..{n} (1-indexed)"
            )
        self.linear_attn_config = lac
        # Fields of transformers' native config that a hub config.json may carry; derived here, not trusted.
        for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
                    "head_dim", "qk_head_dim"):
            kwargs.pop(key, None)
        super().__post_init__(**kwargs)

    # Layer indices below are 0-indexed (module indices); linear_attn_config lists are 1-indexed.
    def is_kda_layer(self, layer_idx: int) -> bool:
        return (layer_idx + 1) in self.linear_attn_config["kda_layers"]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and self.num_experts > 0

    @property
    def layer_types(self) -> list[str]:
        return ["linear_attention" if self.is_kda_layer(i) else "full_attention" for i in range(self.num_hidden_layers)]

    def get_text_config(self, *args: Any, **kwargs: Any) -> KimiK3TextConfig:
        return self


class KimiK3VisionConfig(PretrainedConfig):
    """ViT-style vision tower; patches are merged merge_kernel_size[0] x merge_kernel_size[1] by the projector."""

    model_type = "kimi_k3_vision"
    base_config_key = "vision_config"

    patch_size: int = 14
    in_channels: int = 3
    hidden_size: int = 1152
    depth: int = 27
    num_heads: int = 16
    intermediate_size: int = 4304
    merge_kernel_size: list[int] | None = None
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs: Any) -> None:
        if self.merge_kernel_size is None:
            self.merge_kernel_size = [2, 2]
        self.merge_kernel_size = [int(v) for v in self.merge_kernel_size]
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config.hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        super().__post_init__(**kwargs)


class KimiK3Config(PretrainedConfig):
    """Kimi-K3: vision tower + projector + Kimi-Linear text model (latent MoE)."""

    model_type = "kimi_k3"
    sub_configs_defaults = {"text_config": KimiK3TextConfig, "vision_config": KimiK3VisionConfig}
    keys_to_ignore_at_inference = ["past_key_values"]

    text_config: dict | KimiK3TextConfig | None = None
    vision_config: dict | KimiK3VisionConfig | None = None
    media_placeholder_token_id: int | None = None
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        if self.media_placeholder_token_id is None:
            self.media_placeholder_token_id = self.text_config.media_placeholder_token_id
        if self.text_config.media_placeholder_token_id is None:
            self.text_config.media_placeholder_token_id = self.media_placeholder_token_id
        if not self.architectures:
            self.architectures = ["KimiK3ForConditionalGeneration"]

    def get_text_config(self, *args: Any, **kwargs: Any) -> KimiK3TextConfig:
        return self.text_config


__all__ = ["KimiK3Config", "KimiK3TextConfig", "KimiK3VisionConfig"]
