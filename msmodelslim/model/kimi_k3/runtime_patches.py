"""Swap fla's Triton kernels for msmodelslim's pure-PyTorch ones at run time, without editing model files.

fla's KDA kernels are Triton: on CPU they fail ("0 active drivers"), on Ascend NPUs they time out on long sequences.
Two kinds of model code call them:

(a) remote code loaded by transformers from the weight directory (``transformers_modules.<dir>.modeling_kimi_k3``,
    written like the Kimi HF modeling file): it imports ``chunk_kda``, ``fused_recurrent_kda``, ``fused_kda_gate``,
    ``ShortConvolution``, ``FusedRMSNormGated`` (maybe ``l2norm``...) from fla. Functions are found by scanning the
    module's globals for objects defined in ``fla.*`` and replaced by name; fla's module classes get their
    ``forward``/``step`` replaced on the class itself, so instances built before AND after patching run our code.
(b) transformers' native ``transformers.models.kimi_linear.modeling_kimi_linear``: its kernel functions are
    wrapped at import time by ``use_kernel_func_from_hub_with_fallback``, which binds fla's kernel whenever fla is
    importable (the choice is frozen in the wrapper's closure). The robust override is to rebind the module globals
    the layer's ``forward`` looks up (``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``,
    ``causal_conv1d_fn``, ``causal_conv1d_update``) to our adapters (and any class attribute holding them).

Everything is undone exactly by ``PatchHandle.undo()`` (LIFO), or by leaving the ``runtime_patches`` context.
Policy (``should_patch``): always on CPU and NPU; on CUDA only when asked, so fla's Triton kernels stay in use there.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

from msmodelslim.ops import gated_norm, kda, short_conv

logger = logging.getLogger(__name__)

__all__ = [
    "PatchHandle",
    "apply_runtime_patches",
    "find_fla_modules",
    "runtime_patches",
    "should_patch",
]

_MISSING = object()


# ----------------------------------------------------------------------------------------------------------------------
# replacements


def _l2norm_module_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return kda.l2norm(x, getattr(self, "eps", 1e-6), getattr(self, "output_dtype", None))


def _rmsnorm_module_forward(self: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None,
                            prenorm: bool = False, residual_in_fp32: bool = False):
    h = x.float() if residual is None else x.float() + residual.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    if getattr(self, "weight", None) is not None:
        y = y * self.weight.float()
    if getattr(self, "bias", None) is not None:
        y = y + self.bias.float()
    y = y.to(x.dtype)
    if not prenorm:
        return y
    return y, h.to(torch.float32 if residual_in_fp32 else (residual.dtype if residual is not None else x.dtype))


# fla function name -> torch replacement (fla 0.4 and 0.6 call signatures)
FLA_FUNCTIONS: dict[str, Callable] = {
    "chunk_kda": kda.chunk_kda,
    "fused_recurrent_kda": kda.fused_recurrent_kda,
    "fused_kda_gate": kda.fused_kda_gate,
    "l2norm": kda.l2norm,
    "l2_norm": kda.l2norm,
    "causal_conv1d": short_conv.causal_conv1d,
    "causal_conv1d_update": short_conv.causal_conv1d_update,
    "rms_norm_gated": gated_norm.rms_norm_gated,
}

# fla module class name -> {method: torch replacement}; patched on fla's class (covers existing instances)
FLA_CLASS_METHODS: dict[str, dict[str, Callable]] = {
    "ShortConvolution": {"forward": short_conv.short_conv_forward, "step": short_conv.ShortConvolution.step},
    "FusedRMSNormGated": {"forward": gated_norm.gated_rmsnorm_forward},
    "L2Norm": {"forward": _l2norm_module_forward},
    "RMSNorm": {"forward": _rmsnorm_module_forward},
}


# transformers' native Kimi-Linear kernel entry points -> adapters to our kernels
def transformers_chunk_kimi_delta_attention(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                            output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                            **kwargs):
    """transformers' ``chunk_kimi_delta_attention`` contract ([B, T, H, D] in, ``(o, state | None)`` out).

    ``chunk_size`` is transformers' own tiling (always 64); ours picks its chunk per device (the result does not
    depend on it), so it is not passed on."""
    del chunk_size
    return kda.chunk_kda(query, key, value, g, beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         cu_seqlens=cu_seqlens)


def transformers_recurrent_kimi_delta_attention(query, key, value, g, beta, initial_state=None,
                                                output_final_state=False, use_qk_l2norm_in_kernel=False,
                                                cu_seqlens=None, **kwargs):
    """transformers' ``recurrent_kimi_delta_attention`` contract."""
    return kda.fused_recurrent_kda(query, key, value, g, beta, initial_state=initial_state,
                                   output_final_state=output_final_state,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def transformers_causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' ``causal_conv1d_fn``: hidden_states [B, D, T] (channels first), weight [D, W]."""
    y, _ = short_conv.causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation)
    return y.transpose(1, 2)


