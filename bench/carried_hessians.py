"""How far the Hessians iter_smooth carries to GPTQ are from ones observed after smoothing, on the real model in bf16.

iter_smooth's first pass gathers the GPTQ entries' Hessians and rescales them with its smoothing (H <- D H D,
D = diag(1 / s)) instead of a pass after it. That is exact for the readers' own input in real arithmetic; the
forward computes with the smoothed 16-bit weights, whose rounding moves every later input a little. This runs the
shipped `kimi_linear_w4a8` practice on kimi-linear-mini (bf16, its own text calibration set) through the runner,
with a probe between iter_smooth and linear_quant that observes every carried Hessian again on the smoothed unit
and records the relative Frobenius distance ||H_carried - H_observed|| / ||H_observed||, per linear kind. The run
then goes on with the carried ones, as a real run does.

    python bench/carried_hessians.py [--records 8]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import ROOT, SHARED, machine, print_result  # noqa: E402
from msmodelslim.core.calib import load_calib_records  # noqa: E402
from msmodelslim.core.config import load_practice  # noqa: E402
from msmodelslim.core.requests import Observe  # noqa: E402
from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter  # noqa: E402
from msmodelslim.pipeline.answers import observe  # noqa: E402
from msmodelslim.pipeline.assembly import prepare_run  # noqa: E402
from msmodelslim.pipeline.layer_wise import LayerWiseRunner  # noqa: E402
from msmodelslim.processor.base import Processor  # noqa: E402
from msmodelslim.processor.catalog import registries  # noqa: E402

MINI = SHARED / "models" / "kimi-linear-mini"
PRACTICE = ROOT / "lab_practice" / "kimi_k3" / "kimi_linear_w4a8.yaml"


class Probe(Processor):
    """Bench-only step after iter_smooth: each carried Hessian against one observed now (it changes nothing, so the
    Hessians stay carried through it)."""

    carries_hessians = True

    def __init__(self) -> None:
        self.distances: dict[str, float] = {}

    def process_unit(self, ctx: Any) -> None:
        carried = {n: h for n, h in ctx.gathered.hessian.items()}
        if not carried:
            return
        observed = observe(ctx, Observe(hessian=tuple(carried))).hessian
        for name, h in carried.items():
            norm = float(observed[name].norm())
            if norm > 0:  # an expert no token reached has zeros on both sides
                self.distances[f"{ctx.unit.name}.{name}"] = float((h - observed[name]).norm()) / norm


def kind(name: str) -> str:
    if ".shared_experts." in name:
        return "shared_expert"
    if ".experts." in name:
        return "routed_expert_" + name.rsplit(".", 1)[1]
    return name.rsplit(".", 1)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=8)
    args = p.parse_args()
    start = time.perf_counter()
    practice = load_practice(PRACTICE, *registries())
    spec = practice.spec
    adapter = KimiK3ModelAdapter(MINI)
    try:
        records = load_calib_records(str(ROOT / "lab_calib" / spec.dataset), spec.default_text, args.records)
        samples, processors, _ = prepare_run(adapter, records, spec)
        probe = Probe()
        at = next(i for i, proc in enumerate(processors) if proc.name == "iter_smooth") + 1
        LayerWiseRunner(adapter, [*processors[:at], probe, *processors[at:]], [], background=False).run(samples)
    finally:
        adapter.close()
    by_kind: dict[str, list[float]] = {}
    for name, d in probe.distances.items():
        by_kind.setdefault(kind(name), []).append(d)
    table = {k: {"linears": len(v), "median": statistics.median(v), "max": max(v),
                 "over_1e-2": sum(d > 1e-2 for d in v)} for k, v in sorted(by_kind.items())}
    for k, row in table.items():
        print(f"{k:<24} {row['linears']:>5} median {row['median']:.2e} max {row['max']:.2e} "
              f"over 1e-2: {row['over_1e-2']}")
    print_result({"bench": "carried_hessians", "machine": machine(), "model": "kimi-linear-mini",
                  "practice": PRACTICE.name, "records": len(records), "seconds": round(time.perf_counter() - start, 1),
                  "max_relative_distance": max(probe.distances.values()), "by_kind": table})


if __name__ == "__main__":
    main()
