"""Where everything is in a Kimi-K3 / Kimi-Linear model object: its units, the names of their tensors in the
checkpoint and in the serving engine, the maps the processors apply (QuaRot, smoothing, FA3 points) and the state a
sample carries from one unit to the next.

Pure: `KimiLayout(model)` takes a model in memory (the checkpoint's own classes, remote code or transformers'
native Kimi-Linear, on meta or materialised) and reads nothing else, so tests drive processors over a model they
built with the same layout the run uses.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
from torch import nn

from msmodelslim.core.routing import ExpertStatistics
from msmodelslim.model.base import Unit
from msmodelslim.model.common import expert_parallel
from msmodelslim.model.kimi_k3 import ep_patches, fa3

EXPERT_RE = re.compile(r"(?<!shared_)experts\.(\d+)\.")
# Linears of a decoder unit that read the routed experts' outputs: Kimi-K3's latent up-projection (after the latent
# sum and its norm). Everything else in the unit reads the experts' input side (attention, router, shared experts,
# latent down-projection) or is an expert.
READS_ROUTED_EXPERTS_RE = re.compile(r"(^|\.)routed_expert_up_proj$")
# transformers' native Kimi-Linear renames a few checkpoint tensors (its conversion mapping); live -> checkpoint.
_NATIVE_RENAMES = (("self_attn.forget_gate.", "self_attn."),)
_NATIVE_FUSED_CONV = "self_attn.conv1d.weight"
_NATIVE_CONV_PARTS = ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight")
BLOCK_KINDS = ("decoder", "mtp")  # units that hold a decoder block (attention, MLP / MoE)
_MTP_OWN = ("enorm", "hnorm", "eh_proj", "shared_head")  # an MTP layer's own modules, beside its decoder block


class UnitModule(nn.Module):
    """A unit made of several top-level pieces of the model (vision tower + projector; the head: output
    attention-residual mix, final norm and lm_head)."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class KimiLayout:
    """The layout of one Kimi model object; `expert_range`: the routed experts this rank holds (all by default);
    `dtype`: what image pixels are cast to (the model's own dtype by default)."""

    def __init__(self, model: nn.Module, expert_range: range | None = None, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.dtype = dtype or model.dtype
        self.text_config = model.config.get_text_config()
        self.is_multimodal = hasattr(model, "vision_tower")
        self.expert_statistics: ExpertStatistics = "routed"  # spec.calibrate_all_experts / affinity_guided_experts
        self.is_native = type(model).__module__.startswith("transformers.models.")
        self.language_model = model.language_model if self.is_multimodal else model
        self.lm_prefix = "language_model." if self.is_multimodal else ""
        self.layers = self.language_model.model.layers
        self.num_layers = int(self.text_config.num_hidden_layers)  # the rest of `layers` are MTP layers
        self.has_mtp = len(self.layers) > self.num_layers
        self.attn_res = bool(getattr(self.text_config, "attn_res_block_size", None))
        self.num_experts = int(self.text_config.num_experts)
        self.expert_range = expert_range if expert_range is not None else range(self.num_experts)
        self._units = self._build_units()
        self._mask_cache: dict[int, Any] = {}

    # --- units -------------------------------------------------------------------------------------------------
    def _build_units(self) -> list[Unit]:
        lm = self.lm_prefix
        units = [Unit("vision", "vision", "")] if self.is_multimodal else []
        units.append(Unit("embed", "embed", f"{lm}model.embed_tokens."))
        units += [Unit(f"layers.{i}", "decoder", f"{lm}model.layers.{i}.", i) for i in range(self.num_layers)]
        units.append(Unit("head", "head", f"{lm}model.norm."))
        # MTP layers read the head's final hidden state, so they come after it (stored as layers.{N + k})
        units += [Unit(f"mtp.{i - self.num_layers}", "mtp", f"{lm}model.layers.{i}.", i)
                  for i in range(self.num_layers, len(self.layers))]
        return units

    def units(self) -> list[Unit]:
        return list(self._units)

    def unit_module(self, unit: Unit) -> nn.Module:
        """The unit's module, shared with the model (meta until loaded)."""
        if unit.kind == "vision":
            return UnitModule(vision_tower=self.model.vision_tower, mm_projector=self.model.mm_projector)
        if unit.kind == "embed":
            return UnitModule(embed_tokens=self.language_model.model.embed_tokens)
        if unit.kind == "head":
            text = self.language_model.model
            extra = {"output_attn_res_norm": text.output_attn_res_norm,
                     "output_attn_res_proj": text.output_attn_res_proj} if self.attn_res else {}
            return UnitModule(norm=text.norm, lm_head=self.language_model.lm_head, **extra)
        return self.layers[unit.index]

    def _pieces(self, unit: Unit) -> list[tuple[str, str]]:
        """(live-name prefix, checkpoint-name prefix) of each piece of a unit."""
        lm = self.lm_prefix
        if unit.kind == "vision":
            return [("vision_tower.", "vision_tower."), ("mm_projector.", "mm_projector.")]
        if unit.kind == "embed":
            return [("embed_tokens.", f"{lm}model.embed_tokens.")]
        if unit.kind == "head":
            pieces = [("norm.", f"{lm}model.norm."), ("lm_head.", f"{lm}lm_head.")]
            if self.attn_res:
                pieces += [(f"{p}.", f"{lm}model.{p}.") for p in ("output_attn_res_norm", "output_attn_res_proj")]
            return pieces
        return [("", unit.prefix)]

    def unit_prefixes(self, unit: Unit) -> list[str]:
        return [prefix for _, prefix in self._pieces(unit)]

    # --- names -------------------------------------------------------------------------------------------------
    def checkpoint_name(self, unit: Unit, live_name: str) -> str:
        """The name the serving engine builds (output files, description, practice globs)."""
        return self._name(unit, live_name, source=False)

    def _name(self, unit: Unit, live_name: str, source: bool) -> str:
        """Full name of a live name: as the source checkpoint stores it (`source`) or as vLLM builds it. The two
        differ only for transformers' native Kimi-Linear, whose conversion mapping stores dense MLPs under
        `block_sparse_moe` like the sparse ones, while vLLM builds a dense layer's MLP at `mlp`."""
        for live_prefix, ckpt_prefix in self._pieces(unit):
            if live_name.startswith(live_prefix) or live_name + "." == live_prefix:
                rest = live_name[len(live_prefix):] if live_name.startswith(live_prefix) else ""
                if self.is_native and unit.kind in BLOCK_KINDS:
                    for old, new in _NATIVE_RENAMES:
                        if rest.startswith(old):
                            rest = new + rest[len(old):]
                    if (rest == "mlp" or rest.startswith("mlp.")) and (source or self._is_moe_layer(unit)):
                        rest = "block_sparse_moe" + rest[3:]
                return (ckpt_prefix + rest).rstrip(".")
        raise KeyError(f"unit {unit.name}: {live_name!r} is not part of it")

    def _is_moe_layer(self, unit: Unit) -> bool:
        return hasattr(getattr(self.layers[unit.index], "mlp", None), "experts")

    def tensor_names(self, unit: Unit, live_name: str, source: bool) -> list[str]:
        """The stored tensors one live tensor is made of (native Kimi-Linear fuses the q/k/v convs into one)."""
        if self.is_native and unit.kind == "decoder" and live_name == _NATIVE_FUSED_CONV:
            return [unit.prefix + part for part in _NATIVE_CONV_PARTS]
        return [self._name(unit, live_name, source)]

    def stray_reason(self, name: str) -> str | None:
        match = EXPERT_RE.search(name)
        if match and name.startswith(f"{self.lm_prefix}model.layers."):
            index = int(match.group(1))
            if index >= self.num_experts:
                return f"belongs to expert {index}, but config.json has num_experts={self.num_experts}"
            if index not in self.expert_range:
                return None  # another rank's expert: that rank checks and loads it
        return (f"belongs to no module of {type(self.model).__name__} (an extra tensor, or a config.json that does "
                f"not match the weights)")

    def statistics_pass(self) -> contextlib.AbstractContextManager[Any]:
        """Around each statistics pass: with "all_tokens" (spec.calibrate_all_experts) every local routed
        expert computes on every token (expert_parallel.all_experts_compute)."""
        if self.expert_statistics == "all_tokens":
            return expert_parallel.all_experts_compute(self.model)
        if self.expert_statistics == "affinity":  # spec.affinity_guided_experts: rows weighed by the router
            return expert_parallel.experts_weigh_rows(self.model)
        if self.expert_statistics == "balanced":  # spec.balanced_experts: each expert topped up to its share
            return expert_parallel.experts_balance_tokens(self.model)
        return contextlib.nullcontext()

    def is_rank_local(self, name: str) -> bool:
        """A routed expert's module (live or checkpoint name): held by one expert-parallel rank."""
        return EXPERT_RE.search(name + ".") is not None

    def reads_routed_experts(self, live_name: str) -> bool:
        """A module whose input depends on the routed experts' outputs within its unit (the experts themselves
        excluded)."""
        return READS_ROUTED_EXPERTS_RE.search(live_name) is not None

    def lookup_aliases(self, name: str) -> list[str]:
        """The names under which an MTP drafter looks up layer N+k's entries, where they differ from ours
        (`language_model.model.layers.{N+k}.`): vllm-ascend 0.27's `AscendKimiK3MTP` builds the layer at
        `model.layers.{N+k}.` (PR #14454 `models/kimi_k3_mtp.py:49-53,69`; bench/consumer_k3.py loads it) and vLLM
        0.33's drafter its decoder block at `model.layers.{N+k}.mtp_block.` (`models/kimi_k3/nvidia/mtp.py:426-457`);
        neither maps `language_model.` (nor `.mtp_block.`) away for the lookups (vllm-ascend's
        `modelslim_config.py:306-333` strips `.mtp_block.` for step3p5 only)."""
        match = re.match(rf"{re.escape(self.lm_prefix)}model\.layers\.(\d+)\.(.+)$", name)
        if not match or int(match.group(1)) < self.num_layers:
            return []
        index, rest = match.groups()
        block = "" if rest.split(".")[0] in _MTP_OWN else "mtp_block."
        aliases = dict.fromkeys((f"model.layers.{index}.{rest}", f"model.layers.{index}.{block}{rest}"))
        return [alias for alias in aliases if alias != name]  # a text-only checkpoint already names them so

    # --- maps --------------------------------------------------------------------------------------------------
    def quarot_plan(self, unit: Unit, module: nn.Module) -> Any:
        from msmodelslim.model.kimi_k3 import quarot

        return quarot.quarot_plan(unit, module)

    def smooth_subgraphs(self, unit: Unit, module: nn.Module) -> list[Any]:
        from msmodelslim.model.kimi_k3 import smooth

        return smooth.smooth_subgraphs(unit, module)

    def fa3_attentions(self) -> list[str]:
        """Checkpoint names of the MLA attentions (FA3 points go there)."""
        return [self.checkpoint_name(unit, name) for unit in self._units if unit.kind in BLOCK_KINDS
                for name, mod in self.unit_module(unit).named_modules() if fa3.is_mla(mod)]

    # --- the state of a sample between units -------------------------------------------------------------------
    def _causal_mask(self, hidden: torch.Tensor) -> Any:
        """transformers' own mask for its native full-attention layers (None where sdpa can be causal)."""
        from transformers.masking_utils import create_causal_mask

        length = hidden.shape[1]
        if length not in self._mask_cache:
            positions = torch.arange(length, device=hidden.device).unsqueeze(0)
            self._mask_cache[length] = create_causal_mask(config=self.text_config, inputs_embeds=hidden,
                                                          attention_mask=None, past_key_values=None,
                                                          position_ids=positions)
        return self._mask_cache[length]

    @torch.no_grad()
    def forward_unit(self, unit: Unit, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """One sample through one unit, on the unit's device. The text state is `hidden_states` (with attention
        residuals: the running prefix, plus `attn_res_blocks`, the finished block sums); with MTP layers also
        `next_embeds` (the input embeddings, which MTP step k reads shifted by k + 1). The head's state is the
        model's final hidden state h; it adds `logits` when the model has no MTP layer or the state asks
        (`need_logits`; an MTP layer then adds its own, predicting one token further)."""
        if unit.kind == "vision":
            if "pixel_values" not in state:
                return state
            device = next(module.parameters()).device
            features = self.model.get_image_features(state["pixel_values"].to(device, self.dtype),
                                                     state["grid_thws"].to(device))
            return {**state, "image_features": features}
        if unit.kind == "embed":
            ids = state["input_ids"].to(module.embed_tokens.weight.device)
            hidden = module.embed_tokens(ids)
            if "image_features" in state:
                hidden = self.model.merge_image_features(hidden, ids, state["image_features"])
            out = {"hidden_states": hidden, "input_ids": ids}
            if self.attn_res:
                out["attn_res_blocks"] = []
            if self.has_mtp:
                out["next_embeds"] = hidden
            if state.get("need_logits"):
                out["need_logits"] = True
            return out
        hidden = state["hidden_states"]
        if unit.kind == "head":
            if self.attn_res:
                hidden = self.language_model.model.final_hidden(hidden, state["attn_res_blocks"])
            out = {k: v for k, v in state.items() if k != "attn_res_blocks"}
            out["hidden_states"] = hidden
            if state.get("need_logits") or not self.has_mtp:
                out["logits"] = module.lm_head(module.norm(hidden))
            return out
        if unit.kind == "mtp":
            step = unit.index - self.num_layers
            embeds = state["next_embeds"][:, step + 1:].clone()
            if embeds.shape[1] == 0:  # a sample too short to have a token this far ahead
                return state
            embeds[:, 0] = 0  # vLLM zeroes the MTP's token embedding at position 0
            h_next, logits = module(hidden[:, : embeds.shape[1]], inputs_embeds=embeds)
            return {**state, "hidden_states": h_next, **({"logits": logits} if state.get("need_logits") else {})}
        if self.attn_res:
            out, blocks = module(hidden, attention_mask=None, attn_res_blocks=state["attn_res_blocks"])
            return {**state, "hidden_states": out, "attn_res_blocks": blocks}
        if self.is_native and self.text_config.layer_types[unit.index] == "full_attention":
            out = module(hidden, attention_mask=self._causal_mask(hidden))
        else:
            out = module(hidden, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        return {**state, "hidden_states": out}

    def idle_unit(self, unit: Unit, module: nn.Module) -> None:
        """Take part in the unit's expert-parallel collectives without a sample."""
        for block in module.modules():
            if ep_patches.is_moe_block(block):
                expert_parallel.ep_idle(block)
