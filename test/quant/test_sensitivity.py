"""The quant report's error model (quant/sensitivity.py) against direct float64 measurements of a quantized
linear's output error."""

import pytest
import torch
from torch import nn

from msmodelslim.core.dist import SINGLE
from msmodelslim.core.requests import Observe, Stats
from msmodelslim.pipeline.statistics import QuantError
from msmodelslim.quant import QuantLinear
from msmodelslim.quant.sensitivity import InputSums, hessian_error, report_entry, weight_error, weight_statistics


def _measured(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    """||y - x W^T||^2 / ||x W^T||^2 in float64."""
    ref = x.double() @ w.double().t()
    return float((y.double() - ref).square().sum() / ref.square().sum())


def _observed(ql: QuantLinear, x: torch.Tensor) -> tuple[torch.Tensor, InputSums]:
    """ql(x) and the report's sums of that call, as the runner's statistic (`QuantError`) records them from a
    forward hook and reduces them (one rank)."""
    kind = QuantError(Observe(quant_error=("ql",)), {}, torch.device("cpu"))
    handle = ql.register_forward_hook(lambda module, args, y: kind.record_call("ql", module, args[0], y))
    try:
        y = ql(x)
    finally:
        handle.remove()
    stats = Stats()
    kind.finish({"ql": ql}, SINGLE, lambda name: True, stats)
    return y, stats.quant_error["ql"]


def test_weight_error_with_the_hessian_is_the_exact_output_error_of_the_weight():
    """tr(dW H dW^T) / tr(W H W^T) against ||X dW^T||^2 / ||X W^T||^2 in float64; tol 1e-4 relative (float32)."""
    torch.manual_seed(0)
    x = torch.randn(300, 64) * torch.linspace(0.1, 3, 64)
    w = torch.randn(32, 64)
    w_hat = w + 0.05 * torch.randn(32, 64)
    got = weight_error(w, w_hat, "gptq", hessian_error(w, w_hat, x.t() @ x)).exact
    assert got == pytest.approx(_measured(x, w, x @ w_hat.t()), rel=1e-4)


@pytest.mark.parametrize("scheme", ["W4A8_DYNAMIC", "W8A8_DYNAMIC", "W4A4_DYNAMIC", "W4A8_MXFP"])
def test_report_error_estimates_the_measured_output_error_of_a_quantized_linear(scheme):
    """Weight rounding (min/max: independent per weight) and activation rounding on channels of different scales:
    the report's error against the measured relative output error of the deployed forward; tol 15 % relative
    (the model is exact in expectation over the rounding, not per draw)."""
    torch.manual_seed(1)
    lin = nn.Linear(256, 96, bias=False)
    ql = QuantLinear.from_linear(lin, scheme, weight_method="minmax")
    ql.weight_error = weight_error(lin.weight, ql.dequantized_weight(), "minmax")
    x = torch.randn(4, 512, 256) * torch.rand(256) * 2
    y, sums = _observed(ql, x)
    entry = report_entry(scheme, ql.weight_error, sums)
    assert entry["hessian"] == "diagonal" and entry["tokens"] == 4 * 512
    assert entry["error"] == pytest.approx(_measured(x.reshape(-1, 256), lin.weight.detach(), y.reshape(-1, 96)),
                                           rel=0.15)
    assert entry["error"] == pytest.approx(entry["weight_error"] + entry["act_error"], rel=1e-3)


def test_act_error_is_measured_and_zero_for_a_weight_only_scheme():
    """W4A16_MXFP4 keeps activations in the model dtype: act_error 0, the whole error is the weight's."""
    torch.manual_seed(2)
    lin = nn.Linear(64, 16, bias=False)
    ql = QuantLinear.from_linear(lin, "W4A16_MXFP4", weight_method="minmax")
    ql.weight_error = weight_error(lin.weight, ql.dequantized_weight(), "minmax")
    _, sums = _observed(ql, torch.randn(128, 64))
    entry = report_entry("W4A16_MXFP4", ql.weight_error, sums)
    assert entry["act_error"] == 0 and entry["weight_error"] > 0


def test_the_report_sees_the_input_in_the_weight_basis_after_the_online_rotation():
    """A linear with an online rotation T computes (x T^T) W'^T: its sums are of x T^T (reference: float32 math)."""
    torch.manual_seed(3)
    lin = nn.Linear(32, 8, bias=False)
    rot, _ = torch.linalg.qr(torch.randn(32, 32))
    lin.register_buffer("online_rotation", rot)
    ql = QuantLinear.from_linear(lin, "W8A8_DYNAMIC", weight_method="minmax")
    x = torch.randn(50, 32)
    _, sums = _observed(ql, x)
    rotated = x @ rot.t()
    assert torch.allclose(sums.squares, rotated.square().sum(0), rtol=1e-4)
    assert torch.allclose(sums.absmax, rotated.abs().amax(0), rtol=1e-5)


def test_a_linear_no_token_reached_has_no_error_but_keeps_its_weight_statistics():
    lin = nn.Linear(32, 8, bias=False)
    ql = QuantLinear.from_linear(lin, "W4A8_DYNAMIC", weight_method="minmax")
    entry = report_entry("W4A8_DYNAMIC", weight_error(lin.weight, ql.dequantized_weight(), "minmax"),
                         InputSums.zeros(32, torch.device("cpu")))
    assert entry["error"] is None and entry["tokens"] == 0 and entry["weight_kurtosis"] > 0


def test_weight_kurtosis_flags_an_outlier_column():
    """A Gaussian weight has kurtosis ~3 (tol 0.3 at 16k samples); one column x30 makes it far larger."""
    torch.manual_seed(4)
    w = torch.randn(128, 128)
    assert weight_statistics(w)[0] == pytest.approx(3.0, abs=0.3)
    w[:, 5] *= 30
    assert weight_statistics(w)[0] > 30


def test_activation_kurtosis_and_peak_ratio_match_float64_over_every_input_element():
    """act_kurtosis E[(x - mean)^4] / var^2 and act_peak_ratio max|x| / std of all input elements, from the float32
    raw moments, against float64 on the same elements; tol 1e-3 relative (4 significant digits kept)."""
    torch.manual_seed(5)
    lin = nn.Linear(64, 16, bias=False)
    ql = QuantLinear.from_linear(lin, "W8A8_DYNAMIC", weight_method="minmax")
    x = torch.randn(3, 200, 64) + 0.3
    x[..., 7] *= 25  # an outlier channel
    _, sums = _observed(ql, x)
    entry = report_entry("W8A8_DYNAMIC", weight_error(lin.weight, ql.dequantized_weight(), "minmax"), sums)
    ref = x.double().reshape(-1)
    centred = ref - ref.mean()
    var = centred.square().mean()
    assert entry["act_kurtosis"] == pytest.approx(float(centred.pow(4).mean() / var.square()), rel=1e-3)
    assert entry["act_peak_ratio"] == pytest.approx(float(ref.abs().max() / var.sqrt()), rel=1e-3)
    assert entry["act_kurtosis"] > 10
