"""Expert parallelism: which experts a rank owns, and the patched MoE forward of the checkpoint's own class."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as native
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

from msmodelslim.model.common.expert_parallel import resolve_expert_ep_range
from msmodelslim.model.kimi_k3.ep_patches import apply_ep_patches


def test_expert_ranges_are_contiguous_and_cover_all_experts():
    ranges = [resolve_expert_ep_range(896, r, 8) for r in range(8)]
    assert ranges[0] == range(0, 112) and ranges[7] == range(784, 896)
    assert [e for r in ranges for e in r] == list(range(896))


@pytest.mark.parametrize("experts,world", [(16, 3), (10, 4)])
def test_expert_count_not_divisible_by_world_size_is_a_clear_error(experts, world):
    with pytest.raises(ValueError, match=f"num_experts={experts} is not divisible by the number of devices"):
        resolve_expert_ep_range(experts, 0, world)


def _native_moe(seed: int = 0) -> tuple[native.KimiLinearMoE, KimiLinearConfig]:
    config = KimiLinearConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_token=3,
                              num_shared_experts=1, num_hidden_layers=1, vocab_size=32)
    torch.manual_seed(seed)
    moe = native.KimiLinearMoE(config).float()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.gate.e_score_correction_bias.normal_(std=0.1)
    return moe, config


def _load_fused_into_per_expert(fused: native.KimiLinearMoE, patched: native.KimiLinearMoE) -> None:
    inter = fused.experts.intermediate_dim
    for key, expert in patched.experts.items():
        e = int(key)
        expert.w1.weight.data = fused.experts.gate_up_proj.data[e, :inter].clone()
        expert.w3.weight.data = fused.experts.gate_up_proj.data[e, inter:].clone()
        expert.w2.weight.data = fused.experts.down_proj.data[e].clone()


def test_patched_native_moe_matches_transformers_forward_and_undo_restores_it():
    """Reference: transformers' own KimiLinearMoE forward (fp32); tolerance 1e-5 (fp32 summation order)."""
    moe, config = _native_moe()
    x = torch.randn(2, 7, 64)
    reference = moe(x)
    patched = copy.deepcopy(moe)
    handle = apply_ep_patches(patched, config)
    assert sorted(patched.experts.keys(), key=int) == [str(e) for e in range(8)]
    _load_fused_into_per_expert(moe, patched)
    torch.testing.assert_close(patched(x), reference, rtol=1e-5, atol=1e-5)
    handle.undo()
    assert native.KimiLinearMoE.forward.__module__ == native.__name__
    torch.testing.assert_close(moe(x), reference)


def test_routed_dispatch_equals_a_per_expert_scan_bit_for_bit_and_skips_unrouted_slots():
    """Reference: the plain per-expert scan (nonzero over the routing table), computed here. Tolerance: none, the
    dispatch must hand each expert the same rows in the same order. A -1 slot (no expert) contributes nothing."""
    from msmodelslim.core.dist import SINGLE
    from msmodelslim.model.common.expert_parallel import ep_moe_infer

    torch.manual_seed(0)
    experts = torch.nn.ModuleDict({str(e): torch.nn.Linear(16, 16, bias=False) for e in (0, 2, 3, 5)})
    x = torch.randn(11, 16)
    idx = torch.randint(0, 6, (11, 3))
    idx[4, 1] = -1
    w = torch.rand(11, 3)
    ref = torch.zeros(11, 3, 16)
    for key, expert in experts.items():
        rows, cols = torch.nonzero(idx == int(key), as_tuple=True)
        ref[rows, cols] = expert(x[rows]).float() * w[rows, cols, None]
    with torch.no_grad():
        assert torch.equal(ep_moe_infer(experts, x, idx, w, SINGLE), ref.sum(dim=1))


def test_calibrating_all_experts_feeds_every_expert_every_token_and_keeps_the_routed_output():
    """`all_experts_compute` (spec.calibrate_all_experts): each local expert's hooks see every token, and the block's
    output is the routed one. Reference: the routed dispatch without the switch; tolerance 1e-5 (a row of a matmul
    over all tokens may round differently from the same row over the routed ones)."""
    moe, config = _native_moe()
    patched = copy.deepcopy(moe)
    apply_ep_patches(patched, config)
    _load_fused_into_per_expert(moe, patched)
    from msmodelslim.model.common.expert_parallel import all_experts_compute

    x = torch.randn(2, 7, 64)
    seen = {key: 0 for key in patched.experts}
    for key, expert in patched.experts.items():
        expert.w1.register_forward_pre_hook(lambda _m, args, k=key: seen.__setitem__(k, seen[k] + args[0].shape[0]))
    with torch.no_grad():
        routed = patched(x)
        routed_rows = dict(seen)
        seen.update({key: 0 for key in seen})
        with all_experts_compute(patched):
            everything = patched(x)
        assert seen == {key: 14 for key in seen}  # 2 x 7 tokens each
        assert sum(routed_rows.values()) == 14 * config.num_experts_per_token and min(routed_rows.values()) < 14
        torch.testing.assert_close(everything, routed, rtol=1e-5, atol=1e-5)
        seen.update({key: 0 for key in seen})
        patched(x)  # the switch is off again outside the context
    assert seen == routed_rows


