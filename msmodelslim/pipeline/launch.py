"""The launch: one validated request -> one layer-wise run per device (spawned ranks, or the ranks torchrun
started), with the rendezvous, a watchdog on the main process and the first failing rank's error.

Every rank takes a share of the calibration set (data parallel) and of the routed experts (expert parallel), so a
multi-device run produces the single-device bytes. What each rank runs is assembled in `pipeline/assembly.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

from msmodelslim.core import ascend_check, rank_server
from msmodelslim.core.calib import practice_records
from msmodelslim.core.device import DeviceSpec, bind_device
from msmodelslim.core.dist import DistContext
from msmodelslim.core.files import disk_full_error
from msmodelslim.errors import RankLost, ResumableError, UserError
from msmodelslim.log import configure_logging
from msmodelslim.model.base import ModelAdapter
from msmodelslim.pipeline.assembly import place_tokens, prepare_run, split_samples
from msmodelslim.pipeline.hooks import service_hooks
from msmodelslim.pipeline.impact import ImpactProbe
from msmodelslim.pipeline.layer_wise import LayerWiseRunner, Schedule
from msmodelslim.pipeline.profile import pass_profiler, write_profile
from msmodelslim.pipeline.report import QuantReport
from msmodelslim.pipeline.resume import ResumeState
from msmodelslim.pipeline.spill import SPILL_DIR, StateSpill, host_budget
from msmodelslim.source.checkpoint import source_identity

logger = logging.getLogger(__name__)

STATS_ENV = "MSMODELSLIM_STATS_FILE"
NO_REPORT_ENV = "MSMODELSLIM_BENCH_NO_REPORT"  # "1": no quant report (benchmarks time the report's cost with it)
RENDEZVOUS_TIMEOUT_ENV = "MSMODELSLIM_RENDEZVOUS_TIMEOUT"  # seconds the ranks wait for each other at start
DEFAULT_RENDEZVOUS_TIMEOUT = 600.0  # ranks importing torch_npu on a busy host can take minutes to arrive
_STOP_GRACE_S = 5.0  # after SIGTERM, how long a rank may take to die before it is killed


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: MASTER_ADDR / MASTER_PORT when the environment presets them, else loopback and a
    free port. A rank that cannot reach it within `timeout_s` fails with a message instead of hanging."""

    addr: str
    port: int
    timeout_s: float
    preset: bool

    @classmethod
    def from_environment(cls) -> Rendezvous:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        raw = os.environ.get(RENDEZVOUS_TIMEOUT_ENV, str(DEFAULT_RENDEZVOUS_TIMEOUT))
        try:
            timeout = float(raw)
            if not 0 < timeout < 1e6:
                raise ValueError
        except ValueError:
            raise UserError(f"${RENDEZVOUS_TIMEOUT_ENV}={raw!r}: expected a positive number of seconds") from None
        if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
            raise UserError(f"$MASTER_PORT={port!r}: expected a TCP port number (1-65535)")
        return cls(addr or "127.0.0.1", int(port) if port else _free_port(), timeout, bool(addr or port))

    def describe(self) -> str:
        origin = "from MASTER_ADDR/MASTER_PORT" if self.preset else "loopback, free port"
        return f"{self.addr}:{self.port} ({origin})"


@dataclass
class QuantRequest:
    model_path: Path
    work_dir: Path
    device: DeviceSpec
    adapter_cls: type[ModelAdapter]
    practice: Any  # core.config.PracticeConfig
    trust_remote_code: bool
    background: bool = True  # load the next unit, write the shards and the resumable state behind the compute
    records: list[Any] | None = None  # calibration records, already loaded and checked by the app
    source: dict[str, str] | None = None  # source.checkpoint.source_identity of model_path, when the app has it
    # what the ranks remove should the main process die without cleaning up (the app's lock file)
    orphan_cleanup: tuple[Path, ...] = ()
    ascend_check: bool = False  # MSMODELSLIM_ASCEND_CHECK of the launching process (ranks may start elsewhere)
    resume_after: int | None = None  # continue after this unit from the state kept in work_dir
    report_only: bool = False  # `msmodelslim analyze`: the quant report alone, no weights, no resumable state


