"""Perplexity cost of a quantization recipe, measured the way a user checks a result: `msmodelslim eval` on the
written AscendV1 output.

Protocol (issue #4): the checkpoint's tokenizer without special tokens, non-overlapping 512-token windows of
../shared/data/text/python_tutorial.txt, the first 32; ppl_bf16 is the MXFP4-dequantised model, ppl_quant the
output simulated at inference precision (int8 per-token activations, the written integer weights). Besides the
perplexity delta: the KL divergence of the quantized model's next-token distribution from the original's and their
top-1 agreement, each with a standard error over the windows (msmodelslim eval), which separate practices whose
perplexity deltas are within noise.

    python bench/accuracy.py --model ../shared/models/kimi-linear-mini --recipe {rtn,quarot,iter_smooth,full,w4a4}
    python bench/accuracy.py --practice kimi_linear_w4a8_mxfp      # a shipped practice of lab_practice/kimi_k3

MX practices (Ascend 950) are simulated as their kernels compute: MXFP8 / MXFP4 activations per block of 32, the
written MX weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_OUT, ROOT, SHARED, machine, print_result  # noqa: E402

PRACTICES = ROOT / "lab_practice" / "kimi_k3"
RECIPES = PRACTICES / "recipes"


def msmodelslim(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "msmodelslim.cli.main", *args], capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env})
    if done.returncode:
        raise SystemExit(f"msmodelslim {args[0]} failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(SHARED / "models" / "kimi-linear-mini"))
    p.add_argument("--model_type", default="Kimi-Linear")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--recipe", default="full", help=f"a YAML in {RECIPES} (name without .yaml)")
    which.add_argument("--practice", help=f"a YAML in {PRACTICES} (name without .yaml)")
    p.add_argument("--dataset", nargs="+", default=[str(SHARED / "data" / "text" / "python_tutorial.txt")],
                   help="texts to evaluate on, each on its own (the first is the one the JSON's top level reports)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    return p


def measure(args: argparse.Namespace) -> dict:
    """Quantize with the recipe or practice, then evaluate the output on each dataset; the JSON of `main`."""
    if args.practice:
        args.recipe = args.practice
    practice = (PRACTICES if args.practice else RECIPES) / f"{args.recipe}.yaml"
    if not practice.is_file():
        raise SystemExit(f"{args.recipe}: no {practice}")
    out = BENCH_OUT / f"accuracy-{Path(args.model).name}-{args.recipe}"
    shutil.rmtree(out, ignore_errors=True)
    stats_file = BENCH_OUT / f"accuracy-{args.recipe}.stats"
    start = time.perf_counter()
    msmodelslim("quant", "--model_path", args.model, "--save_path", str(out), "--device", args.device,
                "--model_type", args.model_type, "--config_path", str(practice), "--trust_remote_code", "True",
                "--fresh", env={"MSMODELSLIM_STATS_FILE": str(stats_file)})  # a killed run's state: start over
    quant_s = time.perf_counter() - start
    stages = json.loads(Path(f"{stats_file}.rank0").read_text())  # seconds per runner stage and processor
    texts = {}
    for dataset in args.dataset:
        start = time.perf_counter()
        line = msmodelslim("eval", "--model_path", args.model, "--quant_path", str(out), "--dataset", dataset,
                           "--device", args.device, "--seq-len", str(args.seq_len), "--max-windows",
                           str(args.windows), "--model_type", args.model_type, "--trust_remote_code", "True", "--json")
        result = json.loads(line.strip().splitlines()[-1])
        texts[Path(dataset).name] = {
            "windows": result["windows"], "tokens": result["tokens"],
            "ppl_bf16": round(result["ppl_orig"], 4), "ppl_quant": round(result["ppl_quant"], 4),
            "delta_pct": round(result["delta_pct"], 3),
            # a standard error needs two windows (eval gives None for one)
            **{key: None if result[src] is None else round(result[src], 5) for key, src in (
                ("delta_pct_se", "ppl_delta_se"), ("kl", "kl"), ("kl_se", "kl_se"), ("top1", "top1"),
                ("top1_se", "top1_se"))},
            "eval_s": round(time.perf_counter() - start, 1)}
    return {
        "bench": "accuracy", "model": Path(args.model).name, "recipe": args.recipe, "device": args.device,
        "machine": machine(), **texts[Path(args.dataset[0]).name], "texts": texts, "quant_s": round(quant_s, 1),
        "process_s": {k.split(".", 1)[1]: round(v, 1) for k, v in sorted(stages.items()) if k.startswith("process.")},
        "output_mib": round(sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20, 2),
    }


def main() -> None:
    print_result(measure(parser().parse_args()))


if __name__ == "__main__":
    main()
