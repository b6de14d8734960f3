# Stand-in for the vendor's Kimi-K3 modeling file (remote code, loaded with trust_remote_code=True).
#
# The architecture, the module tree and every checkpoint tensor name follow the public Kimi-K3 implementation
# (vLLM 0.33.0, `vllm/models/kimi_k3/nvidia/{model,kda,mla,mtp}.py`, `ops/attn_res.py`,
# `vllm/model_executor/models/kimi_k25_vit.py`); the facts, with file:line, are in
# docs/dev/facts/kimi_k3_in_vllm_0.33.md. Written the way a Hugging Face modeling file is: the KDA layer calls FLA's
# Triton kernels directly, so on a host without a Triton GPU backend the model only runs after the toolkit's runtime
# patches replace `chunk_kda`, `fused_recurrent_kda`, `fused_kda_gate` (module globals here) and the forwards of
# `ShortConvolution` / `FusedRMSNormGated`.
#
# Module tree (checkpoint names):
#   vision_tower.{patch_embed.{proj, pos_emb}, encoder.{blocks.{j}.{norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1},
#                 final_layernorm}}
#   mm_projector.{proj.0, proj.2, post_norm}                                           (patchmergerv2)
#   language_model.model.{embed_tokens, layers.{i}, norm, output_attn_res_norm, output_attn_res_proj}
#   language_model.lm_head
# Decoder layer i < num_hidden_layers: `self_attn` (KDA if (i+1) in kda_layers, else NoPE MLA), `mlp` (dense) or
# `block_sparse_moe` (latent MoE), `input_layernorm`, `post_attention_layernorm` and, with attention residuals,
# `self_attention_res_{norm,proj}` / `mlp_res_{norm,proj}`. Layers num_hidden_layers.. are the MTP layers
# (`enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}` + one decoder block); the main forward never runs them.
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
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_kimi_k3 import KimiK3Config, KimiK3VisionConfig, KimiLinearConfig


# --------------------------------------------------------------------------------------------------------------------
# Cache (prefill + single-token decode)
# --------------------------------------------------------------------------------------------------------------------
class KimiDynamicCache:
    """Per-layer decode state: KDA conv tails + recurrent state, MLA compressed latents (kv_nope, k_rot).
    Attention residuals mix over depth for one token, so they need no cache."""

    def __init__(self, config: KimiLinearConfig) -> None:
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


class KimiGatedActivation(nn.Module):
    """act(gate) * up. `silu`: silu(gate) * up. `situ` (Kimi-K3): beta*tanh(gate/beta)*sigmoid(gate) times
    linear_beta*tanh(up/linear_beta) (up unchanged when linear_beta is unset); computed in fp32."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.kind = config.hidden_act
        self.beta = float(config.activation_situ_beta or 1.0)
        lb = config.activation_situ_linear_beta
        self.linear_beta = float(lb) if lb is not None and lb > 0 else None

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        g, u = gate.float(), up.float()
        act = self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g)
        if self.linear_beta is not None:
            u = self.linear_beta * torch.tanh(u / self.linear_beta)
        return (act * u).to(gate.dtype)

    def extra_repr(self) -> str:
        return self.kind if self.kind == "silu" else f"situ, beta={self.beta}, linear_beta={self.linear_beta}"


class KimiMLP(nn.Module):
    """Dense MLP and shared experts: down(act(gate(x)) * up(x))."""

    def __init__(self, config: KimiLinearConfig, hidden_size: int | None = None, intermediate_size: int | None = None):
        super().__init__()
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = KimiGatedActivation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))


class KimiBlockSparseMLP(nn.Module):
    """One routed expert: w1 gate, w3 up, w2 down (in the latent space when routed_expert_hidden_size is set)."""

    def __init__(self, config: KimiLinearConfig, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.ffn_dim = intermediate_size
        self.hidden_dim = hidden_size
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.act_fn = KimiGatedActivation(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(hidden_states), self.w3(hidden_states)))


class KimiMoEGate(nn.Module):
    """Router: fp32 logits, sigmoid (or softmax) scores; experts chosen on scores + e_score_correction_bias with
    grouped top-k; weights are the unbiased scores, renormalised, times routed_scaling_factor."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.num_experts = config.num_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.scoring = config.moe_router_activation_func
        self.n_group = config.num_expert_group if config.use_grouped_topk else 1
        self.topk_group = config.topk_group if config.use_grouped_topk else 1
        self.moe_renormalize = config.moe_renormalize
        self.hidden_size = config.hidden_size
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts {self.num_experts} not divisible by num_expert_group {self.n_group}")
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, self.hidden_size)
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        scores_for_choice = scores + self.e_score_correction_bias.float()
        n_tokens = scores.shape[0]
        per_group = self.num_experts // self.n_group
        group_scores = scores_for_choice.view(n_tokens, self.n_group, -1).topk(min(2, per_group), dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n_tokens, self.n_group, per_group).reshape(n_tokens, -1)
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
        topk_idx = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weight = scores.gather(1, topk_idx)
        if self.moe_renormalize:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        return topk_idx, topk_weight * self.routed_scaling_factor


