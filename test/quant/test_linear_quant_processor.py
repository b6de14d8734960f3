"""linear_quant: config validation and include/exclude on checkpoint names of a toy unit."""

import pytest
import torch
from torch import nn

from msmodelslim.core.dist import SINGLE, DistContext
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.pipeline.answers import Carried, assign_owners, run_processor
from msmodelslim.processor.base import PROCESSORS, UnitContext
from msmodelslim.processor.linear_quant import LinearQuantConfig, LinearQuantProcessor
from msmodelslim.quant import QuantLinear

W4A8 = {"act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
        "weight": {"scope": "per_channel", "dtype": "int4", "symmetric": True, "method": "ssz"}}
W8A8 = {"act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
        "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}}


class ToyAdapter(ModelAdapter):
    def __init__(self):
        super().__init__("toy")

    def units(self):
        return []

    def load_unit(self, unit, device, reader=None):
        raise NotImplementedError

    def prepare_samples(self, records):
        return []

    def forward_unit(self, unit, module, state):
        return state

    def checkpoint_name(self, unit, live_name):
        return unit.prefix + live_name

    def checkpoint_state(self, unit, module):
        return iter(())


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.ModuleDict({"q_proj": nn.Linear(16, 16), "o_proj": nn.Linear(16, 16)})
        self.block_sparse_moe = nn.Module()
        self.block_sparse_moe.gate = nn.Linear(16, 4, bias=False)
        self.block_sparse_moe.experts = nn.ModuleList(
            nn.ModuleDict({"w1": nn.Linear(16, 8), "w2": nn.Linear(8, 16), "w3": nn.Linear(16, 8)}) for _ in range(2))
        self.block_sparse_moe.shared_experts = nn.ModuleDict({"up_proj": nn.Linear(16, 8)})
        self.input_layernorm = nn.LayerNorm(16)


def _ctx(module, kind="decoder", prefix="language_model.model.layers.0."):
    unit = Unit(name="layers.0" if kind == "decoder" else kind, kind=kind, prefix=prefix, index=0)
    return UnitContext(unit=unit, module=module, adapter=ToyAdapter(), dist=SINGLE, run_samples=lambda: None)


def _schemes(module):
    return {n: m.scheme.name for n, m in module.named_modules() if isinstance(m, QuantLinear)}


def test_registered_under_yaml_type():
    assert PROCESSORS["linear_quant"] is LinearQuantProcessor
    assert LinearQuantProcessor.config_cls is LinearQuantConfig


def test_two_entries_compose_experts_w4a8_rest_w8a8():
    """Practice order: experts W4A8 (shared excluded) then the rest W8A8; the already quantized experts are skipped."""
    torch.manual_seed(0)
    layer = Layer()
    ctx = _ctx(layer)
    run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig=W4A8, include=["*experts.*"], exclude=["*shared_experts*"])), ctx)
    run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig=W8A8, include=["*self_attn*", "*shared_experts*"])), ctx)
    got = _schemes(layer)
    expected = {f"block_sparse_moe.experts.{e}.{w}": "W4A8_DYNAMIC" for e in range(2) for w in ("w1", "w2", "w3")}
    expected.update({"self_attn.q_proj": "W8A8_DYNAMIC", "self_attn.o_proj": "W8A8_DYNAMIC",
                     "block_sparse_moe.shared_experts.up_proj": "W8A8_DYNAMIC"})
    assert got == expected
    assert isinstance(layer.block_sparse_moe.gate, nn.Linear)  # the router stays float
    out = layer.block_sparse_moe.experts[0].w1(torch.randn(3, 16))
    assert out.shape == (3, 8)


def test_catch_all_include_does_not_touch_head_or_vision_units():
    """Non-decoder units need an include glob that starts with their checkpoint prefix."""
    head = nn.Module()
    head.lm_head = nn.Linear(16, 32)
    ctx = _ctx(head, kind="head", prefix="language_model.")
    run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig=W8A8)), ctx)
    assert isinstance(head.lm_head, nn.Linear)
    run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig=W8A8, include=["language_model.lm_head"])), ctx)
    assert isinstance(head.lm_head, QuantLinear)


