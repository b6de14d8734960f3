"""The consumers an AscendV1 output is written for: one profile per vllm-ascend line, its rules as data.

A profile says which model classes serve each model type (their fused tables: serving/fused.py) and what the engine
refuses at load. Each rule carries where it was read (docs/dev/facts/vllm_ascend_0.27_kimi_k3.md has the reading):
- `vllm-ascend-0.26`: branch `releases/v0.26.0rc` (base vLLM 0.26). Kimi-K3 runs vllm-ascend's own class (KDA q/k/v
  as `fused_qkv`, b/f_a/g separate); Kimi-Linear runs vLLM's class, every KDA / MLA linear separate. Per-group W4A8
  loads (deprecated, a warning). MTP layers are skipped by the loader.
- `vllm-ascend-0.27`: `main`, release v0.27.1rc1 (PR #14454). KDA q/k/v/g/f_a/b are vLLM's packed `in_proj_qkvgfab`:
  all six of one type, or q/k/v of one quantized type with g/f_a/b FLOAT (split at load); W4A8 MoE per channel
  only; MTP layers are built with the quant config, so their linears need description keys; drafts stay aligned
  with a rotated residual only through the description's `optional.quarot.rotation_map.global_rotation` file; the
  FA3 scales of a quantized attention do not load (its cache-scale mapper is applied twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from msmodelslim.errors import UserError
from msmodelslim.serving.fused import fused_groups


@dataclass(frozen=True)
class Profile:
    name: str
    engine: str  # the release line, for messages
    layouts: dict[str, tuple[str, ...]]  # model_type -> serving layouts (serving/fused.py) of its classes
    per_group_w4a8: bool  # W4A8_DYNAMIC MoE with group_size > 0 loads
    kda_split: bool  # in_proj_qkvgfab also loads as q/k/v quantized + g/f_a/b FLOAT
    mtp_described: bool  # MTP layers are built with the quant config (their linears need keys)
    drafts_need_rotation_file: bool  # drafts are anti-rotated only through the global_rotation file
    loads_fa3: bool  # the FA3 scales of a quantized attention (fa3_quant) reach their parameters
    sources: dict[str, str] = field(default_factory=dict)  # rule -> where it was read

    def layouts_for(self, model_type: str | None) -> tuple[str, ...]:
        """The serving layouts of `model_type` (none known: nothing fused)."""
        return self.layouts.get(model_type or "", ())

    def fused_groups(self, model: Any) -> list[tuple[str, list[str]]]:
        """(fused layer name, serving names of its shards) of `model` (a ModelStructure): linears this engine runs
        as one layer with one quantization scheme (a split it accepts aside). Empty when it fuses nothing."""
        return self._groups(model, lookup_keys=False)

    def lookup_groups(self, model: Any) -> list[tuple[str, list[str]]]:
        """The fused groups of `model` the description names (`<fused layer>.weight`) for lookups that find them in
        no packed table of the engine's model class."""
        return self._groups(model, lookup_keys=True)

    def _groups(self, model: Any, lookup_keys: bool) -> list[tuple[str, list[str]]]:
        layouts = self.layouts_for(model.serving_model_type())
        return fused_groups([linear.name for linear in model.linears()], layouts, lookup_keys) if layouts else []


_V026 = "vllm-ascend releases/v0.26.0rc@cf0baa38"
_V027 = "vllm-ascend PR #14454@e4f0a9e5 (v0.27.1rc1)"

PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile(
        "vllm-ascend-0.26", "vllm-ascend releases/v0.26.0rc (vLLM 0.26)",
        layouts={"kimi_k3": ("vllm-ascend-0.26rc",), "kimi_linear": ("vllm-ascend-0.23",)},
        per_group_w4a8=True, kda_split=False, mtp_described=False, drafts_need_rotation_file=False, loads_fa3=True,
        sources={
            "fused layers": f"{_V026} vllm_ascend/models/kimi_k3.py:1261-1266, ops/kimi_kda.py:179-203",
            "per-group W4A8": f"{_V026} quantization/methods/w4a8.py:356-358 (group_size defaults to 256; "
                              "per group is deprecated, a warning)",
            "MTP": f"{_V026} vllm_ascend/models/kimi_k3.py load_weights (layers >= num_hidden_layers skipped)",
            "rotation file": f"{_V026} spec_decode/llm_base_proposer.py:386-432 (defaults to "
                             "optional/quarot.safetensors)",
        }),
    Profile(
        "vllm-ascend-0.27", "vllm-ascend 0.27 (main, v0.27.1rc1)",
        layouts={"kimi_k3": ("vllm-ascend-0.27",), "kimi_linear": ("vllm-ascend-0.27",)},
        per_group_w4a8=False, kda_split=True, mtp_described=True, drafts_need_rotation_file=True, loads_fa3=False,
        sources={
            "fused layers": f"{_V027} quantization/modelslim_config.py:415-435 get_packed_modules_mapping; the MLA "
                            "output gate unfused: vLLM 0.27.1 models/kimi_k3/amd/linear.py:347-352,405-410",
            "KDA in_proj_qkvgfab": f"{_V027} quantization/modelslim_config.py:678-695 "
                                   "uses_kimi_k3_mixed_kda_projection; ops/kimi_kda.py:73-112",
            "per-group W4A8": f"{_V027} quantization/methods/w4a8.py:113-120 (group_size defaults to 0, > 0 "
                              "raises ValueError; the W4A8_DYNAMIC linear scheme is gone)",
            "MTP": f"{_V027} models/kimi_k3_mtp.py:42-75 (decoder layers and SharedHead built with quant_config)",
            "rotation file": f"{_V027} models/llama_eagle3.py:28-38 get_rotation_path, "
                             "spec_decode/llm_base_proposer.py:278-313 (no key: no draft alignment)",
            "FA3": f"{_V027} quantization/modelslim_config.py:655-665 get_cache_scale_mapper (plain suffixes, e.g. "
                   ".fa_k.offset -> .mla_attn.mla_attn.fa_k.offset), which vLLM 0.27.1's AutoWeightsLoader applies at "
                   "every level that holds the quant config (model_executor/models/utils.py:409-416: twice), so no "
                   "stored FA3 name reaches its parameter (bench/consumer_k3.py: load_weights KeyError)",
        }),
)}
DEFAULT_TARGET = "vllm-ascend-0.27"  # the newest line


def profile(name: str | None, key: str = "--target") -> Profile:
    """The profile called `name` (None: the default)."""
    chosen = PROFILES.get(name or DEFAULT_TARGET)
    if chosen is None:
        raise UserError(f"{key}: unknown serving target {name!r}; the known ones are {', '.join(PROFILES)}")
    return chosen
