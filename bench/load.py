"""Layer-wise loading of the `bench` stand-in checkpoint: memory bound and what background prefetch saves.

Runs the real runner with no processors over one calibration sample, once with prefetch and once without, each
in a fresh process so peak RSS is per mode. Target: peak RSS <= 2.5 x the largest unit in BF16 + 1 GB.

    python bench/load.py [--preset bench] [--device cpu] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import generated_checkpoint, machine, peak_rss_gb, print_result  # noqa: E402


def run_mode(model: Path, device: str, prefetch: bool, tokens: int) -> dict:
    from msmodelslim.core.dist import DistContext
    from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter
    from msmodelslim.pipeline.layer_wise import LayerWiseRunner

    adapter = KimiK3ModelAdapter(model, trust_remote_code=True, dist=DistContext(device=torch.device(device)))
    largest = 0
    for unit in adapter.units():
        module = adapter.unit_module(unit)
        largest = max(largest, sum(p.numel() for p in module.parameters()) * 2)
    ids = torch.randint(8, int(adapter.text_config.vocab_size), (1, tokens))
    runner = LayerWiseRunner(adapter, [], dist=adapter.dist, background=prefetch)
    start = time.perf_counter()
    stats = runner.run([{"input_ids": ids}])
    adapter.close()
    return {"wall_s": time.perf_counter() - start, "load_wait_s": stats.seconds["load"],
            "compute_s": stats.seconds["calibrate"], "largest_unit_bf16_gb": largest / 2**30,
            "peak_rss_gb": peak_rss_gb()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--_mode", choices=["prefetch", "no_prefetch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = generated_checkpoint(args.preset)
    if args._mode:
        print(json.dumps(run_mode(model, args.device, args._mode == "prefetch", args.tokens)))
        return
    results = {}
    for mode in ("prefetch", "no_prefetch"):
        out = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--device", args.device,
                              "--tokens", str(args.tokens), "--_mode", mode],
                             check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    largest = results["prefetch"]["largest_unit_bf16_gb"]
    peak = max(r["peak_rss_gb"] for r in results.values())
    print_result({
        "bench": "load", "preset": args.preset, "device": args.device, "machine": machine(),
        "largest_layer_bf16_gb": round(largest, 3), "peak_rss_gb": round(peak, 3),
        "peak_bound_gb": round(2.5 * largest + 1, 3), "within_bound": peak <= 2.5 * largest + 1,
        "load_s_prefetch": round(results["prefetch"]["wall_s"], 2),
        "load_s_no_prefetch": round(results["no_prefetch"]["wall_s"], 2),
        "load_wait_s_prefetch": round(results["prefetch"]["load_wait_s"], 2),
        "load_wait_s_no_prefetch": round(results["no_prefetch"]["load_wait_s"], 2),
    })


if __name__ == "__main__":
    main()
