"""Cost of one batched GPTQ of routed experts: seconds and device ops, this tree against another.

GPTQ quantizes a batch's columns one at a time, and every column costs the same few small kernels whatever the
batch holds, so at full scale the loop is bound by kernel launches (and, under MSMODELSLIM_ASCEND_CHECK, by the
Python check of each op), not by arithmetic. This bench runs `quantize_weight(method="gptq")` on `--experts`
experts' w1 and w3 (one shared Hessian per expert, [--out, --width]) as linear_quant batches them, counts the
aten ops it issues (a counting dispatch mode), times it plain and under the Ascend op check (MSMODELSLIM_ASCEND_CHECK),
and checks that both trees give the same integers.
Each tree runs in a fresh process; the trees alternate `--repeats` times (this machine is noisy).

Usage: python bench/gptq.py [--experts 4 --out 768 --width 896 --tokens 512 --other-tree DIR --repeats 3]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, json, sys, time
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f)]  # this tree, not the installed one
sys.path.insert(0, {tree!r})
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from msmodelslim.quant.granularity import int4
from msmodelslim.quant.modules import quantize_weight

E, OUT, D, T = {experts}, {out}, {width}, {tokens}
g = torch.Generator().manual_seed(0)
mix = torch.randn(D, D, generator=g) / D ** 0.5 + torch.eye(D)
x = torch.randn(E, T, D, generator=g) @ mix
hessian = x.transpose(1, 2) @ x                                  # one per expert (w1 and w3 read one input)
w = torch.randn(E, 2 * OUT, D, generator=g).bfloat16()            # per expert its w1 and w3 rows, stacked
tokens = torch.full((E,), T)


class Count(TorchDispatchMode):
    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Count.ops += 1
        return func(*args, **(kwargs or {{}}))


def run():
    return quantize_weight(w, int4, "gptq", hessian=hessian, tokens=tokens)


with Count():
    q, _ = run()
start = time.perf_counter()
q, _ = run()
seconds = time.perf_counter() - start
from msmodelslim.core import ascend_check
with ascend_check.run_checked(torch.device("cpu"), True, {{}}):
    start = time.perf_counter()
    run()
    checked = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "checked_seconds": checked, "ops": Count.ops, "ops_per_column": Count.ops / D,
                  "integers_sha1": hashlib.sha1(q.contiguous().numpy().tobytes()).hexdigest()}}))
"""


def measure(tree: Path, args: argparse.Namespace) -> dict:
    code = CHILD.format(tree=str(tree), experts=args.experts, out=args.out, width=args.width, tokens=args.tokens)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--out", type=int, default=768, help="rows of w1 / w3 (Kimi-K3: 3072)")
    p.add_argument("--width", type=int, default=896, help="input width, the GPTQ columns (Kimi-K3 latent: 3584)")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--other-tree", type=Path, help="another checkout (e.g. `git worktree add`) to compare with")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    trees = {"this": ROOT, **({"other": args.other_tree.resolve()} if args.other_tree else {})}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(measure(tree, args))
    result = {"bench": "gptq", "experts": args.experts, "matrices": 2 * args.experts,
              "shape": [args.out, args.width], "tokens": args.tokens, "repeats": args.repeats}
    for name, rs in runs.items():
        result[name] = {"median_s": round(statistics.median(r["seconds"] for r in rs), 3),
                        "checked_median_s": round(statistics.median(r["checked_seconds"] for r in rs), 3),
                        "ops": rs[0]["ops"], "ops_per_column": round(rs[0]["ops_per_column"], 2)}
    if "other" in runs:
        result["same_integers"] = runs["this"][0]["integers_sha1"] == runs["other"][0]["integers_sha1"]
        for key in ("median_s", "checked_median_s"):
            result[f"ratio_{key}"] = round(result["this"][key] / result["other"][key], 3)
    print(json.dumps(result, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
