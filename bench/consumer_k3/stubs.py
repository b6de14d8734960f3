"""What vllm-ascend's own unit tests stub to run its classes on a CPU host (`tests/ut/conftest.py` of
releases/v0.26.0rc: torch_npu, acl, mooncake, triton's runtime, the `npu` device name), plus what an extracted
source tree lacks (`_build_info`, written by its setup.py) and a placeholder torchvision (PyPI's wheels are CUDA
builds that cannot load beside a CPU torch; only a Qwen patch imports it, never the Kimi-K3 path). Import first."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from unittest.mock import MagicMock


def _module(name: str, cls: type = types.ModuleType) -> types.ModuleType:
    module = cls(name)
    module.__spec__ = importlib.util.spec_from_loader(name, loader=None)
    module.__path__ = []
    sys.modules[name] = module
    if "." in name:
        parent, child = name.rsplit(".", 1)
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)
    return module


class _Anything(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


runtime = MagicMock()
runtime.driver.active.utils.get_device_properties.return_value = {"num_aic": 8, "num_vectorcore": 8}
sys.modules["triton.runtime"] = runtime
torch_npu = _module("torch_npu")
for attr in ("npu", "profiler", "npu_fusion_attention", "_C"):
    setattr(torch_npu, attr, MagicMock())
torch_npu.npu_format_cast = MagicMock(side_effect=lambda weight, fmt: weight)
torch_npu._C._NPUTaskGroupHandle = MagicMock
sys.modules["torch_npu._C"] = torch_npu._C
sys.modules["torch_npu._C._distributed_c10d"] = torch_npu._C._distributed_c10d
_module("acl").rt = _module("acl.rt")
sys.modules["acl.rt"].memcpy = MagicMock()
_module("mooncake.engine").TransferEngine = MagicMock()
_module("vllm_ascend._build_info").__device_type__ = os.environ.get("ASCEND_DEVICE_TYPE", "A3")
for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional", "torchvision.transforms.functional", "torchvision.io",
             "torchvision.ops"):
    _module(name, _Anything)
sys.modules["torchvision"].__version__ = "0.28.0"

import torch  # noqa: E402

try:
    torch.utils.rename_privateuse1_backend("npu")
except RuntimeError:
    pass
torch.npu = MagicMock()
torch.npu.is_available = MagicMock(return_value=False)
torch.npu.Stream = MagicMock
torch.version.cann = None
torch.distributed.is_hccl_available = MagicMock(return_value=True)
torch.Tensor.npu = lambda self, *a, **k: self  # the layers move their tensors with .npu() (fused_moe.py:458)
torch.nn.Module.npu = lambda self, *a, **k: self


def after_vllm_ascend_import() -> None:
    """conftest's second half: device kernels as mocks, then vllm-ascend's patches and custom ops."""
    from vllm_ascend.utils import adapt_patch, register_ascend_customop

    torch_npu.npu.current_device = MagicMock(return_value=0)
    sys.modules["torch_npu._inductor"] = MagicMock()
    for name in ("_npu_flash_attention", "_npu_paged_attention_splitfuse", "_npu_reshape_and_cache",
                 "npu_scatter_pa_kv_cache", "npu_gather_pa_kv_cache", "npu_fused_infer_attention_score",
                 "_npu_fused_infer_attention_score_get_max_workspace", "npu_moe_gating_top_k_softmax",
                 "npu_quant_matmul", "npu_rms_norm", "npu_swiglu", "npu_convert_weight_to_int4pack",
                 # a torch_npu new enough for the MX schemes (Ascend 950)
                 "npu_dynamic_mx_quant", "npu_grouped_matmul_swiglu_quant_v2"):
        setattr(torch_npu, name, MagicMock())
    torch_npu.float8_e8m0fnu = torch.float8_e8m0fnu
    torch_npu.float4_e2m1fn_x2 = torch.float4_e2m1fn_x2
    # 0.27 quantization/utils.py:36 reads it at import (tests/ut/conftest.py:65 stubs it as 290); no torch twin
    torch_npu.hifloat8 = 290
    adapt_patch()
    adapt_patch(True)
    register_ascend_customop()
