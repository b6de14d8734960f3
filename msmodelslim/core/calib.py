"""Calibration records: `{"text": ..., "image": "relative/path.png"}` lines of a jsonl index.

`dataset` is a lab_calib short name (`lab_calib/<name>/index.jsonl`; a name has no `/` and no `.jsonl` suffix) or
a path (relative to the current directory) to a jsonl file, to a directory holding `index.jsonl`, or to a directory
of jsonl shards (`*.jsonl`, read in name order: a large set written in parts). Image paths are relative to the
file's directory and must stay inside it. Image-only records take `default_text`; text-only records are allowed, so
one set may mix both. Files are read a line at a time and no further than `max_samples` records.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from msmodelslim.errors import UserError

logger = logging.getLogger(__name__)

RECORD_KEYS = ("text", "image")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
INDEX_NAME = "index.jsonl"
# Pillow's own decompression-bomb threshold; larger images are refused by name before anything decodes them.
MAX_IMAGE_PIXELS = 89_478_485
_SHORT_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class CalibError(UserError):
    """A calibration dataset that cannot be used as it is."""


@dataclass(frozen=True)
class CalibRecord:
    text: str
    image: Path | None = None  # absolute path of a verified image file


def is_short_name(dataset: str) -> bool:
    return bool(_SHORT_NAME.match(dataset)) and not dataset.endswith(".jsonl") and dataset not in (".", "..")


def known_datasets() -> list[str]:
    from msmodelslim.core.resources import resource_path

    root = resource_path("lab_calib")
    return sorted(p.parent.name for p in root.glob(f"*/{INDEX_NAME}"))


def resolve_dataset(dataset: str) -> list[Path]:
    """The jsonl files that `dataset` names, in reading order."""
    if not dataset or not dataset.strip():
        raise CalibError("calibration dataset name is empty")
    if is_short_name(dataset):
        from msmodelslim.core.resources import resource_path

        index = resource_path("lab_calib") / dataset / INDEX_NAME
        if not index.is_file():
            raise CalibError(
                f"unknown calibration dataset {dataset!r}: {index} not found; "
                f"lab_calib has {', '.join(known_datasets()) or '(none)'} (or give a path to a jsonl file)"
            )
        return [index]
    path = Path(dataset).expanduser()
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            return [path / INDEX_NAME]
        shards = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        if not shards:
            raise CalibError(f"calibration dataset directory {path} has neither {INDEX_NAME} nor *.jsonl shards")
        return shards
    if path.exists() and not path.is_file():  # a FIFO or a device would be read forever
        raise CalibError(f"calibration dataset {path} is not a regular file (a pipe, device or socket cannot be read "
                         "as one)")
    if not path.is_file():
        raise CalibError(f"calibration dataset not found: {path}")
    return [path]


def _check_image(value: object, root: Path, where: str) -> Path:
    if not isinstance(value, str) or not value.strip():
        raise CalibError(f"{where}: 'image' must be a non-empty path string, got {value!r}")
    candidate = Path(value)
    full = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if not full.is_relative_to(root.resolve()):
        raise CalibError(f"{where}: image path {value!r} escapes the dataset directory {root}")
    if full.suffix.lower() not in IMAGE_SUFFIXES:
        raise CalibError(
            f"{where}: image {value!r} has unsupported type {full.suffix or '(no suffix)'!r}; "
            f"expected one of {', '.join(IMAGE_SUFFIXES)}"
        )
    if not full.is_file():
        raise CalibError(f"{where}: image file not found: {full}")
    from PIL import Image, UnidentifiedImageError

    pillow_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # read the size; our limit judges it
    try:
        with Image.open(full) as img:
            width, height = img.size
            if width * height > MAX_IMAGE_PIXELS:
                raise CalibError(f"{where}: image {value!r} is {width}x{height} = {width * height / 1e6:.0f} M "
                                 f"pixels, above the {MAX_IMAGE_PIXELS / 1e6:.0f} M pixel limit; resize it")
            img.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise CalibError(f"{where}: image {value!r} cannot be read as an image ({exc})") from None
    finally:
        Image.MAX_IMAGE_PIXELS = pillow_limit
    return full


def _record(line: str, where: str, root: Path, default_text: str) -> CalibRecord:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CalibError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise CalibError(f"{where}: expected a JSON object with 'text' and/or 'image', got {type(item).__name__}")
    unknown = sorted(set(item) - set(RECORD_KEYS))
    if unknown:
        raise CalibError(f"{where}: unknown key {unknown[0]!r}; expected one of {', '.join(RECORD_KEYS)}")
    text = item.get("text")
    if text is not None and not isinstance(text, str):
        raise CalibError(f"{where}: 'text' must be a string, got {type(text).__name__}")
    image = _check_image(item["image"], root, where) if item.get("image") is not None else None
    if not (text or "").strip():
        if image is None:
            raise CalibError(f"{where}: record has neither text nor image")
        text = default_text
    return CalibRecord(text=text, image=image)


def load_calib_records(dataset: str, default_text: str, max_samples: int | None = None) -> list[CalibRecord]:
    """Read and check a calibration set (the first `max_samples` records when given; later lines are not read)."""
    if max_samples is not None and max_samples <= 0:
        raise CalibError(f"max_samples must be positive, got {max_samples}")
    files = resolve_dataset(dataset)
    records: list[CalibRecord] = []
    for index in files:
        if max_samples is not None and len(records) >= max_samples:
            break
        root = index.parent
        try:
            with open(index, encoding="utf-8") as lines:
                for lineno, line in enumerate(lines, start=1):
                    if max_samples is not None and len(records) >= max_samples:
                        break
                    if line.strip():
                        records.append(_record(line, f"{index}:{lineno}", root, default_text))
        except (OSError, UnicodeDecodeError) as exc:
            raise CalibError(f"cannot read calibration index {index}: {exc}") from None
    index = files[0] if len(files) == 1 else files[0].parent
    if not records:
        raise CalibError(f"calibration dataset {index} has no records")
    logger.debug("%d calibration records from %s (%d with an image)", len(records), index,
                 sum(r.image is not None for r in records))
    return records
