"""Per-rank cost of one full-size Kimi-K3 MoE layer, as one rank of EP 8 sees it, with the shipped w4a8 practice.

The `layer` preset of make_checkpoint.py: hidden 7168, KDA 96 heads x 128 (full-rank gate), attention residuals,
a latent MoE (routed_expert_hidden_size 3584, with its norm), SiTU experts of 3072 x 3584, shared width 6144,
released values where public (docs/dev/facts/kimi_k3_in_vllm_0.33.md section 6). One rank of EP 8 holds
896 / 8 = 112 experts and, with top-16 routing spread evenly, sees 16 / 8 = 2 of each token's picks: the bench runs
112 experts with top-2 on one device, which gives the rank its expert work without the 7 other ranks (the
all-gather / all-reduce of EP are not timed: documented in the JSON).

Stages (seconds, from the runner's own statistics): load (MXFP4 decode), process (per processor), calibrate
(forwards), save. fla's Triton autotuning is timed on its own first: chunk_kda at this layer's shapes, first call
vs the mean of the next ones, in a fresh process.

Calibration at scale (`--tokens 65536,262144,1048576`): a generated set of long records (random words, cut to
`--max-seq-len`; one record in 8 is image+text from lab_calib/calibImages) of T tokens for each T, run after one
warm-up run, so the marginal cost of a calibration token (ms per token, per stage) is the least-squares slope over
the sizes.
`--baseline-tree DIR` runs the same sizes with another copy of the package (`git archive REV | tar -x -C DIR`)
in the same sitting, for a side-by-side ratio; `--micro-batch-tokens 8192,65536` runs each size at each micro-batch
size (the passes are bound by kernel launches per micro-batch, not by the device's arithmetic).

Usage: python bench/k3_layer.py --device cuda:0 [--samples 8 --max-seq-len 1024 --layers 93 --practice P.yaml]
       python bench/k3_layer.py --device cuda:0 --tokens 65536,262144 [--baseline-tree bench_out/baseline]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (  # noqa: E402
    BENCH_OUT,
    MAKE_CHECKPOINT,
    ROOT,
    line_fit,
    machine,
    package_tree,
    print_result,
    run_quant,
    shrunken_practice,
)
from msmodelslim.pipeline.spill import BUDGET_ENV  # noqa: E402

EP = 8
EXPERTS_PER_RANK = 896 // EP
TOPK_PER_RANK = 16 // EP
DEVICE_MEMORY_GB = 64  # the target: 8 devices of 64 GB

AUTOTUNE = r"""
import json, time, torch
from fla.ops.kda import chunk_kda
dev = torch.device("{device}")
B, T, H, D = 1, {tokens}, 96, 128
g = torch.Generator(device=dev).manual_seed(0)
def args():
    q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    gate = -torch.rand(B, T, H, D, device=dev, dtype=torch.float32, generator=g) * 0.1
    beta = torch.rand(B, T, H, device=dev, dtype=torch.float32, generator=g)
    return dict(q=q, k=k, v=v, g=gate, beta=beta, scale=D ** -0.5, use_qk_l2norm_in_kernel=True)
times = []
for _ in range(4):
    a = args(); torch.cuda.synchronize(dev); t0 = time.perf_counter()
    chunk_kda(**a); torch.cuda.synchronize(dev); times.append(time.perf_counter() - t0)
