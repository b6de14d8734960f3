"""Shared helpers of the benchmarks: generated checkpoints are cached under bench_out/."""

from __future__ import annotations

import json
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH_OUT = ROOT / "bench_out"
SHARED = ROOT.parent / "shared"
MAKE_CHECKPOINT = ROOT / "example" / "multimodal_vlm" / "Kimi-K3" / "make_checkpoint.py"


def generated_checkpoint(preset: str, seed: int = 0) -> Path:
    """A stand-in Kimi-K3 checkpoint of `preset`, generated once and reused."""
    out = BENCH_OUT / f"Kimi-K3-{preset}-s{seed}"
    if not (out / "model.safetensors.index.json").is_file():
        shutil.rmtree(out, ignore_errors=True)  # what a generation that failed left behind
        subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--preset", preset, "--out", str(out),
                        "--seed", str(seed)], check=True)
    return out


def peak_rss_gb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def machine() -> str:
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()} {torch.get_num_threads()} threads, {cuda}, torch {torch.__version__}"


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points (two points: the line through them; more
    damp the noise of any one run)."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return slope, mean_y - slope * mean_x


def timed(fn, device: torch.device, repeats: int, warmup: bool = False) -> tuple[float, object]:
    """(the best wall time of `fn()` over `repeats` calls, each synchronized on `device`; its last result), after
    one untimed call with `warmup`."""
    from msmodelslim.core.device import synchronize

    out = fn() if warmup else None
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best, out


def print_result(result: dict) -> None:
    """The JSON line every benchmark prints last."""
    print(json.dumps(result, sort_keys=True), flush=True)


def shrunken_practice(source: Path, dest: Path, max_samples: int | None = None,
                      max_seq_len: int | None = None, dataset: Path | None = None,
                      spec: dict | None = None) -> Path:
    """A shipped practice with a smaller (or another) calibration set (same processors), other spec keys set."""
    import yaml

    practice = yaml.safe_load(source.read_text())
    if dataset is not None:
        practice["spec"]["dataset"] = str(dataset)
    if max_samples:
        practice["spec"]["max_samples"] = max_samples
    if max_seq_len:
        practice["spec"]["max_seq_len"] = max_seq_len
    practice["spec"].update(spec or {})  # other spec keys (micro_batch_tokens, report_tokens, ...)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(practice, sort_keys=False))
    return dest


def package_tree(tree: str | None) -> None:
    """`tree` (another copy of the package for a side-by-side run) checked before any run: a copy made of the
    package folder alone lacks the resources it reads at start (config/, lab_practice/, lab_calib/ beside setup.py),
    and would fail after the current tree's runs have spent a device call's minutes."""
    if tree is None:
        return
    from msmodelslim.core.resources import RESOURCE_KINDS

    root = Path(tree)
    missing = [kind for kind in RESOURCE_KINDS if not ((root / "setup.py").is_file() and (root / kind).is_dir())
               and not (root / "msmodelslim" / "resources" / kind).is_dir()]
    if not (root / "msmodelslim" / "__init__.py").is_file() or missing:
        sys.exit(f"bench: {tree} is no runnable copy of the package (missing: "
                 f"{', '.join(missing) or 'msmodelslim/'}); make one with `git archive REV | tar -x -C {tree}`")


def run_quant(model: Path, out: Path, device: str, practice: Path, model_type: str = "Kimi-K3",
              extra_env: dict | None = None, tree: str | Path | None = None) -> dict:
    """`msmodelslim quant` in a subprocess; returns {"wall_s", "ranks": [per-rank stage stats]}. `tree`: run another
    copy of the package (e.g. `git archive` of an older commit). It becomes the working directory, because
    `python -m` puts the working directory before $PYTHONPATH: from this checkout, its own package would run."""
    import os
    import shutil
    import time

    shutil.rmtree(out, ignore_errors=True)
    stats = out.parent / f".{out.name}.stats"
    for old in out.parent.glob(f"{stats.name}.rank*"):
        old.unlink()
    env = {**os.environ, "MSMODELSLIM_STATS_FILE": str(stats), **(extra_env or {})}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tree).resolve()), *env.get("PYTHONPATH", "").split(os.pathsep)])
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "msmodelslim.cli.main", "quant", "--model_path", str(model), "--save_path", str(out), "--device", device,
                    "--model_type", model_type, "--config_path", str(practice), "--trust_remote_code", "True"],
                   check=True, env=env, cwd=None if tree is None else str(tree))
    wall = time.perf_counter() - start
    ranks = [json.loads(p.read_text()) for p in sorted(out.parent.glob(f"{stats.name}.rank*"))]
    return {"wall_s": wall, "ranks": ranks}
