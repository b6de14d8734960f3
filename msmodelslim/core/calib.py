"""Calibration records: `{"text": ..., "image": "relative/path.png"}` lines of a jsonl index.

`dataset` is a lab_calib short name (`lab_calib/<name>/index.jsonl`; a name has no `/` and no `.jsonl` suffix) or
a path (relative to the current directory) to a jsonl file, to a directory holding `index.jsonl`, or to a directory
of jsonl shards (`*.jsonl`, read in name order: a large set written in parts). Image paths are relative to the
file's directory and must stay inside it. Image-only records take `default_text`; text-only records are allowed, so
one set may mix both. Files are read a line at a time and no further than `max_samples` records.

Memory is bounded by the practice, not by the records: a record's text past `CHARS_PER_TOKEN` characters per token of
`spec.max_seq_len` cannot reach the model (its tokens are cut to max_seq_len), so it is dropped as it is read. A line
longer than that is read in chunks, its strings kept to their first bytes (`_cut_long_line`): a 10 MB record took
2.4 GB to tokenize whole, and the line itself is never held whole.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from msmodelslim.errors import UserError

logger = logging.getLogger(__name__)

RECORD_KEYS = ("text", "image")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
INDEX_NAME = "index.jsonl"
# Pillow's own decompression-bomb threshold; larger images are refused by name before anything decodes them.
MAX_IMAGE_PIXELS = 89_478_485
_SHORT_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# A token of any tokenizer we know covers far fewer characters than this on average: the first max_seq_len tokens of
# a text lie within its first max_seq_len * CHARS_PER_TOKEN characters.
CHARS_PER_TOKEN = 64
# A JSON string spends at most 12 bytes on one character (a surrogate pair as two \uXXXX escapes).
_RAW_BYTES_PER_CHAR = 12
_CHUNK = 1 << 20  # a long line is read this much at a time
_SPECIAL = re.compile(rb'["\\]')
_OPEN_ESCAPE = re.compile(rb"(\\+)(u[0-9a-fA-F]{0,3}|u[dD][89abAB][0-9a-fA-F]{2})?$")


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


def text_budget(max_seq_len: int | None) -> int | None:
    """The characters of a record's text that can reach max_seq_len tokens (None: no cap)."""
    return max_seq_len * CHARS_PER_TOKEN if max_seq_len else None


def _whole_tail(raw: bytearray) -> bytearray:
    """`raw`, a JSON string's content cut anywhere, without a broken last character: an escape cut short (or a
    lone high surrogate), a UTF-8 sequence cut short."""
    match = _OPEN_ESCAPE.search(raw)
    if match and len(match.group(1)) % 2:  # the last backslash opens an escape that was cut
        del raw[match.end(1) - 1:]
    lead = len(raw) - 1
    while lead >= 0 and len(raw) - lead <= 4 and raw[lead] & 0xC0 == 0x80:
        lead -= 1
    if lead >= 0 and raw[lead] >= 0xC0:  # a multi-byte character: whole only if all of its bytes are there
        length = 2 if raw[lead] < 0xE0 else 3 if raw[lead] < 0xF0 else 4
        if len(raw) - lead < length:
            del raw[lead:]
    return raw


def _cut_long_line(chunks: Iterator[bytes], keep: int, where: str) -> bytes:
    """One JSON line, read chunk by chunk, with every string's content cut to its first `keep` bytes (at a whole
    character): what is kept stays about `keep` per string, whatever the line's length."""
    out, in_string, escaped, kept, start = bytearray(), False, False, 0, 0
    for chunk in chunks:
        pos = 0
        while pos < len(chunk):
            if not in_string:  # outside a string only a quote matters: it opens one
                quote = chunk.find(b'"', pos)
                out += chunk[pos:] if quote < 0 else chunk[pos:quote + 1]
                if quote < 0:
                    break
                pos, in_string, escaped, kept, start = quote + 1, True, False, 0, len(out)  # content from here
                continue
            if escaped:  # the byte after a backslash: never the string's end
                if kept < keep:
                    out.append(chunk[pos])
                pos, kept, escaped = pos + 1, kept + 1, False
                continue
            special = _SPECIAL.search(chunk, pos)
            end = special.start() if special else len(chunk)
            if kept < keep:
                out += chunk[pos:min(end, pos + keep - kept)]
            kept += end - pos
            pos = end
            if special is None:
                break
            if chunk[end] == ord('"'):
                if kept > keep:
                    out[start:] = _whole_tail(out[start:])
                out += b'"'
                in_string, pos = False, end + 1
            else:
                if kept < keep:
                    out += b"\\"
                kept, escaped, pos = kept + 1, True, end + 1
        if len(out) > 4 * keep + _CHUNK:
            raise CalibError(f"{where}: a record of more than {len(out) >> 20} MiB besides its text; a record "
                             f"holds 'text' and 'image' only")
    return bytes(out)


def _lines(f: BinaryIO, keep: int | None, name: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of `f`; a line longer than `keep` bytes and a margin is read cut (`_cut_long_line`)."""
    limit = -1 if keep is None else keep + 4096
    for lineno in itertools.count(1):
        line = f.readline(limit)
        if not line:
            return
        if limit > 0 and len(line) == limit and not line.endswith(b"\n"):
            line = _cut_long_line(_rest_of_line(f, line), keep, f"{name}:{lineno}")
        yield lineno, line


def _rest_of_line(f: BinaryIO, head: bytes) -> Iterator[bytes]:
    yield head
    while chunk := f.readline(_CHUNK):
        yield chunk
        if chunk.endswith(b"\n"):
            return


def _record(line: str, where: str, root: Path, default_text: str, budget: int | None = None) -> CalibRecord:
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
    return CalibRecord(text=text if budget is None else text[:budget], image=image)


def practice_records(spec: Any) -> list[CalibRecord]:
    """The calibration records a practice's `spec` reads, each text cut to what max_seq_len tokens can use."""
    return load_calib_records(spec.dataset, spec.default_text, spec.max_samples, spec.max_seq_len)


def load_calib_records(dataset: str, default_text: str, max_samples: int | None = None,
                       max_seq_len: int | None = None) -> list[CalibRecord]:
    """Read and check a calibration set (the first `max_samples` records when given; later lines are not read),
    each text cut to `text_budget(max_seq_len)` characters as it is read (module docstring)."""
    if max_samples is not None and max_samples <= 0:
        raise CalibError(f"max_samples must be positive, got {max_samples}")
    budget = text_budget(max_seq_len)
    keep = None if budget is None else _RAW_BYTES_PER_CHAR * budget  # a string's bytes that hold `budget` chars
    files = resolve_dataset(dataset)
    records: list[CalibRecord] = []
    for index in files:
        if max_samples is not None and len(records) >= max_samples:
            break
        root = index.parent
        try:
            with open(index, "rb") as f:
                for lineno, raw in _lines(f, keep, index):
                    if max_samples is not None and len(records) >= max_samples:
                        break
                    line = raw.decode("utf-8")
                    if line.strip():
                        records.append(_record(line, f"{index}:{lineno}", root, default_text, budget))
        except (OSError, UnicodeDecodeError) as exc:
            raise CalibError(f"cannot read calibration index {index}: {exc}") from None
    index = files[0] if len(files) == 1 else files[0].parent
    if not records:
        raise CalibError(f"calibration dataset {index} has no records")
    logger.debug("%d calibration records from %s (%d with an image)", len(records), index,
                 sum(r.image is not None for r in records))
    return records
