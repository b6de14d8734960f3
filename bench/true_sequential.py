"""What GPTQ's `true_sequential` buys on Kimi-K3, and what it costs: the shipped W4A8 practice run twice in one
sitting, with `linear_quant.true_sequential` false (the default: every GPTQ Hessian from the unit's first pass) and
true (the latent up-projection's Hessian from the unit with its experts quantized, in a pass of its own).

It changes one linear per decoder unit, `routed_expert_up_proj` (the only reader of a quantized linear's output inside
a unit, docs/dev/architecture.md); the quant report measures its relative output error on the propagate pass, whose
inputs are the quantized experts' outputs as at inference (in-sample: the calibration tokens, the first
`spec.report_tokens`), so the figure favours `true` where its Hessian fits those inputs. Every other linear up to
the first up-projection's unit must keep its error to the report's 4 digits (later units see its output).

    python bench/true_sequential.py                                  # the tiny Kimi-K3 on the CPU
    python bench/true_sequential.py --model layer --device cuda:0 --tokens 262144   # a full-size layer, EP-8 rank

Prints per up-projection both errors, and the runner's wall and calibration passes per unit; one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import BENCH_OUT, ROOT, generated_checkpoint, machine, print_result, run_quant, shrunken_practice  # noqa: E402
from bench.k3_layer import long_record_set, rank_layer_checkpoint  # noqa: E402

PRACTICE = ROOT / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml"
WATCHED = "routed_expert_up_proj"


def practice_for(sequential: bool, args: argparse.Namespace) -> Path:
    dest = BENCH_OUT / f"true_sequential_{args.model}_{sequential}.yaml"
    if args.model == "layer":
        folder, records = long_record_set(args.tokens, args.max_seq_len)
        shrunken_practice(PRACTICE, dest, records, args.max_seq_len, dataset=folder)
    else:
        shrunken_practice(PRACTICE, dest, args.samples, args.max_seq_len)
    practice = yaml.safe_load(dest.read_text())
    for step in practice["spec"]["process"]:
        if step["type"] == "linear_quant":
            step["true_sequential"] = sequential
    dest.write_text(yaml.safe_dump(practice, sort_keys=False))
    return dest


def _layer(name: str) -> int | None:
    """The decoder layer of a checkpoint name (None: not a decoder layer's)."""
    _, found, rest = name.partition(".layers.")
    return int(rest.split(".")[0]) if found else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "layer"), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=262144, help="--model layer: calibration tokens")
    p.add_argument("--samples", type=int, default=16, help="--model tiny: calibration records")
    p.add_argument("--max-seq-len", type=int, default=None)
    args = p.parse_args()
    args.max_seq_len = args.max_seq_len or (1024 if args.model == "layer" else 256)
    model = rank_layer_checkpoint() if args.model == "layer" else generated_checkpoint("tiny")
    out = BENCH_OUT / f"true_sequential_{args.model}"
    if args.model == "layer":  # fla's Triton autotuning, not timed
        run_quant(model, out, args.device, practice_for(False, argparse.Namespace(**{**vars(args), "tokens": 16384})))
    runs = {}
    for sequential in (False, True):
        run = run_quant(model, out, args.device, practice_for(sequential, args))
        report = json.loads((out / "quant_report.json").read_text())["linears"]
        rank = run["ranks"][0]
        runs[sequential] = {"errors": {n: e["error"] for n, e in report.items()}, "wall_s": rank["runner_wall"],
                            "passes": rank["calibration_passes"]}
        print(json.dumps({"true_sequential": sequential, "runner_wall_s": round(rank["runner_wall"], 1),
                          "passes": rank["calibration_passes"]}), flush=True)
    one, seq = runs[False]["errors"], runs[True]["errors"]
    watched = sorted(n for n in one if WATCHED in n)
    # the first changed unit's other linears must not move; later units' do (their inputs come through it)
    first = min((_layer(n) for n in watched), default=-1)
    others_moved = sorted(n for n in one if WATCHED not in n and one[n] != seq.get(n)
                          and (_layer(n) is None or _layer(n) <= first))
    for name in watched:
        print(f"{name}: error {one[name]:.5g} (first pass) vs {seq[name]:.5g} (true_sequential), "
              f"ratio {one[name] / seq[name]:.4f}", flush=True)
    ratios = [one[n] / seq[n] for n in watched if seq[n]]
    print_result({"bench": "true_sequential", "machine": machine(), "device": args.device, "model": args.model,
                  "calibration": {"tokens": args.tokens} if args.model == "layer" else
                  {"records": args.samples, "max_seq_len": args.max_seq_len},
                  "up_proj_error": {n: {"first_pass": one[n], "true_sequential": seq[n]} for n in watched},
                  "up_proj_error_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
                  "moved_up_to_the_first_changed_unit": others_moved,
                  "runner_wall_s": {str(k).lower(): round(v["wall_s"], 1) for k, v in runs.items()},
                  "passes": {str(k).lower(): v["passes"] for k, v in runs.items()}})


if __name__ == "__main__":
    main()
