"""linear_quant: replace matching nn.Linear modules of a unit by QuantLinear (dynamic per-token activations).

YAML:
    - type: linear_quant
      qconfig: {act: {scope: per_token, dtype: int8, symmetric: True, method: minmax},
                weight: {scope: per_channel, dtype: int4, symmetric: True, method: ssz}}
      include: ["*experts.*"]
      exclude: ["*shared_experts*"]

Matching: `include` / `exclude` are fnmatch globs on the linear's CHECKPOINT name without ".weight"
(`adapter.checkpoint_name(unit, live_name)`, e.g. `language_model.model.layers.3.block_sparse_moe.experts.7.w1`).
A linear is quantized when some include glob matches and no exclude glob does.

Composition: several linear_quant entries run in YAML order; a linear already replaced by an earlier entry is a
QuantLinear, not an nn.Linear, so later entries skip it (the first matching entry wins).

Non-decoder units (kind "vision", "embed", "head") are left float unless an include glob that does NOT start with
a wildcard matches: such a glob spells out the checkpoint prefix (`vision_tower.*`, `language_model.lm_head`), so
catch-alls like "*" or "*self_attn*" never quantize the vision tower or the lm_head by accident.

Schemes (`qconfig` dtypes -> the AscendV1 type, `quant/modules.py`):
    int8 / int8 per_token -> W8A8_DYNAMIC     int4 / int8 -> W4A8_DYNAMIC     int4 / int4 -> W4A4_DYNAMIC   (A2/A3)
    mxfp4 / null -> W4A16_MXFP4   mxfp4 / mxfp8 -> W4A8_MXFP   mxfp8 / mxfp8 -> W8A8_MXFP8   mxfp4 / mxfp4 ->
    W4A4_MXFP4 (Ascend 950; weight and act scope per_block: blocks of 32 with E8M0 exponents, quant/mx.py)
Integer weights are per channel, or per group with `scope: per_group` and `ext: {group_size: N}` (W4A8_DYNAMIC only:
vllm-ascend's MoE kernel reads one group size for the model, from the description).

Weight methods (`qconfig.weight.method`; `quant/modules.py`): `minmax`, `ssz` (least-squares refined minmax),
`grid` (clipping grid + refinement; for MX the exponent search of quant/mx.py), `gptq` (GPTQ on the input Hessian
the runner records, with the diag(H)-weighted grid scale, or for MX the diag(H)-weighted exponent search; `ext:
{percdamp: 0.01, block_size: 128, act_order: true}` as msModelSlim names them). Each linear's quantization is one
job for the runner: replicated linears are spread over data-parallel ranks and broadcast, routed experts are
quantized by the rank that holds them.

The checkpoint's own MXFP4 (`W4A16_MXFP4`, `W4A8_MXFP`, `W4A4_MXFP4`): a linear the source stores as MXFP4 whose
weight no earlier processor changed (no rotation, no smoothing: its weight still equals the decoded bytes) keeps the
source's bytes, exactly, with no decode and re-encode; a changed one is quantized again from its new weight, and
the log says how many of each a unit has.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from msmodelslim.core.config import StrictConfig
from msmodelslim.core.device import synchronize
from msmodelslim.core.placement import to_host
from msmodelslim.core.requests import Job, Jobs, Observe
from msmodelslim.errors import UserError, shown
from msmodelslim.processor.base import Changes, Processor, ProcessorConfig, UnitContext, register_processor
from msmodelslim.processor.globs import matching, selected
from msmodelslim.quant.gptq import GPTQ_BATCH_BYTES, GPTQ_BATCH_BYTES_CPU, GPTQOptions
from msmodelslim.quant.granularity import int_dtype
from msmodelslim.quant.modules import QuantLinear, QuantScheme, dequantize_weight, quantize_weight, scheme_for
from msmodelslim.quant.mx import MX_FORMATS, decode_weight, mx_format
from msmodelslim.quant.sensitivity import hessian_error, weight_error

logger = logging.getLogger(__name__)

DECODER_KINDS = ("decoder", "mtp")
_WILDCARDS = ("*", "?", "[")


def _dtype(name: str) -> Any:
    return mx_format(name) if name in MX_FORMATS else int_dtype(name)


@dataclass
class ActQConfig(StrictConfig):
    scope: Literal["per_token", "per_block"] = "per_token"  # dynamic: the serving kernel quantizes each token
    dtype: Literal["int8", "int4", "mxfp8", "mxfp4"] = "int8"
    symmetric: Literal[True] = True
    method: Literal["minmax"] = "minmax"

    def validate(self) -> None:
        mx = self.dtype in MX_FORMATS
        if (self.scope == "per_block") != mx:
            raise ValueError(f"act: scope {self.scope} does not go with dtype {self.dtype} (MX dtypes are per_block, "
                             f"integer ones per_token)")


@dataclass
class WeightExt(StrictConfig):
    """`weight.ext`, as msModelSlim spells it: GPTQ's options (method gptq only) and the per-group group size."""

    percdamp: float | None = None  # gptq: the Hessian's damping, a fraction of its mean diagonal (0.01)
    block_size: int | None = None  # gptq: columns per lazy block update (128)
    act_order: bool | None = None  # gptq: columns in decreasing order of diag(H) (true)
    group_size: int | None = None  # per_group: inputs per weight scale, a multiple of 32

    def validate(self) -> None:
        if self.percdamp is not None and not 0 < self.percdamp < 1:
            raise ValueError(f"percdamp: must be in (0, 1), got {self.percdamp!r}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size: must be a positive integer, got {self.block_size!r}")
        if self.group_size is not None and (self.group_size <= 0 or self.group_size % 32):
            raise ValueError(f"group_size: must be a positive multiple of 32, got {self.group_size!r}")

    @property
    def gptq_keys(self) -> list[str]:
        return [k for k in ("percdamp", "block_size", "act_order") if getattr(self, k) is not None]

    @property
    def gptq(self) -> GPTQOptions:
        given = {"damp": self.percdamp, "block_size": self.block_size, "act_order": self.act_order}
        return GPTQOptions(**{k: v for k, v in given.items() if v is not None})


