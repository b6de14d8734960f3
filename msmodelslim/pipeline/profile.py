"""$MSMODELSLIM_PROFILE (benchmarks only): where a calibration pass spends its time.

Each pass over the samples runs under its own torch.profiler, so the trace holds the forwards and their statistics' hooks
and not the quantization jobs (GPTQ's column loops are hundreds of thousands of small operators per full-size layer
and made a whole-run profile outlast a device call). Per pass kind (the processor that asked for it, or `calibrate`)
the file gives the wall time, the device kernels launched and their time, and the operators by device and host time.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

from msmodelslim.core.device import synchronize

PROFILE_ENV = "MSMODELSLIM_PROFILE"  # a file prefix: `<prefix>.rank<r>`
# set too: `<prefix>.rank<r>.where`, each pass kind's host time by operator and the two innermost calling functions
# of this package or the model's code (Python stacks recorded: a slower profile)
WHERE_ENV = "MSMODELSLIM_PROFILE_WHERE"
_OWN_CODE = ("msmodelslim", "modeling")  # frames that name a place worth changing
# Operators that only make a new view of a tensor (no device kernel): left out of the leaf count
_METADATA_OPS = frozenset({"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::slice", "aten::select",
                           "aten::t", "aten::transpose", "aten::permute", "aten::expand", "aten::unsqueeze",
                           "aten::squeeze", "aten::as_strided", "aten::detach", "aten::alias", "aten::empty",
                           "aten::empty_strided", "aten::resize_", "aten::lift_fresh", "aten::split",
                           "aten::unbind", "aten::narrow", "aten::chunk", "aten::result_type", "aten::item",
                           "aten::_local_scalar_dense", "aten::is_nonzero", "aten::expand_as", "aten::view_as",
                           "aten::numpy_T", "aten::contiguous", "aten::_reshape_alias", "detach"})


class PassProfiler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.walls: dict[str, float] = defaultdict(float)
        self.passes: dict[str, int] = defaultdict(int)
        # per pass kind, per operator: [calls, host microseconds, device microseconds]
        self.ops: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0.0]))
        self.kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # per pass kind: [launches, device us]
        # per pass kind: leaf operators that compute (no operator below them, not a view): on an accelerator about
        # one kernel launch each, so a CPU run counts the launches a pass would make there
        self.leaves: dict[str, int] = defaultdict(int)
        # per pass kind: "caller < caller's caller operator" -> [host us, calls]
        self.where: dict[str, dict[str, list[float]]] | None = defaultdict(lambda: defaultdict(lambda: [0.0, 0])) \
            if os.environ.get(WHERE_ENV) else None

    @contextlib.contextmanager
    def profiled(self, kind: str) -> Iterator[None]:
        activities = [torch.profiler.ProfilerActivity.CPU] + \
            ([torch.profiler.ProfilerActivity.CUDA] if self.on_gpu else [])
        synchronize(self.device)
        start = time.perf_counter()
        with torch.profiler.profile(activities=activities, with_stack=self.where is not None) as prof:
            yield
            synchronize(self.device)
        self.walls[kind] += time.perf_counter() - start
        self.passes[kind] += 1
        self.leaves[kind] += sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU
                                 and not e.cpu_children and e.name not in _METADATA_OPS)
        if self.where is not None:
            self._record_where(kind, prof.events())
        for event in prof.key_averages():
            device_us = float(getattr(event, "self_device_time_total", 0.0))
            if event.device_type == torch.autograd.DeviceType.CUDA:  # a kernel (or a device copy / memset)
                self.kernels[kind][0] += event.count
                self.kernels[kind][1] += device_us
                continue
            if ".py(" in event.key or event.key.startswith("<built-in"):  # a Python frame (WHERE_ENV): no operator
                continue
            row = self.ops[kind][event.key]
            row[0] += event.count
            row[1] += float(event.self_cpu_time_total)
            row[2] += device_us

    def _record_where(self, kind: str, events: list) -> None:
        for event in events:
            if event.cpu_children or not event.name.startswith("aten::"):
                continue
            callers, frame = [], event.cpu_parent
            while frame is not None and len(callers) < 2:
                if ".py(" in frame.name and any(part in frame.name for part in _OWN_CODE):
                    callers.append(frame.name.rsplit("/", 1)[-1])
                frame = frame.cpu_parent
            row = self.where[kind][f"{' < '.join(callers) or '?'} {event.name}"]
            row[0] += event.self_cpu_time_total
            row[1] += 1

    def write(self, path: Path, top: int = 25) -> None:
        lines = []
        for kind in sorted(self.walls, key=self.walls.get, reverse=True):
            launches, device_us = self.kernels[kind]
            host_us = sum(r[1] for r in self.ops[kind].values())
            lines.append(f"== {kind}: {self.passes[kind]} passes, wall {self.walls[kind]:.3f} s, host operators "
                         f"{host_us / 1e6:.3f} s, {self.leaves[kind]} leaf operators, {int(launches)} device kernels taking "
                         f"{device_us / 1e6:.3f} s")
            rows = sorted(self.ops[kind].items(), key=lambda kv: (kv[1][2], kv[1][1]), reverse=True)[:top]
            lines.append(f"{'operator':<60} {'calls':>9} {'host s':>9} {'device s':>9}")
            lines += [f"{name[:60]:<60} {int(r[0]):>9} {r[1] / 1e6:>9.4f} {r[2] / 1e6:>9.4f}" for name, r in rows]
            by_host = sorted(self.ops[kind].items(), key=lambda kv: kv[1][1], reverse=True)[:10]
            lines.append("  by host time: " + ", ".join(f"{n} {r[1] / 1e6:.3f} s ({int(r[0])})" for n, r in by_host))
            by_calls = sorted(self.ops[kind].items(), key=lambda kv: kv[1][0], reverse=True)[:15]
            lines.append("  by calls: " + ", ".join(f"{n} {int(r[0])}" for n, r in by_calls))
        path.write_text("\n".join(lines) + "\n")
        if self.where is not None:
            where = []
            for kind, places in self.where.items():
                where.append(f"== {kind}: host seconds and calls by operator and its callers")
                where += [f"{us / 1e6:9.3f} {int(calls):>8} {place}" for place, (us, calls) in
                          sorted(places.items(), key=lambda kv: kv[1][0], reverse=True)[:2 * top]]
                where.append(f"-- {kind}: by calls")
                where += [f"{us / 1e6:9.3f} {int(calls):>8} {place}" for place, (us, calls) in
                          sorted(places.items(), key=lambda kv: kv[1][1], reverse=True)[:2 * top]]
            Path(f"{path}.where").write_text("\n".join(where) + "\n")


def pass_profiler(device: torch.device) -> PassProfiler | None:
    return PassProfiler(device) if os.environ.get(PROFILE_ENV) else None


def write_profile(profiler: PassProfiler | None, rank: int) -> None:
    if profiler is not None:
        profiler.write(Path(f"{os.environ[PROFILE_ENV]}.rank{rank}"))
