"""KimiK3ModelAdapter: Kimi-K3 (vision + latent-MoE Kimi-Linear) and text-only Kimi-Linear checkpoints.

The shared Hugging Face layer (model/common/hf_adapter.py) builds the weight directory's own classes on meta and
loads one unit at a time; this adapter adds what only Kimi needs: its config checks, its layout (layout.py), its
run-time patches (patches.py: expert parallelism, the pure-PyTorch kernels, the absorbed MLA), image samples, and
the flags the serving side reads from its config.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from msmodelslim.core.dist import SINGLE, DistContext
from msmodelslim.core.routing import ExpertStatistics
from msmodelslim.errors import UserError, shown
from msmodelslim.model.base import Unit
from msmodelslim.model.common.hf_adapter import HFModelAdapter
from msmodelslim.model.kimi_k3 import fa3
from msmodelslim.model.kimi_k3.layout import BLOCK_KINDS, KimiLayout
from msmodelslim.model.kimi_k3.patches import kimi_patches
from msmodelslim.model.kimi_k3.quarot import PROJECTOR_ROTATION
from msmodelslim.quant.modules import append_output_linear, remove_output_linear
from msmodelslim.serving.ascendv1 import quantize_summary
from msmodelslim.source.quant_scheme import text_part

logger = logging.getLogger(__name__)

# config.json fields the model classes read; each is a tuple of accepted spellings. A missing one would otherwise
# fall back to the class's built-in (full-size) default and surface hours later as a shape mismatch.
REQUIRED_TEXT_FIELDS = (
    ("hidden_size",), ("num_hidden_layers",), ("vocab_size",), ("num_attention_heads",), ("intermediate_size",),
    ("moe_intermediate_size",), ("num_experts", "n_routed_experts", "num_local_experts"),
    ("num_experts_per_token", "num_experts_per_tok"), ("kv_lora_rank",), ("qk_nope_head_dim",),
    ("qk_rope_head_dim",), ("v_head_dim",), ("linear_attn_config",),
)
REQUIRED_LINEAR_ATTN_FIELDS = ("num_heads", "head_dim", "short_conv_kernel_size")
REQUIRED_VISION_FIELDS = ("patch_size", "vt_hidden_size", "vt_num_attention_heads", "vt_intermediate_size",
                          "vt_num_hidden_layers", "qkv_hidden_size")
# What our code reads from the config object the model's class builds, with the config.json spellings the check
# above accepts: a class may read only one of them and leave the attribute None.
BUILT_TEXT_FIELDS = {"num_experts": REQUIRED_TEXT_FIELDS[6], "num_experts_per_token": REQUIRED_TEXT_FIELDS[7]}
# --model_type display name -> whether its checkpoints carry a vision tower
MULTIMODAL_MODEL_TYPES = {"Kimi-K3": True, "Kimi-Linear": False}


class KimiK3ModelAdapter(HFModelAdapter):
    """Model knowledge for Kimi-K3 and Kimi-Linear (remote code or transformers' native class)."""

    @classmethod
    def check_config(cls, config: dict[str, Any], config_file: Path, model_type: str) -> None:
        """Refuse, before anything runs, a config.json this adapter cannot build the named model from."""
        text = text_part(config)
        where = "text_config." if text is not config else ""
        multimodal = isinstance(config.get("vision_config"), dict)
        if model_type in MULTIMODAL_MODEL_TYPES and MULTIMODAL_MODEL_TYPES[model_type] != multimodal:
            other = next(k for k, v in MULTIMODAL_MODEL_TYPES.items() if v == multimodal)
            raise UserError(f"{config_file}: --model_type {model_type} but the config describes "
                            f"{'a multimodal model (vision_config present)' if multimodal else 'a text-only model'}; "
                            f"use --model_type {other}")
        for names in REQUIRED_TEXT_FIELDS:
            present = [n for n in names if n in text]
            if not present:
                raise UserError(f"{config_file}: required key {where}{names[0]} is missing")
            value = text[present[0]]
            if names[0] != "linear_attn_config" and (isinstance(value, bool) or not isinstance(value, int)
                                                     or value <= 0):
                raise UserError(f"{config_file}: {where}{present[0]} must be a positive integer, got {value!r}")
        for section, part in (("", config), ("text_config.", text if text is not config else None),
                              ("vision_config.", config.get("vision_config"))):
            for key, value in (part or {}).items():
                if key.endswith(("_eps", "_epsilon")) or key in ("eps", "epsilon"):
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                        raise UserError(f"{config_file}: {section}{key} must be a number in (0, 1) (a norm's "
                                        f"epsilon), got {shown(value)}")
        lac = text["linear_attn_config"]
        if not isinstance(lac, dict):
            raise UserError(f"{config_file}: {where}linear_attn_config must be an object, got {lac!r}")
        for name in REQUIRED_LINEAR_ATTN_FIELDS:
            if name not in lac:
                raise UserError(f"{config_file}: required key {where}linear_attn_config.{name} is missing")
        bound = lac.get("gate_lower_bound")
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not -5 <= bound < 0):
            # vLLM 0.33's Kimi-K3 KDA refuses other values (kda:619-624): its bounded gate is lb * sigmoid(...)
            raise UserError(f"{config_file}: {where}linear_attn_config.gate_lower_bound must be a number in [-5, 0), "
                            f"got {shown(bound)}")
        if multimodal:
            for name in REQUIRED_VISION_FIELDS:
                if name not in config["vision_config"]:
                    raise UserError(f"{config_file}: required key vision_config.{name} is missing")

    def __init__(self, model_path: str | Path, trust_remote_code: bool = False, dist: DistContext = SINGLE,
                 dtype: torch.dtype = torch.bfloat16, torch_kernels_on_cuda: bool = False) -> None:
        self.torch_kernels_on_cuda = torch_kernels_on_cuda
        self._processor: Any = None
        self._fa3_attentions: list[str] | None = None
        super().__init__(model_path, trust_remote_code, dist, dtype)

    def check_built_config(self) -> None:
        config_file = Path(self.model_path) / "config.json"
        for attr, spellings in BUILT_TEXT_FIELDS.items():
            value = getattr(self.text_config, attr, None)
            if attr == "num_experts_per_token" and value is None:
                value = getattr(self.text_config, "num_experts_per_tok", None)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"{config_file}: {type(self.text_config).__name__} reads {attr} and finds "
                                f"{shown(value)}; of the spellings {', '.join(spellings)}, give the one this model's "
                                f"config class reads")

    def make_layout(self, model: nn.Module) -> KimiLayout:
        return KimiLayout(model, self.expert_range(int(self.text_config.num_experts)), dtype=self.dtype)

    def patches(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return kimi_patches(model, self.dist, self.torch_kernels_on_cuda)

    def carried_state(self) -> tuple[int, tuple[str, ...]]:
        """The hidden state, the attention-residual blocks finished at the deepest decoder unit and, with MTP layers
        in the run, their input embeddings. Each decoder layer whose index is a multiple of the block size stores the
        block before it (layer 0 the embeddings): n layers leave ceil(n / size) blocks (Kimi-K3: 93 / 12 -> 8)."""
        block = getattr(self.text_config, "attn_res_block_size", None)
        units = self.units()
        blocks = -(-sum(u.kind == "decoder" for u in units) // block) if block else 0
        mtp = any(u.kind == "mtp" for u in units)
        parts = ("hidden states", *([f"{blocks} attention-residual blocks"] if blocks else []),
                 *(["MTP inputs"] if mtp else []))
        return 1 + blocks + int(mtp), parts

    @property
    def is_multimodal(self) -> bool:
        return self.layout.is_multimodal

    def calibrate_experts(self, how: ExpertStatistics) -> None:
        self.layout.expert_statistics = how

    @property
    def expert_statistics(self) -> ExpertStatistics:
        return self.layout.expert_statistics

    def statistics_pass(self) -> contextlib.AbstractContextManager[Any]:
        return self.layout.statistics_pass()

    def lookup_aliases(self, name: str) -> list[str]:
        return self.layout.lookup_aliases(name)

    def output_config(self, config: dict[str, Any], description: dict[str, str]) -> dict[str, Any]:
        """Every source field, plus what the serving side reads from the text config:
        - `mla_use_nope: true`: vLLM's Kimi MLA is NoPE-only and refuses a config without it (vllm 0.33
          `models/kimi_k3/nvidia/model.py:740-744`; KimiLinearConfig defaults it off);
        - msModelSlim's `quantize` / `moe_quantize` / `mla_quantize` summary (serving/ascendv1.quantize_summary)."""
        config = dict(config)
        holder = dict(text_part(config))
        lac = holder.get("linear_attn_config") or {}
        has_mla = bool(lac.get("full_attn_layers")) or not lac
        if has_mla and "mla_use_nope" not in holder:
            holder["mla_use_nope"] = True
            logger.info("config.json: added mla_use_nope: true (NoPE MLA; vLLM asserts the flag)")
        holder.update(quantize_summary(description))
        if holder.get("num_nextn_predict_layers") and not any(unit.kind == "mtp" for unit in self.units()):
            holder["num_nextn_predict_layers"] = 0  # the output has no MTP layer for a drafter to build
            logger.info("config.json: num_nextn_predict_layers set to 0 (spec.mtp: drop)")
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = holder
            return config
        return holder

    # --- maps for the processors -----------------------------------------------------------------------------
    def quarot_plan(self, unit: Unit, module: nn.Module) -> Any:
        return self.layout.quarot_plan(unit, module)

    def smooth_subgraphs(self, unit: Unit, module: nn.Module) -> list[Any]:
        return self.layout.smooth_subgraphs(unit, module)

    def fa3_attentions(self) -> list[str]:
        if self._fa3_attentions is None:
            self._fa3_attentions = self.layout.fa3_attentions()
        return self._fa3_attentions

    def inject_fa3_placeholders(self, unit: Unit, module: nn.Module, should_inject: Callable[[str], bool]) -> list[str]:
        """FA3 placeholders (`fa_q`, `fa_k`, `fa_v`) in the unit's MLA attentions whose checkpoint name
        `should_inject` accepts; their class then runs the absorbed MLA (model/kimi_k3/fa3.py) while the points
        are there. Returns the live names of the attentions."""
        if unit.kind not in BLOCK_KINDS:
            return []
        return fa3.inject_fa3_placeholders(self.patched.fa3, module,
                                           lambda name: should_inject(self.checkpoint_name(unit, name)),
                                           returns_weights=self.layout.is_native)

    def load_unit(self, unit: Unit, device: torch.device, reader: Any = None) -> nn.Module:
        """As HFModelAdapter's; an output whose residual stream is rotated carries the projector's rotation
        (`mm_projector.rot_proj`, see quarot.vision_plan), applied after the projector as vllm-ascend applies it."""
        if unit.kind == "vision" and reader is not None and f"mm_projector.{PROJECTOR_ROTATION}.weight" in reader:
            hidden = self.text_config.hidden_size  # a meta slot in the skeleton, filled (strictly) by the load
            append_output_linear(self.model.mm_projector, PROJECTOR_ROTATION, torch.empty(hidden, hidden, device="meta"))
        return super().load_unit(unit, device, reader)

    def free_unit(self, unit: Unit, module: nn.Module) -> None:
        fa3.remove_fa3_points(module)  # the skeleton is shared: a later load starts from the checkpoint's own module
        if unit.kind == "vision":
            remove_output_linear(module.mm_projector, PROJECTOR_ROTATION)
        module.to("meta")

    # --- calibration samples ---------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None and self.is_multimodal:
            self._tokenizer = self.processor.tokenizer
        return super().tokenizer

    @property
    def processor(self) -> Any:
        if self._processor is None:
            self._processor = transformers.AutoProcessor.from_pretrained(
                self.model_path, trust_remote_code=self.trust_remote_code)
        return self._processor

    def image_sample(self, record: Any) -> tuple[dict[str, torch.Tensor], int]:
        if not self.is_multimodal:
            return super().image_sample(record)
        from PIL import Image

        with Image.open(record.image) as img:
            rgb = img.convert("RGB")
        inputs = self.processor(text=self.processor.image_token + record.text, images=[rgb], return_tensors="pt")
        sample = {k: v for k, v in inputs.items() if k in ("input_ids", "pixel_values", "grid_thws")}
        media = (sample["input_ids"][0] == self.config.media_placeholder_token_id).nonzero()
        return sample, int(media[-1]) + 1 if len(media) else 0