@dataclass
class WeightQConfig(StrictConfig):
    scope: Literal["per_channel", "per_group", "per_block"] = "per_channel"
    dtype: Literal["int8", "int4", "mxfp8", "mxfp4"] = "int8"
    symmetric: Literal[True] = True
    method: Literal["ssz", "minmax", "grid", "gptq"] = "ssz"
    ext: WeightExt = field(default_factory=WeightExt)

    def validate(self) -> None:
        mx = self.dtype in MX_FORMATS
        if (self.scope == "per_block") != mx:
            raise ValueError(f"weight: scope {self.scope} does not go with dtype {self.dtype} (MX dtypes are "
                             f"per_block, integer ones per_channel or per_group)")
        if mx and self.method not in ("minmax", "grid", "gptq"):
            raise ValueError(f"weight: MX weights take method minmax, grid or gptq, not {self.method!r}")
        if (self.scope == "per_group") != (self.ext.group_size is not None):
            raise ValueError("weight: scope per_group needs ext.group_size, and ext.group_size needs scope per_group")
        if self.ext.gptq_keys and self.method != "gptq":
            raise ValueError(f"ext.{self.ext.gptq_keys[0]} is only read by method gptq, not {self.method!r}")

    @property
    def gptq(self) -> GPTQOptions:
        return self.ext.gptq

    @property
    def group_size(self) -> int:
        """Inputs per integer weight scale (0: per channel; MX blocks are not groups here)."""
        return self.ext.group_size or 0


@dataclass
class QConfig(StrictConfig):
    act: ActQConfig | None = field(default_factory=ActQConfig)  # null: weight-only (W4A16_MXFP4)
    weight: WeightQConfig = field(default_factory=WeightQConfig)


