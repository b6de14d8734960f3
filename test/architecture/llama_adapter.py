"""A second family on the shared Hugging Face layer: plain dense Llama-style models (transformers' LlamaForCausalLM).

What a new family writes: its layout (units, names, the state between units) and a three-line adapter. Loading,
header checks, samples and the save walk are model/common's. test_second_adapter.py quantizes one end to end.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from msmodelslim.model.base import Unit
from msmodelslim.model.common.hf_adapter import HFModelAdapter


class Pieces(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class LlamaLayout:
    """embed (model.embed_tokens), layers.{i} (model.layers.{i}), head (model.norm + lm_head)."""

    def __init__(self, model: nn.Module) -> None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.model = model
        self.rotary = LlamaRotaryEmbedding(model.config)  # its inv_freq is not stored: built on the host here
        layers = model.model.layers
        self._units = ([Unit("embed", "embed", "model.embed_tokens.")]
                       + [Unit(f"layers.{i}", "decoder", f"model.layers.{i}.", i) for i in range(len(layers))]
                       + [Unit("head", "head", "model.norm.")])

    def units(self) -> list[Unit]:
        return list(self._units)

    def unit_module(self, unit: Unit) -> nn.Module:
        if unit.kind == "embed":
            return Pieces(embed_tokens=self.model.model.embed_tokens)
        if unit.kind == "head":
            return Pieces(norm=self.model.model.norm, lm_head=self.model.lm_head)
        return self.model.model.layers[unit.index]

    def unit_prefixes(self, unit: Unit) -> list[str]:
        return ["model.norm.", "lm_head."] if unit.kind == "head" else [unit.prefix]

    def checkpoint_name(self, unit: Unit, live_name: str) -> str:
        if unit.kind == "decoder":
            return unit.prefix + live_name
        return live_name if live_name.startswith("lm_head") else f"model.{live_name}"

    def tensor_names(self, unit: Unit, live_name: str, source: bool) -> list[str]:
        return [self.checkpoint_name(unit, live_name)]

    def stray_reason(self, name: str) -> str | None:
        return "belongs to no module of LlamaForCausalLM"

    def is_rank_local(self, name: str) -> bool:
        return False

    @torch.no_grad()
    def forward_unit(self, unit: Unit, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        if unit.kind == "embed":
            return {"hidden_states": module.embed_tokens(state["input_ids"].to(module.embed_tokens.weight.device))}
        hidden = state["hidden_states"]
        if unit.kind == "head":
            return {"hidden_states": hidden, "logits": module.lm_head(module.norm(hidden))}
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos, sin = self.rotary.to(hidden.device)(hidden, positions)
        out = module(hidden, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        return {"hidden_states": out[0] if isinstance(out, tuple) else out}

    def idle_unit(self, unit: Unit, module: nn.Module) -> None:
        pass


class LlamaModelAdapter(HFModelAdapter):
    def make_layout(self, model: nn.Module) -> LlamaLayout:
        return LlamaLayout(model)
