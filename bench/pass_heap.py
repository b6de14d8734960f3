"""What glibc's allocator settings cost a CPU calibration pass (core/memory.py): the routed experts' quantized
products of one kimi-linear-mini-sized MoE layer (16 W4A8 experts, 512 -> 192 -> 512, 4 x 8,192 routed rows through
`linears_over_row_groups`), under

- `mmap_1MiB`: the threshold between passes (every block of 1 MiB or more a fresh mapping);
- `heap_32MiB`: a 32 MiB mmap threshold alone (glibc's trim threshold then stays at 128 KiB);
- `pass`: what `heap_for_temporaries` sets (32 MiB, and the heap keeps its top).

The settings alternate in one process, `--rounds` times; each value is the median of 8 calls.

    python bench/pass_heap.py [--rounds 4]
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
from msmodelslim.core import memory  # noqa: E402
from msmodelslim.quant.modules import QuantLinear, linears_over_row_groups  # noqa: E402

SETTINGS = {"mmap_1MiB": (memory.UNIT_MMAP_THRESHOLD, memory.UNIT_TRIM_THRESHOLD),
            "heap_32MiB": (memory.PASS_MMAP_THRESHOLD, memory.UNIT_TRIM_THRESHOLD),
            "pass": (memory.PASS_MMAP_THRESHOLD, memory.PASS_TRIM_THRESHOLD)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    experts, rows = 16, 4 * 8192

    def expert(inputs: int, outputs: int) -> QuantLinear:
        return QuantLinear.from_linear(torch.nn.Linear(inputs, outputs, bias=False).bfloat16(), "W4A8_DYNAMIC",
                                       weight_method="minmax")

    w1, w3, w2 = ([expert(512, 192) for _ in range(experts)], [expert(512, 192) for _ in range(experts)],
                  [expert(192, 512) for _ in range(experts)])
    x, hidden = torch.randn(rows, 512).bfloat16(), torch.randn(rows, 192).bfloat16()
    bounds = [(i * rows // experts, (i + 1) * rows // experts) for i in range(experts)]

    def products() -> None:
        linears_over_row_groups(list(zip(w1, w3)), x, bounds)
        linears_over_row_groups([(m,) for m in w2], hidden, bounds)

    ms = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, (mmap, trim) in SETTINGS.items():
            memory._malloc_call("mallopt", memory._M_MMAP_THRESHOLD, mmap)
            memory._malloc_call("mallopt", memory._M_TRIM_THRESHOLD, trim)
            products()
            calls = []
            for _ in range(8):
                start = time.perf_counter()
                products()
                calls.append(time.perf_counter() - start)
            memory._malloc_call("malloc_trim", 0)
            ms[name].append(round(1e3 * statistics.median(calls), 2))
        print(ms, flush=True)
    median = {name: statistics.median(v) for name, v in ms.items()}
    print_result({"bench": "pass_heap", "machine": machine(), "rows": rows, "experts": experts,
                  "ms_per_layer_products": ms, "median_ms": median,
                  "mmap_1MiB_over_pass": round(median["mmap_1MiB"] / median["pass"], 2),
                  "heap_32MiB_over_pass": round(median["heap_32MiB"] / median["pass"], 2)})


if __name__ == "__main__":
    main()
