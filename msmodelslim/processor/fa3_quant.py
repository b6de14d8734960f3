"""fa3_quant: quantize the attention's Q, K and V where the FlashAttention kernel reads them (W4A8C8's "C8").

YAML (msModelSlim's names; one of `qconfig` or `details`, neither is int8 per head for all three points):
    - type: fa3_quant
      qconfig: {dtype: int8, scope: per_head, symmetric: true, method: minmax}
      include: ["*"]                       # globs on the attention's checkpoint name (`...layers.3.self_attn`)
      exclude: ["*.layers.0.*"]
    - type: fa3_quant
      details:                             # per point; a point left out stays float
        fa_q: {dtype: fp8_e4m3, scope: per_token}
        fa_k: {dtype: fp8_e4m3, scope: per_head}
        fa_v: {dtype: fp8_e4m3, scope: per_head}

The adapter puts placeholders at the points (`inject_fa3_placeholders`); for the per-head points the runner records
each head's calibration range (`Observe.head_ranges`: the narrowest window holding the placeholder's share of each
sample's values, min/max over samples and ranks), the scale is max|range| / 127 (int8) or / 448 (fp8), and the
placeholders become quantizers, so later units calibrate on the quantized attention. The saver writes what
msModelSlim writes (serving/ascendv1.py). Put it after linear_quant: the ranges are then those of the quantized
projections, as at run time.

vllm-ascend 0.23 quantizes an MLA's KV cache from `fa_k.scale` only (FAKQuant, kv_c8.py): `fa_k` must be per head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from msmodelslim.core.config import StrictConfig
from msmodelslim.core.requests import Observe
from msmodelslim.errors import UserError
from msmodelslim.processor.base import Processor, ProcessorConfig, UnitContext, register_processor
from msmodelslim.processor.globs import selected
from msmodelslim.quant.attention import (
    FA3_BRANCHES,
    AttentionQuantSpec,
    AttnDType,
    AttnScope,
    head_scales,
    install_quantizers,
)
from msmodelslim.serving.ascendv1 import attention_quant_type

logger = logging.getLogger(__name__)


@dataclass
class FA3QConfig(StrictConfig):
    dtype: AttnDType = "int8"
    scope: AttnScope = "per_head"
    symmetric: bool = True
    method: Literal["minmax"] = "minmax"

    def validate(self) -> None:
        if self.symmetric is not True:
            raise ValueError("symmetric must be true: the MLA kernel dequantizes with a scale only (vllm-ascend "
                             "0.23 passes no K offset to it)")

    @property
    def spec(self) -> AttentionQuantSpec:
        return AttentionQuantSpec(self.dtype, self.scope)


@dataclass
class FA3Details(StrictConfig):
    fa_q: FA3QConfig | None = None
    fa_k: FA3QConfig | None = None
    fa_v: FA3QConfig | None = None


@dataclass
class FA3QuantConfig(ProcessorConfig):
    qconfig: FA3QConfig | None = None
    details: FA3Details | None = None
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.qconfig is not None and self.details is not None:
            raise ValueError("give one of qconfig and details, not both")
        k = self.specs.get("fa_k")
        if k is None or not k.static:
            raise ValueError("fa_k must be quantized per_head: vllm-ascend 0.23 quantizes an MLA's KV cache only "
                             "from a static fa_k scale (FAKQuant); anything else would write nothing it reads")

    @property
    def specs(self) -> dict[str, AttentionQuantSpec]:
        """point -> its scheme, for the points quantized."""
        if self.details is None:
            spec = (self.qconfig or FA3QConfig()).spec
            return {branch: spec for branch in FA3_BRANCHES}
        return {b: cfg.spec for b in FA3_BRANCHES if (cfg := getattr(self.details, b)) is not None}


@register_processor("fa3_quant", FA3QuantConfig)
class FA3QuantProcessor(Processor):
    config: FA3QuantConfig
    quantizes_attention = True

    def _wanted(self, attention: str) -> bool:
        return selected(attention, self.config.include, self.config.exclude)

    def preflight(self, adapter, schemes) -> None:
        attentions = adapter.fa3_attentions()
        if not attentions:
            raise UserError(f"fa3_quant: {type(adapter).__name__} has no attention with FA3 points in this model")
        if not any(self._wanted(a) for a in attentions):
            raise UserError(f"fa3_quant: include {self.config.include} / exclude {self.config.exclude} match none "
                            f"of the model's {len(attentions)} attentions (e.g. {attentions[0]!r})")

    def process_unit(self, ctx: UnitContext):
        attentions = ctx.adapter.inject_fa3_placeholders(ctx.unit, ctx.module, self._wanted)
        if not attentions:
            return
        specs = self.config.specs
        static = {}  # the per-head points: their heads and calibration share, from the adapter's placeholders
        for attention in attentions:
            for branch in (b for b, spec in specs.items() if spec.static):
                holder = ctx.module.get_submodule(f"{attention}.{branch}")
                static[f"{attention}.{branch}"] = (holder.heads, holder.ratio)
        stats = (yield Observe(head_ranges=static)) if static else None
        for attention in attentions:
            points = {}
            for branch, spec in specs.items():
                name = f"{attention}.{branch}"
                scale = head_scales(*stats.head_ranges[name], spec) if spec.static else None
                points[branch] = (spec, scale)
                if scale is not None:
                    logger.debug("%s %s: %s scale %s", ctx.unit.name, name, spec.dtype,
                                 [round(float(s), 6) for s in scale[:4]])
            install_quantizers(ctx.module.get_submodule(attention), points)
        logger.info("fa3_quant %s: %s quantized %d attention(s)", attention_quant_type(specs), ctx.unit.name,
                    len(attentions))