@dataclass
class LinearQuantConfig(ProcessorConfig):
    qconfig: QConfig = field(default_factory=QConfig)
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)
    # GPTQ: take each Hessian from the unit with the earlier entries' linears quantized (Kimi-K3's latent
    # up-projection after its experts: a pass of its own); false: from before them, in the unit's first pass
    # (docs/dev/architecture.md: what it costs)
    true_sequential: bool = False

    def validate(self) -> None:
        try:
            scheme = self.scheme
        except ValueError as exc:
            raise ValueError(f"qconfig: {exc}") from None
        if self.qconfig.weight.group_size and scheme.name != "W4A8_DYNAMIC":
            raise ValueError(f"qconfig: per-group weights are served for W4A8_DYNAMIC only, not {scheme.name}")

    @property
    def scheme(self) -> QuantScheme:
        act = self.qconfig.act
        return scheme_for(_dtype(self.qconfig.weight.dtype), None if act is None else _dtype(act.dtype))


def _check_finite_hessians(ctx: UnitContext, hessians: dict[str, torch.Tensor]) -> None:
    """A backstop behind the runner's check of every pass's outputs: one reduction per distinct Hessian, one read."""
    distinct = {id(h): (name, h) for name, h in hessians.items() if h is not None}
    if not distinct:
        return
    finite = torch.stack([torch.isfinite(h).all() for _, h in distinct.values()])
    if not bool(finite.all()):
        name = next(n for (n, _), ok in zip(distinct.values(), finite.tolist(), strict=True) if not ok)
        raise UserError(f"unit {ctx.unit.name}: the calibration inputs of {ctx.adapter.checkpoint_name(ctx.unit, name)} "
                        "hold NaN/Inf (its Hessian is not finite); likely cause: a weight or config value out of range "
                        "for the model's dtype")


