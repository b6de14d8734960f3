"""The quant report's ranking against measured errors, and what falling back by it buys (issue 33), on
kimi-linear-mini with an aggressive practice: min/max W4A4_DYNAMIC (`--act int8`: W4A8_DYNAMIC) on every linear the
shipped W4A8 practice quantizes, no QuaRot, no smoothing.

1. Ranking. One run with two bench-only steps around linear_quant: `bench_stash` keeps each linear's float weight,
   `bench_measure` forwards the quantized unit over the calibration samples and measures each quantized linear's
   relative output error exactly, ||QuantLinear(X) - X W^T||^2 / ||X W^T||^2, on the inputs the report's statistic
   sees next (the runner's own forward). Spearman's rho of the report's `error` against it, over every quantized
   linear (target >= 0.8).
2. Fallback. 10 % of the quantized linears go to W8A8_DYNAMIC through `spec.fallback`, each with its fused serving
   group (a layer's 48 routed experts, q/k/v/...): the report's worst (`report` + `top_k`), and random orders of
   the linears through the same budget (seeds 0-2); the perplexity delta each recovers (target: the report's >=
   half, and more than random's).
3. A planted outlier: a copy of the checkpoint with one column of layers.5's o_proj times 30 must rank first by the
   report of an `analyze` run.
4. `tune --target_ppl_delta 1.0 --step 40` from min/max W4A8_DYNAMIC everywhere (`--tune-act`, `--tune-step`): rounds
   and deltas (target: <= 1.0 % in <= 4 rounds).

    python bench/sensitivity.py [--windows 16] [--act int4|int8] [--skip-tune]

Last line: JSON with rho, the deltas and recovered fractions, the outlier's rank and the tune rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHARED, machine, print_result  # noqa: E402

from msmodelslim.app.analyze import AnalyzeArgs, analyze  # noqa: E402
from msmodelslim.app.quant import QuantArgs, quant  # noqa: E402
from msmodelslim.app.tune import TuneArgs, tune  # noqa: E402
from msmodelslim.core.report import REPORT_FILE  # noqa: E402
from msmodelslim.eval import evaluate  # noqa: E402
from msmodelslim.model.registry import resolve_model_type  # noqa: E402
from msmodelslim.processor.base import Processor, ProcessorConfig, register_processor  # noqa: E402
from msmodelslim.processor.fallback import serving_groups, worst_within  # noqa: E402
from msmodelslim.quant.modules import QuantLinear  # noqa: E402
from msmodelslim.serving.profiles import profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MINI = SHARED / "models" / "kimi-linear-mini"
TEXT = SHARED / "data" / "text" / "python_tutorial.txt"
OUTLIER = "model.layers.5.self_attn.o_proj"  # checkpoint (source) name of the planted outlier
ACT_DTYPE = "int4"  # the aggressive practice's activations (--act)
RANDOM_SEEDS = 3
MEASURED: dict[str, tuple[float, float]] = {}  # checkpoint name -> (error sum, reference sum)
_STASH: dict[str, torch.Tensor] = {}


@register_processor("bench_stash", ProcessorConfig)
class Stash(Processor):
    """Keeps every linear's float weight of the unit (live name -> float32 copy)."""

    def process_unit(self, ctx: Any) -> None:
        _STASH.clear()
        for name, mod in ctx.module.named_modules():
            if isinstance(mod, nn.Linear):
                _STASH[name] = mod.weight.detach().float().clone()


@register_processor("bench_measure", ProcessorConfig)
class Measure(Processor):
    """The exact relative output error of every quantized linear over one forward of the quantized unit."""

    def process_unit(self, ctx: Any) -> None:
        handles = []
        for name, mod in ctx.module.named_modules():
            if isinstance(mod, QuantLinear) and name in _STASH:
                key = ctx.adapter.checkpoint_name(ctx.unit, name)

                def hook(_m: nn.Module, args: tuple, out: torch.Tensor, key: str = key, w: Any = _STASH[name]) -> None:
                    x = args[0].detach().float()
                    ref = x @ w.t()
                    err, total = MEASURED.get(key, (0.0, 0.0))
                    MEASURED[key] = (err + float((out.float() - ref).square().sum()), total + float(ref.square().sum()))

                handles.append(mod.register_forward_hook(hook))
        try:
            ctx.run_samples()
        finally:
            for h in handles:
                h.remove()


