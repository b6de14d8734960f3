"""`msmodelslim quant ... --plan`: what a run would do, from the headers alone, in seconds.

Every check a real run makes before compute runs here too, with the same one-line errors (the request, the practice,
the save path and its free space, the checkpoint's headers, the processors' preflight, the fused layers). Nothing is
written, no weight is read: the model is built on the meta device. The plan reports

- the serving target chosen, and whether each known target (serving/profiles.py) loads the output, or the rule it
  refuses it by;
- the units in order;
- per linear_quant entry, the linears it selects (first matching entry wins, as in a run): per unit kind and scheme;
- the tensors that stay FLOAT;
- the output: tensor bytes per rank (rank 0 writes the replicated tensors, each rank its routed experts) cut into
  shards as the saver cuts them (at `part_file_size` and at the end of every unit);
- per rank, device and host memory for the unit of largest cost, from the memory model of docs/npu.md, and the
  samples' state each rank's host keeps between units (it grows with the calibration tokens);
- the calibration tokens, and a time estimate where `plan_records.json` holds a benchmark of this device and layer
  size (BENCHMARKS.md), otherwise that no record exists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from msmodelslim.model.base import Unit
from msmodelslim.model.facts import ModelFacts
from msmodelslim.pipeline.assembly import host_state
from msmodelslim.quant.gptq import GPTQ_BATCH_BYTES
from msmodelslim.serving.linear_plan import LinearPlan, PlannedLinear
from msmodelslim.serving.rules import verdict

RECORDS_FILE = Path(__file__).with_name("plan_records.json")
GIB = 1024**3
GPTQ_WORK = 4  # a GPTQ batch holds about this many times GPTQ_BATCH_BYTES (Hessians, factors, weights): npu.md
HOST_BASE_GIB = 2.0  # a rank's interpreter, torch, the tokenizer and the meta model
ACTIVATION_COPIES = 3  # per token of a micro-batch on the device: the unit's input, its output, the residual blocks


def shards(sizes: list[int], limit: int) -> list[int]:
    """The saver's cut: tensors in order, a shard closed before the tensor that would take it past `limit`."""
    out, pending = [], 0
    for size in sizes:
        if pending and pending + size > limit:
            out.append(pending)
            pending = 0
        pending += size
    return out + ([pending] if pending else [])


