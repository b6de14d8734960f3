"""KimiK3ModelAdapter: Kimi-K3 (vision + latent-MoE Kimi-Linear) and text-only Kimi-Linear checkpoints.

The model code is never ours: the adapter builds the weight directory's own classes (remote code with
`trust_remote_code`, or transformers' native Kimi-Linear) on the meta device, then materialises one unit at a time
from the checkpoint. Everything model-specific the runner and processors need is answered here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from msmodelslim.core.dist import SINGLE, DistContext
from msmodelslim.errors import UserError
from msmodelslim.formats.ascendv1 import FA_TENSOR, SEVERITY
from msmodelslim.formats.checkpoint import CheckpointError, open_checkpoint
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.model.common.utils import resolve_expert_ep_range
from msmodelslim.model.kimi_k3 import ep_patches, fa3, runtime_patches
from msmodelslim.quant.attention import AttentionFakeQuant
from msmodelslim.quant.modules import QuantLinear

logger = logging.getLogger(__name__)

_EXPERT_RE = re.compile(r"(?<!shared_)experts\.(\d+)\.")
# transformers' native Kimi-Linear renames a few checkpoint tensors (its conversion mapping); live -> checkpoint.
_NATIVE_RENAMES = (("self_attn.forget_gate.", "self_attn."),)
_NATIVE_FUSED_CONV = "self_attn.conv1d.weight"
_NATIVE_CONV_PARTS = ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight")

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
# --model_type display name -> whether its checkpoints carry a vision tower
MULTIMODAL_MODEL_TYPES = {"Kimi-K3": True, "Kimi-Linear": False}
_BLOCK_KINDS = ("decoder", "mtp")  # units that hold a decoder block (attention, MLP / MoE)
_FLOAT_STORAGE = frozenset({"BF16", "F16", "F32", "F64"})  # safetensors dtypes a float parameter may load from


class UnitModule(nn.Module):
    """A unit made of several top-level pieces of the model (vision tower + projector; the head: output
    attention-residual mix, final norm and lm_head)."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def _model_class(config: Any, model_path: Path, trust_remote_code: bool) -> type[nn.Module]:
    arch = (getattr(config, "architectures", None) or [None])[0]
    if not arch:
        raise ValueError(f"{model_path / 'config.json'}: no 'architectures' entry")
    auto_map = getattr(config, "auto_map", None) or {}
    refs = [v for v in auto_map.values() if isinstance(v, str) and v.rsplit(".", 1)[-1] == arch]
    if refs:
        if not trust_remote_code:
            raise ValueError(f"{model_path} ships its own model code ({refs[0]}); pass --trust_remote_code True")
        return get_class_from_dynamic_module(refs[0], str(model_path))
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise ValueError(f"{model_path / 'config.json'}: architecture {arch!r} is neither in auto_map nor in "
                         f"transformers {transformers.__version__}")
    return cls