@pytest.mark.parametrize("bad,field", [
    ({"qconfig": {**W8A8, "act": {**W8A8["act"], "scope": "per_tensor"}}}, "act.scope"),
    ({"qconfig": {**W8A8, "weight": {**W8A8["weight"], "dtype": "int3"}}}, "weight.dtype"),
    ({"qconfig": {**W8A8, "weight": {**W8A8["weight"], "method": "awq"}}}, "weight.method"),
    ({"qconfig": {**W8A8, "weight": {**W8A8["weight"], "symmetric": False}}}, "weight.symmetric"),
    ({"qconfig": {**W8A8, "weight": {**W8A8["weight"], "granularity": 1}}}, "qconfig.weight"),
    ({"qconfig": {**W8A8, "act": {**W8A8["act"], "dtype": "int4"}}}, "qconfig"),  # W8A4 has no scheme
    ({"include": "*experts*"}, "include"),
    ({"exclude": [1]}, "exclude"),
])
def test_bad_config_is_value_error_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        LinearQuantConfig.build(**{"qconfig": W8A8, **bad})


def test_defaults_are_w8a8_include_all():
    cfg = LinearQuantConfig.build()
    assert cfg.scheme.name == "W8A8_DYNAMIC" and cfg.include == ["*"] and cfg.exclude == []
    assert LinearQuantConfig.build(qconfig=W4A8).scheme.name == "W4A8_DYNAMIC"


def test_replicated_linears_are_shared_out_largest_first_to_the_least_loaded_rank():
    sizes = {"mlp.gate_proj": 12, "mlp.up_proj": 12, "mlp.down_proj": 12, "self_attn.q_proj": 4,
             "self_attn.k_proj": 4, "self_attn.o_proj": 4}
    owner = assign_owners(sizes, 2)
    assert owner == {"mlp.gate_proj": 0, "mlp.up_proj": 1, "mlp.down_proj": 0, "self_attn.q_proj": 1,
                     "self_attn.k_proj": 1, "self_attn.o_proj": 1}
    loads = [sum(sizes[n] for n, r in owner.items() if r == rank) for rank in range(2)]
    assert loads == [24, 24]
    assert set(assign_owners(sizes, 1).values()) == {0}
    assert sorted(set(assign_owners(sizes, 8).values())) == list(range(6))  # more ranks than linears: one each


MXFP8 = {"scope": "per_block", "dtype": "mxfp8", "symmetric": True, "method": "minmax"}
MXFP4 = {**MXFP8, "dtype": "mxfp4"}
PER_GROUP = {**W4A8["weight"], "scope": "per_group", "method": "minmax", "ext": {"group_size": 64}}


@pytest.mark.parametrize("act, weight, scheme", [
    (None, MXFP4, "W4A16_MXFP4"), (MXFP8, MXFP4, "W4A8_MXFP"), (MXFP8, MXFP8, "W8A8_MXFP8"),
    (MXFP4, MXFP4, "W4A4_MXFP4"), (W4A8["act"], PER_GROUP, "W4A8_DYNAMIC"),
])
def test_qconfig_dtypes_name_the_serving_scheme(act, weight, scheme):
    cfg = LinearQuantConfig.build(qconfig={"act": act, "weight": weight})
    assert cfg.scheme.name == scheme
    assert cfg.qconfig.weight.group_size == (64 if weight is PER_GROUP else 0)


@pytest.mark.parametrize("qconfig, message", [
    ({"act": W8A8["act"], "weight": {**MXFP8, "dtype": "int8"}}, "per_block does not go with dtype int8"),
    ({"act": MXFP8, "weight": {**W8A8["weight"], "dtype": "mxfp4"}}, "per_channel does not go with dtype mxfp4"),
    ({"act": {**W8A8["act"], "dtype": "mxfp8"}, "weight": MXFP8}, "act: scope per_token does not go with"),
    ({"act": MXFP8, "weight": {**MXFP4, "method": "ssz"}}, "MX weights take method minmax, grid or gptq"),
    ({"act": W4A8["act"], "weight": {**PER_GROUP, "ext": {}}}, "per_group needs ext.group_size"),
    ({"act": W4A8["act"], "weight": {**PER_GROUP, "ext": {"group_size": 48}}}, "positive multiple of 32"),
    ({"act": W8A8["act"], "weight": {**PER_GROUP, "dtype": "int8"}}, "W4A8_DYNAMIC only, not W8A8_DYNAMIC"),
    ({"act": MXFP8, "weight": {**W4A8["weight"]}}, "no serving scheme has int4 weights with mxfp8"),
])
def test_a_qconfig_no_serving_scheme_reads_is_refused_naming_why(qconfig, message):
    with pytest.raises(ValueError, match=message):
        LinearQuantConfig.build(qconfig=qconfig)