def build_plan(adapter: Any, plan: LinearPlan, save_config: Any, world: int, device_type: str,
               tokens: int, samples: int, largest_sample: int = 0, resume_every: int = 1) -> dict[str, Any]:
    from msmodelslim.processor.save.ascendv1_saver import quant_tensor_bytes, source_float_dtypes

    units = adapter.units()
    linears = list(plan.linears.values())
    quantized = {lp.name: lp for lp in linears if lp.quantized}
    biases = {name: mod.bias for unit in units for live, mod in adapter.unit_module(unit).named_modules()
              if isinstance(mod, torch.nn.Linear) and (name := adapter.checkpoint_name(unit, live)) in quantized}

    selections = []
    for i, entry in enumerate(plan.entries):
        counts: dict[str, dict[str, int]] = {}
        for lp in linears:
            if lp.entry == i:
                per_kind = counts.setdefault(lp.kind, {})
                per_kind[entry.scheme] = per_kind.get(entry.scheme, 0) + 1
        selections.append({"processor": i, "scheme": entry.scheme, "method": entry.method,
                           "include": list(entry.include), "exclude": list(entry.exclude),
                           "selected": sum(sum(c.values()) for c in counts.values()), "per_unit_kind": counts})

    # the output, tensor by tensor in unit order, split by owner
    row_parallel, splits = set(save_config.row_parallel), save_config.row_parallel_splits
    source = source_float_dtypes(adapter)  # FLOAT tensors keep their stored dtype, as the saver writes them
    default_float = getattr(torch, save_config.float_dtype).itemsize
    replicated: list[list[int]] = []  # per unit, the sizes rank 0 writes of it (replicated tensors)
    experts: list[int] = []  # per unit, the bytes of its routed experts (split evenly over the ranks)
    floats: list[str] = []
    unit_weights: dict[str, tuple[int, int]] = {}  # unit -> (replicated, expert) bf16 bytes of its weights
    for unit in units:
        rep = exp = 0
        replicated.append([])
        experts.append(0)
        for name, tensor in adapter.checkpoint_state(unit, adapter.unit_module(unit)):
            owner, _, leaf = name.rpartition(".")
            lp = quantized.get(owner)
            if lp is not None and leaf == "bias":
                continue  # written with its linear
            if lp is not None and leaf == "weight":
                bias, entry = biases[owner], plan.entries[lp.entry]
                size = quant_tensor_bytes(lp.out_features, lp.in_features, entry.scheme,
                                          owner.rsplit(".", 1)[-1] in row_parallel, splits,
                                          0 if bias is None else bias.numel() * default_float,
                                          entry.group_size)
            else:
                size = tensor.numel() * (source[name].itemsize if name in source else default_float) \
                    if tensor.is_floating_point() else tensor.numel() * tensor.element_size()
                floats.append(name)
            compute = tensor.numel() * 2  # bf16 on the device
            if adapter.is_rank_local(name):
                experts[-1] += size
                exp += compute
            else:
                replicated[-1].append(size)
                rep += compute
        unit_weights[unit.name] = (rep, exp)
    # the saver closes a shard at `part_file_size` and at the end of every unit; a rank's experts of one unit are
    # counted as one run of tensors, so their cut is approximate
    limit = int(save_config.part_file_size * GIB)
    rank_shards = [[size for rep, exp in zip(replicated, experts) for size in shards(rep + [exp // world], limit)]]
    rank_shards += [[exp // world for exp in experts if exp] for _ in range(world - 1)]
    rank_bytes = [sum(r) for r in rank_shards]

    memory = _memory(units, plan, unit_weights, world, largest_sample, GPTQ_BATCH_BYTES, limit)
    memory["host_state"] = host_state(adapter, tokens, world, resume_every)
    return {
        "target": {"chosen": adapter.target.name, "verdicts": verdict(plan, adapter)},
        "units": [{"name": u.name, "kind": u.kind} for u in units],
        "linear_quant": selections,
        "float_tensors": {"count": len(floats), "names": floats},
        "output": {"bytes": sum(rank_bytes), "bytes_per_rank": rank_bytes,
                   "shards": [s for r in rank_shards for s in r if s], "part_file_size_gib": save_config.part_file_size},
        "memory_per_rank": memory,
        "calibration": {"samples": samples, "tokens": tokens, "ranks": world,
                        "expert_coverage": _expert_coverage(adapter, plan, tokens)},
        "time": _time_estimate(adapter.facts, device_type, world, units, tokens),
    }


def _memory(units: list[Unit], plan: LinearPlan, weights: dict[str, tuple[int, int]], world: int,
            sample_tokens: int, gptq_batch: int, part_bytes: int) -> dict[str, Any]:
    """docs/npu.md's model per unit: weights (bf16) + the GPTQ readers' float32 Hessians (one per input: readers
    of one module with one width share it) + a GPTQ batch's working set + the activations of one micro-batch (the
    largest, `sample_tokens`: the rest of the samples' state waits on the host, `host_state`). Host: the Cholesky
    factors of one batch in float64, the saver's buffered shard, and the process itself; the samples' state is
    `host_state`, apart."""
    worst = None
    for unit in units:
        rep, exp = weights[unit.name]
        w = rep + exp / world
        inputs: dict[tuple[str, int], bool] = {}
        for lp in plan.linears.values():
            if lp.unit == unit.name and _method(plan, lp) == "gptq":
                inputs[(lp.name.rpartition(".")[0], lp.in_features)] = lp.rank_local
        hessians = sum(4 * d * d / (world if expert else 1) for (_, d), expert in inputs.items())
        batch = min(hessians, GPTQ_WORK * gptq_batch) if hessians else 0
        hidden = max((lp.in_features for lp in plan.linears.values() if lp.unit == unit.name), default=0)
        activations = ACTIVATION_COPIES * 2 * hidden * sample_tokens
        device = w + hessians + batch + activations
        if worst is None or device > worst["device_bytes"]:
            host = 2 * min(hessians, gptq_batch) + part_bytes + HOST_BASE_GIB * GIB
            worst = {"unit": unit.name, "device_bytes": device, "host_bytes": host,
                     "terms": {"weights": w, "hessians": hessians, "gptq_batch": batch, "activations": activations}}
    if worst is None:
        return {}
    worst["device_gib"] = round(worst["device_bytes"] / GIB, 2)
    worst["host_gib"] = round(worst["host_bytes"] / GIB, 2)
    worst["model"] = "docs/npu.md, Memory per rank"
    return worst


def _method(plan: LinearPlan, lp: PlannedLinear) -> str | None:
    entry = plan.entry_of(lp.name)
    return None if entry is None else entry.method


def _expert_coverage(adapter: Any, plan: LinearPlan, tokens: int) -> dict[str, Any] | None:
    """The tokens a routed expert's Hessian sees if the router spreads them evenly (tokens x top-k / experts), against
    the widest routed-expert input: below it the Hessian is rank-deficient (the run's log and report say how the
    real router spread them)."""
    widths = [lp.in_features for lp in plan.linears.values() if lp.rank_local and _method(plan, lp) == "gptq"]
    experts, top_k = adapter.facts.num_experts, adapter.facts.top_k
    if not widths or not experts or not top_k:
        return None
    every_token = adapter.expert_statistics == "all_tokens"  # spec.calibrate_all_experts
    per_expert = tokens if every_token else tokens * top_k // experts
    width = max(widths)
    return {"tokens_per_expert_even_routing": per_expert, "widest_expert_input": width, "all_tokens": every_token,
            "balanced": adapter.expert_statistics == "balanced",  # spec.balanced_experts: at least that, each
            "tokens_for_full_rank": width if every_token else -(-width * experts // top_k),
            "full_rank": per_expert >= width}


def _time_estimate(facts: ModelFacts, device_type: str, world: int, units: list[Unit], tokens: int) -> dict[str, Any]:
    """From a benchmark of this device and layer size (plan_records.json), per decoder unit; else no estimate."""
    experts_per_rank = facts.num_experts // world
    decoders = sum(u.kind in ("decoder", "mtp") for u in units)
    for record in json.loads(RECORDS_FILE.read_text(encoding="utf-8"))["records"]:
        if (record["device_type"], record["hidden_size"], record["experts_per_rank"]) == \
                (device_type, facts.hidden_size, experts_per_rank):
            per_unit = record["seconds_fixed_per_decoder_unit"] + record["ms_per_token_per_decoder_unit"] * tokens / 1e3
            # what the run pays once whatever its layers: the final flush of the resumable state (pipeline/hooks.py,
            # `resume_flush`), the units that are no layer
            once = record.get("seconds_once_per_run", 0.0) + record.get("ms_per_token_once_per_run", 0.0) * tokens / 1e3
            seconds = per_unit * decoders + once
            return {"seconds": round(seconds), "hours": round(seconds / 3600, 2), "record": record,
                    "assumes": f"{decoders} decoder and MTP units of {per_unit:.0f} s each at {tokens} calibration "
                               f"tokens and {once:.0f} s once (the record: {record['seconds_fixed_per_decoder_unit']:g} "
                               f"s + {record['ms_per_token_per_decoder_unit']:g} ms per token per unit, on "
                               f"{record['device']}; an upper bound)"}
    return {"seconds": None, "note": f"no benchmark record for {device_type} with hidden size {facts.hidden_size} "
                                     f"and {experts_per_rank} experts per rank (plan_records.json)"}


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def describe(plan: dict[str, Any]) -> str:
    """The plan as a person reads it (the JSON holds every name)."""
    target = plan["target"]
    lines = [f"serving target: {target['chosen']}"]
    lines += [f"  {name}{' (chosen)' if name == target['chosen'] else ''}: {said}"
              for name, said in target["verdicts"].items()]
    lines.append("units: " + ", ".join(u["name"] for u in plan["units"]))
    for sel in plan["linear_quant"]:
        kinds = "; ".join(f"{kind}: " + ", ".join(f"{n} {s}" for s, n in sorted(c.items()))
                          for kind, c in sorted(sel["per_unit_kind"].items()))
        lines.append(f"linear_quant #{sel['processor']} {sel['scheme']} ({sel['method']}): {sel['selected']} linears "
                     f"({kinds or 'none'})")
    lines.append(f"float tensors: {plan['float_tensors']['count']}")
    out = plan["output"]
    lines.append(f"output: {_size(out['bytes'])} in {len(out['shards'])} shard(s) of up to "
                 f"{out['part_file_size_gib']:g} GiB; per rank " + ", ".join(_size(b) for b in out["bytes_per_rank"]))
    mem = plan["memory_per_rank"]
    if mem:
        lines.append(f"memory per rank, largest unit {mem['unit']}: device ~{_size(mem['device_bytes'])}, host "
                     f"~{_size(mem['host_bytes'])} ({mem['model']})")
        state = mem["host_state"]
        parts = state["state_parts"]
        lines.append(f"samples' state per rank, on the host: ~{_size(state['bytes'])} ({state['bytes_per_token']} "
                     f"bytes per token: {', '.join(parts)}); in the temporary "
                     f"output, all ranks: up to ~{_size(state['disk_bytes'])} (the resumable state)")
    cal = plan["calibration"]
    lines.append(f"calibration: {cal['samples']} samples, {cal['tokens']} tokens over {cal['ranks']} rank(s)")
    cov = cal.get("expert_coverage")
    if cov:
        how = "every expert on every token" if cov["all_tokens"] else \
            "balanced experts: at least even routing's, each" if cov["balanced"] else "even routing"
        lines.append(f"expert coverage ({how}): ~{cov['tokens_per_expert_even_routing']} tokens per routed "
                     f"expert against inputs {cov['widest_expert_input']} wide: "
                     + ("full-rank Hessians" if cov["full_rank"] else
                        f"rank-deficient Hessians; about {cov['tokens_for_full_rank']} calibration tokens fill them"))
    t = plan["time"]
    lines.append(f"time: ~{t['hours']} h ({t['assumes']})" if t.get("seconds") is not None else f"time: {t['note']}")
    return "\n".join(lines)

