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

Weight methods (`qconfig.weight.method`, per-channel scales; `quant/modules.py`): `minmax`, `ssz` (least-squares
refined minmax), `grid` (clipping grid + refinement), `gptq` (GPTQ on the input Hessian the runner records, with
the diag(H)-weighted grid scale; `ext: {percdamp: 0.01, block_size: 128, act_order: true}` as msModelSlim names
them). Each linear's quantization is one job for the runner: replicated linears are spread over data-parallel
ranks and broadcast, routed experts are quantized by the rank that holds them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from msmodelslim.core.runner.context import UnitContext
from msmodelslim.core.runner.requests import Job, Jobs, Observe
from msmodelslim.errors import UserError
from msmodelslim.formats.ascendv1 import FLOAT
from msmodelslim.processor.base import Processor, ProcessorConfig, register_processor
from msmodelslim.processor.globs import matching, selected
from msmodelslim.quant.gptq import GPTQOptions
from msmodelslim.quant.granularity import int_dtype
from msmodelslim.quant.modules import QuantLinear, QuantScheme, quantize_weight, scheme_for

logger = logging.getLogger(__name__)

DECODER_KINDS = ("decoder", "mtp")
_WILDCARDS = ("*", "?", "[")
GPTQ_EXT = {"percdamp": "damp", "block_size": "block_size", "act_order": "act_order"}  # msModelSlim's ext keys
GPTQ_BATCH_BYTES = 2 << 30  # float32 Hessians per batched GPTQ of experts (its temporaries are a few times this)


@dataclass
class ActQConfig:
    scope: Literal["per_token"] = "per_token"  # dynamic: the serving kernel quantizes each token
    dtype: Literal["int8", "int4"] = "int8"
    symmetric: Literal[True] = True
    method: Literal["minmax"] = "minmax"


@dataclass
class WeightQConfig:
    scope: Literal["per_channel"] = "per_channel"
    dtype: Literal["int8", "int4"] = "int8"
    symmetric: Literal[True] = True
    method: Literal["ssz", "minmax", "grid", "gptq"] = "ssz"
    ext: dict[str, Any] = field(default_factory=dict)  # gptq: percdamp (0.01), block_size (128), act_order (true)

    def validate(self) -> None:
        if self.ext and self.method != "gptq":
            raise ValueError(f"ext is only read by method gptq, not {self.method!r}")
        unknown = sorted(set(self.ext) - set(GPTQ_EXT))
        if unknown:
            raise ValueError(f"ext: unknown key {unknown[0]!r} (expected {', '.join(GPTQ_EXT)})")
        opts = self.gptq
        if not 0 < opts.damp < 1:
            raise ValueError(f"ext.percdamp must be in (0, 1), got {opts.damp!r}")
        if isinstance(opts.block_size, bool) or not isinstance(opts.block_size, int) or opts.block_size <= 0:
            raise ValueError(f"ext.block_size must be a positive integer, got {opts.block_size!r}")
        if not isinstance(opts.act_order, bool):
            raise ValueError(f"ext.act_order must be true or false, got {opts.act_order!r}")

    @property
    def gptq(self) -> GPTQOptions:
        return GPTQOptions(**{GPTQ_EXT[k]: v for k, v in self.ext.items()})


@dataclass
class QConfig:
    act: ActQConfig = field(default_factory=ActQConfig)
    weight: WeightQConfig = field(default_factory=WeightQConfig)