print(json.dumps({{"first_call_s": times[0], "warm_call_s": sum(times[1:]) / 3}}))
"""


def rank_layer_checkpoint(decoder_layers: int = 1) -> Path:
    """The `layer` preset as one rank of EP 8 holds it (112 experts, top-2), generated once into bench_out/; with
    `decoder_layers` > 1 that many such KDA layers, so the later ones show what a unit costs in a model's run (the
    first also pays what a run pays once: its kernels' first calls, the host memory its Hessians park in)."""
    model = BENCH_OUT / ("Kimi-K3-layer-ep8-rank" + (f"-{decoder_layers}" if decoder_layers > 1 else ""))
    if not (model / "model.safetensors.index.json").is_file():
        shutil.rmtree(model, ignore_errors=True)  # what a generation that failed left behind
        subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--preset", "layer", "--out", str(model),
                        "--set", f"text_config.num_experts={EXPERTS_PER_RANK}",
                        "--set", f"text_config.num_experts_per_token={TOPK_PER_RANK}",
                        "--set", f"text_config.num_hidden_layers={decoder_layers}",
                        "--set", f"text_config.linear_attn_config.kda_layers={list(range(1, decoder_layers + 1))}",
                        "--set", "text_config.linear_attn_config.full_attn_layers=[]"], check=True)
    return model


