"""`HFModelAdapter`: a ModelAdapter over a Hugging Face weight directory, for any family.

It joins three pieces: the shared checkpoint layer (`HFCheckpoint`: the directory's own class built on meta, the
header check, the strict load of a unit, the save walk), the family's layout (units, names, maps, the state between
units: a pure object built from the model) and the family's run-time patches (one context, undone by `close`).
A family adapter says which layout and which patches, plus what only it knows (config checks, image samples, the
output config); everything else the runner and processors ask is answered here by the layout or the checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from msmodelslim.core.dist import SINGLE, DistContext
from msmodelslim.errors import UserError
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.model.common.expert_parallel import resolve_expert_ep_range
from msmodelslim.model.common.hf_checkpoint import HFCheckpoint
from msmodelslim.model.facts import ModelFacts

logger = logging.getLogger(__name__)


class HFModelAdapter(ModelAdapter):
    """Subclasses give `make_layout` (and `patches` if they patch the model's classes). Construction checks the
    checkpoint's headers against the layout (names, shapes, dtypes, MXFP4 layout, strays) before any compute."""

    def __init__(self, model_path: str | Path, trust_remote_code: bool = False, dist: DistContext = SINGLE,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(model_path, trust_remote_code)
        self._dropped_kinds: set[str] = set()  # unit kinds left out of the run (drop_units)
        self.dist = dist
        self.dtype = dtype
        self.checkpoint = HFCheckpoint(self.model_path, trust_remote_code, dtype)
        self.model = self.checkpoint.model
        self.config = self.checkpoint.config
        self.text_config = self.config.get_text_config()
        self.reader = self.checkpoint.reader
        self._undo = contextlib.ExitStack()
        self._tokenizer: Any = None
        try:
            self.check_built_config()
            self.patched = self._undo.enter_context(self.patches(self.model))
            self.layout = self.make_layout(self.model)
            self.checkpoint.check(self.layout)
        except BaseException:
            self._undo.close()
            raise

    # --- what a family gives ---------------------------------------------------------------------------------
    def make_layout(self, model: nn.Module) -> Any:
        """The family's layout of `model` (after `patches` are in: an EP patch changes the experts' modules)."""
        raise NotImplementedError

    def check_built_config(self) -> None:
        """Refuse (UserError naming config.json) values the config class built from it that the family's code
        cannot use, e.g. a field spelled in a way the class does not read."""

    def patches(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """The run-time patches of the model's own classes, as one context (none by default)."""
        return contextlib.nullcontext()

    def carried_state(self) -> tuple[int, tuple[str, ...]]:
        """[hidden] tensors per token the samples' state carries between units, and what they are in words (the
        hidden state alone unless the family passes more along)."""
        return 1, ("hidden states",)

    @property
    def facts(self) -> ModelFacts:
        """From config.json as read once (`HFCheckpoint.view`), with the units left in the run."""
        return ModelFacts.from_config(self.checkpoint.view.raw, self.dtype.itemsize, *self.carried_state())

    def expert_range(self, num_experts: int) -> range:
        """The routed experts this rank holds under expert parallelism."""
        return resolve_expert_ep_range(num_experts, self.dist.rank, self.dist.world_size)

    def close(self) -> None:
        """Undo the patches of the checkpoint's classes (idempotent)."""
        self._undo.close()

    # --- structure and names: the layout ---------------------------------------------------------------------
    def serving_model_type(self) -> str | None:
        return self.config.model_type

    def units(self) -> list[Unit]:
        return [unit for unit in self.layout.units() if unit.kind not in self._dropped_kinds]

    def drop_units(self, kind: str) -> list[Unit]:
        """Leave the units of `kind` out of everything that follows (a practice's `spec.mtp: drop`): they are
        neither calibrated nor processed nor written. Returns those dropped."""
        dropped = [unit for unit in self.units() if unit.kind == kind]
        self._dropped_kinds.add(kind)
        self.__dict__.pop("_linear_walk", None)  # the walk of the model's linears, made again without them
        return dropped

    def unit_module(self, unit: Unit) -> nn.Module:
        return self.layout.unit_module(unit)

    def checkpoint_name(self, unit: Unit, live_name: str) -> str:
        return self.layout.checkpoint_name(unit, live_name)

    def is_rank_local(self, name: str) -> bool:
        return self.layout.is_rank_local(name)

    def reads_routed_experts(self, live_name: str) -> bool:
        return self.layout.reads_routed_experts(live_name)

    def forward_unit(self, unit: Unit, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        return self.layout.forward_unit(unit, module, state)

    def idle_unit(self, unit: Unit, module: nn.Module) -> None:
        self.layout.idle_unit(unit, module)

    # --- loading and saving: the checkpoint layer ------------------------------------------------------------
    def load_unit(self, unit: Unit, device: torch.device, reader: Any = None) -> nn.Module:
        """`reader` defaults to the source checkpoint; any other (an AscendV1 output) is read by serving names."""
        return self.checkpoint.load(self.layout, unit, device, reader)

    def checkpoint_state(self, unit: Unit, module: nn.Module) -> Iterator[tuple[str, Any]]:
        return self.checkpoint.saved_state(self.layout, unit, module, self.checkpoint_name)

    def source_mxfp4(self, unit: Unit, live_name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        names = self.layout.tensor_names(unit, f"{live_name}.weight", source=True)
        if len(names) != 1 or names[0] not in self.reader or not self.reader.is_mxfp4(names[0]):
            return None
        return self.reader.mxfp4_bytes(names[0])

    def stores_mxfp4(self, name: str) -> bool:
        return f"{name}.weight" in self.reader and self.reader.is_mxfp4(f"{name}.weight")

    # --- calibration samples ---------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                self.model_path, trust_remote_code=self.trust_remote_code)
        return self._tokenizer

    def image_sample(self, record: Any) -> tuple[dict[str, torch.Tensor], int]:
        """Model inputs of an image record, and how many of its first tokens a length cap must keep (its image
        tokens). A text-only model refuses image records."""
        raise UserError(f"calibration record with image {record.image} given to text-only model "
                        f"{self.model_path}; use a text dataset")

    def prepare_samples(self, records: list[Any], max_seq_len: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Model inputs per record, each cut to `max_seq_len` tokens (an image record keeps all of its image
        tokens: a cap below their count only drops its text)."""
        samples, cut = [], 0
        for record in records:
            if getattr(record, "image", None) is None:
                sample = {"input_ids": self.tokenizer(record.text, add_special_tokens=True,
                                                      return_tensors="pt")["input_ids"]}
                keep = 0
            else:
                sample, keep = self.image_sample(record)
            ids = sample["input_ids"]
            if max_seq_len and ids.shape[1] > max(max_seq_len, keep):
                sample["input_ids"] = ids[:, :max(max_seq_len, keep)]
                cut += 1
            samples.append(sample)
        if cut:
            logger.info("calibration: %d of %d records cut to spec.max_seq_len=%d tokens", cut, len(records),
                        max_seq_len)
        return samples
