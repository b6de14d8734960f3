"""A Triton kernel in place of PyTorch passes (CUDA), held to them.

Its first result in a process is compared with the passes' by the caller's check; a kernel that cannot be built on
this GPU (Triton's compiler) or fails that check leaves the work to the passes for the rest of the process, and the
log says so once. The passes compute the same thing, only with more launches or passes over memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class CheckedKernel:
    """`run(kernel, check)`: kernel()'s result, or None where the caller runs its passes instead."""

    def __init__(self, what: str, instead: str, logger: logging.Logger) -> None:
        self.what = what  # the work, as the warning names it
        self.instead = instead  # what the run does from then on
        self.logger = logger
        self.enabled = True  # off: the passes (a failed kernel, or a benchmark comparing the two)
        self.checked = False  # the first result in this process passed its check

    def run(self, kernel: Callable[[], T], check: Callable[[T], str | None]) -> T | None:
        """None when off, when the kernel raises (other than for memory), or when `check` of its first result says
        why it is wrong (then off from now on, said once)."""
        if not self.enabled:
            return None
        try:
            found = kernel()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a compiler failure of the kernel: the passes do the same work
            why = f"failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        else:
            if self.checked:
                return found
            why = check(found)
            if why is None:
                self.checked = True
                return found
        self.enabled = False
        self.logger.warning("%s: the Triton kernel %s; %s", self.what, why, self.instead)
        return None
