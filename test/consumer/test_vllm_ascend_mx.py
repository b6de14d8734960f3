"""The Ascend 950 (MX) and per-group W4A8 outputs of the tiny Kimi-K3 through vllm-ascend 0.23.0.post1's own code:
its scheme lookup for every layer vLLM 0.33 builds, and each scheme's layer built as vllm-ascend builds it
(`get_weight` + `get_dynamic_quant_param` / `get_pergroup_param`: names, shapes, dtypes), our tensors copied into its
parameters the way vLLM's loader does, then its `process_weights_after_loading` run as shipped.

torch_npu is stubbed (no NPU here). `npu_format_cast` (a layout cast to NZ, values unchanged) and
`npu_convert_weight_to_int4pack` stand in as the identity, and `.npu()` is the identity.

References:
- for MXFP4 weights, vllm-ascend's own decoder (`w4a16_mxfp4.unpack_uint8_to_fp4_return_float32`, low nibble
  first) times 2^(E8M0 - 127) per block of 32;
- for per-group W4A8, the fp32 group scales its `process_scale` packs into int64;
- compared with our reader's dequantised weights (`AscendV1Reader.get`). Tolerance: none (bitwise), except
  scale_bias at 1e-6 relative (a sum in another order).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from msmodelslim.serving.ascendv1 import AscendV1Reader

from .outputs import MX_PRACTICES
from .test_vllm_ascend_lookup import lookup_failures
from .test_vllm_ascend_weights import _tensor, _unpack_output_dim, moe_layer
from .vllm_layers import V033

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)


@pytest.fixture
def npu_identity(monkeypatch):
    """The NPU-only layout casts as the identity (values unchanged), `.npu()` too."""
    npu = sys.modules["torch_npu"]
    monkeypatch.setattr(torch.Tensor, "npu", lambda self: self, raising=False)
    monkeypatch.setattr(npu, "npu_format_cast", lambda w, *a, **k: w, raising=False)
    monkeypatch.setattr(npu, "npu_convert_weight_to_int4pack", lambda w, *a, **k: w, raising=False)


@pytest.mark.parametrize("practice", [*MX_PRACTICES, "w4a8_pergroup"])
def test_every_tiny_kimi_k3_layer_resolves_to_the_practice_scheme(vllm_ascend, outputs, practice):
    count, failures = lookup_failures(vllm_ascend, outputs[("tiny_k3", practice)], V033)
    assert count > 30 and failures == [], "\n".join(failures)


def _mx_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vllm-ascend's FP4 decoder, times the E8M0 scale of each block of 32 along the last dim."""
    from vllm_ascend.quantization.methods.w4a16_mxfp4 import unpack_uint8_to_fp4_return_float32

    values = unpack_uint8_to_fp4_return_float32(packed)
    return values * torch.exp2(scale.to(torch.float32) - 127).repeat_interleave(32, dim=-1)


@pytest.mark.parametrize("practice, scheme, module, cls", [
    ("w4a16_mxfp4", "W4A16_MXFP4", "w4a16_mxfp4", "AscendW4A16MXFP4FusedMoEMethod"),
    ("w4a8_mxfp", "W4A8_MXFP", "w4a8_mxfp4", "AscendW4A8MXFPDynamicFusedMoEMethod"),
    ("w4a4c8_mxfp", "W4A4_MXFP4", "w4a4_mxfp4", "AscendW4A4MXFP4DynamicFusedMoEMethod"),
])
def test_mxfp4_fused_moe_loads_our_experts_and_decodes_to_our_weights(vllm_ascend, outputs, npu_identity, practice,
                                                                      scheme, module, cls):
    import importlib

    out = outputs[("tiny_k3", practice)]
    reader = AscendV1Reader(out)
    description = json.loads((out / "quant_model_description.json").read_text())
    assert description["group_size"] == 32
    from . import vllm_ascend_cpu as ascend

    ascend.set_vllm_config("kimi_k3", vllm_ascend.AscendModelSlimConfig(dict(description)))
    method = getattr(importlib.import_module(f"vllm_ascend.quantization.methods.{module}"), cls)()
    layer, moe, experts = moe_layer(reader, description, method, ("weight", "weight_scale"))
    for i, e in enumerate(experts):
        ours = torch.cat([reader.get(f"{moe}.experts.{e}.{w}.weight", dtype=torch.float32) for w in ("w1", "w3")])
        assert reader.quant_type(f"{moe}.experts.{e}.w1") == scheme
        assert torch.equal(_mx_dequant(layer.w13_weight.data[i], layer.w13_weight_scale.data[i]), ours)
        ours2 = reader.get(f"{moe}.experts.{e}.w2.weight", dtype=torch.float32)
        assert torch.equal(_mx_dequant(layer.w2_weight.data[i], layer.w2_weight_scale.data[i]), ours2)
    scale_shape = tuple(layer.w13_weight_scale.shape)
    method.process_weights_after_loading(layer)  # accepts the shapes (paired scales need K/32 even)
    assert layer.w13_weight_scale.numel() == scale_shape[0] * scale_shape[1] * scale_shape[2]


