"""Generated compressed-tensors MXFP4 checkpoints for the reader tests (written with our encoder, which
test_mxfp4.py proves bit-exact with compressed-tensors' compressor)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from msmodelslim.source.mxfp4 import encode_mxfp4

MXFP4_GROUP = {
    "targets": ["re:.*experts\\.\\d+\\.w[123]$"],
    "format": "mxfp4-pack-quantized",
    "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                "scale_dtype": "torch.uint8"},
    "input_activations": None,
}


def quantization_config(version: str = "0.20.0", **overrides) -> dict:
    block = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
             "quantization_status": "compressed", "version": version,
             "config_groups": {"group_0": dict(MXFP4_GROUP)}, "ignore": ["lm_head"]}
    block.update(overrides)
    return block


def dense_and_packed(seed: int = 0, layers: int = 2, experts: int = 3) -> tuple[dict, dict]:
    """(dense tensors by name, MXFP4 weights by module name as bf16 originals)."""
    g = torch.Generator().manual_seed(seed)
    dense = {"model.embed_tokens.weight": torch.randn(50, 64, generator=g).bfloat16(),
             "lm_head.weight": torch.randn(50, 64, generator=g).bfloat16(),
             "model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    quant = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        dense[p + "input_layernorm.weight"] = torch.randn(64, generator=g).bfloat16()
        dense[p + "self_attn.q_proj.weight"] = torch.randn(64, 64, generator=g).bfloat16()
        for e in range(experts):
            for w, shape in (("w1", (96, 64)), ("w2", (64, 96)), ("w3", (96, 64))):
                quant[f"{p}block_sparse_moe.experts.{e}.{w}"] = (torch.randn(*shape, generator=g) * 0.05).bfloat16()
    return dense, quant


def write_checkpoint(out: Path, *, shards: int = 3, version: str = "0.20.0", exponent_shift: int = 0,
                     config_extra: dict | None = None, nest_in_text_config: bool = False, seed: int = 0,
                     single_file: bool = False, tamper=None) -> tuple[dict, dict]:
    """Write a checkpoint; returns (dense tensors, {module: (packed, scale)} as written before any shift)."""
    out.mkdir(parents=True, exist_ok=True)
    dense, quant = dense_and_packed(seed)
    stored = dict(dense)
    packed_by_module = {}
    for module, w in quant.items():
        packed, scale = encode_mxfp4(w, name=module)
        packed_by_module[module] = (packed, scale)
        stored[module + ".weight_packed"] = packed
        stored[module + ".weight_scale"] = (scale.int() - exponent_shift).to(torch.uint8)
    if tamper is not None:  # edit the stored tensors (error tests)
        tamper(stored)
    names = sorted(stored)
    if single_file:
        save_file({k: stored[k].contiguous() for k in names}, str(out / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: stored[k].contiguous() for k in names[s::shards]}
            save_file(part, str(out / fname))
            weight_map.update({k: fname for k in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    qc = quantization_config(version)
    qc.update(config_extra or {})
    config = {"model_type": "kimi_linear", "hidden_size": 64}
    if nest_in_text_config:
        config = {"model_type": "kimi_k3", "text_config": {**config, "quantization_config": qc}}
    else:
        config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    return dense, packed_by_module