class KimiSparseMoeBlock(nn.Module):
    """Latent MoE: z = routed_expert_down_proj(x); y = sum_k w_k expert_k(z); routed = routed_expert_up_proj(
    routed_expert_norm(y)); out = routed + shared_experts(x). Without routed_expert_hidden_size the experts read and
    write the hidden size directly (Kimi-Linear)."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_experts = config.num_experts
        self.num_experts_per_token = config.num_experts_per_token
        self.latent_size = config.routed_expert_hidden_size
        expert_dim = self.latent_size or self.hidden_size
        self.gate = KimiMoEGate(config)
        if self.latent_size:
            self.routed_expert_down_proj = nn.Linear(self.hidden_size, self.latent_size, bias=False)
            self.routed_expert_norm = (KimiRMSNorm(self.latent_size, eps=config.rms_norm_eps)
                                       if config.latent_moe_use_norm else None)
            self.routed_expert_up_proj = nn.Linear(self.latent_size, self.hidden_size, bias=False)
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
        if self.latent_size:
            y = self.moe_infer(self.routed_expert_down_proj(x), topk_idx, topk_weight)
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        else:
            y = self.moe_infer(x, topk_idx, topk_weight)
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
    """Multi-head latent attention without positional encoding (NoPE; k_pe shared across heads, never rotated),
    with q-LoRA (q_a_proj -> q_a_layernorm -> q_b_proj) and an optional sigmoid output gate g_proj."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
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
            self.q_a_layernorm = KimiRMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = KimiRMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(self.hidden_size, self.num_heads * self.v_head_dim, bias=False)
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
        if getattr(self, "g_proj", None) is not None:
            out = out * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(out)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (KDA): gated delta rule with a per-channel decay, FLA kernels. The output gate is
    full rank (`g_proj`, Kimi-K3: linear_attn_config.use_full_rank_gate) or low rank (`g_a_proj` -> `g_b_proj`,
    Kimi-Linear); the forget gate is always low rank (f_a_proj -> f_b_proj)."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        lac = config.linear_attn_config
        self.conv_size = lac["short_conv_kernel_size"]
        self.head_dim = lac["head_dim"]
        self.num_heads = lac["num_heads"]
        self.head_k_dim = self.head_dim
        self.full_rank_gate = bool(lac.get("use_full_rank_gate", False))
        self.gate_lower_bound = lac.get("gate_lower_bound")
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
        if self.full_rank_gate:
            self.g_proj = nn.Linear(self.hidden_size, projection_size, bias=False)
        else:
            self.g_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, projection_size, bias=False)
        # FusedRMSNormGated's own eps (1e-5), as the serving kernel uses, not rms_norm_eps.
        self.o_norm = FusedRMSNormGated(self.head_dim, eps=1e-5, activation="sigmoid")
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
        g = fused_kda_gate(g, self.A_log, dt_bias=self.dt_bias, lower_bound=self.gate_lower_bound)  # fp32, <= 0
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

        gate = self.g_proj(hidden_states) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(hidden_states))
        o = self.o_norm(o, rearrange(gate, "... (h d) -> ... h d", d=self.head_dim))
        o = rearrange(o, "b t h d -> b t (h d)")
        return self.o_proj(o)


