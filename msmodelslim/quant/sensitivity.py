"""How much quantizing one linear moves its output on the calibration tokens: the error model of the quant report.

With Y = X W^T the float output and Y~ = Q(X) Q(W)^T the deployed one, Y~ - Y = X dW^T + dX W~^T (+ a product of
errors, negligible): dW = Q(W) - W the weight's rounding, dX = Q(X) - X the activation's. The two terms are
independent, so their squared norms add:

- weight error: ||X dW^T||^2 = tr(dW H dW^T), H = X^T X. Exact where GPTQ's Hessian is at hand; else H's diagonal
  (h_j = sum_t x_tj^2), which is right for rounding errors uncorrelated across input columns (min/max, ssz, grid:
  each weight rounds on its own) and an upper estimate for GPTQ, whose errors compensate each other;
- activation error: ||dX W~^T||^2 = sum_j a_j ||W~_:j||^2, a_j = sum_t dx_tj^2: exact in expectation for rounding
  errors independent across channels (per-token and per-block quantizers round each element on its own).

Both are relative to ||Y~||^2, summed from the deployed output itself (Y~ is within the error of Y), so a linear's
`error` is its relative output MSE. The statistics come from the runner's forward of the quantized unit
(`pipeline/report.py`), which inference runs anyway: they cost no calibration pass.

Weight statistics: `kurtosis` (E[(w - mean)^4] / var^2 of all weights: 3 for a Gaussian, large for outliers), `std`.
Activation statistics, of every element of the input over the calibration tokens, as msModelSlim's `analyze linear`
reads activations: `act_kurtosis` (the same ratio, from float32 raw moments), `act_peak_ratio` (max |x| / std) and
`act_channel_ratio` (the largest channel range over the median one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from msmodelslim.core.device import tensor_core_fp32_matmuls


@dataclass
class WeightError:
    """What linear_quant knows of one linear's quantization: per input column the squared rounding error summed
    over rows, and the squared quantized weights ([in] float32 each); the exact relative weight error where a
    Hessian was at hand; the float weight's kurtosis and standard deviation."""

    method: str  # the weight method that rounded it (linear_quant's `qconfig.weight.method`)
    column_error: torch.Tensor
    column_weight: torch.Tensor
    exact: float | None
    kurtosis: float
    std: float
    hessian_tokens: int | None = None  # the calibration tokens behind the Hessian, where there was one


def weight_statistics(w: torch.Tensor) -> tuple[float, float]:
    """(kurtosis, std) of all elements of `w` (float32 math); a constant weight has kurtosis 0."""
    x = w.detach().float().reshape(-1)
    centred = x - x.mean()
    var = centred.square().mean()
    if float(var) <= 0:
        return 0.0, 0.0
    return float(centred.pow(4).mean() / var.square()), float(var.sqrt())


def hessian_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """(tr(dW H dW^T), tr(W H W^T)) of quantizing `w` [out, in] to `w_hat` with the input Hessian H = X^T X
    [in, in]: float32 [2] on w's device, nothing read back (GPTQ's job computes it where its Hessian is). A report's
    number, so the products take the tensor cores' float32 (TF32 / HF32, ~1e-3 relative; exact float32 on a CPU)."""
    wf = w.detach().float()
    diff = w_hat.detach().float().to(wf.device) - wf
    h = hessian.to(wf.device, torch.float32)
    with tensor_core_fp32_matmuls(wf.device):
        return torch.stack([((diff @ h) * diff).sum(), ((wf @ h) * wf).sum()])


def weight_error(w: torch.Tensor, w_hat: torch.Tensor, method: str, hessian_sums: torch.Tensor | None = None,
                 hessian_tokens: int | None = None) -> WeightError:
    """The report's record of quantizing `w` [out, in] to `w_hat` (the weight the engine multiplies by), with
    `hessian_error`'s sums when the quantizer had a Hessian (then tr(dW H dW^T) / tr(W H W^T) exactly) and the
    tokens it summed."""
    wf, qf = w.detach().float(), w_hat.detach().float().to(w.device)
    diff = qf - wf
    exact = None
    if hessian_sums is not None:
        error, signal = hessian_sums.tolist()
        exact = error / signal if signal > 0 else None
    kurtosis, std = weight_statistics(wf)
    return WeightError(method, diff.square().sum(dim=0), qf.square().sum(dim=0), exact, kurtosis, std,
                       None if hessian_sums is None else hessian_tokens)


