"""GPTQ column loops of one Kimi-K3 MoE layer as one rank of EP 8 holds it, counted on the CPU, this tree against
another.

GPTQ's column loop costs a few small kernels per column whatever the matrix holds, so on an accelerator a layer's
GPTQ time follows its loops' columns (the H100: 64 us per column of a batch, BENCHMARKS.md, issue 31). This bench
runs the shipped `kimi_k3_w4a8` on the `layer` preset (one rank of EP 8: 112 experts at top-2) with every width
divided by about 30, so the linears keep the full layer's distinct shapes, and records every `gptq_quantize` call's
matrix shape ([batch,] rows, columns): the loops and their columns. At full size the columns are the inputs' widths
(the attention input 7168, o_proj 12288, the latent 3584, the shared experts' 6144, the experts' 3072).

Usage: python bench/gptq_loops.py [--baseline-tree DIR]   (DIR: e.g. `git archive` of an older commit)
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import BENCH_OUT, ROOT, machine, print_result, shrunken_practice  # noqa: E402
from bench.k3_layer import long_record_set  # noqa: E402
from bench.launches import SHRUNK, shrunk_layer_checkpoint  # noqa: E402

# the `layer` preset's widths / ~30 (hidden 7168 -> 256, KDA 96 x 128 -> 3 x 128, latent 3584 -> 128, experts 3072 ->
# 96, two shared): every linear keeps its full-size shape class, the MXFP4 experts' inputs multiples of 32 (the rest,
# MLA's widths among them, are bench/launches.py's; the layer is KDA)
DIV30 = {**SHRUNK, "text_config.hidden_size": 256, "text_config.intermediate_size": 576,
         "text_config.linear_attn_config.num_heads": 3, "text_config.linear_attn_config.head_dim": 128,
         "text_config.moe_intermediate_size": 96, "text_config.routed_expert_hidden_size": 128}

CHILD = r"""
import json, sys
import msmodelslim.quant.modules as modules
calls = []
original = modules.gptq_quantize
def counted(w, *args, **kwargs):
    calls.append(list(w.shape))
    return original(w, *args, **kwargs)
modules.gptq_quantize = counted
from msmodelslim.cli.main import main
code = main(["quant", "--model_path", {model!r}, "--save_path", {out!r}, "--device", "cpu", "--model_type", "Kimi-K3",
             "--config_path", {practice!r}, "--trust_remote_code", "True"])
print("GPTQ_CALLS " + json.dumps({{"code": code, "calls": calls}}))
"""


def loops(tree: Path, model: Path, practice: Path) -> dict:
    """The GPTQ calls of one quant run with the package of `tree` (its working directory comes first on the path)."""
    out = BENCH_OUT / "gptq_loops_out"
    shutil.rmtree(out, ignore_errors=True)  # an output is never overwritten
    run = subprocess.run([sys.executable, "-c", CHILD.format(model=str(model), out=str(out), practice=str(practice))],
                         cwd=tree, capture_output=True, text=True, check=True)
    line = next(x for x in run.stdout.splitlines() if x.startswith("GPTQ_CALLS "))
    result = json.loads(line.split(" ", 1)[1])
    calls = result["calls"]
    return {"exit_code": result["code"], "loops": len(calls), "columns": sum(shape[-1] for shape in calls),
            "matrices": sum(shape[0] if len(shape) == 3 else 1 for shape in calls), "shapes": calls}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline-tree", type=Path, default=None)
    p.add_argument("--practice", default=str(ROOT / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml"))
    args = p.parse_args()
    model = shrunk_layer_checkpoint(DIV30, "div30")
    folder, records = long_record_set(4096, 512)  # 8 records: one image+text
    practice = shrunken_practice(Path(args.practice), BENCH_OUT / "gptq_loops_practice.yaml", records, 512,
                                 dataset=folder)
    trees = {"current": ROOT, **({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})}
    print_result({"bench": "gptq_loops", "machine": machine(), "practice": Path(args.practice).name,
                  "widths": DIV30, **{name: loops(tree, model, practice) for name, tree in trees.items()}})


if __name__ == "__main__":
    main()
