"""A toy decoder layer + adapter + source checkpoint directory for the AscendV1 saver/reader tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from msmodelslim.core.dist import SINGLE, DistContext
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.model.common.hf_checkpoint import HFCheckpoint
from msmodelslim.pipeline.answers import run_processor
from msmodelslim.processor.base import UnitContext
from msmodelslim.processor.linear_quant import LinearQuantConfig, LinearQuantProcessor

HIDDEN, INTER, N_EXPERTS = 32, 48, 2
_EXPERT_RE = re.compile(r"(?<!shared_)experts\.(\d+)\.")
UNIT = Unit("layers.0", "decoder", "model.layers.0.", 0)

W4A8 = {"act": {"dtype": "int8"}, "weight": {"dtype": "int4", "method": "ssz"}}
W8A8 = {"act": {"dtype": "int8"}, "weight": {"dtype": "int8", "method": "minmax"}}


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, INTER, bias=False)
        self.w3 = nn.Linear(HIDDEN, INTER, bias=False)
        self.w2 = nn.Linear(INTER, HIDDEN, bias=False)


class ToyLayer(nn.Module):
    def __init__(self, experts: list[int]) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=True)
        self.self_attn.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.self_attn.A_log = nn.Parameter(torch.randn(1, 1, 4, 1))  # fp32 in the source checkpoint
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(HIDDEN))
        self.block_sparse_moe = nn.Module()
        self.block_sparse_moe.gate = nn.Linear(HIDDEN, N_EXPERTS, bias=False)
        self.block_sparse_moe.experts = nn.ModuleDict({str(e): Expert() for e in experts})
        self.block_sparse_moe.shared_experts = nn.Module()
        self.block_sparse_moe.shared_experts.down_proj = nn.Linear(INTER, HIDDEN, bias=False)


def make_layer(experts: list[int] | None = None, seed: int = 0) -> ToyLayer:
    """Same weights for a given expert whatever subset is built (each piece seeded on its own)."""
    experts = list(range(N_EXPERTS)) if experts is None else experts
    torch.manual_seed(seed)
    layer = ToyLayer([])
    for e in experts:
        torch.manual_seed(seed + 100 + e)
        layer.block_sparse_moe.experts[str(e)] = Expert()
    return _finish(layer)


def _finish(layer: ToyLayer) -> ToyLayer:
    for name, p in layer.named_parameters():
        if not name.endswith("A_log"):
            p.data = p.data.to(torch.bfloat16)
    rot, _ = torch.linalg.qr(torch.randn(INTER, INTER, generator=torch.Generator().manual_seed(7)))
    layer.block_sparse_moe.shared_experts.down_proj.register_buffer("online_rotation", rot)
    return layer.requires_grad_(False)


class ToyAdapter(ModelAdapter):
    def __init__(self, model_path: Path, module_experts: list[int] | None = None) -> None:
        super().__init__(model_path)

    def units(self):
        return [UNIT]

    def load_unit(self, unit, device, reader=None):
        raise NotImplementedError

    def prepare_samples(self, records):
        return []

    def forward_unit(self, unit, module, state):
        return state

    def checkpoint_name(self, unit, live_name):
        return unit.prefix + live_name

    def is_rank_local(self, name):
        return _EXPERT_RE.search(name + ".") is not None

    def tensor_names(self, unit, live_name, source):
        return [self.checkpoint_name(unit, live_name)]

    def checkpoint_state(self, unit, module):  # the shared save walk, this toy being its own layout
        return HFCheckpoint.saved_state(self, unit, module, self.checkpoint_name)


def write_source_dir(path: Path) -> Path:
    """A model directory: config with quantization_config, tokenizer files, remote code, a BF16/FP32 checkpoint."""
    path.mkdir(parents=True, exist_ok=True)
    layer = make_layer()
    tensors = {UNIT.prefix + n: t.clone() for n, t in layer.state_dict().items() if not n.endswith("online_rotation")}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensors}}))
    config = {"model_type": "toy", "quantization_config": {"quant_method": "compressed-tensors"},
              "text_config": {"hidden_size": HIDDEN, "quantization_config": {"x": 1}}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")
    (path / "tokenizer_config.json").write_text("{}")
    (path / "modeling_toy.py").write_text("# remote code\n")
    (path / "chat_template.jinja").write_text("{{ x }}\n")
    (path / "README.md").write_text("not copied\n")
    return path


def quantize(layer: ToyLayer, adapter: ModelAdapter, dist: DistContext = SINGLE) -> ToyLayer:
    """The w4a8 practice: experts W4A8 (shared excluded), then the rest W8A8 (router excluded)."""
    ctx = UnitContext(UNIT, layer, adapter, dist, run_samples=lambda: None)
    run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig=W4A8, include=["*experts.*"], exclude=["*shared_experts*"])), ctx)
    run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig=W8A8, include=["*"], exclude=["*gate"])), ctx)
    return layer
