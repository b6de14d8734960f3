"""Benchmark msmodelslim's pure-PyTorch chunked KDA against the kernels it replaces.

CPU (default): B=1, H=8, T=4096, K=V=128, fp32, Kimi-magnitude gates, the same inputs for every kernel (ours and
fla's loop timed in turn, best of --repeats; the slow fallback once):
  - transformers' torch fallback ``chunk_kimi_delta_attention`` (the path transformers takes without fla),
  - fla's ``naive_recurrent_kda`` (plain torch reference loop),
  - ours (``msmodelslim.ops.kda.chunk_kda``).
  Peak memory of ours is measured per T in fresh subprocesses (max RSS growth) to show it grows O(T).
CUDA (``--device cuda``): B=8, H=32, T=4096, K=V=128, bf16; ours vs fla's Triton ``chunk_kda``
  (``cuda_ratio_to_fla_triton`` = our time / fla time, median of several synchronised runs after warm-up).

Prints one JSON line last. Usage: ``python bench/kda.py [--device cuda] [--T 4096] [--fallback-T 4096]``.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msmodelslim.ops.kda import chunk_kda, kda_gate, l2norm  # noqa: E402

logger = logging.getLogger("bench.kda")
FLA_TOL = 0.005  # fla's own test tolerance (relative RMS error), bf16/fp16 vs fp32


def make_inputs(B: int, H: int, T: int, K: int, V: int, device: str, dtype: torch.dtype, seed: int = 0):
    """Kimi-magnitude inputs: A_log ~ log U(1, 16), raw gate ~ 3*N(0,1) + dt_bias -> per-step log-decay to ~-100s."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(3 * torch.randn(B, T, H, K, generator=gen), A_log, dt_bias)
    beta = torch.rand(B, T, H, generator=gen)
    return [x.to(device) for x in (q, k, v)], g.to(device), beta.to(device), dtype


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def timed(fn, repeats: int, warmup: int, sync=None) -> tuple[float, object, float]:
    """Median wall time, the last result, and the median process CPU time (robust to other load on a shared host)."""
    result = None
    for _ in range(warmup):
        result = fn()
    times, cpu = [], []
    for _ in range(repeats):
        if sync:
            sync()
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), result, statistics.median(cpu)


def timed_interleaved(fns, repeats: int) -> list[tuple[float, object, float]]:
    """Best-of-`repeats` wall time, the last result and the matching CPU time of each function, the functions run in
    turn (after one warm-up call each) so that load from other jobs on a shared host hits them alike."""
    results = [fn() for fn in fns]
    best = [(float("inf"), 0.0)] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            results[i] = fn()
            t = (time.perf_counter() - t0, time.process_time() - c0)
            best[i] = min(best[i], t)
    return [(t, r, c) for (t, c), r in zip(best, results)]


def ours(q, k, v, g, beta, chunk_size=None):  # chunk_size None: the kernel's default for the device
    return chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)


def _proc_status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_mem_child(T: int, B: int, H: int, K: int, V: int, chunk_size: int | None) -> None:
    """Run ours once at length T; print the peak-RSS growth (MB) over the resident inputs (Linux, glibc: freed heap
    is trimmed and the high-water mark reset through /proc/self/clear_refs before the run)."""
    (q, k, v), g, beta, _ = make_inputs(B, H, T, K, V, "cpu", torch.float32)
    with torch.inference_mode():
        ours(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], chunk_size)  # first-call allocations
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so reused free memory cannot hide growth
    Path("/proc/self/clear_refs").write_text("5")
    base = _proc_status_kb("VmRSS")
    with torch.inference_mode():
        ours(q, k, v, g, beta, chunk_size)
    peak = _proc_status_kb("VmHWM")
    print(json.dumps({"T": T, "peak_mem_mb": round((peak - base) / 1024, 1)}))


