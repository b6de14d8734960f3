"""The Hessian's arithmetic, two ways, at a full-size width: exact integer sums of 8-bit digit products (what the
runner does: statistics.py) with fp32, TF32 and bf16 matmuls, against plain float accumulation of X^T X (what an
inexact observer would do). Checks each exact variant against an int64 reference computed on the host, and times
every variant per token.

Usage: python bench/hessian_arith.py --device cuda:0 [--width 7168 --tokens 16384]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, print_result  # noqa: E402
from msmodelslim.core.device import synchronize, tensor_core_fp32_matmuls  # noqa: E402

HESSIAN_GRID_BITS = 15  # x rounded to 2^15 steps of its channel range: |grid| <= 2^15
HESSIAN_DIGIT_BITS = 8  # grid = hi * 2^8 + lo with |hi|, |lo| <= 2^7: digit products <= 2^14
HESSIAN_CHUNK_TOKENS = 1 << 10  # float32 partial sums of such products over 2^10 tokens stay below 2^24: exact


# The exact integer Hessian the runner used until issue 31 (statistics.py, commit 018f4de), kept here as the
# alternative this benchmark measures.
class Triangle:
    """The upper triangle (diagonal included) of a symmetric [d, d] matrix as a packed vector of d(d+1)/2: flat
    int32 indices of (i, j), i <= j, and of its mirror (j, i). A Hessian's integer sums are kept packed: half the
    memory of the full matrix, and half of what the ranks exchange."""

    def __init__(self, d: int, device: torch.device) -> None:
        rows, cols = torch.triu_indices(d, d, device=device, dtype=torch.int32)  # d * d < 2^31 for d < 46341
        self.d = d
        self.upper = rows * d + cols
        self.lower = cols * d + rows

    def pack(self, full: torch.Tensor) -> torch.Tensor:
        return full.reshape(-1)[self.upper]

    def pack_mirror(self, full: torch.Tensor) -> torch.Tensor:
        """The upper triangle of full^T, without a transposed copy."""
        return full.reshape(-1)[self.lower]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        full = torch.empty(self.d * self.d, dtype=packed.dtype, device=packed.device)
        full[self.upper] = packed
        full[self.lower] = packed
        return full.view(self.d, self.d)


def exact_gram_packed(grid: torch.Tensor, triangle: Triangle) -> torch.Tensor:
    """The upper triangle of G^T G (int64, packed) of an integer-valued float32 grid [tokens, d] with |G| <= 2^15,
    exactly: float32 products of 8-bit digits over chunks of 2^10 tokens, summed in int64 (module docstring)."""
    base = float(1 << HESSIAN_DIGIT_BITS)
    hi = torch.round(grid / base)
    lo = grid - hi * base
    total = torch.zeros(triangle.upper.numel(), dtype=torch.int64, device=grid.device)
    for start in range(0, grid.shape[0], HESSIAN_CHUNK_TOKENS):
        h, lo_ = hi[start:start + HESSIAN_CHUNK_TOKENS], lo[start:start + HESSIAN_CHUNK_TOKENS]
        total.add_(triangle.pack(h.t() @ h).to(torch.int64), alpha=1 << (2 * HESSIAN_DIGIT_BITS))
        cross = h.t() @ lo_
        total.add_(triangle.pack(cross).to(torch.int64), alpha=1 << HESSIAN_DIGIT_BITS)
        total.add_(triangle.pack_mirror(cross).to(torch.int64), alpha=1 << HESSIAN_DIGIT_BITS)
        del cross
        total.add_(triangle.pack(lo_.t() @ lo_).to(torch.int64))
    return total




def timed(fn, device: torch.device, repeats: int = 3) -> tuple[torch.Tensor, float]:
    out = fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    synchronize(device)
    return out, (time.perf_counter() - start) / repeats


def bf16_gram_packed(grid: torch.Tensor, triangle: Triangle) -> torch.Tensor:
    """exact_gram_packed with the digits as bf16 (exact: |digit| <= 2^7) and fp32 accumulation."""
    base = 256.0
    hi = torch.round(grid / base)
    lo = grid - hi * base
    total = torch.zeros(triangle.upper.numel(), dtype=torch.int64, device=grid.device)
    for start in range(0, grid.shape[0], 1024):
        h = hi[start:start + 1024].to(torch.bfloat16)
        lo_ = lo[start:start + 1024].to(torch.bfloat16)
        mm = lambda a, b: torch.mm(a.t(), b, out_dtype=torch.float32)  # noqa: E731
        total.add_(triangle.pack(mm(h, h)).to(torch.int64), alpha=1 << 16)
        cross = mm(h, lo_)
        total.add_(triangle.pack(cross).to(torch.int64), alpha=1 << 8)
        total.add_(triangle.pack_mirror(cross).to(torch.int64), alpha=1 << 8)
        total.add_(triangle.pack(mm(lo_, lo_)).to(torch.int64))
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--width", type=int, default=7168)
    p.add_argument("--tokens", type=int, default=16384)
    args = p.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    limit = 1 << HESSIAN_GRID_BITS
    # heavy-tailed integers on the grid, the extremes included: the worst case of the digit sums
    grid = (torch.randn(args.tokens, args.width, generator=g) ** 3).clamp(-1, 1).mul(limit).round()
    grid[0], grid[1] = limit, -limit
    triangle = Triangle(args.width, device)
    x = grid.to(device)
    # float64 is exact here: products <= 2^30, sums over <= 2^22 tokens < 2^53
    ref_cols = x[:, :min(1024, args.width)].double()
    reference = (ref_cols.t() @ ref_cols).to(torch.int64).cpu()
    results = {}
    variants = {"fp32": lambda: exact_gram_packed(x, triangle)}
    if device.type != "cpu":
        def tf32() -> torch.Tensor:
            with tensor_core_fp32_matmuls(device):
                return exact_gram_packed(x, triangle)
        variants["tf32"] = tf32
        variants["bf16"] = lambda: bf16_gram_packed(x, triangle)
    exact = None
    for name, fn in variants.items():
        try:
            out, seconds = timed(fn, device)
        except (RuntimeError, TypeError) as exc:
            results[name] = {"error": str(exc).splitlines()[0][:200]}
            continue
        if exact is None:
            exact = out
        results[name] = {"us_per_token": round(1e6 * seconds / args.tokens, 3), "equal_to_fp32": bool(torch.equal(out, exact))}
        sub = Triangle(min(1024, args.width), torch.device("cpu"))
        full = triangle.unpack(out.cpu())[:sub.d, :sub.d]
        results[name]["equal_to_int64_reference_first_1024"] = bool(torch.equal(sub.pack(full), sub.pack(reference)))
    xb = x.to(torch.bfloat16)

    def plain() -> torch.Tensor:
        return torch.mm(xb.t(), xb, out_dtype=torch.float32) if device.type == "cuda" else xb.float().t() @ xb.float()

    from msmodelslim.core.requests import Observe
    from msmodelslim.pipeline.statistics import Hessian

    def runner() -> torch.Tensor:  # the runner's Hessian kind: float32 sums of 2^10-row chunks on TF32 / HF32
        kind = Hessian(Observe(hessian=("x",)), {}, device)
        kind.record("x", xb)
        kind._flush("x", final=True)
        return kind.sums["x"]

    for name, fn in (("float_plain_bf16", plain), ("float_runner_chunks", runner)):
        try:
            _, seconds = timed(fn, device)
            results[name] = {"us_per_token": round(1e6 * seconds / args.tokens, 3), "exact": False}
        except (RuntimeError, TypeError) as exc:
            results[name] = {"error": str(exc).splitlines()[0][:200]}
    print_result({"bench": "hessian_arith", "machine": machine(), "device": args.device, "width": args.width,
                  "tokens": args.tokens, "variants": results})


if __name__ == "__main__":
    main()
