"""The attention quantizers and their statistics: calibration ranges, scales, int8 / fp8 rounding, the description.

References: msModelSlim 26.1.0's RecallWindowObserver loop (sort, slide a window of int(ratio * n) values, keep the
first narrowest), written out here in plain Python; its scale rules (max(|min|, |max|) / 127 for int8, / 448 for
fp8); float64 arithmetic for the rounding; its `update_fa_quant_type` strings ("INT8", "Q_FP8_DYNAMIC_KV_FP8").
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from msmodelslim.core.dist import SINGLE
from msmodelslim.core.requests import Observe
from msmodelslim.model.base import Unit
from msmodelslim.pipeline.answers import observe
from msmodelslim.pipeline.statistics import recall_window
from msmodelslim.processor.base import UnitContext
from msmodelslim.quant.attention import (
    AttentionFakeQuant,
    AttentionQuantSpec,
    FA3QuantPlaceHolder,
    head_scales,
)
from msmodelslim.serving.ascendv1 import attention_quant_type, parse_attention_quant_type

INT8, FP8 = AttentionQuantSpec("int8"), AttentionQuantSpec("fp8_e4m3")


def msmodelslim_recall_window(row: list[float], ratio: float) -> tuple[float, float]:
    values = sorted(row)
    keep = int(ratio * len(values))
    best, window = float("inf"), (0.0, 0.0)
    for i in range(len(values) - keep + 1):
        width = values[i + keep - 1] - values[i]
        if width < best:
            best, window = width, (values[i], values[i + keep - 1])
    return window


@pytest.mark.parametrize("ratio", [0.9999, 0.99, 0.9, 1.0])
def test_recall_window_is_msmodelslims_narrowest_window(ratio):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5000, generator=g) * torch.tensor([[1.0], [3.0], [0.01]])
    x[0, :7] = 40.0  # outliers on one side
    x[1] = torch.round(x[1])  # ties everywhere
    x = x.to(torch.bfloat16)
    low, high = recall_window(x, ratio)
    for r in range(3):
        assert (float(low[r]), float(high[r])) == msmodelslim_recall_window(x[r].tolist(), ratio)


class _Points(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fa_q = FA3QuantPlaceHolder(heads=4, ratio=0.99)
        self.fa_k = FA3QuantPlaceHolder(heads=1, ratio=1.0)


def _head_ranges(samples: list[torch.Tensor]):
    module = _Points()

    def run() -> None:
        for q in samples:
            module.fa_q(q)
            module.fa_k(q[:, :1])

    ctx = UnitContext(Unit("layers.0", "decoder", "model.layers.0.", 0), module, _NoExperts(), SINGLE, run)
    return observe(ctx, Observe(head_ranges={"fa_q": (4, 0.99), "fa_k": (1, 1.0)})).head_ranges


class _NoExperts:
    def is_rank_local(self, name: str) -> bool:
        return False

    def statistics_pass(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def test_head_ranges_are_per_sample_windows_combined_by_min_and_max_in_any_order():
    g = torch.Generator().manual_seed(1)
    samples = [torch.randn(1, 4, 30, 8, generator=g) * (i + 1) for i in range(5)]
    stats = _head_ranges(samples)
    lows, highs = zip(*(recall_window(s[0].reshape(4, -1), 0.99) for s in samples))
    assert torch.equal(stats["fa_q"][0], torch.stack(lows).amin(0))
    assert torch.equal(stats["fa_q"][1], torch.stack(highs).amax(0))
    assert torch.equal(stats["fa_k"][1], torch.stack([s[0, 0].max() for s in samples]).max().reshape(1))
    shuffled = _head_ranges(samples[::-1])
    for name in stats:
        assert all(torch.equal(a, b) for a, b in zip(stats[name], shuffled[name]))


def test_scales_are_msmodelslims_symmetric_rule_in_bfloat16_values():
    # msModelSlim's saved scales are bf16(max(|low|, |high|) / bound): the dtype vllm-ascend holds them in
    low, high = torch.tensor([-3.0, -0.5, 0.0]), torch.tensor([1.0, 2.0, 0.0])

    def bf16(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64).to(torch.bfloat16).float()

    assert torch.equal(head_scales(low, high, INT8), bf16([3 / 127, 2 / 127, torch.finfo().eps]))
    assert torch.equal(head_scales(low, high, FP8), bf16([3 / 448, 2 / 448, 1e-12]))


def test_int8_per_head_rounds_each_head_to_its_grid():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 7, 16, generator=g) * torch.tensor([1.0, 5.0, 0.2]).view(1, 3, 1, 1)
    scale = torch.tensor([0.5, 1.0, 0.01]) / 127
    out = AttentionFakeQuant(INT8, scale)(x).double()
    s = scale.double().view(1, 3, 1, 1)
    ref = torch.round(x.double() / s).clamp(-128, 127) * s  # float64 reference
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-12)
    assert float(out.abs().amax(dim=(0, 2, 3))[2]) <= 0.01 * 128 / 127 * (1 + 1e-6)  # clipped outliers stay in range


def test_fp8_per_head_keeps_e4m3_values_and_relative_error():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 9, 32, generator=g)
    scale = x.abs().amax(dim=(0, 2, 3)) / 448
    out = AttentionFakeQuant(FP8, scale)(x)
    grid = out / scale.view(1, -1, 1, 1)
    assert torch.allclose(grid.to(torch.float8_e4m3fn).float(), grid, rtol=1e-6)  # every value is an e4m3 number
    assert float(grid.abs().max()) == pytest.approx(448.0)
    big = x.abs() > 1e-2 * x.abs().max()
    assert float(((out - x).abs() / x.abs())[big].max()) <= 2.0 ** -4  # e4m3: 3 mantissa bits


def test_per_token_scales_each_token_and_head_at_run_time():
    x = torch.tensor([[[[1.0, -2.0], [0.25, 0.5]]]])  # [1, 1, 2 tokens, 2]
    out = AttentionFakeQuant(AttentionQuantSpec("int8", "per_token"))(x)
    assert torch.allclose(out, x, atol=2.0 / 127 / 2 + 1e-7)
    assert float(out[0, 0, 0].abs().max()) == pytest.approx(2.0)  # each row's max is exact
    assert float(out[0, 0, 1].abs().max()) == pytest.approx(0.5)


def test_an_observe_only_point_passes_its_input_through():
    x = torch.randn(1, 1, 4, 8)
    assert torch.equal(AttentionFakeQuant(INT8, torch.tensor([1e-3]), observe_only=True)(x), x)


@pytest.mark.parametrize("specs, text", [
    ({"fa_q": INT8, "fa_k": INT8, "fa_v": INT8}, "INT8"),
    ({"fa_q": FP8, "fa_k": FP8, "fa_v": FP8}, "FP8"),
    ({"fa_q": AttentionQuantSpec("fp8_e4m3", "per_token"), "fa_k": FP8, "fa_v": FP8}, "Q_FP8_DYNAMIC_KV_FP8"),
    ({b: AttentionQuantSpec("int8", "per_token") for b in ("fa_q", "fa_k", "fa_v")}, "INT8_DYNAMIC"),
    ({"fa_k": INT8}, "K_INT8"),
])
def test_attention_quant_type_is_msmodelslims_string_and_reads_back(specs, text):
    assert attention_quant_type(specs) == text
    assert parse_attention_quant_type(text) == specs


@pytest.mark.parametrize("text", ["INT4", "Q_INT8_Q_FP8", "QK_", "int8", "P_INT8"])
def test_an_unknown_attention_quant_type_is_refused(text):
    with pytest.raises(ValueError):
        parse_attention_quant_type(text)
