"""Weight quantization quality and speed: ssz vs min/max scales, and the QuantLinear forward.

- Quality on REAL weights: the routed-expert weights of ../shared/models/kimi-linear-mini (MXFP4 decoded) and its
  attention projections; relative weight MSE ||W - W_q||^2 / ||W||^2 of int4 and int8 per-channel, min/max vs ssz.
- Speed on a Kimi-K3-sized expert matrix (--rows 3072 --cols 7168): seconds per `ssz_scale_search` (50 iters)
  and per `QuantLinear.from_linear`; QuantLinear forward (W4A8) tokens/s vs the float nn.Linear on --tokens.

Usage: python bench/quant.py [--device cuda] [--rows 3072 --cols 7168 --tokens 2048 --repeats 3]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from msmodelslim.quant import QuantLinear, quantize_symmetric, ssz_scale_search  # noqa: E402
from msmodelslim.quant.functional import quant_mse  # noqa: E402
from msmodelslim.source.checkpoint import open_checkpoint  # noqa: E402

logger = logging.getLogger("bench.quant")
MODEL = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "kimi-linear-mini"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def quality(device: torch.device, max_tensors: int) -> dict[str, float]:
    """Mean relative MSE over real weights for int4/int8 x minmax/ssz, and ssz's gain over minmax."""
    reader = open_checkpoint(MODEL)
    names = [n for n in reader.keys() if n.endswith(("w1.weight", "w2.weight", "w3.weight"))][:max_tensors]
    names += [n for n in reader.keys() if n.endswith(("self_attn.q_proj.weight", "self_attn.o_proj.weight"))]
    out: dict[str, list[float]] = {}
    for name in names:
        w = reader.get(name, device).float()
        norm = float((w.double() ** 2).sum())
        for bits in (4, 8):
            _, s_mm = quantize_symmetric(w, bits)
            s_ssz = ssz_scale_search(w, bits)
            out.setdefault(f"int{bits}_minmax_rel_mse", []).append(float(quant_mse(w, s_mm, bits).sum()) / norm)
            out.setdefault(f"int{bits}_ssz_rel_mse", []).append(float(quant_mse(w, s_ssz, bits).sum()) / norm)
    res = {k: statistics.mean(v) for k, v in out.items()}
    for bits in (4, 8):
        res[f"int{bits}_ssz_mse_reduction_pct"] = 100 * (1 - res[f"int{bits}_ssz_rel_mse"] / res[f"int{bits}_minmax_rel_mse"])
    res["tensors"] = len(names)
    return res


def speed(device: torch.device, rows: int, cols: int, tokens: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(cols, rows, bias=False, device=device, dtype=torch.bfloat16)
    ssz_s = _median_seconds(lambda: ssz_scale_search(linear.weight, 4), device, repeats)
    build_s = _median_seconds(lambda: QuantLinear.from_linear(linear, "W4A8_DYNAMIC"), device, repeats)
    ql = QuantLinear.from_linear(linear, "W4A8_DYNAMIC")
    x = torch.randn(tokens, cols, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        q_s = _median_seconds(lambda: ql(x), device, repeats)
        f_s = _median_seconds(lambda: linear(x), device, repeats)
    return {"ssz_seconds": ssz_s, "from_linear_seconds": build_s, "quant_forward_tokens_per_s": tokens / q_s,
            "float_forward_tokens_per_s": tokens / f_s, "quant_forward_slowdown": q_s / f_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=3072)
    p.add_argument("--cols", type=int, default=7168)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tensors", type=int, default=24, help="real expert matrices for the quality part")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device(args.device)
    if device.type == "npu":
        import torch_npu  # noqa: F401
    result = {"bench": "quant", "device": str(device), "shape": [args.rows, args.cols]}
    result.update(quality(device, args.max_tensors))
    result.update(speed(device, args.rows, args.cols, args.tokens, args.repeats))
    logger.info("%s", result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
