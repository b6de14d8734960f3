# Stand-in for the vendor's Kimi-K3 modeling file (remote code, loaded with trust_remote_code=True).
#
# Written the way the Kimi-Linear Hugging Face modeling file is: the KDA layer calls FLA's Triton kernels
# directly, so on a host without a Triton GPU backend the model only runs after the toolkit's runtime patches
# replace `chunk_kda`, `fused_recurrent_kda`, `fused_kda_gate` (module globals here) and the forwards of
# `ShortConvolution` / `FusedRMSNormGated`.
#
# Module tree (checkpoint names):
#   vision_tower.{patch_embed, pos_embed, blocks.{j}.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}, post_norm}
#   mm_projector.{pre_norm, linear_1, linear_2}
#   language_model.model.{embed_tokens, layers.{i}, norm}, language_model.lm_head
# A decoder layer holds `self_attn` (KimiDeltaAttention or KimiMLAAttention) and `mlp` (dense, layers before
# first_k_dense_replace) or `block_sparse_moe` (latent MoE).
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from fla.modules import FusedRMSNormGated, ShortConvolution
from fla.ops.kda import chunk_kda, fused_recurrent_kda
from fla.ops.kda.gate import fused_kda_gate
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig, KimiK3VisionConfig


# --------------------------------------------------------------------------------------------------------------------
# Cache (prefill + single-token decode)
# --------------------------------------------------------------------------------------------------------------------
class KimiDynamicCache:
    """Per-layer decode state: KDA conv tails + recurrent state, MLA compressed latents (kv_nope, k_rot)."""

    def __init__(self, config: KimiK3TextConfig) -> None:
        n = config.num_hidden_layers
        self.conv_states: list[tuple[torch.Tensor, ...] | None] = [None] * n
        self.recurrent_states: list[torch.Tensor | None] = [None] * n
        self.kv_nope: list[torch.Tensor | None] = [None] * n
        self.k_rot: list[torch.Tensor | None] = [None] * n
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.seen_tokens

    def update_latents(self, kv_nope: torch.Tensor, k_rot: torch.Tensor, layer_idx: int):
        if self.kv_nope[layer_idx] is not None:
            kv_nope = torch.cat([self.kv_nope[layer_idx], kv_nope], dim=1)
            k_rot = torch.cat([self.k_rot[layer_idx], k_rot], dim=1)
        self.kv_nope[layer_idx], self.k_rot[layer_idx] = kv_nope, k_rot
        return kv_nope, k_rot


