"""IterSmooth processor on Kimi models.

Invariance: smoothing alone (no quantization) leaves the logits of the float32 model unchanged; reference = the same
model before the processor, tolerance relative RMS logit error < 2e-5 (fp32 rounding; a scale folded on one side
only gives errors of order 1). Scales are checked against the SmoothQuant formula in float64 (rel 1e-6), unrouted
experts bit-for-bit, and the expert-parallel reduction by simulating two ranks against the one-device run
(bit-exact: max reductions are exact).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from kimi_test_models import MINI, kimi_linear_mini, mini_tokens, native_kimi_linear, standin_inputs, standin_vlm
from kimi_units import (
    native_torch_kernels,
    per_expert_modules,
    process_units,
    rel_err,
    standin_cpu_kernels,
    unit_modules,
)

from msmodelslim.core.dist import DistContext
from msmodelslim.core.requests import Observe
from msmodelslim.model.kimi_k3.layout import KimiLayout
from msmodelslim.model.maps import SUBGRAPH_TYPES
from msmodelslim.pipeline.answers import Carried, observe, run_processor
from msmodelslim.processor.base import UnitContext
from msmodelslim.processor.iter_smooth import IterSmoothConfig, IterSmoothProcessor, smooth_scale
from msmodelslim.processor.quarot import QuaRotConfig, QuaRotProcessor

TOL = 2e-5


def logits_of(model, samples):
    with torch.no_grad():
        return [model(**s, use_cache=False).logits for s in samples]


def smoother(adapter, **kw) -> IterSmoothProcessor:
    cfg = IterSmoothConfig.build(**kw)
    cfg.validate()
    return IterSmoothProcessor(cfg)


def test_smooth_scale_formula_and_no_information_channels():
    x = torch.tensor([4.0, 0.0, 2.0, 1e-30, 3.0])
    w = torch.tensor([0.5, 1.0, 0.0, 2.0, 1.0])
    s = smooth_scale(x, w, alpha=0.9, scale_min=1e-5)
    assert abs(float(s[0]) - 4.0**0.9 / 0.5**0.1) < 1e-6 * 4.0  # float32 on the device, rel ~1e-7
    assert float(s[1]) == 1.0 and float(s[2]) == 1.0  # no activation / no weight: untouched
    assert float(s[3]) == float(torch.tensor(1e-5))  # clamped (the float32 value of scale_min)
    assert torch.isfinite(s).all()


def test_standin_vlm_logits_unchanged_by_smoothing():
    model, pkg = standin_vlm()
    samples = standin_inputs(model)
    with standin_cpu_kernels(pkg.modeling_kimi_k3), per_expert_modules(model, model.config.text_config):
        ref = logits_of(model, samples)
        adapter = KimiLayout(model)
        gamma = model.language_model.model.layers[1].post_attention_layernorm.weight.detach().clone()
        proc = smoother(adapter)
        process_units(adapter, [proc], lambda: logits_of(model, samples))
        out = logits_of(model, samples)
    for o, r in zip(out, ref):
        assert rel_err(o, r) < TOL
    assert rel_err(model.language_model.model.layers[1].post_attention_layernorm.weight, gamma) > 0.1
    counts = proc.counts
    assert set(counts) == set(SUBGRAPH_TYPES)  # every kind of subgraph ran
    assert counts["gated-norm-linear"] == 3 and counts["ov"] == 1


def _all_w4a8(adapter) -> dict[str, str]:
    """A linear_quant plan giving every linear of the model W4A8 (what the search reads the readers' bits from)."""
    return {adapter.checkpoint_name(unit, name): "W4A8_DYNAMIC" for unit, module in unit_modules(adapter)
            for name, mod in module.named_modules() if isinstance(mod, torch.nn.Linear)}


def test_searched_smoothing_keeps_the_logits_and_records_its_choices():
    """search: true applies, per subgraph, no smoothing or one alpha: still an exact transform (logits rel 2e-5
    against the model before), and every subgraph's choice is one of the candidates."""
    model, pkg = standin_vlm()
    samples = standin_inputs(model)
    with standin_cpu_kernels(pkg.modeling_kimi_k3), per_expert_modules(model, model.config.text_config):
        ref = logits_of(model, samples)
        adapter = KimiLayout(model)
        proc = smoother(adapter, search=True)
        proc.preflight(adapter, _all_w4a8(adapter))
        process_units(adapter, [proc], lambda: logits_of(model, samples))
        out = logits_of(model, samples)
    for o, r in zip(out, ref):
        assert rel_err(o, r) < TOL
    chosen = [a for alphas in proc.chosen.values() for a in alphas]
    assert set(proc.chosen) == set(SUBGRAPH_TYPES) and chosen
    assert all(a is None or a in proc.config.search_alphas for a in chosen)
    assert sum(proc.counts.values()) == sum(a is not None for a in chosen)


def test_modelled_weight_error_is_the_output_error_on_the_calibration_tokens():
    """Without the activation part, the model's error is exactly ||(X / s) dW^T||^2 with dW the rounding error of
    W diag(s): the Hessian form (evaluated in float32, as on the device) against the tokens themselves in
    float64, rel 1e-6."""
    from msmodelslim.processor.iter_smooth import error_parts, modelled_errors
    from msmodelslim.quant.functional import minmax_scale, quantize_with_scale
    from msmodelslim.quant.granularity import PerChannel, int4, int8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 24, generator=g, dtype=torch.float64) * torch.linspace(0.1, 9, 24, dtype=torch.float64)
    w = torch.randn(10, 24, generator=g, dtype=torch.float64)
    s = torch.linspace(0.5, 2.0, 24, dtype=torch.float64)
    ws = w * s
    scale = minmax_scale(ws, int4, PerChannel())
    dw = quantize_with_scale(ws, scale, int4).double() * scale - ws
    direct = float(((x / s) @ dw.t()).square().sum())
    got = float(modelled_errors(error_parts(w, [s], x.t() @ x, int4), torch.zeros(1), int8)[0])
    assert abs(got - direct) <= 1e-6 * direct


