"""The Ascend op check: every op the toolkit places on the run's device, held against Atlas A2/A3's rules.

With `MSMODELSLIM_ASCEND_CHECK=1` a run on any device (CPU, CUDA or NPU) watches every aten op of the layer loop
(load, process, calibrate, save, in the prefetch thread too) and every collective, and fails at the first one an
A2/A3 NPU could not run, with one line naming the op, the dtype and the toolkit's file:line:

- a float64 or complex tensor on the device (aclnn's matrix and sort kernels take FLOAT16, FLOAT32, BFLOAT16;
  HCCL refuses float64 except on Ascend 950), or an fp8 tensor (A2/A3 have none). complex64 is refused only in
  the toolkit's own code: the checkpoint's code may use the complex ops torch_npu implements (MoonViT's rotary);
- an op with a dtype table of its own (`dtype_rules`: mm, bmm, sort, ...) given another dtype;
- an aten op with no NPU kernel (in neither op-plugin's nor torch_npu's function list, and not composite; a
  CUDA-only variant torch picks for a composite op counts as its NPU counterpart, `cuda_variants`);
- a collective whose dtype HCCL does not take.

The rules are data, `ascend_a2a3_rules.json` beside this file, built from the public op-plugin and torch_npu
sources it cites (commits and file:line inside). Which ops count as device work is `core/placement.py`'s rule:
on an accelerator run, ops that touch a tensor on the accelerator; on a CPU run, every op outside a
`host_section` (the CPU stands in for the device there); never a `not_on_npu` branch. Ops on meta tensors compute
nothing and are skipped.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from msmodelslim.core.placement import in_host_section, in_non_npu_branch
from msmodelslim.errors import UserError

ENV = "MSMODELSLIM_ASCEND_CHECK"
RULES_FILE = Path(__file__).with_name("ascend_a2a3_rules.json")
_PACKAGE = Path(__file__).resolve().parents[1]  # .../msmodelslim
_SELF = {str(Path(__file__).resolve()), str(Path(__file__).with_name("placement.py").resolve())}
_DIST = str(Path(__file__).with_name("dist.py").resolve())  # a collective is named by who asked for it


class AscendOpViolation(UserError):
    """An op or collective that an Atlas A2/A3 NPU cannot run."""


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def rules() -> dict[str, Any]:
    data = json.loads(RULES_FILE.read_text(encoding="utf-8"))
    return {
        "npu_ops": frozenset(data["npu_ops"]),
        "forbidden": {getattr(torch, n): why for n, why in data["forbidden_dtypes"].items() if hasattr(torch, n)},
        "dtype_rules": {op: (frozenset(r["allowed"]), r["source"]) for op, r in data["dtype_rules"].items()
                        if r.get("allowed")},
        "cuda_variants": frozenset(data["cuda_variants"]["ops"]),
        "collectives": {op: frozenset(d) for op, d in data["hccl"]["dtypes"].items()},
        "hccl_source": data["hccl"]["source"],
    }


def toolkit_frame(skip: frozenset[str] = frozenset()) -> str:
    """`msmodelslim/path.py:line` of the innermost toolkit frame below the check (the code that placed the op)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path not in _SELF and path not in skip and path.startswith(str(_PACKAGE)):
            return f"{Path(path).relative_to(_PACKAGE.parent)}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside the toolkit"


# The checkpoint's own code may compute in complex where torch_npu has the kernels (MoonViT's rotary embedding
# uses polar / view_as_complex, both in torch_npu's list); the toolkit's own code may not.
_MODEL_MAY_USE = frozenset({torch.complex64})
_TORCH = str(Path(torch.__file__).resolve().parent)


