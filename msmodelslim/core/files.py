"""Files: the small ones a user hands us (practices, names files, reports) read with limits: only
regular files, and only up to a size, so that a FIFO, `/dev/zero` or a runaway file fails at once with one line;
and the checksum of the files a run writes (its resumable state checks them)."""

from __future__ import annotations

import json
import shutil
import stat
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

import torch

from msmodelslim.core.placement import on_host
from msmodelslim.errors import ResumableError, UserError

MAX_SMALL_FILE_BYTES = 1 << 20  # a practice is a few KiB; a names file of a 2.8T model's linears is well under this


def read_small_text(path: Path, what: str, limit: int = MAX_SMALL_FILE_BYTES) -> str:
    """The text of a regular file of at most `limit` bytes. A FIFO, a device (`/dev/zero`) or a process
    substitution would hang the run or grow without bound, so it is refused before it is opened."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise UserError(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise UserError(f"{what} path is a directory, expected a file: {path}")
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{what} path {path} is not a regular file (a pipe, device or socket cannot be read as one)")
    if info.st_size > limit:
        raise UserError(f"{what} file {path} is {info.st_size / 2**20:.1f} MiB, above the {limit / 2**20:g} MiB limit")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UserError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    if len(data) > limit:  # grew since the stat
        raise UserError(f"{what} file {path} is above the {limit / 2**20:g} MiB limit")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"cannot read {what} file {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def file_checksum(path: Path) -> str:
    """CRC-32 of a file ("crc32:<hex>"), read in 16 MiB blocks: what the resumable state checks its files and
    shards with. It finds damage (a truncated or overwritten file), not tampering, and costs half of a sha256 (3.5 vs
    1.6 GB/s on the 2-core sandbox; the state is written after every unit)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            crc = zlib.crc32(block, crc)
    return _crc_text(crc)


def _crc_text(crc: int) -> str:
    return f"crc32:{crc:08x}"


class ChecksumWriter:
    """A binary file being written that keeps the `file_checksum` of its bytes as they pass, so a file just written
    is not read back for it (writing the resumable state then costs its save alone)."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._crc = 0

    def write(self, data: bytes | memoryview) -> int:
        self._crc = zlib.crc32(data, self._crc)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    @property
    def checksum(self) -> str:
        return _crc_text(self._crc)


@on_host("a written shard's checksum reads the tensors' bytes in host memory")
def safetensors_checksum(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """The `file_checksum` of the safetensors file `path` just written from `tensors` (contiguous host tensors),
    without reading its data back: the header from the file (8 bytes of its length, then the JSON), then each
    tensor's bytes from memory in the file's order (the header's data_offsets; the format leaves no gaps). A shard of
    an output is gigabytes, which the read-back took a second or two per unit to bring in again."""
    with open(path, "rb") as f:
        head = f.read(8)
        header = f.read(struct.unpack("<Q", head)[0])
    crc = zlib.crc32(header, zlib.crc32(head))
    order = sorted((entry["data_offsets"][0], name) for name, entry in json.loads(header).items()
                   if name != "__metadata__")
    for _, name in order:
        crc = zlib.crc32(tensors[name].reshape(-1).view(torch.uint8).numpy(), crc)
    return _crc_text(crc)


DISK_FULL_BYTES = 64 << 20  # less than this free after a failed write: the disk is the cause


def disk_full_error(folder: Path, error: BaseException) -> ResumableError | None:
    """The one-line error for `error` when the file system of `folder` is (nearly) full: libraries report a full
    disk in their own words (safetensors' IoError, torch's "file write failed", OSError ENOSPC), so the free space
    decides. None when there is room (or the folder is gone)."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if free >= DISK_FULL_BYTES:
        return None
    return ResumableError(f"the file system of {folder} is full ({free / 2**20:.0f} MiB free) after "
                          f"{type(error).__name__}: {' '.join(str(error).split())[:160]}; free space and continue "
                          "with --resume")