def test_native_kimi_linear_logits_unchanged_by_smoothing_after_quarot():
    """QuaRot (with online down rotations) then IterSmooth, as in a practice: still the same logits."""
    model = native_kimi_linear()
    samples = [{"input_ids": torch.randint(3, 256, (2, 37), generator=torch.Generator().manual_seed(1))}]
    with native_torch_kernels(), per_expert_modules(model, model.config):
        ref = logits_of(model, samples)
        adapter = KimiLayout(model)
        rot = QuaRotProcessor(QuaRotConfig(online_down=True))
        proc = smoother(adapter, alpha=0.5)
        process_units(adapter, [rot, proc], lambda: logits_of(model, samples))
        out = logits_of(model, samples)
    assert rel_err(out[0], ref[0]) < TOL
    # up-down pairs whose down projection takes an online Hadamard cannot be smoothed (the quantizer sees T x)
    assert proc.skipped_online > 0


@pytest.mark.skipif(not MINI.is_dir(), reason=f"{MINI} not available")
def test_kimi_linear_mini_logits_unchanged_by_smoothing(tmp_path):
    model = kimi_linear_mini(tmp_path)
    samples = [{"input_ids": mini_tokens(128, offset=2000)}]
    with native_torch_kernels(), per_expert_modules(model, model.config):
        ref = logits_of(model, samples)
        adapter = KimiLayout(model)
        process_units(adapter, [smoother(adapter)], lambda: logits_of(model, samples))
        out = logits_of(model, samples)
    assert rel_err(out[0], ref[0]) < TOL


def _layer(adapter, name):
    return next((u, m) for u, m in unit_modules(adapter) if u.name == name)


