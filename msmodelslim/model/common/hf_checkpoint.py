"""A Hugging Face weight directory as the toolkit reads it, for any model family.

The model code is never ours: `HFCheckpoint` resolves the directory's own class (remote code with
`trust_remote_code`, or transformers' native class), builds it on the meta device, and opens the tensors lazily.
Which stored tensors make which unit is the family's layout (`CheckpointLayout`); with it, one walk over a unit's
tensor slots serves both the header check before any compute and the strict load of the unit, with one error type
(`CheckpointError`, naming the file and the tensor), and one walk writes a processed unit back out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import transformers
from torch import nn
from transformers import AutoConfig
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from msmodelslim.errors import UserError
from msmodelslim.model.base import Unit
from msmodelslim.quant.attention import AttentionFakeQuant
from msmodelslim.quant.modules import QuantLinear
from msmodelslim.source.checkpoint import CheckpointError, open_checkpoint
from msmodelslim.source.quant_scheme import text_part

FLOAT_STORAGE = frozenset({"BF16", "F16", "F32", "F64"})  # safetensors dtypes a float parameter may load from


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@dataclass(frozen=True)
class ConfigView:
    """config.json, read once: the mapping as stored and its text part (`text_config` of a multimodal config)."""

    file: Path
    raw: dict[str, Any]

    @classmethod
    def read(cls, model_path: Path) -> ConfigView:
        file = Path(model_path) / "config.json"
        if not file.is_file():
            raise UserError(f"{model_path}: no config.json (is --model_path a weight directory?)")
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{file}: not valid JSON ({one_line(exc)})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{file}: expected a JSON object at the top level, got {type(raw).__name__}")
        return cls(file, raw)

    @property
    def text(self) -> dict[str, Any]:
        return text_part(self.raw)

    @property
    def text_where(self) -> str:
        """The key prefix of the text part in messages (`text_config.` or nothing)."""
        return "text_config." if self.text is not self.raw else ""


def model_class(config: Any, model_path: Path, trust_remote_code: bool) -> type[nn.Module]:
    """The class config.json names: remote code from `auto_map` (only with `trust_remote_code`), else transformers'."""
    arch = (getattr(config, "architectures", None) or [None])[0]
    if not arch:
        raise UserError(f"{model_path / 'config.json'}: no 'architectures' entry")
    auto_map = getattr(config, "auto_map", None) or {}
    refs = [v for v in auto_map.values() if isinstance(v, str) and v.rsplit(".", 1)[-1] == arch]
    if refs:
        if not trust_remote_code:
            raise UserError(f"{model_path} ships its own model code ({refs[0]}); pass --trust_remote_code True")
        return get_class_from_dynamic_module(refs[0], str(model_path))
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise UserError(f"{model_path / 'config.json'}: architecture {arch!r} is neither in auto_map nor in "
                        f"transformers {transformers.__version__}")
    return cls


def tensor_slots(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, bool]]:
    """(live name, owning module, attribute, is_parameter) of every parameter and persistent buffer."""
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for attr, value in mod._parameters.items():
            if value is not None:
                yield prefix + attr, mod, attr, True
        for attr, value in mod._buffers.items():
            if value is not None and attr not in mod._non_persistent_buffers_set:
                yield prefix + attr, mod, attr, False


class CheckpointLayout(Protocol):
    """What `HFCheckpoint` needs of a family's layout (model/kimi_k3/layout.py is one)."""

    def units(self) -> list[Unit]: ...

    def unit_module(self, unit: Unit) -> nn.Module: ...

    def unit_prefixes(self, unit: Unit) -> list[str]:
        """Checkpoint-name prefixes of the unit's stored tensors."""

    def tensor_names(self, unit: Unit, live_name: str, source: bool) -> list[str]:
        """The stored tensors one live tensor is made of (several are concatenated on dim 0), by their names in
        the source checkpoint (`source`) or as the serving engine names them (our output)."""

    def stray_reason(self, name: str) -> str | None:
        """Why a stored tensor no module of this rank's model takes is an error, or None when another rank loads
        it (an expert outside this rank's range)."""


