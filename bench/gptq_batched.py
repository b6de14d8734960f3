"""GPTQ of the routed experts one EP-8 rank of a full-size Kimi-K3 layer holds, ours against llm-compressor 0.14's
batched GPTQ on the same matrices, Hessians and scales, side by side in one process (issue 50 item 3).

The matrices: 112 experts, each with w1 and w3 stacked as one [6144, 3584] matrix (the readers of one input share
its Hessian, as linear_quant stacks them) and w2 [3584, 3072]; random weights, and Hessians X^T X of `--tokens`
random rows per expert, their channels correlated (a low-rank part plus noise) with scales spread over two decades
(1M calibration tokens with top-16 over 896 experts give an expert ~18,700 rows).

- ours, as linear_quant runs it: `quantize_weight(..., "gptq")` in linear_quant's batches (GPTQ_BATCH_BYTES of
  Hessians per linear), the diag(H)-weighted scale search included (on CUDA one Triton kernel, ops/grid_search.py);
- the same with the search in PyTorch's elementwise passes (`ours_eager_search`; what an NPU and the CPU run), and
  how its scales compare with the kernel's (the fraction identical, the largest relative difference);
- ours, the column loop alone (`gptq_quantize`, given those scales), in the same batches;
- llm-compressor: `quantize_weight` of `llmcompressor.modifiers.gptq.gptq_quantize` (its Triton block kernel on
  CUDA, eager elsewhere): channel-wise symmetric int4, static activation order, 1 % dampening, given our scales, in
  the same batches. Loaded from an unzipped wheel (`--llmcompressor DIR`, DIR holding `llmcompressor/`) without its
  package `__init__`, which imports datasets, accelerate and the rest of its pipeline.

So that neither is fast by doing less, each result's output error tr(dW H dW^T) is reported relative to rounding to
nearest with the same scales (the mean over matrices). Ours shrinks a Hessian toward its diagonal by the rows it
summed (quant/gptq.py); at these row counts that moves little.

Usage: python bench/gptq_batched.py --device cuda:0 --llmcompressor DIR [--experts 112 --tokens 18724 --repeats 2]
       python bench/gptq_batched.py --device cpu --experts 2 --shrink 16 --llmcompressor DIR   (a check of the script)
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, print_result, timed  # noqa: E402
from msmodelslim.quant import functional  # noqa: E402
from msmodelslim.quant.gptq import DEFAULT_GPTQ, GPTQ_BATCH_BYTES, GPTQ_BATCH_BYTES_CPU, gptq_quantize  # noqa: E402
from msmodelslim.quant.granularity import int4  # noqa: E402
from msmodelslim.quant.modules import quantize_weight  # noqa: E402

EXPERT_SHAPES = {"w13": (2 * 3072, 3584, 2), "w2": (3584, 3072, 1)}  # rows, inputs, linears sharing the Hessian


def llmcompressor_gptq(folder: str):
    """llm-compressor's batched `quantize_weight` and its QuantizationArgs, imported without the package __init__."""
    for name in ("llmcompressor", "llmcompressor.modifiers", "llmcompressor.modifiers.gptq"):
        package = types.ModuleType(name)
        package.__path__ = [str(Path(folder, *name.split(".")))]
        sys.modules[name] = package
    module = importlib.import_module("llmcompressor.modifiers.gptq.gptq_quantize")
    from compressed_tensors.quantization import QuantizationArgs
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel", actorder="static")
    return module.quantize_weight, args


