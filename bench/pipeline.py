"""`msmodelslim quant` end to end on a stand-in Kimi-K3 checkpoint: wall time, seconds per stage, peak memory.

    python bench/pipeline.py [--preset bench] [--device cpu] [--max-samples 8] [--max-seq-len 256]
                             [--practice kimi_k3_w4a8]   # any practice of lab_practice/kimi_k3 (name)

Stages (summed over units, rank 0): load = waiting for the next unit (on accelerators a background prefetch hides
most of it; cpu loads in line), process = processors incl. their statistic-collecting forwards (and per processor,
`process.<type>`), calibrate = the forward that feeds the next unit, save = writing shards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_OUT, ROOT, generated_checkpoint, machine, print_result, run_quant, shrunken_practice  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-samples", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--practice", default="kimi_k3_w4a8")
    args = parser.parse_args()
    model = generated_checkpoint(args.preset)
    practice = shrunken_practice(ROOT / f"lab_practice/kimi_k3/{args.practice}.yaml",
                                 BENCH_OUT / "pipeline_practice.yaml", args.max_samples, args.max_seq_len)
    run = run_quant(model, BENCH_OUT / f"pipeline-{args.preset}-out", args.device, practice)
    rank0 = run["ranks"][0]
    print_result({
        "bench": "pipeline", "practice": args.practice, "preset": args.preset, "device": args.device,
        "machine": machine(),
        "samples": args.max_samples, "max_seq_len": args.max_seq_len, "wall_s": round(run["wall_s"], 1),
        "runner_s": round(rank0["runner_wall"], 1),
        **{f"{stage}_s": round(rank0.get(stage, 0.0), 1) for stage in ("load", "calibrate", "process", "save")},
        **{f"{key}_s": round(val, 1) for key, val in rank0.items() if key.startswith("process.")},
        "peak_rss_gb": round(max(r["peak_rss_gb"] for r in run["ranks"]), 3),
        **({"peak_device_gb": round(max(r["peak_device_gb"] for r in run["ranks"]), 3)}
           if "peak_device_gb" in rank0 else {}),
    })


if __name__ == "__main__":
    main()
