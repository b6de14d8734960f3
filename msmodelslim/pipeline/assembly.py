"""The assembly of one rank's run: the practice's processors and savers built from their entries, the checks that
need no compute, and this rank's share of the calibration samples. A run and `--plan` both go through here."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from msmodelslim.core.config import FallbackConfig, Label
from msmodelslim.core.dist import DistContext, current_token_source
from msmodelslim.errors import UserError
from msmodelslim.model.base import ModelAdapter
from msmodelslim.pipeline.resume import KEEP
from msmodelslim.pipeline.spill import BUDGET_ENV, host_budget
from msmodelslim.processor.fallback import apply_fallback
from msmodelslim.processor.plan import linear_plan, report_native_mxfp4
from msmodelslim.quant.modules import SCHEMES
from msmodelslim.serving.ascendv1 import FLOAT
from msmodelslim.serving.linear_plan import LinearPlan
from msmodelslim.serving.profiles import profile
from msmodelslim.serving.rules import check_plan

logger = logging.getLogger(__name__)
GIB = 1024**3


def prepare_run(adapter: ModelAdapter, records: list[Any], spec: Any, world: int | None = None,
                label: Label | None = None) -> tuple[list[dict[str, Any]], list[Any], LinearPlan]:
    """The calibration samples, the processors and the linear plan, with every check that needs no compute (the
    serving target's rules among them, serving/rules.py): a plan that matches
    nothing, or that cannot produce what the practice's `label` promises, fails here, before any compute (a run and
    `--plan` both go through this). `world`: the ranks the samples are dealt to (default the adapter's)."""

    adapter.serve_on(profile(spec.target, "spec.target"))
    adapter.calibrate_experts("all_tokens" if spec.calibrate_all_experts else
                              "affinity" if spec.affinity_guided_experts else
                              "balanced" if spec.balanced_experts else "routed")
    if spec.mtp == "drop" and adapter.drop_units("mtp"):
        logger.info("spec.mtp: drop: the MTP layers are left out of the run and of the output")
    samples = micro_batches(adapter.prepare_samples(records, max_seq_len=spec.max_seq_len), spec.micro_batch_tokens)
    check_host_memory(adapter, sum(map(sample_tokens, samples)), world or adapter.dist.world_size, spec.resume_every)
    processors = [step.build() for step in spec.process]
    fallback = apply_fallback(processors, [*spec.fallback, *_mtp_fallback(adapter, spec)], adapter)
    plan = linear_plan(processors, adapter, fallback)  # walked once: at Kimi-K3 scale there are ~10^5 linears
    schemes = plan.schemes
    for processor in processors:
        processor.preflight(adapter, schemes)
    check_plan(plan, adapter.target, adapter)
    report_native_mxfp4(processors, plan, adapter)
    if label is not None:
        check_label(label, set(schemes.values()), bool(spec.fallback))
    return samples, processors, plan


def check_label(label: Label, planned: set[str], fallback: bool) -> None:
    """The plan must hold a linear of a scheme the practice's label promises (`w4a8` -> W4A8_DYNAMIC or W4A8_MXFP):
    a practice labelled w4a8 whose quantizers give W8A8 would run for hours to write what its name denies. A
    fallback that moved every such linear up was asked for: it is said, not refused."""
    if label.w_bit >= 16 and label.a_bit >= 16:
        return
    promised = sorted(s.name for s in SCHEMES.values()
                      if (s.weight.bits, s.act.bits if s.act else 16) == (label.w_bit, label.a_bit))
    if set(promised) & planned:
        return
    if fallback:
        logger.warning("the practice is labelled %s, but its spec.fallback moves every %s linear to a higher "
                       "precision", label.quant_type, " / ".join(promised))
        return
    raise UserError(f"the practice is labelled {label.quant_type} (metadata.label), but its quantizers give no "
                    f"linear {' or '.join(promised) or '(no scheme has these bits)'}: they give "
                    f"{', '.join(sorted(planned - {FLOAT})) or 'none'} (check their qconfig and include / exclude "
                    f"globs, or the label)")


def host_state(adapter: Any, tokens: int, world: int, resume_every: int = 1) -> dict[str, Any]:
    """The samples' state between units on one rank's host (the runner moves one micro-batch of it to the device at
    a time): per token the hidden state, the attention-residual blocks finished at the deepest decoder unit and the
    MTP layers' input embeddings, each [hidden] in the compute dtype, and the token id. A unit's outputs share what
    it passes through untouched with its inputs (`HostCopies`: all but the new hidden state), and its last pass
    drops each input state as it makes the output (`LayerWiseRunner._forward_samples`), so inputs and outputs
    together stay one state. It grows with the calibration tokens; past the rank's budget the runner keeps it on
    disk (pipeline/spill.py)."""
    facts = adapter.facts
    hidden = facts.hidden_size * facts.dtype_bytes
    per_token = facts.state_bytes_per_token
    return {"bytes_per_token": per_token, "bytes": per_token * math.ceil(tokens / world),
            "state_parts": list(facts.state_parts),
            # on the save path's disk, all ranks, spilled or not: the files are incremental (pipeline/resume.py,
            # spill.py), so a decoder unit's files hold its new hidden state and refer to the earlier files for the
            # rest. Live are the last KEEP kept units, one more being written, the units since the last kept one
            # (`spec.resume_every`) and the one in progress, a hidden state each; the passed-through tensors once, in
            # the files of the units that made them; and the embedding unit's hidden state beside its MTP inputs
            "disk_bytes": ((KEEP + 2 + resume_every) * hidden + per_token) * tokens}


def check_host_memory(adapter: ModelAdapter, tokens: int, world: int, resume_every: int = 1) -> None:
    """Say, before any compute, how much host memory the samples' state between units takes per rank, and that
    past the rank's budget it is kept on disk (pipeline/spill.py)."""
    if not tokens:
        return
    state = host_state(adapter, tokens, world, resume_every)
    ranks = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    budget = host_budget(ranks)
    what = (f"the calibration samples' state between units takes ~{state['bytes'] / GIB:.2f} GiB of host memory per "
            f"rank ({tokens // world} tokens x {state['bytes_per_token']} bytes) and up to "
            f"~{state['disk_bytes'] / GIB:.2f} GiB in the temporary output (the resumable state)")
    if state["bytes"] > budget:
        logger.info("%s; past %.2f GiB per rank ($%s, else half the available memory over the host's ranks) it is "
                    "kept on disk in the temporary output", what, budget / GIB, BUDGET_ENV)
    else:
        logger.debug("%s", what)


def _mtp_fallback(adapter: ModelAdapter, spec: Any) -> list[FallbackConfig]:
    """`spec.mtp: float` as a fallback entry: every linear of the MTP layers to FLOAT (with the fallback's own rules:
    fused groups move whole, the log says how many)."""
    layers = [f"{unit.prefix}*" for unit in adapter.units() if unit.kind == "mtp"]
    if spec.mtp != "float" or not layers:
        return []
    entry = FallbackConfig(to="FLOAT", names=layers)
    entry.load(Path("."), "spec.mtp")  # its globs: the names (no file to read)
    return [entry]


def sample_tokens(sample: dict[str, Any]) -> int:
    """The calibration tokens of a sample (a micro-batch: every record's token ids)."""
    return int(sample["input_ids"].numel()) if "input_ids" in sample else 0


def _sample_size(sample: dict[str, Any]) -> int:
    return sum(v.numel() for v in sample.values() if isinstance(v, torch.Tensor))


def _stack_key(sample: dict[str, Any]) -> tuple | None:
    """What samples must share to be forwarded as one batch (every value a tensor of one sample, [1, ...], of the
    same shape and dtype), or None for a sample that forwards alone (an image record: its pixels are not [1, ...])."""
    if not all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == 1 for v in sample.values()):
        return None
    return tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in sample.items()))


