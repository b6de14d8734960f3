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


def make_tiny_checkpoint(out: Path, sets: list[str] | None = None) -> Path:
    """The tiny preset (seed 0) written to `out` by make_checkpoint.py's own function, in this process (a fresh
    interpreter would spend ~12 s importing what the tests have imported already); `sets`: its --set overrides."""
    make_checkpoint_module().make_checkpoint(out, preset="tiny", seed=0, sets=sets)
    return out


def load_dense_state_dict(model_dir: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint by logical name, MXFP4 experts decoded (source.checkpoint reader)."""
    from msmodelslim.source.checkpoint import open_checkpoint

    with open_checkpoint(model_dir) as reader:
        return {k: reader.get(k, "cpu", dtype if reader.is_mxfp4(k) else None) for k in reader.keys()}


def stored_tensor_info(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{stored key: (shape, safetensors dtype)} from the shard headers, without reading data."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    info = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / fname), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                info[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return info


def modeling_module(model: torch.nn.Module):
    return sys.modules[type(model).__module__]
