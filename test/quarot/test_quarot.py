"""QuaRot processor on Kimi models: a rotated but unquantized model computes the same logits.

Reference: the same float32 model before the processor ran (units processed one by one in runner order, as the
layer-wise runner does). Tolerance: relative RMS logit error < 2e-5 (fp32 rounding of reordered sums; a wrong
sign, transpose or missed reader gives errors of order 1). Exact-structure checks (online rotation, EP shards,
MLA rope rows) compare against float64 recomputations with tolerance 1e-5 relative or bit equality where the
computation is the same.
"""

from __future__ import annotations

import copy

import pytest
import torch
from kimi_test_models import MINI, kimi_linear_mini, mini_tokens, native_kimi_linear, standin_inputs, standin_vlm
from kimi_units import (
    native_torch_kernels,
    per_expert_modules,
    process_units,
    rel_err,
    standin_cpu_kernels,
    unit_modules,
)
from torch.nn import functional as F

from msmodelslim.core.dist import SINGLE
from msmodelslim.model.kimi_k3.layout import KimiLayout
from msmodelslim.ops.hadamard import orthogonal_hadamard, random_hadamard
from msmodelslim.pipeline.answers import run_processor
from msmodelslim.processor.base import UnitContext
from msmodelslim.processor.quarot import ONLINE_BUFFER, QuaRotConfig, QuaRotProcessor, space_seed

TOL = 2e-5


def logits_of(model, samples):
    with torch.no_grad():
        return [model(**s, use_cache=False).logits for s in samples]


def quarot(adapter, **kw) -> QuaRotProcessor:
    cfg = QuaRotConfig(**kw)
    cfg.validate()
    return QuaRotProcessor(cfg)


@pytest.mark.parametrize("experts", ["ModuleList", "ModuleDict"])
@pytest.mark.parametrize("online_down", [True, False])
def test_standin_vlm_logits_unchanged_by_quarot(experts, online_down):
    model, pkg = standin_vlm()
    # text only: Kimi-K3's projector ends in an RMSNorm, so image tokens cannot enter a rotated residual stream
    # (the practices keep it unrotated; test_adapter_invariance.py runs images with those settings)
    samples = standin_inputs(model)[1:]
    with standin_cpu_kernels(pkg.modeling_kimi_k3):
        if experts == "ModuleDict":
            ctx = per_expert_modules(model, model.config.text_config)
        else:
            ctx = torch.no_grad()  # the remote code's own ModuleList
        with ctx:
            ref = logits_of(model, samples)
            embed_before = model.get_input_embeddings().weight.clone()
            adapter = KimiLayout(model)
            proc = quarot(adapter, online_down=online_down)
            process_units(adapter, [proc], lambda: logits_of(model, samples))
            out = logits_of(model, samples)
    assert rel_err(model.get_input_embeddings().weight, embed_before) > 0.5  # the stream really is rotated
    for o, r in zip(out, ref):
        assert rel_err(o, r) < TOL
    spaces = proc.describe()["quarot"]["spaces"]
    # no mla_v: the MLA output gate (o * sigmoid(g), elementwise) does not commute with a per-head rotation
    assert {"hidden:96", "latent:80", "kv_lora:40"} <= set(spaces) and "mla_v:24" not in spaces


def test_native_kimi_linear_logits_unchanged_by_quarot():
    model = native_kimi_linear()
    samples = [{"input_ids": torch.randint(3, 256, (2, 37), generator=torch.Generator().manual_seed(1))}]
    with native_torch_kernels(), per_expert_modules(model, model.config):
        ref = logits_of(model, samples)
        adapter = KimiLayout(model)
        proc = quarot(adapter, online_down=True, seed=5)
        process_units(adapter, [proc], lambda: logits_of(model, samples))
        out = logits_of(model, samples)
        ffn = model.model.layers[1].mlp
        assert hasattr(ffn.experts["3"].w2, ONLINE_BUFFER) and hasattr(ffn.shared_experts.down_proj, ONLINE_BUFFER)
    assert rel_err(out[0], ref[0]) < TOL
    assert set(proc.describe()["quarot"]["online_rotations"]["sizes"]) == {"48", "112"}


@pytest.mark.skipif(not MINI.is_dir(), reason=f"{MINI} not available")
def test_kimi_linear_mini_logits_unchanged_by_quarot(tmp_path):
    """The real trained checkpoint on real text (128 tokens of the Python tutorial)."""
    model = kimi_linear_mini(tmp_path)
    samples = [{"input_ids": mini_tokens(128, offset=1000)}]
    with native_torch_kernels(), per_expert_modules(model, model.config):
        ref = logits_of(model, samples)
        adapter = KimiLayout(model)
        process_units(adapter, [quarot(adapter, online_down=True)], lambda: logits_of(model, samples))
        out = logits_of(model, samples)
    assert rel_err(out[0], ref[0]) < TOL
    assert (out[0].argmax(-1) == ref[0].argmax(-1)).float().mean() == 1.0