def _parked(hessians: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The Hessians in host memory until their GPTQ batch takes them back to the device (`_quantize`): a rank's
    112 routed experts' are ~10 GB at Kimi-K3's widths, held beside the weights, the quantized results and GPTQ's
    temporaries while the jobs run, which set the layer's device peak (34.6 GiB on the H200 with GPTQ, 18.2 without;
    BENCHMARKS.md, issue 31). The copies are exact; on an accelerator they cost the Hessians' bytes to the host and back
    once (the GPTQ batch, which also sums the report's weight error): 0.2 s each way for a layer's 10 GB on the H100,
    once the run's first layer has paid for pinning its host memory (6 s; torch keeps pinned memory for reuse,
    bench/quant_jobs.py). Readers of one input keep sharing one object."""
    if device.type == "cpu":
        return hessians
    copies: dict[int, torch.Tensor] = {}
    parked = {name: copies.setdefault(id(h), to_host(h)) if h is not None else None for name, h in hessians.items()}
    synchronize(device)  # the asynchronous copies are complete before the device memory is reused
    return parked


def select(name: str, unit_kind: str, include: list[str], exclude: list[str]) -> bool:
    """The matching rule of linear_quant for one checkpoint name (see the module docstring)."""
    if unit_kind not in DECODER_KINDS:
        include = [g for g in matching(name, include) if not g.startswith(_WILDCARDS)]
    return selected(name, include, exclude)


@register_processor("linear_quant", LinearQuantConfig)
class LinearQuantProcessor(Processor):
    config: LinearQuantConfig
    quantizes_linears = True

    def preflight(self, adapter: Any, schemes: dict[str, str]) -> None:
        """Count the linears the globs select on the model's skeleton; selecting none is an error (the practice
        would run for hours and write a FLOAT model)."""
        cfg = self.config
        linears = adapter.linears()
        names = [lin.name for lin in linears]
        matched = sum(select(lin.name, lin.unit.kind, cfg.include, cfg.exclude) for lin in linears)
        if not matched:
            example = names[len(names) // 2] if names else "(none)"
            raise UserError(f"linear_quant ({cfg.scheme.name}): include {shown(cfg.include, 200)} exclude "
                            f"{shown(cfg.exclude, 200)} selects none of the model's {len(names)} linears "
                            f"(for example {example})")
        logger.info("linear_quant %s: include %s exclude %s selects %d of %d linears", cfg.scheme.name,
                    shown(cfg.include, 200), shown(cfg.exclude, 200), matched, len(names))

    def _work(self, ctx: UnitContext) -> list[tuple[LinearQuantConfig, dict[str, nn.Linear]]]:
        """(config, its linears of the unit as it is now: live name -> module) of each plan entry this processor runs,
        in plan order (the run's W8A8 fallback entries, run by the practice's first linear_quant, come first). Without
        a plan (a processor run on its own) its own entry, selected by its globs."""
        plan = ctx.plan
        names = {live_name: ctx.adapter.checkpoint_name(ctx.unit, live_name)
                 for live_name, mod in ctx.module.named_modules()
                 if live_name and isinstance(mod, nn.Linear)}  # the unit root itself cannot be swapped in place
        if plan is None:
            cfg = self.config
            return [(cfg, {live: ctx.module.get_submodule(live) for live, name in names.items()
                           if select(name, ctx.unit.kind, cfg.include, cfg.exclude)})]
        entries = plan.entries_run_by(self.config)
        work = {index: (plan.entries[index].config, {}) for index in entries}
        for live, name in names.items():
            planned = plan.linears.get(name)
            if planned is not None and planned.entry in work:
                work[planned.entry][1][live] = ctx.module.get_submodule(live)
        return [work[index] for index in entries]

    def hessians(self, ctx: UnitContext) -> tuple[str, ...]:
        """GPTQ's Hessians: every linear of this processor's GPTQ entries (one that turns out to keep its checkpoint
        bytes asks for none, and the runner frees one gathered for it)."""
        return tuple(name for cfg, linears in self._work(ctx) if cfg.qconfig.weight.method == "gptq"
                     for name in linears)

    def changes(self, ctx: UnitContext) -> Changes:
        return Changes(weights=frozenset(name for _, linears in self._work(ctx) for name in linears))

    @property
    def true_sequential(self) -> bool:
        return self.config.true_sequential

    def process_unit(self, ctx: UnitContext) -> Any:
        work = [(cfg, linears) for cfg, linears in self._work(ctx) if linears]
        if not work:
            return
        native = [self._native_mxfp4(ctx, cfg, linears) for cfg, linears in work]  # (taken out of `linears`)
        hessians: dict[str, torch.Tensor] = {}
        tokens: dict[str, int] = {}
        if any(cfg.qconfig.weight.method == "gptq" for cfg, _ in work):  # every rank asks, also one whose linears
            # all kept their bytes; one request for every entry it runs: one pass gathers them all
            stats = yield Observe(hessian=tuple(n for cfg, linears in work if cfg.qconfig.weight.method == "gptq"
                                                for n in linears))
            hessians, tokens = stats.hessian, stats.tokens
            _check_finite_hessians(ctx, hessians)
            _log_expert_coverage(ctx, {n: m for _, linears in work for n, m in linears.items()}, tokens)
            hessians = _parked(hessians, ctx.device)
            del stats  # with a parked copy, the device Hessians go now, not after the jobs
        results = yield Jobs([job for cfg, linears in work for job in self._jobs(ctx, cfg, linears, hessians, tokens)])
        hessians.clear()  # the jobs were their last readers (a layer's Hessians can be tens of GB at full scale)
        merged = {k: v for outputs in results.values() for k, v in outputs.items()}
        for (cfg, linears), kept in zip(work, native, strict=True):
            self._replace(ctx, cfg, {**{n: (merged[f"{n}.q"], merged[f"{n}.scale"]) for n in linears}, **kept},
                          set(kept), merged, tokens)

    def _replace(self, ctx: UnitContext, cfg: LinearQuantConfig, quantized: dict[str, tuple], native: set[str],
                 merged: dict[str, torch.Tensor], tokens: dict[str, int]) -> None:
        """Each linear of `quantized` (live name -> integers and scales; `native`: those that keep the checkpoint's
        MXFP4 bytes) replaced by its QuantLinear of `cfg`'s scheme."""
        scheme, weight_cfg = cfg.scheme, cfg.qconfig.weight
        for live_name, (q, scale) in quantized.items():
            parent_name, _, child = live_name.rpartition(".")
            parent = ctx.module.get_submodule(parent_name) if parent_name else ctx.module
            linear = parent.get_submodule(child)
            # the group size said, not read off the scales: a linear as wide as one group is per group too
            quant = QuantLinear.from_linear(linear, scheme, quantized=(q, scale),
                                            group_size=None if live_name in native else weight_cfg.group_size)
            # the report's weight half (quant/sensitivity.py): exact with the Hessian GPTQ had, summed in its job
            method = "checkpoint" if live_name in native else weight_cfg.method  # kept MXFP4 bytes: no rounding
            quant.weight_error = weight_error(linear.weight, quant.dequantized_weight(), method,
                                              merged.get(f"{live_name}.hessian_error"), tokens.get(live_name))
            setattr(parent, child, quant)
            if ctx.keep_replaced is not None:
                ctx.keep_replaced(live_name, linear)
        kept = f", {len(native)} keep the checkpoint's MXFP4 bytes" if native else ""
        logger.info("linear_quant %s (%s): %s quantized %d linears%s", scheme.name, weight_cfg.method, ctx.unit.name,
                    len(quantized), kept)

    def _native_mxfp4(self, ctx: UnitContext, cfg: LinearQuantConfig, linears: dict[str, nn.Linear]
                      ) -> dict[str, tuple]:
        """Linears whose source bytes are the answer (module docstring), taken out of `linears`: live name ->
        (packed codes, E8M0 scales) as the checkpoint stores them. The bytes are read again here rather than kept
        from the load: a quarter of the experts' bf16 memory for the whole unit, against one more read of them."""
        fmt = cfg.scheme.weight
        if not cfg.scheme.is_mx or fmt.bits != 4:
            return {}
        native = {}
        for live_name, linear in list(linears.items()):
            source = ctx.adapter.source_mxfp4(ctx.unit, live_name)
            if source is None:
                continue
            w = linear.weight.detach()
            packed, scale = (t.to(w.device) for t in source)
            if torch.equal(decode_weight(packed, scale, fmt, w.dtype), w):
                native[live_name] = (packed, scale)
                del linears[live_name]
        return native

    def _jobs(self, ctx: UnitContext, cfg: LinearQuantConfig, linears: dict[str, nn.Linear],
              hessians: dict[str, torch.Tensor], tokens: dict[str, int]) -> list[Job]:
        """One job per linear, except for GPTQ: the linears that read one input (one Hessian object: an attention's
        q/k/v/g/b/f_a, an expert's w1 and w3) are one matrix, their rows stacked, with one inverse factor and one
        column loop; matrices of one shape (a rank's experts) go in batches of about GPTQ_BATCH_BYTES of Hessians
        per linear (GPTQ_BATCH_BYTES_CPU on the CPU), one column loop per batch. Replicated jobs are spread over the
        ranks."""
        gptq = cfg.qconfig.weight.method == "gptq"
        readers: dict[tuple, list[str]] = {}  # GPTQ: per input, its linears; else one linear each
        for name in linears:
            local, h = ctx.adapter.is_rank_local(name), hessians.get(name)
            readers.setdefault((id(h), local) if gptq and h is not None else (name, local), []).append(name)
        groups: dict[tuple, list[list[list[str]]]] = {}
        for (_, local), members in readers.items():
            first = linears[members[0]].weight
            in_f = first.shape[1]
            budget = GPTQ_BATCH_BYTES_CPU if first.device.type == "cpu" else GPTQ_BATCH_BYTES
            per_batch = max(1, budget // (len(members) * in_f * in_f * 4)) if gptq else 1
            shape = (sum(linears[n].weight.shape[0] for n in members), in_f)
            batches = groups.setdefault((shape, local), [[]])
            if len(batches[-1]) == per_batch:
                batches.append([])
            batches[-1].append(members)
        jobs = []
        for ((rows, in_f), local), batches in groups.items():
            for batch in batches:
                outputs = {}
                for n in (n for members in batch for n in members):
                    outputs[f"{n}.q"], outputs[f"{n}.scale"] = _output_specs(cfg, *linears[n].weight.shape)
                    if gptq:  # the report's exact weight error, summed where the Hessian is (`_quantize`)
                        outputs[f"{n}.hessian_error"] = ((2,), torch.float32)
                work = partial(_quantize, cfg, [[linears[n].weight.detach() for n in members] for members in batch],
                               batch, [hessians.get(members[0]) for members in batch],
                               [tokens.get(members[0]) for members in batch])
                cost = len(batch) * rows * in_f * (in_f if gptq else 1)
                jobs.append(Job(batch[0][0], cost, work, outputs, local=local))
        return jobs

def _output_specs(cfg: LinearQuantConfig, out_f: int, in_f: int) -> tuple[tuple, tuple]:
    """(shape, dtype) of a linear's quantized weight and of its scales, as QuantLinear holds them."""
    scheme, group = cfg.scheme, cfg.qconfig.weight.group_size
    if scheme.is_mx:
        packing = 2 if scheme.weight.bits == 4 else 1
        return ((out_f, in_f // packing), torch.uint8), ((out_f, in_f // 32), torch.uint8)
    return ((out_f, in_f), torch.int8), ((out_f, in_f // group if group else 1), torch.float32)


def _quantize(cfg: LinearQuantConfig, weights: list[list[torch.Tensor]], names: list[list[str]],
              hessians: list[torch.Tensor | None], tokens: list[int | None]) -> dict[str, torch.Tensor]:
    """Quantize a batch of matrices of one shape, each the rows of the linears `names[k]` stacked (readers of
    one input, `hessians[k]`); returns each linear's integers and scales (and, with a Hessian, its
    `hessian_error` sums)."""
    scheme, weight_cfg = cfg.scheme, cfg.qconfig.weight
    mats = [torch.cat(ws) if len(ws) > 1 else ws[0] for ws in weights]
    single = len(mats) == 1
    w = mats[0] if single else torch.stack(mats)  # a batch: quantized by one batched GPTQ
    h, n = None, None
    if hessians[0] is not None:  # from the host, where they waited (`_parked`)
        h = hessians[0].to(w.device) if single else torch.stack([m.to(w.device) for m in hessians])
        n = tokens[0] if single else torch.tensor(tokens)
    q, scale = quantize_weight(w, scheme.weight, weight_cfg.method, scale_dtype=scheme.engine_scale_dtype,
                               hessian=h, tokens=n, gptq=weight_cfg.gptq, group_size=weight_cfg.group_size)
    if single:
        q, scale, h = q[None], scale[None], None if h is None else h[None]
    out = {}
    for k, members in enumerate(names):
        start = 0
        for name, weight in zip(members, weights[k], strict=True):
            end = start + weight.shape[0]
            out[f"{name}.q"], out[f"{name}.scale"] = q[k, start:end], scale[k, start:end]
            if h is not None:  # no host read: the sums stay on the device until the report's record reads them
                w_hat = dequantize_weight(scheme, out[f"{name}.q"], out[f"{name}.scale"])
                out[f"{name}.hessian_error"] = hessian_error(weight, w_hat, h[k])
            start = end
    return out


def _log_expert_coverage(ctx: UnitContext, linears: dict[str, nn.Linear], tokens: dict[str, int]) -> None:
    """The calibration tokens behind this rank's routed experts' Hessians (min / median / max) and how many saw
    fewer tokens than their inputs (a rank-deficient Hessian, which GPTQ shrinks toward its diagonal)."""
    local = {n: tokens[n] for n in linears if ctx.adapter.is_rank_local(n) and n in tokens}
    if not local:
        return
    counts = sorted(local.values())
    short = sum(local[n] < linears[n].in_features for n in local)
    logger.info("linear_quant: %s: routed experts' Hessians saw %d / %d / %d tokens (min / median / max) on rank "
                "%d; %d of %d linears saw fewer tokens than their inputs", ctx.unit.name, counts[0],
                counts[len(counts) // 2], counts[-1], ctx.dist.rank, short, len(local))
