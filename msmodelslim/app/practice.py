"""`--model_type` + `--quant_type` -> the best practice YAML in lab_practice/<group>/ (or `--config_path`).

A practice answers a quant_type derived from `metadata.label` (`core.config.Label.quant_type`):
w_bit 4 / a_bit 8 -> w4a8; w8/a8 -> w8a8; w4/a4 -> w4a4; w8/a16 -> w8a16; `is_sparse` adds `s` (w8a8s) and
`kv_cache` adds `c8` (w4a8c8). Among the practices whose `metadata.verified_model_types` contains the model type,
the highest `metadata.score` wins; equal top scores are an error naming both files. Only the YAML files directly
in lab_practice/<group>/ are candidates; sub-folders (e.g. recipes/ for benchmarks) are never searched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from msmodelslim.app.resources import resource_path
from msmodelslim.core.config import PracticeConfig, load_practice, load_practice_header
from msmodelslim.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChosenPractice:
    path: Path
    practice: PracticeConfig
    explicit: bool  # True when given with --config_path


def practice_dir(group: str, root: Path | None = None) -> Path:
    return (root if root is not None else resource_path("lab_practice")) / group


def find_practice(model_type: str, quant_type: str, group: str, root: Path | None = None) -> Path:
    """Path of the best practice for (model_type, quant_type) among lab_practice/<group>/*.yaml."""
    folder = practice_dir(group, root)
    files = sorted(folder.glob("*.yaml")) if folder.is_dir() else []
    headers = [load_practice_header(path) for path in files]
    for_model = [h for h in headers if model_type in h.metadata.verified_model_types]
    matches = [h for h in for_model if h.quant_type == quant_type.lower()]
    if not matches:
        available = sorted({h.quant_type for h in for_model})
        raise UserError(
            f"no practice for --model_type {model_type} --quant_type {quant_type} in {folder}; "
            f"available quant types: {', '.join(available) or '(none)'} (or give a YAML with --config_path)"
        )
    matches.sort(key=lambda h: h.metadata.score, reverse=True)
    if len(matches) > 1 and matches[0].metadata.score == matches[1].metadata.score:
        raise UserError(
            f"two practices for {model_type} {quant_type} share the top score {matches[0].metadata.score:g}: "
            f"{matches[0].path} and {matches[1].path}; change one score or pass --config_path"
        )
    return matches[0].path


def choose_practice(
    model_type: str, group: str, quant_type: str | None, config_path: str | Path | None, root: Path | None = None
) -> ChosenPractice:
    """Exactly one of quant_type / config_path; the chosen file is fully validated."""
    if (quant_type is None) == (config_path is None):
        raise UserError("give exactly one of --quant_type and --config_path")
    if config_path is not None:
        path = Path(config_path)
        practice = load_practice(path)
        if model_type not in practice.metadata.verified_model_types:
            logger.warning("%s is verified for %s, not for %s", path,
                           ", ".join(practice.metadata.verified_model_types), model_type)
        return ChosenPractice(path, practice, explicit=True)
    path = find_practice(model_type, quant_type, group, root)
    return ChosenPractice(path, load_practice(path), explicit=False)
