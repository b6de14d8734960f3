"""Shared helpers for the stand-in tests: generate a checkpoint, load it through trust_remote_code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
STANDIN_DIR = REPO / "example" / "multimodal_vlm" / "Kimi-K3"
SHARED = REPO / ".." / "shared"


def make_checkpoint_module():
    if str(STANDIN_DIR) not in sys.path:
        sys.path.insert(0, str(STANDIN_DIR))
    import make_checkpoint

    return make_checkpoint


def load_dense_state_dict(model_dir: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """All tensors of a sharded checkpoint, MXFP4 pairs decoded to `<name>.weight`."""
    from msmodelslim.formats.mxfp4 import decode_mxfp4

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    raw: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / fname), "pt") as f:
            for k in f.keys():
                raw[k] = f.get_tensor(k)
    out = {}
    for k, t in raw.items():
        if k.endswith(".weight_scale"):
            continue
        if k.endswith(".weight_packed"):
            base = k[: -len(".weight_packed")]
            out[base + ".weight"] = decode_mxfp4(t, raw[base + ".weight_scale"], dtype, name=base)
        else:
            out[k] = t
    return out


def modeling_module(model: torch.nn.Module):
    return sys.modules[type(model).__module__]