def test_one_group_size_per_model_mx_and_per_channel_w4a8_cannot_mix():
    from msmodelslim.errors import UserError
    from msmodelslim.serving.linear_plan import LinearPlan, PlanEntry, PlannedLinear
    from msmodelslim.serving.rules import description_group_size

    def plan(*entries: tuple[str, int]) -> LinearPlan:
        """One linear per entry (scheme, weight group size)."""
        return LinearPlan(tuple(PlanEntry(scheme, "minmax", group, ("*",), ()) for scheme, group in entries),
                          {f"l{i}": PlannedLinear(f"l{i}", "layers.0", "decoder", 256, 256, i, True)
                           for i in range(len(entries))})

    assert description_group_size(plan(("W8A8_MXFP8", 0), ("W8A8_DYNAMIC", 0))) == 32
    assert description_group_size(plan(("W4A8_DYNAMIC", 64))) == 64
    with pytest.raises(UserError, match=r"0 \(W4A8_DYNAMIC per channel\) and 32 \(W8A8_MXFP8\)"):
        description_group_size(plan(("W4A8_DYNAMIC", 0), ("W8A8_MXFP8", 0)))


class WideLayer(nn.Module):
    """Experts with 64 inputs (MX blocks of 32 pair up), as a source checkpoint stores them."""

    def __init__(self):
        super().__init__()
        self.block_sparse_moe = nn.Module()
        self.block_sparse_moe.experts = nn.ModuleList(
            nn.ModuleDict({"w1": nn.Linear(64, 64, bias=False), "w2": nn.Linear(64, 64, bias=False)})
            for _ in range(2))


class SourceMXFP4Adapter(ToyAdapter):
    """An adapter whose checkpoint stores the experts as MXFP4 (the bytes given)."""

    def __init__(self, stored):
        super().__init__()
        self.stored = stored

    def source_mxfp4(self, unit, live_name):
        return self.stored.get(live_name)


def test_unchanged_experts_keep_the_source_mxfp4_bytes_and_changed_ones_are_quantized_again():
    from msmodelslim.quant.mx import MXFP4 as FP4
    from msmodelslim.quant.mx import decode_weight, quantize_mx_weight

    torch.manual_seed(1)
    layer = WideLayer()
    stored = {}
    for e in range(2):
        for w in ("w1", "w2"):
            linear = layer.block_sparse_moe.experts[e][w]
            packed, scale = quantize_mx_weight(linear.weight.detach() * 3.0, FP4, "grid")  # not our minmax bytes
            linear.weight.data = decode_weight(packed, scale, FP4)  # the model loaded the decoded checkpoint
            stored[f"block_sparse_moe.experts.{e}.{w}"] = (packed, scale)
    layer.block_sparse_moe.experts[1].w2.weight.data *= 1.5  # a processor changed this one
    ctx = UnitContext(unit=Unit(name="layers.0", kind="decoder", prefix="model.layers.0.", index=0), module=layer,
                      adapter=SourceMXFP4Adapter(stored), dist=SINGLE, run_samples=lambda: None)
    run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig={"act": None, "weight": MXFP4})), ctx)
    for name, (packed, scale) in stored.items():
        q = layer.get_submodule(name)
        assert isinstance(q, QuantLinear) and q.scheme.name == "W4A16_MXFP4"
        kept = torch.equal(q.qweight, packed) and torch.equal(q.weight_scale, scale)
        assert kept == (name != "block_sparse_moe.experts.1.w2"), name


