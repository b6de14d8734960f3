"""IterSmooth subgraphs of Kimi-K3 / Kimi-Linear (data for processor.iter_smooth).

Per decoder layer:
- attention, KDA: input_layernorm -> q/k/v/f_a/g(_a)/b_proj (norm-linear); f_a -> f_b and, with the low-rank
  output gate, g_a -> g_b (linear-linear); o_norm -> o_proj (gated-norm-linear: o_norm's weight [V] is shared by the H heads, so one scale
  per V channel, the max over heads of both statistics).
- attention, MLA: input_layernorm -> q_proj or q_a_proj, kv_a_proj_with_mqa, g_proj (norm-linear); q_a_layernorm ->
  q_b_proj and kv_a_layernorm -> kv_b_proj (norm-linear); kv_b_proj V rows of each head -> o_proj (ov; attention is
  linear in V and the output gate is elementwise).
- FFN: post_attention_layernorm -> shared experts gate/up, routed_expert_down_proj (or every expert's w1/w3 without
  a latent space), dense gate/up, with the router compensated as a float reader (norm-linear); up -> down inside
  every expert, shared expert and dense MLP while the up branch is linear (up-down; not with SiTU's linear_beta);
  routed_expert_down_proj -> every expert's w1/w3 (linear-linear); routed_expert_norm -> routed_expert_up_proj
  (norm-linear), or every expert's w2 -> routed_expert_up_proj without the norm (linear-linear).
With attention residuals the layer norms are the output norms of the mixes, so the norm-linear subgraphs are
unchanged; the res projections stay float and unsmoothed.
Subgraphs whose readers are the routed experts are marked `across_ranks` (EP-local experts, one scale for all).
"""

from __future__ import annotations

from torch import nn

from msmodelslim.model.base import Unit
from msmodelslim.model.kimi_k3.quarot import expert_names
from msmodelslim.model.maps import (
    GATED_NORM_LINEAR,
    LINEAR_LINEAR,
    NORM_LINEAR,
    OV,
    UP_DOWN,
    Span,
    Subgraph,
)


def smooth_subgraphs(unit: Unit, module: nn.Module) -> list[Subgraph]:
    """The smoothing subgraphs of one unit (decoder and MTP layers; an MTP layer's eh_proj stays float)."""
    if unit.kind not in ("decoder", "mtp"):
        return []
    ffn_name = "block_sparse_moe" if hasattr(module, "block_sparse_moe") else "mlp"
    return attention_subgraphs(module.self_attn, "self_attn") + ffn_subgraphs(getattr(module, ffn_name), ffn_name)


def attention_subgraphs(attn: nn.Module, p: str) -> list[Subgraph]:
    if hasattr(attn, "kv_a_proj_with_mqa"):
        heads = attn.num_heads
        v_dim = attn.o_proj.weight.shape[1] // heads
        nope = attn.kv_b_proj.weight.shape[0] // heads - v_dim
        readers = (f"{p}.kv_a_proj_with_mqa",) + ((f"{p}.g_proj",) if getattr(attn, "g_proj", None) is not None else ())
        out = []
        if getattr(attn, "q_proj", None) is not None:
            readers = (f"{p}.q_proj",) + readers
        else:  # q-LoRA
            readers = (f"{p}.q_a_proj",) + readers
            out.append(Subgraph(NORM_LINEAR, (f"{p}.q_a_layernorm",), (f"{p}.q_b_proj",)))
        # ov stays exact with the output gate: o * sigmoid(g) is elementwise, so a per-channel scale commutes
        return out + [
            Subgraph(NORM_LINEAR, ("input_layernorm",), readers),
            Subgraph(NORM_LINEAR, (f"{p}.kv_a_layernorm",), (f"{p}.kv_b_proj",)),
            Subgraph(OV, (f"{p}.kv_b_proj",), (f"{p}.o_proj",),
                     source_rows=Span(width=v_dim, offset=nope, period=nope + v_dim, count=heads)),
        ]
    if hasattr(attn, "o_norm"):
        gate = f"{p}." if hasattr(attn, "f_a_proj") else f"{p}.forget_gate."
        full_rank = getattr(attn, "g_proj", None) is not None
        readers = tuple(f"{p}.{n}" for n in ("q_proj", "k_proj", "v_proj")) + (
            f"{gate}f_a_proj", f"{p}.g_proj" if full_rank else f"{p}.g_a_proj", f"{p}.b_proj")
        heads = attn.o_proj.weight.shape[1] // attn.o_norm.weight.shape[0]
        out = [Subgraph(NORM_LINEAR, ("input_layernorm",), readers),
               Subgraph(LINEAR_LINEAR, (f"{gate}f_a_proj",), (f"{gate}f_b_proj",))]
        if not full_rank:
            out.append(Subgraph(LINEAR_LINEAR, (f"{p}.g_a_proj",), (f"{p}.g_b_proj",)))
        return out + [Subgraph(GATED_NORM_LINEAR, (f"{p}.o_norm",), (f"{p}.o_proj",), heads=heads)]
    raise ValueError(f"{p}: neither MLA (kv_a_proj_with_mqa) nor KDA (o_norm) attention: {type(attn).__name__}")


def up_is_linear(mlp: nn.Module) -> bool:
    """SiTU with linear_beta clamps the up branch (linear_beta * tanh(up / linear_beta)): scaling up's rows then
    no longer passes through to down's columns, so up-down smoothing would change the function."""
    return getattr(getattr(mlp, "act_fn", None), "linear_beta", None) is None


def mlp_up_down(mlp: nn.Module, p: str) -> list[Subgraph]:
    return [Subgraph(UP_DOWN, (f"{p}.up_proj",), (f"{p}.down_proj",))] if up_is_linear(mlp) else []


def ffn_subgraphs(ffn: nn.Module, p: str) -> list[Subgraph]:
    norm = ("post_attention_layernorm",)
    if not hasattr(ffn, "experts"):
        return [Subgraph(NORM_LINEAR, norm, (f"{p}.gate_proj", f"{p}.up_proj")), *mlp_up_down(ffn, p)]

    experts = expert_names(ffn.experts, f"{p}.experts")
    expert_in = tuple(f"{e}.{w}" for e in experts for w in ("w1", "w3"))
    out = [Subgraph(UP_DOWN, (f"{e}.w3",), (f"{e}.w2",))
           for e, module in zip(experts, ffn.experts.children()) if up_is_linear(module)]
    readers: tuple[str, ...] = ()
    if getattr(ffn, "shared_experts", None) is not None:
        readers += (f"{p}.shared_experts.gate_proj", f"{p}.shared_experts.up_proj")
        out += mlp_up_down(ffn.shared_experts, f"{p}.shared_experts")
    router = (f"{p}.gate",)
    if getattr(ffn, "routed_expert_down_proj", None) is not None:
        down, up = f"{p}.routed_expert_down_proj", f"{p}.routed_expert_up_proj"
        out += [
            Subgraph(NORM_LINEAR, norm, readers + (down,), float_targets=router),
            Subgraph(LINEAR_LINEAR, (down,), expert_in, across_ranks=True),
        ]
        if getattr(ffn, "routed_expert_norm", None) is not None:  # the latent sum is normed before up_proj
            out.append(Subgraph(NORM_LINEAR, (f"{p}.routed_expert_norm",), (up,)))
        else:
            out.append(Subgraph(LINEAR_LINEAR, tuple(f"{e}.w2" for e in experts), (up,)))
    else:
        out.append(Subgraph(NORM_LINEAR, norm, readers + expert_in, float_targets=router, across_ranks=True))
    return out
