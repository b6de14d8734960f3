"""Cold start (issue 50 item 6): does a second process find fla's Triton autotuning on disk?

fla-core 0.6.0 autotunes its KDA kernels with Triton's `cache_results` (fla.utils.env: FLA_CACHE_RESULTS, default
on), which keeps each kernel's choice under Triton's cache directory (TRITON_CACHE_DIR, default ~/.triton/cache)
keyed by the kernel, its autotune key and the device. This bench times chunk_kda's first call at the full-size
layer's shapes (96 heads x 128, `--tokens` per sequence, bf16) in fresh processes that share one empty cache
directory: the first pays compilation and autotuning, the next ones should find both.

    python bench/autotune_cache.py --device cuda:0 [--tokens 1024 --processes 2]

Prints each process's first and warm call; one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, print_result  # noqa: E402
from bench.k3_layer import AUTOTUNE  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--processes", type=int, default=2)
    args = p.parse_args()
    calls = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        for i in range(args.processes):
            out = subprocess.run([sys.executable, "-c", AUTOTUNE.format(device=args.device, tokens=args.tokens)],
                                 check=True, capture_output=True, text=True, env=env)
            calls.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps({"process": i, **calls[-1]}), flush=True)
    print_result({"bench": "autotune_cache", "machine": machine(), "device": args.device, "tokens": args.tokens,
                  "first_call_s": [round(c["first_call_s"], 2) for c in calls],
                  "warm_call_s": [round(c["warm_call_s"], 4) for c in calls],
                  "second_process_found_the_cache": calls[-1]["first_call_s"] < 0.1 * calls[0]["first_call_s"]})


if __name__ == "__main__":
    main()
