"""What a calibration token costs the runner on the CPU, against a plain layer-wise forward (issue 50's CPU target: 2).

kimi-linear-mini (../shared/models, a real trained Kimi-Linear) with its shipped `kimi_linear_w4a8` practice (GPTQ,
the smoothing search, the quant report) on generated text sets of T1 and T2 tokens (records of `--max-seq-len`
random words, bench/k3_layer.py's generator). For each size: the runner's wall time of a `msmodelslim quant` run
(its own statistics), and the seconds of a plain forward of the same micro-batches through every unit, layer by
layer, with nothing observed (what `msmodelslim eval` does twice per token: original and quantized). The marginal
cost per token is the least-squares slope over the sizes; the target is runner <= 2 x forward (issue 31 asked for 3).

This sandbox slows down after minutes of full load: a 40,960-token run took 39.9 s when it ran first and 49-50 s
when it ran third, in each of three benches. A one-way sweep therefore tilts the slope by the order of the sizes,
so the sizes run there and back (ascending, then descending): a steady drift then adds about the same to every
size's mean and leaves the slope alone. `--one-way` runs each size once.

    python bench/calib_cost.py [--tokens 4096,16384 --max-seq-len 512 --report-tokens 4096 --search-tokens 4096
                                --host-state-gib 0 --one-way --tree DIR --resume-every 1,2]
`--tree DIR` runs the runner of another copy of the package (`git archive` of an older commit); the plain forward
is this tree's either way. `--resume-every 1,2` runs the runner once per spec.resume_every value at each size, one
after the other, and reports each one's slope and its resumable state's share (issue 31's 5 % target).
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (  # noqa: E402
    BENCH_OUT,
    ROOT,
    SHARED,
    line_fit,
    machine,
    package_tree,
    print_result,
    run_quant,
    shrunken_practice,
)
from bench.k3_layer import long_record_set  # noqa: E402
from msmodelslim.core.calib import load_calib_records  # noqa: E402
from msmodelslim.core.config import DEFAULT_MICRO_BATCH_TOKENS  # noqa: E402
from msmodelslim.core.memory import heap_for_temporaries, return_freed_tensors_to_os  # noqa: E402
from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter  # noqa: E402
from msmodelslim.pipeline.assembly import micro_batches  # noqa: E402
from msmodelslim.pipeline.spill import BUDGET_ENV  # noqa: E402

MINI = SHARED / "models" / "kimi-linear-mini"
PRACTICE = ROOT / "lab_practice" / "kimi_k3" / "kimi_linear_w4a8.yaml"


def plain_forward_s(folder: Path, records: int, max_seq_len: int) -> float:
    """Seconds of one forward of every calibration micro-batch through every unit, unit after unit (loading and
    freeing the units not counted)."""
    return_freed_tensors_to_os()  # the runner's allocator settings: both sides run under the same
    adapter = KimiK3ModelAdapter(MINI)
    try:
        samples = micro_batches(adapter.prepare_samples(load_calib_records(str(folder), "", records),
                                                        max_seq_len=max_seq_len), DEFAULT_MICRO_BATCH_TOKENS)
        device, seconds = torch.device("cpu"), 0.0
        for unit in adapter.units():
            module = adapter.load_unit(unit, device)
            t0 = time.perf_counter()
            with torch.no_grad(), heap_for_temporaries():
                samples = [adapter.forward_unit(unit, module, s) for s in samples]
            seconds += time.perf_counter() - t0
            adapter.free_unit(unit, module)
        return seconds
    finally:
        adapter.close()


def plain_forward_in_child(folder: Path, records: int, max_seq_len: int) -> float:
    """`plain_forward_s` in a process of its own, as the runner runs in one. Run here, its forward made every later
    runner process of the bench 2-9 s slower at 40,960 tokens (all of it in the first calibration pass), although
    this process sat idle meanwhile: the cause is not known, the isolation removes it."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.calib_cost import plain_forward_s; "
            f"from pathlib import Path; print(plain_forward_s(Path({str(folder)!r}), {records}, {max_seq_len}))")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1])


