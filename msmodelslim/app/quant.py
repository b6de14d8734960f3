"""`msmodelslim quant`: validate the request, resolve adapter + practice, run the service, publish atomically.

The output is built in `<save_path.parent>/.<save_path.name>.partial` and moved to `save_path` with one
`os.rename` after the service succeeded and the chosen practice was written beside it; on any failure, SIGINT or
SIGTERM the ranks are stopped and the temporary directory is removed, so a crash never leaves a complete-looking
output. Once every rank has finished a unit the folder holds the run's resumable state (pipeline/resume.py)
and is kept instead: `--resume` continues it, `--fresh` discards it. A lock file beside it
(`.<save_path.name>.lock`, removed at the end) keeps a second run off the same `save_path`. Under torchrun each
process is one rank and rank 0 holds the output (`_quant_torchrun`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from msmodelslim.app.practice import ChosenPractice, choose_practice
from msmodelslim.core import torchrun
from msmodelslim.core.calib import CalibRecord, practice_records
from msmodelslim.core.config import PracticeConfig
from msmodelslim.core.device import DeviceSpec, parse_device
from msmodelslim.core.files import disk_full_error
from msmodelslim.core.signals import Stop, signals_held, sigterm_raises
from msmodelslim.core.torchrun import TorchrunRank
from msmodelslim.errors import ResumableError, UserError
from msmodelslim.model.facts import ModelFacts
from msmodelslim.model.registry import ModelEntry, load_registry
from msmodelslim.pipeline.resume import ResumeState, check_fingerprint, fingerprint, identity_difference, input_identity
from msmodelslim.processor.save.ascendv1_saver import consumer_files, missing_consumer_files
from msmodelslim.serving.profiles import profile
from msmodelslim.source.checkpoint import different_source, source_identity

logger = logging.getLogger(__name__)

DESCRIPTION_FILE = "quant_model_description.json"
NAME_MAX = 255  # bytes in one path component (Linux, most file systems)
_SUFFIX_ROOM = 40  # what the temporary and lock names add to the output's name
FILE_MODE, DIR_MODE = 0o644, 0o755  # every file and folder of a published output
_SHARED_TOKEN = ".shared-token"  # torchrun: rank 0 writes it in the temporary output, every rank must read it


@dataclass
class QuantArgs:
    model_path: str
    save_path: str
    model_type: str
    device: str = "npu"
    quant_type: str | None = None
    config_path: str | None = None
    trust_remote_code: bool = False
    tags: tuple[str, ...] = ()  # scenario tags choosing the hardware (app/practice.py)
    calibration_dataset: str | None = None  # replaces the practice's spec.dataset (msModelSlim's spelling)
    resume: bool = False  # continue the interrupted run of this save_path from its kept state
    fresh: bool = False  # discard such state and start over
    resumable: bool = True  # keep resumable state when stopped; a round of `tune` has none (tune has no --resume)
    target: str | None = None  # the serving target, written into spec.target (serving/profiles.py)


@dataclass
class QuantResult:
    save_path: Path
    practice_path: Path  # the practice that was chosen (lab_practice file or --config_path)
    practice: PracticeConfig
    model_type: str
    device: DeviceSpec
    seconds: float
    files: int
    bytes: int
    copied: list[str]  # the model directory's files a consumer needs, copied into the output
    is_main: bool = True  # False on the ranks of a torchrun job other than 0 (rank 0 publishes)


@dataclass
class _Plan:
    model_path: Path
    save_path: Path
    entry: ModelEntry
    adapter_cls: type
    chosen: ChosenPractice
    device: DeviceSpec
    records: list[CalibRecord]
    practice_data: bytes  # the practice file as it runs (`practice_bytes`): the fingerprint's and the output's copy
    source: dict[str, str]  # source_identity of model_path, read once (it samples every shard)
    inputs: dict[str, str]  # the content of every file the practice reads (`practice_inputs`)

    @property
    def identity(self) -> dict[str, Any]:
        """Everything that decides the output (pipeline/resume.py `input_identity`)."""
        return input_identity(self.source, self.practice_data, self.inputs)


def _read_model_config(model_path: Path) -> dict[str, Any]:
    if not model_path.exists():
        raise UserError(f"--model_path {model_path}: no such directory")
    if not model_path.is_dir():
        raise UserError(f"--model_path {model_path}: not a directory")
    config_file = model_path / "config.json"
    if not config_file.is_file():
        raise UserError(f"--model_path {model_path}: no config.json (expected a Hugging Face weight directory)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{config_file}: invalid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file}: expected a JSON object")
    return config


def _check_remote_code(model_path: Path, config: dict[str, Any], trust_remote_code: bool) -> None:
    auto_maps = [config.get("auto_map")] + [
        sub.get("auto_map") for sub in config.values() if isinstance(sub, dict) and "auto_map" in sub
    ]
    if not trust_remote_code and any(auto_maps):
        raise UserError(
            f"--model_path {model_path} ships its own model code (config.json auto_map); it runs only with "
            "--trust_remote_code True (check the code first)"
        )


def _check_save_path(model_path: Path, save_path: Path) -> None:
    if save_path == model_path or save_path.is_relative_to(model_path):
        raise UserError(f"--save_path {save_path} is inside --model_path {model_path}; choose a separate directory")
    if model_path.is_relative_to(save_path):
        raise UserError(f"--save_path {save_path} contains --model_path {model_path}; choose a separate directory")
    if save_path.is_symlink() or (save_path.exists() and not save_path.is_dir()):
        raise UserError(f"--save_path {save_path} exists and is not a directory")
    if len(save_path.name.encode()) > NAME_MAX:
        raise UserError(f"--save_path {save_path}: the name is {len(save_path.name.encode())} bytes; file systems "
                        f"allow {NAME_MAX}")
    if save_path.is_dir() and any(save_path.iterdir()):
        raise UserError(
            f"--save_path {save_path} exists and is not empty; remove it or choose another directory "
            "(msmodelslim never overwrites an output)"
        )


def _check_expert_split(model_path: Path, config: dict[str, Any], device: DeviceSpec) -> None:
    """Expert parallelism splits the routed experts evenly; refuse an uneven split before any process starts."""
    num_experts = ModelFacts.from_config(config).num_experts
    if device.world_size > 1 and num_experts and num_experts % device.world_size:
        raise UserError(
            f"{model_path / 'config.json'}: num_experts={num_experts} is not divisible by the "
            f"{device.world_size} devices of --device {device}; choose a device count that divides {num_experts}"
        )


def _check_fallback_reports(chosen: ChosenPractice, model_path: Path, source: dict[str, str]) -> None:
    """A fallback's report must come from this checkpoint: another one's linears rank nothing here."""
    for i, fallback in enumerate(chosen.practice.spec.fallback):
        if fallback.report_source is None:
            continue
        if different_source(fallback.report_source, source) is not None:
            raise UserError(f"{chosen.path}: spec.fallback[{i}].report {fallback.report} is the quant report of "
                            f"another checkpoint (its config / index / tensor hashes differ from {model_path}'s)")


def check_utf8_paths(**paths: str | None) -> None:
    """Paths whose names are not UTF-8 (a shell's $'\\xff') cannot be logged, printed or written into an output's
    metadata faithfully: refused up front, by flag."""
    for flag, value in paths.items():
        if value is None:
            continue
        try:
            str(value).encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"--{flag} {os.fsencode(value)!r}: the name is not valid UTF-8; choose a UTF-8 "
                            "name") from None


def check_request(args: QuantArgs, place: TorchrunRank | None = None) -> _Plan:
    """Every check that needs no model weights, in the order a user would fix them."""
    check_utf8_paths(model_path=args.model_path, save_path=args.save_path, config_path=args.config_path,
                     calibration_dataset=args.calibration_dataset)
    model_path = Path(args.model_path).expanduser().resolve()
    save_path = Path(args.save_path).expanduser().absolute()
    save_path = save_path.parent.resolve() / save_path.name
    config = _read_model_config(model_path)
    _check_save_path(model_path, save_path)
    _check_remote_code(model_path, config, args.trust_remote_code)
    missing = missing_consumer_files(model_path, config)
    if missing:
        raise UserError(f"--model_path {model_path}: {', '.join(missing)} missing (config.json names it; a consumer "
                        "cannot load the output without it)")
    entry = load_registry().resolve(args.model_type)
    entry.check_dependencies()
    chosen = choose_practice(args.model_type, entry.group, args.quant_type, args.config_path, tags=args.tags)
    device = parse_device(args.device, place)
    _check_expert_split(model_path, config, device)
    spec = chosen.practice.spec
    if args.calibration_dataset is not None:
        spec.dataset = args.calibration_dataset
    profile(spec.target, "spec.target")
    if args.target is not None:
        spec.target = profile(args.target).name
    records = practice_records(spec)
    with_image = sum(r.image is not None for r in records)
    if not chosen.practice.is_multimodal and with_image:
        raise UserError(
            f"{chosen.path}: apiversion {chosen.practice.apiversion} is the text service, but spec.dataset "
            f"{spec.dataset!r} has {with_image} image records; use a text dataset"
        )
    if chosen.practice.is_multimodal and not with_image:
        raise UserError(
            f"{chosen.path}: apiversion {chosen.practice.apiversion} calibrates on images and text, but "
            f"spec.dataset {spec.dataset!r} has no image record"
        )
    if spec.runner == "layer_wise" and device.world_size > 1:
        raise UserError(
            f"{chosen.path}: spec.runner layer_wise runs on one device, but --device {args.device} gives "
            f"{device.world_size}; use runner auto or dp_layer_wise"
        )
    if len(records) < device.world_size:
        raise UserError(
            f"{chosen.path}: spec.dataset {spec.dataset!r} has {len(records)} records, fewer than the "
            f"{device.world_size} devices of --device {args.device}"
        )
    source = source_identity(model_path)
    _check_fallback_reports(chosen, model_path, source)
    adapter_cls = entry.load_adapter_class()
    adapter_cls.check_config(config, model_path / "config.json", args.model_type)
    return _Plan(model_path, save_path, entry, adapter_cls, chosen, device, records, practice_bytes(chosen), source,
                 practice_inputs(chosen, records))


def run_quant_service(plan: _Plan, args: QuantArgs, work_dir: Path, resume_after: int | None = None,
                      report_only: bool = False) -> None:
    from msmodelslim.core import ascend_check
    from msmodelslim.pipeline import launch

    request = launch.QuantRequest(
        model_path=plan.model_path,
        work_dir=work_dir,
        device=plan.device,
        adapter_cls=plan.adapter_cls,
        practice=plan.chosen.practice,
        trust_remote_code=args.trust_remote_code,
        records=plan.records,
        source=plan.source,
        orphan_cleanup=(_side_name(plan.save_path, "lock"),),
        resume_after=resume_after,
        ascend_check=ascend_check.enabled(),
        report_only=report_only,
    )
    launch.run_service(request)


def _publish(work_dir: Path, save_path: Path) -> None:
    for path in [work_dir, *work_dir.rglob("*")]:  # one mode for every file, whatever wrote it
        os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)
    try:
        if save_path.is_dir():
            save_path.rmdir()  # empty (checked earlier); rename cannot replace a directory on every platform
        os.rename(work_dir, save_path)
    except OSError as exc:  # something else wrote --save_path while the run was computing
        kept = save_path.with_name(f"{save_path.name}.msmodelslim-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(work_dir, kept)
        raise UserError(f"--save_path {save_path}: another process wrote it during the run ({exc.strerror}); the "
                        f"finished output is in {kept}") from None


def practice_bytes(chosen: ChosenPractice) -> bytes:
    """The practice as it runs, read once before the run (the file may change or go while it computes): its bytes,
    with `--calibration_dataset` written into spec.dataset and `--target` into spec.target when they were given."""
    try:
        data = chosen.path.read_bytes()
    except OSError as exc:
        raise UserError(f"{chosen.path}: cannot read the practice again ({exc.strerror})") from None
    spec = chosen.practice.spec
    practice = yaml.safe_load(data)
    given = {"dataset": (spec.dataset, "--calibration_dataset"), "target": (spec.target, "--target")}
    changed = [key for key, (value, _) in given.items() if practice["spec"].get(key) != value]
    if not changed:
        return data
    if "dataset" in changed:
        practice["spec"]["dataset"] = str(Path(spec.dataset).expanduser().resolve())
    if "target" in changed:
        practice["spec"]["target"] = spec.target
    said = " and ".join(f"spec.{key} from {given[key][1]}" for key in changed)
    return f"# {said}\n".encode() + yaml.safe_dump(practice, sort_keys=False).encode()


def practice_inputs(chosen: ChosenPractice, records: list[CalibRecord]) -> dict[str, str]:
    """sha256 of what the practice read from files besides its own bytes, by the name a user knows each by: every
    fallback's names file and report (as read: the names, the ranking and the report's source) and the calibration
    records (their texts and their images' bytes, as far as `spec.max_samples` reads)."""
    spec = chosen.practice.spec
    out = {}
    for i, fallback in enumerate(spec.fallback):
        if fallback.names_file is not None:
            out[f"spec.fallback[{i}].names_file {fallback.names_file}"] = _sha256_json(fallback.globs)
        if fallback.report is not None:
            out[f"spec.fallback[{i}].report {fallback.report}"] = _sha256_json([fallback.ranking,
                                                                                 fallback.report_source])
    records_digest = hashlib.sha256()
    for record in records:
        records_digest.update(_sha256_json([record.text, record.image is not None]).encode())  # content, not where
        if record.image is not None:
            try:
                records_digest.update(hashlib.sha256(record.image.read_bytes()).digest())
            except OSError as exc:
                raise UserError(f"spec.dataset {spec.dataset}: cannot read image {record.image} ({exc.strerror})") \
                    from None
    # one name whatever the dataset's spelling (a relative path, --calibration_dataset): its content decides
    out["the calibration dataset (spec.dataset)"] = records_digest.hexdigest()
    return out


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def practice_file_name(model_type: str) -> str:
    return f"{model_type}_best_practice.yaml"


def _side_name(save_path: Path, kind: str) -> Path:
    """`.<name>.<kind>` beside the output; a long name is shortened (with a hash of it) to stay a valid name."""
    name = save_path.name
    if len(name.encode()) > NAME_MAX - _SUFFIX_ROOM:
        digest = hashlib.sha1(name.encode()).hexdigest()[:12]
        name = name.encode()[: NAME_MAX - _SUFFIX_ROOM - 13].decode(errors="ignore") + "-" + digest
    return save_path.parent / f".{name}.{kind}"


@contextlib.contextmanager
def output_lock(save_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `save_path` for the whole run (a second run fails at once, not after hours)."""
    path = _side_name(save_path, "lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as exc:
        raise UserError(f"--save_path {save_path}: cannot write in {save_path.parent} ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise UserError(f"--save_path {save_path}: another msmodelslim run (pid {holder}) is writing it; "
                            f"wait for it or choose another directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
    finally:
        os.close(fd)


def _check_free_space(model_path: Path, save_path: Path) -> None:
    """Refuse a run whose output cannot fit: the bound is computed from the checkpoint's headers."""
    from msmodelslim.source.checkpoint import INDEX_NAME, SINGLE_NAME, open_checkpoint

    if not ((model_path / INDEX_NAME).is_file() or (model_path / SINGLE_NAME).is_file()):
        return  # no weights to size: the adapter says so with its own error
    needed = open_checkpoint(model_path).output_size_bound()
    where = next(p for p in (save_path.parent, *save_path.parent.parents) if p.exists())  # --plan creates nothing
    free = shutil.disk_usage(where).free
    if free < needed:
        raise UserError(f"--save_path {save_path}: {where} has {free / 2**30:.2f} GiB free; the output "
                        f"of {model_path.name} can take up to {needed / 2**30:.2f} GiB")


def _check_state(plan: _Plan, args: QuantArgs) -> tuple[Path, dict[str, Any], int | None]:
    """The read-only half of `_open_work_dir` (`--plan` makes it too): the temporary output's path, the run's
    fingerprint and, with `--resume`, the unit to resume after. A plain run refuses to overwrite resumable state;
    `--resume` refuses state of another run or damaged state."""
    work_dir = _side_name(plan.save_path, "partial")
    state = ResumeState(work_dir)
    world = plan.device.world_size
    expected = fingerprint(plan.source, plan.practice_data, plan.inputs, plan.device.type, world)
    if args.resume:
        if not work_dir.is_dir():
            raise UserError(f"--resume: no interrupted run of --save_path {plan.save_path} to continue ({work_dir} "
                            f"does not exist); run without --resume")
        check_fingerprint(state.recorded_fingerprint(), expected, work_dir)
        after = state.resume_point(world)
        if after is None:
            raise UserError(f"--resume: {work_dir} holds no unit that every rank finished; start over with --fresh")
        state.verify(after, world)
        return work_dir, expected, after
    if not args.fresh and work_dir.exists() and state.recorded_fingerprint() is not None and state.has_units():
        raise UserError(f"--save_path {plan.save_path}: an interrupted run left resumable state in {work_dir}; "
                        f"continue it with --resume, or start over with --fresh (or delete that folder)")
    return work_dir, expected, None


def _open_work_dir(plan: _Plan, args: QuantArgs) -> tuple[Path, int | None]:
    """The run's temporary output `.<name>.partial` (one name per save_path, so an interrupted run can be found
    again) and the unit to resume after (None: from the start); `--fresh` discards earlier state."""
    work_dir, expected, after = _check_state(plan, args)
    if after is not None:
        logger.info("--resume: continuing the run in %s after unit %d", work_dir, after)
        ResumeState(work_dir).drop_interrupted_writes()  # before any rank writes again
        return work_dir, after
    try:
        discarded = _side_name(plan.save_path, "discarded")
        _remove_output(discarded)  # what an earlier discard left when it was cut short
        if work_dir.exists():  # --fresh, or left by a run that finished no unit: nothing to resume
            logger.info("discarding %s", work_dir)
            os.replace(work_dir, discarded)  # at once: no state that looks resumable but lacks its shards
            _remove_output(discarded)
        work_dir.mkdir()
        ResumeState(work_dir).start(expected)
    except OSError as exc:
        where = exc.filename or plan.save_path.parent
        message = "no space left" if exc.errno == errno.ENOSPC else exc.strerror
        raise UserError(f"--save_path {plan.save_path}: cannot create {where} ({message})") from None
    return work_dir, None


@contextlib.contextmanager
def _on_failure(stop: Stop, work_dir: Path, world: int, *files: Path, resumed: bool = False,
                resumable: bool = True) -> Iterator[None]:
    """Whatever fails inside: `_failed` decides what stays, and a signal is re-raised as the signal."""
    try:
        yield
    except BaseException as exc:
        # A signal that arrives while the failure is handled (torchrun's agent signals the survivors as soon as a rank
        # dies, often just after they lost their peer) waits until the handling is done, then stops the run.
        with signals_held():
            error = stop.replace(exc)
            if isinstance(error, Exception) and not isinstance(error, UserError):
                error = disk_full_error(work_dir, error) or error  # the publish's own writes
            _failed(work_dir, world, error, *files, resumed=resumed, resumable=resumable)
        if error is exc:
            raise
        raise error from None


def _failed(work_dir: Path, world: int, error: BaseException, *files: Path, resumed: bool = False,
            resumable: bool = True) -> None:
    """After a failure: keep resumable state (and say how to use it), else remove the temporary output. A bad input
    found mid-run (a NaN in a layer, say) discards it too: the run cannot go on with that input, and fixing it makes
    another run. A resumed run never discards: the state it continued was good, and whatever the new attempt was
    refused for (a typo in a file it reads) the user can fix and resume again."""
    keep = resumable and (resumed or isinstance(error, ResumableError) or not isinstance(error, UserError))
    if keep and ResumeState(work_dir).resume_point(world) is not None:
        logger.warning("the run can be resumed: the same command with --resume continues after the last unit every "
                       "rank finished; --fresh starts over (the state is in %s)", work_dir)
        _remove_output(None, *files)
    else:
        _remove_output(work_dir, *files)


def _finish_output(plan: _Plan, args: QuantArgs, work_dir: Path) -> None:
    """Add the practice to what the ranks wrote, publish with one rename."""
    if not (work_dir / DESCRIPTION_FILE).is_file():
        raise RuntimeError(f"the quant service finished without writing {DESCRIPTION_FILE} in {work_dir}")
    (work_dir / practice_file_name(args.model_type)).write_bytes(plan.practice_data)
    ResumeState(work_dir).invalidate()  # the runner dropped it before the merge; a report-only run has none
    _publish(work_dir, plan.save_path)


def _remove_output(work_dir: Path | None, *files: Path) -> None:
    """Remove a failed run's temporary output, with SIGINT / SIGTERM held back meanwhile: under torchrun the
    agent signals every rank as soon as one fails, and a signal must not cut the removal short."""
    with signals_held():
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)
        for path in files:
            path.unlink(missing_ok=True)


def _quant_spawned(plan: _Plan, args: QuantArgs) -> None:
    """The built-in launch: this process holds the output and starts one process per device of this host."""
    with sigterm_raises() as stop, output_lock(plan.save_path):
        _check_save_path(plan.model_path, plan.save_path)  # again under the lock: a run may have just published
        _check_free_space(plan.model_path, plan.save_path)
        work_dir, after = _open_work_dir(plan, args)
        with _on_failure(stop, work_dir, plan.device.world_size, resumed=after is not None,
                         resumable=args.resumable):
            run_quant_service(plan, args, work_dir, after)
            _finish_output(plan, args, work_dir)


def _quant_torchrun(plan: _Plan, args: QuantArgs, place: TorchrunRank) -> None:
    """One rank of a torchrun job. Rank 0 holds the output (lock, temporary folder, publish), as the built-in
    launcher's main process does; every rank checks that it sees that folder (one shared directory on every node)
    before any compute. On a failure every rank removes the temporary output, or keeps it as resumable state: the
    rank that held it may be gone."""
    with sigterm_raises() as stop:
        torchrun.join(place, plan.device.backend, plan.device.torch_device(place.rank))
        try:
            with contextlib.ExitStack() as held:
                work_dir, after, error, token = None, None, None, uuid.uuid4().hex
                identity = plan.identity if place.is_main else None
                if place.is_main:
                    try:
                        held.enter_context(output_lock(plan.save_path))
                        _check_save_path(plan.model_path, plan.save_path)
                        _check_free_space(plan.model_path, plan.save_path)
                        work_dir, after = _open_work_dir(plan, args)
                        (work_dir / _SHARED_TOKEN).write_text(token)
                    except UserError as exc:
                        error = str(exc)
                work_dir, after, token, error, identity = torchrun.share((work_dir, after, token, error, identity))
                if error:
                    raise UserError(error)
                # rank 0 may be killed holding the lock: another rank removes it then
                lock = () if place.is_main else (_side_name(plan.save_path, "lock"),)
                with _on_failure(stop, work_dir, plan.device.world_size, *lock, resumed=after is not None,
                                 resumable=args.resumable):
                    _check_shared(plan, work_dir, token, identity, place)
                    run_quant_service(plan, args, work_dir, after)
                    if place.is_main:
                        _finish_output(plan, args, work_dir)
        finally:
            torchrun.leave()


def _check_shared(plan: _Plan, work_dir: Path, token: str, identity: dict[str, Any], place: TorchrunRank) -> None:
    """Before any compute, every rank reads rank 0's token in the temporary output (one shared directory) and
    reads the same input as rank 0: the checkpoint, the practice and every file it reads (a node-local copy of
    another revision, a practice edited between the ranks' starts: either would make a mixed output)."""
    try:
        seen = (work_dir / _SHARED_TOKEN).read_text() == token
    except OSError:
        seen = False
    differs = identity_difference(identity, plan.identity)  # each rank's plan read its own files
    ranks = torchrun.gather((place.rank, torchrun.host(), seen, differs))
    if place.is_main:
        # every rank has looked (gather is collective); a rank that failed may already have removed the folder
        (work_dir / _SHARED_TOKEN).unlink(missing_ok=True)
    blind = [(rank, host) for rank, host, ok, _ in ranks if not ok]
    if blind:
        rank, host = blind[0]
        raise UserError(f"--save_path {plan.save_path}: under torchrun it must be one directory that every node sees "
                        f"(a shared file system), but rank {rank} on {host} does not see {work_dir}, written by rank 0 "
                        f"({len(blind)} rank(s) blind)")
    other = [(rank, host, what) for rank, host, _, what in ranks if what is not None]
    if other:
        rank, host, what = other[0]
        raise UserError(f"--model_path {plan.model_path} --config_path {plan.chosen.path}: rank {rank} on {host} "
                        f"reads another input than rank 0: {what} ({len(other)} rank(s) differ); every node needs "
                        f"the same files")


def quant(args: QuantArgs) -> QuantResult:
    """Run one quantization; raises UserError (nothing written) for bad input. Under torchrun this is one rank
    of the job (core/torchrun.py); the result of a rank other than 0 reports no files."""
    start = time.perf_counter()
    place = TorchrunRank.from_environment()
    plan = check_request(args, place)
    logger.info("model_type %s -> %s (%s); practice %s; device %s", args.model_type, plan.entry.group,
                plan.entry.entry_point, plan.chosen.path, plan.device)
    try:
        plan.save_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--save_path {plan.save_path}: cannot create {exc.filename} ({exc.strerror})") from None
    if place is None:
        _quant_spawned(plan, args)
    else:
        _quant_torchrun(plan, args, place)
    main = place is None or place.is_main
    files = [p for p in plan.save_path.rglob("*") if p.is_file()] if main else []
    return QuantResult(
        save_path=plan.save_path,
        practice_path=plan.chosen.path,
        practice=plan.chosen.practice,
        model_type=args.model_type,
        device=plan.device,
        seconds=time.perf_counter() - start,
        files=len(files),
        bytes=sum(p.stat().st_size for p in files),
        copied=[p.name for p in consumer_files(plan.save_path)] if main else [],
        is_main=main,
    )


def plan(args: QuantArgs) -> dict[str, Any]:
    """`--plan`: every check of a run before compute, in the same order and with the same errors, then what the
    run would do (app/plan.py). Reads headers only and writes nothing."""
    from msmodelslim.app.plan import build_plan
    from msmodelslim.pipeline.assembly import prepare_run, sample_tokens

    checked = check_request(args, TorchrunRank.from_environment())  # under torchrun: the job's rank count
    _check_save_path(checked.model_path, checked.save_path)
    _check_free_space(checked.model_path, checked.save_path)
    _check_state(checked, args)
    spec = checked.chosen.practice.spec
    # one process's adapter: the model on the meta device, the checkpoint's headers checked, no weight read
    adapter = checked.adapter_cls(checked.model_path, trust_remote_code=args.trust_remote_code)
    try:
        samples, _, linears = prepare_run(adapter, checked.records, spec, world=checked.device.world_size,
                                          label=checked.chosen.practice.metadata.label)
        tokens = sum(map(sample_tokens, samples))
        save_config = next(e.config for e in spec.save if e.type == "ascendv1_saver")
        largest = max(map(sample_tokens, samples), default=0)
        result = build_plan(adapter, linears, save_config, checked.device.world_size, checked.device.type,
                            tokens, len(samples), largest, spec.resume_every)
    finally:
        adapter.close()
    result["practice"] = str(checked.chosen.path)
    result["device"] = str(checked.device)
    return result
