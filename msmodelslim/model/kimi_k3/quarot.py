"""QuaRot maps of Kimi-K3 / Kimi-Linear: which norms fuse into which readers and which weights each space rotates.

Works on the stand-in remote code (`block_sparse_moe`, KDA with `f_a_proj` on the attention, optional latent
projections) and on transformers' native Kimi-Linear (`mlp` MoE, KDA `forget_gate.f_a_proj`): the variant is read
from attribute names, never class names. Routed experts may be a ModuleList or, under expert parallelism, a
ModuleDict holding only this rank's experts; every expert present is listed, so the latent rotation (one seeded Q)
is the same on every rank whichever experts it holds.
"""

from __future__ import annotations

from torch import nn

from msmodelslim.model.base import Unit
from msmodelslim.processor.quarot import KV_LORA, LATENT, MLA_V, FuseNorm, QuaRotPlan, Rotate
from msmodelslim.processor.spans import Span


def quarot_plan(unit: Unit, module: nn.Module) -> QuaRotPlan:
    """The QuaRot plan of one unit (live names relative to `module`)."""
    if unit.kind == "embed":
        return QuaRotPlan(rotate=[Rotate("embed_tokens", "in")])
    if unit.kind == "vision":  # the projector's last linear writes into the text residual stream
        return QuaRotPlan(rotate=[Rotate("mm_projector.linear_2", "out")])
    if unit.kind == "head":
        return QuaRotPlan(fuse=[FuseNorm("norm", ("lm_head",))], rotate=[Rotate("lm_head", "in")])
    if unit.kind == "decoder":
        return decoder_plan(module)
    raise ValueError(f"quarot_plan: unit {unit.name} has unknown kind {unit.kind!r}")


def decoder_plan(layer: nn.Module) -> QuaRotPlan:
    attn_readers, attn_plan = attention_plan(layer.self_attn, "self_attn")
    ffn_name = "block_sparse_moe" if hasattr(layer, "block_sparse_moe") else "mlp"
    ffn_readers, ffn_plan = ffn_plan_of(getattr(layer, ffn_name), ffn_name)
    plan = QuaRotPlan(
        fuse=[FuseNorm("input_layernorm", attn_readers), FuseNorm("post_attention_layernorm", ffn_readers)],
        rotate=[Rotate(r, "in") for r in attn_readers + ffn_readers],
    )
    for part in (attn_plan, ffn_plan):
        plan.fuse += part.fuse
        plan.rotate += part.rotate
        plan.online += part.online
    return plan


def attention_plan(attn: nn.Module, p: str) -> tuple[tuple[str, ...], QuaRotPlan]:
    """(readers of the normed residual, the rest of the attention's plan)."""
    if hasattr(attn, "kv_a_proj_with_mqa"):
        return mla_plan(attn, p)
    if hasattr(attn, "o_norm"):
        f_a = "f_a_proj" if hasattr(attn, "f_a_proj") else "forget_gate.f_a_proj"
        readers = tuple(f"{p}.{n}" for n in ("q_proj", "k_proj", "v_proj", f_a, "g_a_proj", "b_proj"))
        return readers, QuaRotPlan(rotate=[Rotate(f"{p}.o_proj", "out")])
    raise ValueError(f"{p}: neither MLA (kv_a_proj_with_mqa) nor KDA (o_norm) attention: {type(attn).__name__}")


def mla_plan(attn: nn.Module, p: str) -> tuple[tuple[str, ...], QuaRotPlan]:
    """MLA: hidden readers q (or q_a) and kv_a; writer o_proj. Two exact inner rotations:
    kv_lora   kv_a non-rope rows (out) -> RMSNorm (gamma fused into kv_b first) -> kv_b columns (in);
              the rope rows of kv_a (k_rot) stay unrotated;
    mla_v     kv_b V rows of each head (out) -> softmax(.) V (linear in V) -> o_proj columns of that head (in)."""
    q_reader = "q_proj" if getattr(attn, "q_proj", None) is not None else "q_a_proj"
    readers = (f"{p}.{q_reader}", f"{p}.kv_a_proj_with_mqa")
    heads = attn.num_heads
    kv_lora = attn.kv_a_layernorm.weight.shape[0]
    v_dim = attn.o_proj.weight.shape[1] // heads
    nope = attn.kv_b_proj.weight.shape[0] // heads - v_dim
    plan = QuaRotPlan(
        fuse=[FuseNorm(f"{p}.kv_a_layernorm", (f"{p}.kv_b_proj",), space=KV_LORA)],
        rotate=[
            Rotate(f"{p}.o_proj", "out"),
            Rotate(f"{p}.kv_a_proj_with_mqa", "out", KV_LORA, Span(width=kv_lora)),
            Rotate(f"{p}.kv_b_proj", "in", KV_LORA),
            Rotate(f"{p}.kv_b_proj", "out", MLA_V, Span(width=v_dim, offset=nope, period=nope + v_dim, count=heads)),
            Rotate(f"{p}.o_proj", "in", MLA_V, Span(width=v_dim, period=v_dim, count=heads)),
        ],
    )
    return readers, plan


def expert_names(experts: nn.Module, p: str) -> list[str]:
    """Live names of the routed experts present (ModuleList or EP-local ModuleDict keyed by expert index)."""
    names = []
    for key, expert in experts.named_children():
        if not all(isinstance(getattr(expert, w, None), nn.Linear) for w in ("w1", "w2", "w3")):
            raise ValueError(f"{p}.{key}: routed experts must be per-expert modules with w1/w2/w3 nn.Linear "
                             f"(fused 3-D experts must be converted first), got {type(expert).__name__}")
        names.append(f"{p}.{key}")
    return names


def ffn_plan_of(ffn: nn.Module, p: str) -> tuple[tuple[str, ...], QuaRotPlan]:
    """(readers of the normed residual, the rest of the FFN's plan) for a dense MLP or a (latent) MoE."""
    if not hasattr(ffn, "experts"):
        readers = (f"{p}.gate_proj", f"{p}.up_proj")
        return readers, QuaRotPlan(rotate=[Rotate(f"{p}.down_proj", "out")], online=[f"{p}.down_proj"])

    experts = expert_names(ffn.experts, f"{p}.experts")
    readers = [f"{p}.gate"]  # the router reads the normed residual too (float, rotated all the same)
    plan = QuaRotPlan()
    if getattr(ffn, "shared_experts", None) is not None:
        s = f"{p}.shared_experts"
        readers += [f"{s}.gate_proj", f"{s}.up_proj"]
        plan.rotate.append(Rotate(f"{s}.down_proj", "out"))
        plan.online.append(f"{s}.down_proj")
    expert_in = [f"{e}.{w}" for e in experts for w in ("w1", "w3")]
    expert_out = [f"{e}.w2" for e in experts]
    if getattr(ffn, "latent_down_proj", None) is not None:
        readers.append(f"{p}.latent_down_proj")
        plan.rotate.append(Rotate(f"{p}.latent_up_proj", "out"))
        plan.rotate += [Rotate(f"{p}.latent_down_proj", "out", LATENT), Rotate(f"{p}.latent_up_proj", "in", LATENT)]
        plan.rotate += [Rotate(n, "in", LATENT) for n in expert_in] + [Rotate(n, "out", LATENT) for n in expert_out]
    else:  # plain Kimi-Linear MoE: experts read and write the residual stream directly
        readers += expert_in
        plan.rotate += [Rotate(n, "out") for n in expert_out]
    plan.online += expert_out
    return tuple(readers), plan