class KimiK3ModelAdapter(ModelAdapter):
    """Model knowledge for Kimi-K3 and Kimi-Linear (remote code or transformers' native class)."""

    @classmethod
    def check_config(cls, config: dict[str, Any], config_file: Path, model_type: str) -> None:
        """Refuse, before anything runs, a config.json this adapter cannot build the named model from."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
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
        lac = text["linear_attn_config"]
        if not isinstance(lac, dict):
            raise UserError(f"{config_file}: {where}linear_attn_config must be an object, got {lac!r}")
        for name in REQUIRED_LINEAR_ATTN_FIELDS:
            if name not in lac:
                raise UserError(f"{config_file}: required key {where}linear_attn_config.{name} is missing")
        if multimodal:
            for name in REQUIRED_VISION_FIELDS:
                if name not in config["vision_config"]:
                    raise UserError(f"{config_file}: required key vision_config.{name} is missing")

    def __init__(self, model_path: str | Path, trust_remote_code: bool = False, dist: DistContext = SINGLE,
                 dtype: torch.dtype = torch.bfloat16, torch_kernels_on_cuda: bool = False) -> None:
        super().__init__(model_path, trust_remote_code)
        self.dist = dist
        self.dtype = dtype
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_path}: no config.json (is --model_path a weight directory?)")
        config_file = self.model_path / "config.json"
        try:
            self.config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:
            raise UserError(f"{config_file}: cannot be read as a model configuration: {_one_line(exc)}") from None
        self.text_config = self.config.get_text_config()
        self.is_multimodal = getattr(self.config, "vision_config", None) is not None
        self.reader = open_checkpoint(self.model_path)

        try:
            cls = _model_class(self.config, self.model_path, trust_remote_code)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        try:
            with torch.device("meta"):
                self.model = cls._from_config(self.config, dtype=dtype)
        except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, RuntimeError) as exc:
            raise UserError(f"{config_file}: {cls.__name__} cannot be built from it: {_one_line(exc)}") from None
        self.model.eval()
        self.is_native = type(self.model).__module__.startswith("transformers.models.")
        self.language_model = self.model.language_model if self.is_multimodal else self.model
        self.lm_prefix = "language_model." if self.is_multimodal else ""
        self.layers = self.language_model.model.layers
        self.num_layers = int(self.text_config.num_hidden_layers)  # the rest of `layers` are MTP layers
        self.has_mtp = len(self.layers) > self.num_layers
        self.attn_res = bool(getattr(self.text_config, "attn_res_block_size", None))

        self.num_experts = int(self.text_config.num_experts)
        self.expert_range = resolve_expert_ep_range(self.num_experts, dist.rank, dist.world_size)
        self._ep = ep_patches.apply_ep_patches(self.model, self.text_config, dist)
        self._kernels = runtime_patches.apply_runtime_patches(
            runtime_patches.find_fla_modules(self.model), device_type=dist.device.type, force=torch_kernels_on_cuda)
        self._fa3 = runtime_patches.PatchHandle()  # the MLA classes' absorbed forward, patched on first injection
        self._fa3_attentions: list[str] | None = None
        self._tokenizer: Any = None
        self._processor: Any = None
        self._mask_cache: dict[int, Any] = {}
        self._units = self._build_units()
        self.check_checkpoint()

    def close(self) -> None:
        """Undo the runtime patches of the checkpoint's classes (EP, kernels, the absorbed MLA forward)."""
        self._fa3.undo()
        self._kernels.undo()
        self._ep.undo()

    # --- structure -------------------------------------------------------------------------------------------
    def _build_units(self) -> list[Unit]:
        units = []
        if self.is_multimodal:
            units.append(Unit("vision", "vision", ""))
        lm = self.lm_prefix
        units.append(Unit("embed", "embed", f"{lm}model.embed_tokens."))
        units += [Unit(f"layers.{i}", "decoder", f"{lm}model.layers.{i}.", i) for i in range(self.num_layers)]
        units.append(Unit("head", "head", f"{lm}model.norm."))
        # MTP layers read the head's final hidden state, so they come after it (stored as layers.{N + k})
        units += [Unit(f"mtp.{i - self.num_layers}", "mtp", f"{lm}model.layers.{i}.", i)
                  for i in range(self.num_layers, len(self.layers))]
        return units

    def units(self) -> list[Unit]:
        return list(self._units)

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

    def unit_module(self, unit: Unit) -> nn.Module:
        """The (meta or materialised) module of a unit, shared with the model skeleton."""
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
                if self.is_native and unit.kind in _BLOCK_KINDS:
                    for old, new in _NATIVE_RENAMES:
                        if rest.startswith(old):
                            rest = new + rest[len(old):]
                    if (rest == "mlp" or rest.startswith("mlp.")) and (source or self._is_moe_layer(unit)):
                        rest = "block_sparse_moe" + rest[3:]
                return (ckpt_prefix + rest).rstrip(".")
        raise KeyError(f"unit {unit.name}: {live_name!r} is not part of it")

    def _is_moe_layer(self, unit: Unit) -> bool:
        return hasattr(getattr(self.layers[unit.index], "mlp", None), "experts")

    def _tensor_names(self, unit: Unit, live_name: str, source: bool) -> list[str]:
        """The stored tensors one live tensor is made of (native Kimi-Linear fuses the q/k/v convs into one)."""
        if self.is_native and unit.kind == "decoder" and live_name == _NATIVE_FUSED_CONV:
            return [unit.prefix + part for part in _NATIVE_CONV_PARTS]
        return [self._name(unit, live_name, source)]

    def fused_groups(self) -> list[tuple[str, list[str]]]:
        from msmodelslim.model.kimi_k3.serving import fused_groups

        return fused_groups([name for _, name in self.linear_names()])

    def lookup_aliases(self, name: str) -> list[str]:
        """vLLM's Kimi-K3 MTP drafter builds layer N+k's decoder block at `model.layers.{N+k}.mtp_block.` (vllm 0.33
        `models/kimi_k3/nvidia/mtp.py:426-457`), and vllm-ascend 0.23 maps neither `language_model.` nor `.mtp_block.`
        away for it (`modelslim_config.py:306-333` strips `.mtp_block.` for step3p5 only): its lookups find the MTP
        layer's entries under these names."""
        match = re.match(rf"{re.escape(self.lm_prefix)}model\.layers\.(\d+)\.(.+)$", name)
        if not match or int(match.group(1)) < self.num_layers:
            return []
        index, rest = match.groups()
        block = "" if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head") else "mtp_block."
        alias = f"model.layers.{index}.{block}{rest}"
        return [alias] if alias != name else []  # a text-only checkpoint already names them so

    def is_rank_local(self, name: str) -> bool:
        return _EXPERT_RE.search(name + ".") is not None

    def source_mxfp4(self, unit: Unit, live_name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        names = self._tensor_names(unit, f"{live_name}.weight", source=True)
        if len(names) != 1 or names[0] not in self.reader or not self.reader.is_mxfp4(names[0]):
            return None
        return self.reader.mxfp4_bytes(names[0])

    def stores_mxfp4(self, name: str) -> bool:
        return f"{name}.weight" in self.reader and self.reader.is_mxfp4(f"{name}.weight")

    # --- loading ---------------------------------------------------------------------------------------------
    def check_checkpoint(self) -> None:
        """Headers only, before any compute: every tensor each unit needs is stored with its shape and a usable
        dtype (MXFP4 codes and scales consistent), and every stored tensor belongs to a module of the model (no
        expert beyond num_experts, no layer beyond num_hidden_layers). Each fault names the file and the tensor."""
        reader = self.reader
        available = set(reader.keys())
        expected: set[str] = set()
        for unit in self._units:
            for live_name, owner, attr, _ in _tensor_slots(self.unit_module(unit)):
                names = self._tensor_names(unit, live_name, source=True)
                expected.update(names)
                model_shape = tuple(getattr(owner, attr).shape)
                for name in names:
                    if name not in available:
                        raise CheckpointError(f"{self.model_path}: tensor {name!r} of unit {unit.name} is missing "
                                              f"from the checkpoint")
                    if reader.is_mxfp4(name):
                        reader.check_mxfp4_layout(name)
                    elif getattr(owner, attr).is_floating_point() and reader.stored_dtype(name) \
                            not in _FLOAT_STORAGE:
                        raise CheckpointError(f"{reader.file_of(name)}: tensor {name} is stored as "
                                              f"{reader.stored_dtype(name)}; the model expects a float tensor")
                shapes = [reader.shape(n) for n in names]
                shape = shapes[0] if len(shapes) == 1 else (sum(s[0] for s in shapes), *shapes[0][1:])
                if shape != model_shape:
                    raise CheckpointError(f"{reader.file_of(names[0])}: tensor {names[0]} has shape {shape}; "
                                          f"{type(self.model).__name__} expects {model_shape} (from config.json)")
        prefixes = [p for u in self._units for _, p in self._pieces(u)]
        for key in sorted(available - expected):
            match = _EXPERT_RE.search(key)
            if match and any(key.startswith(p) for p in prefixes):
                index = int(match.group(1))
                if index >= self.num_experts:
                    raise CheckpointError(f"{reader.file_of(key)}: tensor {key} belongs to expert {index}, but "
                                          f"config.json has num_experts={self.num_experts}")
                if index not in self.expert_range:
                    continue  # another rank's expert: that rank checks it
            raise CheckpointError(f"{reader.file_of(key)}: tensor {key} belongs to no module of "
                                  f"{type(self.model).__name__} (an extra tensor, or a config.json that does not "
                                  f"match the weights)")
        reader.close()

    def load_unit(self, unit: Unit, device: torch.device, reader: Any = None) -> nn.Module:
        """`reader` defaults to the source checkpoint; any other (an AscendV1 output) is read by serving names."""
        reader = reader or self.reader
        source = reader is self.reader
        available = set(reader.keys())
        module = self.unit_module(unit)
        persistent = {name for name, *_ in _tensor_slots(module)}
        for name, buf in module.named_buffers():
            if buf.is_meta and name not in persistent:
                raise RuntimeError(f"unit {unit.name}: non-persistent buffer {name!r} cannot be rebuilt from the "
                                   f"checkpoint; the adapter must recompute it")
        expected: set[str] = set()
        for live_name, owner, attr, is_param in _tensor_slots(module):
            names = self._tensor_names(unit, live_name, source)
            expected.update(names)
            for name in names:
                if name not in available:
                    raise KeyError(f"{self.model_path}: tensor {name!r} of unit {unit.name} is missing "
                                   f"from the checkpoint")
            parts = [self._read_tensor(reader, unit, n, device) for n in names]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                tensor = tensor.to(self.dtype)
            current = getattr(owner, attr)
            if tuple(tensor.shape) != tuple(current.shape):
                raise ValueError(f"{names[0]}: checkpoint shape {tuple(tensor.shape)} != model shape "
                                 f"{tuple(current.shape)}")
            if is_param:
                owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            else:
                owner._buffers[attr] = tensor
        prefixes = [p for _, p in self._pieces(unit)]
        for key in available:
            if any(key.startswith(p) for p in prefixes) and key not in expected:
                match = _EXPERT_RE.search(key)
                if match and int(match.group(1)) not in self.expert_range:
                    continue  # another rank's expert: never loaded here
                raise KeyError(f"{self.model_path}: unexpected tensor {key!r} for unit {unit.name} "
                               f"(the model class {type(self.model).__name__} has no such parameter)")
        if reader is self.reader:
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
                                  f"{_one_line(exc)}") from None
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"{where}: tensor {name} of unit {unit.name} has {bad} non-finite value(s) "
                                  f"(NaN/Inf); refusing to quantize it")
        return tensor

    def free_unit(self, unit: Unit, module: nn.Module) -> None:
        fa3.remove_fa3_points(module)  # the skeleton is shared: a later load starts from the checkpoint's own module
        module.to("meta")

    # --- calibration data flow -------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self.is_multimodal:
                self._tokenizer = self.processor.tokenizer
            else:
                self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                    self.model_path, trust_remote_code=self.trust_remote_code)
        return self._tokenizer

    @property
    def processor(self) -> Any:
        if self._processor is None:
            self._processor = transformers.AutoProcessor.from_pretrained(
                self.model_path, trust_remote_code=self.trust_remote_code)
        return self._processor

    def prepare_samples(self, records: list[Any], max_seq_len: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Model inputs per record, each cut to `max_seq_len` tokens (an image record keeps all of its image
        tokens, which come first: a cap below their count only drops its text)."""
        from PIL import Image

        samples, cut = [], 0
        for record in records:
            image = getattr(record, "image", None)
            if image is not None and not self.is_multimodal:
                raise UserError(f"calibration record with image {image} given to text-only model "
                                f"{self.model_path}; use a text dataset")
            if image is None:
                sample = {"input_ids": self.tokenizer(record.text, add_special_tokens=True,
                                                      return_tensors="pt")["input_ids"]}
            else:
                with Image.open(image) as img:
                    rgb = img.convert("RGB")
                inputs = self.processor(text=self.processor.image_token + record.text, images=[rgb],
                                        return_tensors="pt")
                sample = {k: v for k, v in inputs.items() if k in ("input_ids", "pixel_values", "grid_thws")}
            ids = sample["input_ids"]
            if max_seq_len and ids.shape[1] > max_seq_len:
                keep = max_seq_len
                if image is not None:
                    media = (ids[0] == self.config.media_placeholder_token_id).nonzero()
                    keep = max(keep, int(media[-1]) + 1 if len(media) else 0)
                if keep < ids.shape[1]:
                    sample["input_ids"] = ids[:, :keep]
                    cut += 1
            samples.append(sample)
        if cut:
            logger.info("calibration: %d of %d records cut to spec.max_seq_len=%d tokens", cut, len(records),
                        max_seq_len)
        return samples

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
        """One sample through one unit. The text state is `hidden_states` (with attention residuals: the running
        prefix, plus `attn_res_blocks`, the finished block sums); with MTP layers also `next_embeds` (the input
        embeddings, which MTP step k reads shifted by k + 1). The head's state is the model's final hidden state
        h; it adds `logits` when the model has no MTP layer or the state asks (`need_logits`; an MTP layer then adds
        its own, predicting one token further)."""
        if unit.kind == "vision":
            if "pixel_values" not in state:
                return state
            features = self.model.get_image_features(state["pixel_values"].to(self.dist.device, self.dtype),
                                                     state["grid_thws"].to(self.dist.device))
            return {**state, "image_features": features}
        if unit.kind == "embed":
            ids = state["input_ids"].to(self.dist.device)
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
        for block in module.modules():
            if ep_patches.is_moe_block(block):
                ep_patches.ep_idle(block)

    def fa3_attentions(self) -> list[str]:
        if self._fa3_attentions is None:
            self._fa3_attentions = [self.checkpoint_name(unit, name) for unit in self._units
                                    if unit.kind in _BLOCK_KINDS
                                    for name, mod in self.unit_module(unit).named_modules() if fa3.is_mla(mod)]
        return self._fa3_attentions

    def inject_fa3_placeholders(self, unit: Unit, module: nn.Module, should_inject: Callable[[str], bool]) -> list[str]:
        """FA3 placeholders (`fa_q`, `fa_k`, `fa_v`) in the unit's MLA attentions whose checkpoint name
        `should_inject` accepts; their class then runs the absorbed MLA (model/kimi_k3/fa3.py) while the points
        are there. Returns the live names of the attentions."""
        if unit.kind not in _BLOCK_KINDS:
            return []
        return fa3.inject_fa3_placeholders(self._fa3, module,
                                           lambda name: should_inject(self.checkpoint_name(unit, name)),
                                           returns_weights=self.is_native)

    # --- saving ----------------------------------------------------------------------------------------------
    def output_config(self, config: dict[str, Any], description: dict[str, str]) -> dict[str, Any]:
        """Every source field, plus what the serving side reads from the text config:
        - `mla_use_nope: true`: vLLM's Kimi MLA is NoPE-only and refuses a config without it (vllm 0.33
          `models/kimi_k3/nvidia/model.py:740-744`; KimiLinearConfig defaults it off);
        - `quantize` / `moe_quantize` / `mla_quantize` (`w8a8_dynamic`, `w4a8_dynamic`), as msModelSlim writes them:
          vllm-ascend picks its MoE communication from `moe_quantize` (`ascend_forward_context.py:335-339`)."""
        config = dict(config)
        holder = dict(config["text_config"]) if isinstance(config.get("text_config"), dict) else config
        lac = holder.get("linear_attn_config") or {}
        has_mla = bool(lac.get("full_attn_layers")) or not lac
        if has_mla and "mla_use_nope" not in holder:
            holder["mla_use_nope"] = True
            logger.info("config.json: added mla_use_nope: true (NoPE MLA; vLLM asserts the flag)")
        holder.update(_quantize_flags(description))
        if holder is not config:
            config["text_config"] = holder
        return config

    def checkpoint_state(self, unit: Unit, module: nn.Module) -> Iterator[tuple[str, Any]]:
        modules = list(module.named_modules())
        quantized = {name: m for name, m in modules if isinstance(m, QuantLinear)}
        for name, mod in modules:
            if isinstance(mod, (QuantLinear, AttentionFakeQuant)):
                yield self.checkpoint_name(unit, name), mod
        for live_name, owner, attr, _ in _tensor_slots(module):
            owner_name = live_name.rsplit(".", 1)[0] if "." in live_name else ""
            if any(owner_name == q or owner_name.startswith(q + ".") for q in quantized):
                continue
            tensor = getattr(owner, attr)
            names = self._tensor_names(unit, live_name, source=False)
            parts = tensor.chunk(len(names), dim=0) if len(names) > 1 else [tensor]
            yield from zip(names, parts)

    # --- algorithm maps --------------------------------------------------------------------------------------
    def quarot_plan(self, unit: Unit, module: nn.Module) -> Any:
        from msmodelslim.model.kimi_k3 import quarot

        return quarot.quarot_plan(unit, module)

    def smooth_subgraphs(self, unit: Unit, module: nn.Module) -> list[Any]:
        from msmodelslim.model.kimi_k3 import smooth

        return smooth.smooth_subgraphs(unit, module)


_MLA_LINEARS = re.compile(r"\.self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight$")


def _quantize_flags(description: dict[str, str]) -> dict[str, str]:
    """msModelSlim's config.json summary of a W4A8 mix: routed experts (`moe_quantize`), MLA linears of layers that
    have `kv_a_proj_with_mqa` (`mla_quantize`; `w8a8` once attention is quantized per head, as msModelSlim's
    kimi_k2 / deepseek_v3 adapters write it for W4A8C8), every other quantized linear (`quantize`)."""
    quantized = {n: t for n, t in description.items() if t != "FLOAT" and n.endswith(".weight")}
    mla_layers = {n.split(".self_attn.")[0] for n in quantized if n.endswith(".kv_a_proj_with_mqa.weight")}
    groups: dict[str, set[str]] = {"moe_quantize": set(), "mla_quantize": set(), "quantize": set()}
    for name, scheme in quantized.items():
        if _EXPERT_RE.search(name):
            groups["moe_quantize"].add(scheme)
        elif _MLA_LINEARS.search(name) and name.split(".self_attn.")[0] in mla_layers:
            groups["mla_quantize"].add(scheme)
        else:
            groups["quantize"].add(scheme)
    if "W4A8_DYNAMIC" not in groups["moe_quantize"]:
        return {}  # msModelSlim writes them only for a W4A8 mix, and the engine's defaults fit the rest
    flags = {key: max(s, key=lambda t: SEVERITY[t]).lower() for key, s in groups.items() if s}
    if "mla_quantize" in flags and FA_TENSOR in description.values():
        flags["mla_quantize"] = "w8a8"
    return flags


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _tensor_slots(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, bool]]:
    """(live name, owning module, attribute, is_parameter) of every parameter and persistent buffer."""
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for attr, value in mod._parameters.items():
            if value is not None:
                yield prefix + attr, mod, attr, True
        for attr, value in mod._buffers.items():
            if value is not None and attr not in mod._non_persistent_buffers_set:
                yield prefix + attr, mod, attr, False
