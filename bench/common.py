"""Shared helpers of the benchmarks: generated checkpoints are cached under bench_out/."""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys
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
        subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--preset", preset, "--out", str(out),
                        "--seed", str(seed)], check=True)
    return out


def peak_rss_gb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def machine() -> str:
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()} {torch.get_num_threads()} threads, {cuda}, torch {torch.__version__}"


def print_result(result: dict) -> None:
    """The JSON line every benchmark prints last."""
    print(json.dumps(result, sort_keys=True), flush=True)
