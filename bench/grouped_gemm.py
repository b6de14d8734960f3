"""The grouped experts' products on CUDA: one GEMM per expert (int8 with the scaling kernel; bf16 as the statistics
pass's float experts), against one Triton kernel for every expert (ops/grouped_gemm.py), at one Kimi-K3 EP-8 rank's
shapes, for the shipped tile configuration and `--configs` others.

112 W4A8 experts (int4 values in int8, per-channel scales), w1/w3 [3072, 3584] and w2 [3584, 3072], one 8,192-token
micro-batch routed top-2 over them (16,384 rows; the experts' shares drawn unevenly, some under 17 rows, as the
layer bench's router leaves them). The int8 outputs are compared bit for bit, the bf16 ones by their largest
difference; the times are the median of `--repeats` calls each (warm, synchronized).

Usage: python bench/grouped_gemm.py [--device cuda:0 --rows 16384 --repeats 20 --configs 128,128,64,8,3 ...]
(a config: BLOCK_ROWS,BLOCK_COLS,BLOCK_K,num_warps,num_stages)
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, print_result  # noqa: E402
from msmodelslim.ops import grouped_gemm as kernels  # noqa: E402
from msmodelslim.quant.modules import QuantLinear, _int8_gemms  # noqa: E402

EXPERTS = 112


def experts(inner: int, outer: int, device: torch.device, g: torch.Generator) -> list[QuantLinear]:
    return [QuantLinear(inner, outer, "W4A8_DYNAMIC",
                        torch.randint(-8, 8, (outer, inner), generator=g, dtype=torch.int8).to(device),
                        (torch.rand(outer, 1, generator=g) * 1e-2).to(device)) for _ in range(EXPERTS)]


def uneven_bounds(rows: int, g: torch.Generator) -> list[tuple[int, int]]:
    shares = torch.rand(EXPERTS, generator=g) ** 3  # many small experts, a few large
    counts = (shares / shares.sum() * rows).floor().long()
    counts[0] += rows - int(counts.sum())
    ends = torch.cumsum(counts, 0).tolist()
    return list(zip([0, *ends[:-1]], ends))


def timed(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--configs", nargs="*", default=[], help="other tile configurations to time")
    args = p.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    bounds = uneven_bounds(args.rows, g)
    configs = [dict(kernels.CONFIG)] + [dict(zip(("BLOCK_ROWS", "BLOCK_COLS", "BLOCK_K", "num_warps", "num_stages"),
                                                 map(int, c.split(",")))) for c in args.configs]
    results = {}
    for position, (inner, outer) in {"w1": (3584, 3072), "w2": (3072, 3584)}.items():
        modules = experts(inner, outer, device, g)
        rows = torch.randint(-127, 128, (args.rows, inner), generator=g, dtype=torch.int8).to(device)
        sx = (torch.rand(args.rows, generator=g) * 1e-3).to(device)
        floats = [torch.randn(outer, inner, generator=g).to(device, torch.bfloat16) * 0.02 for _ in modules]
        x = torch.randn(args.rows, inner, generator=g).to(device, torch.bfloat16)

        def per_group(modules=modules, rows=rows, sx=sx):
            return _int8_gemms(modules, rows, sx, bounds, torch.bfloat16)

        def one_kernel(modules=modules, rows=rows, sx=sx):
            return kernels.grouped_int8_gemm(rows, sx, [m.qweight for m in modules], [m.weight_scale for m in modules],
                                             bounds).to(torch.bfloat16)

        def float_per_group(floats=floats, x=x):
            return torch.cat([torch.nn.functional.linear(x[s:e], w) for w, (s, e) in zip(floats, bounds)])

        def float_kernel(floats=floats, x=x):
            return kernels.grouped_gemm(x, floats, bounds).to(torch.bfloat16)

        row = {"per_group_ms": round(1000 * timed(per_group, args.repeats, device), 3),
               "float_per_group_ms": round(1000 * timed(float_per_group, args.repeats, device), 3), "configs": []}
        for config in configs:
            kernels.CONFIG.clear()
            kernels.CONFIG.update(config)
            row["configs"].append({
                "config": ",".join(str(v) for v in config.values()),
                "identical": torch.equal(per_group(), one_kernel()),
                "float_max_diff": float((float_kernel().float() - float_per_group().float()).abs().max()),
                "one_kernel_ms": round(1000 * timed(one_kernel, args.repeats, device), 3),
                "float_kernel_ms": round(1000 * timed(float_kernel, args.repeats, device), 3)})
            print(position, row["configs"][-1], flush=True)
        kernels.CONFIG.clear()
        kernels.CONFIG.update(configs[0])
        results[position] = row
        print(position, {k: v for k, v in row.items() if k != "configs"}, flush=True)
    print_result({"bench": "grouped_gemm", "machine": machine(), "device": torch.cuda.get_device_name(device),
                  "experts": EXPERTS, "rows": args.rows, "groups_under_17_rows": sum(e - s < 17 for s, e in bounds),
                  **results})


if __name__ == "__main__":
    main()
