"""The model adapter as two protocols by reader (model/base.py), and expert parallelism any MoE family can use
(model/common/expert_parallel.py) without Kimi's code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from msmodelslim.model.base import ModelAdapter, ModelRuntime, ModelStructure

PACKAGE = Path(__file__).resolve().parents[2] / "msmodelslim"
MAX_METHODS = 15


def _members(cls: type) -> set[str]:
    """The public names a class itself defines (methods, properties, class attributes)."""
    return {name for name in vars(cls) if not name.startswith("_")}


def test_each_protocol_is_small_and_the_adapter_adds_nothing_to_them():
    """Each protocol has at most 15 public members, they do not overlap, and ModelAdapter is exactly their union
    (a third, unnamed surface would grow back the hub)."""
    structure, runtime = _members(ModelStructure), _members(ModelRuntime)
    assert len(structure) <= MAX_METHODS, sorted(structure)
    assert len(runtime) <= MAX_METHODS, sorted(runtime)
    assert not structure & runtime
    assert _members(ModelAdapter) == set()


def test_the_serving_package_reads_only_the_model_structure():
    """serving/ (the target's rules, the plan, the AscendV1 format) calls no runtime method on a model: every
    `model.X` / `adapter.X` it names is a ModelStructure member (by the source's syntax tree)."""
    allowed = _members(ModelStructure)
    read = set()
    for file in (PACKAGE / "serving").glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in ("model", "adapter"):
                read.add(node.attr)
    assert read and read <= allowed, sorted(read - allowed)


class _GatedExpert(nn.Module):
    def __init__(self, width: int, inter: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(width, inter, bias=False), nn.Linear(width, inter, bias=False)
        self.w2 = nn.Linear(inter, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.gelu(self.w1(x)) * self.w3(x))


class _OtherFamilyMoE(nn.Module):
    """A MoE block of no Kimi shape: softmax-then-top-k router called `router`, experts in a ModuleList."""

    def __init__(self, width: int = 16, experts: int = 6, top_k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(_GatedExpert(width, 12) for _ in range(experts))
        self.top_k = top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, idx = torch.softmax(self.router(x).float(), dim=-1).topk(self.top_k, dim=-1)
        return idx, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slots = torch.nonzero(idx == e, as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(x[rows]) * weights[rows, slots, None].to(x.dtype))
        return out


def _ep_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from msmodelslim.model.common.expert_parallel import ep_routed

    idx, weights = block.route(x)
    return ep_routed(block, x, idx, weights)


def test_a_second_moe_family_runs_expert_parallel_with_the_common_module_alone():
    """A MoE block unlike Kimi's, set up for EP with model/common/expert_parallel.py only (one rank): its output
    against its own forward (float32, tolerance 1e-6: the same products, another summation order), and
    `all_experts_compute` hands each expert every token while the output stays the router's."""
    from msmodelslim.core.dist import SINGLE
    from msmodelslim.model.common.expert_parallel import EP_ATTR, BlockEP, all_experts_compute

    torch.manual_seed(0)
    block = _OtherFamilyMoE()
    x = torch.randn(20, 16)
    reference = block(x)
    block.experts = nn.ModuleDict({str(e): m for e, m in enumerate(block.experts)})
    setattr(block, EP_ATTR, BlockEP(dist=SINGLE, router=block.router, expert_width=16, top_k=block.top_k))
    with torch.no_grad():
        torch.testing.assert_close(_ep_forward(block, x), reference, rtol=1e-6, atol=1e-6)
        seen = []
        handles = [m.w1.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
                   for m in block.experts.values()]
        with all_experts_compute(block):
            torch.testing.assert_close(_ep_forward(block, x), reference, rtol=1e-6, atol=1e-6)
        for handle in handles:
            handle.remove()
    assert seen == [20] * 6


def test_the_common_model_layer_imports_nothing_of_kimi():
    """A second family builds on model/base.py, model/facts.py and model/common/ (the HF adapter, the checkpoint
    layer, expert parallelism): importing them in a fresh interpreter loads no module of model/kimi_k3/."""
    code = ("import sys\n"
            "import msmodelslim.model.base, msmodelslim.model.facts\n"
            "import msmodelslim.model.common.hf_adapter, msmodelslim.model.common.expert_parallel\n"
            "print([m for m in sys.modules if m.startswith('msmodelslim.model.kimi_k3')])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]"
