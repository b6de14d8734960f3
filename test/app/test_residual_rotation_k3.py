"""Kimi-K3 with its residual stream rotated (`quarot.rotate_hidden: true`, the shipped `kimi_k3_w4a8_upstream`):
the projector ends in an RMSNorm, so the output carries the rotation of the image path as the stored linear
`mm_projector.rot_proj` [hidden, hidden] that vllm-ascend's Kimi-K3 class applies after the projector
(`releases/v0.26.0rc`, `models/kimi_k3.py:1694-1711`).

Reference: the published residual rotation Q (`optional/quarot.safetensors`, float32): rot_proj must be Q^T rounded
once to BF16, bit for bit. The served math (every unit loaded from the output, quantized linears from their stored
integers, rot_proj after the projector) on an image+text sample must match the float model as closely as the same
practice without the residual rotation: relative RMS error of the logits at most 1.5x the unrotated output's (the
tiny model's random weights make both errors a few percent; a missing rot_proj puts the image tokens in the
wrong basis, an error of order 1). Practices cut to 4 records, min/max weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from runner.dp_helpers import shrunken_practice
from safetensors.torch import load_file

from msmodelslim.cli.main import main
from msmodelslim.eval.perplexity import wrap_quantized_linears
from msmodelslim.serving.ascendv1 import AscendV1Reader

pytestmark = pytest.mark.slow  # whole quantization runs

REPO = Path(__file__).resolve().parents[2]
PRACTICE = REPO / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8_upstream.yaml"


def _quantize(checkpoint: Path, root: Path, rotate_hidden: bool) -> Path:
    practice = shrunken_practice(PRACTICE, root / f"p{int(rotate_hidden)}.yaml", max_samples=4, max_seq_len=64,
                                 plain_numerics=True)
    data = yaml.safe_load(practice.read_text())
    data["spec"]["process"][0]["rotate_hidden"] = rotate_hidden
    practice.write_text(yaml.safe_dump(data, sort_keys=False))
    out = root / f"out{int(rotate_hidden)}"
    assert main(["quant", "--model_path", str(checkpoint), "--save_path", str(out), "--device", "cpu",
                 "--model_type", "Kimi-K3", "--config_path", str(practice), "--trust_remote_code", "True"]) == 0
    return out


@pytest.fixture(scope="module")
def outputs(tiny_k3_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("rotated")
    return {flag: _quantize(tiny_k3_checkpoint, root, flag) for flag in (True, False)}


def _logits(checkpoint: Path, sample: dict, output: Path | None) -> torch.Tensor:
    """The head's logits of one sample, unit by unit (MTP layers left out), from the source or from an output (a
    fresh adapter each: simulated linears replace the skeleton's)."""
    from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter

    reader = None if output is None else AscendV1Reader(output)
    state = dict(sample, need_logits=True)
    with KimiK3ModelAdapter(checkpoint, trust_remote_code=True) as adapter:
        for unit in adapter.units():
            if unit.kind == "mtp":
                continue
            module = adapter.load_unit(unit, torch.device("cpu"), reader=reader)
            if reader is not None:
                wrap_quantized_linears(adapter, unit, module, reader, torch.bfloat16)
            with torch.no_grad():
                state = adapter.forward_unit(unit, module, state)
            adapter.free_unit(unit, module)
    return state["logits"].float()


def test_the_rotated_output_carries_the_projector_rotation_as_q_transposed_in_bf16(outputs):
    out = outputs[True]
    q = load_file(str(out / "optional" / "quarot.safetensors"))["global_rotation"]
    reader = AscendV1Reader(out)
    rot = reader.get("mm_projector.rot_proj.weight")
    assert rot.dtype == torch.bfloat16 and torch.equal(rot, q.T.to(torch.bfloat16))
    assert reader.description["mm_projector.rot_proj.weight"] == "FLOAT"
    assert "mm_projector.rot_proj.weight" not in AscendV1Reader(outputs[False])


def test_the_upstream_selection_keeps_kda_side_projections_and_output_projections_float(outputs):
    description = json.loads((outputs[True] / "quant_model_description.json").read_text())
    kda = "language_model.model.layers.0.self_attn."
    for name in ("b_proj", "f_a_proj", "f_b_proj", "g_proj", "o_proj"):
        assert description[f"{kda}{name}.weight"] == "FLOAT", name
    for name in ("q_proj", "k_proj", "v_proj"):  # vllm-ascend's fused_qkv: one scheme for q/k/v
        assert description[f"{kda}{name}.weight"] == "W8A8_DYNAMIC", name
    assert not any("in_proj_qkvgfab" in k for k in description)  # vLLM 0.33's fusion is not this output's layout
    assert description["language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight"] \
        == "W8A8_DYNAMIC"


def test_an_image_and_text_forward_of_the_rotated_output_is_as_close_to_the_float_model(outputs,
                                                                                         tiny_k3_checkpoint):
    from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter

    with KimiK3ModelAdapter(tiny_k3_checkpoint, trust_remote_code=True) as adapter:
        placeholder = adapter.config.media_placeholder_token_id
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (1, 24), generator=gen)
    ids[0, 3:7] = placeholder
    sample = {"input_ids": ids, "pixel_values": torch.randn(16, 3, 14, 14, generator=gen),
              "grid_thws": torch.tensor([[1, 4, 4]])}
    ref = _logits(tiny_k3_checkpoint, sample, None)
    errors = {flag: float((_logits(tiny_k3_checkpoint, sample, out) - ref).norm() / ref.norm())
              for flag, out in outputs.items()}
    assert errors[True] <= 1.5 * errors[False], errors
    assert errors[False] < 0.2, errors
