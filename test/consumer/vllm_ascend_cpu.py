"""vllm-ascend 0.23.0.post1's own quantization code, imported on a CPU host: the consumer of our AscendV1 output.

The sdist is fetched from PyPI once (sha256-pinned, cached in $MSMODELSLIM_CACHE or ~/.cache/msmodelslim) and its
`vllm_ascend/` package imported from there. vLLM and torch_npu are not installed: the modules vllm-ascend imports
from them are stubbed with the few classes and functions its import needs, and device kernels raise if called.
Nothing of vllm-ascend's lookup (`quantization/modelslim_config.py`) or of its weight processing
(`quantization/methods/w4a8.py`, `w8a8_dynamic.py`) is stubbed: those modules run as shipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tarfile
import types
import urllib.request
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

VERSION = "0.23.0.post1"
SDIST = f"vllm_ascend-{VERSION}.tar.gz"
SHA256 = "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1"
SIMPLE_INDEX = "https://pypi.org/simple/vllm-ascend/"


def cache_dir() -> Path:
    return Path(os.environ.get("MSMODELSLIM_CACHE", Path.home() / ".cache" / "msmodelslim"))


def source_tree() -> Path:
    """The unpacked sdist (downloaded and checked on first use)."""
    root = cache_dir() / f"vllm_ascend-{VERSION}"
    if (root / "vllm_ascend" / "quantization" / "modelslim_config.py").is_file():
        return root
    cache_dir().mkdir(parents=True, exist_ok=True)
    archive = cache_dir() / SDIST
    if not archive.is_file() or hashlib.sha256(archive.read_bytes()).hexdigest() != SHA256:
        request = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            files = json.load(r)["files"]
        url = next(f["url"] for f in files if f["filename"] == SDIST)
        with urllib.request.urlopen(url, timeout=300) as r:
            data = r.read()
        if hashlib.sha256(data).hexdigest() != SHA256:
            raise RuntimeError(f"{url}: sha256 mismatch")
        archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"vllm_ascend-{VERSION}/vllm_ascend/")
                   and m.isfile() and m.name.endswith(".py")]
        tar.extractall(cache_dir(), members=members, filter="data")
    return root


# --- stubs of vLLM and torch_npu (only what the import of vllm-ascend's quantization package needs) ------------
def _module(name: str, **attrs: Any) -> types.ModuleType:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            mod = types.ModuleType(sub)
            mod.__path__ = []
            sys.modules[sub] = mod
            if i > 1:
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], mod)
    for key, value in attrs.items():
        setattr(sys.modules[name], key, value)
    return sys.modules[name]


class _DeviceOnly:
    """torch_npu's kernels: present for the import, an error if called on this CPU host."""

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"torch_npu.{item} is a device kernel (not on this CPU host)")

        return kernel


class _Logger:
    def __getattr__(self, item: str) -> Any:
        return getattr(logging.getLogger("vllm_ascend"), item.removesuffix("_once"))


class QuantizeMethodBase:
    def process_weights_after_loading(self, layer: Any) -> None:
        return None


class LinearBase(torch.nn.Module):
    pass


class RowParallelLinear(LinearBase):
    pass


class FusedMoE(torch.nn.Module):
    pass


class VocabParallelEmbedding(torch.nn.Module):
    pass


class AttentionLayerBase(torch.nn.Module):
    pass


class QuantizationConfig:
    def __init__(self) -> None:
        self.packed_modules_mapping: dict[str, list[str]] = {}  # as vLLM's base_config sets it


class WeightsMapper:
    """vLLM's checkpoint-name mapper (substr, then prefix, then suffix rules)."""

    def __init__(self, orig_to_new_substr: dict | None = None, orig_to_new_prefix: dict | None = None,
                 orig_to_new_suffix: dict | None = None, orig_to_new_regex: dict | None = None) -> None:
        self.substr, self.prefix = orig_to_new_substr or {}, orig_to_new_prefix or {}
        self.suffix = orig_to_new_suffix or {}

    def _map_name(self, key: str) -> str:
        for old, new in self.substr.items():
            if old in key:
                key = key.replace(old, new, 1)
        for old, new in self.prefix.items():
            if key.startswith(old):
                key = key.replace(old, new, 1)
        for old, new in self.suffix.items():
            if key.endswith(old):
                key = new.join(key.rsplit(old, 1))
        return key

    def apply_dict(self, values: dict) -> dict:
        return {self._map_name(k): v for k, v in values.items()}


class AscendDeviceType(Enum):
    A2 = 0
    A3 = 1
    _310P = 2
    A5 = 3