def background_threads(request: QuantRequest, device: torch.device) -> bool:
    """Whether the run loads the next unit and writes its shards and resumable state in background threads.

    On a CPU device a background thread competes with the compute for the same cores, which stalls torch's
    intra-op threads: on the 2-core host the background load made a run 3x slower to hide 0.2 s of load, and the
    background resumable-state write cost ~3 s of a 32 s run where writing in line costs ~1 s."""
    return request.background and device.type != "cpu"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_process_group(backend: str, rank: int, world: int, device: torch.device, meet: Rendezvous) -> None:
    try:
        store = torch_dist.TCPStore(meet.addr, meet.port, world, is_master=rank == 0,
                                    timeout=timedelta(seconds=meet.timeout_s), wait_for_workers=True)
    except (RuntimeError, OSError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
        raise UserError(f"rank {rank} of {world}: no rendezvous at {meet.describe()} within {meet.timeout_s:g} s "
                        f"({' '.join(str(exc).split())[:200]}); unset MASTER_ADDR/MASTER_PORT or point them at "
                        f"this host") from None
    torch_dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                  device_id=device if device.type != "cpu" else None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a dead process its parent has not reaped yet
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


_told_resumable = threading.Event()  # the watchdog and the exit path may both get here: say it once


def _remove_orphaned_output(paths: list[Path], work_dir: Path, world: int, rank: int) -> None:
    """Remove what a dead main process left, except resumable state (the temporary output of a run in which every
    rank finished a unit), which rank 0 then announces: nobody else is left to say how to use it."""
    keep = ResumeState(work_dir).resume_point(world) is not None
    for path in paths:
        if path == work_dir and keep:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if keep and rank == 0 and not _told_resumable.is_set():
        _told_resumable.set()
        print(f"msmodelslim: the main process died; the run can be resumed: the same command with --resume "
              f"continues it, --fresh starts over (the state is in {work_dir})", file=sys.stderr, flush=True)


def _stop_with_main(main_pid: int, rank: int, cleanup: list[Path], work_dir: Path, world: int) -> None:
    """A rank outlives a killed main process only by a moment: it removes the run's temporary folders and exits, so
    no orphan goes on computing or writing into an output nobody will publish. Every rank removes them: the first
    to notice exits, and its peers may then fail in a collective before their own watchdog looks (run_worker's
    exit path removes them again for that case)."""
    def watch() -> None:
        while _alive(main_pid):
            time.sleep(0.5)
        _remove_orphaned_output(cleanup, work_dir, world, rank)
        os._exit(1)

    threading.Thread(target=watch, name="main-watchdog", daemon=True).start()


def host_threads(ranks_here: int) -> int:
    """Threads for one rank's host work (CPU compute, GPTQ's Cholesky factors, loading): the cores this process may
    run on, shared by the `ranks_here` ranks of this host. A scheduler's CPU binding, taskset or a container's cpuset
    narrows them (os.cpu_count() counts the host's: two ranks bound to one core each would run twice the threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks_here)


def run_worker(rank: int, request: QuantRequest, records: list[Any], meet: Rendezvous | None,
               failures: str | None = None, main_pid: int | None = None) -> dict[str, float]:
    """One rank of a run (rank 0 of 1 on a single device). A failing rank notes its error and the time in the
    folder `failures`, so the service can report the rank that failed first rather than a peer that only lost it."""

    spec = request.practice.spec
    world = request.device.world_size
    device = request.device.torch_device(rank)
    torchrun = request.device.torchrun  # then the launch has joined the ranks already (core/torchrun.py)
    bind_device(device)
    orphaned_output = [request.work_dir, *request.orphan_cleanup] + ([Path(failures)] if failures else [])
    if world > 1:
        configure_logging(rank=rank)  # a spawned rank starts without the CLI's logging set-up
        logger.debug("rank %d of %d: pid %d on %s", rank, world, os.getpid(), socket.gethostname())
        if main_pid is not None:
            _stop_with_main(main_pid, rank, orphaned_output, request.work_dir, world)
        torch.set_num_threads(host_threads(torchrun.local_world_size if torchrun else world))
    dist = DistContext(rank=rank, world_size=world, device=device)
    adapter = None
    try:
        if world > 1 and torchrun is None:
            _init_process_group(request.device.backend, rank, world, device, meet)
        adapter = request.adapter_cls(request.model_path, trust_remote_code=request.trust_remote_code, dist=dist)
        samples, processors, plan = prepare_run(adapter, records, spec, label=request.practice.metadata.label)
        steps = math.ceil(len(samples) / world)
        mine = split_samples(samples, rank, world)
        savers = [] if request.report_only else [step.build(adapter, request.work_dir, dist) for step in spec.save]
        background = background_threads(request, device)
        report = None if os.environ.get(NO_REPORT_ENV) == "1" and not request.report_only else \
            QuantReport(adapter, dist, request.source or source_identity(request.model_path), request.work_dir,
                        tokens=spec.report_tokens,
                        impact=None if spec.report_impact_tokens is None else
                        ImpactProbe(adapter, dist, spec.report_impact_tokens))
        resume = None if request.report_only else ResumeState(request.work_dir)
        # the samples' state past the host budget: in the resumable state (its units refer to the files), else apart
        spill = StateSpill(resume.root / f"rank{rank}" / "spill" if resume else request.work_dir / SPILL_DIR / f"rank{rank}",
                           host_budget(torchrun.local_world_size if torchrun else world))
        profiler = pass_profiler(device)
        hooks = service_hooks(savers, report, resume, request.resume_after, spec.resume_every, spill, profiler,
                              background)
        runner = LayerWiseRunner(adapter, processors, hooks, dist, Schedule(steps, place_tokens(samples), plan),
                                 background)
        start = time.perf_counter()
        checked: dict[str, int] = {}
        with ascend_check.run_checked(device, request.ascend_check, checked):
            stats = runner.run(mine)
        write_profile(profiler, rank)
        result = {**stats.seconds, **checked, "runner_wall": time.perf_counter() - start, "world_size": world,
                  "calibration_passes": dict(stats.passes), "unit_seconds": dict(stats.unit_seconds),
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        if stats.peak is not None:  # an accelerator: the most memory it held, over the run and per stage
            result["peak_device_gb"] = stats.peak
            result["peak_device_gb_by_stage"] = dict(stats.peaks)
        top = max(stats.peaks.items(), key=lambda kv: kv[1], default=None)
        peak = f"; peak device memory {stats.peak:.2f} GiB (its largest stage: {top[0]} {top[1]:.2f} GiB)" \
            if top else ""
        logger.info("rank %d finished in %.1f s (%s)%s", rank, result["runner_wall"],
                    ", ".join(f"{k} {v:.1f} s" for k, v in sorted(stats.seconds.items())), peak)
        if os.environ.get(STATS_ENV):
            # Benchmarks read per-rank stage timings and memory from here.
            Path(f"{os.environ[STATS_ENV]}.rank{rank}").write_text(json.dumps(result))
        return result
    except Exception as exc:
        full = None if isinstance(exc, UserError) else disk_full_error(request.work_dir, exc)
        user = full is not None or isinstance(exc, UserError)
        if not user and not isinstance(exc, RankLost):  # those are one line (the CLI's); anything else is a bug
            # or an environment failure and keeps its traceback
            logger.exception("rank %d of %d failed", rank, world)
        if failures:
            with contextlib.suppress(OSError):  # the folder is gone when the main process died first
                Path(failures, f"rank{rank}").write_text(json.dumps({
                    "time": time.time(), "error": f"{full or exc}", "user": user,
                    "resumable": isinstance(full or exc, ResumableError)}))
        if full is not None:
            raise full from None
        raise
    finally:
        if adapter is not None:
            adapter.close()  # the checkpoint's classes get their own code back
        if world > 1 and torchrun is None and torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        if main_pid is not None and not _alive(main_pid):  # failed because a peer left with the main process
            _remove_orphaned_output(orphaned_output, request.work_dir, world, rank)


def run_service(request: QuantRequest) -> None:
    spec = request.practice.spec
    records = request.records
    if records is None:
        records = practice_records(spec)
    world = request.device.world_size
    logger.info("%s: %d calibration records on %d device(s) (%s)", request.practice.apiversion, len(records),
                world, request.device)
    if world == 1 or request.device.torchrun:  # one rank in this process
        run_worker(request.device.torchrun.rank if request.device.torchrun else 0, request, records, None)
        return
    meet = Rendezvous.from_environment()
    logger.info("ranks meet at %s", meet.describe())
    # One process per device; every rank is stopped as soon as one fails, and when this process is interrupted
    # (SIGINT, SIGTERM) it stops them all before the temporary output is removed.
    with tempfile.TemporaryDirectory(prefix="msmodelslim-failures-") as failures:
        context = mp.start_processes(run_worker, args=(request, records, meet, failures, os.getpid()),
                                     nprocs=world, join=False, start_method=_start_method(request.device.type))
        try:
            while not context.join(timeout=0.5):
                pass
        except mp.ProcessExitedException as exc:  # killed (the OOM killer's SIGKILL) or exited without a word
            how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with status {exc.exit_code}"
            hint = " (the kernel's out-of-memory killer sends SIGKILL: `dmesg` says)" \
                if exc.signal_name == "SIGKILL" else ""
            raise RankLost(f"rank {exc.error_index} {how}{hint}") from None
        except mp.ProcessRaisedException as exc:
            first = _first_failure(Path(failures))
            if first is not None and first[2]:
                error = ResumableError if first[3] else UserError
                raise error(f"rank {first[0]}: {first[1]}") from None
            if first is not None and first[0] != exc.error_index:
                # the rank torch reports may only have lost its peer (a collective reset by the failing rank)
                raise RuntimeError(f"rank {first[0]} failed first: {first[1]}") from exc
            raise
        finally:
            _stop_ranks(context.processes)
            if (context.processes[0].exitcode or 0) < 0:
                # rank 0 draws the progress bar; killed by a signal (here or by torch's join, when another rank
                # failed) it leaves the bar's line open, and the error the CLI prints next would run on from it
                print(file=sys.stderr, flush=True)
            for error_file in context.error_files:  # torch leaves them in $TMPDIR (one per rank that failed)
                Path(error_file).unlink(missing_ok=True)


def _stop_ranks(processes: list[Any]) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after a grace period, and reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _first_failure(folder: Path) -> tuple[int, str, bool, bool] | None:
    """(rank, message, is a bad input, keeps the resumable state) of the rank that failed first."""
    notes = [(json.loads(p.read_text()), int(p.name[len("rank"):])) for p in folder.glob("rank*")]
    if not notes:
        return None
    note, rank = min(notes, key=lambda n: n[0]["time"])
    return rank, note["error"], bool(note.get("user")), bool(note.get("resumable"))


def _start_method(device_type: str) -> str:
    """CPU ranks fork from the rank server (core/rank_server.py; the command line may have started it already);
    accelerator ranks are spawned clean because a forked CUDA/NPU runtime is unusable."""
    if device_type != "cpu":
        return "spawn"
    rank_server.start()
    return "forkserver"
