"""What fa3_quant costs on one full-size Kimi-K3 MLA layer (96 heads, q-LoRA 1536, kv_lora_rank 512, rope 64,
hidden 7168, output gate; the `layer` preset's sizes), per calibration sample, bfloat16 on one device.

Timed (ms per sample, after warm-up, mean of --reps): the model's own MLA forward; the absorbed forward through
identity placeholders; fa3_quant's calibration pass (absorbed forward + per-head recall windows on Q and K and the
min/max of V, the runner's `Observe.head_ranges` hook); the absorbed forward with int8 quantizers installed (what
later units calibrate on). Also the output error of the int8 attention against the own forward on the same input
(relative Frobenius), and the peak device memory of each.

Usage: python bench/fa3_mla.py --device cuda [--seq-len 1024 --reps 5]. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import MAKE_CHECKPOINT, machine, print_result  # noqa: E402
from msmodelslim.core.dist import DistContext  # noqa: E402
from msmodelslim.core.requests import Observe  # noqa: E402
from msmodelslim.model.base import Unit  # noqa: E402
from msmodelslim.model.kimi_k3 import fa3  # noqa: E402
from msmodelslim.model.kimi_k3.runtime_patches import PatchHandle  # noqa: E402
from msmodelslim.pipeline.answers import observe  # noqa: E402
from msmodelslim.processor.base import UnitContext
from msmodelslim.quant.attention import AttentionQuantSpec, head_scales, install_quantizers  # noqa: E402


def standin_mla(device: torch.device) -> torch.nn.Module:
    sys.path.insert(0, str(MAKE_CHECKPOINT.parent))
    import make_checkpoint

    pkg = make_checkpoint.load_remote_package(make_checkpoint.HERE)
    text = {**make_checkpoint.TEXT_COMMON, **make_checkpoint.PRESETS["layer"]["text_config"]}
    config = pkg.configuration_kimi_k3.KimiLinearConfig(**text)
    torch.manual_seed(0)
    with torch.device(device):
        attn = pkg.modeling_kimi_k3.KimiMLAAttention(config, layer_idx=0).to(torch.bfloat16).eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.02)
    attn.kv_a_layernorm.weight.data.fill_(1.0)
    attn.q_a_layernorm.weight.data.fill_(1.0)
    return attn


def timed(fn, device: torch.device, reps: int) -> tuple[float, float | None]:
    """(ms per call, peak device GB) after one warm-up call."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = 1000 * (time.perf_counter() - start) / reps
    peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
    return round(ms, 2), peak


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    attn = standin_mla(device)
    x = torch.randn(1, args.seq_len, attn.hidden_size, device=device, dtype=torch.bfloat16)
    result: dict = {"bench": "fa3_mla", "machine": machine(), "device": args.device, "seq_len": args.seq_len,
                    "heads": attn.num_heads, "kv_lora_rank": attn.kv_lora_rank}

    own = attn(x)
    result["own_ms"], result["own_peak_gb"] = timed(lambda: attn(x), device, args.reps)
    handle = PatchHandle()
    fa3.inject_fa3_placeholders(handle, attn, lambda _: True, returns_weights=False)
    result["absorbed_ms"], result["absorbed_peak_gb"] = timed(lambda: attn(x), device, args.reps)
    result["absorbed_vs_own_rel_err"] = float((attn(x).float() - own.float()).norm() / own.float().norm())

    points = {f"fa_{b}": (getattr(attn, f"fa_{b}").heads, getattr(attn, f"fa_{b}").ratio) for b in "qkv"}
    ctx = UnitContext(Unit("layers.0", "decoder", "", 0), attn, type("A", (), {"is_rank_local": lambda s, n: False})(),
                      DistContext(device=device), run_samples=lambda: attn(x))
    stats: dict = {}

    def calibrate() -> None:
        stats["s"] = observe(ctx, Observe(head_ranges=points))

    result["calibration_pass_ms"], result["calibration_peak_gb"] = timed(calibrate, device, args.reps)
    spec = AttentionQuantSpec("int8", "per_head")
    install_quantizers(attn, {b: (spec, head_scales(*stats["s"].head_ranges[b], spec)) for b in points})
    result["quantized_ms"], result["quantized_peak_gb"] = timed(lambda: attn(x), device, args.reps)
    result["int8_attention_rel_err"] = float((attn(x).float() - own.float()).norm() / own.float().norm())
    handle.undo()
    print_result(result)


if __name__ == "__main__":
    main()