class MoECommType(Enum):
    ALLGATHER = 0
    MC2 = 1
    ALLTOALL = 2
    FUSED_MC2 = 3


_VLLM_CONFIG: dict[str, Any] = {"cfg": None}


def set_vllm_config(model_type: str, quant_config: Any = None, expert_parallel: bool = True, kv_lora_rank: int = 0,
                    qk_rope_head_dim: int = 0) -> None:
    """What `get_current_vllm_config()` returns: the served model's type (top-level hf_config.model_type) and,
    for the FA-quant scheme, its MLA sizes."""
    _VLLM_CONFIG["cfg"] = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type, kv_lora_rank=kv_lora_rank,
                                                               qk_rope_head_dim=qk_rope_head_dim),
                                     dtype=torch.bfloat16, enforce_eager=True, use_mla=kv_lora_rank > 0),
        quant_config=quant_config, parallel_config=SimpleNamespace(enable_expert_parallel=expert_parallel),
        compilation_config=SimpleNamespace(mode=0), kv_transfer_config=None)


def _no_group() -> Any:
    raise AttributeError("no communication group on this CPU host")  # the MoE schemes catch AttributeError


_STUBBED: list[str] = []  # module names this file put into sys.modules
_ADDED_TORCH_NPU = False


def remove_stubs() -> None:
    """Take the stubs out of sys.modules again: a `torch_npu` without a spec breaks transformers' device probes,
    and nothing else in the process may see a fake vLLM. vllm-ascend's own modules keep what they imported."""
    global _ADDED_TORCH_NPU
    for name in _STUBBED + [n for n in sys.modules if n == "vllm_ascend" or n.startswith("vllm_ascend.")]:
        sys.modules.pop(name, None)
    _STUBBED.clear()
    if _ADDED_TORCH_NPU:
        del torch.npu
        _ADDED_TORCH_NPU = False


def _install_stubs() -> None:
    global _ADDED_TORCH_NPU
    before = set(sys.modules)
    _install_stub_modules()
    _STUBBED.extend(sorted(set(sys.modules) - before))
    if not hasattr(torch, "npu"):
        torch.npu = SimpleNamespace(is_available=lambda: False)
        _ADDED_TORCH_NPU = True