def attn_res_mix(sources: list[torch.Tensor], norm: KimiRMSNorm, proj: nn.Linear) -> torch.Tensor:
    """Attention residual: sum_i softmax_i(RMSNorm(s_i; norm) . proj) s_i over the sources, in fp32 (the raw,
    un-normalised sources are mixed; the caller applies the output norm)."""
    stacked = torch.stack([s.float() for s in sources], dim=-2)  # [..., n, H]
    logits = F.linear(norm(stacked), proj.weight.float()).squeeze(-1)  # [..., n]
    alpha = torch.softmax(logits, dim=-1)
    return (alpha.unsqueeze(-1) * stacked).sum(dim=-2)


class KimiDecoderLayer(nn.Module):
    """Pre-norm decoder layer. With attn_res_block_size B the residual stream is the list of finished block sums
    (block 0 = the embeddings) plus the running prefix p of the current block: the input of attention and of the
    MLP is RMSNorm(attn_res_mix(blocks + [p])) with the layer norms as the output norms; a layer with
    index % B == 0 stores p as a new block and starts the next one with its attention output."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int, attn_res: bool = True) -> None:
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
        self.attn_res_block_size = config.attn_res_block_size if attn_res else None
        if self.attn_res_block_size:
            h, eps = config.hidden_size, config.rms_norm_eps
            self.self_attention_res_norm = KimiRMSNorm(h, eps=eps)
            self.self_attention_res_proj = nn.Linear(h, 1, bias=False)
            self.mlp_res_norm = KimiRMSNorm(h, eps=eps)
            self.mlp_res_proj = nn.Linear(h, 1, bias=False)

    def _attn(self, x, attention_mask, cache):
        if self.is_linear_attn:
            return self.self_attn(x, attention_mask=attention_mask, cache_params=cache)
        return self.self_attn(x, attention_mask=attention_mask, past_key_values=cache)

    def _ffn(self, x):
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KimiDynamicCache | None = None,
        use_cache: bool | None = False,
        attn_res_blocks: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """attention_mask: None (all tokens real) or 2-D [batch, past+seq] with 1 for real tokens.
        Without attention residuals: hidden_states -> hidden_states. With them: (p, blocks) -> (p, blocks), where
        p already includes this layer's MLP output."""
        cache = past_key_values if use_cache else None
        if not self.attn_res_block_size:
            residual = hidden_states
            hidden_states = residual + self._attn(self.input_layernorm(hidden_states), attention_mask, cache)
            residual = hidden_states
            return residual + self._ffn(self.post_attention_layernorm(hidden_states))

        dtype = hidden_states.dtype
        prefix = hidden_states
        blocks = list(attn_res_blocks or [])
        starts_block = self.layer_idx % self.attn_res_block_size == 0
        if starts_block:
            blocks.append(prefix)
        sources = (blocks[:-1] if starts_block else blocks) + [prefix]
        x = self.input_layernorm(attn_res_mix(sources, self.self_attention_res_norm, self.self_attention_res_proj))
        attn_out = self._attn(x.to(dtype), attention_mask, cache)
        prefix = attn_out if starts_block else prefix + attn_out
        x = self.post_attention_layernorm(attn_res_mix(blocks + [prefix], self.mlp_res_norm, self.mlp_res_proj))
        return prefix + self._ffn(x.to(dtype)), blocks