class HFCheckpoint:
    """A weight directory: its config (`view`, and transformers' parse of it), the model built on meta from the
    directory's own class, and the lazy tensor reader."""

    def __init__(self, model_path: str | Path, trust_remote_code: bool, dtype: torch.dtype) -> None:
        self.model_path = Path(model_path)
        self.dtype = dtype
        self.view = ConfigView.read(self.model_path)
        try:
            self.config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:
            raise UserError(f"{self.view.file}: cannot be read as a model configuration: {one_line(exc)}") from None
        self.reader = open_checkpoint(self.model_path, config=self.view.raw)
        cls = model_class(self.config, self.model_path, trust_remote_code)
        try:
            with torch.device("meta"):
                self.model = cls._from_config(self.config, dtype=dtype)
        except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, RuntimeError) as exc:
            raise UserError(f"{self.view.file}: {cls.__name__} cannot be built from it: {one_line(exc)}") from None
        self.model.eval()

    # --- the one walk ------------------------------------------------------------------------------------------
    def _slots(self, layout: CheckpointLayout, unit: Unit, module: nn.Module, available: set[str], source: bool,
               ) -> Iterator[tuple[str, nn.Module, str, bool, list[str]]]:
        """Every tensor slot of `unit` with the stored names that fill it; a name not stored is an error."""
        for live_name, owner, attr, is_param in tensor_slots(module):
            names = layout.tensor_names(unit, live_name, source)
            for name in names:
                if name not in available:
                    raise CheckpointError(f"{self.model_path}: tensor {name!r} of unit {unit.name} is missing "
                                          f"from the checkpoint")
            yield live_name, owner, attr, is_param, names

    def _check_strays(self, layout: CheckpointLayout, keys: list[str]) -> None:
        for key in keys:
            reason = layout.stray_reason(key)
            if reason is not None:
                where = self.reader.file_of(key) if key in self.reader else self.model_path
                raise CheckpointError(f"{where}: tensor {key} {reason}")

    def check(self, layout: CheckpointLayout) -> None:
        """Headers only, before any compute: every tensor each unit needs is stored with its shape and a usable
        dtype (MXFP4 codes and scales consistent), and every stored tensor belongs to a module of the model."""
        reader = self.reader
        available = set(reader.keys())
        expected: set[str] = set()
        for unit in layout.units():
            for _, owner, attr, _, names in self._slots(layout, unit, layout.unit_module(unit), available, True):
                expected.update(names)
                current = getattr(owner, attr)
                for name in names:
                    if reader.is_mxfp4(name):
                        reader.check_mxfp4_layout(name)
                    elif current.is_floating_point() and reader.stored_dtype(name) not in FLOAT_STORAGE:
                        raise CheckpointError(f"{reader.file_of(name)}: tensor {name} is stored as "
                                              f"{reader.stored_dtype(name)}; the model expects a float tensor")
                shapes = [reader.shape(n) for n in names]
                shape = shapes[0] if len(shapes) == 1 else (sum(s[0] for s in shapes), *shapes[0][1:])
                if shape != tuple(current.shape):
                    raise CheckpointError(f"{reader.file_of(names[0])}: tensor {names[0]} has shape {shape}; "
                                          f"{type(self.model).__name__} expects {tuple(current.shape)} (from "
                                          f"config.json)")
        self._check_strays(layout, sorted(available - expected))
        reader.close()

    def load(self, layout: CheckpointLayout, unit: Unit, device: torch.device, reader: Any = None) -> nn.Module:
        """The unit's module (shared with the meta skeleton) with every tensor read from `reader` (the source
        checkpoint by default; any other, an AscendV1 output, is read by serving names), strictly."""
        reader = reader or self.reader
        source = reader is self.reader
        available = set(reader.keys())
        module = layout.unit_module(unit)
        persistent = {name for name, *_ in tensor_slots(module)}
        for name, buf in module.named_buffers():
            if buf.is_meta and name not in persistent:
                raise RuntimeError(f"unit {unit.name}: non-persistent buffer {name!r} cannot be rebuilt from the "
                                   f"checkpoint; the adapter must recompute it")
        expected: set[str] = set()
        for _, owner, attr, is_param, names in self._slots(layout, unit, module, available, source):
            expected.update(names)
            parts = [self._read_tensor(reader, unit, n, device) for n in names]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                tensor = tensor.to(self.dtype)
            current = getattr(owner, attr)
            if tuple(tensor.shape) != tuple(current.shape):
                raise CheckpointError(f"{names[0]}: stored shape {tuple(tensor.shape)} != model shape "
                                      f"{tuple(current.shape)}")
            if is_param:
                owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            else:
                owner._buffers[attr] = tensor
        prefixes = layout.unit_prefixes(unit)
        self._check_strays(layout, sorted(k for k in available - expected if any(k.startswith(p) for p in prefixes)))
        if source:
            self.reader.close()  # unmap the shards: their pages would otherwise stay resident for the whole run
        return module

    def _read_tensor(self, reader: Any, unit: Unit, name: str, device: torch.device) -> torch.Tensor:
        """One tensor of `unit`; what only the data can show (a truncated body, an E8M0 NaN scale, NaN/Inf
        weights) is a CheckpointError naming the unit, the file and the tensor."""
        where = reader.file_of(name) if hasattr(reader, "file_of") else self.model_path
        try:
            tensor = reader.get(name, device)
        except UserError:  # a CheckpointError, or the Ascend op check: already one line
            raise
        except (ValueError, RuntimeError, OSError) as exc:
            raise CheckpointError(f"{where}: tensor {name} of unit {unit.name} cannot be read: "
                                  f"{one_line(exc)}") from None
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"{where}: tensor {name} of unit {unit.name} has {bad} non-finite value(s) "
                                  f"(NaN/Inf); refusing to quantize it")
        return tensor

    # --- the save walk -----------------------------------------------------------------------------------------
    @staticmethod
    def saved_state(layout: CheckpointLayout, unit: Unit, module: nn.Module, checkpoint_name: Any,
                    ) -> Iterator[tuple[str, Any]]:
        """(serving name, tensor or quantized module) of everything the output holds of a processed unit: each
        QuantLinear / attention quantizer as one piece, every other tensor by its serving names (a fused live
        tensor split back into its stored parts)."""
        modules = list(module.named_modules())
        quantized = [name for name, m in modules if isinstance(m, QuantLinear)]
        for name, mod in modules:
            if isinstance(mod, (QuantLinear, AttentionFakeQuant)):
                yield checkpoint_name(unit, name), mod
        for live_name, owner, attr, _ in tensor_slots(module):
            owner_name = live_name.rsplit(".", 1)[0] if "." in live_name else ""
            if any(owner_name == q or owner_name.startswith(q + ".") for q in quantized):
                continue
            tensor = getattr(owner, attr)
            names = layout.tensor_names(unit, live_name, source=False)
            parts = tensor.chunk(len(names), dim=0) if len(names) > 1 else [tensor]
            yield from zip(names, parts)
