"""Per-matrix quantized output error of the weight methods and smoothing variants, on real matrices and held-out
tokens of kimi-linear-mini.

Protocol (issue 15): 16 non-overlapping 512-token windows of python_tutorial.txt; windows 0-7 calibrate, windows 8-15
measure. The model runs layer by layer through the toolkit's own runner with the practice's QuaRot first, so every
matrix is what linear_quant would see; a capture step records each chosen linear's inputs. For each matrix W and
method, the error is ||Qa(X) Q(W)^T - X W^T||^2 / ||X W^T||^2 on the held-out X, with Qa the per-token activation
quantizer (int8 for W4A8, int4 for W4A4) and Q the per-channel int4 weight quantizer of the method.

Methods: minmax, ssz (the default until issue 15), grid, gptq (GPTQ with the diag(H)-weighted grid scale, the new
default) and gptq_minmax (GPTQ with min/max scales, as msModelSlim 26.1.0 ships it); per-group W4A8_DYNAMIC
(issue 25): ssz_g<G> and gptq_g<G>, one fp16 scale per G inputs of a row, for G in 32, 64 (the
mini's w2 has 192 inputs, so larger groups do not divide it). MX weights (issue 25) with MXFP8 activations per block
of 32: mxfp4_* and mxfp8_* for minmax, grid (the exponent search) and gptq; `mx_median_ratio_vs_minmax`. The
matrices are QuaRot-rotated, so the experts are off their checkpoint's FP4 grid (a re-quantization). Smoothing variants, with the
new default's weights: none, alpha 0.9 (the former practice) and the searched strength (iter_smooth's own model,
`modelled_error`, on the calibration windows), on up-down (routed expert w2), norm-linear (KDA q_proj, MLA q_a /
kv_a) and ov (MLA o_proj).

    python bench/layer_error.py [--windows 16] [--experts 2]

Last line: JSON with the per-matrix table and `expert_w4a8_error_ratio` (median over routed-expert matrices of
gptq / ssz at W4A8; target <= 0.7).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHARED, machine, print_result  # noqa: E402

from msmodelslim.core.config import build_dataclass  # noqa: E402
from msmodelslim.eval.perplexity import make_windows, tokenize  # noqa: E402
from msmodelslim.model.registry import resolve_model_type  # noqa: E402
from msmodelslim.pipeline.layer_wise import LayerWiseRunner  # noqa: E402
from msmodelslim.processor.base import Processor  # noqa: E402
from msmodelslim.processor.iter_smooth import SEARCH_ALPHAS, error_parts, modelled_errors, smooth_scale  # noqa: E402
from msmodelslim.processor.quarot import QuaRotConfig, QuaRotProcessor  # noqa: E402
from msmodelslim.quant.functional import fake_quant_per_token, minmax_scale  # noqa: E402
from msmodelslim.quant.gptq import gptq_quantize  # noqa: E402
from msmodelslim.quant.granularity import PerChannel, int4, int8  # noqa: E402
from msmodelslim.quant.modules import quantize_weight  # noqa: E402
from msmodelslim.quant.mx import MXFP8, MXFormat, decode_weight, fake_quant_mx, mx_format  # noqa: E402

GROUPS = (32, 64)  # per-group W4A8_DYNAMIC (issue 25): `<method>_g<size>`; the mini's experts have 192 inputs
METHODS = ("minmax", "ssz", "grid", "gptq", "gptq_minmax", *(f"{m}_g{g}" for g in GROUPS for m in ("ssz", "gptq")))
NEW_DEFAULT = "gptq"
# MX weights (issue 25), as W4A8_MXFP / W8A8_MXFP8 compute: MXFP8 activations per block of 32
MX_METHODS = tuple(f"{fmt}_{m}" for fmt in ("mxfp4", "mxfp8") for m in ("minmax", "grid", "gptq"))


def targets(layers: list[int], experts: int) -> dict[str, str]:
    """Live name inside its layer unit -> kind, for kimi-linear-mini (layer 0 dense MLP, KDA and MLA layers)."""
    out = {"layers.0": {"mlp.gate_proj": "dense", "mlp.up_proj": "dense", "mlp.down_proj": "dense",
                        "self_attn.q_proj": "kda", "self_attn.o_proj": "kda"}}
    for layer in layers:
        names = {f"mlp.experts.{e}.{w}": "expert" for e in range(experts) for w in ("w1", "w3", "w2")}
        names.update({"mlp.shared_experts.gate_proj": "shared",
                      "mlp.shared_experts.down_proj": "shared"})
        out[f"layers.{layer}"] = names
    out["layers.3"] = {"self_attn.kv_a_proj_with_mqa": "mla", "self_attn.o_proj": "mla", **out.get("layers.3", {})}
    return out


class Capture(Processor):
    """Bench-only step: records the inputs of chosen linears per calibration window (after the processors
    before it), and the weights."""

    def __init__(self, wanted: dict[str, dict[str, str]]) -> None:
        self.wanted = wanted
        self.inputs: dict[str, list[list[torch.Tensor]]] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def process_unit(self, ctx: Any) -> None:
        names = self.wanted.get(ctx.unit.name, {})
        if not names:
            return
        modules = dict(ctx.module.named_modules())
        window = [-1]
        handles = [ctx.module.register_forward_pre_hook(lambda *_: window.__setitem__(0, window[0] + 1))]
        for name in names:
            key = f"{ctx.unit.name}.{name}"
            self.inputs[key] = []
            self.weights[key] = modules[name].weight.detach().float().clone()

            def hook(_m: nn.Module, args: tuple, key: str = key) -> None:
                per_window = self.inputs[key]
                while len(per_window) <= window[0]:
                    per_window.append([])
                per_window[window[0]].append(args[0].detach().reshape(-1, args[0].shape[-1]).float().clone())

            handles.append(modules[name].register_forward_pre_hook(hook))
        try:
            ctx.run_samples()
        finally:
            for h in handles:
                h.remove()


def rows(parts: list[list[torch.Tensor]], lo: int, hi: int, width: int) -> torch.Tensor:
    chunks = [t for w in parts[lo:hi] for t in w]
    return torch.cat(chunks) if chunks else torch.zeros(0, width)


def quantized(w: torch.Tensor, method: str, h: torch.Tensor, tokens: int) -> torch.Tensor:
    """The dequantised int4 weight of `method` (fp32 scales, as the W4A8 MoE kernel keeps them)."""
    if method == "gptq_minmax":  # msModelSlim 26.1.0: min/max scales, H as measured
        scale = minmax_scale(w, int4, PerChannel()).float()
        return gptq_quantize(w, h, scale, int4).float() * scale
    method, _, group = method.partition("_g")
    q, scale = quantize_weight(w, int4, method, hessian=h, tokens=tokens, group_size=int(group or 0))
    return q.float() * (scale.repeat_interleave(int(group), dim=1) if group else scale)


def output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor, act: Any) -> float:
    """||Qa(X) Wq^T - X W^T||^2 / ||X W^T||^2; Qa per token (int bits) or per block of 32 (an MX format)."""
    ref = x.double() @ w.double().t()
    xq = fake_quant_mx(x, act).double() if isinstance(act, MXFormat) else fake_quant_per_token(x.double(), act)
    got = xq @ wq.double().t()
    return float((got - ref).square().sum() / ref.square().sum().clamp_min(1e-30))


def searched_scale(x_cal: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, float | None]:
    """iter_smooth's search on one reader: no smoothing or the alpha of least modelled error (W4A8)."""
    x_max, w_max = x_cal.abs().amax(0).double(), w.abs().amax(0).double()
    candidates = [torch.ones_like(x_max)] + [smooth_scale(x_max, w_max, a, 1e-5) for a in SEARCH_ALPHAS]
    ranges = torch.tensor([float((x_cal.double().abs() / s).amax(-1).square().sum()) for s in candidates])
    errors = modelled_errors(error_parts(w, candidates, h, int4), ranges, int8).tolist()
    best = min(range(len(errors)), key=errors.__getitem__)
    return candidates[best], None if best == 0 else SEARCH_ALPHAS[best - 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(SHARED / "models" / "kimi-linear-mini"))
    parser.add_argument("--text", default=str(SHARED / "data" / "text" / "python_tutorial.txt"))
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--experts", type=int, default=2, help="routed experts measured per MoE layer")
    parser.add_argument("--moe-layers", default="1,5")
    parser.add_argument("--cache", help="save the captured inputs here, or load them if the file exists")
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()

    entry = resolve_model_type("Kimi-Linear")
    adapter = entry.load_adapter_class()(args.model, trust_remote_code=True)
    windows = make_windows(tokenize(adapter, Path(args.text).read_text()), args.seq_len, args.windows)
    half = len(windows) // 2
    wanted = targets([int(i) for i in args.moe_layers.split(",")], args.experts)
    quarot = QuaRotProcessor(build_dataclass(QuaRotConfig, {"seed": 0, "online_down": False, "rotate_latent": False,
                                                            "rotate_mla": True}))
    capture = Capture(wanted)
    last = max(int(u.split(".")[1]) for u in wanted)
    adapter_units = adapter.units
    adapter.units = lambda: [u for u in adapter_units() if u.kind != "head" and
                             (u.kind != "decoder" or u.index <= last)]  # stop after the last measured layer
    if args.cache and Path(args.cache).is_file():
        capture.inputs, capture.weights = torch.load(args.cache)
    else:
        LayerWiseRunner(adapter, [quarot, capture], background=False).run([{"input_ids": w} for w in windows])
        if args.cache:
            torch.save((capture.inputs, capture.weights), args.cache)
    capture_s = time.perf_counter() - start

    table, smoothing = {}, {}
    for key, parts in capture.inputs.items():
        kind = next(k for unit, names in wanted.items() for n, k in names.items() if f"{unit}.{n}" == key)
        w = capture.weights[key]
        x_cal, x_test = rows(parts, 0, half, w.shape[1]), rows(parts, half, len(windows), w.shape[1])
        if x_cal.shape[0] < 16 or x_test.shape[0] < 16:
            continue
        h = x_cal.double().t() @ x_cal.double()
        row = {"kind": kind, "shape": list(w.shape), "tokens_cal": x_cal.shape[0], "tokens_test": x_test.shape[0]}
        for method in METHODS:
            wq = quantized(w, method, h, x_cal.shape[0])
            row[f"{method}_w4a8"] = output_error(x_test, w, wq, int8)
            row[f"{method}_w4a4"] = output_error(x_test, w, wq, int4)
        for method in MX_METHODS:
            fmt, _, how = method.partition("_")
            stored, scale = quantize_weight(w, mx_format(fmt), how, hessian=h.float(), tokens=x_cal.shape[0])
            row[method] = output_error(x_test, w, decode_weight(stored, scale, mx_format(fmt)), MXFP8)
        table[key] = row
        reader = key.endswith((".w2", "q_proj", "kv_a_proj_with_mqa")) or (kind == "mla" and key.endswith("o_proj"))
        if reader:
            variants = {"none": torch.ones(w.shape[1], dtype=torch.float64),
                        "alpha_0.9": smooth_scale(x_cal.abs().amax(0).double(), w.abs().amax(0).double(), 0.9, 1e-5)}
            variants["searched"], alpha = searched_scale(x_cal, w, h)
            res = {"searched_alpha": alpha}
            for name, s in variants.items():
                ws, xs_cal, xs_test = (w.double() * s).float(), (x_cal.double() / s).float(), (x_test.double() / s).float()
                wq = quantized(ws, NEW_DEFAULT, xs_cal.double().t() @ xs_cal.double(), xs_cal.shape[0])
                res[name] = output_error(xs_test, ws, wq, int8)
            res["alpha_0.9_vs_none"] = res["alpha_0.9"] / res["none"]
            res["searched_vs_none"] = res["searched"] / res["none"]
            smoothing[key] = res

    def ratio(method: str, kinds: tuple[str, ...], bits: str = "w4a8") -> float:
        values = [r[f"{method}_{bits}"] / r[f"ssz_{bits}"] for r in table.values() if r["kind"] in kinds]
        return statistics.median(values) if values else float("nan")

    experts = ("expert",)
    others = ("dense", "kda", "shared", "mla")
    for key, row in table.items():
        print(f"{key:58s} {row['kind']:6s} " + " ".join(f"{m}={row[f'{m}_w4a8'] / row['ssz_w4a8']:.3f}"
                                                        for m in METHODS), file=sys.stderr)
    for key, res in smoothing.items():
        print(f"smooth {key:51s} a0.9/none={res['alpha_0.9_vs_none']:.3f} searched/none={res['searched_vs_none']:.3f} "
              f"(alpha {res['searched_alpha']})", file=sys.stderr)
    print_result({
        "bench": "layer_error", "model": Path(args.model).name, "machine": machine(), "matrices": len(table),
        "windows_cal": half, "windows_test": len(windows) - half, "new_default": NEW_DEFAULT,
        "expert_w4a8_error_ratio": round(ratio(NEW_DEFAULT, experts), 4),
        "expert_w4a8_error_ratio_per_group": {g: round(ratio(f"gptq_g{g}", experts), 4) for g in GROUPS},
        "median_ratio_w4a8": {m: {"experts": round(ratio(m, experts), 4), "others": round(ratio(m, others), 4)}
                              for m in METHODS},
        "median_ratio_w4a4": {m: {"experts": round(ratio(m, experts, "w4a4"), 4),
                                  "others": round(ratio(m, others, "w4a4"), 4)} for m in METHODS},
        "mx_median_ratio_vs_minmax": {
            m: {group: round(statistics.median(r[m] / r[f"{m.split('_')[0]}_minmax"] for r in table.values()
                                               if r["kind"] in kinds), 4)
                for group, kinds in (("experts", experts), ("others", others))}
            for m in MX_METHODS if not m.endswith("minmax")},
        "smoothing_median_vs_none": {
            variant: {kind: round(statistics.median(r[f"{variant}_vs_none"] for k, r in smoothing.items()
                                                    if table[k]["kind"] == kind), 4)
                      for kind in sorted({table[k]["kind"] for k in smoothing})}
            for variant in ("alpha_0.9", "searched")},
        "table": table, "smoothing": smoothing,
        "capture_s": round(capture_s, 1), "wall_s": round(time.perf_counter() - start, 1),
    })


if __name__ == "__main__":
    main()
