"""Kernel launches per calibration pass of one Kimi-K3 MoE layer as one rank of EP 8 holds it, counted on the CPU.

On the H200 the passes are bound by their launches (BENCHMARKS.md, issue 31: ~16,000 kernels per 8,192-token
micro-batch pass, the GPU busy a tenth of the wall). A launch is one computing operator, and the operators a pass
runs do not depend on the layer's widths, so this bench counts them on the CPU: the `layer` preset's structure (one
KDA layer with attention residuals, a latent MoE of 112 SiTU experts at top-2, two shared experts) with every width
shrunk, the shipped `kimi_k3_w4a8` practice, generated long records (one in 8 image+text) in micro-batches of
`--micro-batch-tokens`. `$MSMODELSLIM_PROFILE` counts the leaf operators of each pass kind (pipeline/profile.py:
operators with none below them that are not views); the JSON gives them per pass and micro-batch of the decoder
layer's unit, next to the H200's kernel counts of the full-size layer.

    python bench/launches.py [--tokens 16384 --micro-batch-tokens 8192 --no-report --baseline-tree DIR]
`--baseline-tree` counts another copy of the package in the same sitting (its pipeline/profile.py must count leaf
operators: 0d9bf8f or later, or an older tree with today's profile.py copied in).
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (  # noqa: E402
    BENCH_OUT,
    MAKE_CHECKPOINT,
    ROOT,
    machine,
    package_tree,
    print_result,
    run_quant,
    shrunken_practice,
)
from bench.k3_layer import EXPERTS_PER_RANK, TOPK_PER_RANK, long_record_set  # noqa: E402
from msmodelslim.pipeline.launch import NO_REPORT_ENV  # noqa: E402
from msmodelslim.pipeline.profile import PROFILE_ENV  # noqa: E402

# the `layer` preset's structure at widths a CPU runs in seconds
SHRUNK = {
    "text_config.hidden_size": 256, "text_config.intermediate_size": 512, "text_config.vocab_size": 1024,
    "text_config.linear_attn_config.num_heads": 2, "text_config.linear_attn_config.head_dim": 64,
    "text_config.num_attention_heads": 2, "text_config.qk_nope_head_dim": 32, "text_config.qk_rope_head_dim": 16,
    "text_config.v_head_dim": 32, "text_config.kv_lora_rank": 64, "text_config.q_lora_rank": 96,
    "text_config.moe_intermediate_size": 64, "text_config.routed_expert_hidden_size": 128,
    "text_config.num_experts": EXPERTS_PER_RANK, "text_config.num_experts_per_token": TOPK_PER_RANK,
}
# The H200's counts of the full-size layer (session 18, 2 micro-batches of 8,192 tokens; all units' passes)
H200_KERNELS = {"calibrate": 69684, "iter_smooth": 53423, "linear_quant": 42376}
_KIND = re.compile(r"^== (\S+): (\d+) passes, wall ([\d.]+) s, host operators ([\d.]+) s, (\d+) leaf operators")


def shrunk_layer_checkpoint(widths: dict = SHRUNK, name: str = "shrunk") -> Path:
    """The `layer` preset as one rank of EP 8 holds it, with `widths` set, generated once into bench_out/."""
    model = BENCH_OUT / f"Kimi-K3-layer-ep8-rank-{name}"
    if not (model / "model.safetensors.index.json").is_file():
        sets = [arg for key, value in widths.items() for arg in ("--set", f"{key}={value}")]
        subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--preset", "layer", "--out", str(model), *sets],
                       check=True)
    return model


def count(model: Path, tokens: int, seq_len: int, batch: int, practice: Path, report: bool = True,
          tree: str | None = None) -> dict:
    folder, records = long_record_set(tokens, seq_len)
    shrunk = shrunken_practice(practice, BENCH_OUT / f"launches_practice_{tokens}_{batch}.yaml", records, seq_len,
                               dataset=folder, spec={"micro_batch_tokens": batch})
    prefix = BENCH_OUT / "launches_profile"
    run = run_quant(model, BENCH_OUT / "Kimi-K3-layer-shrunk-w4a8", "cpu", shrunk,
                    extra_env={PROFILE_ENV: str(prefix), **({} if report else {NO_REPORT_ENV: "1"}),
                               "MSMODELSLIM_CPU_PIECE_ROWS": str(1 << 40)},  # no CPU-only pieces: a device's count
                    tree=tree)
    kinds = {}
    for line in Path(f"{prefix}.rank0").read_text().splitlines():
        if m := _KIND.match(line):
            kinds[m.group(1)] = {"passes": int(m.group(2)), "wall_s": float(m.group(3)),
                                 "leaf_operators": int(m.group(5))}
    return {"kinds": kinds, "profiled_runner_wall_s": round(run["ranks"][0]["runner_wall"], 2)}  # profiler on: slower


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--no-report", action="store_true", help="without the quant report: what a token past "
                                                               "spec.report_tokens costs")
    p.add_argument("--baseline-tree", default=None, help="also count this copy of the package")
    p.add_argument("--practice", default=str(ROOT / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml"))
    args = p.parse_args()
    package_tree(args.baseline_tree)
    model = shrunk_layer_checkpoint()
    trees = {"current": None, **({"baseline": args.baseline_tree} if args.baseline_tree else {})}
    counted = {}
    for name, tree in trees.items():
        result = count(model, args.tokens, args.max_seq_len, args.micro_batch_tokens, Path(args.practice),
                       report=not args.no_report, tree=tree)
        for kind, row in result["kinds"].items():
            row["h200_full_size_kernels"] = H200_KERNELS.get(kind)
            row["leaf_operators_per_token"] = round(row["leaf_operators"] / args.tokens, 3)
        counted[name] = result
    print_result({"bench": "launches", "machine": machine(), "tokens": args.tokens, "report": not args.no_report,
                  "micro_batch_tokens": args.micro_batch_tokens,
                  "micro_batches": -(-args.tokens // args.micro_batch_tokens), "practice": Path(args.practice).name,
                  "shrunk": SHRUNK, **counted})


if __name__ == "__main__":
    main()
