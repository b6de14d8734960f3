"""What the samples' state costs when it spills to disk at Kimi-K3's size (143,368 bytes per token).

Past the host budget the runner writes each micro-batch's outputs to a file as a unit makes them and reads it back
memory-mapped when the next unit forwards it (pipeline/spill.py). This bench does exactly that through `StateSpill`,
with Kimi-K3's state per token (the hidden state, 8 attention-residual blocks and the MTP input, each bf16 [7168],
and the token id: 143,368 bytes; 7 blocks and 129,032 bytes before session 35) in micro-batches of 8,192 tokens (1.06 GB each):

1. the first unit writes `--batches` of them whole (more than the page cache holds at the default);
2. a decoder unit reads each back, copies every byte into one buffer (as the forward's move to the device does) and
   keeps a new hidden state with the rest passed through, two ways alternating (`--repeats` each): `incremental`,
   the runner's (the passed-through tensors are references to the first unit's files), and `whole`, every tensor
   written again (the spill before session 24: the passed-through tensors as new objects).

Prints per way the read and write seconds of each run, the bytes written, the best run's milliseconds per token
and unit and what a decoder unit's spill costs at 1M tokens per rank at that rate.

    python bench/spill.py [--batches 16 --repeats 2 --folder bench_out/spill_bench]
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
BLOCKS = 8  # Kimi-K3: 93 decoder layers in attention-residual blocks of 12 (layers 0, 12, ..., 84 store one)


def k3_state(tokens: int) -> dict:
    """One micro-batch's state between units, as Kimi-K3's adapter keeps it (sizes of assembly.host_state)."""
    def hidden() -> torch.Tensor:
        return torch.randn(tokens, HIDDEN).to(torch.bfloat16)

    return {"hidden": hidden(), "blocks": [hidden() for _ in range(BLOCKS)], "mtp": hidden(),
            "input_ids": torch.randint(0, 160_000, (tokens,))}


def decoder_unit(spill: StateSpill, unit: int, kept: list, tokens: int, whole: bool) -> dict:
    """Unit `unit` over the spilled states `kept` of the first unit: read each back into one buffer, keep a new
    hidden state and the rest passed through (as new objects when `whole`). Seconds reading and writing, bytes."""
    buffers = k3_state(tokens)  # the device copy's source stands in for the device
    fresh = buffers["hidden"].clone()
    read_s = write_s = 0.0
    written = 0
    for i, item in enumerate(kept):
        start = time.perf_counter()
        loaded = spill.load(item)
        for dst, src in zip([buffers["hidden"], *buffers["blocks"], buffers["mtp"], buffers["input_ids"]],
                            [loaded["hidden"], *loaded["blocks"], loaded["mtp"], loaded["input_ids"]], strict=True):
            dst.copy_(src)
        read_s += time.perf_counter() - start
        out = {**loaded, "hidden": fresh + i}  # a new hidden state (one add: not timed as the unit's work)
        if whole:
            out = {k: (v.clone() if k != "blocks" else [b.clone() for b in v]) for k, v in out.items()}
        start = time.perf_counter()
        made = spill.keep(unit, i, out, state_bytes(out))
        write_s += time.perf_counter() - start
        written += made.bytes
        del loaded, out
    return {"read_s": read_s, "write_s": write_s, "bytes": written}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--folder", default=str(BENCH_OUT / "spill_bench"))
    p.add_argument("--repeats", type=int, default=2, help="decoder units of each way, alternating")
    args = p.parse_args()
    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)
    spill = StateSpill(folder, budget=0)
    state = k3_state(args.tokens)
    per_batch = state_bytes(state)
    tokens = args.batches * args.tokens
    ways = {}
    try:
        start = time.perf_counter()
        kept = [spill.keep(0, i, state, per_batch) for i in range(args.batches)]
        first_write_s = time.perf_counter() - start
        del state
        runs: dict[str, list[dict]] = {"incremental": [], "whole": []}
        for unit, way in enumerate(["incremental", "whole"] * args.repeats, start=1):  # alternating: drift hits both
            runs[way].append(decoder_unit(spill, unit, kept, args.tokens, whole=way == "whole"))
            shutil.rmtree(spill.unit_folder(unit))
        for way, done in runs.items():
            best = min(done, key=lambda r: r["read_s"] + r["write_s"])
            ms = 1000 * (best["read_s"] + best["write_s"]) / tokens
            ways[way] = {"read_s": [round(r["read_s"], 1) for r in done],
                         "write_s": [round(r["write_s"], 1) for r in done],
                         "written_gb": round(best["bytes"] / 1e9, 2),
                         "written_bytes_per_token": best["bytes"] // tokens,
                         "ms_per_token_per_unit_best": round(ms, 4), "unit_at_1m_tokens_s": round(ms * 1e3, 1)}
    finally:
        spill.close()
    total = per_batch * args.batches
    print_result({"bench": "spill", "machine": machine(), "bytes_per_token": per_batch // args.tokens,
                  "batches": args.batches, "tokens": tokens, "first_unit_gb": round(total / 1e9, 2),
                  "first_unit_write_gb_per_s": round(total / 1e9 / first_write_s, 3), "decoder_unit": ways,
                  "ratio_incremental_vs_whole": round(ways["incremental"]["ms_per_token_per_unit_best"]
                                                      / ways["whole"]["ms_per_token_per_unit_best"], 3)})


if __name__ == "__main__":
    main()