def transformers_causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
    """transformers' ``causal_conv1d_update``: hidden_states [B, D, T], conv_state [B, D, S] updated in place."""
    T, S = hidden_states.shape[-1], conv_state.shape[-1]
    w = weight.reshape(weight.shape[0], weight.shape[-1])
    full = torch.cat([conv_state, hidden_states.to(conv_state.dtype)], dim=-1)
    conv_state.copy_(full[..., -S:])
    y = torch.nn.functional.conv1d(full[..., -(w.shape[-1] - 1 + T):].float(), w.float().unsqueeze(1),
                                   None if bias is None else bias.float(), groups=w.shape[0])
    return short_conv._act(y, activation).to(hidden_states.dtype)


TRANSFORMERS_FUNCTIONS: dict[str, Callable] = {
    "chunk_kimi_delta_attention": transformers_chunk_kimi_delta_attention,
    "recurrent_kimi_delta_attention": transformers_recurrent_kimi_delta_attention,
    "causal_conv1d_fn": transformers_causal_conv1d_fn,
    "causal_conv1d_update": transformers_causal_conv1d_update,
}
TRANSFORMERS_KIMI_MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"


@contextmanager
def transformers_torch_fallback() -> Iterator[None]:
    """Run transformers' native Kimi-Linear on its own torch reference kernels (the functions under its
    "fla if importable" wrapper) instead of fla's: the independent reference our kernels are checked against."""
    import importlib

    native = importlib.import_module(TRANSFORMERS_KIMI_MODULE)
    saved = {name: getattr(native, name) for name in TRANSFORMERS_FUNCTIONS}
    for name, fn in saved.items():
        setattr(native, name, fn.__wrapped__)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(native, name, fn)


# ----------------------------------------------------------------------------------------------------------------------
# policy and bookkeeping


def should_patch(device_type: str | torch.device, config_switch: bool = False) -> bool:
    """Whether to run msmodelslim's torch kernels: always off CUDA (cpu, npu, ...: fla's Triton cannot run or times
    out there); on CUDA only when ``config_switch`` asks (fla's Triton kernels are the fast path there)."""
    kind = device_type.type if isinstance(device_type, torch.device) else str(device_type).split(":")[0].lower()
    if kind == "cuda":
        return bool(config_switch)
    return True


@dataclass
class PatchHandle:
    """What one ``apply_runtime_patches`` call changed; ``undo()`` restores it (idempotent). Usable as a context."""

    changes: list[tuple[Any, str, Any]] = field(default_factory=list)  # (owner, attribute, previous value)

    def _set(self, owner: Any, name: str, value: Any) -> None:
        previous = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        if previous is value:
            return
        self.changes.append((owner, name, previous))
        setattr(owner, name, value)

    @property
    def patched(self) -> list[str]:
        return [f"{getattr(o, '__name__', o)}.{n}" for o, n, _ in self.changes]

    def undo(self) -> None:
        while self.changes:
            owner, name, previous = self.changes.pop()
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def _is_fla(obj: Any) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    return mod == "fla" or mod.startswith("fla.")


