"""FA3 in the absorbed MLA: where Ascend's MLA FlashAttention kernel sees Q, K and V, and a forward that has them.

The kernel never expands the latent cache into per-head keys and values (vllm-ascend 0.23 `attention/mla_v1.py`):
- Q: the query's no-position part absorbed into the latent space, q_nope @ W_uk -> [batch, heads, seq, kv_lora_rank]
  (`fa_q`; vllm-ascend 0.23 quantizes it at run time, `query_quant_mode` 3);
- K: the normalized latent kv_a_layernorm(kv) [batch, 1, seq, kv_lora_rank] is the cache (`fa_k`; int8 on A2/A3
  with fa_k's scale, `quant_kscale`); the rope part k_pe stays in the model dtype;
- V: the same latent cache, dequantized with fa_k's scale too (`dequant_scale_value`); `fa_v` observes it.
Then scores = (q_abs @ c^T + q_pe @ k_pe^T) * softmax_scale, P = softmax, out = (P @ c) @ W_uv^T per head.

`inject_fa3_placeholders` puts `fa_q`, `fa_k`, `fa_v` placeholders into the checkpoint's own MLA modules and
patches their class's forward (recorded in a PatchHandle, undone with the adapter's other patches) to the absorbed
form while the points are there; without them the class's own forward runs. Placeholder ratios are msModelSlim's
(0.9999 of each head's values for Q and K, all of them for V: deepseek_v3 and kimi_k2_5 adapters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from msmodelslim.model.kimi_k3.runtime_patches import PatchHandle
from msmodelslim.quant.attention import FA3_BRANCHES, FA3QuantPlaceHolder

PLACEHOLDER_RATIOS = {"fa_q": 0.9999, "fa_k": 0.9999, "fa_v": 1.0}
OBSERVE_ONLY = {"fa_v"}  # V is the latent cache fa_k already quantized
_ORIGINAL = "_msmodelslim_fa3_original"


def is_mla(module: nn.Module) -> bool:
    """A DeepSeek-style MLA (the stand-in's KimiMLAAttention, transformers' KimiLinearAttention)."""
    return all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))


def has_fa3_points(module: nn.Module) -> bool:
    return all(b in module._modules for b in FA3_BRANCHES)


def _allowed(mask: torch.Tensor | None, seq: int, device: torch.device) -> torch.Tensor:
    """SDPA's attn_mask for a prefill of `seq` tokens: causal, and the caller's mask as the model reads it -
    a 2-D padding mask [batch, seq] (the stand-in: padded keys hidden, a query always sees itself), or a 4-D
    boolean / additive mask (transformers' create_causal_mask), used as given."""
    if mask is not None and mask.dim() == 4:
        return mask
    idx = torch.arange(seq, device=device)
    causal = (idx[None, :] <= idx[:, None])[None, None]
    if mask is None:
        return causal
    keep = causal & mask[:, None, None, -seq:].bool()
    return keep | torch.eye(seq, dtype=torch.bool, device=device)[None, None]


def absorbed_mla_forward(attn: nn.Module, hidden_states: torch.Tensor,
                         attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The MLA output (before any tuple the class returns) computed in the absorbed form, through the FA3 points."""
    bsz, seq, _ = hidden_states.shape
    heads, nope, rope, v_dim = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    rank = attn.kv_lora_rank
    if getattr(attn, "q_lora_rank", None) is None:
        q = attn.q_proj(hidden_states)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q_nope, q_pe = torch.split(q.view(bsz, seq, heads, nope + rope).transpose(1, 2), [nope, rope], dim=-1)
    latent, k_pe = torch.split(attn.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    latent = attn.kv_a_layernorm(latent)

    kv_b = attn.kv_b_proj.weight.view(heads, nope + v_dim, rank).to(q.dtype)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [heads, nope, rank], [heads, v_dim, rank]
    q_abs = attn.fa_q(torch.matmul(q_nope, w_uk))  # [bsz, heads, seq, rank]
    cache = attn.fa_k(latent.unsqueeze(1))  # [bsz, 1, seq, rank]: the K cache, and the V side
    attn.fa_v(cache)

    query = torch.cat([q_abs, q_pe], dim=-1)
    key = torch.cat([cache, k_pe.view(bsz, 1, seq, rope)], dim=-1).expand(-1, heads, -1, -1)
    value = cache.expand(-1, heads, -1, -1)
    scale = getattr(attn, "softmax_scale", None) or attn.scaling
    mask = _allowed(attention_mask, seq, hidden_states.device)
    out_latent = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    out = torch.matmul(out_latent, w_uv.transpose(1, 2))  # [bsz, heads, seq, v_dim]
    out = out.transpose(1, 2).reshape(bsz, seq, heads * v_dim)
    gate = getattr(attn, "g_proj", None)
    if gate is not None:
        out = out * torch.sigmoid(gate(hidden_states))
    return attn.o_proj(out)


def _patch_class(handle: PatchHandle, cls: type, returns_weights: bool) -> None:
    if hasattr(cls.__dict__.get("forward"), _ORIGINAL):
        return
    original = cls.forward

    def forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: Any = None, **kwargs: Any) -> Any:
        if not has_fa3_points(self):
            return original(self, hidden_states, attention_mask, past_key_values, **kwargs)
        if past_key_values is not None:
            raise NotImplementedError(f"{cls.__name__} with FA3 points runs prefills without a cache only")
        out = absorbed_mla_forward(self, hidden_states, attention_mask)
        return (out, None) if returns_weights else out

    setattr(forward, _ORIGINAL, original)
    handle._set(cls, "forward", forward)


def remove_fa3_points(module: nn.Module) -> None:
    for sub in module.modules():
        if has_fa3_points(sub):
            for branch in FA3_BRANCHES:
                del sub._modules[branch]


def inject_fa3_placeholders(handle: PatchHandle, module: nn.Module, should_inject: Callable[[str], bool],
                            returns_weights: bool) -> list[str]:
    """Placeholders in every MLA of `module` whose live name `should_inject` accepts; returns those names.
    `returns_weights`: the class's forward returns (output, attention weights), as transformers' classes do."""
    injected = []
    for name, sub in list(module.named_modules()):
        if not is_mla(sub) or not should_inject(name):
            continue
        for branch in FA3_BRANCHES:
            heads = sub.num_heads if branch == "fa_q" else 1  # the query per head; one latent cache
            setattr(sub, branch, FA3QuantPlaceHolder(heads, PLACEHOLDER_RATIOS[branch], branch in OBSERVE_ONLY))
        _patch_class(handle, type(sub), returns_weights)
        injected.append(name)
    return injected
