"""The absorbed MLA forward that carries the FA3 points equals the model's own MLA forward.

Reference: the checkpoint classes' own forwards (the stand-in's KimiMLAAttention with q-LoRA and the output gate;
transformers' native KimiLinearAttention without q-LoRA), float32, random weights with non-trivial norms.
Tolerance: 2e-5 relative to the output's largest magnitude (fp32 rounding of a different summation order).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from kimi_test_models import native_config, native_kimi_linear, standin_vlm
from transformers.masking_utils import create_causal_mask

from msmodelslim.model.kimi_k3 import fa3
from msmodelslim.model.kimi_k3.runtime_patches import PatchHandle, runtime_patches
from msmodelslim.quant.attention import AttentionFakeQuant, AttentionQuantSpec, install_quantizers

TOL = 2e-5  # measured: 1e-7 .. 4e-7


def _mla_layers(model):
    lm = getattr(model, "language_model", model)
    return [layer.self_attn for layer in lm.model.layers if fa3.is_mla(layer.self_attn)]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@contextlib.contextmanager
def _points(attn, returns_weights: bool):
    handle = PatchHandle()
    fa3.inject_fa3_placeholders(handle, attn, lambda _: True, returns_weights=returns_weights)
    try:
        yield
    finally:
        fa3.remove_fa3_points(attn)
        handle.undo()


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def standin_mla():
    model, _ = standin_vlm()
    with runtime_patches(model, device_type="cpu"):
        attn = _mla_layers(model)[0]
        assert attn.q_lora_rank is not None and getattr(attn, "g_proj", None) is not None
        yield attn


@pytest.fixture(scope="module")
def native_mla():
    model = native_kimi_linear()
    attn = _mla_layers(model)[0]
    assert attn.q_lora_rank is None
    return attn


def test_absorbed_forward_equals_the_standin_mla_with_q_lora_and_output_gate(standin_mla):
    x = torch.randn(2, 13, standin_mla.hidden_size, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0  # left padding: padded keys hidden
    expected = [standin_mla(x, attention_mask=m) for m in (None, mask)]
    with _points(standin_mla, returns_weights=False):
        for m, want in zip((None, mask), expected):
            assert _close(fa3.absorbed_mla_forward(standin_mla, x, m), want) < TOL


def test_absorbed_forward_equals_transformers_native_kimi_linear_attention(native_mla):
    x = torch.randn(1, 17, native_mla.hidden_size, generator=torch.Generator().manual_seed(1))
    config = native_config()
    config._attn_implementation = "sdpa"
    mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                              position_ids=torch.arange(17)[None])
    expected, _ = native_mla(x, attention_mask=mask)
    with _points(native_mla, returns_weights=True):
        assert _close(fa3.absorbed_mla_forward(native_mla, x, mask), expected) < TOL
        assert _close(fa3.absorbed_mla_forward(native_mla, x, None), expected) < TOL  # None: causal


def test_placeholders_are_the_identity_and_the_class_is_restored_on_undo(native_mla):
    cls = type(native_mla)
    own = cls.forward
    x = torch.randn(1, 9, native_mla.hidden_size, generator=torch.Generator().manual_seed(2))
    expected, _ = native_mla(x, attention_mask=None)
    handle = PatchHandle()
    names = fa3.inject_fa3_placeholders(handle, native_mla, lambda _: True, returns_weights=True)
    assert names == [""] and cls.forward is not own
    out, weights = native_mla(x, attention_mask=None)  # the patched class: absorbed form through the points
    assert weights is None and _close(out, expected) < TOL
    fa3.remove_fa3_points(native_mla)
    out, _ = native_mla(x, attention_mask=None)  # no points: the class's own forward, bit for bit
    assert torch.equal(out, expected)
    handle.undo()
    assert cls.forward is own


def test_quantized_points_change_the_output_by_int8_rounding_only(native_mla):
    """int8 per-head points with scales from the data: the output moves, by about the rounding of 8-bit inputs."""
    x = torch.randn(1, 11, native_mla.hidden_size, generator=torch.Generator().manual_seed(3))
    expected, _ = native_mla(x, attention_mask=None)
    with _points(native_mla, returns_weights=True):
        spec = AttentionQuantSpec("int8", "per_head")
        big = torch.full((native_mla.num_heads,), 10.0)
        install_quantizers(native_mla, {"fa_q": (spec, big / 127), "fa_k": (spec, torch.tensor([10.0 / 127])),
                                        "fa_v": (spec, torch.tensor([10.0 / 127]))})
        assert isinstance(native_mla.fa_k, AttentionFakeQuant) and native_mla.fa_v.observe_only
        out, _ = native_mla(x, attention_mask=None)
        assert 1e-4 < _close(out, expected) < 0.05


def test_the_absorbed_form_in_bfloat16_is_as_accurate_as_the_models_own(standin_mla):
    """Reference: the own forward in float64. The absorbed bf16 forward (what calibration and eval run) may
    round differently from the own bf16 forward, but not worse: error at most 1.25x the own one's."""
    import copy

    x = torch.randn(1, 64, standin_mla.hidden_size, generator=torch.Generator().manual_seed(4))
    ref = copy.deepcopy(standin_mla).double()(x.double())
    attn = copy.deepcopy(standin_mla).to(torch.bfloat16)
    own = attn(x.bfloat16()).double()
    with _points(attn, returns_weights=False):
        absorbed = attn(x.bfloat16()).double()
    err = {name: float((out - ref).norm() / ref.norm()) for name, out in (("own", own), ("absorbed", absorbed))}
    assert 0 < err["absorbed"] <= 1.25 * err["own"], err