@dataclass
class InputSums:
    """A quantized linear's inputs over the calibration tokens, in the weight's basis (after any online rotation):
    per channel sum x^2, sum (Q(x) - x)^2 and max |x| ([in] float32), the raw moments sum x^k, k = 1..4, of all
    input elements (for the activation kurtosis), the output's sum of squares and the tokens."""

    squares: torch.Tensor
    act_error: torch.Tensor
    absmax: torch.Tensor
    moments: torch.Tensor  # float32 [4]
    output_squares: torch.Tensor  # float32 scalar
    tokens: torch.Tensor  # int64 scalar

    @classmethod
    def zeros(cls, width: int, device: torch.device) -> InputSums:
        z = torch.zeros(width, dtype=torch.float32, device=device)
        return cls(z, z.clone(), z.clone(), torch.zeros(4, dtype=torch.float32, device=device),
                   torch.zeros((), dtype=torch.float32, device=device),
                   torch.zeros((), dtype=torch.int64, device=device))

    def record(self, x: torch.Tensor, x_quant: torch.Tensor | None, y: torch.Tensor) -> None:
        """One call's input x [..., in], its quantized form (None: activations stay float) and the output y."""
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        if not flat.shape[0]:
            return
        if x_quant is not None:
            self.act_error += (x_quant.detach().reshape(flat.shape).float() - flat).square().sum(dim=0)
        torch.maximum(self.absmax, flat.abs().amax(dim=0), out=self.absmax)
        squares = flat.square()
        self.squares += squares.sum(dim=0)
        self.moments += torch.stack([flat.sum(), squares.sum(), (squares * flat).sum(), squares.square().sum()])
        self.output_squares += y.detach().float().square().sum()
        self.tokens += flat.shape[0]


def significant(value: float | None, digits: int = 4) -> float | None:
    """`value` to `digits` significant digits: the report's float sums are not bit-exact across rank counts."""
    if value is None or not math.isfinite(value) or value == 0:
        return value
    return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))


def report_entry(scheme: str, weight: WeightError, sums: InputSums) -> dict[str, object]:
    """One linear's line of the quant report (module docstring); errors are None when no token reached it."""
    out_sq = float(sums.output_squares)
    tokens = int(sums.tokens)
    weight_err = act_err = None
    if tokens and out_sq > 0:
        if weight.exact is not None:
            weight_err = weight.exact
        else:
            weight_err = float((sums.squares * weight.column_error.to(sums.squares.device)).sum()) / out_sq
        act_err = float((sums.act_error * weight.column_weight.to(sums.act_error.device)).sum()) / out_sq
    absmax = sums.absmax
    positive = absmax[absmax > 0]
    ratio = float(absmax.max() / positive.median()) if positive.numel() else None
    act_kurtosis = act_peak = None
    count = tokens * absmax.numel()
    if count:
        m1, m2, m3, m4 = (float(v) / count for v in sums.moments)
        var = m2 - m1 * m1
        if var > 0:  # central moments from the raw ones
            act_kurtosis = (m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1 ** 4) / (var * var)
            act_peak = float(absmax.max()) / math.sqrt(var)
    return {
        "scheme": scheme,
        "method": weight.method,
        "error": significant(None if weight_err is None else weight_err + act_err),
        "weight_error": significant(weight_err),
        "act_error": significant(act_err),
        "hessian": "exact" if weight.exact is not None else "diagonal",
        "tokens": tokens,  # the tokens the report observed (spec.report_tokens)
        "hessian_tokens": weight.hessian_tokens,  # those behind GPTQ's Hessian: every calibration token it saw
        "inputs": int(sums.squares.numel()),  # fewer tokens than inputs: a rank-deficient Hessian
        "output_energy": significant(out_sq),  # sum over the tokens of ||y||^2: error * this is the absolute error
        "weight_kurtosis": significant(weight.kurtosis),
        "weight_std": significant(weight.std),
        "act_absmax": significant(float(absmax.max()) if absmax.numel() else None),
        "act_channel_ratio": significant(ratio),  # max channel range / median channel range: outlier channels
        "act_kurtosis": significant(act_kurtosis),  # of all input elements: 3 for a Gaussian
        "act_peak_ratio": significant(act_peak),  # max |x| / std of all input elements
    }
