"""`msmodelslim analyze`: which linears a practice quantizes worst, without writing a quantized model.

The run is a quant run (same practice lookup, checks, devices and ranks, layer by layer) whose units are quantized
in memory and never saved: what it keeps is the quant report (core/report.py, pipeline/report.py). The linears are
ranked by a metric (msModelSlim's names, or the report's own):

    mse       -> error              relative output MSE on the calibration tokens (weight + activation rounding)
    impact                          the loss-aware score: the part of its unit output's relative error that
                                    falling back the linear's serving group removes (pipeline/impact.py), measured
                                    on the practice's spec.report_impact_tokens (default DEFAULT_IMPACT_TOKENS)
    kurtosis  -> act_kurtosis       of the input activations (msModelSlim reads these three off the inputs too)
    std       -> act_peak_ratio     max |x| / std of the input activations
    quantile  -> act_channel_ratio  max / median of the input channels' ranges (msModelSlim: int8 step / IQR)

Without `--quant_type` / `--config_path` (as upstream's analyze runs): a statistic (kurtosis, std, quantile, the
weight statistics) needs no quant scheme, so it is read off the float model's activations over every linear the
model type's W8A8 practice quantizes (its linear selection alone: no rotation, no smoothing, min/max weights); an
error metric needs one, and uses that W8A8 practice as it is. The summary says which.

`--patterns` restricts the ranking to linears whose checkpoint names match a glob; `--save_path FILE.yaml` writes
the top k as `disable_names`, which a practice's `spec.fallback` reads (`names_file`); `--report_path FILE.json`
keeps the whole report (a fallback's `report`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from msmodelslim.app.practice import choose_practice
from msmodelslim.app.quant import QuantArgs, check_request, run_quant_service
from msmodelslim.core.config import DEFAULT_IMPACT_TOKENS
from msmodelslim.core.report import ANALYZE_METRICS, DEFAULT_TOP_K, METRIC_ALIASES, REPORT_FILE, ranked, read_report
from msmodelslim.core.signals import sigterm_raises
from msmodelslim.core.torchrun import TorchrunRank
from msmodelslim.errors import UserError
from msmodelslim.model.registry import load_registry
from msmodelslim.processor.globs import matching

logger = logging.getLogger(__name__)

# Without a practice: the quant type whose practice quantizes every linear the serving engine can quantize, so that
# every one of them is ranked.
DEFAULT_QUANT_TYPE = "w8a8"
ERROR_METRICS = ("error", "impact", "weight_error", "act_error")  # the report's fields that need a quant scheme


@dataclass
class AnalyzeArgs:
    model_path: str
    model_type: str
    device: str = "npu"
    quant_type: str | None = None
    config_path: str | None = None
    trust_remote_code: bool = False
    tags: tuple[str, ...] = ()
    calibration_dataset: str | None = None  # replaces the practice's spec.dataset
    metrics: str = "mse"
    top_k: int = DEFAULT_TOP_K
    patterns: list[str] = field(default_factory=list)
    save_path: str | None = None  # the disable_names YAML
    report_path: str | None = None  # the whole report


@dataclass
class AnalyzeResult:
    metric: str  # the report's metric the ranking used
    top: list[tuple[str, float]]  # (checkpoint name, value), worst first
    considered: int  # linears ranked (after --patterns)
    report: dict[str, Any]
    basis: str  # what the values were measured with (the practice, or the float statistics' linear selection)


def _check_args(args: AnalyzeArgs) -> str:
    if args.metrics not in ANALYZE_METRICS:
        raise UserError(f"--metrics {args.metrics!r}: expected one of {', '.join(ANALYZE_METRICS)}")
    if args.top_k <= 0:
        raise UserError(f"--top_k {args.top_k}: must be a positive integer")
    for flag, path, suffixes in (("--save_path", args.save_path, (".yaml", ".yml")),
                                 ("--report_path", args.report_path, (".json",))):
        if path is None:
            continue
        target = Path(path)
        if target.suffix not in suffixes:
            raise UserError(f"{flag} {path}: expected a {' or '.join(suffixes)} file")
        if target.exists():
            raise UserError(f"{flag} {path}: exists; msmodelslim never overwrites a file it writes")
        if not target.parent.is_dir():
            raise UserError(f"{flag} {path}: no such folder {target.parent}")
    return METRIC_ALIASES.get(args.metrics, args.metrics)


def quantized_linears(plan: Any, trust_remote_code: bool) -> list[str]:
    """The checkpoint names of the linears the practice quantizes, from the model's skeleton (no weight read),
    after every check a run makes before compute."""
    from msmodelslim.pipeline.assembly import prepare_run

    adapter = plan.adapter_cls(plan.model_path, trust_remote_code=trust_remote_code)
    try:
        _, _, linears = prepare_run(adapter, plan.records[:1], plan.chosen.practice.spec)
        return sorted(linears.quantized())
    finally:
        adapter.close()


def analyze(args: AnalyzeArgs) -> AnalyzeResult:
    metric = _check_args(args)
    if TorchrunRank.from_environment() is not None:
        raise UserError("msmodelslim analyze runs its own ranks (--device npu:0,1,...), not under torchrun")
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="msmodelslim-analyze-") as tmp:
        args, basis = _with_practice(args, metric, Path(tmp))
        work_dir = Path(tmp) / "run"
        quant_args = QuantArgs(model_path=args.model_path, save_path=str(work_dir), model_type=args.model_type,
                               device=args.device, quant_type=args.quant_type, config_path=args.config_path,
                               trust_remote_code=args.trust_remote_code, tags=args.tags,
                               calibration_dataset=args.calibration_dataset)
        plan = check_request(quant_args)
        spec = plan.chosen.practice.spec
        if metric == "impact" and spec.report_impact_tokens is None:
            spec.report_impact_tokens = DEFAULT_IMPACT_TOKENS
        names = quantized_linears(plan, args.trust_remote_code)
        for glob in args.patterns:
            if not any(matching(name, [glob]) for name in names):
                raise UserError(f"--patterns {glob!r} matches none of the {len(names)} linears the practice "
                                f"quantizes (checkpoint names, e.g. {names[len(names) // 2]})")
        logger.info("analyze: %d quantized linears of %s with %s, ranked by %s", len(names), args.model_type,
                    plan.chosen.path, metric)
        work_dir.mkdir()
        run_quant_service(plan, quant_args, work_dir, report_only=True)
        report = read_report(work_dir / REPORT_FILE)
    linears = {n: e for n, e in report["linears"].items() if not args.patterns or matching(n, args.patterns)}
    top = ranked(linears, metric)[:args.top_k]
    if args.report_path:
        _write_new(Path(args.report_path), json.dumps(report, indent=1) + "\n")
    if args.save_path:
        header = (f"# msmodelslim analyze --metrics {args.metrics} --top_k {args.top_k}: the linears of "
                  f"{args.model_path} that {plan.chosen.path.name} quantizes worst.\n# A practice keeps them in "
                  f"higher precision with spec.fallback: [{{to: W8A8_DYNAMIC, names_file: "
                  f"{Path(args.save_path).name}}}]\n")
        body = yaml.safe_dump({"metric": metric, "disable_names": [name for name, _ in top]}, sort_keys=False)
        _write_new(Path(args.save_path), header + body)
    return AnalyzeResult(metric, top, len(linears), report, basis or f"practice {plan.chosen.path}")


def _with_practice(args: AnalyzeArgs, metric: str, tmp: Path) -> tuple[AnalyzeArgs, str | None]:
    """`args` as given when they name a practice; else with the model type's DEFAULT_QUANT_TYPE practice, as it is
    for an error metric, cut to its linear selection (min/max, nothing before it) for a statistic (module docstring),
    and a sentence saying so."""
    if args.quant_type is not None or args.config_path is not None:
        return args, None
    entry = load_registry().resolve(args.model_type)
    chosen = choose_practice(args.model_type, entry.group, DEFAULT_QUANT_TYPE, None, tags=args.tags)
    if metric in ERROR_METRICS:
        return (replace(args, quant_type=DEFAULT_QUANT_TYPE),
                f"no --quant_type: {metric} of {args.model_type}'s default practice {chosen.path}")
    practice = yaml.safe_load(chosen.path.read_text(encoding="utf-8"))
    selection = [step for step in practice["spec"]["process"] if step["type"] == "linear_quant"]
    for step in selection:
        step["qconfig"]["weight"]["method"] = "minmax"
    practice["spec"]["process"] = selection
    path = tmp / f"{chosen.path.stem}_statistics.yaml"
    path.write_text(yaml.safe_dump(practice, sort_keys=False), encoding="utf-8")
    return (replace(args, config_path=str(path)),
            f"no --quant_type: float statistics over the linears {chosen.path.name} quantizes")


def _write_new(path: Path, text: str) -> None:
    """Write `path` whole or not at all, and never over a file: the checks before the run found none, but another
    process may have written one since (a hard link of a temporary file is made only where no file is). Such a
    file stays; ours is kept beside it, and the error says where."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        tmp.write_text(text, encoding="utf-8")
        try:
            os.link(tmp, path)
        except FileExistsError:
            kept = path.with_name(f"{path.stem}.msmodelslim-{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
            os.link(tmp, kept)
            raise UserError(f"{path}: another process wrote it during the analysis; it is left as it is, and "
                            f"this analysis's file is {kept}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot write it ({exc.strerror})") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
