"""Finiteness of the calibration activations: the outputs of every calibration pass of a unit are checked (one
reduction per tensor on the device, read without waiting for the work queued after it: `finite_later`). A NaN or Inf
found there is traced to the first module that made it from finite inputs, by one more forward of that record with
hooks, so the error names the unit, the module and the likely cause instead of surfacing later as a linear-algebra
failure or as a silent NaN scale."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from msmodelslim.core.placement import to_host
from msmodelslim.errors import UserError


class NonFiniteActivations(UserError):
    """Calibration activations became NaN / Inf: the run cannot continue with this input (its state is dropped)."""


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a sample's state (in dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


def all_finite(value: Any) -> torch.Tensor | None:
    """A device bool: every floating value of the state is finite (None: it holds no floating tensor)."""
    flags = [torch.isfinite(t).all() for t in tensors(value) if t.is_floating_point()]
    return torch.stack(flags).all() if flags else None


def finite_later(value: Any) -> Callable[[], bool]:
    """`all_finite(value)` as a reader to call later: on CUDA the flag goes to pinned host memory behind the work
    queued so far and an event marks its arrival, so reading it waits for that work only, not for what was queued
    since (the next sample's forward); elsewhere the flag itself (a CPU computes in line; an NPU rank's copies to the
    host already wait for the device)."""
    flag = all_finite(value)
    if flag is None:
        return lambda: True
    if flag.device.type != "cuda":
        return lambda: bool(flag)
    host = to_host(flag)
    arrived = torch.cuda.Event()
    arrived.record()

    def read() -> bool:
        arrived.synchronize()
        return bool(host)

    return read


def first_non_finite_module(module: nn.Module, forward: Callable[[], Any]) -> str | None:
    """The qualified name of the first module (in call order) whose output is not finite although its inputs
    are; None when every module's inputs were already non-finite or none went wrong."""
    culprit: list[str] = []

    def hook(name: str) -> Callable[..., None]:
        def check(mod: nn.Module, args: Any, output: Any) -> None:
            if culprit:
                return
            inputs, outputs = all_finite(args), all_finite(output)
            if outputs is not None and not bool(outputs) and (inputs is None or bool(inputs)):
                culprit.append(name)
        return check

    handles = [m.register_forward_hook(hook(name or type(module).__name__)) for name, m in module.named_modules()]
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return culprit[0] if culprit else None


def non_finite_error(unit_name: str, record: int, culprit: str | None, dtype: torch.dtype) -> NonFiniteActivations:
    where = f"module {culprit}" if culprit else "a module"
    return NonFiniteActivations(
        f"unit {unit_name}: calibration activations became NaN/Inf in {where} (record {record} of this rank); "
        f"likely cause: a weight or config value out of range for {str(dtype).removeprefix('torch.')} (a norm's "
        "epsilon, a scale that overflows), or a calibration record the model cannot take")