@dataclass
class LinearQuantConfig(ProcessorConfig):
    qconfig: QConfig = field(default_factory=QConfig)
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)

    def validate(self) -> None:
        try:
            self.scheme  # noqa: B018 - validates the dtype pair
        except ValueError as exc:
            raise ValueError(f"qconfig: {exc}") from None

    @property
    def scheme(self) -> QuantScheme:
        return scheme_for(int_dtype(self.qconfig.weight.dtype), int_dtype(self.qconfig.act.dtype))


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
        linears = adapter.linear_names()
        names = [name for _, name in linears]
        matched = sum(select(name, unit.kind, cfg.include, cfg.exclude) for unit, name in linears)
        if not matched:
            example = names[len(names) // 2] if names else "(none)"
            raise UserError(f"linear_quant ({cfg.scheme.name}): include {cfg.include} exclude {cfg.exclude} selects "
                            f"none of the model's {len(names)} linears (for example {example})")
        logger.info("linear_quant %s: include %s exclude %s selects %d of %d linears", cfg.scheme.name, cfg.include,
                    cfg.exclude, matched, len(names))

    def process_unit(self, ctx: UnitContext) -> Any:
        cfg = self.config
        scheme, weight_cfg = cfg.scheme, cfg.qconfig.weight
        linears = {}
        for live_name, mod in ctx.module.named_modules():
            if not live_name or not isinstance(mod, nn.Linear):  # the unit root itself cannot be swapped in place
                continue
            if select(ctx.adapter.checkpoint_name(ctx.unit, live_name), ctx.unit.kind, cfg.include, cfg.exclude):
                linears[live_name] = mod
        if not linears:
            return
        hessians: dict[str, torch.Tensor] = {}
        tokens: dict[str, int] = {}
        if weight_cfg.method == "gptq":
            stats = yield Observe(hessian=tuple(linears))
            hessians, tokens = stats.hessian, stats.tokens
        results = yield Jobs(self._jobs(ctx, linears, hessians, tokens))
        hessians.clear()  # a layer's Hessians can be tens of GB at full scale
        merged = {k: v for outputs in results.values() for k, v in outputs.items()}
        for live_name, linear in linears.items():
            parent_name, _, child = live_name.rpartition(".")
            parent = ctx.module.get_submodule(parent_name) if parent_name else ctx.module
            quantized = (merged[f"{live_name}.q"], merged[f"{live_name}.scale"])
            setattr(parent, child, QuantLinear.from_linear(linear, scheme, quantized=quantized))
        logger.info("linear_quant %s (%s): %s quantized %d linears", scheme.name, weight_cfg.method, ctx.unit.name,
                    len(linears))

    def _jobs(self, ctx: UnitContext, linears: dict[str, nn.Linear], hessians: dict[str, torch.Tensor],
              tokens: dict[str, int]) -> list[Job]:
        """One job per linear, except for GPTQ: linears of one shape (a rank's experts; q/k/v) in batches of about
        GPTQ_BATCH_BYTES of Hessians, one column loop per batch. Replicated jobs are spread over the ranks."""
        gptq = self.config.qconfig.weight.method == "gptq"
        groups: dict[tuple, list[list[str]]] = {}
        for name, linear in linears.items():
            shape = tuple(linear.weight.shape)
            local = ctx.adapter.is_expert(name)
            per_batch = max(1, GPTQ_BATCH_BYTES // (shape[1] * shape[1] * 4)) if gptq else 1
            batches = groups.setdefault((shape, local), [[]])
            if len(batches[-1]) == per_batch:
                batches.append([])
            batches[-1].append(name)
        jobs = []
        for (shape, local), batches in groups.items():
            out_f, in_f = shape
            for names in batches:
                outputs = {}
                for n in names:
                    outputs[f"{n}.q"] = ((out_f, in_f), torch.int8)
                    outputs[f"{n}.scale"] = ((out_f, 1), torch.float32)
                work = partial(self._quantize, [linears[n].weight.detach() for n in names], names,
                               [hessians.get(n) for n in names], [tokens.get(n) for n in names])
                cost = len(names) * out_f * in_f * (in_f if gptq else 1)
                jobs.append(Job(names[0], cost, work, outputs, local=local))
        return jobs

    def _quantize(self, weights: list[torch.Tensor], names: list[str], hessians: list[torch.Tensor | None],
                  tokens: list[int | None]) -> dict[str, torch.Tensor]:
        scheme, weight_cfg = self.config.scheme, self.config.qconfig.weight
        index = None
        if len(weights) == 1:
            w, h, n = weights[0], hessians[0], tokens[0]
        else:  # a batch of one shape: stacked, quantized by one batched GPTQ
            w, h, n = torch.stack(weights), None, None
            if hessians[0] is not None:  # readers of one input (w1, w3) hold one Hessian object: stacked once
                first: dict[int, int] = {}  # id(Hessian) -> its first matrix in the batch
                for i, m in enumerate(hessians):
                    first.setdefault(id(m), i)
                slot = {key: k for k, key in enumerate(first)}
                index = torch.tensor([slot[id(m)] for m in hessians])
                h = torch.stack([hessians[i] for i in first.values()])
                n = torch.tensor([tokens[i] for i in first.values()])
        q, scale = quantize_weight(w, scheme.weight, weight_cfg.method, scale_dtype=scheme.engine_scale_dtype,
                                   hessian=h, tokens=n, gptq=weight_cfg.gptq, hessian_index=index)
        if len(weights) == 1:
            q, scale = q[None], scale[None]
        out = {}
        for i, name in enumerate(names):
            out[f"{name}.q"], out[f"{name}.scale"] = q[i], scale[i]
        return out

    def describe(self) -> dict[str, Any]:
        return {}


def planned_schemes(processors: list[Processor], adapter: Any) -> dict[str, str]:
    """Serving name -> the scheme each linear of the model will get: that of the first linear_quant entry (in YAML
    order) selecting it, as process_unit applies them, else FLOAT."""
    quantizers = [p.config for p in processors if isinstance(p, LinearQuantProcessor)]
    return {name: next((q.scheme.name for q in quantizers if select(name, unit.kind, q.include, q.exclude)), FLOAT)
            for unit, name in adapter.linear_names()}


def check_fused_groups(processors: list[Processor], adapter: Any) -> None:
    """Refuse a practice that would give the shards of one serving-engine layer different schemes: vllm-ascend
    loads such a layer with one scheme and rejects a mixed one (`modelslim_config.py:695-700`)."""
    plan = planned_schemes(processors, adapter)
    for group, shards in adapter.fused_groups():
        schemes = {}
        for shard in shards:
            schemes.setdefault(plan[shard], shard)
        if len(schemes) > 1:
            detail = "; ".join(f"{shard} is {scheme}" for scheme, shard in schemes.items())
            members = sorted({s.rsplit(".", 1)[-1] if ".experts." not in s else "experts.*" for s in shards})
            raise UserError(f"spec.process: the serving engine runs {group} as one layer with one scheme, but the "
                            f"practice splits it ({detail}); include or exclude {', '.join(members)} together")
