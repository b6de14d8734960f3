"""Where a computation runs: on the run's device (the default) or, deliberately, on the host.

Everything the runner does to a unit happens on the run's device, which on an Ascend NPU means what the NPU's
operators accept (docs/npu.md). A few computations are meant for the host instead: Cholesky factors and their
inverse (Ascend has no `cholesky_inverse` kernel), tables built once in float64 (Hadamard matrices, the MXFP4
decode table), and writing the output. They run inside `host_section(...)`, which names why:

    with host_section("GPTQ: Cholesky factor of H^-1 (Ascend has no cholesky_inverse)"):
        host = h.to("cpu", torch.float64)
        ...

The section is the design, not an annotation: code in it moves its inputs to the CPU itself and its results back,
and the Ascend op check (`core/ascend_check.py`) exempts exactly the CPU ops inside it. On a CPU run the host and
the device are the same processor, so the section is the only thing that tells the two apart: there every op
outside a section counts as device work and is checked.

A branch that a device type other than the NPU takes instead of the NPU's path (the CPU's int32 GEMM, CUDA's
Cholesky) runs inside `not_on_npu("why")`: an NPU never executes it, so the check exempts it too.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

_state = threading.local()
F = TypeVar("F", bound=Callable[..., Any])
HOST = torch.device("cpu")


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory; from CUDA into pinned memory, asynchronously (synchronize the device before the host
    reads it; a copy back to the device on the same stream needs no wait). A host tensor is returned as it is."""
    if t.device.type == "cuda":
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
    return t.to(HOST)


def in_host_section() -> bool:
    """True inside `host_section` on this thread."""
    return getattr(_state, "depth", 0) > 0


@contextmanager
def host_section(reason: str) -> Iterator[None]:
    """Mark the enclosed computation as host work (`reason` says, to the reader, why it belongs there)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def on_host(reason: str) -> Callable[[F], F]:
    """Decorator form of `host_section` for a function that is host work as a whole."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with host_section(reason):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def in_non_npu_branch() -> bool:
    """True inside `not_on_npu` on this thread."""
    return getattr(_state, "branch", 0) > 0


@contextmanager
def not_on_npu(reason: str) -> Iterator[None]:
    """Mark a device-specific branch that an NPU never takes (`reason` names the branch an NPU takes instead)."""
    _state.branch = getattr(_state, "branch", 0) + 1
    try:
        yield
    finally:
        _state.branch -= 1
