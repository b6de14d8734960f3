"""The layer-wise runner: the loop over units, on one device or as one rank of a data-parallel group.

Per unit: load (with `background`, the next unit loads in the background, behind the propagate forward) ->
processors in YAML order (the runner answers what each asks for: statistics from calibration passes, reductions,
jobs shared over ranks, the Hessians carried from one processor's pass to a later one; `answers.py`) -> forward
the processed unit over the samples to make the next unit's inputs (quantization errors propagate as at inference;
every unit but the last, since MTP layers follow the head) -> save -> free. The services around that loop are
hooks (pipeline/hooks.py): the savers, the quant report, the resumable state, the spill of the samples' state, the
per-pass profile; the runner owns the loop, the passes, the finite checks, the stage timing and every collective.

A sample here is a micro-batch (`assembly.micro_batches`). Between units the samples' state (hidden states,
attention-residual blocks, MTP inputs) lives on the host, and an accelerator holds one micro-batch of it at a time:
at a million calibration tokens that state is hundreds of GB, the device's share of it stays one forward's, and past
a host budget a hook keeps it in files read back memory-mapped (pipeline/spill.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.pipeline.answers import Carried, UnitContext, finished, kinds_of, recording, run_processor
from msmodelslim.pipeline.assembly import first_places, observed_now, steps_with
from msmodelslim.pipeline.finite import finite_later, first_non_finite_module, non_finite_error
from msmodelslim.pipeline.hooks import UnitHook
from msmodelslim.pipeline.impact import ImpactProbe
from msmodelslim.pipeline.spill import map_state
from msmodelslim.processor.base import OutputExtras, Processor
from msmodelslim.serving.linear_plan import LinearPlan

logger = logging.getLogger(__name__)


@dataclass
class RunStats:
    """Seconds per stage summed over units (loading in the background, load counts only the time spent waiting for a
    unit); `process.<type>` splits the process stage by processor (a type listed twice is summed), and within it
    `observe.<type>` (calibration passes with their reductions), `reduce.<type>` and `jobs.<type>` (its heavy
    work, collectives included) say where that time went."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    passes: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # forwards over the samples, per unit
    # each unit's wall, from waiting for its load to its hooks' `unit_done` (what a model's layer count multiplies;
    # the run's end, `loop_done` and the output's publication, is once per run)
    unit_seconds: dict[str, float] = field(default_factory=dict)
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


@dataclass(frozen=True)
class Schedule:
    """What the run does when: `steps` lock-step sample slots (ranks with fewer samples idle through the
    collectives; None: one per sample), the calibration tokens of each place of the global dealing order
    (`assembly.place_tokens`), from which a capped statistics pass picks its samples (None: such a pass sees every
    sample), and the run's linear plan (serving/linear_plan.py), which each unit's context carries to the processors
    (None: each linear_quant selects by its own globs, as a processor run alone does)."""

    steps: int | None = None
    place_tokens: Sequence[int] | None = None
    plan: LinearPlan | None = None


