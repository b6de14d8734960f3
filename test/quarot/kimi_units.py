"""Test-only driver: Kimi models split into runner units, processors applied unit by unit like the runner does.

The run's own `KimiLayout` of an in-memory model answers what processors ask an adapter (units, checkpoint names,
the rank-local test, QuaRot plan, smoothing subgraphs); `process_units` calls `process_unit` on a UnitContext per
unit, in the runner's order (vision, embed, layers.0..N-1, head, mtp.k), whose `run_samples` runs the whole model
on the calibration samples (upstream units already processed, so statistics see what the runner would feed).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from msmodelslim.core.dist import SINGLE, DistContext
from msmodelslim.model.base import Unit
from msmodelslim.model.kimi_k3.layout import KimiLayout
from msmodelslim.pipeline.answers import run_processor
from msmodelslim.processor.base import UnitContext

REPO = Path(__file__).resolve().parents[2]
STANDIN_DIR = REPO / "example" / "multimodal_vlm" / "Kimi-K3"
SHARED = REPO / ".." / "shared"


def unit_modules(layout: KimiLayout) -> list[tuple[Unit, nn.Module]]:
    """(unit, module) in the runner's order."""
    return [(unit, layout.unit_module(unit)) for unit in layout.units()]


def process_units(layout: KimiLayout, processors: list, run_model: Callable[[], None], dist: DistContext = SINGLE,
                  only: str | None = None) -> None:
    """What the layer-wise runner does for the processors: per unit in order, each processor's process_unit, with
    the run's own layout of the model standing in for the adapter (what processors ask of one, it answers)."""
    for unit, module in unit_modules(layout):
        if only is not None and unit.name != only:
            continue
        ctx = UnitContext(unit=unit, module=module, adapter=layout, dist=dist, run_samples=run_model)
        for proc in processors:
            run_processor(proc, ctx)


# --- models ------------------------------------------------------------------------------------------------------
def standin_package():
    if str(STANDIN_DIR) not in sys.path:
        sys.path.insert(0, str(STANDIN_DIR))
    import make_checkpoint

    return make_checkpoint.load_remote_package(make_checkpoint.HERE)


@contextlib.contextmanager
def standin_cpu_kernels(modeling) -> Iterator[None]:
    """Pure-torch kernels for the stand-in's FLA calls (the project's runtime patches)."""
    from msmodelslim.model.kimi_k3.runtime_patches import runtime_patches

    with runtime_patches(modeling):
        yield


@contextlib.contextmanager
def native_torch_kernels() -> Iterator[None]:
    """transformers picks fla's Triton kernels when fla is importable: the project's runtime patches swap in its
    pure-torch KDA / short-conv kernels (exact undo on exit)."""
    import transformers.models.kimi_linear.modeling_kimi_linear as native

    from msmodelslim.model.kimi_k3.runtime_patches import runtime_patches

    with runtime_patches(native):
        yield


@contextlib.contextmanager
def per_expert_modules(model: nn.Module, config, dist: DistContext = SINGLE) -> Iterator[None]:
    """Routed experts as a ModuleDict of w1/w2/w3 nn.Linear (the adapter's EP patch; with `dist` of several ranks
    only this rank's experts), weights copied from the model's own experts (native fused 3-D tensors or the
    stand-in's ModuleList)."""
    from msmodelslim.model.kimi_k3 import ep_patches

    originals = [(m, m.experts) for m in model.modules() if ep_patches.is_moe_block(m)]
    handle = ep_patches.apply_ep_patches(model, config, dist)
    with torch.no_grad():
        for block, old in originals:
            for key, expert in block.experts.items():
                e = int(key)
                if hasattr(old, "gate_up_proj"):
                    gate, up = old.gate_up_proj[e].chunk(2, dim=0)
                    expert.w1.weight.copy_(gate)
                    expert.w3.weight.copy_(up)
                    expert.w2.weight.copy_(old.down_proj[e])
                else:
                    expert.load_state_dict(old[e].state_dict())
    try:
        yield
    finally:
        handle.undo()


@torch.no_grad()
def randomize_norms(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial norm weights, biases and router correction biases, so fusing and smoothing are exercised."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and ("norm" in name or name.endswith("bias")) and "dt_bias" not in name:
            p.copy_((1.0 + 0.5 * torch.randn(p.shape, generator=gen)).to(p.dtype) if "norm" in name
                    else 0.1 * torch.randn(p.shape, generator=gen).to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.01 * torch.randn(b.shape, generator=gen))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())
