"""What the Ascend op check costs: the same `msmodelslim quant` with and without MSMODELSLIM_ASCEND_CHECK=1.

The tiny Kimi-K3 stand-in (generated once into bench_out/) with a shipped practice, on `--device` (cpu by default),
the two settings run alternately `--repeats` times; the ratio of medians is the check's cost, and the checked run
reports how many device ops it examined (none may fail: a violation would fail the run).

Usage: python bench/ascend_check.py [--device cpu --practice kimi_k3_w4a8 --repeats 2]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import BENCH_OUT, MAKE_CHECKPOINT, ROOT, machine, print_result, run_quant  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--practice", default="kimi_k3_w4a8")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    model = BENCH_OUT / "Kimi-K3-tiny"
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--preset", "tiny", "--out", str(model)], check=True,
                       capture_output=True)
    practice = ROOT / "lab_practice" / "kimi_k3" / f"{args.practice}.yaml"
    walls: dict[str, list[float]] = {"off": [], "on": []}
    checked = 0
    for _ in range(args.repeats):
        for setting in ("off", "on"):
            run = run_quant(model, BENCH_OUT / f"Kimi-K3-tiny-check-{setting}", args.device, practice,
                            extra_env={"MSMODELSLIM_ASCEND_CHECK": "1" if setting == "on" else "0"})
            walls[setting].append(run["ranks"][0]["runner_wall"])
            checked = run["ranks"][0].get("ascend_ops_checked", checked)
    off, on = statistics.median(walls["off"]), statistics.median(walls["on"])
    print_result({"bench": "ascend_check", "machine": machine(), "device": args.device, "practice": args.practice,
                  "runner_wall_s_off": walls["off"], "runner_wall_s_on": walls["on"],
                  "check_cost_ratio": round(on / off, 2), "device_ops_checked": checked})


if __name__ == "__main__":
    main()
