"""Every run-time patch of a Kimi model's own classes, as one context: expert parallelism on its MoE class
(`ep_patches`), the pure-PyTorch kernels in place of FLA's Triton ones (`runtime_patches`), and the absorbed MLA
forward, patched when FA3 points are first injected (`fa3`). Leaving the context undoes all three, in reverse."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from msmodelslim.core.dist import DistContext
from msmodelslim.model.kimi_k3 import ep_patches, runtime_patches


@dataclass
class KimiPatches:
    ep: ep_patches.EPHandle
    kernels: runtime_patches.PatchHandle
    fa3: runtime_patches.PatchHandle  # filled by fa3.inject_fa3_placeholders on first use


@contextlib.contextmanager
def kimi_patches(model: nn.Module, dist: DistContext, torch_kernels_on_cuda: bool = False) -> Iterator[KimiPatches]:
    text_config = model.config.get_text_config()
    with contextlib.ExitStack() as stack:
        ep = stack.enter_context(ep_patches.apply_ep_patches(model, text_config, dist))
        kernels = stack.enter_context(runtime_patches.apply_runtime_patches(
            runtime_patches.find_fla_modules(model), device_type=dist.device.type, force=torch_kernels_on_cuda))
        fa3 = stack.enter_context(runtime_patches.PatchHandle())
        yield KimiPatches(ep, kernels, fa3)
