"""Host-memory behaviour a layer-by-layer run depends on."""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def return_freed_tensors_to_os(threshold_bytes: int = 1 << 20) -> None:
    """Keep every tensor of 1 MiB or more in its own mapping, so freeing a layer gives its memory back.

    glibc raises its mmap threshold each time a large block is freed; after the first layer, layer-sized
    tensors then come from heap arenas that are not returned to the OS, and resident memory grows by about one
    layer per layer. Setting the threshold explicitly switches that adjustment off. No-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes)
    except (OSError, AttributeError):
        return
    if not ok:
        logger.debug("mallopt(M_MMAP_THRESHOLD) refused; freed layers may stay resident")


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
