"""Accuracy side by side, with error bars (issue 51): every shipped W4A8 / W4A4 / W8A8 practice of kimi-linear-mini,
upstream's linear selection, the RTN baselines and the calibration options, each quantized once and evaluated on the
public text and on a held-out one that no practice was tuned on.

Per row and text (`bench/accuracy.py`'s `measure`, i.e. `msmodelslim eval --json` on the written output): KL of the
quantized model's next-token distribution from the float model's (mean over windows +- its standard error), top-1
agreement +- SE, the perplexity delta +- SE (from the paired per-window losses). Two rows differ significantly when
their KLs are more than 2 combined SEs apart, sqrt(se_a^2 + se_b^2): conservative, because both rows are measured on
the same windows, whose shared difficulty a paired test would cancel.

The held-out text: the GNU GPL v3 as Debian ships it (/usr/share/common-licenses/GPL-3, ~5,600 words of legal
English: another domain than python_tutorial.txt, the calibration and tuning text of every practice here).

    python bench/accuracy_table.py [--rows w4a8,rtn] [--windows 16] [--held-out PATH]

Prints one JSON line per row as it finishes, the tables, and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import measure, parser  # noqa: E402
from common import SHARED, machine, print_result  # noqa: E402

PUBLIC = SHARED / "data" / "text" / "python_tutorial.txt"
HELD_OUT = Path("/usr/share/common-licenses/GPL-3")
# row -> (practice or recipe, its YAML's name); the first row is the one the others are compared with
ROWS = {
    "w4a8 (shipped)": ("practice", "kimi_linear_w4a8"),
    "w4a8 upstream's selection": ("practice", "kimi_linear_w4a8_upstream"),
    "w4a8 per group (0.26)": ("practice", "kimi_linear_w4a8_pergroup"),
    "w4a8c8 (shipped)": ("practice", "kimi_linear_w4a8c8"),
    "w4a8 MX (shipped, Ascend 950)": ("practice", "kimi_linear_w4a8_mxfp"),
    "w4a8 calibrate_all_experts": ("recipe", "calibrate_all_experts"),
    "w4a8 affinity_guided_experts": ("recipe", "affinity_guided_experts"),
    "w4a8 balanced_experts": ("recipe", "balanced_experts"),
    "w4a8 RTN": ("recipe", "rtn"),
    "w4a4": ("recipe", "w4a4"),
    "w4a4 RTN": ("recipe", "w4a4_rtn"),
    "w4a4 MX (shipped, Ascend 950)": ("practice", "kimi_linear_w4a4c8_mxfp"),
    "w8a8 (shipped)": ("practice", "kimi_linear_w8a8"),
}


def significant(a: dict, b: dict, key: str = "kl") -> bool | None:
    if a.get(f"{key}_se") is None or b.get(f"{key}_se") is None:
        return None
    return abs(a[key] - b[key]) > 2 * math.hypot(a[f"{key}_se"], b[f"{key}_se"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=None, help="comma-separated YAML names of ROWS to run, in that order (default: all)")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--held-out", default=str(HELD_OUT))
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    by_name = {spec[1]: label for label, spec in ROWS.items()}
    unknown = [n for n in (args.rows or "").split(",") if n and n not in by_name]
    if unknown:
        p.error(f"--rows: {unknown[0]} is none of {', '.join(by_name)}")
    rows = ROWS if args.rows is None else {by_name[n]: ROWS[by_name[n]] for n in args.rows.split(",")}  # its order
    texts = [str(PUBLIC), args.held_out]
    results: dict[str, dict] = {}
    for label, (kind, name) in rows.items():
        argv = [f"--{kind}", name, "--dataset", *texts, "--windows", str(args.windows), "--device", args.device]
        results[label] = measure(parser().parse_args(argv))
        print(json.dumps({"row": label, "texts": results[label]["texts"]}), flush=True)
    first = next(iter(results))
    for text in (Path(t).name for t in texts):
        print(f"\n{text}  (vs '{first}': * = KL more than 2 combined SEs apart)")
        print(f"{'row':34s} {'KL x1e3':>16s} {'top-1 %':>14s} {'ppl delta %':>16s}")
        for label, r in results.items():
            t = r["texts"][text]
            mark = "*" if label != first and significant(t, results[first]["texts"][text]) else " "
            print(f"{label:34s} {1e3 * t['kl']:8.2f} +- {1e3 * t['kl_se']:5.2f}{mark} "
                  f"{100 * t['top1']:6.2f} +- {100 * t['top1_se']:4.2f} "
                  f"{t['delta_pct']:+7.3f} +- {t['delta_pct_se']:5.3f}")
    print_result({"bench": "accuracy_table", "machine": machine(), "device": args.device, "windows": args.windows,
                  "texts": [Path(t).name for t in texts],
                  "rows": {label: {"yaml": rows[label][1], "texts": r["texts"], "quant_s": r["quant_s"],
                                   "output_mib": r["output_mib"]} for label, r in results.items()},
                  "significant_vs_first_kl": {label: {text: significant(r["texts"][text], results[first]["texts"][text])
                                                      for text in r["texts"]}
                                              for label, r in results.items() if label != first}})


if __name__ == "__main__":
    main()