def _toolkit_placed() -> bool:
    """Whether the innermost Python frame outside torch (the code that issued the op) is the toolkit's."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path not in _SELF and not path.startswith(_TORCH):
            return path.startswith(str(_PACKAGE))
        frame = frame.f_back
    return False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Check:
    """The process's check: which device is the run's, and the first violation (kept should a caller swallow
    the exception)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rules = rules()
        self.first: AscendOpViolation | None = None
        self.checked = 0  # device ops examined
        self.lock = threading.Lock()
        self._static: dict[Any, tuple[str, frozenset[str] | None, str | None, bool]] = {}  # per op overload
        self._passed: set[tuple[Any, frozenset[torch.dtype]]] = set()  # (op overload, device dtypes) that passed

    def exempt(self) -> bool:
        """Code the NPU never runs: a branch of another device type, or host work (what tells it apart on a CPU
        run; on an accelerator run host tensors are not the device's anyway)."""
        return in_non_npu_branch() or (self.device.type == "cpu" and in_host_section())

    def device_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors of one op that live on the device (placement.py's rule)."""
        return [] if self.exempt() else [t for t in tensors if t.device.type == self.device.type]

    def fail(self, message: str, skip: frozenset[str] = frozenset()) -> None:
        err = AscendOpViolation(f"Ascend op check: {message} at {toolkit_frame(skip)}")
        with self.lock:
            if self.first is None:
                self.first = err
        raise err

    def op(self, func: Any, tensors: list[torch.Tensor]) -> None:
        if self.exempt():
            return
        kind = self.device.type
        dtypes = frozenset(t.dtype for t in tensors if t.device.type == kind)
        if not dtypes:
            return
        self.checked += 1
        if (func, dtypes) in self._passed:  # the verdict depends on the op and its dtypes only
            return
        rule = self._static.get(func)
        if rule is None:
            rule = self._static[func] = self._op_rule(func)
        name, allowed, source, has_kernel = rule
        forbidden = self.rules["forbidden"]
        model_may_use = False
        for dtype in dtypes:
            why = forbidden.get(dtype)
            if why is not None:
                if dtype not in _MODEL_MAY_USE or _toolkit_placed():
                    self.fail(f"{name} on {_dtype_name(dtype)} on the device ({why})")
                model_may_use = True  # allowed for this caller only: not cached
            if allowed is not None and dtype.is_floating_point and _dtype_name(dtype) not in allowed:
                self.fail(f"{name} on {_dtype_name(dtype)}: the NPU kernel takes {', '.join(sorted(allowed))} "
                          f"({source})")
        if not has_kernel:
            self.fail(f"{name} has no NPU kernel (not in op-plugin's or torch_npu's function lists)")
        if not model_may_use:
            self._passed.add((func, dtypes))

    def _op_rule(self, func: Any) -> tuple[str, frozenset[str] | None, str | None, bool]:
        """What the rules say of one op, whatever its tensors: (name, allowed float dtypes, source, has a kernel)."""
        packet = func.overloadpacket.__name__
        name = f"{func.namespace}.{packet}"
        if func.namespace != "aten":
            return name, None, None, True
        allowed, source = self.rules["dtype_rules"].get(packet, (None, None))
        kernel = packet in self.rules["npu_ops"] or packet in self.rules["cuda_variants"] \
            or _is_composite(func.name())
        return name, allowed, source, kernel

    def collective(self, op: str, dtype: torch.dtype) -> None:
        allowed = self.rules["collectives"][op]
        if _dtype_name(dtype) not in allowed:
            self.fail(f"{op} of {_dtype_name(dtype)}: HCCL on A2/A3 takes {', '.join(sorted(allowed))} "
                      f"({self.rules['hccl_source']})", skip=frozenset({_DIST}))


@functools.cache
def _is_composite(qualified: str) -> bool:
    """An op with a CompositeExplicitAutograd kernel runs on any backend through the ops it decomposes into."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeExplicitAutograd")
    except RuntimeError:
        return False


class _Mode(TorchDispatchMode):
    def __init__(self, check: _Check) -> None:
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.check.op(func, _tensors(args, kwargs.values(), (out,)))  # once per op: inputs and results
        return out


def _tensors(*groups: Any) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results (one level of lists and tuples, as aten ops take them)."""
    found = []
    for group in groups:
        for a in group:
            if isinstance(a, torch.Tensor):
                found.append(a)
            elif isinstance(a, (list, tuple)):
                found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


_active: _Check | None = None


def start(device: torch.device) -> None:
    """Turn the check on for this process (one rank), for `device`, the run's device."""
    global _active
    _active = _Check(device)


def stop() -> None:
    global _active
    _active = None


@contextmanager
def watching() -> Iterator[None]:
    """Watch the ops of the enclosed code on this thread, when the check is on (else nothing)."""
    check = _active
    if check is None:
        yield
        return
    with _Mode(check):
        yield
    if check.first is not None:  # raised inside code that swallowed it
        raise check.first


def check_collective(op: str, dtype: torch.dtype) -> None:
    """Refuse a collective HCCL cannot carry on A2/A3 (called by core/dist for every collective)."""
    if _active is not None:
        _active.collective(op, dtype)


@contextmanager
def run_checked(device: torch.device, on: bool, report: dict[str, Any]) -> Iterator[None]:
    """The check over one rank's run when `on` (the launcher's `enabled()`); `report["ascend_ops_checked"]`
    says how many device ops it examined."""
    if not on:
        yield
        return
    start(device)
    check = _active
    try:
        with watching():
            yield
    finally:
        report["ascend_ops_checked"] = check.checked
        stop()