def cpu_bench(args) -> dict:
    from fla.ops.kda.naive import naive_recurrent_kda
    from transformers.models.kimi_linear import modeling_kimi_linear as transformers_kimi

    transformers_fallback = inspect.unwrap(transformers_kimi.chunk_kimi_delta_attention)  # the torch path under the fla wrapper
    B, H, T, K, V = 1, 8, args.T, 128, 128
    (q, k, v), g, beta, _ = make_inputs(B, H, T, K, V, "cpu", torch.float32)
    res: dict = {"device": "cpu", "threads": torch.get_num_threads(), "B": B, "H": H, "T": T, "K": K, "V": V,
                 "dtype": "float32", "chunk_size": args.chunk_size}
    with torch.inference_mode():
        qn, kn = l2norm(q), l2norm(k)
        (t_ours, (o, s), c_ours), (t_naive, (o_naive, s_naive), c_naive) = timed_interleaved(
            [lambda: ours(q, k, v, g, beta, args.chunk_size),
             lambda: naive_recurrent_kda(qn, kn, v, g, beta, output_final_state=True)], repeats=args.repeats)
        Tf = min(args.fallback_T, T)
        t_ours_f, c_ours_f = t_ours, c_ours
        if Tf != T:
            cut = [x[:, :Tf] for x in (q, k, v, g, beta)]
            t_ours_f, _, c_ours_f = timed(lambda: ours(*cut, args.chunk_size), repeats=args.repeats, warmup=1)
        t_fb, (o_fb, s_fb), c_fb = timed(
            lambda: transformers_fallback(q[:, :Tf], k[:, :Tf], v[:, :Tf], g[:, :Tf], beta[:, :Tf], output_final_state=True,
                                use_qk_l2norm_in_kernel=True), repeats=1, warmup=0)
    errs = {
        "out_vs_fla_naive": rel_rms(o, o_naive),
        "state_vs_fla_naive": rel_rms(s, s_naive),
        "out_vs_transformers_fallback": rel_rms(o[:, :Tf], o_fb),
    }
    if Tf == T:
        errs["state_vs_transformers_fallback"] = rel_rms(s, s_fb)
    mem = {}
    for Tm in args.mem_T:
        extra = ["--chunk-size", str(args.chunk_size)] if args.chunk_size else []
        out = subprocess.run([sys.executable, __file__, "--_mem-child", str(Tm), *extra], capture_output=True, text=True,
                             check=True)
        mem[str(Tm)] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mem_mb"]
    res.update({
        "ours_ms": round(t_ours * 1e3, 1),
        "fla_naive_recurrent_ms": round(t_naive * 1e3, 1),
        "transformers_fallback_T": Tf,
        "transformers_fallback_ms": round(t_fb * 1e3, 1),
        "ours_ms_at_fallback_T": round(t_ours_f * 1e3, 1),
        "cpu_speedup_vs_transformers_fallback": round(t_fb / t_ours_f, 2),
        "cpu_speedup_vs_fla_naive_recurrent": round(t_naive / t_ours, 2),
        "cpu_time_speedup_vs_transformers_fallback": round(c_fb / c_ours_f, 2),
        "cpu_time_speedup_vs_fla_naive_recurrent": round(c_naive / c_ours, 2),
        "load_average_1min": round(os.getloadavg()[0], 1),
        "peak_mem_mb": mem.get(str(T)),
        "peak_mem_mb_by_T": mem,
        "rel_rms_errors": {key: float(f"{val:.3g}") for key, val in errs.items()},
        "max_rel_err": float(f"{max(errs.values()):.3g}"),
    })
    return res


MATMUL_OPS = {"aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::mm", "aten::addmm", "aten::matmul",
              "aten::linalg_solve_triangular"}


