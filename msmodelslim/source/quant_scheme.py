"""The compressed-tensors ``quantization_config`` of a checkpoint: which stored modules are packed, and how.

Matching follows compressed-tensors 0.20 (``utils/match.py``): a target/ignore entry is an exact module
name, a ``re:`` regex applied with ``re.match`` (anchored at the start only, as compressed-tensors does), or
a class name. A checkpoint has no classes, so the only class a stored module can be recognised as is
``Linear``: every module stored as ``weight_packed`` + ``weight_scale`` (or dense ``weight``) is a Linear.
When several targets match, the most specific wins as in compressed-tensors' ``match_targets``: exact names,
then regexes, then class names (each sorted), and a target listed by several groups belongs to the last one.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MXFP4_FORMAT",
    "QuantGroup",
    "QuantScheme",
    "find_quantization_config",
    "match_name",
    "mxfp4_exponent_bias",
    "parse_quant_scheme",
    "read_config",
    "text_part",
]

logger = logging.getLogger(__name__)

MXFP4_FORMAT = "mxfp4-pack-quantized"
SUPPORTED_QUANT_METHODS = ("compressed-tensors",)
# compressed-tensors 0.13.x wrote E8M0 exponents 2 lower than the scale it used (fixed in 0.14.0).
_BUGGY_SCALE_VERSION = re.compile(r"^0\.13(\.|$|[^0-9])")


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model directory (errors name the file)."""
    path = Path(model_dir) / "config.json"
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path}: config.json not found in model directory {model_dir}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object at top level, got {type(config).__name__}")
    return config


def text_part(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's part of a config.json: `text_config` of a multimodal model, else the whole mapping."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def find_quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``quantization_config`` block: top level, else under ``text_config`` (multimodal models).

    ``compression_config`` is accepted as the older compressed-tensors spelling.
    """
    for holder in (config, text_part(config)):
        for key in ("quantization_config", "compression_config"):
            block = holder.get(key)
            if block:
                return block
    return None


def mxfp4_exponent_bias(version: str | None) -> int:
    """E8M0 exponent bias to decode a checkpoint written by compressed-tensors ``version``.

    0.13.x stored the exponent 2 lower than the scale it quantized with, so its true value is
    ``fp4 * 2**(e - 125)``; every other version (and an unknown one) uses the spec's 127.
    """
    if version is not None and _BUGGY_SCALE_VERSION.match(str(version).strip()):
        return 125
    return 127


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' ``match_name``: ``re:`` prefix -> ``re.match``, else exact equality."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _match_class(target: str, module_class: str | None) -> bool:
    return module_class is not None and target == module_class


@dataclass(frozen=True)
class QuantGroup:
    """One ``config_groups`` entry."""

    name: str
    targets: tuple[str, ...]
    format: str | None
    weights: dict[str, Any] | None


@dataclass(frozen=True)
class QuantScheme:
    """A parsed compressed-tensors ``quantization_config``."""

    quant_method: str
    format: str | None
    version: str | None
    status: str | None
    groups: tuple[QuantGroup, ...]
    ignore: tuple[str, ...]
    source: str = "config.json"

    @property
    def exponent_bias(self) -> int:
        return mxfp4_exponent_bias(self.version)

    def is_ignored(self, module_name: str, module_class: str | None = "Linear") -> bool:
        return any(match_name(module_name, ign) or _match_class(ign, module_class) for ign in self.ignore)

    def group_for(self, module_name: str, module_class: str | None = "Linear") -> QuantGroup | None:
        """The group quantizing ``module_name`` (``None`` when untargeted or ignored)."""
        if self.is_ignored(module_name, module_class):
            return None
        target_to_group: dict[str, QuantGroup] = {}
        for group in self.groups:  # a target repeated in a later group belongs to that group
            for target in group.targets:
                target_to_group[target] = group
        ordered = sorted(target_to_group, key=lambda t: ("re:" in t, t))
        for target in ordered:
            if match_name(module_name, target):
                return target_to_group[target]
        for target in ordered:
            if _match_class(target, module_class):
                return target_to_group[target]
        return None

    def format_for(self, module_name: str, module_class: str | None = "Linear") -> str | None:
        """Storage format of ``module_name`` (``None``: not quantized by this config)."""
        group = self.group_for(module_name, module_class)
        if group is None:
            return None
        fmt = group.format or self.format
        if fmt is None or fmt == "mixed-precision":
            raise ValueError(
                f"{self.source}: quantization_config group {group.name!r} (matching {module_name!r}) has no format"
            )
        return fmt

    def require_mxfp4(self, module_name: str) -> int:
        """Check that ``module_name`` is stored as MXFP4 by this config; returns the exponent bias to decode it."""
        fmt = self.format_for(module_name, "Linear")
        if fmt is None:
            raise ValueError(
                f"{self.source}: {module_name} is stored as weight_packed/weight_scale but quantization_config "
                f"does not target it (targets {[g.targets for g in self.groups]}, ignore {list(self.ignore)})"
            )
        if fmt != MXFP4_FORMAT:
            raise ValueError(
                f"{self.source}: {module_name} uses compressed-tensors format {fmt!r}; only {MXFP4_FORMAT!r} is supported"
            )
        group = self.group_for(module_name, "Linear")
        weights = (group.weights if group is not None else None) or {}
        if weights.get("group_size", 32) != 32 or weights.get("num_bits", 4) != 4:
            raise ValueError(
                f"{self.source}: {module_name}: {MXFP4_FORMAT} needs num_bits 4 / group_size 32, got "
                f"num_bits {weights.get('num_bits')} / group_size {weights.get('group_size')}"
            )
        return self.exponent_bias


def parse_quant_scheme(config: dict[str, Any], *, source: str = "config.json") -> QuantScheme | None:
    """Parse the ``quantization_config`` of a model ``config`` dict (``None`` if it has none).

    Raises ``ValueError`` naming ``source`` for an unknown ``quant_method`` or a malformed block.
    """
    block = find_quantization_config(config)
    if block is None:
        return None
    if not isinstance(block, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {type(block).__name__}")
    method = block.get("quant_method")
    if method not in SUPPORTED_QUANT_METHODS:
        raise ValueError(
            f"{source}: unsupported quantization_config.quant_method {method!r} (supported: {list(SUPPORTED_QUANT_METHODS)})"
        )
    raw_groups = block.get("config_groups") or {}
    if not isinstance(raw_groups, dict):
        raise ValueError(f"{source}: quantization_config.config_groups must be an object")
    groups = []
    for gname, raw in raw_groups.items():
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: quantization_config.config_groups.{gname} must be an object")
        targets = raw.get("targets") or []
        if isinstance(targets, str):
            targets = [targets]
        groups.append(QuantGroup(gname, tuple(targets), raw.get("format"), raw.get("weights")))
    ignore = block.get("ignore") or []
    if isinstance(ignore, str):
        ignore = [ignore]
    for entry in [t for g in groups for t in g.targets] + list(ignore):
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise ValueError(f"{source}: invalid regex {entry!r} in quantization_config ({exc})") from exc
    version = block.get("version")
    scheme = QuantScheme(
        quant_method=method,
        format=block.get("format"),
        version=None if version is None else str(version),
        status=block.get("quantization_status"),
        groups=tuple(groups),
        ignore=tuple(ignore),
        source=source,
    )
    if scheme.exponent_bias != 127:
        logger.warning(
            "%s: written by compressed-tensors %s, whose E8M0 scales are 2 too low; decoding with bias %d",
            source, scheme.version, scheme.exponent_bias,
        )
    return scheme
