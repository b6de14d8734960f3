"""IterSmooth subgraphs of Kimi-K3 / Kimi-Linear (data for processor.iter_smooth).

Per decoder layer:
- attention, KDA: input_layernorm -> q/k/v/f_a/g_a/b_proj (norm-linear); f_a -> f_b and g_a -> g_b (linear-linear,
  low-rank pairs); o_norm -> o_proj (gated-norm-linear: o_norm's weight [V] is shared by the H heads, so one scale
  per V channel, the max over heads of both statistics).
- attention, MLA: input_layernorm -> q_proj, kv_a_proj_with_mqa (norm-linear); kv_a_layernorm -> kv_b_proj
  (norm-linear); kv_b_proj V rows of each head -> o_proj (ov; attention is linear in V).
- FFN: post_attention_layernorm -> shared experts gate/up, latent_down (or every expert's w1/w3 without latent
  projections), dense gate/up, with the router compensated as a float reader (norm-linear); up -> down inside every
  expert, shared expert and dense MLP (up-down); latent_down -> every expert's w1/w3 and every expert's w2 ->
  latent_up (linear-linear).
Subgraphs whose readers are the routed experts are marked `across_ranks` (EP-local experts, one scale for all).
"""

from __future__ import annotations

from torch import nn

from msmodelslim.model.base import Unit
from msmodelslim.model.kimi_k3.quarot import expert_names
from msmodelslim.processor.iter_smooth import (
    GATED_NORM_LINEAR,
    LINEAR_LINEAR,
    NORM_LINEAR,
    OV,
    UP_DOWN,
    Subgraph,
)
from msmodelslim.processor.spans import Span


def smooth_subgraphs(unit: Unit, module: nn.Module) -> list[Subgraph]:
    """The smoothing subgraphs of one unit (none outside decoder layers)."""
    if unit.kind != "decoder":
        return []
    ffn_name = "block_sparse_moe" if hasattr(module, "block_sparse_moe") else "mlp"
    return attention_subgraphs(module.self_attn, "self_attn") + ffn_subgraphs(getattr(module, ffn_name), ffn_name)


def attention_subgraphs(attn: nn.Module, p: str) -> list[Subgraph]:
    if hasattr(attn, "kv_a_proj_with_mqa"):
        q = "q_proj" if getattr(attn, "q_proj", None) is not None else "q_a_proj"
        heads = attn.num_heads
        v_dim = attn.o_proj.weight.shape[1] // heads
        nope = attn.kv_b_proj.weight.shape[0] // heads - v_dim
        return [
            Subgraph(NORM_LINEAR, ("input_layernorm",), (f"{p}.{q}", f"{p}.kv_a_proj_with_mqa")),
            Subgraph(NORM_LINEAR, (f"{p}.kv_a_layernorm",), (f"{p}.kv_b_proj",)),
            Subgraph(OV, (f"{p}.kv_b_proj",), (f"{p}.o_proj",),
                     source_rows=Span(width=v_dim, offset=nope, period=nope + v_dim, count=heads)),
        ]
    if hasattr(attn, "o_norm"):
        gate = f"{p}." if hasattr(attn, "f_a_proj") else f"{p}.forget_gate."
        readers = tuple(f"{p}.{n}" for n in ("q_proj", "k_proj", "v_proj")) + (
            f"{gate}f_a_proj", f"{p}.g_a_proj", f"{p}.b_proj")
        heads = attn.o_proj.weight.shape[1] // attn.o_norm.weight.shape[0]
        return [
            Subgraph(NORM_LINEAR, ("input_layernorm",), readers),
            Subgraph(LINEAR_LINEAR, (f"{gate}f_a_proj",), (f"{gate}f_b_proj",)),
            Subgraph(LINEAR_LINEAR, (f"{p}.g_a_proj",), (f"{p}.g_b_proj",)),
            Subgraph(GATED_NORM_LINEAR, (f"{p}.o_norm",), (f"{p}.o_proj",), heads=heads),
        ]
    raise ValueError(f"{p}: neither MLA (kv_a_proj_with_mqa) nor KDA (o_norm) attention: {type(attn).__name__}")


def mlp_up_down(p: str) -> Subgraph:
    return Subgraph(UP_DOWN, (f"{p}.up_proj",), (f"{p}.down_proj",))


def ffn_subgraphs(ffn: nn.Module, p: str) -> list[Subgraph]:
    norm = ("post_attention_layernorm",)
    if not hasattr(ffn, "experts"):
        return [Subgraph(NORM_LINEAR, norm, (f"{p}.gate_proj", f"{p}.up_proj")), mlp_up_down(p)]

    experts = expert_names(ffn.experts, f"{p}.experts")
    expert_in = tuple(f"{e}.{w}" for e in experts for w in ("w1", "w3"))
    out = [Subgraph(UP_DOWN, (f"{e}.w3",), (f"{e}.w2",)) for e in experts]
    readers: tuple[str, ...] = ()
    if getattr(ffn, "shared_experts", None) is not None:
        readers += (f"{p}.shared_experts.gate_proj", f"{p}.shared_experts.up_proj")
        out.append(mlp_up_down(f"{p}.shared_experts"))
    router = (f"{p}.gate",)
    if getattr(ffn, "latent_down_proj", None) is not None:
        out += [
            Subgraph(NORM_LINEAR, norm, readers + (f"{p}.latent_down_proj",), float_targets=router),
            Subgraph(LINEAR_LINEAR, (f"{p}.latent_down_proj",), expert_in, across_ranks=True),
            Subgraph(LINEAR_LINEAR, tuple(f"{e}.w2" for e in experts), (f"{p}.latent_up_proj",)),
        ]
    else:
        out.append(Subgraph(NORM_LINEAR, norm, readers + expert_in, float_targets=router, across_ranks=True))
    return out
