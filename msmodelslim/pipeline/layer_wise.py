"""The layer-wise runner: the loop over units, on one device or as one rank of a data-parallel group.

Per unit: load (with `background`, the next unit loads in the background) -> processors in YAML order (the runner
answers what each asks for: statistics from calibration passes, reductions, jobs shared over ranks; `answers.py`)
-> forward the processed unit over the samples to make the next unit's inputs (quantization errors propagate as at
inference; every unit but the last, since MTP layers follow the head), with the quant report's observers on its
quantized linears (pipeline/report.py) -> save -> free
-> keep the resumable state (with `background`, written while the next unit computes).

A sample here is a micro-batch (`assembly.micro_batches`). Between units the samples' state (hidden states,
attention-residual blocks, MTP inputs) lives on the host, and an accelerator holds one micro-batch of it at a time:
at a million calibration tokens that state is hundreds of GB, the device's share of it stays one forward's, and past
a host budget the runner keeps it in files read back memory-mapped (pipeline/spill.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from msmodelslim.core import ascend_check
from msmodelslim.core.device import (
    bind_device,
    peak_device_bytes,
    release_cached_memory,
    reset_peak_device_bytes,
    synchronize,
)
from msmodelslim.core.dist import SINGLE, DistContext
from msmodelslim.core.memory import heap_for_temporaries, return_freed_tensors_to_os
from msmodelslim.core.placement import to_host
from msmodelslim.errors import UserError
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.pipeline.answers import UnitContext, run_processor
from msmodelslim.pipeline.assembly import first_places, observed_now, steps_with
from msmodelslim.pipeline.finite import all_finite, first_non_finite_module, non_finite_error
from msmodelslim.pipeline.profile import PassProfiler
from msmodelslim.pipeline.report import QuantReport
from msmodelslim.pipeline.resume import ResumeState
from msmodelslim.pipeline.spill import Spilled, StateSpill, map_state, state_bytes
from msmodelslim.processor.base import OutputExtras, Processor

logger = logging.getLogger(__name__)


@dataclass
class RunStats:
    """Seconds per stage summed over units (loading in the background, load counts only the time spent waiting for a
    unit); `process.<type>` splits the process stage by processor (a type listed twice is summed), and within it
    `observe.<type>` (calibration passes with their reductions), `reduce.<type>` and `jobs.<type>` (its heavy
    work, collectives included) say where that time went."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    passes: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # forwards over the samples, per unit
    # the most device memory held (GiB) in each stage that is not made of others, and over the run (accelerators)
    peaks: dict[str, float] = field(default_factory=dict)
    peak: float | None = None

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] += seconds

    def held(self, stage: str | None, peak_bytes: int | None) -> None:
        """The device's peak since the last reset: within `stage`, or between stages (None)."""
        if peak_bytes is None:
            return
        gib = peak_bytes / 2**30
        self.peak = max(self.peak or 0.0, gib)
        if stage is not None:
            self.peaks[stage] = max(self.peaks.get(stage, 0.0), gib)