def _expert_block(kind: str, seed: int = 0) -> torch.nn.ModuleDict:
    """Six bf16 experts of one rank (keys 2..7, a contiguous EP range), plain or quantized as linear_quant leaves
    them: W4A8 per channel, W4A8 per group of 8, or W8A8."""
    from msmodelslim.model.kimi_k3.experts import KimiExpertMLP
    from msmodelslim.quant.granularity import int4
    from msmodelslim.quant.modules import QuantLinear, quantize_weight

    torch.manual_seed(seed)
    experts = torch.nn.ModuleDict({str(e): KimiExpertMLP(32, 24, dtype=torch.bfloat16) for e in range(2, 8)})
    if kind == "float":
        return experts
    for expert in experts.values():
        for name in ("w1", "w2", "w3"):
            linear = getattr(expert, name)
            if kind == "w4a8_group":
                q = quantize_weight(linear.weight.detach(), int4, "minmax", group_size=8)
                setattr(expert, name, QuantLinear.from_linear(linear, "W4A8_DYNAMIC", quantized=q, group_size=8))
            else:
                scheme = {"w4a8": "W4A8_DYNAMIC", "w8a8": "W8A8_DYNAMIC"}[kind]
                setattr(expert, name, QuantLinear.from_linear(linear, scheme, weight_method="minmax"))
    return experts


def _routing(tokens: int = 40, k: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 32, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 9, (tokens, k), generator=g)  # experts 0, 1 and 8 live on other ranks
    idx[idx == 5] = 6  # expert 5 gets no token
    return x, idx, torch.rand(tokens, k, generator=g)


def _expert_by_expert(experts: torch.nn.ModuleDict, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
                      ) -> torch.Tensor:
    """The reference: each expert called as a module on its rows in token order (nonzero over the table)."""
    out = torch.zeros(*idx.shape, x.shape[1])
    for key, expert in experts.items():
        rows, cols = torch.nonzero(idx == int(key), as_tuple=True)
        if rows.numel():
            out[rows, cols] = expert(x[rows]).float() * w[rows, cols, None]
    return out.sum(dim=1).to(x.dtype)


@pytest.mark.parametrize("path", ["cpu", "accelerator", "cuda int8 gemm"],
                         ids=["cpu", "accelerator products", "cuda int8 gemm"])
@pytest.mark.parametrize("kind", ["float", "w4a8", "w4a8_group", "w8a8"])
def test_grouped_experts_equal_calling_each_expert_bit_for_bit(kind, path):
    """A rank's experts run as one group (one gather, one activation, each input quantized per token once, one
    scatter), with the CPU's products per group or an accelerator's in one buffer per linear position, in float32
    or (CUDA) as int8 GEMMs into one int32 buffer (each taken here on the CPU's tensors). Reference: each expert
    called on its rows, the CPU's exact float products; tolerance: none (exact integer sums, the same float32
    scaling of each row)."""
    from msmodelslim.core.dist import SINGLE
    from msmodelslim.model.common import expert_parallel
    from msmodelslim.quant import modules

    experts = _expert_block(kind)
    x, idx, w = _routing()
    with torch.no_grad():
        reference = _expert_by_expert(experts, x, idx, w)
    groups = []
    original = expert_parallel._grouped_experts
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(modules, "_buffers_products", lambda _x: path != "cpu")
        gemms = []
        if path == "cuda int8 gemm":
            mp.setattr(modules, "int8_gemm_fits", lambda _device, i, o: i % 8 == 0 and o % 8 == 0)
            mp.setattr(modules, "_int8_gemm", lambda *a, _f=modules._int8_gemm, **k: gemms.append(1) or _f(*a, **k))
        mp.setattr(expert_parallel, "_grouped_experts", lambda *a: groups.append(1) or original(*a))
        grouped = expert_parallel.ep_moe_infer(experts, x, idx, w, SINGLE)
        assert groups, "the grouped path was not taken"
        assert bool(gemms) == (path == "cuda int8 gemm" and kind in ("w4a8", "w8a8"))
        assert torch.equal(grouped, reference)


