"""`msmodelslim quant`: validate the request, resolve adapter + practice, run the service, publish atomically.

The output is built in `<save_path.parent>/.<save_path.name>.tmp-<pid>` and moved to `save_path` with one
`os.rename` after the service succeeded and the chosen practice was written beside it; on any failure the
temporary directory is removed, so a crash never leaves a complete-looking output.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msmodelslim.app.practice import ChosenPractice, choose_practice
from msmodelslim.core.calib import CalibRecord, load_calib_records
from msmodelslim.core.config import PracticeConfig
from msmodelslim.core.device import DeviceSpec, parse_device
from msmodelslim.errors import UserError
from msmodelslim.model.registry import ModelEntry, load_registry

logger = logging.getLogger(__name__)

DESCRIPTION_FILE = "quant_model_description.json"


@dataclass
class QuantArgs:
    model_path: str
    save_path: str
    model_type: str
    device: str = "npu"
    quant_type: str | None = None
    config_path: str | None = None
    trust_remote_code: bool = False
    tag: str | None = None


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


@dataclass
class _Plan:
    model_path: Path
    save_path: Path
    entry: ModelEntry
    adapter_cls: type
    chosen: ChosenPractice
    device: DeviceSpec
    records: list[CalibRecord]


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
    if save_path.is_dir() and any(save_path.iterdir()):
        raise UserError(
            f"--save_path {save_path} exists and is not empty; remove it or choose another directory "
            "(msmodelslim never overwrites an output)"
        )


def _check_expert_split(model_path: Path, config: dict[str, Any], device: DeviceSpec) -> None:
    """Expert parallelism splits the routed experts evenly; refuse an uneven split before any process starts."""
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    num_experts = text_config.get("num_experts")
    if device.world_size > 1 and isinstance(num_experts, int) and num_experts > 0 \
            and num_experts % device.world_size:
        raise UserError(
            f"{model_path / 'config.json'}: num_experts={num_experts} is not divisible by the "
            f"{device.world_size} devices of --device {device}; choose a device count that divides {num_experts}"
        )


def _plan(args: QuantArgs) -> _Plan:
    """Every check that needs no model weights, in the order a user would fix them."""
    model_path = Path(args.model_path).expanduser().resolve()
    save_path = Path(args.save_path).expanduser().absolute()
    save_path = save_path.parent.resolve() / save_path.name
    config = _read_model_config(model_path)
    _check_save_path(model_path, save_path)
    _check_remote_code(model_path, config, args.trust_remote_code)
    entry = load_registry().resolve(args.model_type)
    entry.check_dependencies()
    chosen = choose_practice(args.model_type, entry.group, args.quant_type, args.config_path)
    device = parse_device(args.device)
    _check_expert_split(model_path, config, device)
    spec = chosen.practice.spec
    records = load_calib_records(spec.dataset, spec.default_text, spec.max_samples)
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
    adapter_cls = entry.load_adapter_class()
    return _Plan(model_path, save_path, entry, adapter_cls, chosen, device, records)


def _run_service(plan: _Plan, args: QuantArgs, work_dir: Path) -> None:
    from msmodelslim.core import quant_service

    request = quant_service.QuantRequest(
        model_path=plan.model_path,
        work_dir=work_dir,
        device=plan.device,
        adapter_cls=plan.adapter_cls,
        practice=plan.chosen.practice,
        trust_remote_code=args.trust_remote_code,
        model_type=args.model_type,
        records=plan.records,
    )
    quant_service.run_service(request)


def _publish(work_dir: Path, save_path: Path) -> None:
    if save_path.is_dir():
        save_path.rmdir()  # empty (checked earlier); rename cannot replace a directory on every platform
    os.rename(work_dir, save_path)


def practice_file_name(model_type: str) -> str:
    return f"{model_type}_best_practice.yaml"


def quant(args: QuantArgs) -> QuantResult:
    """Run one quantization; raises UserError (nothing written) for bad input."""
    start = time.perf_counter()
    plan = _plan(args)
    logger.info("model_type %s -> %s (%s); practice %s; device %s", args.model_type, plan.entry.group,
                plan.entry.entry_point, plan.chosen.path, plan.device)
    if args.tag:
        logger.info("tag: %s", args.tag)
    plan.save_path.parent.mkdir(parents=True, exist_ok=True)
    work_dir = plan.save_path.parent / f".{plan.save_path.name}.tmp-{os.getpid()}"
    if work_dir.exists():
        shutil.rmtree(work_dir)  # left by a killed run of this same pid number
    work_dir.mkdir()
    try:
        _run_service(plan, args, work_dir)
        if not (work_dir / DESCRIPTION_FILE).is_file():
            raise RuntimeError(f"the quant service finished without writing {DESCRIPTION_FILE} in {work_dir}")
        shutil.copyfile(plan.chosen.path, work_dir / practice_file_name(args.model_type))
        _publish(work_dir, plan.save_path)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    files = [p for p in plan.save_path.rglob("*") if p.is_file()]
    return QuantResult(
        save_path=plan.save_path,
        practice_path=plan.chosen.path,
        practice=plan.chosen.practice,
        model_type=args.model_type,
        device=plan.device,
        seconds=time.perf_counter() - start,
        files=len(files),
        bytes=sum(p.stat().st_size for p in files),
    )
