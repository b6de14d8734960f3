"""What the resumable state costs per unit at Kimi-K3's size: incremental files against rewriting the whole state.

After a unit the runner keeps the samples' state for `--resume` (pipeline/resume.py). Kimi-K3's state is 143,368
bytes per token (bench/spill.py's `k3_state`: the hidden state, 8 attention-residual blocks, the MTP input, the token
id), and a decoder unit changes only its hidden state (and, at the end of a block of 12 layers, adds one block): the
rest passes through untouched as the same tensors (`layer_wise.HostCopies`). This bench keeps `--units` such units'
states through `ResumeState.save`, as the runner does, two ways in one sitting: one `ResumeState` (its files refer to
the tensors earlier files hold: what the runner does now) and a fresh `ResumeState` per unit (no registry: every
tensor written again, what it did before). Per way: seconds and bytes written per unit, ms per token and unit, and a
unit's cost at 1M tokens per rank.

    python bench/resume_state.py [--tokens 8192 --batches 2 --units 6 --folder bench_out/resume_bench]
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
from bench.spill import k3_state  # noqa: E402
from msmodelslim.pipeline.resume import ResumeState  # noqa: E402
from msmodelslim.pipeline.spill import state_bytes  # noqa: E402

BLOCK_EVERY = 12  # Kimi-K3's attention-residual block size (layers)


def next_unit(state: dict, unit: int) -> dict:
    """A decoder unit's outputs: a new hidden state; a finished block at the end of every BLOCK_EVERY-th unit."""
    hidden = torch.randn_like(state["hidden"], dtype=torch.float32).to(torch.bfloat16)
    blocks = state["blocks"] + [hidden] if (unit + 1) % BLOCK_EVERY == 0 else state["blocks"]
    return {**state, "hidden": hidden, "blocks": blocks}


def keep_units(folder: Path, states: list[dict], units: int, incremental: bool) -> list[tuple[float, int]]:
    """(seconds, bytes written) per unit kept."""
    shutil.rmtree(folder, ignore_errors=True)
    resume = ResumeState(folder)
    out = []
    for unit in range(units):
        states = [next_unit(s, unit) for s in states]
        if not incremental:
            resume = ResumeState(folder)  # an empty registry: the whole state is written
        start = time.perf_counter()
        resume.save(0, unit, {"states": states, "savers": [], "processors": [], "report": None}, shards={})
        seconds = time.perf_counter() - start
        out.append((seconds, (folder / "resume" / "rank0" / f"unit{unit:05d}.pt").stat().st_size))
    shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--batches", type=int, default=2, help="micro-batches of the rank")
    p.add_argument("--units", type=int, default=6)
    p.add_argument("--folder", default=str(BENCH_OUT / "resume_bench"))
    args = p.parse_args()
    states = [k3_state(args.tokens) for _ in range(args.batches)]
    tokens = args.tokens * args.batches
    result = {"bench": "resume_state", "machine": machine(), "tokens": tokens, "units": args.units,
              "state_bytes_per_token": sum(map(state_bytes, states)) // tokens}
    for name, incremental in (("rewrite", False), ("incremental", True)):
        # the first unit writes everything either way: the steady state is the units after it
        runs = keep_units(Path(args.folder), states, args.units, incremental)[1:]
        seconds = sum(s for s, _ in runs) / len(runs)
        written = sum(b for _, b in runs) / len(runs)
        result[name] = {"s_per_unit": round(seconds, 2), "bytes_per_token_per_unit": round(written / tokens),
                        "ms_per_token_per_unit": round(1000 * seconds / tokens, 4),
                        "unit_at_1m_tokens_s": round(seconds / tokens * 1e6, 1)}
        print(name, result[name], flush=True)
    result["ratio"] = round(result["rewrite"]["s_per_unit"] / result["incremental"]["s_per_unit"], 2)
    print_result(result)


if __name__ == "__main__":
    main()
