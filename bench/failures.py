"""Reliability table: every fault of test/reliability/faults.py, run as a user runs it (a `msmodelslim quant`
subprocess on a broken copy of the tiny stand-in), with its exit status, its error line, the seconds it took to
fail and what it left behind (in the save directory's parent, and msmodelslim-failures-* or torch's
pytorch-errorfile-* in its TMPDIR).

Targets (issue 17): every case exits 2 with one `msmodelslim: error:` line, leaves nothing, fails in < 15 s.

    python bench/failures.py [--cases a,b,...] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generated_checkpoint, machine, print_result  # noqa: E402

sys.path.insert(0, str(ROOT / "test"))
from reliability.faults import FAULTS  # noqa: E402


def run_case(name: str, source: Path, root: Path) -> dict:
    fault, _ = FAULTS[name]
    case_dir = root / name
    model, workspace, tmp = case_dir / "model", case_dir / "work", case_dir / "tmp"
    shutil.copytree(source, model)
    workspace.mkdir()
    tmp.mkdir()
    extra = fault(model, workspace)
    before = set(os.listdir(workspace))
    cmd = [sys.executable, "-m", "msmodelslim.cli.main", "quant", "--model_path", str(model), "--save_path",
           str(workspace / "out"), "--device", "cpu", "--model_type", "Kimi-K3", "--trust_remote_code", "True"]
    if "--config_path" not in extra:
        cmd += ["--quant_type", "w4a8"]
    start = time.perf_counter()
    proc = subprocess.run(cmd + extra, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(tmp)})
    seconds = time.perf_counter() - start
    errors = [line for line in proc.stderr.splitlines() if line.startswith("msmodelslim: error: ")]
    left = sorted(set(os.listdir(workspace)) - before) + [p for p in os.listdir(tmp) if p.startswith(("msmodelslim-", "pytorch-errorfile-"))]
    message = errors[0][len("msmodelslim: error: "):] if errors else proc.stderr.strip().splitlines()[-1:]
    return {"case": name, "exit": proc.returncode, "error_lines": len(errors),
            "traceback": "Traceback" in proc.stderr, "seconds": round(seconds, 2), "left": left,
            "message": str(message).replace(str(case_dir), "<case>")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(sorted(FAULTS)))
    ap.add_argument("--markdown", action="store_true", help="also print the table for BENCHMARKS.md")
    args = ap.parse_args()
    source = generated_checkpoint("tiny")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-failures-") as root:
        for name in args.cases.split(","):
            rows.append(run_case(name, source, Path(root)))
            print(f"{name}: exit {rows[-1]['exit']} in {rows[-1]['seconds']} s: {rows[-1]['message']}", flush=True)
    if args.markdown:
        print("| case | exit | s | left | message |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['case']} | {r['exit']} | {r['seconds']:.1f} | {', '.join(r['left']) or '-'} | "
                  f"{r['message'][:110]} |")
    good = [r for r in rows if r["exit"] == 2 and r["error_lines"] == 1 and not r["traceback"] and not r["left"]]
    print_result({"bench": "failures", "machine": machine(), "cases": len(rows), "clean_exit_2": len(good),
                  "max_seconds_to_fail": max(r["seconds"] for r in rows),
                  "slowest_case": max(rows, key=lambda r: r["seconds"])["case"],
                  "leaks": sum(bool(r["left"]) for r in rows), "rows": rows})


if __name__ == "__main__":
    main()
