"""Our tensors through vllm-ascend 0.23.0.post1's own weight processing: its W4A8_DYNAMIC fused-MoE and
W8A8_DYNAMIC linear `process_weights_after_loading` (run as shipped on CPU; torch_npu's kernels are stubs, and the
one device move `.npu()` is the identity), fed the way vLLM's loader feeds them (each checkpoint tensor copied into
its slice of the layer's parameter, with the parameter's dtype).

Reference: our own reader's dequantisation of the same tensors (`AscendV1Reader.get`, q * weight_scale in fp32).
Tolerance: none for weights and scales (bitwise); scale_bias 1e-6 relative (a sum in another order).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from msmodelslim.serving.ascendv1 import AscendV1Reader

from . import vllm_ascend_cpu as ascend

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)


@pytest.fixture
def npu_is_cpu(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "npu", lambda self: self, raising=False)


def _tensor(reader: AscendV1Reader, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(reader.out_dir / reader.weight_map[name]), framework="pt") as f:
        return f.get_tensor(name)


def _unpack_output_dim(packed: torch.Tensor) -> torch.Tensor:
    """[..., in, out/2] bytes holding two int4 along the output dim (low nibble first) -> int8 [..., in, out]."""
    low = (packed.to(torch.int16) << 12 >> 12).to(torch.int8)  # sign-extend the low nibble
    high = (packed.to(torch.int16) >> 4).to(torch.int8)
    return torch.stack([low, high], dim=-1).flatten(-2)


def _first_moe(description: dict) -> str:
    return next(k.rsplit(".experts.", 1)[0] for k in description if ".experts.0.w1.weight" in k)


def moe_layer(reader: AscendV1Reader, description: dict, method, suffixes: tuple[str, ...]):
    """(layer, MoE name, expert indices): a fused-MoE layer of `method`'s parameters (`get_weight` +
    `get_dynamic_quant_param`), the first MoE's expert tensors `suffixes` copied in as vLLM's FusedMoE loader does
    (w1 -> first half of w13, w3 -> second half, w2 -> w2); every tensor must fit its slice in shape, and in dtype
    or exactly in the parameter's dtype (the loader casts: W8A8 scales are bf16 values kept in fp32)."""
    moe = _first_moe(description)
    experts = sorted({int(k.split(".experts.")[1].split(".")[0]) for k in description
                      if k.startswith(moe + ".experts.") and k.endswith(".w1.weight")})
    inter, hidden = reader.get(f"{moe}.experts.0.w1.weight").shape
    layer = torch.nn.Module()
    params = {**method.get_weight(len(experts), inter, hidden, torch.bfloat16),
              **method.get_dynamic_quant_param(len(experts), inter, hidden, torch.bfloat16)}
    for name, value in params.items():
        layer.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
    for e in experts:
        for w, dst, half in (("w1", "w13", 0), ("w3", "w13", 1), ("w2", "w2", None)):
            for suffix in suffixes:
                src = _tensor(reader, f"{moe}.experts.{e}.{w}.{suffix}")
                param = getattr(layer, f"{dst}_{suffix}").data[e]
                if half is not None:
                    param = param.narrow(0, half * src.shape[0], src.shape[0])
                assert param.shape == src.shape, (w, suffix, param.shape, src.shape)
                # the loader copies into the parameter's dtype: a different dtype must hold our values exactly
                assert param.dtype == src.dtype or torch.equal(src.to(param.dtype).to(src.dtype), src), \
                    (w, suffix, param.dtype, src.dtype)
                param.copy_(src)
    return layer, moe, experts


