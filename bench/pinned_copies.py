"""What the calibration state's trips between host and device cost, per GB, by how the host memory is pinned.

The runner keeps every sample's state on the host and copies each unit's new hidden state back into pinned memory
(pipeline/layer_wise.HostCopies); linear_quant parks the routed experts' Hessians there too. torch allocates pinned
memory with cudaHostAlloc by default, which pins page after page on one thread: a one-off cost per byte that, in the
H100 profile of one full-size layer at 16k tokens, was as large as the copies themselves (0.244 s of cudaHostAlloc
for ~230 MB) and grows with the calibration tokens. torch's host allocator can instead fault the pages in on several
threads and register them (`pinned_use_cuda_host_register`, `pinned_num_register_threads` of
PYTORCH_CUDA_ALLOC_CONF). Each variant runs in a fresh process (the settings are read once):

- `first`: device -> new host blocks (allocation + copy), the state of a unit the first time;
- `back`: those blocks -> device (the next pass's inputs);
- `again`: the blocks freed and the copy repeated (torch's cache of pinned blocks: a later unit's outputs).

Block: the hidden state of one 8192-token micro-batch of a full-size layer (8192 x 7168 bf16, 112 MiB).

    python bench/pinned_copies.py --device cuda:0 [--gb 8]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import ROOT, machine, print_result  # noqa: E402
from msmodelslim.core.device import PINNED_HOST_ALLOCATOR  # noqa: E402

BLOCK_ELEMENTS = 8192 * 7168

VARIANTS = {
    "cudaHostAlloc": {"pinned": True, "conf": ""},
    "register_1_thread": {"pinned": True, "conf": "pinned_use_cuda_host_register:True,pinned_num_register_threads:1"},
    "shipped": {"pinned": True, "conf": None},  # no setting: msmodelslim's bind_device sets its own
    "register_16_threads": {"pinned": True,
                            "conf": "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"},
    "pageable": {"pinned": False, "conf": ""},
}

CHILD = r"""
import json, sys, time, torch
dev, blocks, pinned = torch.device({device!r}), {blocks}, {pinned}
if {shipped}:
    sys.path.insert(0, {root!r})
    from msmodelslim.core.device import bind_device
    bind_device(dev)
src = torch.randn({elements}, device=dev).to(torch.bfloat16)
torch.cuda.synchronize(dev)

def out():
    start, host = time.perf_counter(), []
    for _ in range(blocks):
        if pinned:
            host.append(torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src, non_blocking=True))
        else:
            host.append(src.to("cpu"))
    torch.cuda.synchronize(dev)
    return host, time.perf_counter() - start

host, first = out()
start = time.perf_counter()
for h in host:
    h.to(dev, non_blocking=True)
torch.cuda.synchronize(dev)
back = time.perf_counter() - start
assert torch.equal(host[-1].to(dev), src)
del host
host, again = out()
print(json.dumps({{"first": first, "back": back, "again": again}}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--gb", type=float, default=8.0, help="host state per variant (GB)")
    args = p.parse_args()
    block_gb = BLOCK_ELEMENTS * 2 / 1e9
    blocks = max(1, round(args.gb / block_gb))
    gb = blocks * block_gb
    results = {}
    for name, variant in VARIANTS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        if variant["conf"]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = variant["conf"]
        code = CHILD.format(device=args.device, blocks=blocks, pinned=variant["pinned"], elements=BLOCK_ELEMENTS,
                            shipped=variant["conf"] is None, root=str(ROOT))
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
        seconds = json.loads(out.stdout.strip().splitlines()[-1])
        results[name] = {k: round(gb / v, 2) for k, v in seconds.items()}
        print(name, results[name], flush=True)
    print_result({"bench": "pinned_copies", "machine": machine(), "device": args.device, "gb": round(gb, 2),
                  "block_mib": BLOCK_ELEMENTS * 2 / 2**20, "gb_per_s": results,
                  "shipped_setting": PINNED_HOST_ALLOCATOR})


if __name__ == "__main__":
    main()