def micro_batches(samples: list[dict[str, Any]], max_tokens: int | None) -> list[dict[str, Any]]:
    """Calibration samples as the forwards take them: records of one shape (text records cut to the same length:
    at scale, nearly all of them) stacked along the batch dimension, at most `max_tokens` tokens per batch; the
    others alone. One forward of many tokens costs far less than many of a few (each routed expert of a 896-expert
    layer sees ~2 % of a batch's tokens).

    Batches are made from the whole set in one fixed order (largest first, file order on ties) before they are
    dealt to ranks, so which records share a forward never depends on the rank count: a data-parallel run computes
    exactly what one device computes."""
    if not max_tokens:
        return samples
    order = sorted(range(len(samples)), key=lambda i: -_sample_size(samples[i]))
    batches: list[dict[str, Any]] = []
    group: list[dict[str, Any]] = []
    group_key: tuple | None = None

    def close() -> None:
        if group:
            batches.append(group[0] if len(group) == 1 else
                           {k: torch.cat([s[k] for s in group]) for k in group[0]})
            group.clear()

    for i in order:
        sample = samples[i]
        key = _stack_key(sample)
        tokens = sample_tokens(sample)
        if key is None or key != group_key or (len(group) + 1) * tokens > max_tokens:
            close()
        group.append(sample)
        group_key = key
        if key is None:
            close()
    close()
    return batches


def split_samples(samples: list[dict[str, Any]], rank: int, world: int) -> list[dict[str, Any]]:
    """This rank's share of the calibration samples.

    Ranks forward their samples in lock-step (the expert-parallel MoE is collective), so each step lasts as long as
    its largest sample on any rank: samples are dealt round-robin in decreasing size (token ids plus pixels), which
    gives every rank samples of about the same size at each step. Which rank forwards a sample never changes the
    output (statistics are max-reduced, each sample is forwarded on its own).
    """
    return [samples[i] for i in _dealing_order(samples)[rank::world]]


def place_tokens(samples: list[dict[str, Any]]) -> list[int]:
    """The calibration tokens of each place of the dealing order (`split_samples`: rank r forwards place
    s * world + r at step s)."""
    return [sample_tokens(samples[i]) for i in _dealing_order(samples)]


def first_places(tokens_by_place: Sequence[int], tokens: int | None) -> set[int] | None:
    """The samples a capped statistic observes (the quant report's `spec.report_tokens`, the smoothing search's
    `search_tokens`), by place in the dealing order: the first, up to `tokens` calibration tokens (at least one),
    the same on any number of ranks. None: all."""
    if tokens is None:
        return None
    places, seen = set(), 0
    for place, count in enumerate(tokens_by_place):
        if seen >= tokens:
            break
        places.add(place)
        seen += count
    return places


def steps_with(places: set[int] | None, steps: int, world: int) -> set[int] | None:
    """The steps at which some rank forwards one of `places` (the same on every rank); None: all."""
    if places is None:
        return None
    return {s for s in range(steps) if any(s * world + r in places for r in range(world))}


def observed_now(places: set[int] | None, step: int, dist: DistContext) -> bool:
    """Whether the tokens in progress come from one of `places`: those of the sample that the rank they come from
    forwards at `step` (a routed expert under EP computes every rank's tokens, one rank's block at a time)."""
    if places is None:
        return True
    source = current_token_source()
    return step * dist.world_size + (dist.rank if source is None else source) in places


def _dealing_order(samples: list[dict[str, Any]]) -> list[int]:
    return sorted(range(len(samples)), key=lambda i: -_sample_size(samples[i]))  # stable: ties keep file order