def test_w4a8_fused_moe_after_loading_equals_our_dequantised_experts(vllm_ascend, outputs, npu_is_cpu):
    out = outputs[("mini", "w4a8c8")] if ("mini", "w4a8c8") in outputs else outputs[("tiny_k3", "w4a8c8")]
    reader = AscendV1Reader(out)
    description = json.loads((out / "quant_model_description.json").read_text())
    config = vllm_ascend.AscendModelSlimConfig(dict(description))
    ascend.set_vllm_config("kimi_linear", config)
    from vllm_ascend.quantization.methods.w4a8 import AscendW4A8DynamicFusedMoEMethod

    method = AscendW4A8DynamicFusedMoEMethod()
    layer, moe, experts = moe_layer(reader, description, method,
                                    ("weight", "weight_scale", "weight_offset", "scale_bias"))
    method.process_weights_after_loading(layer)

    q = _unpack_output_dim(layer.w13_weight.data.view(torch.int8)).transpose(1, 2)  # [E, 2I, H]
    scale = layer.w13_weight_scale.data.to(torch.int64).to(torch.int32).view(torch.float32)  # fp32 bits in int64
    for i, e in enumerate(experts):
        ours = torch.cat([reader.get(f"{moe}.experts.{e}.{w}.weight", dtype=torch.float32) for w in ("w1", "w3")])
        assert torch.equal(q[i].to(torch.float32) * scale[i][:, None], ours)
        bias = torch.cat([_tensor(reader, f"{moe}.experts.{e}.{w}.scale_bias").sum(-1) for w in ("w1", "w3")])
        torch.testing.assert_close(layer.w13_scale_bias.data[i], bias, rtol=1e-6, atol=0)
    q2 = _unpack_output_dim(layer.w2_weight.data.view(torch.int8)).transpose(1, 2)  # [E, H, I]
    scale2 = layer.w2_weight_scale.data.to(torch.int32).view(torch.float32).squeeze(1)  # [E, H]
    for i, e in enumerate(experts):
        ours = reader.get(f"{moe}.experts.{e}.w2.weight", dtype=torch.float32)
        assert torch.equal(q2[i].to(torch.float32) * scale2[i][:, None], ours)


@pytest.mark.parametrize("quant_type", ["w4a8c8", "w8a8"])
def test_w8a8_linear_after_loading_equals_our_dequantised_weight(vllm_ascend, outputs, quant_type):
    # the engine holds W8A8 scales in the model dtype (bf16): equality is exact only because we quantized
    # against the bf16 value of each scale
    key = ("mini", quant_type) if ("mini", quant_type) in outputs else ("tiny_k3", quant_type)
    reader = AscendV1Reader(outputs[key])
    from vllm_ascend.quantization.methods.w8a8_dynamic import AscendW8A8DynamicLinearMethod

    names = [n for n in reader.quantized_linears() if reader.quant_type(n) == "W8A8_DYNAMIC"]
    assert names
    for name in names:
        q_ours = _tensor(reader, f"{name}.weight")
        method = AscendW8A8DynamicLinearMethod()
        layer = SimpleNamespace(prefix=name)
        params = {**method.get_weight(q_ours.shape[1], q_ours.shape[0], torch.bfloat16),
                  **method.get_perchannel_param(q_ours.shape[0], torch.bfloat16)}
        for pname, value in params.items():
            value.copy_(_tensor(reader, f"{name}.{pname}"))
            setattr(layer, pname, torch.nn.Parameter(value, requires_grad=False))
        method.process_weights_after_loading(layer)
        theirs = layer.weight.data.t().to(torch.float32) * layer.weight_scale_fp32[:, None]
        assert torch.equal(theirs, reader.get(f"{name}.weight", dtype=torch.float32)), name


def test_a_fallback_w8a8_fused_moe_takes_our_expert_tensors(vllm_ascend, fallback_output):
    """The experts spec.fallback moved to W8A8_DYNAMIC (layer 1, the first MoE) fill vllm-ascend's W8A8_DYNAMIC
    fused-MoE parameters slice by slice, shape and dtype (moe_layer's checks), and the int8 weights copied in are
    our integers (exact)."""
    reader = AscendV1Reader(fallback_output)
    description = json.loads((fallback_output / "quant_model_description.json").read_text())
    config = vllm_ascend.AscendModelSlimConfig(dict(description))
    ascend.set_vllm_config("kimi_k3", config)
    from vllm_ascend.quantization.methods.w8a8_dynamic import AscendW8A8DynamicFusedMoEMethod

    layer, moe, experts = moe_layer(reader, description, AscendW8A8DynamicFusedMoEMethod(),
                                    ("weight", "weight_scale", "weight_offset"))
    assert moe.endswith("layers.1.block_sparse_moe")
    for i, e in enumerate(experts):
        assert torch.equal(layer.w2_weight.data[i], _tensor(reader, f"{moe}.experts.{e}.w2.weight"))