def test_expert_without_tokens_is_left_untouched():
    """An expert that no calibration token reached gets s = 1 on its up-down pair (bit-identical weights), while
    those the tokens reach are smoothed (their w3 changes)."""
    model, pkg = standin_vlm()
    samples = standin_inputs(model)[1:]
    with standin_cpu_kernels(pkg.modeling_kimi_k3), per_expert_modules(model, model.config.text_config):
        block = model.language_model.model.layers[1].block_sparse_moe
        with torch.no_grad():
            block.gate.weight[5] = 0.0
            block.gate.e_score_correction_bias[5] = -100.0  # expert 5 is never chosen
        before = {w: getattr(block.experts["5"], w).weight.detach().clone() for w in ("w2", "w3")}
        w3s = {e: m.w3.weight.detach().clone() for e, m in block.experts.items()}
        adapter = KimiLayout(model)
        unit, layer = _layer(adapter, "layers.1")
        run_processor(smoother(adapter, enable_subgraph_type=["up-down"]),
                      UnitContext(unit, layer, adapter, DistContext(), run_samples=lambda: logits_of(model, samples)))
        for w, t in before.items():
            assert torch.equal(getattr(block.experts["5"], w).weight, t)
        assert all(m.w3.weight.shape == w3s[e].shape for e, m in block.experts.items())  # else "changed" is vacuous
        smoothed = {e for e, m in block.experts.items() if not torch.equal(m.w3.weight, w3s[e])}
        assert smoothed and "5" not in smoothed  # the experts the tokens reach were smoothed


