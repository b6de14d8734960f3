"""SHA-256 of every file of our outputs, for every shipped practice of both models, compared with another commit's
outputs built on this machine in this sitting: what a refactor that must keep the outputs is held to.

Two sets, each on the tiny Kimi-K3 (seed 0) and on kimi-linear-mini:
- `plain`: test/consumer/outputs.py's outputs (2 samples of <= 64 tokens, min/max weights, fixed-alpha smoothing);
- `shipped`: the same calibration cut with the practices' own numerics (GPTQ, the smoothing search).

    python bench/output_hashes.py --against 936f46a   # build REV's outputs in a git worktree, then this tree's
    python bench/output_hashes.py --record FILE       # only write this tree's hashes (JSON)

Bytes are compared on one machine only: float kernels differ between CPU microarchitectures (oneDNN / MKL dispatch
on more than torch's reported capability), so hashes recorded elsewhere say nothing. Both sides read the same
generated checkpoint (REV's worktree links this tree's bench_out/ copy), so a change of the generator is not taken
for a change of the toolkit. The quant report is left out (`file_hashes`: a diagnostic of float sums that a refactor
may reorder; its tests hold it to a tolerance). The JSON line counts the differing files; each is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_OUT, ROOT, generated_checkpoint, machine, print_result  # noqa: E402

sys.path.insert(0, str(ROOT / "test"))
from consumer.outputs import build_outputs, file_hashes  # noqa: E402

DEFAULT_RECORD = BENCH_OUT / "output_hashes.json"
# where a tree's `--record` (no value) writes: this version's default, and the older versions' tracked record
RECORDS = ("bench_out/output_hashes.json", "test/app/output_hashes.json")


def output_hashes(root: Path, tiny_k3: Path, plain_numerics: bool) -> dict[str, dict[str, str]]:
    root.mkdir(parents=True)
    outputs = build_outputs(root, tiny_k3, every_practice=True, plain_numerics=plain_numerics)
    return {f"{model}_{quant_type}": file_hashes(out) for (model, quant_type), out in sorted(outputs.items())}


def this_tree(tiny_k3: Path) -> dict[str, dict[str, dict[str, str]]]:
    with tempfile.TemporaryDirectory(prefix="bench-hashes-") as root:
        return {"plain": output_hashes(Path(root) / "plain", tiny_k3, plain_numerics=True),
                "shipped": output_hashes(Path(root) / "shipped", tiny_k3, plain_numerics=False)}


def other_tree(rev: str, tiny_k3: Path) -> dict[str, dict[str, dict[str, str]]]:
    """`rev`'s hashes: its own bench/output_hashes.py --record, run in a git worktree of it (its package first on
    the path) beside a link to ../shared, reading this tree's generated checkpoint."""
    with tempfile.TemporaryDirectory(prefix="bench-hashes-base-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
        try:
            os.symlink(ROOT.parent / "shared", Path(tmp) / "shared")
            (tree / "bench_out").mkdir()
            os.symlink(tiny_k3, tree / "bench_out" / tiny_k3.name)
            env = {**os.environ, "PYTHONPATH": str(tree)}
            subprocess.run([sys.executable, "bench/output_hashes.py", "--record"], cwd=tree, env=env, check=True)
            written = [tree / name for name in RECORDS if (tree / name).is_file()]
            recorded = json.loads(max(written, key=lambda p: p.stat().st_mtime).read_text())
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False,
                           capture_output=True)
    recorded.pop("cpu_capability", None)
    return recorded


def differing(found: dict, base: dict) -> list[str]:
    names = {(kind, output, name) for side in (found, base) for kind, outputs in side.items()
             for output, files in outputs.items() for name in files}
    return sorted(f"{kind}/{output}/{name}" for kind, output, name in names
                  if found.get(kind, {}).get(output, {}).get(name) != base.get(kind, {}).get(output, {}).get(name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="a commit to compare with (built here, now)")
    parser.add_argument("--record", nargs="?", const=str(DEFAULT_RECORD), metavar="FILE",
                        help=f"write this tree's hashes (default {DEFAULT_RECORD.relative_to(ROOT)})")
    args = parser.parse_args()
    start = time.perf_counter()
    tiny = generated_checkpoint("tiny")
    base = other_tree(args.against, tiny) if args.against else None
    found = this_tree(tiny)
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    differ = differing(found, base) if base is not None else []
    for name in differ:
        print(f"differs: {name}", flush=True)
    print_result({"bench": "output_hashes", "machine": machine(), "against": args.against,
                  "outputs": sum(len(o) for o in found.values()),
                  "files": sum(len(f) for o in found.values() for f in o.values()),
                  "differing_files": len(differ) if base is not None else None,
                  "seconds": round(time.perf_counter() - start, 1)})


if __name__ == "__main__":
    main()
