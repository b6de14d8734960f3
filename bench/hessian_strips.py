"""The CPU Hessian's products: float32 products of the whole square per chunk (before session 22; accelerators keep
one product per chunk), of the upper triangle in strips of HESSIAN_CPU_STRIP rows (session 22), and the strips as
bf16 dot products accumulating in float32 (what the runner does on the CPU with the bf16 rows its hooks get).

The runner's own `statistics.Hessian` records T tokens of each width in 8,192-row calls and sums them: the same
bf16 values, given as float32 rows (float32 products) or as bf16 rows (`cpu_bf16_products`); the whole square is
the same code with the strip as wide as the input. Each way is checked against float64 X^T X and timed (median of
--repeat, the ways alternating in one sitting).

    python bench/hessian_strips.py [--widths 192,512,1536,7168 --tokens 16384 --repeat 5]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import statistics as stats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, print_result  # noqa: E402
from msmodelslim.core.requests import Observe  # noqa: E402
from msmodelslim.pipeline import statistics  # noqa: E402


def hessian(x: torch.Tensor, strip: int) -> tuple[torch.Tensor, float]:
    statistics.HESSIAN_CPU_STRIP = strip
    h = statistics.Hessian(Observe(hessian=("a",)), {}, torch.device("cpu"))
    start = time.perf_counter()
    for call in x.split(8192):
        h.record("a", call)
    h._flush("a", final=True)
    result = statistics._mirrored(h.sums.pop("a"))
    return result, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", default="192,512,1536,7168")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    strip = statistics.HESSIAN_CPU_STRIP
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        g = torch.Generator().manual_seed(width)
        x = (torch.randn(args.tokens, width, generator=g) * torch.linspace(0.1, 20, width)).to(torch.bfloat16)
        ref = x.double().t() @ x.double()
        ways = {"square": (x.float(), width), "strips": (x.float(), strip), "strips_bf16": (x, strip)}
        times = {way: [] for way in ways}
        errors = {}
        for _ in range(args.repeat):
            for way, (rows_in, s) in ways.items():
                h, seconds = hessian(rows_in, s)
                times[way].append(seconds)
                errors[way] = float((h.double() - ref).norm() / ref.norm())
        median = {way: stats.median(t) for way, t in times.items()}
        rows.append({"width": width, **{f"{way}_us_per_token": round(1e6 * t / args.tokens, 3)
                                        for way, t in median.items()},
                     "strips_over_square": round(median["strips"] / median["square"], 3),
                     "strips_bf16_over_square": round(median["strips_bf16"] / median["square"], 3),
                     "relative_error_vs_float64": {k: float(f"{v:.3g}") for k, v in errors.items()}})
        print(rows[-1], flush=True)
    statistics.HESSIAN_CPU_STRIP = strip
    print_result({"bench": "hessian_strips", "machine": machine(), "threads": torch.get_num_threads(),
                  "tokens": args.tokens, "strip": strip, "widths": rows})


if __name__ == "__main__":
    main()