def _patch_fla_class(handle: PatchHandle, cls: type) -> None:
    for base in cls.__mro__:
        methods = FLA_CLASS_METHODS.get(base.__name__)
        if methods and _is_fla(base):
            for name, fn in methods.items():
                handle._set(base, name, fn)


def _patch_module(handle: PatchHandle, module: ModuleType) -> None:
    namespace = vars(module)
    inside_fla = module.__name__ == "fla" or module.__name__.startswith("fla.")
    for name, value in list(namespace.items()):
        if isinstance(value, type) and _is_fla(value):
            _patch_fla_class(handle, value)
        elif not inside_fla and callable(value) and _is_fla(value):
            replacement = FLA_FUNCTIONS.get(getattr(value, "__name__", name))
            if replacement is not None:
                handle._set(module, name, replacement)
    # transformers' native Kimi-Linear (any version that defines these entry points in the module)
    originals = {}
    for name, adapter in TRANSFORMERS_FUNCTIONS.items():
        value = namespace.get(name)
        if callable(value) and (getattr(value, "__module__", "") or "").startswith("transformers."):
            originals[id(value)] = adapter
            handle._set(module, name, adapter)
    if originals:  # classes of that module holding the wrapped kernels as attributes (hub-kernel decorators)
        for value in list(namespace.values()):
            if isinstance(value, type) and value.__module__ == module.__name__:
                for attr, held in list(vars(value).items()):
                    if id(held) in originals:
                        handle._set(value, attr, originals[id(held)])


def find_fla_modules(model: nn.Module) -> list[ModuleType]:
    """The Python modules whose classes make up ``model`` (its submodules' classes and their bases), excluding
    torch's own; these are the modules to hand to :func:`apply_runtime_patches`."""
    seen: dict[str, ModuleType] = {}
    for sub in model.modules():
        for cls in type(sub).__mro__:
            name = cls.__module__
            if name in seen or name == "builtins" or name == "torch" or name.startswith("torch."):
                continue
            module = sys.modules.get(name)
            if module is not None:
                seen[name] = module
    return list(seen.values())


def _default_modules() -> list[ModuleType]:
    found = []
    for name, module in list(sys.modules.items()):
        if module is None:
            continue
        if name == TRANSFORMERS_KIMI_MODULE or name.startswith("transformers_modules."):
            found.append(module)
    return found


def apply_runtime_patches(
    modules: Iterable[ModuleType] | ModuleType | nn.Module | None = None,
    device_type: str | torch.device = "cpu",
    force: bool = False,
) -> PatchHandle:
    """Swap in msmodelslim's torch kernels for fla's in ``modules`` (a model is expanded with
    :func:`find_fla_modules`; None = transformers' native Kimi-Linear module and every loaded remote-code module).

    Nothing is changed when :func:`should_patch` says no (CUDA without ``force``). Returns a handle to undo.
    """
    handle = PatchHandle()
    if not should_patch(device_type, force):
        logger.info("runtime patches: keeping fla kernels on %s", device_type)
        return handle
    if modules is None:
        modules = _default_modules()
    elif isinstance(modules, nn.Module):
        modules = find_fla_modules(modules)
    elif isinstance(modules, ModuleType):
        modules = [modules]
    for module in modules:
        if not isinstance(module, ModuleType):
            raise TypeError(f"apply_runtime_patches: expected Python modules, got {type(module).__name__}")
        _patch_module(handle, module)
    logger.info("runtime patches on %s: %d replacements (%s)", device_type, len(handle.changes),
                ", ".join(handle.patched) or "none")
    return handle


@contextmanager
def runtime_patches(
    modules: Iterable[ModuleType] | ModuleType | nn.Module | None = None,
    device_type: str | torch.device = "cpu",
    force: bool = False,
) -> Iterator[PatchHandle]:
    """Context manager form of :func:`apply_runtime_patches`; undoes the patches on exit."""
    handle = apply_runtime_patches(modules, device_type, force)
    try:
        yield handle
    finally:
        handle.undo()