GPTQ_W4A8 = {**W4A8, "weight": {**W4A8["weight"], "method": "gptq"}}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Hessians wait on the host only beside an accelerator"))])
def test_hessians_wait_on_the_host_during_the_jobs_and_give_the_same_weights(device, monkeypatch):
    """GPTQ's Hessians leave the accelerator between the statistics pass and the jobs (`_parked`: a rank's expert
    Hessians set the layer's device peak) and come back per batch. Reference: the same run with the Hessians left
    on the device; tolerance: none (the copies are exact). On the CPU nothing moves."""
    from msmodelslim.processor import linear_quant

    def run(park: bool) -> tuple[dict, list[torch.device]]:
        torch.manual_seed(0)
        layer = Layer().to(device)
        inputs = {n: torch.randn(64, m.in_features, device=device) for n, m in layer.named_modules()
                  if isinstance(m, nn.Linear)}
        unit = Unit(name="layers.0", kind="decoder", prefix="language_model.model.layers.0.", index=0)
        ctx = UnitContext(unit=unit, module=layer, adapter=ToyAdapter(), dist=DistContext(device=torch.device(device)),
                          run_samples=lambda: [layer.get_submodule(n)(x) for n, x in inputs.items()])
        where: list[torch.device] = []
        original = linear_quant._parked

        def parked(hessians, dev):
            out = original(hessians, dev) if park else hessians
            where.extend(h.device for h in out.values())
            return out

        monkeypatch.setattr(linear_quant, "_parked", parked)
        run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig=GPTQ_W4A8, include=["*experts.*"],
                                                                 exclude=["*shared_experts*"])), ctx)
        return {n: (m.qweight.cpu(), m.weight_scale.cpu()) for n, m in layer.named_modules()
                if isinstance(m, QuantLinear)}, where

    parked, where = run(park=True)
    kept, _ = run(park=False)
    assert len(parked) == 6 and where and all(d.type == "cpu" for d in where)
    for name, (q, scale) in kept.items():
        assert torch.equal(parked[name][0], q) and torch.equal(parked[name][1], scale), name


def test_linears_that_read_one_input_are_one_gptq_matrix_and_get_the_integers_each_gets_alone(monkeypatch):
    """q/k/v of different widths read one input, so they share one Hessian: GPTQ takes them as one matrix (their
    rows stacked: one inverse factor, one column loop), o_proj alone. Reference: `quantize_weight` on each linear by
    itself with that Hessian; tolerance: none (GPTQ treats rows independently)."""
    from msmodelslim.quant.modules import quantize_weight

    torch.manual_seed(0)
    attn = nn.ModuleDict({"q_proj": nn.Linear(32, 24), "k_proj": nn.Linear(32, 8), "v_proj": nn.Linear(32, 8),
                          "o_proj": nn.Linear(8, 32)})
    layer = nn.Module()
    layer.self_attn = attn
    x, x_o = torch.randn(128, 32), torch.randn(128, 8)
    floats = {n: m.weight.detach().clone() for n, m in attn.items()}
    unit = Unit(name="layers.0", kind="decoder", prefix="language_model.model.layers.0.", index=0)
    ctx = UnitContext(unit=unit, module=layer, adapter=ToyAdapter(), dist=SINGLE,
                      run_samples=lambda: [attn[n](x) for n in ("q_proj", "k_proj", "v_proj")] + [attn.o_proj(x_o)])
    from msmodelslim.processor import linear_quant

    problems, seen = [], {}
    original = linear_quant._quantize

    def quantize(cfg, weights, names, hessians, tokens):
        problems.extend(names)
        seen.update({n: (h, t) for members, h, t in zip(names, hessians, tokens) for n in members})
        return original(cfg, weights, names, hessians, tokens)

    monkeypatch.setattr(linear_quant, "_quantize", quantize)
    config = LinearQuantConfig.build(qconfig={**W8A8, "weight": {**W8A8["weight"], "method": "gptq"}})
    run_processor(LinearQuantProcessor(config), ctx)
    assert sorted(map(sorted, problems)) == [["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"],
                                             ["self_attn.o_proj"]]
    for name, w in floats.items():
        h, tokens = seen[f"self_attn.{name}"]
        q, scale = quantize_weight(w, config.scheme.weight, "gptq", scale_dtype=config.scheme.engine_scale_dtype,
                                   hessian=h, tokens=tokens)
        assert torch.equal(attn[name].qweight, q) and torch.equal(attn[name].weight_scale, scale), name