def test_online_rotation_convention_matches_quant_linear():
    """W' = W T^T with buffer online_rotation = T; x @ T^T @ W'^T == x @ W^T (float64 reference, 1e-5 rel)."""
    from msmodelslim.processor.quarot import rotate_online
    from msmodelslim.quant.modules import apply_online_rotation

    lin = torch.nn.Linear(48, 16, bias=False)
    w = lin.weight.detach().double().clone()
    t = orthogonal_hadamard(48).float()
    rotate_online(lin, t)
    assert torch.equal(lin.online_rotation, t)
    x = torch.randn(5, 48)
    ref = x.double() @ w.T
    assert rel_err(F.linear(apply_online_rotation(x, lin.online_rotation), lin.weight), ref) < 1e-5
    assert rel_err(lin(x), ref) < 1e-5  # the float pre-hook rotates the input until a QuantLinear takes over
    assert ONLINE_BUFFER not in lin.state_dict()  # one shared T per size; the saver writes it explicitly
    with pytest.raises(ValueError, match="already carries"):
        rotate_online(lin, t)


def _moe_layer_unit(model):
    adapter = KimiLayout(model)
    unit, layer = next((u, m) for u, m in unit_modules(adapter) if u.name == "layers.1")
    return adapter, unit, layer


def test_latent_rotation_is_identical_on_every_expert_parallel_shard():
    """An expert's rotated weights do not depend on which other experts the rank holds (bit-exact)."""
    model, pkg = standin_vlm()
    with per_expert_modules(model, model.config.text_config):
        full = copy.deepcopy(model)
        shard = copy.deepcopy(model)
        experts = shard.language_model.model.layers[1].block_sparse_moe.experts
        for key in [k for k in experts if int(k) < 8]:
            del experts[key]  # rank 1 of 2: experts 8..15
        results = []
        for m in (full, shard):
            adapter, unit, layer = _moe_layer_unit(m)
            proc = quarot(adapter, online_down=True)
            run_processor(proc, UnitContext(unit, layer, adapter, SINGLE, run_samples=lambda: None))
            results.append(layer.block_sparse_moe)
    a, b = results
    for key in ("8", "15"):
        for w in ("w1", "w2", "w3"):
            assert torch.equal(getattr(a.experts[key], w).weight, getattr(b.experts[key], w).weight)
    assert torch.equal(a.routed_expert_down_proj.weight, b.routed_expert_down_proj.weight)
    assert torch.equal(a.routed_expert_up_proj.weight, b.routed_expert_up_proj.weight)


def test_mla_kv_a_rope_rows_take_only_the_hidden_rotation():
    """kv_a_proj_with_mqa: rope rows = W_rope Q_hidden; non-rope rows = Q_kv^T W_nope Q_hidden (float64, 1e-5)."""
    model, _ = standin_vlm()
    adapter = KimiLayout(model)
    unit, layer = next((u, m) for u, m in unit_modules(adapter) if u.name == "layers.3")
    attn = layer.self_attn
    assert hasattr(attn, "kv_a_proj_with_mqa")
    gamma = layer.input_layernorm.weight.detach().double().clone()
    w = attn.kv_a_proj_with_mqa.weight.detach().double().clone()
    proc = quarot(adapter)
    run_processor(proc, UnitContext(unit, layer, adapter, SINGLE, run_samples=lambda: None))
    q_h = random_hadamard(96, space_seed(0, "hidden", 96))
    q_kv = random_hadamard(40, space_seed(0, "kv_lora", 40))
    fused = w * gamma
    new = attn.kv_a_proj_with_mqa.weight.double()
    assert rel_err(new[40:], fused[40:] @ q_h) < 1e-5
    assert rel_err(new[:40], q_kv.T @ fused[:40] @ q_h) < 1e-5
    assert torch.equal(attn.kv_a_layernorm.weight, torch.ones_like(attn.kv_a_layernorm.weight))


@pytest.mark.parametrize("field,value", [("seed", -1), ("block_size", 23 * 8), ("online_down", 1),
                                         ("compute_dtype", "float16")])
def test_config_rejects_bad_values(field, value):
    """Built in code, a config is checked as a practice's is (types first, then ranges): the error names the field."""
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        QuaRotConfig(**{field: value})


def test_quarot_config_parses_from_practice_yaml_schema():
    from msmodelslim.core.config import build_dataclass

    cfg = build_dataclass(QuaRotConfig, {"seed": 3, "online_down": True, "rotate_latent": False, "block_size": 64})
    assert (cfg.seed, cfg.online_down, cfg.rotate_latent, cfg.rotate_mla, cfg.block_size) == (3, True, False, True, 64)
    with pytest.raises(Exception, match="rotate_lantent"):
        build_dataclass(QuaRotConfig, {"rotate_lantent": True})


def test_rotating_a_quantized_linear_is_a_clear_error():
    from msmodelslim.quant.modules import QuantLinear

    model, _ = standin_vlm()
    adapter, unit, layer = _moe_layer_unit(model)
    layer.self_attn.o_proj = QuantLinear.from_linear(layer.self_attn.o_proj, "W8A8_DYNAMIC", weight_method="minmax")
    with pytest.raises(ValueError, match="self_attn.o_proj has no float weight"):
        run_processor(quarot(adapter), UnitContext(unit, layer, adapter, SINGLE, run_samples=lambda: None))
