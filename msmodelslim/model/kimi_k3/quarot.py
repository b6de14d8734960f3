"""QuaRot maps of Kimi-K3 / Kimi-Linear: which norms fuse into which readers and which weights each space rotates.

Works on Kimi-K3 as vLLM 0.33 builds it (attention residuals, latent MoE with its norm, q-LoRA MLA with the output
gate, full-rank KDA gate, MTP layers) and on transformers' native Kimi-Linear (`mlp` MoE, KDA
`forget_gate.f_a_proj`): the variant is read from attribute names, never class names. Routed experts may be a ModuleList or, under expert parallelism, a
ModuleDict holding only this rank's experts; every expert present is listed, so the latent rotation (one seeded Q)
is the same on every rank whichever experts it holds.
"""

from __future__ import annotations

from torch import nn

from msmodelslim.model.base import Unit
from msmodelslim.model.maps import KV_LORA, LATENT, MLA_V, AppendRotation, FuseNorm, QuaRotPlan, Rotate, Span

PROJECTOR_ROTATION = "rot_proj"  # vllm-ascend's name of the stored rotation after `mm_projector`


def quarot_plan(unit: Unit, module: nn.Module) -> QuaRotPlan:
    """The QuaRot plan of one unit (live names relative to `module`)."""
    if unit.kind == "embed":
        return QuaRotPlan(rotate=[Rotate("embed_tokens", "in")])
    if unit.kind == "vision":
        return vision_plan(module)
    if unit.kind == "head":
        plan = QuaRotPlan(fuse=[FuseNorm("norm", ("lm_head",))], rotate=[Rotate("lm_head", "in")])
        if hasattr(module, "output_attn_res_proj"):  # the output attention-residual mix reads every source
            plan.fuse.append(FuseNorm("output_attn_res_norm", ("output_attn_res_proj",)))
            plan.rotate.append(Rotate("output_attn_res_proj", "in"))
        return plan
    if unit.kind == "decoder":
        return decoder_plan(module)
    if unit.kind == "mtp":
        return mtp_plan(module)
    raise ValueError(f"quarot_plan: unit {unit.name} has unknown kind {unit.kind!r}")


def vision_plan(module: nn.Module) -> QuaRotPlan:
    """The projector writes the image tokens into the residual stream. A projector ending in a linear (Kimi-K2.5's
    patchmerger) rotates its output rows; Kimi-K3's patchmergerv2 ends in an RMSNorm, whose weight acts on the
    unrotated channels: RMSNorm(u) diag(w) Q is no RMSNorm of any rotated u, so no stored weight makes it exact.
    There the rotation is a stored linear after the norm, `mm_projector.rot_proj` [hidden, hidden], which
    vllm-ascend's Kimi-K3 class applies when the checkpoint carries it (`models/kimi_k3.py:1694-1711`, #14231)."""
    projector = module.mm_projector
    if getattr(projector, "post_norm", None) is not None:
        return QuaRotPlan(append=[AppendRotation("mm_projector", PROJECTOR_ROTATION, projector.post_norm.weight.shape[0])])
    last = "mm_projector.proj.2" if hasattr(projector, "proj") else "mm_projector.linear_2"
    return QuaRotPlan(rotate=[Rotate(last, "out")])


def attn_res_plan(layer: nn.Module) -> QuaRotPlan:
    """Attention residuals: each mix's logit RMSNorm(s; norm) . proj reads every stored block and the prefix, all in
    the residual space. The norm's weight is fused into the [1, H] projection, which is then rotated like any
    reader; the mix itself is linear in the sources, and its output norm is the layer norm fused as usual."""
    plan = QuaRotPlan()
    for name in ("self_attention_res", "mlp_res"):
        if hasattr(layer, f"{name}_proj"):
            plan.fuse.append(FuseNorm(f"{name}_norm", (f"{name}_proj",)))
            plan.rotate.append(Rotate(f"{name}_proj", "in"))
    return plan


def decoder_plan(layer: nn.Module) -> QuaRotPlan:
    attn_readers, attn_plan = attention_plan(layer.self_attn, "self_attn")
    ffn_name = "block_sparse_moe" if hasattr(layer, "block_sparse_moe") else "mlp"
    ffn_readers, ffn_plan = ffn_plan_of(getattr(layer, ffn_name), ffn_name)
    plan = QuaRotPlan(
        fuse=[FuseNorm("input_layernorm", attn_readers), FuseNorm("post_attention_layernorm", ffn_readers)],
        rotate=[Rotate(r, "in") for r in attn_readers + ffn_readers],
    )
    for part in (attn_plan, ffn_plan, attn_res_plan(layer)):
        plan.fuse += part.fuse
        plan.rotate += part.rotate
        plan.online += part.online
    return plan


