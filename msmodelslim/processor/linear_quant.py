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
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from msmodelslim.core.runner.context import UnitContext
from msmodelslim.errors import UserError
from msmodelslim.formats.ascendv1 import FLOAT
from msmodelslim.processor.base import Processor, ProcessorConfig, register_processor
from msmodelslim.quant.granularity import int_dtype
from msmodelslim.quant.modules import WEIGHT_METHODS, QuantLinear, QuantScheme, quantize_weight, scheme_for

logger = logging.getLogger(__name__)

DECODER_KINDS = ("decoder", "mtp")
_WILDCARDS = ("*", "?", "[")


@dataclass
class ActQConfig:
    scope: str = "per_token"
    dtype: str = "int8"
    symmetric: bool = True
    method: str = "minmax"


@dataclass
class WeightQConfig:
    scope: str = "per_channel"
    dtype: str = "int8"
    symmetric: bool = True
    method: str = "ssz"


@dataclass
class QConfig:
    act: ActQConfig = field(default_factory=ActQConfig)
    weight: WeightQConfig = field(default_factory=WeightQConfig)


def _sub_config(cls: type, value: Any, key: str) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"linear_quant.{key} must be a mapping, got {value!r}")
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"linear_quant.{key}: unknown key {unknown[0]!r} (expected {sorted(known)})")
    return cls(**value)


def _parse_qconfig(value: Any) -> QConfig:
    if isinstance(value, QConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"linear_quant.qconfig must be a mapping with 'act' and 'weight', got {value!r}")
    unknown = sorted(set(value) - {"act", "weight"})
    if unknown:
        raise ValueError(f"linear_quant.qconfig: unknown key {unknown[0]!r} (expected 'act', 'weight')")
    return QConfig(act=_sub_config(ActQConfig, value.get("act", {}), "qconfig.act"),
                   weight=_sub_config(WeightQConfig, value.get("weight", {}), "qconfig.weight"))


def _check_globs(value: Any, key: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(g, str) for g in value):
        raise ValueError(f"linear_quant.{key} must be a list of glob strings, got {value!r}")
    return list(value)


@dataclass
class LinearQuantConfig(ProcessorConfig):
    qconfig: QConfig = field(default_factory=QConfig)  # a plain mapping is accepted too (parsed in validate)
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        self.qconfig = _parse_qconfig(self.qconfig)
        self.include = _check_globs(self.include, "include")
        self.exclude = _check_globs(self.exclude, "exclude")
        act, w = self.qconfig.act, self.qconfig.weight
        if act.scope != "per_token":
            raise ValueError(f"linear_quant.qconfig.act.scope: only 'per_token' (dynamic) is supported, got {act.scope!r}")
        if w.scope != "per_channel":
            raise ValueError(f"linear_quant.qconfig.weight.scope: only 'per_channel' is supported, got {w.scope!r}")
        for key, sub in (("act", act), ("weight", w)):
            if sub.symmetric is not True:
                raise ValueError(f"linear_quant.qconfig.{key}.symmetric: only True is supported, got {sub.symmetric!r}")
            try:
                int_dtype(sub.dtype)
            except ValueError as exc:
                raise ValueError(f"linear_quant.qconfig.{key}.dtype: {exc}") from None
        if act.method != "minmax":
            raise ValueError(f"linear_quant.qconfig.act.method: only 'minmax' is supported, got {act.method!r}")
        if w.method not in WEIGHT_METHODS:
            raise ValueError(f"linear_quant.qconfig.weight.method: expected one of {list(WEIGHT_METHODS)}, "
                             f"got {w.method!r}")
        try:
            self.scheme  # noqa: B018 - validates the dtype pair
        except ValueError as exc:
            raise ValueError(f"linear_quant.qconfig: {exc}") from None

    @property
    def scheme(self) -> QuantScheme:
        return scheme_for(int_dtype(self.qconfig.weight.dtype), int_dtype(self.qconfig.act.dtype))


def _matches(name: str, globs: list[str]) -> list[str]:
    return [g for g in globs if fnmatch.fnmatchcase(name, g)]


def select(name: str, unit_kind: str, include: list[str], exclude: list[str]) -> bool:
    """The matching rule of linear_quant for one checkpoint name (see the module docstring)."""
    hits = _matches(name, include)
    if unit_kind not in DECODER_KINDS:
        hits = [g for g in hits if not g.startswith(_WILDCARDS)]
    return bool(hits) and not _matches(name, exclude)


def assign_owners(sizes: dict[str, int], world: int) -> dict[str, int]:
    """Rank that does the work for each item: largest first onto the least-loaded rank (lowest rank on ties).
    Deterministic, so every rank computes the same plan without communicating."""
    owner, load = {}, [0] * world
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # stable: equal sizes keep their order
        owner[name] = load.index(min(load))
        load[owner[name]] += sizes[name]
    return owner


@register_processor("linear_quant", LinearQuantConfig)
class LinearQuantProcessor(Processor):
    config: LinearQuantConfig
    quantizes_linears = True

    def preflight(self, adapter: Any) -> None:
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

    def process_unit(self, ctx: UnitContext) -> None:
        cfg = self.config
        scheme = cfg.scheme
        targets = []
        for live_name, mod in ctx.module.named_modules():
            if not live_name or not isinstance(mod, nn.Linear):  # the unit root itself cannot be swapped in place
                continue
            ckpt = ctx.adapter.checkpoint_name(ctx.unit, live_name)
            if select(ckpt, ctx.unit.kind, cfg.include, cfg.exclude):
                targets.append(live_name)
        linears = {name: ctx.module.get_submodule(name) for name in targets}
        quantized = self._quantize_weights(ctx, linears)
        for live_name, linear in linears.items():
            parent_name, _, child = live_name.rpartition(".")
            parent = ctx.module.get_submodule(parent_name) if parent_name else ctx.module
            setattr(parent, child, QuantLinear.from_linear(linear, scheme, quantized=quantized[live_name]))
        logger.info("linear_quant %s: %s quantized %d linears", scheme.name, ctx.unit.name, len(targets))

    def _quantize_weights(self, ctx: UnitContext, linears: dict[str, nn.Linear]) -> dict[str, tuple]:
        """(q, scale) per linear. Rank-local experts are quantized by their rank. Each replicated linear is
        quantized by one rank (largest first onto the least-loaded rank, the same plan on every rank) and broadcast
        from there, so data-parallel ranks share that work and still end with the single-device integers."""
        dist, scheme, method = ctx.dist, self.config.scheme, self.config.qconfig.weight.method

        def quantize(name: str) -> tuple:
            return quantize_weight(linears[name].weight.detach(), scheme.weight, method,
                                   scale_dtype=scheme.engine_scale_dtype)

        replicated = [n for n in linears if dist.is_distributed and not ctx.adapter.is_expert(n)]
        owner = assign_owners({n: linears[n].weight.numel() for n in replicated}, dist.world_size)
        out = {n: quantize(n) for n in linears if owner.get(n, dist.rank) == dist.rank}
        for name in replicated:
            w = linears[name].weight
            q, scale = out.get(name) or (torch.empty(w.shape, dtype=torch.int8, device=w.device),
                                         torch.empty(w.shape[0], 1, dtype=torch.float32, device=w.device))
            out[name] = (dist.broadcast(q, owner[name]), dist.broadcast(scale, owner[name]))
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