def fla_autotune(device: str, tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", AUTOTUNE.format(device=device, tokens=tokens)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def long_record_set(tokens: int, seq_len: int, images: bool = True) -> tuple[Path, int]:
    """A calibration set of about `tokens` tokens: records of random words longer than `seq_len` tokens (cut to
    it), with `images` one in 8 an image+text record of lab_calib/calibImages. Returns (folder, records)."""
    import json
    import random
    import shutil

    records = -(-tokens // seq_len)
    out = BENCH_OUT / f"calib_long_{records}x{seq_len}{'' if images else '_text'}"
    if (out / "index.jsonl").is_file():
        return out, records
    source = ROOT / "lab_calib" / "calibImages"
    pictures = [json.loads(line) for line in (source / "index.jsonl").read_text().splitlines() if '"image"' in line]
    shutil.copytree(source / "images", out / "images", dirs_exist_ok=True)
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    lines = []
    for i in range(records):
        text = " ".join(rng.choice(words) for _ in range(2 * seq_len))
        with_image = images and i % 8 == 7
        lines.append(json.dumps({**pictures[i // 8 % len(pictures)], "text": text} if with_image else {"text": text}))
    (out / "index.jsonl").write_text("\n".join(lines) + "\n")
    return out, records


def stage_peaks(run: dict) -> dict[str, float]:
    """The most device memory each stage held (GiB), the largest first."""
    peaks = run.get("peak_device_gb_by_stage", {})
    return {k: round(v, 2) for k, v in sorted(peaks.items(), key=lambda kv: -kv[1])}


def decoder_walls(run: dict) -> list[float]:
    """Each decoder unit's seconds in a run's statistics (the runner's `unit_seconds`; before it was recorded: the
    run's wall less its final flush of the resumable state, the vision, embedding and head units included)."""
    walls = [s for name, s in run.get("unit_seconds", {}).items() if name.startswith("layers.")]
    return walls or [run["runner_wall"] - run.get("resume_flush", 0.0)]


def decoder_wall(run: dict) -> float:
    """What each of a model's decoder units costs: the run's last one (with --decoder-layers > 1 a unit after the
    first, which pays once what a run's first unit pays: the Triton kernels' first calls and checks, the pinned host
    memory the Hessians park in)."""
    return decoder_walls(run)[-1]


def once_per_run(run: dict) -> float:
    """What a run pays once whatever its layers: its wall less its decoder units at `decoder_wall` each (the vision,
    embedding and head units, the first unit's surplus, the final flush of the resumable state, the publication)."""
    return run["runner_wall"] - decoder_wall(run) * len(decoder_walls(run))


def scale_runs(args: argparse.Namespace, model: Path) -> dict:
    """Runs at each calibration size T (after a warm-up), and the marginal cost per token between sizes; one
    variant per package tree and micro-batch size, side by side in the same sitting."""
    sizes = [int(t) for t in args.tokens.split(",")]
    trees = {"current": None, **({"baseline": args.baseline_tree} if args.baseline_tree else {})}
    batches = [int(b) for b in args.micro_batch_tokens.split(",")] if args.micro_batch_tokens else [None]
    variants = {(name if len(batches) == 1 else f"{name}@{batch}"): (tree, batch)
                for name, tree in trees.items() for batch in batches}
    out = BENCH_OUT / "Kimi-K3-layer-w4a8"

    def practice_for(t: int, batch: int | None) -> Path:
        folder, records = long_record_set(t, args.max_seq_len)
        return shrunken_practice(Path(args.practice), BENCH_OUT / f"k3_layer_practice_{t}_{batch}.yaml", records,
                                 args.max_seq_len, dataset=folder,
                                 spec={**({} if batch is None else {"micro_batch_tokens": batch}),
                                       **({} if args.resume_every is None else {"resume_every": args.resume_every}),
                                       **({} if args.report_tokens is None else {"report_tokens": args.report_tokens})})

    state_env = None if args.host_state_gib is None else {BUDGET_ENV: str(args.host_state_gib)}
    # Triton compilation and autotuning, not timed: fla keeps its choices on disk per kernel shape, and another
    # micro-batch size autotuned again (2.5 min inside a timed run on the H200), so each variant warms up
    warmup = sizes[0] if args.warmup_tokens is None else args.warmup_tokens
    for tree, batch in variants.values() if warmup else ():
        run_quant(model, out, args.device, practice_for(warmup, batch), tree=tree, extra_env=state_env)
    if args.profile:  # each calibration pass's operators, one run at the smallest size (printed, not in the JSON)
        prefix = BENCH_OUT / "k3_layer_profile"
        for batch in batches:
            run_quant(model, out, args.device, practice_for(sizes[0], batch),
                      extra_env={"MSMODELSLIM_PROFILE": str(prefix)})
            print(f"micro-batch {batch or 'default'}:\n" + Path(f"{prefix}.rank0").read_text(), flush=True)
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for t in sizes:
        for name, (tree, batch) in variants.items():
            run = run_quant(model, out, args.device, practice_for(t, batch), tree=tree, extra_env=state_env)["ranks"][0]
            run["tokens_requested"] = t
            results[name].append(run)
            # every stage as it comes, so a run cut by a call's limit still tells where its time went
            print(json.dumps({"variant": name, "tokens": t, "runner_wall": round(run["runner_wall"], 1),
                              "decoder_unit_s": round(decoder_wall(run), 2),
                              "decoder_units_s": [round(w, 2) for w in decoder_walls(run)],
                              "peak_device_gb": round(run.get("peak_device_gb", 0.0), 2),
                              "peak_rss_gb": round(run["peak_rss_gb"], 2),
                              "stages_s": {k: round(v, 2) for k, v in run.items() if isinstance(v, float)
                                           and k not in ("runner_wall", "peak_rss_gb", "peak_device_gb")},
                              "peak_device_gb_by_stage": stage_peaks(run)}),
                  flush=True)
    summary = {}
    for name, runs in results.items():
        per_size = [{"tokens": r["tokens_requested"], "layer_s": round(r["runner_wall"], 1),
                     "peak_device_gb": round(r.get("peak_device_gb", 0.0), 2), "peak_rss_gb": round(r["peak_rss_gb"], 2),
                     "passes": r.get("calibration_passes"), "peak_device_gb_by_stage": stage_peaks(r),
                     "stages_s": {k: round(v, 2) for k, v in r.items() if isinstance(v, float) and k not in
                                  ("runner_wall", "peak_rss_gb", "peak_device_gb")}} for r in runs]
        marginal, record = {}, {}
        if len(runs) > 1:  # least-squares lines over the sizes
            tokens = [r["tokens_requested"] for r in runs]
            marginal = {k: round(1000 * line_fit(tokens, [r.get(k, 0.0) for r in runs])[0], 4)
                        for k in runs[-1] if isinstance(runs[-1][k], float) and k not in ("peak_rss_gb", "peak_device_gb")}
            # as plan_records.json holds it: the decoder unit's line, and the line of the rest of the run
            decoder = [decoder_wall(r) for r in runs]
            per_token, fixed = line_fit(tokens, decoder)
            once_per_token, once = line_fit(tokens, [once_per_run(r) for r in runs])
            record = {"seconds_fixed_per_decoder_unit": round(fixed, 1),
                      "ms_per_token_per_decoder_unit": round(1000 * per_token, 4),
                      "seconds_once_per_run": round(once, 1), "ms_per_token_once_per_run": round(1000 * once_per_token, 4),
                      "measured_tokens": tokens, "measured_seconds": [round(r["runner_wall"], 1) for r in runs],
                      "measured_decoder_unit_seconds": [round(d, 2) for d in decoder]}
        largest, largest_decoder = runs[-1], decoder_wall(runs[-1])
        summary[name] = {"sizes": per_size, "marginal_ms_per_token": marginal, "plan_record": record,
                         "projected_model_hours_per_rank_at_largest": round(
                             (largest_decoder * args.layers + once_per_run(largest)) / 3600, 2)}
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--samples", type=int, default=8, help="calibration records (the practice's dataset)")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--layers", type=int, default=93, help="decoder layers for the projection (Kimi-K3: 69 KDA + 24 "
                                                             "MLA)")
    p.add_argument("--tokens", default=None, help="comma-separated calibration sizes T (tokens), each a generated "
                                                   "long-record set; replaces --samples")
    p.add_argument("--baseline-tree", default=None, help="with --tokens: also run another copy of the package")
    p.add_argument("--profile", action="store_true", help="with --tokens: print the operators of each calibration "
                                                           "pass of a run at the smallest size")
    p.add_argument("--micro-batch-tokens", default=None, help="with --tokens: comma-separated spec.micro_batch_tokens "
                                                               "values, each a variant (default: the practice's)")
    p.add_argument("--resume-every", type=int, default=None,
                   help="with --tokens: spec.resume_every (the resumable state of all T tokens, ~14 KiB each, must "
                        "fit the disk: 5 units' states at 1M tokens are 70 GiB)")
    p.add_argument("--report-tokens", type=int, default=None,
                   help="with --tokens: spec.report_tokens (the quant report observes the first 65,536 tokens by "
                        "default: a profile at 65k tokens with 1 shows a pass as it runs past them)")
    p.add_argument("--host-state-gib", type=float, default=None,
                   help="with --tokens: $MSMODELSLIM_HOST_STATE_GIB, the samples' state a rank keeps in memory before "
                        "it spills to disk (this layer's state is ~28 KiB per token: 4M tokens need ~110 GiB of "
                        "memory and disk together)")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="with --tokens: the untimed first run's size (default: the smallest T; 0: none, for a "
                        "machine on which an earlier call of the same variants has already compiled and autotuned)")
    p.add_argument("--decoder-layers", type=int, default=1,
                   help="KDA decoder layers in the checkpoint (each as one EP-8 rank holds it): with 2 the second shows "
                        "a unit's cost in a model's run, without what the run's first unit pays once")
    p.add_argument("--runs", type=int, default=2, help="quant runs; the first includes Triton compilation")
    p.add_argument("--practice", default=str(ROOT / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml"))
    p.add_argument("--skip-autotune", action="store_true", help="do not time fla's first call (88 s, measured)")
    p.add_argument("--report-overhead", action="store_true",
                   help="after the runs, warm runs without and with the quant report, alternating (3 each): the "
                        "report's share of the layer")
    args = p.parse_args()
    package_tree(args.baseline_tree)

    t0 = time.perf_counter()
    model = rank_layer_checkpoint(args.decoder_layers)
    generate_s = time.perf_counter() - t0
    if args.tokens:
        print_result({"bench": "k3_layer_scale", "machine": machine(), "device": args.device,
                      "practice": Path(args.practice).name, "max_seq_len": args.max_seq_len,
                      "assumed": {"ep": EP, "local_experts": EXPERTS_PER_RANK, "topk_per_rank": TOPK_PER_RANK,
                                  "layers_for_projection": args.layers,
                                  "calibration": "generated long records (one in 8 image+text), all T tokens "
                                                 "through this one rank's layer"},
                      "generate_checkpoint_s": round(generate_s, 1), **scale_runs(args, model)})
        return
    autotune = fla_autotune(args.device, args.max_seq_len) \
        if args.device.startswith("cuda") and not args.skip_autotune else {}

    practice = shrunken_practice(Path(args.practice), BENCH_OUT / "k3_layer_practice.yaml", args.samples,
                                 args.max_seq_len)
    runs = [run_quant(model, BENCH_OUT / "Kimi-K3-layer-w4a8", args.device, practice) for _ in range(args.runs)]
    warm = runs[-1]["ranks"][0]
    overhead = {}
    if args.report_overhead:  # alternating, so drift hits both sides alike
        out = BENCH_OUT / "Kimi-K3-layer-w4a8"
        sides: dict[str, list[dict]] = {"without": [], "with": []}
        for _ in range(3):
            for side, env in (("without", {"MSMODELSLIM_BENCH_NO_REPORT": "1"}), ("with", {})):
                sides[side].append(run_quant(model, out, args.device, practice, extra_env=env)["ranks"][0])

        def median(side: str, key: str) -> float:
            values = sorted(r.get(key, 0.0) for r in sides[side])
            return values[len(values) // 2]

        # the report's work: its statistic on the forward and its reduction (calibrate) and its entries (report)
        cost = median("with", "calibrate") + median("with", "report") - median("without", "calibrate")
        overhead = {"runner_wall_s": {side: [round(r["runner_wall"], 2) for r in runs_] for side, runs_ in sides.items()},
                    "calibrate_s": {side: [round(r["calibrate"], 3) for r in runs_] for side, runs_ in sides.items()},
                    "report_stage_s": [round(r.get("report", 0.0), 3) for r in sides["with"]],
                    "report_cost_s": round(cost, 3),
                    "report_cost_pct_of_layer": round(100 * cost / median("without", "runner_wall"), 2),
                    "wall_overhead_pct_median": round(100 * (median("with", "runner_wall")
                                                             / median("without", "runner_wall") - 1), 2)}
    meta = ("runner_wall", "world_size", "peak_rss_gb", "peak_device_gb", "peak_device_gb_by_stage",
            "ascend_ops_checked", "calibration_passes")
    stages = {k: round(v, 2) for k, v in warm.items() if k not in meta}
    layer_s = warm["runner_wall"]  # the vision (1 tiny block), embed and head (vocab 4096) units take ~no time
    result = {
        "bench": "k3_layer", "machine": machine(), "device": args.device, "practice": Path(args.practice).name,
        "assumed": {"ep": EP, "local_experts": EXPERTS_PER_RANK, "topk_per_rank": TOPK_PER_RANK,
                    "expert_shape": [3072, 3584], "hidden": 7168, "layers_for_projection": args.layers,
                    "calibration": f"{args.samples} records of the practice's dataset, max_seq_len {args.max_seq_len}",
                    "not_timed": "EP all-gather / all-reduce of the routed tokens (no other ranks here)",
                    "projection": "every decoder layer costs what this KDA + MoE layer costs; the vision, embed "
                                  "and head units are negligible next to 61 MoE layers"},
        "generate_checkpoint_s": round(generate_s, 1),
        "fla_autotune": autotune,
        "runs_wall_s": [round(r["wall_s"], 1) for r in runs],
        "warm_stages_s": stages,
        "warm_layer_unit_s": round(layer_s, 1),
        "peak_device_gb": round(warm.get("peak_device_gb", 0.0), 2),
        "peak_device_gb_by_stage": stage_peaks(warm),
        "peak_rss_gb": round(warm.get("peak_rss_gb", 0.0), 2),
        "projected_model_hours_per_rank": round(layer_s * args.layers / 3600, 2),
        "projected_peak_device_gb_per_rank": round(warm.get("peak_device_gb", 0.0), 2),
        "fits_64gb_device": warm.get("peak_device_gb", 0.0) < DEVICE_MEMORY_GB,
        "report_overhead": overhead,
    }
    print_result(result)


if __name__ == "__main__":
    main()
