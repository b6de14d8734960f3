"""Dynamic per-token int8 quantization of activations on CUDA: the PyTorch passes (`quantize_symmetric` per token,
what `quantize_per_token` runs without the kernel) against one Triton kernel (ops/token_quant.py), at the inputs of
a full-size Kimi-K3 layer's quantized linears for one 8,192-token micro-batch of an EP-8 rank (bfloat16: the hidden
state 7168 wide, the KDA output 12288, the shared experts' hidden 6144; the routed experts' rows at top-2, 16,384,
3584 wide into w1/w3 and 3072 into w2).

The integers and scales are compared bit for bit; the times are the median of `--repeats` calls each (warm,
synchronized).

Usage: python bench/token_quant.py [--device cuda:0 --repeats 20]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, print_result  # noqa: E402
from bench.grouped_gemm import timed  # noqa: E402
from msmodelslim.ops.token_quant import per_token_int8  # noqa: E402
from msmodelslim.quant.functional import quantize_symmetric  # noqa: E402
from msmodelslim.quant.granularity import PerToken, int8  # noqa: E402

SHAPES = [(8192, 7168), (8192, 12288), (8192, 6144), (16384, 3584), (16384, 3072)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for shape in SHAPES:
        # activations with outlier channels, as a calibration pass sees them
        x = (torch.randn(shape, generator=g, device=device) *
             torch.rand(shape[1], generator=g, device=device).pow(8).mul(50).add(1)).to(torch.bfloat16)
        passes, kernel = quantize_symmetric(x, int8, PerToken()), per_token_int8(x, int8.qmin, int8.qmax)
        identical = torch.equal(passes[0], kernel[0]) and torch.equal(passes[1], kernel[1])
        ms_passes = 1e3 * timed(lambda x=x: quantize_symmetric(x, int8, PerToken()), args.repeats, device)
        ms_kernel = 1e3 * timed(lambda x=x: per_token_int8(x, int8.qmin, int8.qmax), args.repeats, device)
        rows.append({"shape": list(shape), "passes_ms": round(ms_passes, 3), "kernel_ms": round(ms_kernel, 3),
                     "speedup": round(ms_passes / ms_kernel, 2), "identical": identical})
        print(rows[-1], flush=True)
    print_result({"bench": "token_quant", "machine": machine(), "device": args.device, "dtype": "bfloat16",
                  "shapes": rows, "all_identical": all(r["identical"] for r in rows),
                  "passes_ms_total": round(sum(r["passes_ms"] for r in rows), 3),
                  "kernel_ms_total": round(sum(r["kernel_ms"] for r in rows), 3)})


if __name__ == "__main__":
    main()
