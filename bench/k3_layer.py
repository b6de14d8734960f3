"""Per-rank cost of one full-size Kimi-K3 MoE layer, as one rank of EP 8 sees it, with the shipped w4a8 practice.

The `layer` preset of make_checkpoint.py: hidden 7168, KDA 96 heads x 128 (full-rank gate), attention residuals,
a latent MoE (routed_expert_hidden_size 3584, with its norm), SiTU experts of 3072 x 3584, shared width 6144,
released values where public (docs/dev/facts/kimi_k3_in_vllm_0.33.md section 6). One rank of EP 8 holds
896 / 8 = 112 experts and, with top-16 routing spread evenly, sees 16 / 8 = 2 of each token's picks: the bench runs
112 experts with top-2 on one device, which gives the rank its expert work without the 7 other ranks (the
all-gather / all-reduce of EP are not timed: documented in the JSON).

Stages (seconds, from the runner's own statistics): load (MXFP4 decode), process (per processor), calibrate
(forwards), save. fla's Triton autotuning is timed on its own first: chunk_kda at this layer's shapes, first call
vs the mean of the next ones, in a fresh process.

Usage: python bench/k3_layer.py --device cuda:0 [--samples 8 --max-seq-len 1024 --layers 61 --practice P.yaml]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import BENCH_OUT, MAKE_CHECKPOINT, ROOT, machine, print_result, run_quant, shrunken_practice  # noqa: E402

EP = 8
EXPERTS_PER_RANK = 896 // EP
TOPK_PER_RANK = 16 // EP
DEVICE_MEMORY_GB = 64  # the target: 8 devices of 64 GB

AUTOTUNE = r"""
import json, time, torch
from fla.ops.kda import chunk_kda
dev = torch.device("{device}")
B, T, H, D = 1, {tokens}, 96, 128
g = torch.Generator(device=dev).manual_seed(0)
def args():
    q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    gate = -torch.rand(B, T, H, D, device=dev, dtype=torch.float32, generator=g) * 0.1
    beta = torch.rand(B, T, H, device=dev, dtype=torch.float32, generator=g)
    return dict(q=q, k=k, v=v, g=gate, beta=beta, scale=D ** -0.5, use_qk_l2norm_in_kernel=True)
times = []
for _ in range(4):
    a = args(); torch.cuda.synchronize(dev); t0 = time.perf_counter()
    chunk_kda(**a); torch.cuda.synchronize(dev); times.append(time.perf_counter() - t0)
print(json.dumps({{"first_call_s": times[0], "warm_call_s": sum(times[1:]) / 3}}))
"""


def fla_autotune(device: str, tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", AUTOTUNE.format(device=device, tokens=tokens)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--samples", type=int, default=8, help="calibration records (the practice's dataset)")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--layers", type=int, default=61, help="decoder layers assumed for the projection (Kimi-K3's "
                                                             "count is not public; 61 is Kimi-K2's)")
    p.add_argument("--runs", type=int, default=2, help="quant runs; the first includes Triton compilation")
    p.add_argument("--practice", default=str(ROOT / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml"))
    p.add_argument("--skip-autotune", action="store_true", help="do not time fla's first call (88 s, measured)")
    p.add_argument("--report-overhead", action="store_true",
                   help="after the runs, warm runs without and with the quant report, alternating (3 each): the "
                        "report's share of the layer")
    args = p.parse_args()

    model = BENCH_OUT / "Kimi-K3-layer-ep8-rank"
    t0 = time.perf_counter()
    if not (model / "model.safetensors.index.json").is_file():
        subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--preset", "layer", "--out", str(model),
                        "--set", f"text_config.num_experts={EXPERTS_PER_RANK}",
                        "--set", f"text_config.num_experts_per_token={TOPK_PER_RANK}"], check=True)
    generate_s = time.perf_counter() - t0
    autotune = fla_autotune(args.device, args.max_seq_len) \
        if args.device.startswith("cuda") and not args.skip_autotune else {}

    practice = shrunken_practice(Path(args.practice), BENCH_OUT / "k3_layer_practice.yaml", args.samples,
                                 args.max_seq_len)
    runs = [run_quant(model, BENCH_OUT / "Kimi-K3-layer-w4a8", args.device, practice) for _ in range(args.runs)]
    warm = runs[-1]["ranks"][0]
    overhead = {}
    if args.report_overhead:  # alternating, so drift hits both sides alike
        out = BENCH_OUT / "Kimi-K3-layer-w4a8"
        sides: dict[str, list[dict]] = {"without": [], "with": []}
        for _ in range(3):
            for side, env in (("without", {"MSMODELSLIM_BENCH_NO_REPORT": "1"}), ("with", {})):
                sides[side].append(run_quant(model, out, args.device, practice, extra_env=env)["ranks"][0])

        def median(side: str, key: str) -> float:
            values = sorted(r.get(key, 0.0) for r in sides[side])
            return values[len(values) // 2]

        # the report's work: its observers inside the forward (calibrate) and its reduction (report)
        cost = median("with", "calibrate") + median("with", "report") - median("without", "calibrate")
        overhead = {"runner_wall_s": {side: [round(r["runner_wall"], 2) for r in runs_] for side, runs_ in sides.items()},
                    "calibrate_s": {side: [round(r["calibrate"], 3) for r in runs_] for side, runs_ in sides.items()},
                    "report_stage_s": [round(r.get("report", 0.0), 3) for r in sides["with"]],
                    "report_cost_s": round(cost, 3),
                    "report_cost_pct_of_layer": round(100 * cost / median("without", "runner_wall"), 2),
                    "wall_overhead_pct_median": round(100 * (median("with", "runner_wall")
                                                             / median("without", "runner_wall") - 1), 2)}
    meta = ("runner_wall", "world_size", "peak_rss_gb", "peak_device_gb", "ascend_ops_checked")
    stages = {k: round(v, 2) for k, v in warm.items() if k not in meta}
    layer_s = warm["runner_wall"]  # the vision (1 tiny block), embed and head (vocab 4096) units take ~no time
    result = {
        "bench": "k3_layer", "machine": machine(), "device": args.device, "practice": Path(args.practice).name,
        "assumed": {"ep": EP, "local_experts": EXPERTS_PER_RANK, "topk_per_rank": TOPK_PER_RANK,
                    "expert_shape": [3072, 3584], "hidden": 7168, "layers_for_projection": args.layers,
                    "calibration": f"{args.samples} records of the practice's dataset, max_seq_len {args.max_seq_len}",
                    "not_timed": "EP all-gather / all-reduce of the routed tokens (no other ranks here)",
                    "projection": "every decoder layer costs what this KDA + MoE layer costs; the vision, embed "
                                  "and head units are negligible next to 61 MoE layers"},
        "generate_checkpoint_s": round(generate_s, 1),
        "fla_autotune": autotune,
        "runs_wall_s": [round(r["wall_s"], 1) for r in runs],
        "warm_stages_s": stages,
        "warm_layer_unit_s": round(layer_s, 1),
        "peak_device_gb": round(warm.get("peak_device_gb", 0.0), 2),
        "peak_rss_gb": round(warm.get("peak_rss_gb", 0.0), 2),
        "projected_model_hours_per_rank": round(layer_s * args.layers / 3600, 2),
        "projected_peak_device_gb_per_rank": round(warm.get("peak_device_gb", 0.0), 2),
        "fits_64gb_device": warm.get("peak_device_gb", 0.0) < DEVICE_MEMORY_GB,
        "report_overhead": overhead,
    }
    print_result(result)


if __name__ == "__main__":
    main()
