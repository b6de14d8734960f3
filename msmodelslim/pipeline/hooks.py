"""The runner's services as unit-lifecycle hooks: saving, the quant report, the resumable state, the spill of the
samples' state, the per-pass profile. The runner (pipeline/layer_wise.py) owns the loop, the passes, the statistics
and every collective; at each point of a unit's life it calls every hook in the order given, and a hook does
nothing at the points it does not override.

A unit's life: `restore` (once, before the loop) -> load -> processors -> `probe` -> `observe` (the statistics a
hook reads off the forward that makes the next unit's inputs) -> per sample of every pass `load` and `keep` ->
`observed` -> `propagated` -> `save_unit` -> the unit freed -> `unit_done` -> ... -> `loop_done` -> `finish_rank` ->
`publish` (rank 0) -> `close` (always).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from torch import nn

from msmodelslim.core.device import synchronize
from msmodelslim.core.requests import Observe, Stats
from msmodelslim.errors import UserError
from msmodelslim.model.base import Unit
from msmodelslim.pipeline.impact import ImpactProbe
from msmodelslim.pipeline.profile import PassProfiler
from msmodelslim.pipeline.report import QuantReport
from msmodelslim.pipeline.resume import ResumeState
from msmodelslim.pipeline.spill import Spilled, StateSpill, state_bytes

# `run` below is the LayerWiseRunner calling the hook: its `stage(name)`, `dist`, `background`, `processors` and
# `position` (the unit in progress) are what hooks read
LayerWiseRunner = Any


class UnitHook:
    """One service of the runner; every point does nothing by default."""

    # Given to the processors as `UnitContext.keep_replaced`: the float linears they replace, for this hook's probe
    keep_replaced: Callable[[str, nn.Module], None] | None = None

    def restore(self, run: LayerWiseRunner) -> tuple[int, list[dict[str, Any]]] | None:
        """(first unit to run, the samples' states) when the run continues from kept state, else None."""
        return None

    def pass_context(self, kind: str) -> contextlib.AbstractContextManager[Any]:
        """Entered around every pass over the samples (`kind`: the processor that asked, or "calibrate")."""
        return contextlib.nullcontext()

    def load(self, state: Any) -> Any:
        """A sample's state as the forward takes it."""
        return state

    def start_keeping(self) -> None:
        """A pass whose outputs are kept begins."""

    def reads_outputs(self, unit: Unit) -> bool:
        """Whether `keep` reads this unit's outputs even where it is the last unit (whose outputs feed nothing)."""
        return False

    def keep(self, run: LayerWiseRunner, step: int, state: Any) -> Any:
        """A unit's output for the sample of `step`, on the host, as the runner keeps it."""
        return state

    def probe(self) -> ImpactProbe | None:
        """Variants of the processed unit to forward over a few samples before the forward that makes the next
        unit's inputs (pipeline/impact.py), or None."""
        return None

    def observe(self, unit: Unit, module: nn.Module) -> Observe | None:
        """Statistics of the processed unit to read off the forward that makes the next unit's inputs (no pass of
        their own; the runner records them on the samples of `Observe.tokens` and reduces them over ranks), or None.
        The last unit, whose outputs feed nothing, is forwarded for them alone, over those samples."""
        return None

    def observed(self, run: LayerWiseRunner, unit: Unit, module: nn.Module, stats: Stats) -> None:
        """What `observe` asked of `module`, reduced over ranks."""

    def propagated(self, run: LayerWiseRunner, index: int, unit: Unit, last: bool) -> None:
        """After that forward (or, on the last unit, where it would be)."""

    def save_unit(self, unit: Unit, module: nn.Module) -> None:
        """The processed unit, before it is freed."""

    def unit_done(self, run: LayerWiseRunner, index: int, states: list[dict[str, Any]], last: bool) -> None:
        """After the unit is saved and freed; `states`: the next unit's inputs."""

    def loop_done(self, run: LayerWiseRunner) -> None:
        """Every unit is done (not called when the loop failed)."""

    def close(self) -> None:
        """The loop ended, done or failed."""

    def finish_rank(self) -> None:
        """This rank's part of the output, on disk."""

    def publish(self, metadata: dict[str, Any], extras: Any) -> None:
        """Rank 0, every rank's part on disk: the output completed."""


class SaveHook(UnitHook):
    """The savers (processor/save/): each unit written as it is done (with `behind`, by a background thread while
    the next unit computes: a full-size Kimi-K3 unit's shards are ~2 GB to write and make durable), the shards
    merged at the end."""

    def __init__(self, savers: Sequence[Any], behind: bool = False) -> None:
        self.savers = list(savers)
        if behind:
            for saver in self.savers:
                saver.write_behind()

    def save_unit(self, unit: Unit, module: nn.Module) -> None:
        for saver in self.savers:
            saver.save_unit(unit, module)

    def finish_rank(self) -> None:
        for saver in self.savers:
            saver.finish_rank()

    def publish(self, metadata: dict[str, Any], extras: Any) -> None:
        for saver in self.savers:
            saver.merge(metadata, extras)

    def close(self) -> None:
        for saver in self.savers:
            saver.close()


class ReportHook(UnitHook):
    """The quant report (pipeline/report.py): the sums of a unit's quantized linears, read off its forward."""

    def __init__(self, report: QuantReport) -> None:
        self.report = report
        if report.impact is not None:
            self.keep_replaced = report.impact.keep

    def probe(self) -> ImpactProbe | None:
        return self.report.impact

    def observe(self, unit: Unit, module: nn.Module) -> Observe | None:
        return self.report.request(module)

    def observed(self, run: LayerWiseRunner, unit: Unit, module: nn.Module, stats: Stats) -> None:
        with run.stage("report"):
            self.report.finish_unit(unit, module, stats.quant_error)

    def finish_rank(self) -> None:
        self.report.finish_rank()

    def publish(self, metadata: dict[str, Any], extras: Any) -> None:
        self.report.merge()


class SpillHook(UnitHook):
    """The samples' state past the host budget kept in files and read back memory-mapped (pipeline/spill.py).
    Without a resumable state its files go as soon as no unit reads them."""

    def __init__(self, spill: StateSpill, resumable: bool) -> None:
        self.spill = spill
        self.resumable = resumable
        self._kept = 0

    def load(self, state: Any) -> Any:
        return self.spill.load(state)

    def start_keeping(self) -> None:
        self._kept = 0

    def keep(self, run: LayerWiseRunner, step: int, state: Any) -> Any:
        self._kept += state_bytes(state)
        if self._kept > self.spill.budget and run.dist.device.type != "cpu":
            synchronize(run.dist.device)  # the asynchronous host copy, complete before it is written
        return self.spill.keep(run.position, step, state, self._kept)

    def propagated(self, run: LayerWiseRunner, index: int, unit: Unit, last: bool) -> None:
        if not self.resumable and not last:
            self.spill.drop_before(index)  # the inputs of this unit are needed no more

    def loop_done(self, run: LayerWiseRunner) -> None:
        if not self.resumable:
            self.spill.close()  # (with resumable state the files go when it is dropped)


class ResumeHook(UnitHook):
    """The resumable state (pipeline/resume.py): what the rest of the run depends on, kept after every `every`
    units and after the last (written in the background with `run.background`), and the run continued from it."""

    def __init__(self, resume: ResumeState, after: int | None = None, every: int = 1,
                 savers: Sequence[Any] = (), report: QuantReport | None = None, spill: StateSpill | None = None) -> None:
        self.resume = resume
        self.after = after  # continue after this unit, from its kept state
        self.every = every
        self.savers = list(savers)
        self.report = report
        self.spill = spill
        self.writer: ThreadPoolExecutor | None = None  # writes the resumable state behind the compute
        self._writing: Future | None = None

    def restore(self, run: LayerWiseRunner) -> tuple[int, list[dict[str, Any]]] | None:
        if self.after is None:
            return None
        kept = self.resume.load(run.dist.rank, self.after)
        for saver, state in zip(self.savers, kept["savers"], strict=True):
            saver.restore_state(state)
        for processor, state in zip(run.processors, kept["processors"], strict=True):
            processor.restore_state(state)
        if self.report is not None and kept.get("report") is not None:
            self.report.restore_state(kept["report"])
        for state in kept["states"]:  # spilled states: their files as they were written (names and sizes)
            missing = state.missing() if isinstance(state, Spilled) else None
            if missing is not None:
                raise UserError(f"{missing}: a spilled calibration state of the resumable state is missing or "
                                f"damaged; discard it with --fresh")
        return self.after + 1, kept["states"]  # on the host (or spilled), where the runner keeps them

    def unit_done(self, run: LayerWiseRunner, index: int, states: list[dict[str, Any]], last: bool) -> None:
        if (index + 1) % self.every and not last:
            return
        # after the last unit no unit reads the samples' states: a resume there only finishes the output
        # (Kimi-K3 at 1M tokens: ~30 GB per rank written and waited for, for nothing). There the run waits for the
        # writes still in flight, once per run and not per unit: timed as `resume_flush`, apart from the per-unit cost
        with run.stage("resume_flush" if last else "resume_state"):
            self._keep(run, index, [] if last else states)

    def _keep(self, run: LayerWiseRunner, index: int, states: list[dict[str, Any]]) -> None:
        """Snapshot what the rest of the run depends on and write it, in line or in the background: there the next
        unit computes while unit `index`'s file is written (the states are never changed in place, only replaced)
        and the runner waits only for the previous write, so a run spends on its resumable state what the disk
        cannot hide."""
        self._wait()
        rank = run.dist.rank
        if self.spill is not None:  # the spilled states no kept unit refers to any more (nor this one's inputs)
            self.spill.drop_before(index, keep=set(self.resume.latest(rank)))
        snapshot = {
            "states": list(states),  # the runner's list loses each state as the next unit's last pass reads it
            "savers": [saver.resume_state() for saver in self.savers],
            "processors": [processor.resume_state() for processor in run.processors],
            "report": None if self.report is None else self.report.resume_state(),
        }
        shards_written = [future for saver in self.savers for future in saver.in_flight()]

        def write() -> None:
            for future in shards_written:  # the shards this state counts are durable before it is
                future.result()
            shards = {file: digest for saver, state in zip(self.savers, snapshot["savers"], strict=True)
                      for file, digest in saver.written_files(state).items()}
            self.resume.save(rank, index, snapshot, shards)

        if run.background:
            if self.writer is None:
                self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resume-state")
            self._writing = self.writer.submit(write)
        else:
            write()

    def _wait(self) -> None:
        """The write in flight, finished (its failure raised here)."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def loop_done(self, run: LayerWiseRunner) -> None:
        with run.stage("resume_flush"):
            self._wait()

    def close(self) -> None:
        if self.writer is not None:  # a failed run keeps the last unit it finished writing
            wait([self._writing] if self._writing is not None else [])
            self.writer.shutdown(wait=True)

    def publish(self, metadata: dict[str, Any], extras: Any) -> None:
        self.resume.invalidate()  # the merge renames the shards the state counts: it resumes no more


class ProfileHook(UnitHook):
    """Each pass's operators ($MSMODELSLIM_PROFILE, benchmarks: pipeline/profile.py)."""

    def __init__(self, profiler: PassProfiler) -> None:
        self.profiler = profiler

    def pass_context(self, kind: str) -> contextlib.AbstractContextManager[Any]:
        return self.profiler.profiled(kind)


def service_hooks(savers: Sequence[Any] = (), report: QuantReport | None = None, resume: ResumeState | None = None,
                  resume_after: int | None = None, resume_every: int = 1, spill: StateSpill | None = None,
                  profiler: PassProfiler | None = None, background: bool = False) -> list[UnitHook]:
    """The hooks of a quantization run, in the order their points must run: the resumable state is invalidated
    before the savers merge; the savers write a unit before the report's rank part. With `background` the savers
    write behind the compute (the runner's `background`: off on a CPU device, whose cores the compute needs)."""
    hooks: list[UnitHook] = []
    if resume is not None:
        hooks.append(ResumeHook(resume, resume_after, resume_every, savers, report, spill))
    hooks.append(SaveHook(savers, behind=background))
    if report is not None:
        hooks.append(ReportHook(report))
    if spill is not None:
        hooks.append(SpillHook(spill, resumable=resume is not None))
    if profiler is not None:
        hooks.append(ProfileHook(profiler))
    return hooks
