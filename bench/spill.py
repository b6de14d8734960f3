"""What the samples' state costs when it spills to disk at Kimi-K3's size (issue 31: 129,032 bytes per token).

Past the host budget the runner writes each micro-batch's outputs to a file as a unit makes them and reads it back
memory-mapped when the next unit forwards it (pipeline/spill.py). This bench does exactly that through `StateSpill`
and `Spilled.load`, with Kimi-K3's state per token (the hidden state, 7 attention-residual blocks and the MTP input,
each bf16 [7168], and the token id: 129,032 bytes) in micro-batches of 8,192 tokens (1.06 GB each): it writes
`--batches` of them, more than the page cache holds, then reads each back and copies every byte into one buffer (as
the forward's move to the device does). Prints the write and read rates, the milliseconds per token and unit, and
what a unit's spill costs at 1M tokens per rank.

    python bench/spill.py [--batches 24 --folder bench_out/spill_bench]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import BENCH_OUT, machine, print_result  # noqa: E402
from msmodelslim.pipeline.spill import StateSpill, state_bytes  # noqa: E402

HIDDEN = 7168
BLOCKS = 7  # Kimi-K3: 93 decoder layers in attention-residual blocks of 12


def k3_state(tokens: int) -> dict:
    """One micro-batch's state between units, as Kimi-K3's adapter keeps it (sizes of assembly.host_state)."""
    def hidden() -> torch.Tensor:
        return torch.randn(tokens, HIDDEN).to(torch.bfloat16)

    return {"hidden": hidden(), "blocks": [hidden() for _ in range(BLOCKS)], "mtp": hidden(),
            "input_ids": torch.randint(0, 160_000, (tokens,))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--folder", default=str(BENCH_OUT / "spill_bench"))
    args = p.parse_args()
    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)
    spill = StateSpill(folder, budget=0)
    state = k3_state(args.tokens)
    per_batch = state_bytes(state)
    try:
        start = time.perf_counter()
        kept = [spill.keep(0, i, state, per_batch) for i in range(args.batches)]
        write_s = time.perf_counter() - start
        del state
        buffers = k3_state(args.tokens)  # where the bytes go (the device copy's source stands in for the device)
        start = time.perf_counter()
        for item in kept:
            loaded = item.load()
            buffers["hidden"].copy_(loaded["hidden"])
            for dst, src in zip(buffers["blocks"], loaded["blocks"], strict=True):
                dst.copy_(src)
            buffers["mtp"].copy_(loaded["mtp"])
            buffers["input_ids"].copy_(loaded["input_ids"])
            del loaded
        read_s = time.perf_counter() - start
    finally:
        spill.close()
    tokens = args.batches * args.tokens
    total = per_batch * args.batches
    ms_per_token = 1000 * (write_s + read_s) / tokens
    print_result({"bench": "spill", "machine": machine(), "bytes_per_token": per_batch // args.tokens,
                  "batches": args.batches, "tokens": tokens, "gb": round(total / 1e9, 2),
                  "write_gb_per_s": round(total / 1e9 / write_s, 3), "read_gb_per_s": round(total / 1e9 / read_s, 3),
                  "write_s": round(write_s, 1), "read_s": round(read_s, 1),
                  "ms_per_token_per_unit": round(ms_per_token, 4),
                  "unit_at_1m_tokens_s": round(ms_per_token * 1e6 / 1000, 1)})


if __name__ == "__main__":
    main()
