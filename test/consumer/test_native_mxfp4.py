"""Kimi-K3's own MXFP4 experts kept, not re-quantized: with a practice that neither rotates nor smooths them, every
routed expert of the output is the checkpoint's bytes, and dequantises to what compressed-tensors' own decoder
makes of the source checkpoint (formats/mxfp4_ct_reference.py: `MXFP4PackedCompressor.decompress`), bit for bit.
A practice that rotates the experts' space quantizes them again from the rotated weights, and says so.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from formats.mxfp4_ct_reference import ct_decode, same_bits
from runner.dp_helpers import shrunken_practice
from safetensors import safe_open

from msmodelslim.app.quant import QuantArgs, quant
from msmodelslim.serving.ascendv1 import AscendV1Reader

from .outputs import MX_PRACTICES, PRACTICES

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)


def _source(checkpoint, name: str) -> torch.Tensor:
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(checkpoint / index[name]), framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("practice", MX_PRACTICES)
def test_every_routed_expert_is_the_checkpoints_mxfp4_bit_for_bit(outputs, tiny_k3_checkpoint, practice):
    reader = AscendV1Reader(outputs[("tiny_k3", practice)])
    experts = [n for n in reader.quantized_linears() if ".experts." in n and ".shared_experts." not in n]
    assert len(experts) >= 3 * 16 * 4  # w1 / w2 / w3 of every expert of every MoE layer, MTP included
    for name in experts:
        packed, scale = _source(tiny_k3_checkpoint, f"{name}.weight_packed"), \
            _source(tiny_k3_checkpoint, f"{name}.weight_scale")
        assert torch.equal(reader.get_stored(f"{name}.weight"), packed), name
        assert torch.equal(reader.get_stored(f"{name}.weight_scale"), scale), name
        assert same_bits(reader.get(f"{name}.weight", dtype=torch.bfloat16), ct_decode(packed, scale)), name


def test_experts_a_rotation_changed_are_quantized_again_and_the_log_says_so(tiny_k3_checkpoint, tmp_path, caplog):
    rotate = {"type": "quarot", "seed": 0, "rotate_hidden": False, "online_down": False, "rotate_latent": True,
              "rotate_mla": False}
    practice = shrunken_practice(PRACTICES / "kimi_k3_w4a16_mxfp4.yaml", tmp_path / "rotated.yaml", max_samples=2,
                                 max_seq_len=32, extra_process=[rotate])
    with caplog.at_level(logging.INFO, logger="msmodelslim"):
        quant(QuantArgs(model_path=str(tiny_k3_checkpoint), save_path=str(tmp_path / "out"), device="cpu",
                        model_type="Kimi-K3", config_path=str(practice), trust_remote_code=True))
    log = caplog.text
    assert "quarot run first: those whose weights they change are quantized again" in log
    assert "keep the checkpoint's MXFP4 bytes" not in log  # every expert reads the rotated latent space
    reader = AscendV1Reader(tmp_path / "out")
    name = next(n for n in reader.quantized_linears() if ".experts.0.w1" in n)
    assert reader.quant_type(name) == "W4A16_MXFP4"
    stored, source = reader.get_stored(f"{name}.weight"), _source(tiny_k3_checkpoint, f"{name}.weight_packed")
    assert stored.shape == source.shape and stored.dtype == source.dtype  # else "not equal" could not fail
    assert not torch.equal(stored, source)
