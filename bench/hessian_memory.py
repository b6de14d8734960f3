"""Memory and time of the runner's Hessian statistics for a rank's routed experts, this tree against another.

A rank of EP 8 holds 112 Kimi-K3 experts: w1 and w3 read the latent (3584), w2 the SiTU width (3072). One
calibration pass records X^T X of each (`Observe(hessian=...)`), which is what GPTQ reads, and the Hessians are
what filled a 64 GB device at full scale (BENCHMARKS.md, k3_layer). This bench builds `--experts` such experts
as cheap readers (only their input widths matter), feeds each `--tokens` random tokens, and reports the peak
host RSS the statistics took (a fresh process per tree, CPU) and the seconds, so the memory model of docs/npu.md
can be checked without an accelerator: the figures scale linearly with the experts.

Usage: python bench/hessian_memory.py [--experts 16 --tokens 256 --other-tree .before]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f)]  # this tree, not the installed one
sys.path.insert(0, {tree!r})
import torch
from torch import nn
import msmodelslim
from msmodelslim.core.dist import SINGLE
from msmodelslim.processor.base import UnitContext
from msmodelslim.pipeline.answers import observe
from msmodelslim.core.requests import Observe
from msmodelslim.model.base import Unit

LATENT, WIDTH = 3584, 3072


class Reader(nn.Module):  # a linear's input width, no weight
    def __init__(self, d):
        super().__init__()
        self.in_features = d

    def forward(self, x):
        return x


class RankLocal:
    def is_rank_local(self, name):
        return True  # rank-local: no reduction


experts = nn.ModuleDict({{str(e): nn.ModuleDict({{"w1": Reader(LATENT), "w3": Reader(LATENT), "w2": Reader(WIDTH)}})
                         for e in range({experts})}})
g = torch.Generator().manual_seed(0)
inputs = [(torch.randn({tokens}, LATENT, generator=g).bfloat16(), torch.randn({tokens}, WIDTH, generator=g).bfloat16())
          for _ in range({experts})]


def run():
    for e, (x1, x2) in enumerate(inputs):
        m = experts[str(e)]
        m["w1"](x1); m["w3"](x1); m["w2"](x2)


names = [f"{{e}}.{{w}}" for e in range({experts}) for w in ("w1", "w3", "w2")]
ranges = {{n: torch.full((LATENT if not n.endswith("w2") else WIDTH,), 5.0) for n in names}}
ctx = UnitContext(Unit("layers.0", "decoder", "model.layers.0.", 0), experts, RankLocal(), SINGLE, run_samples=run)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
stats = observe(ctx, Observe(hessian=tuple(names), ranges=ranges))
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
held = sum(h.numel() * h.element_size() for h in {{id(h): h for h in stats.hessian.values()}}.values())
print(json.dumps({{"tree": msmodelslim.__file__, "seconds": seconds, "peak_added_gib": (peak - base) / 2**20,
                  "held_gib": held / 2**30, "dtype": str(next(iter(stats.hessian.values())).dtype)}}))
"""


def measure(tree: Path, experts: int, tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(tree=str(tree), experts=experts, tokens=tokens)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--other-tree", default=str(ROOT / ".before"), help="a checkout to compare with")
    args = p.parse_args()
    this = measure(ROOT, args.experts, args.tokens)
    other = measure(Path(args.other_tree), args.experts, args.tokens) if Path(args.other_tree).is_dir() else None
    scale = 112 / args.experts
    result = {"bench": "hessian_memory", "experts": args.experts, "tokens_per_expert": args.tokens,
              "this": this, "other": other,
              "this_peak_gib_at_112_experts": round(this["peak_added_gib"] * scale, 1)}
    if other:
        result["other_peak_gib_at_112_experts"] = round(other["peak_added_gib"] * scale, 1)
        result["peak_ratio_this_to_other"] = round(this["peak_added_gib"] / other["peak_added_gib"], 3)
    print(json.dumps(result, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