def aggressive_practice(dest: Path, bench_steps: bool, fallback: list[dict] | None = None,
                        max_samples: int = 16, impact_tokens: int | None = None) -> Path:
    """The shipped kimi_linear_w4a8 cut down to min/max W4A8_DYNAMIC on every linear it quantizes."""
    practice = yaml.safe_load((ROOT / "lab_practice" / "kimi_k3" / "kimi_linear_w4a8.yaml").read_text())
    quantizers = [s for s in practice["spec"]["process"] if s["type"] == "linear_quant"]
    include = [g for q in quantizers for g in q["include"]]
    exclude = sorted({g for q in quantizers for g in q.get("exclude", [])} - set(include))
    step = {"type": "linear_quant", "include": include, "exclude": exclude,
            "qconfig": {"act": {"scope": "per_token", "dtype": ACT_DTYPE, "symmetric": True, "method": "minmax"},
                        "weight": {"scope": "per_channel", "dtype": "int4", "symmetric": True, "method": "minmax"}}}
    if ACT_DTYPE == "int8":  # vllm-ascend serves W4A8 outside the routed experts per group only, on 0.26 alone
        step["qconfig"]["weight"].update(scope="per_group", ext={"group_size": 32})  # (serving/rules.py)
        practice["spec"]["target"] = "vllm-ascend-0.26"
    process = ([{"type": "bench_stash"}] if bench_steps else []) + [step] + \
        ([{"type": "bench_measure"}] if bench_steps else [])
    practice["spec"]["process"] = process
    practice["spec"]["max_samples"] = max_samples
    practice["spec"]["report_impact_tokens"] = impact_tokens
    practice["metadata"]["config_id"] = f"kimi_linear_w4a{ACT_DTYPE[-1]}_minmax_everywhere"
    practice["metadata"]["label"]["a_bit"] = int(ACT_DTYPE[-1])
    if fallback:
        practice["spec"]["fallback"] = fallback
    dest.write_text(yaml.safe_dump(practice, sort_keys=False))
    return dest


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> torch.Tensor:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = torch.empty(len(v), dtype=torch.float64)
        for i, j in enumerate(order):
            r[j] = i
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def planted_outlier(dest: Path) -> Path:
    """A copy of the mini (shards linked) whose OUTLIER has one input column times 30."""
    dest.mkdir()
    index = json.loads((MINI / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][f"{OUTLIER}.weight"]
    for f in MINI.iterdir():
        if f.name != shard:
            (dest / f.name).symlink_to(f)
    tensors = load_file(str(MINI / shard))
    w = tensors[f"{OUTLIER}.weight"].clone()
    w[:, 7] *= 30
    tensors[f"{OUTLIER}.weight"] = w
    save_file(tensors, str(dest / shard), metadata={"format": "pt"})
    return dest


def fused_groups() -> dict[str, list[str]]:
    """The mini's fused layers under the serving target the practice is written for (`practice`)."""
    adapter = resolve_model_type("Kimi-Linear").load_adapter_class()(MINI)
    try:
        adapter.serve_on(profile("vllm-ascend-0.26" if ACT_DTYPE == "int8" else None))
        return serving_groups(adapter.target.fused_groups(adapter))
    finally:
        adapter.close()


def run(work: Path, name: str, practice: Path) -> Path:
    out = work / name
    quant(QuantArgs(model_path=str(MINI), save_path=str(out), device="cpu", model_type="Kimi-Linear",
                    config_path=str(practice)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--skip-tune", action="store_true")
    parser.add_argument("--skip-outlier", action="store_true")
    parser.add_argument("--impact-tokens", type=int, default=8192, help="the base run's spec.report_impact_tokens")
    parser.add_argument("--tune-act", choices=["int4", "int8"], default="int8", help="tune starts from min/max W4A<bits>")
    parser.add_argument("--tune-step", type=float, default=40.0, help="tune's --step (percent of linears per round)")
    parser.add_argument("--act", choices=["int4", "int8"], default="int4", help="the aggressive practice's activations")
    args = parser.parse_args()
    global ACT_DTYPE
    ACT_DTYPE = args.act
    work = Path(tempfile.mkdtemp(prefix="sensitivity-"))
    result: dict[str, Any] = {"bench": "sensitivity", "machine": machine(), "windows": args.windows,
                              "practice": f"min/max W4A{args.act[-1]}_DYNAMIC on every linear of kimi_linear_w4a8"}
    try:
        def ppl(out: Path) -> dict[str, float]:
            return evaluate(MINI, out, TEXT, seq_len=512, max_windows=args.windows, model_type="Kimi-Linear")

        t0 = time.perf_counter()
        base = run(work, "base", aggressive_practice(work / "base.yaml", bench_steps=True,
                                                     impact_tokens=args.impact_tokens))
        result["quant_seconds"] = round(time.perf_counter() - t0, 1)
        report = json.loads((base / REPORT_FILE).read_text())["linears"]
        names = sorted(n for n in report if n in MEASURED and report[n]["error"] is not None)
        measured = {n: MEASURED[n][0] / MEASURED[n][1] for n in names}
        result["linears"] = len(names)
        result["spearman_rho"] = round(spearman([report[n]["error"] for n in names], [measured[n] for n in names]), 4)
        result["median_estimate_over_measured"] = round(float(torch.tensor(
            [report[n]["error"] / measured[n] for n in names]).median()), 4)
        base_eval = ppl(base)
        result["ppl_float"], result["delta_pct_base"] = base_eval["ppl_orig"], base_eval["delta_pct"]
        result["kl_base"], result["kl_se_base"] = base_eval["kl"], base_eval["kl_se"]

        # 10 % of the quantized linears may move, each with its fused serving group (processor/fallback.py)
        budget = max(1, round(0.1 * len(report)))
        groups = fused_groups()
        linears = sorted(report)
        picks = {f"{metric}_top10": [{"to": "W8A8_DYNAMIC", "report": str(base / REPORT_FILE), "metric": metric,
                                      "top_k": budget}] for metric in ("error", "impact")}
        for seed in range(RANDOM_SEEDS):
            order = random.Random(seed).sample(linears, len(linears))
            picks[f"random10_s{seed}"] = [{"to": "W8A8_DYNAMIC",
                                          "names": sorted(worst_within(order, groups, set(linears), budget))}]
        result["budget_linears"] = budget
        for label, fallback in picks.items():
            out = run(work, label, aggressive_practice(work / f"{label}.yaml", bench_steps=False, fallback=fallback))
            moved = json.loads((out / REPORT_FILE).read_text())["linears"]
            result[f"moved_{label}"] = sum(e["scheme"] == "W8A8_DYNAMIC" for e in moved.values())
            measured = ppl(out)
            delta = measured["delta_pct"]
            result[f"delta_pct_{label}"] = round(delta, 3)
            result[f"recovered_{label}"] = round(1 - delta / base_eval["delta_pct"], 4)
            result[f"kl_{label}"], result[f"kl_se_{label}"] = measured["kl"], measured["kl_se"]
            result[f"kl_recovered_{label}"] = round(1 - measured["kl"] / base_eval["kl"], 4)
            shutil.rmtree(out)
        for kind in ("recovered", "kl_recovered"):
            randoms = [result[f"{kind}_random10_s{seed}"] for seed in range(RANDOM_SEEDS)]
            result[f"{kind}_random10_mean"] = round(sum(randoms) / len(randoms), 4)
            result[f"{kind}_impact_beats_every_seed"] = result[f"{kind}_impact_top10"] > max(randoms)

        if not args.skip_outlier:
            planted = planted_outlier(work / "planted")
            found = analyze(AnalyzeArgs(model_path=str(planted), model_type="Kimi-Linear", device="cpu",
                                        config_path=str(aggressive_practice(work / "plain.yaml", bench_steps=False)),
                                        top_k=5))
            order = [n for n, _ in found.top]
            result["outlier_rank"] = next((i + 1 for i, n in enumerate(order) if n == OUTLIER), None)
            result["outlier_top5"] = order

        if not args.skip_tune:
            ACT_DTYPE = args.tune_act
            start = aggressive_practice(work / "tune.yaml", bench_steps=False)
            t0 = time.perf_counter()
            tuned = tune(TuneArgs(model_path=str(MINI), save_path=str(work / "tuned"), model_type="Kimi-Linear",
                                  dataset=str(TEXT), target_ppl_delta=1.0, device="cpu", config_path=str(start),
                                  max_rounds=4, step=args.tune_step, max_windows=args.windows))
            result["tune_start"] = f"min/max W4A{args.tune_act[-1]}_DYNAMIC, --step {args.tune_step:g}"
            result["tune_seconds"] = round(time.perf_counter() - t0, 1)
            result["tune_rounds"] = [{"round": r.index, "fallen_back": len(r.fallback), "delta_pct": round(r.delta_pct, 3)}
                                     for r in tuned.rounds]
            result["tune_reached"] = tuned.reached
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_result(result)


if __name__ == "__main__":
    main()