def mtp_plan(layer: nn.Module) -> QuaRotPlan:
    """An MTP layer: eh_proj reads [enorm(e) | hnorm(h)] (both halves in the residual space: e from the rotated
    embedding table, h the main model's output) and writes the block's residual stream; the block is a standard
    decoder layer; shared_head.norm fuses into shared_head.head. (vLLM's proposer swaps shared_head.head for the
    target's lm_head, which carries model.norm's weight instead: exact only where the two norms are equal.)"""
    hidden = layer.enorm.weight.shape[0]
    plan = decoder_plan(layer)
    halves = Span(width=hidden, period=hidden, count=2)
    plan.fuse += [FuseNorm("enorm", ("eh_proj",), span=Span(width=hidden)),
                  FuseNorm("hnorm", ("eh_proj",), span=Span(width=hidden, offset=hidden)),
                  FuseNorm("shared_head.norm", ("shared_head.head",))]
    plan.rotate += [Rotate("eh_proj", "in", span=halves), Rotate("eh_proj", "out"), Rotate("shared_head.head", "in")]
    return plan


def attention_plan(attn: nn.Module, p: str) -> tuple[tuple[str, ...], QuaRotPlan]:
    """(readers of the normed residual, the rest of the attention's plan)."""
    if hasattr(attn, "kv_a_proj_with_mqa"):
        return mla_plan(attn, p)
    if hasattr(attn, "o_norm"):
        f_a = "f_a_proj" if hasattr(attn, "f_a_proj") else "forget_gate.f_a_proj"
        gate = "g_proj" if getattr(attn, "g_proj", None) is not None else "g_a_proj"  # full- or low-rank gate
        readers = tuple(f"{p}.{n}" for n in ("q_proj", "k_proj", "v_proj", f_a, gate, "b_proj"))
        return readers, QuaRotPlan(rotate=[Rotate(f"{p}.o_proj", "out")])
    raise ValueError(f"{p}: neither MLA (kv_a_proj_with_mqa) nor KDA (o_norm) attention: {type(attn).__name__}")


def mla_plan(attn: nn.Module, p: str) -> tuple[tuple[str, ...], QuaRotPlan]:
    """MLA: hidden readers q (or q_a), kv_a and the output gate g_proj; writer o_proj. Inner rotations:
    kv_lora   kv_a non-rope rows (out) -> RMSNorm (gamma fused into kv_b first) -> kv_b columns (in);
              the rope rows of kv_a (k_pe) stay unrotated;
    mla_v     kv_b V rows of each head (out) -> softmax(.) V (linear in V) -> o_proj columns of that head (in);
              not with the output gate: o * sigmoid(g) is elementwise, so it does not commute with a rotation."""
    q_reader = "q_proj" if getattr(attn, "q_proj", None) is not None else "q_a_proj"
    gated = getattr(attn, "g_proj", None) is not None
    readers = (f"{p}.{q_reader}", f"{p}.kv_a_proj_with_mqa") + ((f"{p}.g_proj",) if gated else ())
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
        ],
    )
    if not gated:
        plan.rotate += [
            Rotate(f"{p}.kv_b_proj", "out", MLA_V, Span(width=v_dim, offset=nope, period=nope + v_dim, count=heads)),
            Rotate(f"{p}.o_proj", "in", MLA_V, Span(width=v_dim, period=v_dim, count=heads)),
        ]
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
    if getattr(ffn, "routed_expert_down_proj", None) is not None:
        down, up = f"{p}.routed_expert_down_proj", f"{p}.routed_expert_up_proj"
        readers.append(down)
        plan.rotate.append(Rotate(up, "out"))
        if getattr(ffn, "routed_expert_norm", None) is not None:  # RMSNorm of the latent sum: fuse, then rotate
            plan.fuse.append(FuseNorm(f"{p}.routed_expert_norm", (up,), space=LATENT))
        plan.rotate += [Rotate(down, "out", LATENT), Rotate(up, "in", LATENT)]
        plan.rotate += [Rotate(n, "in", LATENT) for n in expert_in] + [Rotate(n, "out", LATENT) for n in expert_out]
    else:  # plain Kimi-Linear MoE: experts read and write the residual stream directly
        readers += expert_in
        plan.rotate += [Rotate(n, "out") for n in expert_out]
    plan.online += expert_out
    return tuple(readers), plan
