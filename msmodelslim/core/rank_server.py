"""The server CPU ranks fork from: multiprocessing's forkserver, which imports torch, transformers and fla once
(~12 s: importing fla alone takes seconds per process) and forks each rank from that state. Accelerator ranks are
spawned clean instead, because a forked CUDA / NPU runtime is unusable. Imports nothing heavy itself: the command
line starts the server before it imports torch."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

PRELOAD = ["torch", "transformers", "fla.modules", "fla.ops.kda", "msmodelslim.model.kimi_k3.adapter"]
_TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # under torchrun each rank is a process of its own (core/torchrun.py)


def start() -> None:
    """Start the server now, if it is not running: its imports then run while this process reads the practice,
    the checkpoint's headers and the calibration data, not after them. The ranks inherit the server's environment,
    which is this process's at this call: set what they read (the log level) before."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()


def wanted(device: str) -> bool:
    """Whether `--device` asks this process to start several CPU ranks (`cpu:0,1`; not under torchrun). A guess
    from the text alone, before the device list is checked: a wrong guess costs a server started for nothing or
    started later, never a different run."""
    kind, _, indices = device.partition(":")
    return kind.strip().lower() == "cpu" and indices.count(",") >= 1 and _TORCHRUN_ENV not in os.environ