def slope_ms(tokens: list[int], seconds: list[float]) -> float:
    """Milliseconds per token: the least-squares slope of seconds over tokens."""
    return 1000 * line_fit(tokens, seconds)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--calibrate-all-experts", action="store_true",
                   help="the practice with spec.calibrate_all_experts: every routed expert computes on every token")
    p.add_argument("--report-tokens", type=int, default=None,
                   help="spec.report_tokens (default the practice's, 65,536): below the smaller size, the marginal "
                        "cost is that of a token past the report's cap")
    p.add_argument("--search-tokens", type=int, default=None,
                   help="iter_smooth.search_tokens (default the practice's, 65,536): below the smaller size, the "
                        "marginal cost is that of a token past the search's sample")
    p.add_argument("--host-state-gib", type=float, default=None,
                   help="$MSMODELSLIM_HOST_STATE_GIB for the runner (0: every micro-batch's state spilled to disk)")
    p.add_argument("--resume-every", default=None,
                   help="comma-separated spec.resume_every values, each a variant run beside the others at each size "
                        "(default: the practice's)")
    p.add_argument("--one-way", action="store_true", help="each size once, in the given order (half the time)")
    p.add_argument("--tree", default=None, help="run the runner of this copy of the package")
    args = p.parse_args()
    package_tree(args.tree)
    sizes = [int(t) for t in args.tokens.split(",")]
    if len(set(sizes)) < 2:  # the cost of a token is the slope between sizes
        p.error(f"--tokens: two or more different sizes are needed for a cost per token, got {args.tokens!r}")
    variants = [None] if args.resume_every is None else [int(v) for v in args.resume_every.split(",")]
    rows: dict[int | None, list[dict]] = {v: [] for v in variants}
    forwards: list[tuple[int, float]] = []
    for tokens in sizes if args.one_way else [*sizes, *reversed(sizes)]:
        folder, records = long_record_set(tokens, args.max_seq_len, images=False)
        for every in variants:  # side by side at each size, so this machine's drift hits them alike
            spec = {"calibrate_all_experts": True} if args.calibrate_all_experts else {}
            if args.report_tokens is not None:
                spec["report_tokens"] = args.report_tokens
            if every is not None:
                spec["resume_every"] = every
            practice = shrunken_practice(PRACTICE, BENCH_OUT / f"calib_cost_{tokens}.yaml", records,
                                         args.max_seq_len, dataset=folder, spec=spec)
            if args.search_tokens is not None:
                data = yaml.safe_load(practice.read_text())
                next(step for step in data["spec"]["process"] if step["type"] == "iter_smooth")["search_tokens"] = \
                    args.search_tokens
                practice.write_text(yaml.safe_dump(data, sort_keys=False))
            env = {} if args.host_state_gib is None else {BUDGET_ENV: str(args.host_state_gib)}
            run = run_quant(MINI, BENCH_OUT / "calib_cost_out", "cpu", practice, model_type="Kimi-Linear",
                            extra_env=env, tree=args.tree)["ranks"][0]
            rows[every].append({"tokens": tokens, "runner_s": round(run["runner_wall"], 2),
                                "stages_s": {k: round(v, 2) for k, v in run.items() if isinstance(v, float)
                                             and k not in ("runner_wall", "peak_rss_gb")},
                                "passes": run.get("calibration_passes")})
            print({"resume_every": every, **rows[every][-1]}, flush=True)
        forwards.append((tokens, plain_forward_in_child(folder, records, args.max_seq_len)))
        print({"tokens": tokens, "forward_s": round(forwards[-1][1], 3)}, flush=True)
    forward_ms = slope_ms([t for t, _ in forwards], [s for _, s in forwards])

    def summary(runs: list[dict]) -> dict:
        tokens = [r["tokens"] for r in runs]
        runner_ms = slope_ms(tokens, [r["runner_s"] for r in runs])
        stage_ms = {k: round(slope_ms(tokens, [r["stages_s"].get(k, 0.0) for r in runs]), 4)
                    for k in runs[0]["stages_s"]}
        return {"sizes": runs, "runner_marginal_ms_per_token": round(runner_ms, 4),
                "ratio": round(runner_ms / forward_ms, 2) if forward_ms > 0 else None,
                "stage_marginal_ms_per_token": stage_ms,
                "resume_state_pct_of_runner": round(100 * stage_ms.get("resume_state", 0.0) / runner_ms, 1)
                if runner_ms > 0 else None}

    result = {"bench": "calib_cost", "machine": machine(), "model": "kimi-linear-mini",
              "practice": PRACTICE.name, "calibrate_all_experts": args.calibrate_all_experts,
              "report_tokens": args.report_tokens, "search_tokens": args.search_tokens,
              "host_state_gib": args.host_state_gib, "tree": args.tree,
              "max_seq_len": args.max_seq_len, "order": "one way" if args.one_way else "there and back",
              "forward_sizes_s": [{"tokens": t, "forward_s": round(s, 3)} for t, s in forwards],
              "forward_marginal_ms_per_token": round(forward_ms, 4), "target_ratio": 2}
    if args.resume_every is None:
        result.update(summary(rows[None]))
    else:
        result["by_resume_every"] = {str(v): summary(rows[v]) for v in variants}
    print_result(result)


if __name__ == "__main__":
    main()
