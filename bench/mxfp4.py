"""MXFP4 -> BF16 decode throughput against a plain copy of the same number of output bytes.

Both are timed side by side in the same run (interleaved, median of --repeats), on --device:
- ``ratio_to_memcpy`` (the headline, ``<device>_ratio_to_memcpy``): ``decode_mxfp4(..., out=buf)`` into a
  preallocated tensor vs ``dst.copy_(src)`` into a preallocated tensor (like for like: no allocation);
- ``alloc_ratio_to_clone``: ``decode_mxfp4`` returning a fresh tensor vs ``src.clone()`` (on CPU both pay
  first-touch page faults, which dominate a 2-core sandbox).
``bitexact``: our decode of a sample equals compressed-tensors' MXFP4PackedCompressor.decompress bit for bit.

Usage: python bench/mxfp4.py [--device cuda] [--rows 7168 --cols 3072 --count 4 --repeats 9]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from msmodelslim.source.mxfp4 import decode_mxfp4  # noqa: E402

logger = logging.getLogger("bench.mxfp4")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def _timed(fn, device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds: all threads, not counting time preempted by other processes)."""
    _sync(device)
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def _bitexact_sample(packed: torch.Tensor, scale: torch.Tensor, rows: int = 256) -> bool:
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="float", strategy="group", symmetric=True, group_size=32,
                            scale_dtype=torch.uint8, zp_dtype=torch.uint8)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    p, s = packed[:rows].cpu(), scale[:rows].cpu()
    ref = MXFP4PackedCompressor.decompress({"weight_packed": p, "weight_scale": s}, scheme)["weight"]
    ours = decode_mxfp4(packed[:rows], scale[:rows]).cpu()
    return bool(torch.equal(ours.view(torch.int16), ref.view(torch.int16)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=7168)
    ap.add_argument("--cols", type=int, default=3072)
    ap.add_argument("--count", type=int, default=4, help="weights decoded per timed pass")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    opts = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    if device.type == "npu":
        import torch_npu  # noqa: F401
    g = torch.Generator().manual_seed(0)
    shape = (opts.rows, opts.cols)
    packed = [torch.randint(0, 256, (opts.rows, opts.cols // 2), dtype=torch.uint8, generator=g).to(device)
              for _ in range(opts.count)]
    # realistic exponents (weights of magnitude ~1e-3..1e-1) plus the extremes of the valid range
    scale = []
    for _ in range(opts.count):
        s = torch.randint(112, 126, (opts.rows, opts.cols // 32), dtype=torch.uint8, generator=g)
        s[0, 0], s[-1, -1] = 0, 254
        scale.append(s.to(device))
    out_bytes = opts.rows * opts.cols * 2 * opts.count
    src = [torch.randn(shape, generator=g).bfloat16().to(device) for _ in range(opts.count)]
    dst = [torch.empty_like(x) for x in src]
    buf = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(opts.count)]

    def copy_pre():
        for d, s in zip(dst, src):
            d.copy_(s)

    def decode_pre():
        for b, p, s in zip(buf, packed, scale):
            decode_mxfp4(p, s, out=b)

    def clone():
        return [s.clone() for s in src]

    def decode_alloc():
        return [decode_mxfp4(p, s) for p, s in zip(packed, scale)]

    for fn in (copy_pre, decode_pre, clone, decode_alloc):  # warm-up (tables, allocator, caches)
        fn()
    t = {"copy": [], "decode": [], "clone": [], "decode_alloc": []}
    for _ in range(opts.repeats):
        t["copy"].append(_timed(copy_pre, device))
        t["decode"].append(_timed(decode_pre, device))
        t["clone"].append(_timed(clone, device))
        t["decode_alloc"].append(_timed(decode_alloc, device))
    med = {k: statistics.median(w for w, _ in v) for k, v in t.items()}
    ratios = [c[0] / d[0] for c, d in zip(t["copy"], t["decode"])]
    alloc_ratios = [c[0] / d[0] for c, d in zip(t["clone"], t["decode_alloc"])]
    cpu_ratios = [c[1] / d[1] for c, d in zip(t["copy"], t["decode"]) if c[1] > 0 and d[1] > 0]
    result = {
        "bench": "mxfp4_decode",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": list(shape),
        "count": opts.count,
        "repeats": opts.repeats,
        "bitexact": _bitexact_sample(packed[0], scale[0]),
        "decode_gbps": round(out_bytes / med["decode"] / 1e9, 3),
        "memcpy_gbps": round(out_bytes / med["copy"] / 1e9, 3),
        f"{device.type}_ratio_to_memcpy": round(statistics.median(ratios), 3),
        "decode_alloc_gbps": round(out_bytes / med["decode_alloc"] / 1e9, 3),
        "clone_gbps": round(out_bytes / med["clone"] / 1e9, 3),
        "alloc_ratio_to_clone": round(statistics.median(alloc_ratios), 3),
        # CPU-seconds ratio (copy / decode, preallocated): robust to other processes on a shared host
        "cpu_seconds_ratio": round(statistics.median(cpu_ratios), 3) if cpu_ratios and device.type == "cpu" else None,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    target = 0.5 if device.type == "cuda" else 0.25
    logger.info("decode %.2f GB/s vs copy %.2f GB/s: ratio %.3f (target >= %.2f)", result["decode_gbps"],
                result["memcpy_gbps"], result[f"{device.type}_ratio_to_memcpy"], target)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
