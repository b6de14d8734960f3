"""`--model_type` + `--quant_type` (+ `--tag`) -> the best practice YAML in lab_practice/<group>/ (or `--config_path`).

A practice answers a quant_type derived from `metadata.label` (`core.config.Label.quant_type`):
w_bit 4 / a_bit 8 -> w4a8; w8/a8 -> w8a8; w4/a4 -> w4a4; w4/a16 -> w4a16; `is_sparse` adds `s` (w8a8s) and
`kv_cache` adds `c8` (w4a8c8). It is verified for model types, either by name (`metadata.verified_model_types`) or
with the scenarios it was verified in (`metadata.verified_tags`, msModelSlim 26.1.0's form: model type -> lists of
tags such as `[vLLM_Ascend, Ascend_950]`).

The hardware is chosen explicitly. Without `--tag`, the lookup serves Atlas A2/A3 (the integer schemes): a practice
qualifies when one of its scenarios names Atlas_A2_Inference or Atlas_A3_Inference, or when it names no scenario.
`--tag T ...` (as msModelSlim's) asks for a practice with a scenario holding every tag, case-insensitive: `--tag
Ascend_950` for the MX schemes of Ascend 950 / Atlas 350. Among the qualifying practices for the model type and
quant type, the highest `metadata.score` wins; equal top scores are an error naming both files. Only the YAML files
directly in lab_practice/<group>/ are candidates; sub-folders (e.g. recipes/ for benchmarks) are never searched.
Any other shipped practice is taken by name: `--config_path kimi_k3_w4a8_pergroup` reads
lab_practice/<group>/kimi_k3_w4a8_pergroup.yaml (a path that exists wins).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msmodelslim.core.config import PracticeConfig, load_practice, load_practice_header
from msmodelslim.core.resources import resource_path
from msmodelslim.errors import UserError
from msmodelslim.processor.catalog import registries

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChosenPractice:
    path: Path
    practice: PracticeConfig


def practice_dir(group: str, root: Path | None = None) -> Path:
    return (root if root is not None else resource_path("lab_practice")) / group


DEFAULT_HARDWARE = ("Atlas_A2_Inference", "Atlas_A3_Inference")


def qualifies(metadata: Any, model_type: str, tags: tuple[str, ...]) -> bool:
    """Whether a practice serves `model_type` on the hardware `tags` ask for (module docstring)."""
    if model_type not in metadata.model_types:
        return False
    scenarios = [{t.lower() for t in scenario} for scenario in metadata.verified_tags.get(model_type, [])]
    if not tags:
        return not scenarios or any(scenario & {t.lower() for t in DEFAULT_HARDWARE} for scenario in scenarios)
    return any({t.lower() for t in tags} <= scenario for scenario in scenarios)


def _hardware(metadata: Any, model_type: str) -> str:
    """How a user reaches a practice: `--tag A | B` with the tags that tell its scenarios apart."""
    scenarios = metadata.verified_tags.get(model_type, [])
    if not scenarios:
        return "the default hardware"
    common = set.intersection(*(set(s) for s in scenarios)) if len(scenarios) > 1 else set()
    return "--tag " + " | ".join(" ".join(t for t in s if t not in common) for s in scenarios)


def _available(headers: list[Any], model_type: str) -> str:
    """The quant types of `model_type`'s practices, those of the default hardware first."""
    default = sorted({h.quant_type for h in headers if qualifies(h.metadata, model_type, ())})
    others: dict[str, set[str]] = {}
    for h in headers:
        if not qualifies(h.metadata, model_type, ()):
            others.setdefault(_hardware(h.metadata, model_type), set()).add(h.quant_type)
    parts = [f"{', '.join(default)} (default hardware)"] if default else []
    parts += [f"{', '.join(sorted(qts))} with {how}" for how, qts in sorted(others.items())]
    return "; ".join(parts) or "(none)"


def find_practice(model_type: str, quant_type: str, group: str, root: Path | None = None,
                  tags: tuple[str, ...] = ()) -> Path:
    """Path of the best practice for (model_type, quant_type, tags) among lab_practice/<group>/*.yaml."""
    folder = practice_dir(group, root)
    files = sorted(folder.glob("*.yaml")) if folder.is_dir() else []
    headers = [load_practice_header(path) for path in files]
    for_model = [h for h in headers if model_type in h.metadata.model_types]
    matches = [h for h in for_model if h.quant_type == quant_type.lower() and qualifies(h.metadata, model_type, tags)]
    if not matches:
        hardware = f"--tag {' '.join(tags)}" if tags else f"the default hardware ({', '.join(DEFAULT_HARDWARE)})"
        raise UserError(
            f"no practice for --model_type {model_type} --quant_type {quant_type} on {hardware} in {folder}; "
            f"available: {_available(for_model, model_type)} (or give a YAML with --config_path)"
        )
    matches.sort(key=lambda h: h.metadata.score, reverse=True)
    if len(matches) > 1 and matches[0].metadata.score == matches[1].metadata.score:
        raise UserError(
            f"two practices for {model_type} {quant_type} share the top score {matches[0].metadata.score:g}: "
            f"{matches[0].path} and {matches[1].path}; change one score, narrow with --tag or pass --config_path"
        )
    return matches[0].path


def choose_practice(
    model_type: str, group: str, quant_type: str | None, config_path: str | Path | None, root: Path | None = None,
    tags: tuple[str, ...] = (),
) -> ChosenPractice:
    """Exactly one of quant_type / config_path; the chosen file is fully validated."""
    if (quant_type is None) == (config_path is None):
        raise UserError("give exactly one of --quant_type and --config_path")
    if config_path is not None:
        path = Path(config_path)
        shipped = practice_dir(group, root) / f"{config_path}.yaml"
        if not path.exists() and path.name == str(config_path) and shipped.is_file():
            path = shipped  # a shipped practice by name, e.g. kimi_k3_w4a8_pergroup
        practice = load_practice(path, *registries())
        if model_type not in practice.metadata.model_types:
            logger.warning("%s is verified for %s, not for %s", path, ", ".join(practice.metadata.model_types),
                           model_type)
        elif tags and not qualifies(practice.metadata, model_type, tags):
            logger.warning("%s is not verified for --tag %s (it is for %s)", path, " ".join(tags),
                           _hardware(practice.metadata, model_type))
        return _noted(ChosenPractice(path, practice))
    path = find_practice(model_type, quant_type, group, root, tags)
    return _noted(ChosenPractice(path, load_practice(path, *registries())))


def _noted(chosen: ChosenPractice) -> ChosenPractice:
    """The practice's serving note (consumer versions, deployment limits) as a warning: it decides whether the
    output can be served where the user means to."""
    note = chosen.practice.metadata.serving_note
    if note:
        logger.warning("%s: %s", chosen.practice.metadata.config_id, " ".join(note.split()))
    return chosen
