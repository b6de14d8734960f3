"""What a user's input costs before any compute: memory of `--plan` against the length of one calibration record, and
the time of fallback glob matching against the number of patterns at Kimi-K3's scale (issue 52).

    python bench/input_bounds.py [--record-mb 10 100]

Each `--plan` runs in its own process on the tiny Kimi-K3 (W4A8 practice, one image record of "word " * n and a
text record); its peak RSS is that child's. The globs: 400 `*...w1` patterns over the ~250k routed-expert linear
names of 93 layers x 896 experts, through processor/globs.py (compiled) and one expression of them (before).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generated_checkpoint, machine, print_result  # noqa: E402

from msmodelslim.processor.globs import any_match  # noqa: E402


def plan_peak_gb(model: Path, folder: Path, record_mb: float) -> float:
    """Peak RSS of `msmodelslim quant --plan` with a calibration set holding one record of `record_mb` MB."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "images").mkdir(parents=True)
    shutil.copy(ROOT / "lab_calib" / "calibImages" / "images" / "bar_chart.png", folder / "images")
    words = max(1, int(record_mb * 1e6 / 5))
    with open(folder / "index.jsonl", "w") as f:
        f.write(json.dumps({"image": "images/bar_chart.png", "text": "word " * words}) + "\n")
        f.write(json.dumps({"text": "A short text record."}) + "\n")
    script = ("import resource, sys; from msmodelslim.cli.main import main; code = main(sys.argv[1:]); "
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", script, "quant", "--model_path", str(model), "--save_path",
                          str(folder.parent / "out"), "--device", "cpu", "--model_type", "Kimi-K3", "--quant_type",
                          "w4a8", "--trust_remote_code", "True", "--calibration_dataset", str(folder), "--plan",
                          "--log_level", "error"], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 2**20


def glob_seconds() -> dict[str, float]:
    names = [f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
             for layer in range(93) for e in range(896) for w in ("w1", "w2", "w3")]
    globs = [f"*layers.{layer}.block_sparse_moe.experts.{e}.w1" for layer in range(80) for e in range(5)]
    start = time.perf_counter()
    compiled = sum(any_match(name, globs) for name in names)
    middle = time.perf_counter()
    expression = re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs))
    one = sum(expression.match(name) is not None for name in names)
    end = time.perf_counter()
    assert compiled == one == len(globs)
    return {"linears": len(names), "patterns": len(globs), "compiled_s": round(middle - start, 2),
            "one_expression_s": round(end - middle, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record-mb", type=float, nargs="+", default=[10.0, 100.0])
    args = parser.parse_args()
    model = generated_checkpoint("tiny")
    peaks = {}
    with tempfile.TemporaryDirectory(prefix="bench-input-") as tmp:
        for mb in [0.0001, *args.record_mb]:
            peaks[f"{mb:g}MB"] = round(plan_peak_gb(model, Path(tmp) / "calib", mb), 3)
            print(f"--plan with a {mb:g} MB record: peak RSS {peaks[f'{mb:g}MB']} GB", flush=True)
    globs = glob_seconds()
    print(f"{globs['patterns']} patterns over {globs['linears']} names: {globs['compiled_s']} s compiled, "
          f"{globs['one_expression_s']} s as one expression", flush=True)
    print_result({"bench": "input_bounds", "machine": machine(), "plan_peak_rss_gb": peaks, **globs,
                  "max_rss_gb_self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)})


if __name__ == "__main__":
    main()