def _smoothing_then_gptq(true_sequential: bool):
    """The stand-in's layers.1 through searched smoothing's first pass, followed by the W4A8 experts' GPTQ entry and
    a W8A8 GPTQ entry for the rest: (the Hessians that pass carried, the unit's later passes, the later entries'
    latent up-projection, the Hessians observed on the smoothed unit, the Carried left at the end)."""
    from msmodelslim.processor.linear_quant import LinearQuantConfig, LinearQuantProcessor

    gptq = {"act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
            "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "gptq"}}
    w4 = {**gptq, "weight": {**gptq["weight"], "dtype": "int4"}}
    model, pkg = standin_vlm()
    samples = standin_inputs(model)
    with standin_cpu_kernels(pkg.modeling_kimi_k3), per_expert_modules(model, model.config.text_config):
        adapter = KimiLayout(model)
        unit, layer = _layer(adapter, "layers.1")
        passes = []
        ctx = UnitContext(unit, layer, adapter, DistContext(),
                          run_samples=lambda: passes.append(logits_of(model, samples)))
        smooth = smoother(adapter, search=True)
        smooth.preflight(adapter, _all_w4a8(adapter))
        experts = LinearQuantProcessor(LinearQuantConfig.build(qconfig=w4, include=["*experts.*"],
                                                               exclude=["*shared_experts*"],
                                                               true_sequential=true_sequential))
        rest = LinearQuantProcessor(LinearQuantConfig.build(qconfig=gptq, include=["*"],
                                                            true_sequential=true_sequential))
        held = Carried()
        run_processor(smooth, ctx, following=[experts, rest], carried=held)
        carried = dict(held.hessian)
        latent = [n for n in rest.hessians(ctx) if adapter.reads_routed_experts(n)]
        assert latent and set(carried) <= set(experts.hessians(ctx)) | set(rest.hessians(ctx))
        observed = observe(ctx, Observe(hessian=tuple(carried))).hessian
        assert sum(smooth.counts.values()) > 0
        passes.clear()
        run_processor(experts, ctx, following=[rest], carried=held)
        run_processor(rest, ctx, carried=held)
    return carried, len(passes), latent, observed, held


def test_smoothing_carries_the_hessians_its_first_pass_gathered_for_gptq():
    """iter_smooth's first pass also gathers every GPTQ entry's Hessians (the latent up-projection's too: from before
    the experts are quantized, `true_sequential: false`) and rescales them with its smoothing: no GPTQ entry needs a
    pass of its own, the unit takes 2 with the forward. Reference: the Hessians observed on the smoothed float32
    unit; tolerance: relative Frobenius error 1e-5 (float32 rounding of the rescaling and of the smoothed weights).
    The unrescaled Hessians differ by more than 1 %, so a missing or wrong rescaling fails."""
    carried, later_passes, latent, observed, held = _smoothing_then_gptq(true_sequential=False)
    assert set(latent) <= set(carried)
    for name, h in carried.items():  # an expert no token reached has zeros on both sides
        assert (h - observed[name]).norm() <= 1e-5 * observed[name].norm(), name
    assert later_passes == 0 and not held.hessian  # all handed over
    # the same unit unsmoothed: the rescaling was needed
    model, pkg = standin_vlm()
    samples = standin_inputs(model)
    with standin_cpu_kernels(pkg.modeling_kimi_k3), per_expert_modules(model, model.config.text_config):
        adapter = KimiLayout(model)
        unit, layer = _layer(adapter, "layers.1")
        ctx = UnitContext(unit, layer, adapter, DistContext(), run_samples=lambda: logits_of(model, samples))
        before = observe(ctx, Observe(hessian=tuple(carried))).hessian
    assert max(float((before[n] - carried[n]).norm() / carried[n].norm().clamp(min=1e-30)) for n in carried) > 1e-2


def test_a_true_sequential_entry_takes_the_latent_up_projection_after_the_experts_are_quantized():
    """With `linear_quant.true_sequential`, the W8A8 entry's latent up-projection reads the quantized experts'
    outputs: the first pass gathers every Hessian but its, and it takes one pass of its own after the experts'
    entry (the unit: 3 with the forward)."""
    carried, later_passes, latent, _, held = _smoothing_then_gptq(true_sequential=True)
    assert not set(latent) & set(carried)
    assert later_passes == 1 and not held.hessian


def test_gated_norm_scale_is_shared_by_heads():
    """o_norm's weight [V] absorbs one scale per V channel: s_j = max over heads of the SmoothQuant scale inputs."""
    model, pkg = standin_vlm()
    samples = standin_inputs(model)
    with standin_cpu_kernels(pkg.modeling_kimi_k3):
        adapter = KimiLayout(model)
        unit, layer = _layer(adapter, "layers.0")
        attn = layer.self_attn
        ctx = UnitContext(unit, layer, adapter, DistContext(), run_samples=lambda: logits_of(model, samples))
        x = observe(ctx, Observe(absmax=["self_attn.o_proj"])).absmax["self_attn.o_proj"].double().view(2, -1).amax(0)
        w = attn.o_proj.weight.detach().double().abs().amax(0).view(2, -1).amax(0)
        gamma, wo = attn.o_norm.weight.detach().double().clone(), attn.o_proj.weight.detach().double().clone()
        run_processor(smoother(adapter, enable_subgraph_type=["gated-norm-linear"], alpha=0.7), ctx)
    s = (x.pow(0.7) / w.pow(0.3)).clamp(min=1e-5)
    assert rel_err(attn.o_norm.weight, gamma / s) < 1e-6
    assert rel_err(attn.o_proj.weight, wo * s.repeat(2)) < 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _smooth_moe_layer(dist: DistContext, sample_ids: list[int], out: Path) -> None:
    """Smooth layers.1 (latent MoE) of the stand-in with the samples `sample_ids`; save the layer's weights."""
    model, pkg = standin_vlm()
    samples = [standin_inputs(model)[i] for i in sample_ids]
    with standin_cpu_kernels(pkg.modeling_kimi_k3), per_expert_modules(model, model.config.text_config, dist):
        adapter = KimiLayout(model)
        calls = []
        reduce = dist.all_reduce_max

        def counting(stats):
            calls.append(sorted(stats))
            return reduce(stats)

        object.__setattr__(dist, "all_reduce_max", counting)
        process_units(adapter, [smoother(adapter)], lambda: logits_of(model, samples), dist, only="layers.1")
        layer = model.language_model.model.layers[1]
        torch.save({"state": layer.state_dict(), "calls": calls}, out)


def _ep_rank(rank: int, world: int, port: int, out: Path) -> None:
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _smooth_moe_layer(DistContext(rank, world, torch.device("cpu")), [rank], out / f"rank{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_smoothing_equals_one_device(tmp_path):
    """Two gloo ranks (EP: experts 0-7 / 8-15; DP: one calibration sample each) against one device with both
    samples: replicated weights bit-identical on both ranks and equal to one device (rel 1e-6: the EP forward sums
    expert outputs in another order), every expert equal to its one-device version; one extra collective per MoE
    layer (routed_expert_down_proj -> experts) besides the statistics reduction."""
    # spawn, not fork: the parent's OpenMP / gloo threads make a forked child hang
    mp.spawn(_ep_rank, args=(2, _free_port(), tmp_path), nprocs=2, join=True)
    _smooth_moe_layer(DistContext(), [0, 1], tmp_path / "single.pt")
    r0, r1, single = (torch.load(tmp_path / f"{n}.pt") for n in ("rank0", "rank1", "single"))
    assert r0["calls"] == r1["calls"]
    assert r0["calls"][1:] == [["skip", "w", "x"]]  # statistics reduction, then the cross-rank scale
    experts = re.compile(r"(?<!shared_)experts\.")
    for name, t in single["state"].items():
        holders = [r["state"] for r in (r0, r1) if name in r["state"]]
        assert holders, name
        if not experts.search(name):
            assert torch.equal(r0["state"][name], r1["state"][name]), name
        for h in holders:
            assert rel_err(h[name], t) < 1e-6, name
    assert not any(experts.search(n) and int(n.split("experts.")[1].split(".")[0]) >= 8 for n in r0["state"])


def test_include_exclude_match_checkpoint_names():
    model, pkg = standin_vlm()
    adapter = KimiLayout(model)
    unit, layer = _layer(adapter, "layers.0")
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    proc = smoother(adapter, exclude=["*.self_attn.*"], enable_subgraph_type=["norm-linear", "up-down"])
    with standin_cpu_kernels(pkg.modeling_kimi_k3):
        run_processor(proc, UnitContext(unit, layer, adapter, DistContext(),
                                      run_samples=lambda: logits_of(model, standin_inputs(model)[1:])))
    assert all(p.shape == before[n].shape for n, p in layer.named_parameters())
    changed = {n for n, p in layer.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                       "mlp.down_proj.weight"}


@pytest.mark.parametrize("kw,match", [
    ({"alpha": 1.5}, "alpha"), ({"scale_min": 0.0}, "scale_min"), ({"enable_subgraph_type": ["qkv"]}, "qkv"),
    ({"search_tokens": 0}, "search_tokens"),
])
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        IterSmoothConfig.build(**kw).validate()


def test_iter_smooth_config_parses_from_practice_yaml_schema():
    from msmodelslim.core.config import build_dataclass

    cfg = build_dataclass(IterSmoothConfig, {"alpha": 0.8, "enable_subgraph_type": ["ov", "up-down"],
                                             "exclude": ["*kv_b_proj"]})
    assert cfg.enable_subgraph_type == ["ov", "up-down"] and cfg.alpha == 0.8
    with pytest.raises(Exception, match="norm_linear"):
        build_dataclass(IterSmoothConfig, {"enable_subgraph_type": ["norm_linear"]})


def test_smoothing_a_quantized_linear_is_a_clear_error():
    from msmodelslim.quant.modules import QuantLinear

    model, _ = standin_vlm()
    adapter = KimiLayout(model)
    unit, layer = _layer(adapter, "layers.0")
    layer.mlp.down_proj = QuantLinear.from_linear(layer.mlp.down_proj, "W8A8_DYNAMIC", weight_method="minmax")
    with pytest.raises(ValueError, match="mlp.down_proj has no float weight"):
        run_processor(smoother(adapter), UnitContext(unit, layer, adapter, DistContext(), run_samples=lambda: None))


def test_the_strength_search_refuses_mx_readers_it_cannot_model():
    from msmodelslim.errors import UserError

    processor = IterSmoothProcessor(IterSmoothConfig.build(search=True))
    processor.preflight(None, {"a.q_proj": "W8A8_DYNAMIC", "b": "FLOAT"})  # integer readers: modelled
    with pytest.raises(UserError, match="search: false .* W8A8_MXFP8|W8A8_MXFP8.*search: false"):
        processor.preflight(None, {"a.q_proj": "W8A8_MXFP8"})
    IterSmoothProcessor(IterSmoothConfig.build(search=False)).preflight(None, {"a.q_proj": "W8A8_MXFP8"})
