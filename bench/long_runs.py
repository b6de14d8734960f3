"""What long runs cost: `--plan`, the resumable state, a resume after a kill, and torchrun against the built-in
launcher, side by side on one machine in one sitting.

1. `--plan` on the preset: seconds (headers only).
2. A full run on `--device` (the built-in launcher): wall, the seconds each rank spent keeping its state
   (`resume_state` in the runner's statistics) as a share of the runner's wall, and the largest size the state
   folder reached (polled every 0.2 s).
3. The same run killed (SIGKILL of the main process) once the middle unit is logged done, then `--resume`: the
   resumed run's wall and whether the output equals run 2's file for file.
4. torchrun with as many processes on this host: wall, and the same output check.

Usage: python bench/long_runs.py [--preset small --device cpu:0,1 --max-samples 8 --max-seq-len 256
                                  --steps plan,full,resume,torchrun]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_OUT, ROOT, generated_checkpoint, machine, print_result, shrunken_practice  # noqa: E402


def quant_cmd(model: Path, save: Path, device: str, practice: Path, *extra: str) -> list[str]:
    return ["-m", "msmodelslim.cli.main", "quant", "--model_path", str(model), "--save_path", str(save), "--device",
            device, "--model_type", "Kimi-K3", "--config_path", str(practice), "--trust_remote_code", "True", *extra]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def timed(cmd: list[str], watch: Path | None = None, stats: Path | None = None, kill_after: str | None = None
          ) -> dict:
    """Run `cmd`; poll the size of `watch`; with `kill_after`, SIGKILL the main process when that unit is done."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"MSMODELSLIM_STATS_FILE": str(stats)} if stats else {})}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd + (["--log_level", "debug"] if kill_after else []), env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0

    def read() -> None:
        for line in proc.stderr:
            if kill_after and line.rstrip().endswith(f"unit {kill_after} done"):
                proc.kill()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        if watch is not None:
            peak = max(peak, folder_bytes(watch))
        time.sleep(0.2)
    reader.join(10)
    return {"code": proc.returncode, "wall_s": time.perf_counter() - start, "peak_state_bytes": peak}


def same_files(a: Path, b: Path) -> bool:
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    return files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file()) and all(
        (a / f).read_bytes() == (b / f).read_bytes() for f in files)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cpu:0,1")
    p.add_argument("--max-samples", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--steps", default="plan,full,resume,torchrun", help="which of the four to run (full is needed "
                                                                        "by the others)")
    args = p.parse_args()
    steps = set(args.steps.split(","))
    model = generated_checkpoint(args.preset)
    practice = shrunken_practice(ROOT / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml", BENCH_OUT / "long_runs.yaml",
                                 args.max_samples, args.max_seq_len)
    work = BENCH_OUT / "long_runs"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    python = [sys.executable]
    world = len(args.device.split(":")[1].split(",")) if ":" in args.device else 1

    result = {"bench": "long_runs", "machine": machine(), "preset": args.preset, "device": args.device,
              "calibration": f"{args.max_samples} samples, max_seq_len {args.max_seq_len}"}
    if "plan" in steps:
        plan = timed(python + quant_cmd(model, work / "plan", args.device, practice, "--plan"))
        result.update(plan_s=round(plan["wall_s"], 2), plan_ok=plan["code"] == 0)

    full, stats = work / "full", work / "full.stats"
    run = timed(python + quant_cmd(model, full, args.device, practice), watch=work / ".full.partial" / "resume",
                stats=stats)
    ranks = [json.loads(Path(f"{stats}.rank{r}").read_text()) for r in range(world)]
    keep_s = max(r.get("resume_state", 0.0) + r.get("resume_flush", 0.0) for r in ranks)
    runner_s = max(r["runner_wall"] for r in ranks)
    result.update(full_run_wall_s=round(run["wall_s"], 1), runner_s=round(runner_s, 1), keep_state_s=round(keep_s, 2),
                  keep_state_share=round(keep_s / runner_s, 4),
                  peak_state_mib=round(run["peak_state_bytes"] / 2**20, 1),
                  output_mib=round(sum(f.stat().st_size for f in full.rglob("*") if f.is_file()) / 2**20, 1))
    if "resume" in steps:
        middle, resumed = "layers.3", work / "resumed"
        killed = timed(python + quant_cmd(model, resumed, args.device, practice), kill_after=middle)
        time.sleep(2)  # the ranks' watchdogs notice the dead main process
        again = timed(python + quant_cmd(model, resumed, args.device, practice, "--resume"))
        result.update(killed_after=middle, killed_code=killed["code"], killed_at_s=round(killed["wall_s"], 1),
                      resume_wall_s=round(again["wall_s"], 1),
                      resumed_equals_full=again["code"] == 0 and same_files(full, resumed))
    if "torchrun" in steps:
        launched = work / "torchrun"
        torchrun = timed(python + ["-m", "torch.distributed.run", "--nproc-per-node", str(world)]
                         + quant_cmd(model, launched, args.device.split(":")[0], practice))
        result.update(torchrun_wall_s=round(torchrun["wall_s"], 1), builtin_wall_s=round(run["wall_s"], 1),
                      torchrun_equals_builtin=torchrun["code"] == 0 and same_files(full, launched))
    print_result(result)


if __name__ == "__main__":
    main()