def test_on_the_cpu_gptq_batches_hold_gptq_batch_bytes_cpu_of_hessians_and_give_the_same_weights(monkeypatch):
    """On the CPU, experts of one shape go through GPTQ in batches of about GPTQ_BATCH_BYTES_CPU of Hessians (a
    batch's temporaries take host memory and save no launches there). Reference: one batch for every expert;
    tolerance: none (a batch gives each matrix the integers it gets alone)."""
    from msmodelslim.processor import linear_quant
    original = linear_quant._quantize

    def run(budget: int) -> tuple[dict, list[int]]:
        monkeypatch.setattr(linear_quant, "GPTQ_BATCH_BYTES_CPU", budget)
        torch.manual_seed(0)
        layer = Layer()
        inputs = {n: torch.randn(64, m.in_features) for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        unit = Unit(name="layers.0", kind="decoder", prefix="language_model.model.layers.0.", index=0)
        ctx = UnitContext(unit=unit, module=layer, adapter=ToyAdapter(), dist=SINGLE,
                          run_samples=lambda: [layer.get_submodule(n)(x) for n, x in inputs.items()])
        batches: list[int] = []

        def quantize(cfg, weights, *args, **kwargs):
            batches.append(len(weights))
            return original(cfg, weights, *args, **kwargs)

        monkeypatch.setattr(linear_quant, "_quantize", quantize)
        run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig=GPTQ_W4A8, include=["*experts.*"],
                                                                 exclude=["*shared_experts*"])), ctx)
        return {n: (m.qweight, m.weight_scale) for n, m in layer.named_modules() if isinstance(m, QuantLinear)}, \
            batches

    one_each, small = run(budget=1)
    together, large = run(budget=1 << 30)
    assert small and all(n == 1 for n in small) and max(large) > 1
    for name, (q, scale) in together.items():
        assert torch.equal(one_each[name][0], q) and torch.equal(one_each[name][1], scale), name


def test_a_gptq_linears_report_weight_error_is_the_exact_output_error_on_its_calibration_inputs():
    """The report's weight half of a GPTQ linear, summed in its job with the Hessian GPTQ had (batched experts and a
    linear of its own alike), against ||X dW^T||^2 / ||X W^T||^2 on the linear's calibration inputs X in float64
    (dW: the dequantized weight less the float one); tolerance 1e-4 relative (float32 sums on the CPU)."""
    torch.manual_seed(0)
    layer = Layer()
    inputs = {n: torch.randn(64, m.in_features).bfloat16().float() for n, m in layer.named_modules()
              if isinstance(m, nn.Linear)}
    floats = {n: layer.get_submodule(n).weight.detach().double() for n in inputs}
    unit = Unit(name="layers.0", kind="decoder", prefix="language_model.model.layers.0.", index=0)
    ctx = UnitContext(unit=unit, module=layer, adapter=ToyAdapter(), dist=SINGLE,
                      run_samples=lambda: [layer.get_submodule(n)(x) for n, x in inputs.items()])
    run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig=GPTQ_W4A8, include=["*experts.*", "*q_proj"],
                                                               exclude=["*shared_experts*"])), ctx)
    checked = 0
    for name, x in inputs.items():
        quant = layer.get_submodule(name)
        if not isinstance(quant, QuantLinear):
            continue
        xd, w = x.double(), floats[name]
        dw = quant.dequantized_weight().double() - w
        expected = float((xd @ dw.t()).square().sum() / (xd @ w.t()).square().sum())
        assert quant.weight_error.exact == pytest.approx(expected, rel=1e-4), name
        checked += 1
    assert checked == 7  # six expert linears (batched by shape) and q_proj


class LatentLayer(Layer):
    """Layer with a linear that reads the routed experts' outputs (Kimi-K3's latent up-projection)."""

    def __init__(self):
        super().__init__()
        self.block_sparse_moe.routed_expert_up_proj = nn.Linear(16, 16)


class RoutedAdapter(ToyAdapter):
    def is_rank_local(self, live_name):
        return ".experts." in live_name and "shared" not in live_name

    def reads_routed_experts(self, live_name):
        return live_name.endswith("routed_expert_up_proj")


