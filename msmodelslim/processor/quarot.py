"""QuaRot: fuse norm weights into their readers, then rotate each residual-like space by a random Hadamard Q.

Notation as in PyTorch: y = x W^T, activations are row vectors, Q is orthogonal. With a space rotated (h~ = h Q):
    readers   W <- W Q          (a linear/embedding whose last weight dim indexes the space)
    writers   W <- Q^T W, b <- Q^T b   (a linear whose output indexes the space)
    norms     W <- W diag(gamma), gamma <- 1   first, so RMSNorm(h Q) = RMSNorm(h) Q holds
    online    W_down <- W_down T^T at rest and x~ = x T^T at run time (T a Hadamard of the down input size)

The model knowledge is data: `adapter.quarot_plan(unit, module) -> QuaRotPlan` (live names, spaces, spans).
The processor keeps one Q per (space, size) for the whole run, built lazily from a seed derived from
(config.seed, space, size), so every unit and every expert-parallel rank uses the same Q.

Online rotation convention (shared with quant.modules.QuantLinear and the saver): the down-projection nn.Linear
gets a non-persistent buffer `online_rotation` = T [n, n] (fp32, orthogonal, one tensor shared by every linear of
that size) and its weight is stored as W T^T; the input must be rotated as `x~ = F.linear(x, online_rotation)`
(= x @ T^T) before activation quantization. Until a QuantLinear takes over, a forward pre-hook on the float
linear does that rotation (handle in `linear._online_rotation_hook`), so the float model stays exact.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from msmodelslim.core.placement import host_section
from msmodelslim.model.maps import HIDDEN, KV_LORA, LATENT, MLA_V, WHOLE, QuaRotPlan, Span
from msmodelslim.ops.hadamard import factor_order, orthogonal_hadamard, random_hadamard
from msmodelslim.processor.base import OutputExtras, Processor, ProcessorConfig, UnitContext, register_processor
from msmodelslim.quant.modules import append_output_linear

logger = logging.getLogger(__name__)

ONLINE_BUFFER = "online_rotation"
GLOBAL_ROTATION_FILE = "optional/quarot.safetensors"  # msModelSlim's name for the published residual Q
_ROW_CHUNK = 8192  # rows rotated at once (embedding tables and lm_head have ~1e5 rows)
ONLINE_CONVENTION = "x_rot = x @ online_rotation.T (F.linear(x, online_rotation)); weight stored as W @ online_rotation.T"


# ---------------------------------------------------------------------------------------------------------------
# The transformations, one equation each
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def fuse_norm(gamma: torch.Tensor, readers: list[torch.Tensor], dtype: torch.dtype = torch.float32,
              span: Span = WHOLE) -> None:
    """W <- W diag(gamma) for every reader (on the span's columns); gamma <- 1."""
    g = gamma.to(dtype)
    for w in readers:
        if span == WHOLE:
            w.copy_((w.to(dtype) * g.to(w.device)).to(w.dtype))
        else:
            idx = span.index(w.shape[-1], w.device).reshape(-1)
            w[:, idx] = (w[:, idx].to(dtype) * g.to(w.device).repeat(span.count)).to(w.dtype)
    gamma.fill_(1.0)


@torch.no_grad()
def rotate_in(w: torch.Tensor, q: torch.Tensor, span: Span = WHOLE) -> None:
    """W <- W Q on the span's channel blocks of the last dim."""
    whole = span == WHOLE
    idx = None if whole else span.index(w.shape[-1], w.device)  # [count, width]
    for rows in torch.split(torch.arange(w.shape[0], device=w.device), _ROW_CHUNK):  # bounded temporaries
        if whole:
            w[rows] = (w[rows].to(q.dtype) @ q).to(w.dtype)
        else:
            blocks = w[rows[:, None, None], idx].to(q.dtype)  # [rows, count, width]
            w[rows[:, None, None], idx] = (blocks @ q).to(w.dtype)


@torch.no_grad()
def rotate_out(w: torch.Tensor, b: torch.Tensor | None, q: torch.Tensor, span: Span = WHOLE) -> None:
    """W <- Q^T W and b <- Q^T b on the span's channel blocks of the first dim."""
    if span == WHOLE:
        w.copy_((q.T @ w.to(q.dtype)).to(w.dtype))
        if b is not None:
            b.copy_((b.to(q.dtype) @ q).to(b.dtype))
        return
    idx = span.index(w.shape[0], w.device)
    w[idx] = torch.einsum("ba,cbi->cai", q, w[idx].to(q.dtype)).to(w.dtype)
    if b is not None:
        b[idx] = (b[idx].to(q.dtype) @ q).to(b.dtype)


def _online_pre_hook(module: nn.Module, args: tuple) -> tuple:
    x = args[0]
    t = module.online_rotation
    return (F.linear(x.to(t.dtype), t).to(x.dtype), *args[1:])


@torch.no_grad()
def rotate_online(linear: nn.Linear, t: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """W <- W T^T at rest; x~ = x T^T at run time (buffer `online_rotation` = T plus a float pre-hook)."""
    if hasattr(linear, ONLINE_BUFFER):
        raise ValueError(f"{linear} already carries an {ONLINE_BUFFER!r} buffer (QuaRot applied twice?)")
    w = linear.weight
    w.copy_((w.to(dtype) @ t.to(w.device, dtype).T).to(w.dtype))
    linear.register_buffer(ONLINE_BUFFER, t, persistent=False)
    linear._online_rotation_hook = linear.register_forward_pre_hook(_online_pre_hook)


# ---------------------------------------------------------------------------------------------------------------
# Config and processor
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class QuaRotConfig(ProcessorConfig):
    seed: int = 0  # seeds the random signs of every Q (per space and size, identical on every rank)
    rotate_hidden: bool = True  # the residual stream (embeddings, every reader and writer of it)
    online_down: bool = False  # online Hadamard on the inputs of down projections (needs runtime support)
    rotate_latent: bool = True  # rot_latent: the latent-MoE space
    rotate_mla: bool = True  # MLA kv_lora_rank space (after fusing kv_a_layernorm) and per-head v_head_dim space
    block_size: int | None = None  # block of the block-diagonal fallback for sizes without a Hadamard matrix
    # float32 on the device, as msModelSlim rotates (Ascend's matrix kernels take no float64: docs/npu.md);
    # float64 only where the device has float64 matrix products (CPU, CUDA), e.g. to measure the rounding
    compute_dtype: Literal["float64", "float32"] = "float32"

    def validate(self) -> None:
        if self.seed < 0:
            raise ValueError(f"quarot.seed must be a non-negative integer, got {self.seed!r}")
        if self.block_size is not None and factor_order(self.block_size) is None:
            raise ValueError(f"quarot.block_size must be a Hadamard order K * 2^m, got {self.block_size!r}")


def space_seed(seed: int, space: str, size: int) -> int:
    """The random-sign seed of one (space, size): stable across processes, ranks and runs."""
    return (seed * 1_000_003 + zlib.crc32(f"{space}:{size}".encode())) % (2**62)


@register_processor("quarot", QuaRotConfig)
class QuaRotProcessor(Processor):
    config: QuaRotConfig

    def __init__(self, config: QuaRotConfig) -> None:
        super().__init__(config)
        self._q: dict[tuple[str, int], torch.Tensor] = {}  # (space, size) -> Q (host, float64)
        self._on_device: dict[tuple[str, int, str], torch.Tensor] = {}
        self._online: dict[int, torch.Tensor] = {}  # size -> T (fp32), shared by every linear of that size

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.config.compute_dtype == "float64" else torch.float32

    def enabled_spaces(self) -> set[str]:
        spaces = {HIDDEN} if self.config.rotate_hidden else set()
        if self.config.rotate_latent:
            spaces.add(LATENT)
        if self.config.rotate_mla:
            spaces |= {KV_LORA, MLA_V}
        return spaces

    def rotation(self, space: str, size: int, device: torch.device) -> torch.Tensor:
        """Q of one space and size (built once per run), on `device` in the compute dtype."""
        if (space, size) not in self._q:
            with host_section("QuaRot: Q built once per space in float64, rounded once to the compute dtype"):
                self._q[(space, size)] = random_hadamard(size, space_seed(self.config.seed, space, size),
                                                         self.config.block_size)
            logger.info("quarot: built Q for space %s, size %d", space, size)
        key = (space, size, str(device))
        if key not in self._on_device:
            with host_section("QuaRot: Q rounded on the host, then moved"):
                host = self._q[(space, size)].to(self.dtype)
            self._on_device[key] = host.to(device)
        return self._on_device[key]

    def online_rotation(self, size: int) -> torch.Tensor:
        """T for down inputs of `size`: the plain normalised Hadamard (no random signs, so runtimes can use a fast
        Walsh-Hadamard kernel), block-diagonal when `size` has no Hadamard matrix."""
        if size not in self._online:
            with host_section("QuaRot: the online Hadamard built once in float64"):
                self._online[size] = orthogonal_hadamard(size, self.config.block_size).float()
        return self._online[size]

    def process_unit(self, ctx: UnitContext) -> None:
        plan: QuaRotPlan = ctx.adapter.quarot_plan(ctx.unit, ctx.module)
        modules = dict(ctx.module.named_modules())

        def get(name: str) -> nn.Module:
            if name not in modules:
                raise KeyError(f"quarot plan of unit {ctx.unit.name}: no module named {name!r}")
            self.require_float_weight(ctx.unit.name, name, modules[name])
            return modules[name]

        spaces = self.enabled_spaces()
        for f in plan.fuse:
            if f.space in spaces:
                fuse_norm(get(f.norm).weight.data, [get(r).weight.data for r in f.readers], self.dtype, f.span)
        for r in plan.rotate:
            if r.space not in spaces:
                continue
            mod = get(r.name)
            w = mod.weight.data
            size = r.span.block_width(w.shape[-1] if r.side == "in" else w.shape[0])
            q = self.rotation(r.space, size, w.device)
            if r.side == "in":
                rotate_in(w, q, r.span)
            else:
                bias = getattr(mod, "bias", None)
                rotate_out(w, None if bias is None else bias.data, q, r.span)
        for a in plan.append:
            if a.space in spaces:
                owner = modules[a.module]
                param = next(owner.parameters())  # W = Q^T in the writer's dtype, as the engine stores it
                append_output_linear(owner, a.name,
                                     self.rotation(a.space, a.size, param.device).T.to(param.dtype).contiguous())
        if self.config.online_down:
            for name in plan.online:
                mod = get(name)
                size = mod.weight.shape[-1]
                rotate_online(mod, self.online_rotation(size).to(mod.weight.device), self.dtype)

    def resume_state(self) -> dict[str, Any]:
        """The rotations built so far (describe and extras list them); rebuilt from the seed on restore."""
        return {"q": sorted(self._q), "online": sorted(self._online)}

    def restore_state(self, state: dict[str, Any]) -> None:
        for space, size in state["q"]:
            self.rotation(space, size, torch.device("cpu"))
        for size in state["online"]:
            self.online_rotation(size)
        self._on_device.clear()

    def extras(self) -> OutputExtras | None:
        """The residual-stream Q as msModelSlim publishes it: `optional.quarot.rotation_map.global_rotation` names
        a file holding tensor `global_rotation` [hidden, hidden] (the stored model reads h_rot = h @ Q); vllm-ascend
        reads it to rotate what a drafter takes from the target (`patch/worker/patch_draft_quarot.py:42-70`)."""
        hidden = [size for space, size in self._q if space == HIDDEN]
        if not hidden:
            return None
        if len(hidden) > 1:
            raise RuntimeError(f"quarot: the residual space was rotated at several sizes {sorted(hidden)}")
        with host_section("QuaRot: the published Q"):
            q = self._q[(HIDDEN, hidden[0])].to(torch.float32)
        return OutputExtras(optional={"quarot": {"rotation_map": {"global_rotation": GLOBAL_ROTATION_FILE}}},
                      files={GLOBAL_ROTATION_FILE: {"global_rotation": q}})

    def describe(self) -> dict[str, Any]:
        """{"quarot": seed, spaces and online sizes}: the same on every rank (no per-rank counts)."""

        def kind(n: int) -> str:
            km = factor_order(n)
            return f"hadamard {km[0]}x2^{km[1]}" if km else "block-diagonal hadamard"

        return {"quarot": {
            "seed": self.config.seed,
            "rotate_hidden": self.config.rotate_hidden,
            "rotate_latent": self.config.rotate_latent,
            "rotate_mla": self.config.rotate_mla,
            "online_down": self.config.online_down,
            "spaces": {
                f"{space}:{size}": {"size": size, "seed": space_seed(self.config.seed, space, size), "matrix": kind(size),
                                    "form": "diag(+-1) H / sqrt(n)"}
                for space, size in sorted(self._q)
            },
            "online_rotations": {
                "buffer": ONLINE_BUFFER,
                "convention": ONLINE_CONVENTION,
                "sizes": {str(n): {"matrix": kind(n)} for n in sorted(self._online)},
            },
        }}