def cuda_time_split(run, sync) -> dict:
    """Where our CUDA time goes: matmuls vs the rest (elementwise passes, copies, reductions), from one profiled
    call. For the rest it also counts the elements written (the largest operand of each op) and sets them against
    the rate of a plain contiguous fp32 multiply on the same GPU: ``elementwise_floor_ms`` is the time those passes
    would take even at that rate, i.e. the bound of an unfused (one kernel per op) implementation."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU],
                                         record_shapes=True) as prof:
        run()
        sync()
    matmul_us = rest_us = rest_elems = 0.0
    ops = 0
    for ev in prof.key_averages(group_by_input_shape=True):
        us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if not ev.key.startswith("aten::") or us <= 0:
            continue
        ops += ev.count
        if ev.key in MATMUL_OPS:
            matmul_us += us
        else:
            rest_us += us
            rest_elems += ev.count * max((math.prod(shape) for shape in ev.input_shapes if shape), default=0)
    x, y = torch.rand(2, 1 << 27, device="cuda").unbind()
    z = torch.empty_like(x)
    t_mul, _, _ = timed(lambda: torch.mul(x, y, out=z), repeats=10, warmup=3, sync=sync)
    rate = x.numel() / t_mul
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), file=sys.stderr)
    return {"matmul_ms": round(matmul_us / 1e3, 2), "other_ms": round(rest_us / 1e3, 2), "aten_ops": ops,
            "other_gelems": round(rest_elems / 1e9, 2), "other_gelem_per_s": round(rest_elems / rest_us / 1e3, 1),
            "contiguous_mul_gelem_per_s": round(rate / 1e9, 1),
            "elementwise_floor_ms": round(rest_elems / rate * 1e3, 2)}


def cuda_bench(args) -> dict:
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    B, H, T, K, V = 8, 32, args.T, 128, 128
    (q, k, v), g, beta, _ = make_inputs(B, H, T, K, V, "cuda", torch.bfloat16)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    beta = beta.to(torch.bfloat16)
    h0 = torch.zeros(B, H, K, V, device="cuda", dtype=torch.float32)
    sync = torch.cuda.synchronize

    def fla_run():
        return fla_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)

    def ours_run():
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         chunk_size=args.chunk_size)

    with torch.inference_mode():
        t_fla, (o_fla, s_fla), _ = timed(fla_run, repeats=args.repeats, warmup=3, sync=sync)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t_ours, (o, s), _ = timed(ours_run, repeats=args.repeats, warmup=2, sync=sync)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    profile = cuda_time_split(ours_run, sync) if args.profile else None
    errs = {"out_vs_fla_triton": rel_rms(o, o_fla), "state_vs_fla_triton": rel_rms(s, s_fla)}
    return {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "B": B, "H": H, "T": T, "K": K, "V": V,
        "dtype": "bfloat16", "chunk_size": args.chunk_size, "ours_ms": round(t_ours * 1e3, 2), "fla_triton_ms": round(t_fla * 1e3, 2),
        "cuda_ratio_to_fla_triton": round(t_ours / t_fla, 2), "peak_mem_mb": round(peak, 1),
        "rel_rms_errors": {key: float(f"{val:.3g}") for key, val in errs.items()},
        "max_rel_err": float(f"{max(errs.values()):.3g}"), "tolerance": FLA_TOL,
        "within_tolerance": max(errs.values()) <= FLA_TOL,
        **({"profile": profile} if profile else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--fallback-T", type=int, default=4096,
                        help="sequence length for transformers' fallback (it materialises [B,H,N,64,64,K])")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="cuda: split our time into matmuls and other ops, with the floor of the unfused passes")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--chunk-size", type=int, default=None, help="our chunk size (default: the device default)")
    parser.add_argument("--mem-T", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--_mem-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args._mem_child is not None:
        peak_mem_child(args._mem_child, 1, 8, 128, 128, args.chunk_size)
        return
    res = cuda_bench(args) if args.device == "cuda" else cpu_bench(args)
    res.update({"host": platform.node(), "cpu_count": os.cpu_count(), "command": " ".join(sys.argv)})
    print(json.dumps(res))


if __name__ == "__main__":
    main()
