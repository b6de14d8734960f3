"""The quant report: every quantized linear's output error on the calibration tokens, its weight and activation
statistics (quant/sensitivity.py), from the forward the runner makes anyway: no calibration pass of its own.

Per unit, the report asks the runner for one more statistic on the forward of the quantized unit (the one that makes
the next unit's inputs; the last unit feeds nothing, so its forward runs for the report only when it holds a
quantized linear): the `quant_error` sums of its quantized linears (pipeline/statistics.py `QuantError`), over the
samples of the first `spec.report_tokens` calibration tokens of the global order (past them a calibration token
costs the report nothing), reduced over the data-parallel ranks by the runner; `finish_unit` makes each linear's
entry from them and from what linear_quant knew of its rounding (`QuantLinear.weight_error`). The entries are part
of a rank's resumable state. At the end every rank writes its part and rank 0 merges them into `quant_report.json`
and logs the worst linears.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch import nn

from msmodelslim.core.dist import DistContext
from msmodelslim.core.report import REPORT_FILE, REPORT_VERSION, ranked
from msmodelslim.core.requests import Observe
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.pipeline.impact import ImpactProbe
from msmodelslim.quant.modules import QuantLinear
from msmodelslim.quant.sensitivity import InputSums, report_entry, significant

logger = logging.getLogger(__name__)

LOGGED_WORST = 15  # msModelSlim's `analyze --top_k` default


class QuantReport:
    def __init__(self, adapter: ModelAdapter, dist: DistContext, source: dict[str, str], work_dir: Path,
                 tokens: int | None = None, impact: ImpactProbe | None = None) -> None:
        self.adapter = adapter
        self.impact = impact  # the loss-aware score's probe (pipeline/impact.py), when the practice asks for it
        self.tokens = tokens  # the calibration tokens observed (spec.report_tokens; None: all)
        self.dist = dist
        self.work_dir = work_dir  # the run's temporary output: the parts and the report go there
        self.source = source  # source.checkpoint.source_identity of the checkpoint: a fallback checks it
        self.entries: dict[str, dict[str, Any]] = {}  # checkpoint name -> entry, this rank's

    def request(self, module: nn.Module) -> Observe | None:
        """The statistic of the unit's quantized linears read off its forward (None: it has none)."""
        names = tuple(name for name, m in module.named_modules()
                      if isinstance(m, QuantLinear) and m.weight_error is not None)
        return Observe(quant_error=names, tokens=self.tokens) if names else None

    def finish_unit(self, unit: Unit, module: nn.Module, sums: dict[str, InputSums]) -> None:
        """One entry per quantized linear of the unit from its reduced sums (live name -> InputSums)."""
        names = {name: self.adapter.checkpoint_name(unit, name) for name in sums}
        for name, linear_sums in sums.items():
            linear = module.get_submodule(name)
            entry = report_entry(linear.scheme.name, linear.weight_error, linear_sums)
            self.entries[names[name]] = {"unit": unit.name, **entry}
            linear.weight_error = None
        if self.impact is not None and self.impact.impacts:  # the unit was probed (on every rank alike)
            absolute = {names[n]: (self.entries[names[n]]["error"] or 0.0) * (self.entries[names[n]]["output_energy"]
                                                                            or 0.0) for n in sums}
            replicated = {names[n] for n in sums if not self.adapter.is_rank_local(n)}
            for name, value in self.impact.shares(absolute, replicated).items():
                self.entries[name]["impact"] = significant(value)

    def resume_state(self) -> dict[str, Any]:
        return {"entries": dict(self.entries)}

    def restore_state(self, state: dict[str, Any]) -> None:
        self.entries = dict(state["entries"])

    def _part(self, rank: int) -> Path:
        return self.work_dir / f".report.rank{rank}.json"

    def finish_rank(self) -> None:
        self._part(self.dist.rank).write_text(json.dumps(self.entries), encoding="utf-8")

    def merge(self) -> dict[str, Any]:
        """Rank 0, every part on disk: the report file, its parts removed; the worst linears logged."""
        entries: dict[str, dict[str, Any]] = {}
        for rank in range(self.dist.world_size):
            part = self._part(rank)
            entries.update(json.loads(part.read_text(encoding="utf-8")))
            part.unlink()
        report = {"version": REPORT_VERSION, "source": self.source,
                  "expert_coverage": expert_coverage({n: e for n, e in entries.items()
                                                      if self.adapter.is_rank_local(n)},
                                                     self.adapter.expert_statistics),
                  "linears": {name: entries[name] for name in sorted(entries)}}
        (self.work_dir / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        log_worst(report["linears"])
        return report


def expert_coverage(experts: dict[str, dict[str, Any]], calibration: str = "routed") -> dict[str, Any] | None:
    """How many calibration tokens the routed experts' linears saw (min / median / max; their Hessians' counts where
    GPTQ had one, every calibration token, else the report's own), and those that saw fewer than their inputs: their
    Hessians are rank-deficient (GPTQ shrinks them toward the diagonal; none at all means min/max rounding for a
    weight no token tested). Logged as a warning naming them; None without experts. `calibration`: how the experts'
    statistics were taken (`ModelAdapter.calibrate_experts`: "routed", "all_tokens", "affinity" or "balanced"), said
    in it."""
    if not experts:
        return None
    seen = {n: e["tokens"] if e.get("hessian_tokens") is None else e["hessian_tokens"] for n, e in experts.items()}
    counts = sorted(seen.values())
    short = sorted(n for n, e in experts.items() if seen[n] < e["inputs"])
    unseen = [n for n in short if seen[n] == 0]
    if short:
        logger.warning("quant report: %d of %d routed-expert linears saw fewer calibration tokens than their inputs "
                       "(%d saw none): %s%s; more calibration data covers them", len(short), len(experts),
                       len(unseen), ", ".join(short[:8]), f" and {len(short) - 8} more" if len(short) > 8 else "")
    return {"calibration": calibration, "linears": len(experts), "tokens_min": counts[0], "tokens_median": counts[len(counts) // 2],
            "tokens_max": counts[-1], "below_inputs": short, "no_token": unseen}


def log_worst(linears: dict[str, dict[str, Any]], top: int = LOGGED_WORST) -> None:
    worst = ranked(linears)[:top]
    if not worst:
        return
    width = max(len(name) for name, _ in worst)
    lines = [f"  {name:<{width}}  {linears[name]['scheme']:<14} error {value:.3e} (weight "
             f"{linears[name]['weight_error']:.2e}, act {linears[name]['act_error']:.2e}, kurtosis "
             f"{linears[name]['weight_kurtosis']:.1f})" for name, value in worst]
    logger.info("quant report: the %d of %d quantized linears with the largest relative output error on the "
                "calibration tokens (%s):\n%s", len(worst), len(linears), REPORT_FILE, "\n".join(lines))