class LayerWiseRunner:
    def __init__(self, adapter: ModelAdapter, processors: Sequence[Processor], hooks: Sequence[UnitHook] = (),
                 dist: DistContext = SINGLE, schedule: Schedule = Schedule(), background: bool = True) -> None:
        self.adapter = adapter
        self.processors = list(processors)
        self.hooks = list(hooks)  # the services around each unit (pipeline/hooks.py), called in this order
        self.dist = dist
        self.schedule = schedule
        # load the next unit and write the resumable state in background threads while a unit computes (off on a
        # CPU device, where those threads compete with the compute for the same cores)
        self.background = background
        self.stats = RunStats()
        self.position = 0  # the unit being processed: its index in adapter.units()
        self._step = 0  # this rank's sample in progress
        self._places: dict[int, set[int] | None] = {}  # first_places by token cap
        self._pass_kind = "calibrate"  # who asked for the pass being run (the profile's label)
        self.progress_label = "quantizing"  # the progress bar's (an evaluation's runner says so)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
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

    def _steps(self, states: list[dict[str, Any]]) -> int:
        return self.schedule.steps if self.schedule.steps is not None else len(states)

    def _run_samples(self, unit: Unit, module: nn.Module, states: list[dict[str, Any]],
                     keep: bool, only: set[int] | None = None) -> list[dict[str, Any]]:
        with contextlib.ExitStack() as passes:
            for hook in self.hooks:
                passes.enter_context(hook.pass_context(self._pass_kind))
            return self._forward_samples(unit, module, states, keep, only)

    def _statistics_pass(self, unit: Unit, module: nn.Module, states: list[dict[str, Any]],
                         tokens: int | None = None) -> None:
        """A pass for a processor's statistics (no state kept): over every sample, or over those of the first
        `tokens` calibration tokens of the global order (the steps where some rank forwards one)."""
        self._run_samples(unit, module, states, keep=False,
                          only=steps_with(self._first_places(tokens), self._steps(states), self.dist.world_size))

    def _first_places(self, tokens: int | None) -> set[int] | None:
        """The places of the samples of the first `tokens` calibration tokens (None: every sample)."""
        place_tokens = self.schedule.place_tokens
        if tokens is None or place_tokens is None:
            return None
        if tokens not in self._places:
            self._places[tokens] = first_places(place_tokens, tokens)
        return self._places[tokens]

    def _forward_samples(self, unit: Unit, module: nn.Module, states: list[dict[str, Any]],
                         keep: bool, only: set[int] | None) -> list[dict[str, Any]]:
        """One pass over the samples (`only`: these steps, the same on every rank, else all). With `keep` the pass
        is the unit's last over its inputs and makes the next unit's: each input state leaves `states` (the
        runner's own list) once its outputs are found finite, one sample later, so the old and the new states
        together stay about one state's size (unless a resumable state still being written holds the old ones)."""
        device = self.dist.device
        self.stats.passes[unit.name] += 1
        outputs: list[dict[str, Any]] = []
        unread: deque[tuple[int, Callable[[], bool]]] = deque()  # (step, its outputs' finite flag) not read yet
        bad: list[int] = []

        def settle(step: int, finite: Callable[[], bool]) -> None:
            if not finite():
                bad.append(step)
            elif keep:
                states[step] = None  # read no more: its memory (pinned blocks) goes to the new states

        if keep:
            for hook in self.hooks:
                hook.start_keeping()
        with torch.no_grad(), heap_for_temporaries():
            for step in range(self._steps(states)):
                if only is not None and step not in only:
                    continue
                self._step = step
                if step < len(states):
                    copies = HostCopies()
                    out = self.adapter.forward_unit(unit, module, copies.to_device(self._loaded(states[step]), device))
                    unread.append((step, finite_later(out)))  # every pass: statistics must never see a NaN
                    if keep:
                        host = copies.to_host(out)
                        for hook in self.hooks:
                            host = hook.keep(self, step, host)
                        outputs.append(host)
                        while len(unread) > 1:  # the previous sample's flag, on the host by now
                            settle(*unread.popleft())
                else:
                    self.adapter.idle_unit(unit, module)
        while unread:
            settle(*unread.popleft())
        if keep and device.type != "cpu":
            synchronize(device)  # the host copies of the outputs are complete
        if bad:
            culprit = first_non_finite_module(module, lambda: self.adapter.forward_unit(
                unit, module, HostCopies().to_device(self._loaded(states[bad[0]]), device)))
            raise non_finite_error(unit.name, bad[0], culprit,
                                   next((p.dtype for p in module.parameters()), torch.float32))
        return outputs

    def _loaded(self, state: Any) -> Any:
        """A sample's state as the forward takes it (a spilled one read back)."""
        for hook in self.hooks:
            state = hook.load(state)
        return state

    def run(self, samples: list[dict[str, Any]]) -> RunStats:
        return_freed_tensors_to_os()
        units = self.adapter.units()
        first, states = 0, [dict(s) for s in samples]
        for hook in self.hooks:
            restored = hook.restore(self)
            if restored is not None:
                first, states = restored
                logger.info("resuming after unit %s (%d of %d done)", units[first - 1].name, first, len(units))
        loader = UnitLoader(self, units)
        bar = tqdm(total=len(units), initial=first, desc=self.progress_label, unit="unit", disable=not self.dist.is_main,
                   dynamic_ncols=True)
        try:
            loader.start(first)
            for i in range(first, len(units)):
                unit, last = units[i], i + 1 == len(units)
                started = time.perf_counter()
                bar.set_postfix_str(unit.name)
                with self.stage("load"):  # (in the background: the wait for it)
                    module = loader.take()
                self._process(unit, module, states)
                # the next unit loads behind the propagate forward, not beside the processors, whose Hessians,
                # token samples and GPTQ batches make the device's peak (a full-size K3 layer: +8.4 GiB there)
                loader.start(i + 1)
                states = self._propagate(i, unit, module, states, last)
                with self.stage("save"):  # (on accelerators the shards' writes go on behind the next unit)
                    for hook in self.hooks:
                        hook.save_unit(unit, module)
                with self.stage("free"):
                    self.adapter.free_unit(unit, module)
                    release_cached_memory(self.dist.device)  # the next unit's different shapes reuse none of these
                for hook in self.hooks:
                    hook.unit_done(self, i, states, last)
                self.stats.unit_seconds[unit.name] = time.perf_counter() - started
                bar.update(1)
                logger.debug("unit %s done", unit.name)
            for hook in self.hooks:
                hook.loop_done(self)
        finally:
            bar.close()
            loader.close()
            for hook in self.hooks:
                hook.close()
        self._publish()
        return self.stats

    def _context(self, unit: Unit, module: nn.Module, states: list[dict[str, Any]]) -> UnitContext:
        return UnitContext(unit, module, self.adapter, self.dist,
                           run_samples=lambda: self._statistics_pass(unit, module, states),
                           run_first=lambda tokens: self._statistics_pass(unit, module, states, tokens),
                           within_first=lambda tokens: observed_now(self._first_places(tokens), self._step, self.dist),
                           keep_replaced=next((h.keep_replaced for h in self.hooks if h.keep_replaced), None),
                           plan=self.schedule.plan)

    def _process(self, unit: Unit, module: nn.Module, states: list[dict[str, Any]]) -> None:
        """The processors in YAML order, each request answered (pipeline/answers.py)."""
        t0 = time.perf_counter()
        ctx = self._context(unit, module, states)
        carried = Carried()  # Hessians a pass gathered for a later processor of this unit
        for k, processor in enumerate(self.processors):
            self._pass_kind = processor.name
            t1 = time.perf_counter()
            run_processor(processor, ctx, stage=lambda kind, p=processor.name: self.stage(f"{kind}.{p}"),
                          following=self.processors[k + 1:], carried=carried)
            self.stats.add(f"process.{processor.name}", time.perf_counter() - t1)
        self.stats.add("process", time.perf_counter() - t0)

    def _propagate(self, index: int, unit: Unit, module: nn.Module, states: list[dict[str, Any]],
                   last: bool) -> list[dict[str, Any]]:
        """The forward that makes the next unit's inputs (quantization errors propagate as at inference), the hooks'
        statistics read off it (`UnitHook.observe`); the last unit feeds nothing and is forwarded only for a hook
        that reads its outputs, or for those statistics over the samples they observe."""
        for probe in filter(None, (hook.probe() for hook in self.hooks)):
            with self.stage("impact"):
                self._probe(unit, module, states, probe)
        asked = [(hook, request) for hook in self.hooks
                 if (request := hook.observe(unit, module)) is not None and request.modules()]
        with self.stage("calibrate"):
            self.position = index
            self._pass_kind = "calibrate"
            ctx = self._context(unit, module, states)
            kinds = [kinds_of(ctx, request) for _, request in asked]
            with contextlib.ExitStack() as recordings:
                for (_, request), request_kinds in zip(asked, kinds):
                    recordings.enter_context(recording(ctx, request, request_kinds))
                if not last or any(hook.reads_outputs(unit) for hook in self.hooks):
                    states = self._run_samples(unit, module, states, keep=True)
                elif asked:
                    tokens = [request.tokens for _, request in asked]
                    only = None if None in tokens else set().union(
                        *(steps_with(self._first_places(t), self._steps(states), self.dist.world_size)
                          for t in tokens))
                    self._run_samples(unit, module, states, keep=False, only=only)
            observed = [(hook, finished(ctx, request_kinds)) for (hook, _), request_kinds in zip(asked, kinds)]
        for hook, stats in observed:
            hook.observed(self, unit, module, stats)
        for hook in self.hooks:
            hook.propagated(self, index, unit, last)
        return states

    def _probe(self, unit: Unit, module: nn.Module, states: list[dict[str, Any]], probe: ImpactProbe) -> None:
        """A hook's probe (pipeline/impact.py): on the steps of its samples, its variants of the unit over each
        sample's inputs (an idle rank takes part in each variant's collectives); no state is kept, and the few
        capped samples are no calibration pass."""
        variants = probe.start(unit)
        if not variants:
            return
        device = self.dist.device
        probe.on_device(device)
        steps = self._steps(states)
        places = self._first_places(probe.tokens)
        only = steps_with(places, steps, self.dist.world_size)
        with torch.no_grad(), heap_for_temporaries():
            for step in range(steps):
                if only is not None and step not in only:
                    continue
                self._step = step
                if step < len(states):
                    inputs = HostCopies().to_device(self._loaded(states[step]), device)
                    probe.measure(module, lambda inputs=inputs: self.adapter.forward_unit(unit, module, inputs),
                                  inputs, counted=observed_now(places, step, self.dist))
                else:
                    for _ in range(variants):
                        self.adapter.idle_unit(unit, module)
        probe.finish()

    def _publish(self) -> None:
        """Every rank's part on disk, then rank 0 completes the output (the processors' description entries and
        extra files with it); no rank returns before it is complete."""
        metadata: dict[str, Any] = {}
        extras = OutputExtras()
        for processor in self.processors:
            metadata.update(processor.describe())
            extras.update(processor.extras())
        with self.stage("save"):
            self.dist.barrier()
            for hook in self.hooks:
                hook.finish_rank()
            self.dist.barrier()  # every rank's part is on disk
            if self.dist.is_main:
                for hook in self.hooks:
                    hook.publish(metadata, extras)
            self.dist.barrier()