@pytest.mark.parametrize("latent,true_sequential", [(False, False), (True, True), (True, False)])
def test_the_experts_pass_gathers_the_hessians_of_the_later_entry(latent, true_sequential):
    """Two GPTQ entries, routed experts then the rest: the experts' pass also gathers the later entry's Hessians, so
    that entry needs no pass of its own; with `true_sequential`, only those of the linears that do not read the
    experts' outputs, and the latent up-projection takes a pass of its own after the experts are quantized.
    Reference: the entries run with a pass each; tolerance: none (the gathered inputs are the same tensors),
    but for the up-projection gathered before the experts' quantization (not true-sequential): other bytes."""
    W8A8_GPTQ = {**W8A8, "weight": {**W8A8["weight"], "method": "gptq"}}

    def run(gather: bool) -> tuple[int, dict]:
        torch.manual_seed(0)
        layer = LatentLayer() if latent else Layer()
        moe = layer.block_sparse_moe
        x = torch.randn(40, 16)
        passes = []

        def samples():
            passes.append(1)
            h = x + layer.self_attn.o_proj(layer.self_attn.q_proj(x))
            routed = sum(e.w2(e.w1(h) * e.w3(h)) for e in moe.experts)
            out = h + moe.shared_experts.up_proj(h).sum() + routed
            return moe.routed_expert_up_proj(routed) + out if latent else out

        unit = Unit(name="layers.0", kind="decoder", prefix="language_model.model.layers.0.", index=0)
        ctx = UnitContext(unit=unit, module=layer, adapter=RoutedAdapter(), dist=SINGLE, run_samples=samples)
        experts = LinearQuantProcessor(LinearQuantConfig.build(qconfig=GPTQ_W4A8, include=["*experts.*"],
                                                               exclude=["*shared_experts*"]))
        rest = LinearQuantProcessor(LinearQuantConfig.build(qconfig=W8A8_GPTQ, include=["*"],
                                                            true_sequential=true_sequential))
        carried = Carried()
        run_processor(experts, ctx, following=[rest] if gather else (), carried=carried)
        run_processor(rest, ctx, carried=carried)
        assert not carried.hessian  # everything gathered was handed over
        return len(passes), {n: (m.qweight, m.weight_scale) for n, m in layer.named_modules()
                             if isinstance(m, QuantLinear)}

    gathered_passes, gathered = run(gather=True)
    separate_passes, separate = run(gather=False)
    assert (gathered_passes, separate_passes) == ((2, 2) if true_sequential else (1, 2))
    assert gathered.keys() == separate.keys() and len(gathered) == 10 + latent
    for name, (q, scale) in separate.items():
        same = torch.equal(gathered[name][0], q) and torch.equal(gathered[name][1], scale)
        assert same != (name == "block_sparse_moe.routed_expert_up_proj" and not true_sequential), name


def test_a_w8a8_fallback_entry_of_the_plan_runs_in_the_first_linear_quant_as_its_own_processor_would():
    """spec.fallback's W8A8 entry is an entry of the run's linear plan, run by the practice's first linear_quant (no
    processor of its own). Reference: the same layer quantized, without a plan, by a linear_quant of that entry placed
    before the practice's own (what a fallback built before the plan); tolerance: none (the same integers)."""
    import copy

    from msmodelslim.processor.plan import Fallback, linear_plan

    torch.manual_seed(0)
    layer = Layer()
    reference = copy.deepcopy(layer)
    unit = Unit(name="layers.0", kind="decoder", prefix="language_model.model.layers.0.", index=0)

    class OneLayer(ToyAdapter):
        def units(self):
            return [unit]

        def unit_module(self, u):
            return layer

    experts = dict(qconfig=W4A8, include=["*experts.*"], exclude=["*shared_experts*"])
    practice = [LinearQuantProcessor(LinearQuantConfig.build(**experts)),
                LinearQuantProcessor(LinearQuantConfig.build(qconfig=W8A8))]
    fallback = LinearQuantConfig.build(qconfig=W8A8, include=["*experts.0.*"])
    adapter = OneLayer()
    plan = linear_plan(practice, adapter, Fallback(higher=[fallback]))
    assert plan.entries[0].runs_with is practice[0].config and plan.entries_run_by(practice[1].config) == [2]
    ctx = UnitContext(unit=unit, module=layer, adapter=adapter, dist=SINGLE, run_samples=lambda: None, plan=plan)
    for processor in practice:
        run_processor(processor, ctx)
    for processor in [LinearQuantProcessor(fallback), *[LinearQuantProcessor(p.config) for p in practice]]:
        run_processor(processor, UnitContext(unit=unit, module=reference, adapter=adapter, dist=SINGLE,
                                             run_samples=lambda: None))
    assert _schemes(layer) == _schemes(reference)
    assert _schemes(layer)["block_sparse_moe.experts.0.w1"] == "W8A8_DYNAMIC"
    assert _schemes(layer)["block_sparse_moe.experts.1.w1"] == "W4A8_DYNAMIC"
    for name, module in layer.named_modules():
        if isinstance(module, QuantLinear):
            other = reference.get_submodule(name)
            assert torch.equal(module.qweight, other.qweight) and torch.equal(module.weight_scale, other.weight_scale)