class LayerWiseRunner:
    def __init__(self, adapter: ModelAdapter, processors: Sequence[Processor], savers: Sequence[Any],
                 dist: DistContext = SINGLE, background: bool = True, steps: int | None = None,
                 resume: ResumeState | None = None, resume_after: int | None = None,
                 report: QuantReport | None = None, spill: StateSpill | None = None,
                 profiler: PassProfiler | None = None, place_tokens: Sequence[int] | None = None,
                 resume_every: int = 1) -> None:
        self.adapter = adapter
        self.processors = list(processors)
        self.savers = list(savers)
        self.dist = dist
        # load the next unit and write the resumable state in background threads while a unit computes (off on a
        # CPU device, where those threads compete with the compute for the same cores)
        self.background = background
        # Number of lock-step sample slots; ranks with fewer samples idle through the collectives.
        self.steps = steps
        self.stats = RunStats()
        self.resume = resume  # where each finished unit's state is kept (pipeline/resume.py), if anywhere
        self.resume_after = resume_after  # continue after this unit, from its kept state
        self.resume_every = resume_every  # keep the resumable state after every this many units (and the last)
        self.report = report  # the quant report (pipeline/report.py), collected during the forwards
        self.spill = spill  # where the samples' state goes past the host budget (pipeline/spill.py), if anywhere
        self.profiler = profiler  # each pass's operators ($MSMODELSLIM_PROFILE, benchmarks), if anything
        # the calibration tokens of each place of the global dealing order (`assembly.place_tokens`), from which
        # a capped statistics pass picks its samples; None: such a pass sees every sample
        self.place_tokens = place_tokens
        self._step = 0  # this rank's sample in progress
        self._observed: set[int] | None = None  # the places a capped statistics pass observes
        self._position = 0  # the unit being processed: its index in adapter.units()
        self._pass_kind = "calibrate"  # who asked for the pass being run (the profile's label)
        self._writer: ThreadPoolExecutor | None = None  # writes the resumable state behind the compute
        self._writing: Future | None = None

    @contextlib.contextmanager
    def _stage(self, name: str) -> Iterator[None]:
        """Time a stage (the device synchronized at its end) and record the most device memory held in it. The
        device keeps one peak counter: it starts over with each stage, and what came between two stages goes into
        the run's peak."""
        device = self.dist.device
        self.stats.held(None, peak_device_bytes(device))
        reset_peak_device_bytes(device)
        start = time.perf_counter()
        yield
        synchronize(device)
        self.stats.add(name, time.perf_counter() - start)
        self.stats.held(name, peak_device_bytes(device))

    def _run_samples(self, unit: Unit, module: nn.Module, states: list[dict[str, Any]],
                     keep: bool, only: set[int] | None = None) -> list[dict[str, Any]]:
        if self.profiler is None:
            return self._forward_samples(unit, module, states, keep, only)
        with self.profiler.profiled(self._pass_kind):
            return self._forward_samples(unit, module, states, keep, only)

    def _statistics_pass(self, unit: Unit, module: nn.Module, states: list[dict[str, Any]],
                         tokens: int | None = None) -> None:
        """A pass for a processor's statistics (no state kept): over every sample, or over those of the first
        `tokens` calibration tokens of the global order (the steps where some rank forwards one)."""
        places = None if tokens is None or self.place_tokens is None else first_places(self.place_tokens, tokens)
        steps = self.steps if self.steps is not None else len(states)
        self._observed = places
        try:
            self._run_samples(unit, module, states, keep=False, only=steps_with(places, steps, self.dist.world_size))
        finally:
            self._observed = None

    def _forward_samples(self, unit: Unit, module: nn.Module, states: list[dict[str, Any]],
                         keep: bool, only: set[int] | None) -> list[dict[str, Any]]:
        """One pass over the samples (`only`: these steps, the same on every rank, else all)."""
        steps = self.steps if self.steps is not None else len(states)
        device = self.dist.device
        self.stats.passes[unit.name] += 1
        outputs, finite, forwarded = [], [], []
        kept = 0
        with torch.no_grad(), heap_for_temporaries():
            for step in range(steps):
                if only is not None and step not in only:
                    continue
                self._step = step
                if self.report is not None:
                    self.report.observe_step(step)  # (an idle rank's experts still compute the others' tokens)
                if step < len(states):
                    copies = HostCopies()
                    out = self.adapter.forward_unit(unit, module, copies.to_device(self._loaded(states[step]), device))
                    finite.append(all_finite(out))  # every pass: observers must never see a NaN
                    forwarded.append(step)
                    if keep:
                        host = copies.to_host(out)
                        if self.spill is not None:
                            kept += state_bytes(host)
                            if kept > self.spill.budget and device.type != "cpu":
                                synchronize(device)  # the asynchronous host copy, complete before it is written
                            host = self.spill.keep(self._position, step, host, kept)
                        outputs.append(host)
                else:
                    self.adapter.idle_unit(unit, module)
        if keep and device.type != "cpu":
            synchronize(device)  # the host copies of the outputs are complete
        flags = [f for f in finite if f is not None]
        bad = [step for step, flag in zip(forwarded, finite) if flag is not None and not bool(flag)] \
            if flags and not bool(torch.stack(flags).all()) else []  # one read of the flags per pass
        if bad:
            culprit = first_non_finite_module(module, lambda: self.adapter.forward_unit(
                unit, module, HostCopies().to_device(self._loaded(states[bad[0]]), device)))
            raise non_finite_error(unit.name, bad[0], culprit,
                                   next((p.dtype for p in module.parameters()), torch.float32))
        return outputs

    def _loaded(self, state: Any) -> Any:
        """A sample's state as the forward takes it (a spilled one read back)."""
        return state if self.spill is None else self.spill.load(state)

    def _keep_state(self, index: int, states: list[dict[str, Any]]) -> None:
        """Snapshot what the rest of the run depends on and write it, in line or in the background: there the next
        unit computes while unit `index`'s file is written (the states are never changed in place, only replaced)
        and the runner waits only for the previous write, so a run spends on its resumable state what the disk
        cannot hide."""
        self._wait_for_state()
        if self.spill is not None:  # the spilled states no kept unit refers to any more (nor this one's inputs)
            self.spill.drop_before(index, keep=set(self.resume.latest(self.dist.rank)))
        snapshot = {
            "states": states,
            "savers": [saver.resume_state() for saver in self.savers],
            "processors": [processor.resume_state() for processor in self.processors],
            "report": None if self.report is None else self.report.resume_state(),
        }
        shards = {file: digest for saver in self.savers for file, digest in saver.written_files().items()}
        if self.background:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resume-state")
            self._writing = self._writer.submit(self.resume.save, self.dist.rank, index, snapshot, shards)
        else:
            self.resume.save(self.dist.rank, index, snapshot, shards)

    def _wait_for_state(self) -> None:
        """The write in flight, finished (its failure raised here)."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def _restore(self) -> list[dict[str, Any]]:
        kept = self.resume.load(self.dist.rank, self.resume_after)
        for saver, state in zip(self.savers, kept["savers"], strict=True):
            saver.restore_state(state)
        for processor, state in zip(self.processors, kept["processors"], strict=True):
            processor.restore_state(state)
        if self.report is not None and kept.get("report") is not None:
            self.report.restore_state(kept["report"])
        for state in kept["states"]:  # spilled states: their files as they were written (names and sizes)
            missing = state.missing() if isinstance(state, Spilled) else None
            if missing is not None:
                raise UserError(f"{missing}: a spilled calibration state of the resumable state is missing or "
                                f"damaged; discard it with --fresh")
        return kept["states"]  # on the host (or spilled), where the runner keeps them

    def run(self, samples: list[dict[str, Any]]) -> RunStats:
        return_freed_tensors_to_os()
        units = self.adapter.units()
        device = self.dist.device
        first = 0
        if self.resume_after is not None:
            states = self._restore()
            first = self.resume_after + 1
            logger.info("resuming after unit %s (%d of %d done)", units[self.resume_after].name, first, len(units))
        else:
            states = [dict(s) for s in samples]
        # the prefetch thread binds the rank's device once (else its work lands on device 0)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch", initializer=bind_device,
                                  initargs=(device,)) if self.background else None

        def load_in_thread(unit: Unit) -> nn.Module:
            with ascend_check.watching():
                return self.adapter.load_unit(unit, device)

        def load(i: int) -> Future | nn.Module:
            if pool is None:
                with self._stage("load"):
                    return self.adapter.load_unit(units[i], device)
            return pool.submit(load_in_thread, units[i])

        bar = tqdm(total=len(units), initial=first, desc="quantizing", unit="unit", disable=not self.dist.is_main,
                   dynamic_ncols=True)
        pending = load(first) if first < len(units) else None
        try:
            for i, unit in enumerate(units):
                if i < first:
                    continue
                bar.set_postfix_str(unit.name)
                with self._stage("load"):  # (in the background: the wait for it)
                    module = pending.result() if isinstance(pending, Future) else pending
                if i + 1 < len(units):
                    pending = load(i + 1)

                t0 = time.perf_counter()
                ctx = UnitContext(unit, module, self.adapter, self.dist,
                                  run_samples=lambda u=unit, m=module, s=states: self._statistics_pass(u, m, s),
                                  run_first=lambda tokens, u=unit, m=module, s=states:
                                  self._statistics_pass(u, m, s, tokens),
                                  observing=lambda: observed_now(self._observed, self._step, self.dist))
                for k, processor in enumerate(self.processors):
                    self._pass_kind = processor.name
                    t1 = time.perf_counter()
                    run_processor(processor, ctx, stage=lambda kind, p=processor.name: self._stage(f"{kind}.{p}"),
                                  following=self.processors[k + 1:])
                    self.stats.add(f"process.{processor.name}", time.perf_counter() - t1)
                self.stats.add("process", time.perf_counter() - t0)

                with self._stage("calibrate"):
                    watched = self.report.watch(module) if self.report is not None else []
                    self._position = i
                    self._pass_kind = "calibrate"
                    if i + 1 < len(units):
                        states = self._run_samples(unit, module, states, keep=True)
                        if self.spill is not None and self.resume is None:
                            self.spill.drop_before(i)  # the inputs of this unit are needed no more
                    elif watched:  # the last unit's outputs feed nothing: forwarded for the report alone
                        self._run_samples(unit, module, states, keep=False,
                                          only=self.report.steps_observed(
                                              self.steps if self.steps is not None else len(states)))
                if watched:
                    with self._stage("report"):
                        self.report.finish_unit(unit, watched)

                with self._stage("save"):
                    for saver in self.savers:
                        saver.save_unit(unit, module)
                    self.adapter.free_unit(unit, module)
                    release_cached_memory(device)  # the next unit's different shapes reuse none of these blocks
                if self.resume is not None and ((i + 1) % self.resume_every == 0 or i + 1 == len(units)):
                    # after the last unit no unit reads the samples' states: a resume there only finishes the
                    # output (Kimi-K3 at 1M tokens: ~30 GB per rank written and waited for, for nothing)
                    with self._stage("resume_state"):
                        self._keep_state(i, states if i + 1 < len(units) else [])
                bar.update(1)
                logger.debug("unit %s done", unit.name)
            with self._stage("resume_state"):
                self._wait_for_state()
            if self.spill is not None and self.resume is None:
                self.spill.close()  # (with resumable state the files go when it is dropped)
        finally:
            bar.close()
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            if self._writer is not None:  # a failed run keeps the last unit it finished writing
                wait([self._writing] if self._writing is not None else [])
                self._writer.shutdown(wait=True)

        metadata: dict[str, Any] = {}
        extras = OutputExtras()
        for processor in self.processors:
            metadata.update(processor.describe())
            extras.update(processor.extras())
        with self._stage("save"):
            self.dist.barrier()
            for saver in self.savers:
                saver.finish_rank()
            if self.report is not None:
                self.report.finish_rank()
            self.dist.barrier()  # every rank's part is on disk
            if self.dist.is_main:
                if self.resume is not None:
                    self.resume.invalidate()  # the merge renames the shards the state counts: it resumes no more
                for saver in self.savers:
                    saver.merge(metadata, extras)
                if self.report is not None:
                    self.report.merge()
            self.dist.barrier()  # no rank returns before the output is complete
        return self.stats


class HostCopies:
    """One sample's state moved to the device and its unit's outputs moved back. An output tensor that is one of the
    inputs' device copies, unchanged, goes back as the host tensor it came from: no copy back and no second host
    copy. Kimi-K3's finished attention-residual blocks, MTP inputs and token ids pass through a unit untouched
    (~110 of its 126 KiB per token), so only the new hidden state is copied back."""

    def __init__(self) -> None:
        self._sources: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id(copy) -> (copy, host, version)

    def to_device(self, state: Any, device: torch.device) -> Any:
        """`state` on the run's device (a no-op on the host; from pinned memory the copy is asynchronous),
        remembering each copy's host tensor."""
        def move(t: torch.Tensor, _path: tuple) -> torch.Tensor:
            copy = t.to(device, non_blocking=True)
            self._sources[id(copy)] = (copy, t, copy._version)  # the copy is held: its id stays its own
            return copy

        return map_state(state, move)

    def to_host(self, state: Any) -> Any:
        """A unit's outputs on the host (from CUDA into pinned memory, asynchronously: the pass synchronizes once),
        an input's tensor the unit returned as it was (not written in place) as its host tensor."""
        def back(t: torch.Tensor, _path: tuple) -> torch.Tensor:
            source = self._sources.get(id(t))
            if source is not None and source[0] is t and t._version == source[2]:
                return source[1]
            return to_host(t)

        return map_state(state, back)