def matrices(experts: int, rows: int, cols: int, tokens: int, device: torch.device, seed: int):
    """Weights [E, rows, cols] (bfloat16, as loaded) and Hessians [E, cols, cols] (float32 X^T X)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(experts, rows, cols, generator=g, device=device) * 0.02).to(torch.bfloat16)
    h = torch.empty(experts, cols, cols, device=device)
    rank = max(1, cols // 16)
    for e in range(experts):  # correlated channels (a low-rank part plus noise), scales over two decades
        spread = torch.exp(torch.rand(cols, generator=g, device=device) * 4.6)
        mix = torch.randn(rank, cols, generator=g, device=device) / rank ** 0.5
        x = (torch.randn(tokens, rank, generator=g, device=device) @ mix
             + 0.5 * torch.randn(tokens, cols, generator=g, device=device)) * spread
        h[e] = x.T @ x
    return w, h


def output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """tr(dW H dW^T) per matrix."""
    dw = (w.float() - w_hat.float())
    return torch.einsum("bri,bij,brj->b", dw, h, dw)


def compare(rows: int, cols: int, sharing: int, args: argparse.Namespace, device: torch.device, theirs, qargs,
            seed: int) -> tuple[dict, dict, int]:
    """(seconds per implementation, output error relative to RTN per implementation, batches) for one shape."""
    w, h = matrices(args.experts, rows, cols, args.tokens, device, seed)
    budget = GPTQ_BATCH_BYTES_CPU if device.type == "cpu" else GPTQ_BATCH_BYTES
    per_batch = max(1, budget // (sharing * cols * cols * 4))  # linear_quant's batches
    batches = [slice(s, min(s + per_batch, args.experts)) for s in range(0, args.experts, per_batch)]
    n = torch.full((args.experts,), args.tokens)

    def ours() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [quantize_weight(w[b], int4, "gptq", hessian=h[b], tokens=n[b]) for b in batches]

    functional.GRID_KERNEL.enabled = False
    t_eager, eager = timed(ours, device, args.repeats, warmup=True)
    functional.GRID_KERNEL.enabled = True
    t_ours, quantized = timed(ours, device, args.repeats, warmup=True)
    scale = torch.cat([s for _, s in quantized])
    eager_scale = torch.cat([s for _, s in eager])
    searches = {"identical_scales": round(float((scale == eager_scale).double().mean()), 4),
                "max_relative_scale_difference": float(((scale - eager_scale).abs() / eager_scale).max())}
    t_loop, _ = timed(lambda: [gptq_quantize(w[b], h[b], scale[b], int4, DEFAULT_GPTQ, n[b]) for b in batches],
                      device, args.repeats, warmup=True)
    zero = torch.zeros_like(scale, dtype=torch.int8)
    t_llmc, theirs_hat = timed(lambda: [theirs(w[b].float(), h[b].clone(), scale[b], zero[b], None, qargs)[0]
                                        for b in batches], device, args.repeats, warmup=True)
    def vs_rtn(b: slice, w_hat: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # rounding to nearest, scales s
        rtn = output_error(w[b], torch.clamp(torch.round(w[b].float() / s), int4.qmin, int4.qmax) * s, h[b])
        return output_error(w[b], w_hat, h[b]) / rtn

    ratios: dict[str, list[torch.Tensor]] = {"ours": [], "ours_eager_search": [], "llmcompressor": []}
    for b, (q, s), (q_eager, s_eager), theirs_b in zip(batches, quantized, eager, theirs_hat, strict=True):
        ratios["ours"].append(vs_rtn(b, q.float() * s, s))  # a batch at a time: memory
        ratios["ours_eager_search"].append(vs_rtn(b, q_eager.float() * s_eager, s_eager))
        ratios["llmcompressor"].append(vs_rtn(b, theirs_b, s))
    seconds = {"ours": t_ours, "ours_eager_search": t_eager, "ours_column_loop": t_loop, "llmcompressor": t_llmc}
    errors = {k: round(float(torch.cat(v).mean()), 4) for k, v in ratios.items()}
    return seconds, {**errors, **searches}, len(batches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--experts", type=int, default=112)
    p.add_argument("--tokens", type=int, default=18724, help="Hessian rows per expert")
    p.add_argument("--shrink", type=int, default=1, help="divide every width by this (a check on the CPU)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--llmcompressor", required=True, help="folder holding llmcompressor/ (an unzipped 0.14 wheel)")
    args = p.parse_args()
    device = torch.device(args.device)
    theirs, qargs = llmcompressor_gptq(args.llmcompressor)
    result: dict = {"machine": machine(), "device": str(device), "experts": args.experts, "tokens": args.tokens,
                    "shapes": {}, "seconds": {}, "error_vs_rtn": {}}
    totals = {"ours": 0.0, "ours_eager_search": 0.0, "ours_column_loop": 0.0, "llmcompressor": 0.0}
    for seed, (name, (rows, cols, sharing)) in enumerate(EXPERT_SHAPES.items()):
        rows, cols = rows // args.shrink, cols // args.shrink
        seconds, errors, batches = compare(rows, cols, sharing, args, device, theirs, qargs, seed)
        result["shapes"][name] = [args.experts, rows, cols, batches]
        result["seconds"][name] = {k: round(v, 3) for k, v in seconds.items()}
        result["error_vs_rtn"][name] = errors
        for k, v in seconds.items():
            totals[k] += v
        print(name, result["shapes"][name], result["seconds"][name], errors, flush=True)
    result["seconds"]["total"] = {k: round(v, 3) for k, v in totals.items()}
    result["column_loop_ours_over_llmcompressor"] = round(totals["ours_column_loop"] / totals["llmcompressor"], 3)
    print_result(result)


if __name__ == "__main__":
    main()
