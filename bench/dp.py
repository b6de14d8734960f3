"""Data + expert parallelism: calibration-stage time on 1 vs 2 processes, and per-rank memory under EP.

    python bench/dp.py [--preset small] [--device cpu|cuda] [--max-samples 8] [--max-seq-len 256]

`--device cpu` compares `cpu` with `cpu:0,1` (two gloo processes sharing this machine's cores); `--device cuda`
compares `cuda:0` with `cuda:0,1` (NCCL). The calibration stage is the runner's process + calibrate time (every
forward over the calibration set), taken from the slowest rank. Outputs must be byte-identical (checked).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_OUT, ROOT, generated_checkpoint, machine, print_result, run_quant, shrunken_practice  # noqa: E402


def _tensors(out: Path) -> dict[str, bytes]:
    found = {}
    for shard in sorted(out.glob("quant_model_weights*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                found[key] = f.get_tensor(key).view(torch.uint8).numpy().tobytes()
    return found


def _expert_gb(model: Path) -> tuple[float, float]:
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    expert = total = 0
    for shard in sorted(set(index.values())):
        with safe_open(str(model / shard), framework="pt") as f:
            for key in f.keys():
                numel = f.get_slice(key).get_shape()
                size = 1
                for n in numel:
                    size *= n
                # BF16 size once dequantised (an MXFP4 byte holds 2 weights; scales are not weights)
                if key.endswith("weight_packed"):
                    expert += size * 2 * 2
                elif not key.endswith("weight_scale"):
                    total += size * 2
    return expert / 2**30, (expert + total) / 2**30


def _stages(rank_stats: dict) -> dict[str, float]:
    """Seconds of the calibration stage split by processor, plus the calibrate forward."""
    return {key: round(val, 2) for key, val in rank_stats.items() if key.startswith("process.") or key == "calibrate"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--max-samples", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=256)
    args = parser.parse_args()
    model = generated_checkpoint(args.preset)
    practice = shrunken_practice(ROOT / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml", BENCH_OUT / "dp_practice.yaml",
                                 args.max_samples, args.max_seq_len)
    devices = {"cpu": ("cpu", "cpu:0,1"), "cuda": ("cuda:0", "cuda:0,1")}[args.device]
    if args.device == "cuda":
        # Compile fla's Triton kernels once (on-disk cache) so neither timed run pays for it.
        warm = shrunken_practice(practice, BENCH_OUT / "dp_warmup.yaml", 2, 32)
        run_quant(model, BENCH_OUT / f"dp-{args.preset}-warmup", devices[0], warm)
    runs = {}
    for n, device in enumerate(devices, start=1):
        runs[n] = run_quant(model, BENCH_OUT / f"dp-{args.preset}-{n}", device, practice)
    same = _tensors(BENCH_OUT / f"dp-{args.preset}-1") == _tensors(BENCH_OUT / f"dp-{args.preset}-2")

    def calib(run: dict) -> float:
        return max(r.get("process", 0.0) + r.get("calibrate", 0.0) for r in run["ranks"])

    mem_key = "peak_device_gb" if args.device == "cuda" else "peak_rss_gb"
    expert_gb, model_gb = _expert_gb(model)
    print_result({
        "bench": "dp", "preset": args.preset, "device": args.device, "machine": machine(),
        "samples": args.max_samples, "max_seq_len": args.max_seq_len,
        "calib_s_1": round(calib(runs[1]), 2), "calib_s_2": round(calib(runs[2]), 2),
        "speedup": round(calib(runs[1]) / calib(runs[2]), 3),
        "wall_s_1": round(runs[1]["wall_s"], 1), "wall_s_2": round(runs[2]["wall_s"], 1),
        "peak_gb_1": round(runs[1]["ranks"][0][mem_key], 3),
        "peak_gb_2_per_rank": [round(r[mem_key], 3) for r in runs[2]["ranks"]],
        "model_bf16_gb": round(model_gb, 3), "expert_bf16_gb": round(expert_gb, 3),
        "identical_output": same,
        "stages_1": _stages(runs[1]["ranks"][0]), "stages_2_per_rank": [_stages(r) for r in runs[2]["ranks"]],
    })


if __name__ == "__main__":
    main()