class KimiMTPHead(nn.Module):
    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class KimiMTPLayer(KimiDecoderLayer):
    """Multi-token prediction layer (stored as model.layers.{num_hidden_layers + i}): one standard-residual decoder
    block on eh_proj([enorm(e) | hnorm(h)]), where h is the main model's final hidden state (after the output
    attention-residual mix, before model.norm) or the previous MTP step's, and e the embedding of the next token
    (zero at position 0)."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, attn_res=False)
        h = config.hidden_size
        self.enorm = KimiRMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = KimiRMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = KimiMTPHead(config)

    def forward(self, hidden_states: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(h [B, T, H], next-token embeddings [B, T, H]) -> (h_next, logits)."""
        if inputs_embeds is None:
            raise ValueError("KimiMTPLayer needs inputs_embeds (the embeddings of the next tokens)")
        z = self.eh_proj(torch.cat([self.enorm(inputs_embeds), self.hnorm(hidden_states)], dim=-1))
        h_next = super().forward(z, attention_mask=attention_mask)
        return h_next, self.shared_head.head(self.shared_head.norm(h_next))


def _init_kimi_weights(module: nn.Module, std: float) -> None:
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, ShortConvolution):
        nn.init.normal_(module.weight, mean=0.0, std=0.5 / math.sqrt(module.kernel_size[0]))
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, (KimiRMSNorm, FusedRMSNormGated, nn.RMSNorm)):
        nn.init.ones_(module.weight)
    elif isinstance(module, KimiDeltaAttention):
        # FLA's init: A ~ U(1, 16); dt ~ logU(1e-3, 1e-1) stored as inverse softplus.
        module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    elif isinstance(module, KimiMoEGate):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        nn.init.zeros_(module.e_score_correction_bias)
    elif isinstance(module, MoonViTPosEmb):
        nn.init.normal_(module.weight, mean=0.0, std=std)


class KimiPreTrainedModel(PreTrainedModel):
    config_class = KimiLinearConfig
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
    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        n = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([KimiDecoderLayer(config, i) for i in range(n)]
                                    + [KimiMTPLayer(config, n + i) for i in range(config.num_nextn_predict_layers)])
        self.norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.attn_res_block_size:
            self.output_attn_res_norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def final_hidden(self, prefix: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The model's output state h (before model.norm): the output attention-residual mix, no output norm."""
        if not self.config.attn_res_block_size:
            return prefix
        return attn_res_mix(blocks + [prefix], self.output_attn_res_norm, self.output_attn_res_proj).to(prefix.dtype)

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
        """last_hidden_state is normed (model.norm); hidden_states[-1] is the pre-norm h the MTP layers read."""
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
        hidden_states, blocks = inputs_embeds, []
        for layer in self.layers[: self.config.num_hidden_layers]:
            out = layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, use_cache=use_cache, attn_res_blocks=blocks)
            hidden_states, blocks = out if isinstance(out, tuple) else (out, blocks)
        final = self.final_hidden(hidden_states, blocks)
        if use_cache:
            past_key_values.seen_tokens += inputs_embeds.shape[1]
        return BaseModelOutputWithPast(last_hidden_state=self.norm(final), hidden_states=(final,),
                                       past_key_values=past_key_values if use_cache else None)


class KimiLinearForCausalLM(KimiPreTrainedModel):
    _tied_weights_keys = {}

    def __init__(self, config: KimiLinearConfig) -> None:
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
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states)

    @torch.no_grad()
    def mtp_logits(self, input_ids: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
                   ) -> list[torch.Tensor]:
        """Logits of each MTP step over positions 0..T-2-step: step s predicts token t+s+2 at position t."""
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
        h = self.model(inputs_embeds=inputs_embeds).hidden_states[-1]
        out = []
        for step, layer in enumerate(self.model.layers[self.config.num_hidden_layers:]):
            e = inputs_embeds[:, step + 1:].clone()
            e[:, 0] = 0  # vLLM zeroes the embedding at position 0
            h, logits = layer(h[:, : e.shape[1]], inputs_embeds=e)
            out.append(logits)
        return out


