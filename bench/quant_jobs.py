"""Where the fixed cost of a full-size Kimi-K3 layer's quantization jobs goes, on one device (issue 31).

The cost of a layer that does not grow with the calibration tokens is mostly linear_quant's GPTQ jobs and
iter_smooth's search (bench/k3_layer.py: 13.6 s and 6.7 s on the H100) and the Hessians' trip to the host and back
(`linear_quant._parked`). This bench times their parts on one batch of routed experts as linear_quant batches them
(`--experts` experts, each its w1 and w3 [--out, --width] stacked, one Hessian per expert of `--tokens` random
tokens), each part
synchronized, best of `--repeats`:

- gptq: the diag(H)-weighted scale search, the inverse Cholesky factor, the column loop (the whole less the two),
  eager and with a full block's loop replayed as a CUDA graph (`gptq._BlockGraph`), on the experts' batch and on one
  wide W8A8 linear (`--wide` columns, per-row and per-group scales), and whether the two give the same integers;
- the report's exact weight error of the batch: read back per linear (as the apply loop did) against one read of
  all (as the job does now);
- iter_smooth's modelled error of one reader for 8 candidate smoothings: read back per candidate (as before) against
  one read, and with TF32 products (not used: it would change which candidate wins a near tie);
- the Hessians of a whole rank's 112 experts (w1/w3's and w2's, ~10 GB) to the host and back: into pinned memory
  (its first allocation, then again from torch's pinned cache), into pageable memory, and back from each.

Usage: python bench/quant_jobs.py --device cuda:0 [--experts 20 --out 3072 --width 3584 --tokens 2048]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, print_result, timed  # noqa: E402
from msmodelslim.core.placement import to_host  # noqa: E402
from msmodelslim.processor.iter_smooth import error_parts  # noqa: E402
from msmodelslim.quant import gptq  # noqa: E402
from msmodelslim.quant.gptq import gptq_scale, inverse_cholesky_upper, shrunk_hessian  # noqa: E402
from msmodelslim.quant.granularity import int4, int8  # noqa: E402
from msmodelslim.quant.modules import quantize_weight  # noqa: E402
from msmodelslim.quant.sensitivity import hessian_error  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--experts", type=int, default=20, help="experts per GPTQ batch (w1 and w3 each: 2x matrices)")
    p.add_argument("--out", type=int, default=3072)
    p.add_argument("--width", type=int, default=3584)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--wide", type=int, default=12288, help="columns of the one wide W8A8 linear (out: a quarter)")
    p.add_argument("--rank-experts", type=int, default=112, help="experts whose Hessians are parked")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    dev = torch.device(args.device)
    E, OUT, D, T = args.experts, args.out, args.width, args.tokens
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(E, T, D, device=dev, generator=g)
    hessian = x.transpose(1, 2) @ x
    del x
    w = torch.randn(E, 2 * OUT, D, device=dev, generator=g).bfloat16()  # per expert its w1 and w3 rows, stacked
    tokens = torch.full((E,), T)
    r = args.repeats
    result: dict = {"bench": "quant_jobs", "machine": machine(), "device": args.device,
                    "shape": {"matrices": E, "rows": 2 * OUT, "width": D, "tokens": T}}

    scale_s, _ = timed(lambda: gptq_scale(w, hessian, int4), dev, r)
    factor_s, _ = timed(lambda: inverse_cholesky_upper(shrunk_hessian(hessian, tokens)), dev, r)
    experts = lambda: quantize_weight(w, int4, "gptq", hessian=hessian, tokens=tokens)  # noqa: E731
    gptq.CUDA_GRAPHS = False
    eager_s, (q_eager, _) = timed(experts, dev, r)
    gptq.CUDA_GRAPHS = True
    whole_s, (q, scale) = timed(experts, dev, r)
    result["gptq_s"] = {"whole": round(whole_s, 3), "scale_search": round(scale_s, 3), "factor": round(factor_s, 3),
                        "column_loop": round(whole_s - scale_s - factor_s, 3),
                        "column_loop_eager": round(eager_s - scale_s - factor_s, 3)}
    # one W8A8 linear as wide as Kimi-K3's o_proj input (12,288 columns, one matrix): the loop at its most
    # launch-bound, with per-row and per-group scales
    x1 = torch.randn(T, args.wide, device=dev, generator=g)
    h1, w1 = x1.t() @ x1, torch.randn(args.wide // 4, args.wide, device=dev, generator=g).bfloat16()
    del x1
    wide = {"per_row": lambda: quantize_weight(w1, int8, "gptq", hessian=h1, tokens=T),  # noqa: E731
            "per_group": lambda: quantize_weight(w1, int4, "gptq", hessian=h1, tokens=T, group_size=64)}  # noqa: E731
    same = [torch.equal(q, q_eager)]
    result["gptq_wide_s"] = {"shape": list(w1.shape)}
    for name, fn in wide.items():
        gptq.CUDA_GRAPHS = False
        eager_s, (q1_eager, _) = timed(fn, dev, r)
        gptq.CUDA_GRAPHS = True
        graphs_s, (q1, _) = timed(fn, dev, r)
        result["gptq_wide_s"][name] = {"eager": round(eager_s, 3), "graphs": round(graphs_s, 3)}
        same.append(torch.equal(q1, q1_eager))
    result["graphs_bit_identical"] = all(same)
    del q1, q1_eager, q_eager, wide

    w_hat = q.float() * scale

    def per_linear() -> list[float]:  # as the apply loop did: each linear's Hessian on the device, two reads each
        sums = []
        for i in range(E):
            wf, h = w[i].float(), hessian[i]
            diff = w_hat[i] - wf
            sums.append(float(((diff @ h) * diff).sum()) / float(((wf @ h) * wf).sum()))
        return sums

    per_linear_s, _ = timed(per_linear, dev, r)
    in_job_s, _ = timed(lambda: torch.stack([hessian_error(w[i], w_hat[i], hessian[i]) for i in range(E)]).tolist(),
                        dev, r)
    result["weight_error_s"] = {"per_linear_reads": round(per_linear_s, 3), "in_job_one_read": round(in_job_s, 3)}

    candidates = [torch.rand(D, device=dev, generator=g) + 0.5 for _ in range(8)]
    calls_s, _ = timed(lambda: [float(error_parts(w[0], [s], hessian[0], int4)[0, 0]) for s in candidates], dev, r)
    batched_s, _ = timed(lambda: error_parts(w[0], candidates, hessian[0], int4).tolist(), dev, r)
    torch.backends.cuda.matmul.allow_tf32 = True
    tf32_s, _ = timed(lambda: error_parts(w[0], candidates, hessian[0], int4).tolist(), dev, r)
    torch.backends.cuda.matmul.allow_tf32 = False
    result["smoothing_errors_s_per_reader"] = {"read_per_candidate": round(calls_s, 4),
                                               "one_read": round(batched_s, 4), "one_read_tf32": round(tf32_s, 4)}

    del q, scale
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    n = args.rank_experts
    parked = [torch.randn(D, D, device=dev) for _ in range(n)] + [torch.randn(OUT, OUT, device=dev) for _ in range(n)]
    gb = sum(t.numel() * 4 for t in parked) / 1e9
    first_s, hosts = timed(lambda: [to_host(t) for t in parked], dev, 1)
    del hosts
    again_s, hosts = timed(lambda: [to_host(t) for t in parked], dev, 1)
    back_pinned_s, _ = timed(lambda: [h.to(dev) for h in hosts], dev, 1)
    del hosts
    flat = sum(t.numel() for t in parked)

    def one_block() -> list[torch.Tensor]:  # one pinned allocation for all, sliced
        block = torch.empty(flat, pin_memory=dev.type == "cuda")
        views, at = [], 0
        for t in parked:
            views.append(block[at:at + t.numel()].view(t.shape).copy_(t, non_blocking=True))
            at += t.numel()
        return views

    one_block_s, hosts = timed(one_block, dev, 1)
    del hosts
    pageable_s, hosts = timed(lambda: [t.to("cpu") for t in parked], dev, 1)
    back_pageable_s, _ = timed(lambda: [h.to(dev) for h in hosts], dev, 1)
    result["park_s"] = {"gb": round(gb, 2), "pinned_first": round(first_s, 3), "pinned_cached": round(again_s, 3),
                        "pinned_back": round(back_pinned_s, 3), "pinned_one_block": round(one_block_s, 3), "pageable": round(pageable_s, 3),
                        "pageable_back": round(back_pageable_s, 3)}
    print_result(result)


if __name__ == "__main__":
    main()