def _install_stub_modules() -> None:
    if "torch_npu" not in sys.modules:
        npu = _module("torch_npu")
        npu.__getattr__ = _DeviceOnly().__getattr__
        npu.float8_e8m0fnu = getattr(torch, "float8_e8m0fnu", None)
        npu.float4_e2m1fn_x2 = getattr(torch, "float4_e2m1fn_x2", None)
        npu.hifloat8 = None
        npu.npu = SimpleNamespace(get_soc_version=lambda: 250)
    _module("vllm", __version__="0.23.0")
    _module("vllm.logger", logger=_Logger(), init_logger=lambda name: _Logger())
    _module("vllm.config", get_current_vllm_config=lambda: _VLLM_CONFIG["cfg"],
            get_current_vllm_config_or_none=lambda: _VLLM_CONFIG["cfg"],
            CompilationMode=SimpleNamespace(NONE=0, VLLM_COMPILE=3), VllmConfig=type("VllmConfig", (), {}))
    _module("vllm.distributed", get_tensor_model_parallel_world_size=lambda: 1,
            get_tensor_model_parallel_rank=lambda: 0, get_ep_group=lambda: None)
    _module("vllm.envs", VLLM_USE_MODELSCOPE=False)
    _module("vllm.forward_context", get_forward_context=lambda: None)
    _module("vllm.utils.math_utils", cdiv=lambda a, b: -(a // -b))
    _module("vllm.model_executor.layers.attention_layer_base", AttentionLayerBase=AttentionLayerBase)
    _module("vllm.model_executor.layers.linear", LinearBase=LinearBase, RowParallelLinear=RowParallelLinear,
            ColumnParallelLinear=type("ColumnParallelLinear", (LinearBase,), {}),
            LinearMethodBase=type("LinearMethodBase", (QuantizeMethodBase,), {}))
    _module("vllm.model_executor.layers.quantization", register_quantization_config=lambda name: (lambda c: c))
    _module("vllm.model_executor.layers.quantization.base_config", QuantizationConfig=QuantizationConfig,
            QuantizeMethodBase=QuantizeMethodBase)
    _module("vllm.model_executor.layers.quantization.kv_cache",
            BaseKVCacheMethod=type("BaseKVCacheMethod", (QuantizeMethodBase,), {"__init__": lambda s, *a: None}))
    _module("vllm.model_executor.layers.vocab_parallel_embedding", VocabParallelEmbedding=VocabParallelEmbedding,
            UnquantizedEmbeddingMethod=type("UnquantizedEmbeddingMethod", (QuantizeMethodBase,), {}))
    _module("vllm.model_executor.models.utils", WeightsMapper=WeightsMapper)
    _module("vllm.model_executor.layers.fused_moe", FusedMoE=FusedMoE,
            FusedMoEMethodBase=type("FusedMoEMethodBase", (QuantizeMethodBase,),
                                    {"__init__": lambda s, moe=None: setattr(s, "moe", moe)}),
            FusedMoeWeightScaleSupported=SimpleNamespace(**{k: SimpleNamespace(value=k.lower())
                                                            for k in ("TENSOR", "CHANNEL", "GROUP", "BLOCK")}))
    _module("vllm.model_executor.layers.fused_moe.config", FusedMoEConfig=type("FusedMoEConfig", (), {}))
    _module("vllm.model_executor.parameter", PerTensorScaleParameter=torch.nn.Parameter)
    _module("vllm.model_executor.utils",
            set_weight_attrs=lambda w, attrs: [setattr(w, k, v) for k, v in (attrs or {}).items()])
    off = lambda *a, **k: False  # noqa: E731 - feature switches of the serving runtime, all off
    _module("vllm_ascend.utils", ASCEND_QUANTIZATION_METHOD="ascend", COMPRESSED_TENSORS_METHOD="compressed-tensors",
            FP8_METHOD="fp8", ACL_FORMAT_FRACTAL_ND=2, ACL_FORMAT_FRACTAL_NZ=29, AscendDeviceType=AscendDeviceType,
            calc_split_factor=lambda nums: [sum(nums) / n for n in nums],
            get_ascend_device_type=lambda: AscendDeviceType.A3, vllm_version_is=lambda v: v == "0.23.0",
            maybe_trans_nz=lambda w: w, enable_dsa_cp=off, enable_dsa_cp_with_layer_shard=off,
            flashcomm2_enable=off, mlp_tp_enable=off, oproj_tp_enable=off, get_weight_prefetch_method=lambda: None)
    _module("vllm_ascend.logger")
    _module("vllm_ascend.ascend_config", get_ascend_config=lambda: SimpleNamespace(
        eplb_config=SimpleNamespace(dynamic_eplb=False), multistream_overlap_gate=False, enable_fused_mc2=0,
        flashcomm2_oproj_tensor_parallel_size=1))
    _module("vllm_ascend.ascend_forward_context", _EXTRA_CTX=SimpleNamespace(), MoECommType=MoECommType)
    _module("vllm_ascend.distributed.parallel_state", get_mc2_group=_no_group, get_flashcomm2_otp_group=_no_group,
            get_mlp_tp_group=_no_group, get_otp_group=_no_group)
    _module("vllm_ascend.flash_common3_context", get_flash_common3_context=lambda: None)
    _module("vllm_ascend.ops.fused_moe.experts_selector", select_experts=None, zero_experts_compute=None)
    _module("vllm_ascend.ops.fused_moe.moe_runtime_args", build_fused_experts_input=None)
    _module("vllm_ascend.ops.linear",
            AscendUnquantizedLinearMethod=type("AscendUnquantizedLinearMethod", (QuantizeMethodBase,), {}))
    _module("vllm_ascend.ops.fused_moe.fused_moe", AscendUnquantizedFusedMoEMethod=type(
        "AscendUnquantizedFusedMoEMethod", (QuantizeMethodBase,), {"__init__": lambda s, cfg=None: None}))


def import_vllm_ascend() -> types.ModuleType:
    """vllm_ascend.quantization.modelslim_config, as shipped, importable on this CPU host (call remove_stubs()
    when done with it)."""
    if "vllm_ascend.quantization.modelslim_config" in sys.modules:
        return sys.modules["vllm_ascend.quantization.modelslim_config"]
    root = source_tree()
    _install_stubs()
    stubbed = {k: v for k, v in sys.modules.items() if k.startswith("vllm_ascend.")}
    del sys.modules["vllm_ascend"]  # the real package __init__ from the sdist, with the stubbed submodules kept
    sys.path.insert(0, str(root))
    try:
        import vllm_ascend

        for name, module in stubbed.items():
            sys.modules[name] = module
        vllm_ascend.utils = stubbed["vllm_ascend.utils"]
        import vllm_ascend.quantization.methods.registry as registry
        import vllm_ascend.quantization.modelslim_config as modelslim_config
    finally:
        sys.path.remove(str(root))
    modelslim_config.SCHEME_REGISTRY = registry._SCHEME_REGISTRY  # kept reachable once the stubs are gone
    return modelslim_config
