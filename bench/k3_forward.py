"""The forward alone: one full-size Kimi-K3 layer as one rank of EP 8 holds it (bench/k3_layer.py's checkpoint),
run over T calibration tokens in micro-batches with no observer, processor or saver, and the operators of one
micro-batch's forward by device time. It separates what a calibration pass costs per token from what the
observers add (issue 31: the runner's marginal cost per token against this one).

The units before the layer (vision, embed) run once to make its inputs; the layer's passes are timed after a
warm-up pass (fla's Triton autotuning). torch.profiler covers one micro-batch's forward only: profiling a whole
quant run of this layer did not finish within a device call.

    python bench/k3_forward.py --device cuda:0 [--tokens 65536 --max-seq-len 1024 --micro-batch-tokens 8192]
    python bench/k3_forward.py --device cpu --preset tiny --tokens 2048     # a check of the script itself
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import generated_checkpoint, machine, print_result  # noqa: E402
from bench.k3_layer import long_record_set, rank_layer_checkpoint  # noqa: E402
from msmodelslim.core.calib import load_calib_records  # noqa: E402
from msmodelslim.core.device import bind_device, synchronize  # noqa: E402
from msmodelslim.core.dist import DistContext  # noqa: E402
from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter  # noqa: E402
from msmodelslim.pipeline.assembly import micro_batches  # noqa: E402
from msmodelslim.pipeline.finite import tensors  # noqa: E402


def moved(value, device: torch.device):
    """A sample's state (tensors in dicts and lists) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, device) for v in value)
    return value


def one_pass(adapter: KimiK3ModelAdapter, unit, module, states: list[dict], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for state in states:
            adapter.forward_unit(unit, module, moved(state, device))
    synchronize(device)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--preset", default="layer", help="layer (the EP-8 rank of bench/k3_layer.py) or a make_checkpoint "
                                                     "preset (tiny: to check the script)")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--passes", type=int, default=2, help="timed passes after the warm-up pass")
    p.add_argument("--top", type=int, default=25, help="operators listed from the profile")
    args = p.parse_args()

    device = torch.device(args.device)
    bind_device(device)
    model = rank_layer_checkpoint() if args.preset == "layer" else generated_checkpoint(args.preset)
    adapter = KimiK3ModelAdapter(model, trust_remote_code=True, dist=DistContext(rank=0, world_size=1,
                                                                                 device=device))
    folder, count = long_record_set(args.tokens, args.max_seq_len)
    records = load_calib_records(str(folder), "Describe this image.", count)
    states = micro_batches(adapter.prepare_samples(records, max_seq_len=args.max_seq_len), args.micro_batch_tokens)
    units = adapter.units()
    layer = next(u for u in units if u.kind == "decoder")
    for unit in units[:units.index(layer)]:  # the layer's inputs
        module = adapter.load_unit(unit, device)
        with torch.no_grad():
            states = [moved(adapter.forward_unit(unit, module, moved(s, device)), torch.device("cpu"))
                      for s in states]
        adapter.free_unit(unit, module)
    module = adapter.load_unit(layer, device)
    tokens = sum(s["hidden_states"].shape[0] * s["hidden_states"].shape[1] for s in states) \
        if all("hidden_states" in s for s in states) else None
    warm_s = one_pass(adapter, layer, module, states, device)
    passes = [one_pass(adapter, layer, module, states, device) for _ in range(args.passes)]

    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    biggest = max(states, key=lambda s: sum(t.numel() for t in tensors(s)))
    with torch.no_grad(), torch.profiler.profile(activities=activities) as prof:
        adapter.forward_unit(layer, module, moved(biggest, device))
        synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) \
        if device.type == "cuda" else None
    print(events.table(sort_by=key, row_limit=args.top), flush=True)
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:args.top]
    best = min(passes)
    print_result({
        "bench": "k3_forward", "machine": machine(), "device": args.device, "preset": args.preset,
        "tokens": tokens, "micro_batches": len(states), "micro_batch_tokens": args.micro_batch_tokens,
        "warmup_pass_s": round(warm_s, 2), "pass_s": [round(t, 3) for t in passes],
        "forward_ms_per_token": round(1000 * best / tokens, 5) if tokens else None,
        "profiled_micro_batch_tokens": int(biggest["hidden_states"].shape[0] * biggest["hidden_states"].shape[1])
        if "hidden_states" in biggest else None,
        "device_kernels_in_profiled_forward": kernels,
        "top_ops": [{"name": e.key, "count": e.count, "self_ms": round(getattr(e, key) / 1000, 3)} for e in top],
    })


if __name__ == "__main__":
    main()