class UnitLoader:
    """Units loaded in order: with `background`, the next one loads in a thread while a unit computes (the thread
    binds the rank's device once, else its work lands on device 0)."""

    def __init__(self, run: LayerWiseRunner, units: list[Unit]) -> None:
        self.run, self.units = run, units
        device = run.dist.device
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch", initializer=bind_device,
                                       initargs=(device,)) if run.background else None
        self.pending: Future | nn.Module | None = None

    def _load(self, i: int) -> Future | nn.Module:
        if self.pool is None:
            with self.run.stage("load"):
                return self.run.adapter.load_unit(self.units[i], self.run.dist.device)
        return self.pool.submit(self._load_in_thread, self.units[i])

    def _load_in_thread(self, unit: Unit) -> nn.Module:
        with ascend_check.watching():
            return self.run.adapter.load_unit(unit, self.run.dist.device)

    def start(self, i: int) -> None:
        """Unit `i` starts loading (there is one)."""
        if i < len(self.units):
            self.pending = self._load(i)

    def take(self) -> nn.Module:
        """The unit started last, loaded (in the background: waited for)."""
        module, self.pending = self.pending, None
        return module.result() if isinstance(module, Future) else module

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


class HostCopies:
    """One sample's state moved to the device and its unit's outputs moved back. An output tensor that is one of the
    inputs' device copies, unchanged, goes back as the host tensor it came from: no copy back and no second host
    copy. Kimi-K3's finished attention-residual blocks, MTP inputs and token ids pass through a unit untouched
    (~126 of its 140 KiB per token), so only the new hidden state is copied back."""

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
