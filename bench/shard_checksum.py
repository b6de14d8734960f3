"""What the saver's checksum of a written shard costs: read back from the file after its fsync (before session 26)
against taken from the tensors in memory while the fsync runs (`files.safetensors_checksum`, now).

A shard of `--gb` GB of tensors as the saver writes them (packed int4 weights, bf16, float32 scales) is written with
safetensors' `save_file` into `--folder`; each way then makes it durable and takes its checksum, alternating
`--repeats` times (this machine is noisy), a fresh file each time so the read-back does not find it cached by an
earlier read. Both must give the same checksum.

Usage: python bench/shard_checksum.py [--gb 1 --folder bench_out --repeats 3]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import BENCH_OUT, machine, print_result  # noqa: E402
from msmodelslim.core.files import file_checksum, safetensors_checksum  # noqa: E402


def read_back(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return file_checksum(path)


def from_memory(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    with open(path, "rb") as f, ThreadPoolExecutor(1) as pool:
        durable = pool.submit(os.fsync, f.fileno())
        checksum = safetensors_checksum(path, tensors)
        durable.result()
    return checksum


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--folder", type=Path, default=BENCH_OUT)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    tensors, total, k = {}, 0, 0
    while total < args.gb * 1e9:  # one expert's tensors at Kimi-K3's widths: ~17 MB
        tensors[f"e{k}.w.weight"] = torch.randint(-128, 128, (1536, 3584), generator=g, dtype=torch.int8)
        tensors[f"e{k}.w.weight_scale"] = torch.rand(3072, 1, generator=g)
        tensors[f"e{k}.n.weight"] = torch.randn(3584, 1536, generator=g).to(torch.bfloat16)
        total += sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith(f"e{k}."))
        k += 1
    args.folder.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, list[float]] = {"read_back": [], "from_memory": []}
    sums = set()
    for r in range(args.repeats):
        for name, way in (("read_back", read_back), ("from_memory", from_memory)):
            path = args.folder / f"shard_checksum_{name}_{r}.safetensors"
            save_file(tensors, str(path), metadata={"format": "pt"})
            start = time.perf_counter()
            sums.add(way(path, tensors))
            seconds[name].append(time.perf_counter() - start)
            path.unlink()
    med = {name: statistics.median(v) for name, v in seconds.items()}
    print_result({"bench": "shard_checksum", "machine": machine(), "folder": str(args.folder),
                  "shard_gb": round(total / 1e9, 3), "seconds": {n: [round(x, 3) for x in v] for n, v in seconds.items()},
                  "median_s": {n: round(v, 3) for n, v in med.items()}, "same_checksum": len(sums) == 1,
                  "saved_s_per_gb": round((med["read_back"] - med["from_memory"]) / (total / 1e9), 3)})


if __name__ == "__main__":
    main()
