"""The assembly of one rank's run: the practice's processors and savers built from their entries, the checks that
need no compute, and this rank's share of the calibration samples. A run and `--plan` both go through here."""

from __future__ import annotations

from typing import Any

import torch

from msmodelslim.model.base import ModelAdapter
from msmodelslim.processor.fallback import apply_fallback
from msmodelslim.processor.linear_quant import check_plan, planned_configs, scheme_names


def prepare_run(adapter: ModelAdapter, records: list[Any], spec: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """The calibration samples and the processors, with every check that needs no compute: a plan that matches
    nothing fails here, before any compute (a run and `--plan` both go through this)."""

    samples = adapter.prepare_samples(records, max_seq_len=spec.max_seq_len)
    processors = apply_fallback([step.build() for step in spec.process], spec.fallback, adapter)
    planned = planned_configs(processors, adapter)  # walked once: at Kimi-K3 scale there are ~10^5 linears
    schemes = scheme_names(planned)
    for processor in processors:
        processor.preflight(adapter, schemes)
    check_plan(processors, planned, adapter)
    return samples, processors


def _sample_size(sample: dict[str, Any]) -> int:
    return sum(v.numel() for v in sample.values() if isinstance(v, torch.Tensor))


def split_samples(samples: list[dict[str, Any]], rank: int, world: int) -> list[dict[str, Any]]:
    """This rank's share of the calibration samples.

    Ranks forward their samples in lock-step (the expert-parallel MoE is collective), so each step lasts as long as
    its largest sample on any rank: samples are dealt round-robin in decreasing size (token ids plus pixels), which
    gives every rank samples of about the same size at each step. Which rank forwards a sample never changes the
    output (statistics are max-reduced, each sample is forwarded on its own).
    """
    order = sorted(range(len(samples)), key=lambda i: -_sample_size(samples[i]))  # stable: ties keep file order
    return [samples[i] for i in order[rank::world]]