# --------------------------------------------------------------------------------------------------------------------
# Text model
# --------------------------------------------------------------------------------------------------------------------
class KimiRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x).to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class KimiMLP(nn.Module):
    def __init__(self, config: KimiK3TextConfig, hidden_size: int | None = None, intermediate_size: int | None = None):
        super().__init__()
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class KimiBlockSparseMLP(nn.Module):
    """One routed expert: w1 gate, w3 up, w2 down (in the latent space when moe_latent_size is set)."""

    def __init__(self, config: KimiK3TextConfig, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.ffn_dim = intermediate_size
        self.hidden_dim = hidden_size
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


class KimiMoEGate(nn.Module):
    """Sigmoid router with e_score_correction_bias and grouped top-k; weights come from the unbiased scores."""

    def __init__(self, config: KimiK3TextConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.num_experts = config.num_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group = config.num_expert_group
        self.topk_group = config.topk_group
        self.moe_renormalize = config.moe_renormalize
        self.hidden_size = config.hidden_size
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts {self.num_experts} not divisible by num_expert_group {self.n_group}")
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, self.hidden_size)
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        scores_for_choice = scores + self.e_score_correction_bias.float()
        n_tokens = scores.shape[0]
        group_scores = (
            scores_for_choice.view(n_tokens, self.n_group, -1).topk(min(2, self.num_experts // self.n_group), dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n_tokens, self.n_group, self.num_experts // self.n_group)
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.reshape(n_tokens, -1).bool(), float("-inf"))
        topk_idx = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weight = scores.gather(1, topk_idx)
        if self.top_k > 1 and self.moe_renormalize:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx, topk_weight


class KimiSparseMoeBlock(nn.Module):
    """Latent MoE: routed experts run in a moe_latent_size space entered/left through latent projections;
    the shared experts run at hidden size. With moe_latent_size unset it is the plain Kimi-Linear MoE."""

    def __init__(self, config: KimiK3TextConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_experts = config.num_experts
        self.num_experts_per_token = config.num_experts_per_token
        self.moe_latent_size = config.moe_latent_size
        expert_dim = self.moe_latent_size or self.hidden_size
        self.gate = KimiMoEGate(config)
        if self.moe_latent_size:
            self.latent_down_proj = nn.Linear(self.hidden_size, self.moe_latent_size, bias=False)
            self.latent_up_proj = nn.Linear(self.moe_latent_size, self.hidden_size, bias=False)
        else:
            self.latent_down_proj = None
            self.latent_up_proj = None
        self.experts = nn.ModuleList(
            [KimiBlockSparseMLP(config, expert_dim, config.moe_intermediate_size) for _ in range(self.num_experts)]
        )
        self.shared_experts = (
            KimiMLP(config, intermediate_size=config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts
            else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        orig_shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        topk_idx, topk_weight = self.gate(x)
        x_lat = self.latent_down_proj(x) if self.latent_down_proj is not None else x
        y_lat = self.moe_infer(x_lat, topk_idx, topk_weight)
        y = self.latent_up_proj(y_lat) if self.latent_up_proj is not None else y_lat
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(orig_shape)

    def moe_infer(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """sum_k weight_k * expert_{idx_k}(x) per token, accumulated in fp32."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        counts = torch.bincount(topk_idx.flatten(), minlength=self.num_experts).tolist()
        for e, count in enumerate(counts):
            if count == 0:
                continue
            token_idx, slot = torch.where(topk_idx == e)
            y = self.experts[e](x[token_idx])
            out.index_add_(0, token_idx, y.float() * topk_weight[token_idx, slot, None].float())
        return out.to(x.dtype)


class KimiMLAAttention(nn.Module):
    """Multi-head latent attention without positional encoding (NoPE); k_rot is shared across heads."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.q_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(self.hidden_size, self.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiRMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = KimiRMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=False)
        self.softmax_scale = self.q_head_dim ** (-0.5)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KimiDynamicCache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, q_len, self.num_heads, self.q_head_dim).transpose(1, 2)

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        kv_nope, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        if past_key_values is not None:
            kv_nope, k_rot = past_key_values.update_latents(kv_nope, k_rot, self.layer_idx)
        kv_len = kv_nope.shape[1]

        kv = self.kv_b_proj(kv_nope).view(bsz, kv_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, value = torch.split(kv.transpose(1, 2), [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rot = k_rot.view(bsz, 1, kv_len, self.qk_rope_head_dim).expand(-1, self.num_heads, -1, -1)
        key = torch.cat([k_nope, k_rot], dim=-1)

        # Causal over the whole (cached + new) sequence; padded keys masked; a query always sees itself so fully
        # padded rows stay finite.
        past = kv_len - q_len
        qi = torch.arange(q_len, device=q.device)[:, None] + past
        ki = torch.arange(kv_len, device=q.device)[None, :]
        mask = (ki <= qi)[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, -kv_len:].bool()
            mask = mask | (ki == qi)[None, None]
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=self.softmax_scale)
        out = out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.v_head_dim)
        return self.o_proj(out)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (KDA): gated delta rule with a per-channel decay, FLA kernels."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        lac = config.linear_attn_config
        self.conv_size = lac["short_conv_kernel_size"]
        self.head_dim = lac["head_dim"]
        self.num_heads = lac["num_heads"]
        self.head_k_dim = self.head_dim
        projection_size = self.num_heads * self.head_dim

        self.q_proj = nn.Linear(self.hidden_size, projection_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, projection_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, projection_size, bias=False)
        self.q_conv1d = ShortConvolution(hidden_size=projection_size, kernel_size=self.conv_size, activation="silu")
        self.k_conv1d = ShortConvolution(hidden_size=projection_size, kernel_size=self.conv_size, activation="silu")
        self.v_conv1d = ShortConvolution(hidden_size=projection_size, kernel_size=self.conv_size, activation="silu")

        self.A_log = nn.Parameter(torch.empty(1, 1, self.num_heads, 1, dtype=torch.float32))
        self.f_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, projection_size, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(projection_size, dtype=torch.float32))
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, projection_size, bias=False)
        self.o_norm = FusedRMSNormGated(self.head_dim, eps=config.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(projection_size, self.hidden_size, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache_params: KimiDynamicCache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        if attention_mask is not None:
            # Zeroed padding is inert: q=k=v=0 and the state is zero before the first real token.
            hidden_states = hidden_states * attention_mask[:, -q_len:, None].to(hidden_states.dtype)
        use_cache = cache_params is not None
        conv_state_q = conv_state_k = conv_state_v = None
        recurrent_state = None
        if use_cache:
            if cache_params.conv_states[self.layer_idx] is not None:
                conv_state_q, conv_state_k, conv_state_v = cache_params.conv_states[self.layer_idx]
            recurrent_state = cache_params.recurrent_states[self.layer_idx]

        q, conv_state_q = self.q_conv1d(x=self.q_proj(hidden_states), cache=conv_state_q, output_final_state=use_cache)
        k, conv_state_k = self.k_conv1d(x=self.k_proj(hidden_states), cache=conv_state_k, output_final_state=use_cache)
        v, conv_state_v = self.v_conv1d(x=self.v_proj(hidden_states), cache=conv_state_v, output_final_state=use_cache)

        g = self.f_b_proj(self.f_a_proj(hidden_states))
        g = rearrange(g, "... (h d) -> ... h d", d=self.head_dim)
        g = fused_kda_gate(g, self.A_log, dt_bias=self.dt_bias)  # fp32 log-decay, <= 0
        beta = self.b_proj(hidden_states).float().sigmoid()

        q, k, v = (rearrange(x, "... (h d) -> ... h d", d=self.head_dim) for x in (q, k, v))
        if use_cache and q_len == 1 and recurrent_state is not None:
            o, recurrent_state = fused_recurrent_kda(
                q=q, k=k, v=v, g=g, beta=beta, scale=self.head_k_dim ** -0.5, initial_state=recurrent_state,
                output_final_state=True, use_qk_l2norm_in_kernel=True,
            )
        else:
            o, recurrent_state = chunk_kda(
                q=q, k=k, v=v, g=g, beta=beta, scale=self.head_k_dim ** -0.5, initial_state=recurrent_state,
                output_final_state=use_cache, use_qk_l2norm_in_kernel=True,
            )
        if use_cache:
            cache_params.recurrent_states[self.layer_idx] = recurrent_state
            cache_params.conv_states[self.layer_idx] = (conv_state_q, conv_state_k, conv_state_v)

        gate = rearrange(self.g_b_proj(self.g_a_proj(hidden_states)), "... (h d) -> ... h d", d=self.head_dim)
        o = self.o_norm(o, gate)
        o = rearrange(o, "b t h d -> b t (h d)")
        return self.o_proj(o)


class KimiDecoderLayer(nn.Module):
    def __init__(self, config: KimiK3TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.layer_idx = layer_idx
        self.is_linear_attn = config.is_kda_layer(layer_idx)
        if self.is_linear_attn:
            self.self_attn = KimiDeltaAttention(config, layer_idx)
        else:
            self.self_attn = KimiMLAAttention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = KimiSparseMoeBlock(config)
        else:
            self.mlp = KimiMLP(config)
        self.input_layernorm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KimiDynamicCache | None = None,
        use_cache: bool | None = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """attention_mask: None (all tokens real) or 2-D [batch, past+seq] with 1 for real tokens."""
        cache = past_key_values if use_cache else None
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.is_linear_attn:
            hidden_states = self.self_attn(hidden_states, attention_mask=attention_mask, cache_params=cache)
        else:
            hidden_states = self.self_attn(hidden_states, attention_mask=attention_mask, past_key_values=cache)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        if hasattr(self, "block_sparse_moe"):
            hidden_states = self.block_sparse_moe(hidden_states)
        else:
            hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


def _init_kimi_weights(module: nn.Module, std: float) -> None:
    if isinstance(module, nn.Linear):
        init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, ShortConvolution):
        init.normal_(module.weight, mean=0.0, std=0.5 / math.sqrt(module.kernel_size[0]))
        if module.bias is not None:
            init.zeros_(module.bias)
    elif isinstance(module, (KimiRMSNorm, FusedRMSNormGated)):
        init.ones_(module.weight)
    elif isinstance(module, nn.LayerNorm):
        init.ones_(module.weight)
        init.zeros_(module.bias)
    elif isinstance(module, KimiDeltaAttention):
        # FLA's init: A ~ U(1, 16); dt ~ logU(1e-3, 1e-1) stored as inverse softplus.
        init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
    elif isinstance(module, KimiMoEGate):
        init.normal_(module.weight, mean=0.0, std=std)
        init.zeros_(module.e_score_correction_bias)
    elif isinstance(module, KimiK3VisionTower) and module.pos_embed is not None:
        init.normal_(module.pos_embed, mean=0.0, std=std)


class KimiPreTrainedModel(PreTrainedModel):
    config_class = KimiK3TextConfig
    config: KimiK3TextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _keep_in_fp32_modules = ["A_log", "dt_bias", "e_score_correction_bias"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        _init_kimi_weights(module, self.config.initializer_range)


class KimiLinearModel(KimiPreTrainedModel):
    def __init__(self, config: KimiK3TextConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([KimiDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KimiDynamicCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = KimiDynamicCache(self.config)
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be 2-D [batch, seq] (1 = token), got {tuple(attention_mask.shape)}")
            if bool(attention_mask.all()):
                attention_mask = None  # no padding: every layer takes its unmasked path
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, use_cache=use_cache,
            )
        hidden_states = self.norm(hidden_states)
        if use_cache:
            past_key_values.seen_tokens += inputs_embeds.shape[1]
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values if use_cache else None)


class KimiLinearForCausalLM(KimiPreTrainedModel):
    _tied_weights_keys = {}

    def __init__(self, config: KimiK3TextConfig) -> None:
        super().__init__(config)
        self.model = KimiLinearModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KimiDynamicCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)


# --------------------------------------------------------------------------------------------------------------------
# Vision tower + projector
# --------------------------------------------------------------------------------------------------------------------
class KimiK3VisionAttention(nn.Module):
    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n_patches, D] of ONE image; attention is bidirectional over its patches."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class KimiK3VisionMLP(nn.Module):
    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class KimiK3VisionBlock(nn.Module):
    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = KimiK3VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = KimiK3VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class KimiK3VisionTower(nn.Module):
    """ViT over flattened patches; images of any whole patch grid, learned 2-D position table interpolated."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.config = config
        patch_dim = config.in_channels * config.patch_size * config.patch_size
        self.patch_embed = nn.Linear(patch_dim, config.hidden_size, bias=True)
        if config.pos_emb_height and config.pos_emb_width:
            self.pos_embed = nn.Parameter(torch.empty(config.pos_emb_height, config.pos_emb_width, config.hidden_size))
        else:
            self.pos_embed = None
        self.blocks = nn.ModuleList([KimiK3VisionBlock(config) for _ in range(config.depth)])
        self.post_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def _pos(self, h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
        table = self.pos_embed
        if table.shape[:2] != (h, w):
            table = F.interpolate(table.float().permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False)
            table = table[0].permute(1, 2, 0)
        return table.reshape(h * w, -1).to(dtype)

    def forward(self, pixel_values: torch.Tensor, image_grid_hws: torch.Tensor) -> torch.Tensor:
        """pixel_values [n_patches, C*p*p] (row-major per image), image_grid_hws [n_images, 2] -> [n_patches, D]."""
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        outs = []
        start = 0
        for h, w in image_grid_hws.tolist():
            xi = x[start:start + h * w]
            if self.pos_embed is not None:
                xi = xi + self._pos(h, w, xi.dtype)
            for block in self.blocks:
                xi = block(xi)
            outs.append(self.post_norm(xi))
            start += h * w
        if start != x.shape[0]:
            raise ValueError(f"image_grid_hws covers {start} patches but pixel_values has {x.shape[0]}")
        return torch.cat(outs, dim=0)


class KimiK3MultiModalProjector(nn.Module):
    """Merge mh x mw neighbouring patches, LayerNorm, MLP to the text hidden size."""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        vc = config.vision_config
        self.merge_kernel_size = tuple(vc.merge_kernel_size)
        in_dim = vc.hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]
        self.pre_norm = nn.LayerNorm(in_dim, eps=config.projector_ln_eps)
        self.linear_1 = nn.Linear(in_dim, in_dim, bias=True)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(in_dim, config.text_config.hidden_size, bias=True)

    def merge(self, features: torch.Tensor, image_grid_hws: torch.Tensor) -> torch.Tensor:
        mh, mw = self.merge_kernel_size
        out, start = [], 0
        for h, w in image_grid_hws.tolist():
            if h % mh or w % mw:
                raise ValueError(f"image grid {h}x{w} is not a multiple of merge_kernel_size {mh}x{mw}")
            f = features[start:start + h * w].view(h // mh, mh, w // mw, mw, -1)
            out.append(f.permute(0, 2, 1, 3, 4).reshape((h // mh) * (w // mw), -1))
            start += h * w
        return torch.cat(out, dim=0)

    def forward(self, features: torch.Tensor, image_grid_hws: torch.Tensor) -> torch.Tensor:
        x = self.pre_norm(self.merge(features, image_grid_hws))
        return self.linear_2(self.act(self.linear_1(x)))


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    config: KimiK3Config
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiDecoderLayer", "KimiK3VisionBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _keep_in_fp32_modules = ["A_log", "dt_bias", "e_score_correction_bias"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        _init_kimi_weights(module, self.config.text_config.initializer_range)


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel):
    _tied_weights_keys = {}

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(config)
        self.vision_tower = KimiK3VisionTower(config.vision_config)
        self.mm_projector = KimiK3MultiModalProjector(config)
        self.language_model = KimiLinearForCausalLM(config.text_config)
        self.media_placeholder_token_id = config.media_placeholder_token_id
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Linear:
        return self.language_model.lm_head

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_hws: torch.Tensor) -> torch.Tensor:
        """-> [n_image_tokens, text hidden] (one row per merged patch group, images in order)."""
        features = self.vision_tower(pixel_values, image_grid_hws)
        return self.mm_projector(features, image_grid_hws)

    def merge_image_features(
        self, inputs_embeds: torch.Tensor, input_ids: torch.LongTensor, image_features: torch.Tensor
    ) -> torch.Tensor:
        mask = input_ids == self.media_placeholder_token_id
        n_slots = int(mask.sum())
        if n_slots != image_features.shape[0]:
            raise ValueError(
                f"input_ids hold {n_slots} media placeholder tokens (id {self.media_placeholder_token_id}) "
                f"but there are {image_features.shape[0]} image features"
            )
        mask = mask.unsqueeze(-1).expand_as(inputs_embeds)
        return inputs_embeds.masked_scatter(mask, image_features.to(inputs_embeds.dtype))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_hws: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KimiDynamicCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
            if pixel_values is not None:
                if image_grid_hws is None:
                    raise ValueError("pixel_values given without image_grid_hws")
                image_features = self.get_image_features(pixel_values, image_grid_hws)
                inputs_embeds = self.merge_image_features(inputs_embeds, input_ids, image_features)
        return self.language_model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, labels=labels, use_cache=use_cache,
        )


__all__ = [
    "KimiK3ForConditionalGeneration",
    "KimiK3PreTrainedModel",
    "KimiLinearForCausalLM",
    "KimiLinearModel",
    "KimiPreTrainedModel",
    "KimiDecoderLayer",
    "KimiDeltaAttention",
    "KimiMLAAttention",
    "KimiSparseMoeBlock",
    "KimiMoEGate",
    "KimiBlockSparseMLP",
    "KimiMLP",
    "KimiRMSNorm",
    "KimiDynamicCache",
]