def test_w8a8_mxfp8_linears_load_and_decode_to_our_weights(vllm_ascend, outputs):
    out = outputs[("tiny_k3", "w4a8_mxfp")]
    reader = AscendV1Reader(out)
    from . import vllm_ascend_cpu as ascend

    ascend.set_vllm_config("kimi_k3", vllm_ascend.AscendModelSlimConfig(
        json.loads((out / "quant_model_description.json").read_text())))
    from vllm_ascend.quantization.methods.w8a8_mxfp8 import AscendW8A8MXFP8DynamicLinearMethod

    names = [n for n in reader.quantized_linears() if reader.quant_type(n) == "W8A8_MXFP8"]
    assert len(names) > 10
    for name in names:
        ours = reader.get(f"{name}.weight", dtype=torch.float32)
        out_f, in_f = ours.shape
        method = AscendW8A8MXFP8DynamicLinearMethod()
        layer = torch.nn.Module()
        for pname, value in {**method.get_weight(in_f, out_f, torch.bfloat16),
                             **method.get_pergroup_param(in_f, out_f, torch.bfloat16)}.items():
            src = _tensor(reader, f"{name}.{pname}")
            assert value.shape == src.shape and value.dtype == src.dtype, (name, pname)
            value.copy_(src)
            layer.register_parameter(pname, torch.nn.Parameter(value, requires_grad=False))
        scale = torch.exp2(layer.weight_scale.data.to(torch.float32) - 127).repeat_interleave(32, dim=-1)
        assert torch.equal(layer.weight.data.to(torch.float32) * scale[:, :in_f], ours), name
        method.process_weights_after_loading(layer)
        assert tuple(layer.weight.shape) == (in_f, out_f)


def test_per_group_w4a8_fused_moe_after_loading_equals_our_dequantised_experts(vllm_ascend, outputs, npu_identity):
    out = outputs[("tiny_k3", "w4a8_pergroup")]
    reader = AscendV1Reader(out)
    description = json.loads((out / "quant_model_description.json").read_text())
    from .outputs import TINY_GROUP

    assert description["group_size"] == TINY_GROUP
    from . import vllm_ascend_cpu as ascend

    ascend.set_vllm_config("kimi_k3", vllm_ascend.AscendModelSlimConfig(dict(description)))
    from vllm_ascend.quantization.methods.w4a8 import AscendW4A8DynamicFusedMoEMethod

    method = AscendW4A8DynamicFusedMoEMethod()
    assert not method.is_per_channel_weight
    suffixes = ("weight", "weight_scale", "weight_offset", "weight_scale_second", "weight_offset_second", "scale_bias")
    layer, moe, experts = moe_layer(reader, description, method, suffixes)
    method.process_weights_after_loading(layer)

    def group_scales(packed: torch.Tensor) -> torch.Tensor:  # int64 [E, G, n]: fp32 bits in the low half
        return packed.to(torch.int32).view(torch.float32)

    for dst, names in (("w13", ("w1", "w3")), ("w2", ("w2",))):
        q = _unpack_output_dim(getattr(layer, f"{dst}_weight").data.view(torch.int8))  # [E, K, N]
        scales = group_scales(getattr(layer, f"{dst}_weight_scale").data)  # [E, K / g, N]
        theirs = q.to(torch.float32) * scales.repeat_interleave(TINY_GROUP, dim=1)
        for i, e in enumerate(experts):
            ours = torch.cat([reader.get(f"{moe}.experts.{e}.{w}.weight", dtype=torch.float32) for w in names])
            assert torch.equal(theirs[i].t(), ours), (dst, e)
            bias = torch.cat([_tensor(reader, f"{moe}.experts.{e}.{w}.scale_bias").sum(-1) for w in names])
            torch.testing.assert_close(getattr(layer, f"{dst}_scale_bias").data[i].flatten(), bias, rtol=1e-6, atol=0)
