"""Host-memory behaviour a layer-by-layer run depends on."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
UNIT_MMAP_THRESHOLD = 1 << 20  # between passes: every block of 1 MiB or more is a mapping of its own
# during a calibration pass: glibc's largest threshold on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX)
PASS_MMAP_THRESHOLD = 32 << 20
UNIT_TRIM_THRESHOLD = 128 << 10  # glibc's default: the free top of the heap above it goes back at once
PASS_TRIM_THRESHOLD = (1 << 31) - 1  # (mallopt takes an int) during a pass the heap keeps its top for the next forward


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _malloc_call(function: str, *args: int) -> int | None:
    """glibc's `function(*args)`; None off glibc."""
    try:
        return getattr(_glibc(), function)(*args)
    except AttributeError:  # no libc.so.6, or a libc without it
        return None


def return_freed_tensors_to_os() -> None:
    """Keep every tensor of 1 MiB or more in its own mapping, so freeing a layer gives its memory back.

    glibc raises its mmap threshold each time a large block is freed; after the first layer, layer-sized
    tensors then come from heap arenas that are not returned to the OS, and resident memory grows by about one
    layer per layer. Setting the threshold explicitly switches that adjustment off. No-op off glibc.
    """
    if _malloc_call("mallopt", _M_MMAP_THRESHOLD, UNIT_MMAP_THRESHOLD) == 0:
        logger.debug("mallopt(M_MMAP_THRESHOLD) refused; freed layers may stay resident")


@contextlib.contextmanager
def heap_for_temporaries() -> Iterator[None]:
    """Around a calibration pass: blocks below 32 MiB come from the heap, so each forward's temporaries reuse the
    memory the previous one freed, the heap's free top included, instead of faulting in a fresh mapping's pages on
    every use (with 1 MiB mappings the experts' quantized products took 1.7-5x as long, BENCHMARKS.md).
    Afterwards the threshold is back at 1 MiB and the heap's free pages go back to the OS (`malloc_trim`); what the
    pass keeps (the next unit's states, Hessians) stays where it is. No-op off glibc."""
    _malloc_call("mallopt", _M_MMAP_THRESHOLD, PASS_MMAP_THRESHOLD)
    _malloc_call("mallopt", _M_TRIM_THRESHOLD, PASS_TRIM_THRESHOLD)
    try:
        yield
    finally:
        _malloc_call("mallopt", _M_MMAP_THRESHOLD, UNIT_MMAP_THRESHOLD)
        _malloc_call("mallopt", _M_TRIM_THRESHOLD, UNIT_TRIM_THRESHOLD)
        _malloc_call("malloc_trim", 0)


def available_host_bytes() -> int | None:
    """The host memory the kernel says new allocations can take without swapping (`MemAvailable`), or None where
    it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