# --------------------------------------------------------------------------------------------------------------------
# Vision tower (MoonViT) + projector (patchmergerv2)
# --------------------------------------------------------------------------------------------------------------------
def _sincos_1d(dim: int, length: int) -> torch.Tensor:
    """Fixed 1-D sin/cos table [length, dim] (the temporal position of video frames)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * omega[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).float()


class MoonViTPosEmb(nn.Module):
    """Learned [Ph, Pw, D] table, bilinearly interpolated to other grids; frames add a fixed sincos time table."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.mode = config.pos_emb_interpolation_mode
        self.max_time = config.init_pos_emb_time
        self.weight = nn.Parameter(torch.empty(config.init_pos_emb_height, config.init_pos_emb_width,
                                               config.vt_hidden_size))

    def forward(self, x: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for t, h, w in grid_thws.tolist():
            if t > self.max_time:
                raise ValueError(f"grid t={t} exceeds init_pos_emb_time={self.max_time}")
            table = self.weight
            if tuple(table.shape[:2]) != (h, w):
                table = F.interpolate(table.float().permute(2, 0, 1)[None], size=(h, w), mode=self.mode)[0]
                table = table.permute(1, 2, 0)
            pos = table.reshape(1, h * w, -1).to(x.dtype).expand(t, -1, -1)
            if t > 1:
                pos = pos + _sincos_1d(pos.shape[-1], t).to(x.device, x.dtype)[:, None]
            out.append(x[start:start + t * h * w] + pos.reshape(t * h * w, -1))
            start += t * h * w
        if start != x.shape[0]:
            raise ValueError(f"grid_thws covers {start} patches but pixel_values has {x.shape[0]}")
        return torch.cat(out, dim=0)


class MoonViTPatchEmbed(nn.Module):
    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(3, config.vt_hidden_size, kernel_size=p, stride=p, bias=config.patch_embed_proj_bias)
        self.pos_emb = MoonViTPosEmb(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)  # [n_patches, D]
        return self.pos_emb(x, grid_thws)


def _rope_2d(head_dim: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """cis angles [h*w, head_dim/2], interleaved [x f_0, y f_0, x f_1, y f_1, ...] with f_j = 10000^(-4j/d)."""
    freqs = 1.0 / 10000 ** (torch.arange(0, head_dim, 4, device=device, dtype=torch.float32)[: head_dim // 4]
                            / head_dim)
    ys, xs = torch.meshgrid(torch.arange(h, device=device, dtype=torch.float32),
                            torch.arange(w, device=device, dtype=torch.float32), indexing="ij")
    angles = torch.stack([xs.reshape(-1, 1) * freqs, ys.reshape(-1, 1) * freqs], dim=-1)  # [hw, d/4, 2]
    return torch.polar(torch.ones_like(angles), angles).reshape(h * w, head_dim // 2)


def _apply_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d]; rotate interleaved pairs (2i, 2i+1) by cis [n, d/2], in fp32."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis[:, None]).flatten(-2).to(x.dtype)


class MoonViTEncoderLayer(nn.Module):
    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        d, q = config.vt_hidden_size, config.qkv_hidden_size
        self.num_heads = config.vt_num_attention_heads
        self.head_dim = q // self.num_heads
        self.norm0 = nn.RMSNorm(d)
        self.norm1 = nn.RMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * q, bias=config.attn_bias)
        self.wo = nn.Linear(q, d, bias=config.attn_bias)
        self.mlp = nn.Module()
        self.mlp.fc0 = nn.Linear(d, config.vt_intermediate_size, bias=config.linear_bias)
        self.mlp.fc1 = nn.Linear(config.vt_intermediate_size, d, bias=config.linear_bias)
        self.act = ACT2FN[config.activation_func]

    def forward(self, x: torch.Tensor, cis: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _apply_rope(q, cis), _apply_rope(k, cis)
        outs, start = [], 0
        for length in lengths:  # bidirectional attention within each image
            sl = slice(start, start + length)
            o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1))
            outs.append(o.transpose(0, 1).reshape(length, -1))
            start += length
        x = x + self.wo(torch.cat(outs, dim=0))
        return x + self.mlp.fc1(self.act(self.mlp.fc0(self.norm1(x))))


class MoonViTEncoder(nn.Module):
    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MoonViTEncoderLayer(config) for _ in range(config.vt_num_hidden_layers)])
        self.final_layernorm = nn.RMSNorm(config.vt_hidden_size)
        self.head_dim = config.qkv_hidden_size // config.vt_num_attention_heads

    def forward(self, x: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        cis = torch.cat([_rope_2d(self.head_dim, h, w, x.device).repeat(t, 1) for t, h, w in grid_thws.tolist()])
        lengths = [t * h * w for t, h, w in grid_thws.tolist()]
        for block in self.blocks:
            x = block(x, cis, lengths)
        return self.final_layernorm(x)


class MoonViT3dPretrainedModel(nn.Module):
    """pixel_values [n_patches, 3, p, p] (patches row-major per image), grid_thws [n_images, 3] -> merged patch
    features [n_tokens, kh*kw*D]: sd2_tpool merge (mean over frames, kh x kw neighbours concatenated)."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.merge_kernel_size = tuple(config.merge_kernel_size)
        self.patch_embed = MoonViTPatchEmbed(config)
        self.encoder = MoonViTEncoder(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        x = self.encoder(self.patch_embed(pixel_values, grid_thws), grid_thws)
        kh, kw = self.merge_kernel_size
        out, start = [], 0
        for t, h, w in grid_thws.tolist():
            if h % kh or w % kw:
                raise ValueError(f"image grid {h}x{w} is not a multiple of merge_kernel_size {kh}x{kw}")
            f = x[start:start + t * h * w].view(t, h // kh, kh, w // kw, kw, -1).mean(dim=0)
            out.append(f.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), -1))
            start += t * h * w
        return torch.cat(out, dim=0)


class KimiK3MultiModalProjector(nn.Module):
    """patchmergerv2: post_norm(linear_2(gelu(linear_1(u)))), stored as proj.0 / proj.2 / post_norm."""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        vc = config.vision_config
        in_dim = vc.mm_hidden_size * vc.merge_kernel_size[0] * vc.merge_kernel_size[1]
        self.proj = nn.Sequential(nn.Linear(in_dim, in_dim, bias=False), nn.GELU(),
                                  nn.Linear(in_dim, config.text_config.hidden_size, bias=False))
        self.post_norm = nn.RMSNorm(config.text_config.hidden_size, eps=vc.projector_ln_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(features.to(self.proj[0].weight.dtype)))


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiDecoderLayer", "MoonViTEncoderLayer"]
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
        self.vision_tower = MoonViT3dPretrainedModel(config.vision_config)
        self.mm_projector = KimiK3MultiModalProjector(config)
        self.language_model = KimiLinearForCausalLM(config.text_config)
        self.media_placeholder_token_id = config.media_placeholder_token_id
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Linear:
        return self.language_model.lm_head

    def get_image_features(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """-> [n_image_tokens, text hidden] (one row per merged patch group, images in order)."""
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws.reshape(-1, 3)))

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

    def embed(self, input_ids: torch.LongTensor, pixel_values: torch.Tensor | None = None,
              grid_thws: torch.Tensor | None = None) -> torch.Tensor:
        inputs_embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            if grid_thws is None:
                raise ValueError("pixel_values given without grid_thws")
            inputs_embeds = self.merge_image_features(inputs_embeds, input_ids,
                                                      self.get_image_features(pixel_values, grid_thws))
        return inputs_embeds

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        grid_thws: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KimiDynamicCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids, pixel_values, grid_thws)
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
    "KimiMTPLayer",
    "KimiDeltaAttention",
    "KimiMLAAttention",
    "KimiSparseMoeBlock",
    "KimiMoEGate",
    "KimiBlockSparseMLP",
    "KimiMLP",
    "KimiRMSNorm",
    "KimiDynamicCache",
    "MoonViT3dPretrainedModel",
    "KimiK3MultiModalProjector",
]