def test_grouped_experts_fill_the_quant_report_as_each_expert_would():
    """The report's statistic (`QuantError`, from forward hooks) of every expert after a grouped forward equals that
    of calling each expert on its rows (bit for bit: the same rows, the same float32 reductions per expert), and the
    hooked experts keep the grouped path (their rows quantized once)."""
    from msmodelslim.core.dist import SINGLE
    from msmodelslim.core.requests import Observe
    from msmodelslim.model.common.expert_parallel import ep_moe_infer
    from msmodelslim.pipeline.statistics import QuantError
    from msmodelslim.quant.modules import _shares_quantized_rows

    x, idx, w = _routing()
    blocks = [_expert_block("w4a8"), _expert_block("w4a8")]
    names = [(key, name) for key in blocks[0] for name in ("w1", "w2", "w3")]
    kinds = [QuantError(Observe(quant_error=tuple(f"{k}.{n}" for k, n in names)), {}, torch.device("cpu"))
             for _ in blocks]
    for block, kind in zip(blocks, kinds):
        for key, name in names:
            getattr(block[key], name).register_forward_hook(
                lambda module, args, y, kind=kind, label=f"{key}.{name}": kind.record_call(label, module, args[0], y))
    with torch.no_grad():
        ep_moe_infer(blocks[0], x, idx, w, SINGLE)
        assert all(_shares_quantized_rows(getattr(blocks[0][key], name)) for key, name in names)
        _expert_by_expert(blocks[1], x, idx, w)
    assert set(kinds[0].sums) == set(kinds[1].sums) and kinds[0].sums
    for label, a in kinds[0].sums.items():
        b = kinds[1].sums[label]
        for field in ("squares", "act_error", "absmax", "moments", "output_squares", "tokens"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (label, field)


def test_grouped_experts_hand_each_hook_its_expert_rows_and_one_tensor_to_w1_and_w3():
    """Statistics hooks see, per expert, the rows it would be called on, w1 and w3 the very same tensor one call
    after the other (how readers of one input share a Hessian: pipeline/statistics.py compares each call's input
    with the previous call's); an expert with a hook of its own is called as a module."""
    from msmodelslim.core.dist import SINGLE
    from msmodelslim.model.common.expert_parallel import ep_moe_infer

    experts = _expert_block("float")
    x, idx, w = _routing()
    seen: dict[tuple[str, str], torch.Tensor] = {}
    order: list[tuple[str, str]] = []
    for key, expert in experts.items():
        for name in ("w1", "w3", "w2"):
            getattr(expert, name).register_forward_pre_hook(
                lambda _m, args, k=key, n=name: seen.__setitem__((k, n), args[0]) or order.append((k, n)))
    with torch.no_grad():
        ep_moe_infer(experts, x, idx, w, SINGLE)
        assert all(order[i + 1] == (key, "w3") for i, (key, name) in enumerate(order) if name == "w1")
        for key, expert in experts.items():
            rows, _ = torch.nonzero(idx == int(key), as_tuple=True)
            if not rows.numel():
                assert (key, "w1") not in seen
                continue
            assert seen[(key, "w1")] is seen[(key, "w3")]
            assert torch.equal(seen[(key, "w1")], x[rows])
            assert torch.equal(seen[(key, "w2")], expert.act_fn(expert.w1(x[rows]), expert.w3(x[rows])))
        called = []
        experts["3"].register_forward_hook(lambda *_: called.append(1))
        assert torch.equal(ep_moe_infer(experts, x, idx, w, SINGLE), _expert_by_expert(experts, x, idx, w))
        assert called == [1, 1]  # in the dispatch and in the reference: expert by expert


def _experts_unit(experts: torch.nn.ModuleDict, batches: list) -> object:
    """A unit of these experts alone (all rank-local), whose pass routes `batches` (x, idx, w) through them."""
    import contextlib

    from msmodelslim.core.dist import SINGLE
    from msmodelslim.model.base import Unit
    from msmodelslim.model.common.expert_parallel import ep_moe_infer
    from msmodelslim.processor.base import UnitContext

    class Adapter:
        def is_rank_local(self, name: str) -> bool:
            return True

        def statistics_pass(self) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()

    def run() -> None:
        for x, idx, w in batches:
            ep_moe_infer(experts, x, idx, w, SINGLE)

    return UnitContext(Unit("layers.0", "decoder", "model.layers.0.", 0), experts, Adapter(), SINGLE, run_samples=run)


@pytest.mark.parametrize("chunk", [16, 4096], ids=["chunks fill, rows compacted", "rows held to the end"])
def test_grouped_experts_statistics_are_recorded_at_once_with_the_values_of_each_experts_calls(monkeypatch, chunk):
    """The runner's statistics hooks on the experts' linears take each linear position's calls at once (one
    recorder call per position: Hessians hold every expert's rows as views, maxima in one scatter reduction, the
    kept sample one copy). Reference: the same micro-batches recorded call by call (the recorder declined); the
    Hessians' bytes, token counts, maxima and token ranges equal (tolerance none: the same rows in the same order per
    expert, max exact), w1 and w3 sharing one Hessian, and the capped sample's replay equal to recording it. With
    16-row chunks and no slack, full chunks are summed as they fill and held rows are compacted into one buffer."""
    from msmodelslim.core.requests import Observe
    from msmodelslim.pipeline import answers, statistics
    from msmodelslim.quant import modules

    monkeypatch.setattr(statistics, "HESSIAN_CHUNK_TOKENS", chunk)
    monkeypatch.setattr(statistics, "HESSIAN_HELD_SLACK_BYTES", 0)
    experts = _expert_block("float")
    names = tuple(f"{key}.{n}" for key in experts for n in ("w1", "w3", "w2"))
    batches = [_routing(tokens=60, seed=s) for s in range(4)]

    grouped_calls = []
    found = {}
    original = modules._recorded_at_once
    for way in ("at once", "call by call"):
        if way == "at once":
            monkeypatch.setattr(modules, "_recorded_at_once",
                                lambda *a: original(*a) and (grouped_calls.append(1) or True))
        else:
            monkeypatch.setattr(modules, "_recorded_at_once", lambda *a: False)
        sample = answers.Sample(names, None)
        ctx = _experts_unit(experts, batches)
        stats = answers.observe(ctx, Observe(hessian=names, absmax=names), sample)
        replay = answers.replayed(ctx, Observe(hessian=names, absmax=names, tokens=None), sample)
        found[way] = stats, replay
    assert len(grouped_calls) == 3 * len(batches)  # w1, w3 (the same input), w2: a recorder call each per batch
    (at_once, replay_at_once), (by_call, replay_by_call) = found["at once"], found["call by call"]
    for name in names:
        assert torch.equal(at_once.hessian[name], by_call.hessian[name]), name
        assert at_once.tokens[name] == by_call.tokens[name], name
        assert torch.equal(at_once.absmax[name], by_call.absmax[name]), name
        assert torch.equal(replay_at_once.hessian[name], at_once.hessian[name]), name
        assert torch.equal(replay_at_once.absmax[name], replay_by_call.absmax[name]), name
    for key in experts:  # an expert that got no token has zeros of its own per linear
        assert (at_once.hessian[f"{key}.w1"] is at_once.hessian[f"{key}.w3"]) == (key != "5"), key
    assert any(at_once.tokens[n] for n in names) and not at_once.tokens["5.w1"]  # expert 5 gets no token


@pytest.mark.parametrize("kind", ["w4a8", "w8a8"])
def test_the_quant_reports_sums_of_grouped_experts_are_recorded_at_once_with_each_experts_values(monkeypatch, kind):
    """The runner's report hooks (`QuantError`, forward hooks) on grouped experts take each linear position's calls
    at once, after its output is whole: per-row quantities summed per expert by one float32 GEMM with the experts'
    indicator rows, the maxima by one scatter reduction. Reference: the same micro-batches recorded call by call
    (the recorder declined): maxima and token counts equal, the float32 sums (squares, activation error, moments,
    output squares) within 1e-5 relative (the same terms summed in another order)."""
    from msmodelslim.core.requests import Observe
    from msmodelslim.pipeline import answers
    from msmodelslim.quant import modules

    experts = _expert_block(kind)
    names = tuple(f"{key}.{n}" for key in experts for n in ("w1", "w3", "w2"))
    batches = [_routing(tokens=60, seed=s) for s in range(3)]

    at_once_calls, found = [], {}
    original = modules._call_recorder
    for way in ("at once", "call by call"):
        monkeypatch.setattr(modules, "_call_recorder", (lambda m: (r := original(m)) and (at_once_calls.append(1) or r))
                            if way == "at once" else (lambda m: None))
        found[way] = answers.observe(_experts_unit(experts, batches), Observe(quant_error=names)).quant_error
    assert len(at_once_calls) == 3 * len(batches)
    for name in names:
        a, b = found["at once"][name], found["call by call"][name]
        assert torch.equal(a.absmax, b.absmax) and int(a.tokens) == int(b.tokens), name
        for field in ("squares", "act_error", "moments", "output_squares"):
            assert torch.allclose(getattr(a, field), getattr(b, field), rtol=1e-5, atol=1e-6), (name, field)
    assert int(found["at once"]["5.w1"].tokens) == 0 and int(found["at once"]["3.w2"].tokens) > 0


def test_grouped_experts_with_fallbacks_equal_calling_each_expert_bit_for_bit():
    """`spec.fallback` can leave one expert's linear FLOAT and give another W8A8 among W4A8 experts: the group mixes
    module calls with shared per-token quantization. Reference: each expert called on its rows; tolerance: none."""
    from msmodelslim.core.dist import SINGLE
    from msmodelslim.model.common.expert_parallel import ep_moe_infer
    from msmodelslim.quant.modules import QuantLinear

    experts = _expert_block("w4a8")
    plain = _expert_block("float")
    experts["3"].w1 = plain["3"].w1  # FLOAT fallback
    experts["4"].w2 = QuantLinear.from_linear(plain["4"].w2, "W8A8_DYNAMIC", weight_method="minmax")
    x, idx, w = _routing()
    with torch.no_grad():
        assert torch.equal(ep_moe_infer(experts, x, idx, w, SINGLE), _expert_by_expert(experts, x, idx, w))


@pytest.mark.parametrize("int8_gemm", [False, True], ids=["float32", "cuda int8 gemm"])
@pytest.mark.parametrize("kind", ["w4a8", "w8a8"])
def test_products_in_one_buffer_equal_each_modules_integer_product(kind, int8_gemm):
    """On accelerators a grouped call writes its experts' products into one float32 buffer: the int8 rows made
    float32 once, one per-token scaling of all rows, each expert's weight scales on its rows. Reference: each
    module's `integer_product` of its rows (float32), concatenated; tolerance: none (the same float32 operations in
    the same order; on the CPU's tensors here: the products of integers are exact in any order), each of its ops
    one that Atlas A2/A3 runs (the Ascend op check); groups that do not tile the rows take the concatenation.
    CUDA's int8 GEMMs (taken on the CPU's tensors) into one int32 buffer give the same values, every group here
    smaller than the GEMM's 17 rows (each multiplies the rows after it too, which the next groups overwrite)."""
    from msmodelslim.core import ascend_check
    from msmodelslim.quant import modules as modules_module
    from msmodelslim.quant.functional import quantize_per_token
    from msmodelslim.quant.granularity import int8
    from msmodelslim.quant.modules import _one_product_buffer, _products_in_one_buffer, linears_over_row_groups

    experts = _expert_block(kind)
    modules = [expert.w1 for expert in experts.values()]
    x, _, _ = _routing()
    bounds = [(0, 3), (3, 3), (3, 10), (10, 24), (24, 25), (25, 40)]  # an expert without rows among them
    qx, sx = quantize_per_token(x, int8)
    assert _one_product_buffer(modules)
    reference = torch.cat([m.integer_product(qx[a:b], sx[a:b]) for m, (a, b) in zip(modules, bounds)])
    with pytest.MonkeyPatch.context() as mp:  # groups that leave rows out: the concatenation, not one buffer
        mp.setattr(modules_module, "_buffers_products", lambda _x: True)
        (gaps,) = linears_over_row_groups([(m,) for m in modules[:2]], x, [(0, 3), (10, 24)])
    assert torch.equal(gaps, torch.cat([modules[0](x[0:3]), modules[1](x[10:24])]))
    if int8_gemm:  # CUDA's branch, never an NPU's
        gemms = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(modules_module, "int8_gemm_fits", lambda _device, i, o: i % 8 == 0 and o % 8 == 0)
            mp.setattr(modules_module, "_int8_gemm",
                       lambda *a, _f=modules_module._int8_gemm, **k: gemms.append(1) or _f(*a, **k))
            assert torch.equal(_products_in_one_buffer(modules, (qx, sx), bounds, torch.float32), reference)
        assert len(gemms) == len(modules) - 1  # the group without rows multiplies nothing
        return
    report: dict = {}
    with ascend_check.run_checked(torch.device("cpu"), True, report):  # an NPU takes this path too
        assert torch.equal(_products_in_one_buffer(modules, (qx, sx), bounds, torch.float32), reference)
    assert report["ascend_ops_checked"] >= 3 * len(modules)


GROUP_SCALES_CHECK = """
import os
os.environ["TRITON_INTERPRET"] = "1"  # the kernel run by Triton's interpreter, on the CPU
import torch
from torch import nn
from msmodelslim.quant.modules import QuantLinear, _kernel_scaled_sums, _scale_passes

g = torch.Generator().manual_seed(3)
bounds = [(0, 5), (5, 5), (5, 40), (40, 41), (41, 100)]  # a group without rows, groups inside one row block
modules = [QuantLinear.from_linear(nn.Linear(64, 136, bias=False), "W8A8_DYNAMIC", weight_method="minmax")
           for _ in bounds]  # 136 outputs: two column blocks, the second partly masked
sums = torch.randint(-(1 << 30), 1 << 30, (100, 136), generator=g, dtype=torch.int32)  # past 2^24: rounded
sums[:3] = torch.randint(-100, 100, (3, 136), generator=g, dtype=torch.int32)
sx = torch.rand(100, generator=g) * 1e-3
kernel = _kernel_scaled_sums(sums, sx, modules, bounds)
for dtype in (torch.float32, torch.bfloat16):
    print(torch.equal(kernel.to(dtype), _scale_passes(sums.to(torch.float32), sx, modules, bounds, dtype)))
"""


def test_the_group_scales_kernel_gives_the_passes_values():
    """ops/group_scales.py (CUDA's scaling of the grouped experts' int8 GEMM sums), run by Triton's interpreter on
    the CPU, against the PyTorch passes (the sums made float32, times each row's token scale, times its module's
    weight scales), over groups of 5, 0, 35, 1 and 59 rows, sums past 2^24 (rounded to float32) and a partly masked
    column block. Tolerance none, in float32 and after the cast to bf16. A fresh interpreter: TRITON_INTERPRET must
    be set before the kernel's module is imported."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", GROUP_SCALES_CHECK], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"], out.stdout


def test_the_group_scales_kernel_compiles_for_hopper_with_two_rounded_products(hopper_ptx):
    """The scaling kernel as CUDA runs it, compiled by Triton's own compiler for sm_90 (H100 / H200) without a GPU:
    it builds, the int32 sums become float32 rounded to nearest (`cvt.rn.f32.s32`), and the two products stay
    two rounded multiplies (`mul.rn.f32`, no fused multiply-add). Reference: the PTX text."""
    from msmodelslim.ops.group_scales import _group_scales_kernel

    signature = {"SUMS": "*i32", "TOKEN_SCALES": "*fp32", "WEIGHT_SCALES": "*fp32", "GROUPS": "*i32",
                 "OUT": "*fp32", "rows": "i32", "cols": "i32", "BLOCK_ROWS": "constexpr", "BLOCK_COLS": "constexpr"}
    ptx = hopper_ptx(_group_scales_kernel, signature, {"BLOCK_ROWS": 32, "BLOCK_COLS": 128})
    assert "cvt.rn.f32.s32" in ptx and "mul.rn.f32" in ptx and "fma.rn.f32" not in ptx


GROUPED_GEMM_CHECK = """
import os
os.environ["TRITON_INTERPRET"] = "1"  # the kernel run by Triton's interpreter, on the CPU
import torch
from torch import nn
from msmodelslim.ops.grouped_gemm import grouped_int8_gemm
from msmodelslim.quant.modules import QuantLinear, _int8_gemms

g = torch.Generator().manual_seed(5)
bounds = [(0, 5), (5, 5), (5, 75), (75, 76), (76, 135)]  # an empty group, one of two row tiles, one of 1 row
modules = [QuantLinear.from_linear(nn.Linear(1064, 136, bias=False), "W8A8_DYNAMIC", weight_method="minmax")
           for _ in bounds]  # 1064 inputs: a partly masked last k block, sums past 2^24; 136 outputs: two column blocks
rows = torch.randint(-127, 128, (135, 1064), generator=g, dtype=torch.int8)
rows[0] = 127
modules[0].qweight[0] = 127  # a sum of 1064 x 127^2, past 2^24: rounded to float32
sx = torch.rand(135, generator=g) * 1e-3
kernel = grouped_int8_gemm(rows, sx, [m.qweight for m in modules], [m.weight_scale for m in modules], bounds)
for dtype in (torch.float32, torch.bfloat16):
    print(torch.equal(kernel.to(dtype), _int8_gemms(modules, rows, sx, bounds, dtype)))
print(bool((rows[:1].double() @ modules[0].qweight.double().t()).abs().max() > 2 ** 24))

from msmodelslim.ops.grouped_gemm import grouped_gemm
weights = [(torch.randn(136, 1064, generator=g) * 0.05).to(torch.bfloat16) for _ in bounds]
x = (torch.randn(135, 1064, generator=g) * 3).to(torch.bfloat16)
found, within = grouped_gemm(x, weights, bounds), True
for w, (start, end) in zip(weights, bounds):
    exact = x[start:end].double() @ w.double().t()
    bound = (x[start:end].double().abs() @ w.double().abs().t()) * 1064 * 2.0 ** -24
    within &= bool(((found[start:end].double() - exact).abs() <= bound).all())
print(within)
"""


def test_the_grouped_gemm_kernel_gives_the_gemms_per_group_and_their_scales():
    """ops/grouped_gemm.py (CUDA's grouped experts' int8 products and scales in one launch), run by Triton's
    interpreter on the CPU, against one int8 GEMM per group (`torch._int_mm`) and the scaling passes: groups of 5,
    0, 70 (two row tiles), 1 and 59 rows, 1064 inputs (a masked k block; sums past 2^24, rounded as float32), 136
    outputs (a masked column block). Tolerance none, in float32 and after the cast to bf16. Its 16-bit form (a
    statistics pass's float experts) on bf16 rows against float64 products: within the bound of float32 sums of
    exact products (n 2^-24 sum |x_i w_i|)."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", GROUPED_GEMM_CHECK], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True", "True"], out.stdout


def test_the_grouped_int8_gemm_kernel_compiles_for_hopper_with_vector_loads_and_two_rounded_products(hopper_ptx):
    """The grouped GEMM as CUDA runs it, compiled for sm_90 without a GPU (the rows, output and widths aligned as a
    launch at Kimi-K3's shapes finds them): int8 tensor-core products into int32 (`wgmma ... s32.s8.s8`), no load of
    a weight byte by byte (the address read from the table is declared aligned: without it 64 single-byte loads per
    thread made the kernel 5x slower than a GEMM per expert on the H100), the sums made float32 rounded to nearest
    and the two scales two rounded multiplies (no fused multiply-add). Reference: the PTX text."""
    from msmodelslim.ops.grouped_gemm import CONFIG, _grouped_kernel

    signature = {"X": "*i8", "TOKEN_SCALES": "*fp32", "WEIGHTS": "*i64", "WEIGHT_SCALES": "*i64", "TILES": "*i64",
                 "OUT": "*fp32", "inner": "i32", "cols": "i32", "INTEGER": "constexpr", "BLOCK_ROWS": "constexpr",
                 "BLOCK_COLS": "constexpr", "BLOCK_K": "constexpr"}
    blocks = {k: v for k, v in CONFIG.items() if k.startswith("BLOCK")}
    ptx = hopper_ptx(_grouped_kernel, signature, {"INTEGER": True, **blocks}, aligned=(0, 5, 6, 7))
    assert "s32.s8.s8" in ptx and "ld.global.b8" not in ptx
    assert "cvt.rn.f32.s32" in ptx and "mul.rn.f32" in ptx and "fma.rn.f32" not in ptx


def _failing_kernel(*_args: object) -> torch.Tensor:
    raise RuntimeError("PassManager::run failed\n(the compiler's log)")


def _unscaled_kernel(sums: torch.Tensor, *_args: object) -> torch.Tensor:
    return sums.to(torch.float32)  # what a kernel that skipped the scales would give


@pytest.mark.parametrize(("kernel", "said"), [(_failing_kernel, r"failed \(PassManager::run failed\)"),
                                              (_unscaled_kernel, r"gave other values than the passes")])
def test_a_group_scales_kernel_that_cannot_be_built_or_differs_leaves_the_scaling_to_the_passes(
        kernel, said, monkeypatch, caplog):
    """If Triton cannot build the scaling kernel on a GPU, or its first result in a process is not the passes'
    bit for bit, the run goes on with the passes (the same values) and says so once. Reference: the kernel's
    launcher replaced by one that raises as a compiler failure does, and by one that skips the scales; the
    passes' values."""
    import logging
    import re

    from msmodelslim.quant import modules as modules_module

    experts = _expert_block("w8a8")
    linears = [expert.w1 for expert in experts.values()][:3]
    bounds = [(0, 4), (4, 4), (4, 9)]
    g = torch.Generator().manual_seed(2)
    sums = torch.randint(-(1 << 20), 1 << 20, (9, linears[0].out_features), generator=g, dtype=torch.int32)
    sx = torch.rand(9, generator=g)
    reference = modules_module._scale_passes(sums.to(torch.float32), sx, linears, bounds, torch.bfloat16)
    monkeypatch.setattr(modules_module, "_kernel_scaled_sums", kernel)
    monkeypatch.setattr(modules_module.GROUP_SCALES_KERNEL, "enabled", True)
    monkeypatch.setattr(modules_module.GROUP_SCALES_KERNEL, "checked", False)
    with caplog.at_level(logging.WARNING, logger="msmodelslim.quant.modules"):
        assert modules_module._checked_group_scales(sums, sx, linears, bounds, torch.bfloat16) is None
        assert modules_module._checked_group_scales(sums, sx, linears, bounds, torch.bfloat16) is None  # off now
    assert torch.equal(modules_module._scaled_sums(sums, sx, linears, bounds, torch.bfloat16), reference)
    assert modules_module.GROUP_SCALES_KERNEL.enabled is False
    assert len(caplog.records) == 1 and re.fullmatch(
        rf"grouped experts' scales: the Triton kernel {said}; they are scaled in passes from now on: the same "
        r"values, more launches", caplog.records[0].getMessage()), caplog.records[0].getMessage()


@pytest.mark.parametrize(("kernel", "said"), [(_failing_kernel, r"failed \(PassManager::run failed\)"),
                                              (lambda rows, *_a: rows[:, :24].float(),
                                               r"gave other values than the GEMMs per group")],
                         ids=["cannot be built", "differs"])
def test_a_grouped_int8_gemm_kernel_that_cannot_be_built_or_differs_leaves_the_products_to_the_gemms(
        kernel, said, monkeypatch, caplog):
    """If Triton cannot build the grouped GEMM on a GPU, or its first result in a process is not the per-group
    GEMMs' bit for bit, the run goes on with one GEMM per group (the same values) and says so once. Reference: the
    kernel's launcher replaced by one that raises as a compiler failure does, and by one that returns other
    values."""
    import logging
    import re

    pytest.importorskip("triton")
    from msmodelslim.ops import grouped_gemm
    from msmodelslim.quant import modules as modules_module

    experts = _expert_block("w8a8")
    linears = [expert.w1 for expert in experts.values()][:3]
    bounds = [(0, 4), (4, 4), (4, 9)]
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(-127, 128, (9, linears[0].in_features), generator=g, dtype=torch.int8)
    sx = torch.rand(9, generator=g)
    monkeypatch.setattr(grouped_gemm, "grouped_int8_gemm", kernel)
    monkeypatch.setattr(modules_module.GROUPED_GEMM_KERNEL, "enabled", True)
    monkeypatch.setattr(modules_module.GROUPED_GEMM_KERNEL, "checked", False)
    with caplog.at_level(logging.WARNING, logger="msmodelslim.quant.modules"):
        assert modules_module._checked_grouped_gemm(linears, rows, sx, bounds, torch.bfloat16) is None
        assert modules_module._checked_grouped_gemm(linears, rows, sx, bounds, torch.bfloat16) is None  # off now
    assert modules_module.GROUPED_GEMM_KERNEL.enabled is False
    assert len(caplog.records) == 1 and re.fullmatch(
        rf"grouped experts' int8 GEMMs: the Triton kernel {said}; they run as one GEMM per expert from now on: the "
        r"same values, more launches", caplog.records[0].getMessage()), caplog.records[0].getMessage()


def test_a_float_grouped_gemm_is_held_to_the_gemms_per_group_within_their_rounding(monkeypatch, caplog):
    """The statistics pass's float experts on CUDA: the grouped kernel's first result is accepted when within the
    rounding of a GEMM per group (here: those GEMMs' own values, with float32 noise of 2^-20 relative), refused
    when 1 % off (the modules are called per group from then on, said once). Reference: F.linear per group."""
    import logging

    pytest.importorskip("triton")
    from msmodelslim.ops import grouped_gemm
    from msmodelslim.quant import modules as modules_module

    experts = _expert_block("float")
    linears = [expert.w1 for expert in experts.values()][:3]
    bounds = [(0, 4), (4, 4), (4, 9)]
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def per_group(factor: float):
        def kernel(rows, weights, bounds_):
            out = torch.zeros(rows.shape[0], weights[0].shape[0])
            for w, (start, end) in zip(weights, bounds_):
                out[start:end] = torch.nn.functional.linear(rows[start:end], w).float() * factor
            return out
        return kernel

    monkeypatch.setattr(modules_module.FLOAT_GROUPED_KERNEL, "enabled", True)
    monkeypatch.setattr(modules_module.FLOAT_GROUPED_KERNEL, "checked", False)
    monkeypatch.setattr(grouped_gemm, "grouped_gemm", per_group(1 + 2.0 ** -20))
    found = modules_module._float_products_in_one_buffer(linears, x, bounds)
    assert found is not None and modules_module.FLOAT_GROUPED_KERNEL.checked
    monkeypatch.setattr(modules_module.FLOAT_GROUPED_KERNEL, "checked", False)
    monkeypatch.setattr(grouped_gemm, "grouped_gemm", per_group(1.01))
    with caplog.at_level(logging.WARNING, logger="msmodelslim.quant.modules"):
        assert modules_module._float_products_in_one_buffer(linears, x, bounds) is None
    assert modules_module.FLOAT_GROUPED_KERNEL.enabled is False
    assert "grouped experts' float GEMMs: the Triton kernel gave other values than the GEMMs per group (beyond " \
           "their rounding); they run as one GEMM per expert from now on" in caplog.text


def test_affinity_guided_experts_weigh_each_expert_hessian_by_its_router_weights():
    """`experts_weigh_rows` (spec.affinity_guided_experts): an expert's Hessian is sum_t w_t x_t x_t^T over its routed
    rows, scaled to their count, its w1 and w3 share it, and the block's output is unchanged (bit for bit: the
    dispatch runs expert by expert, which the grouped one equals). Reference: float64 sums from the routing table;
    tolerance 1e-5 relative (float32 sums of rows scaled by sqrt(w) in float32)."""
    from msmodelslim.core.dist import SINGLE
    from msmodelslim.core.requests import Observe
    from msmodelslim.model.base import Unit
    from msmodelslim.model.common.expert_parallel import ep_moe_infer, experts_weigh_rows
    from msmodelslim.pipeline.answers import observe
    from msmodelslim.processor.base import UnitContext

    experts = _expert_block("float")
    x, idx, w = _routing()
    plain = ep_moe_infer(experts, x, idx, w, SINGLE)

    class Adapter:
        def is_rank_local(self, name: str) -> bool:
            return True

        def statistics_pass(self):
            return experts_weigh_rows(block)

    block = torch.nn.Module()
    block.experts = experts
    block._msmodelslim_ep = type("EP", (), {"affinity": False})()  # what apply_ep_patches attaches
    outputs = []
    ctx = UnitContext(Unit("layers.0", "decoder", "", 0), experts, Adapter(), SINGLE,
                      run_samples=lambda: outputs.append(ep_moe_infer(experts, x, idx, w, SINGLE,
                                                                      affinity=block._msmodelslim_ep.affinity)))
    names = [f"{key}.{p}" for key in experts for p in ("w1", "w3")]
    stats = observe(ctx, Observe(hessian=tuple(names)))
    assert torch.equal(outputs[0], plain)
    for key in experts:
        rows, cols = torch.nonzero(idx == int(key), as_tuple=True)
        h = stats.hessian[f"{key}.w1"]
        assert stats.tokens[f"{key}.w1"] == rows.numel()
        if not rows.numel():  # expert 5: zeros of its own for each reader
            assert not h.any()
            continue
        assert stats.hessian[f"{key}.w3"] is h
        weights = w[rows, cols].double()
        xs = x[rows].double()
        reference = rows.numel() * (xs.t() * weights) @ xs / weights.sum()
        assert float((h.double() - reference).norm() / reference.norm()) < 1e-5


def test_balanced_experts_top_each_expert_up_to_its_share_with_its_highest_scored_tokens():
    """`ep_moe_infer(scores=...)` (spec.balanced_experts): an expert the router sends fewer than ceil(tokens x k /
    experts) rows computes, for its observers, on its routed rows and then the highest-logit other rows up to that
    share; one with more sees its routed rows only; the block's output is the routed one. Reference: the rows each
    expert's w1 receives against the routing table and a descending sort of the logits (exact); the output against
    the dispatch without scores (bf16 tolerances: a row of a matmul over more rows may round differently)."""
    from msmodelslim.core.dist import SINGLE
    from msmodelslim.model.common.expert_parallel import ep_moe_infer

    experts = _expert_block("float")
    x, idx, w = _routing()
    logits = torch.randn(x.shape[0], 9, generator=torch.Generator().manual_seed(2))
    share = -(-x.shape[0] * idx.shape[1] // 9)  # 40 tokens x 3 / 9 experts -> 14
    seen: dict[str, torch.Tensor] = {}
    for key, expert in experts.items():
        expert.w1.register_forward_pre_hook(lambda _m, args, k=key: seen.__setitem__(k, args[0]))
    plain = ep_moe_infer(experts, x, idx, w, SINGLE)
    seen.clear()
    balanced = ep_moe_infer(experts, x, idx, w, SINGLE, scores=logits)
    torch.testing.assert_close(balanced, plain)
    topped = 0
    for key in experts:
        routed = torch.nonzero(idx == int(key), as_tuple=True)[0]
        others = [t for t in logits[:, int(key)].argsort(descending=True).tolist() if t not in set(routed.tolist())]
        added = others[:max(0, share - routed.numel())]
        topped += bool(added)
        assert torch.equal(seen[key], x[torch.tensor(routed.tolist() + added, dtype=torch.long)]), key
    assert topped >= 2  # expert 5 (no routed token) and at least one more were topped up
