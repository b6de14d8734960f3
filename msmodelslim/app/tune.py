"""`msmodelslim tune`: quantize, measure, fall back the worst linears, quantize again, until the accuracy holds.

msModelSlim's acceptance loop as one command. Round 0 quantizes with the practice; each round evaluates the output
against the original (`msmodelslim eval` on `--dataset`) and, while the relative perplexity increase is above
`--target_ppl_delta` percent (or the KL divergence from the original's next-token distribution above `--target_kl`
nats per token), moves the linears worst by `--metric` in that round's quant_report.json one step up (`impact`,
the default: the loss-aware score, pipeline/impact.py, which each round then measures on the practice's
`spec.report_impact_tokens`, else DEFAULT_IMPACT_TOKENS; or `error`, the linear's own relative output error): a 4-bit scheme to W8A8 (W8A8_DYNAMIC, or W8A8_MXFP8 for MX schemes), an 8-bit one to FLOAT. A member of
a fused serving layer moves its whole group, and at most `--step` percent of the quantized linears move per round
(processor/fallback.py `worst_within`). Each round's practice is the original with an explicit `spec.fallback`, so it is
self-contained; it names the fallen-back linears as processor/fallback.py `with_groups` does (a layer's routed
experts as one glob), so that it stays a few KiB on a model of Kimi-K3's size (spelled out, a tenth of its ~250k
linears passed the 1 MiB practice limit). The round that meets the target (or, with `--max_rounds` spent, the best
one) is published at `--save_path` with that practice beside it. Everything `tune` takes is checked before round 0
(the quant run's checks, the evaluation text long enough for its windows); the output is locked for the whole tune.
Rounds are built in `.<name>.tune/` beside the output, removed at the end, on a failure and on SIGINT / SIGTERM: an
interrupted tune starts over (it has no `--resume`, and its rounds keep no resumable state).

Every round quantizes the whole model again: the units after the first changed one see other inputs, and a round
resumed from a kept state would need every unit's calibration state kept (hidden states of all tokens per unit).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, get_args

import yaml

from msmodelslim.app.quant import NAME_MAX, QuantArgs, check_request, output_lock, quant
from msmodelslim.core.config import DEFAULT_IMPACT_TOKENS
from msmodelslim.core.device import parse_device
from msmodelslim.core.report import REPORT_FILE, ReportMetric, ranked, read_report
from msmodelslim.core.signals import sigterm_raises
from msmodelslim.errors import UserError
from msmodelslim.eval.perplexity import check_eval_args, eval_windows
from msmodelslim.processor.fallback import serving_groups, with_groups, worst_within
from msmodelslim.quant.modules import SCHEMES

logger = logging.getLogger(__name__)


@dataclass
class TuneArgs:
    model_path: str
    save_path: str
    model_type: str
    dataset: str
    target_ppl_delta: float | None = None  # percent; this or target_kl
    target_kl: float | None = None  # nats per predicted token
    metric: str = "impact"  # what ranks the linears to fall back (a quant report field)
    device: str = "npu"
    quant_type: str | None = None
    config_path: str | None = None
    trust_remote_code: bool = False
    tags: tuple[str, ...] = ()
    calibration_dataset: str | None = None  # replaces the practice's spec.dataset
    target: str | None = None  # the serving target (replaces the practice's spec.target)
    max_rounds: int = 4  # quantizations, the first included
    step: float = 10.0  # percent of the quantized linears moved up per round
    seq_len: int = 512
    max_windows: int | None = 32


@dataclass
class Round:
    index: int
    fallback: dict[str, str]  # checkpoint name -> the scheme it was moved to
    ppl_orig: float
    ppl_quant: float
    delta_pct: float
    output: Path
    kl: float | None = None  # with --target_kl (the original forwarded beside every round)
    kl_se: float | None = None

    def measure(self, args: TuneArgs) -> float:
        """What the target bounds: the perplexity delta (percent) or the KL."""
        return self.delta_pct if args.target_kl is None else float(self.kl)

    def meets(self, args: TuneArgs) -> bool:
        return self.measure(args) <= (args.target_ppl_delta if args.target_kl is None else args.target_kl)


@dataclass
class TuneResult:
    rounds: list[Round] = field(default_factory=list)
    chosen: Round | None = None
    reached: bool = False
    save_path: Path | None = None


def next_scheme(scheme: str) -> str:
    """One step up from `scheme`: 4-bit weights or activations to W8A8 of the same family, 8-bit to FLOAT."""
    s = SCHEMES[scheme]
    if s.weight.bits >= 8 and (s.act is None or s.act.bits >= 8):
        return "FLOAT"
    return "W8A8_MXFP8" if s.is_mx else "W8A8_DYNAMIC"


def _check(args: TuneArgs) -> None:
    if (args.target_ppl_delta is None) == (args.target_kl is None):
        raise UserError("tune needs one target: --target_ppl_delta PCT or --target_kl NATS")
    if args.target_ppl_delta is not None and not args.target_ppl_delta > 0:
        raise UserError(f"--target_ppl_delta {args.target_ppl_delta}: must be a positive percentage")
    if args.target_kl is not None and not args.target_kl > 0:
        raise UserError(f"--target_kl {args.target_kl}: must be a positive number of nats per token")
    if args.metric not in get_args(ReportMetric):
        raise UserError(f"--metric {args.metric!r}: expected one of {', '.join(get_args(ReportMetric))}")
    if args.max_rounds < 1:
        raise UserError(f"--max_rounds {args.max_rounds}: must be at least 1")
    if not 0 < args.step <= 100:
        raise UserError(f"--step {args.step}: must be a percentage in (0, 100]")
    check_eval_args(args.dataset, args.seq_len, args.max_windows)
    save = Path(args.save_path)
    if save.exists() and (not save.is_dir() or any(save.iterdir())):
        raise UserError(f"--save_path {save}: exists and is not an empty directory (msmodelslim never overwrites "
                        f"an output)")
    if len(save.name.encode()) > NAME_MAX - 20:
        raise UserError(f"--save_path {save}: the name is too long for the rounds' folders beside it")


def _practice_with(base: dict[str, Any], base_dir: Path, fallback: dict[str, str],
                   fused: list[tuple[str, list[str]]], metric: str = "error") -> dict[str, Any]:
    """The practice `base` (read from `base_dir`) with `fallback` as explicit entries after its own, each scheme's
    linears as `with_groups` names them, the base's files made absolute so the round's practice reads them from
    anywhere; ranking by `impact`, the report measures it."""
    practice = yaml.safe_load(yaml.safe_dump(base))
    if metric == "impact" and practice["spec"].get("report_impact_tokens") is None:
        practice["spec"]["report_impact_tokens"] = DEFAULT_IMPACT_TOKENS
    entries = practice["spec"].get("fallback") or []
    for entry in entries:
        for key in ("names_file", "report"):
            if entry.get(key):
                entry[key] = str((base_dir / entry[key]).resolve())
    for scheme in ("W8A8_DYNAMIC", "W8A8_MXFP8", "FLOAT"):
        names = {n for n, s in fallback.items() if s == scheme}
        if names:
            entries.append({"to": scheme, "names": with_groups(names, fused)})
    practice["spec"]["fallback"] = entries
    return practice


def tune(args: TuneArgs) -> TuneResult:
    from msmodelslim.eval import evaluate

    _check(args)
    save_path = Path(args.save_path).expanduser().absolute()
    rounds_dir = save_path.parent / f".{save_path.name}.tune"
    quant_args = QuantArgs(model_path=args.model_path, save_path=str(rounds_dir / "round0"),
                           model_type=args.model_type, device=args.device, quant_type=args.quant_type,
                           config_path=args.config_path, trust_remote_code=args.trust_remote_code, tags=args.tags,
                           calibration_dataset=args.calibration_dataset, resumable=False, target=args.target)
    plan = check_request(quant_args)  # every check of a quant run, before round 0
    base = yaml.safe_load(plan.chosen.path.read_text(encoding="utf-8"))
    eval_device = str(parse_device(args.device).torch_device(0))
    result = TuneResult()
    fallback: dict[str, str] = {}
    with sigterm_raises(), output_lock(save_path):
        if rounds_dir.exists():
            raise UserError(f"--save_path {save_path}: {rounds_dir} exists (left by a tune that was killed); "
                            f"remove it first")
        fused = _fused_groups_checking_the_text(plan, args)
        groups = serving_groups(fused)
        rounds_dir.mkdir(parents=True)
        try:
            for index in range(args.max_rounds):
                practice_file = rounds_dir / f"round{index}.yaml"
                practice_file.write_text(yaml.safe_dump(_practice_with(base, plan.chosen.path.parent, fallback,
                                                                       fused, args.metric), sort_keys=False),
                                         encoding="utf-8")
                output = rounds_dir / f"round{index}"
                quant(replace(quant_args, save_path=str(output), quant_type=None, config_path=str(practice_file)))
                measured = evaluate(args.model_path, output, args.dataset, device=eval_device, seq_len=args.seq_len,
                                    max_windows=args.max_windows, trust_remote_code=args.trust_remote_code,
                                    model_type=args.model_type,  # the original once (KL: beside every round)
                                    ppl_orig=result.rounds[0].ppl_orig if result.rounds and args.target_kl is None
                                    else None)
                done = Round(index, dict(fallback), measured["ppl_orig"], measured["ppl_quant"],
                             measured["delta_pct"], output, measured.get("kl"), measured.get("kl_se"))
                result.rounds.append(done)
                moved = {s: sum(v == s for v in fallback.values()) for s in sorted(set(fallback.values()))}
                target = f"KL {done.kl:.5f} +- {done.kl_se or 0:.5f} (target {args.target_kl:g})" \
                    if args.target_kl is not None else f"target {args.target_ppl_delta:.2f}%"
                logger.info("tune round %d: %s: perplexity %.4f -> %.4f (%+.2f%%), %s", index,
                            ", ".join(f"{n} linears {s}" for s, n in moved.items()) or "the practice as it is",
                            done.ppl_orig, done.ppl_quant, done.delta_pct, target)
                if done.meets(args):
                    result.reached = True
                    break
                if index + 1 < args.max_rounds:
                    stepped = _step_up(output, fallback, args.step, groups, args.metric)
                    if stepped == fallback:  # every linear is FLOAT already: no round can do better
                        logger.warning("tune: nothing left to fall back after round %d", index)
                        break
                    fallback = stepped
            # the round that met the target, else the best one
            result.chosen = result.rounds[-1] if result.reached else min(result.rounds, key=lambda r: r.measure(args))
            if save_path.is_dir():
                save_path.rmdir()
            os.rename(result.chosen.output, save_path)
            result.save_path = save_path
        finally:
            shutil.rmtree(rounds_dir, ignore_errors=True)
    return result


def _fused_groups_checking_the_text(plan: Any, args: TuneArgs) -> list[tuple[str, list[str]]]:
    """The model's fused serving layers, from its skeleton (no weight read), and, with its tokenizer, whether the
    evaluation text fills the windows: both before round 0."""
    adapter = plan.adapter_cls(plan.model_path, trust_remote_code=args.trust_remote_code)
    try:
        eval_windows(adapter, Path(args.dataset), args.seq_len, args.max_windows)
        return adapter.target.fused_groups(adapter)
    finally:
        adapter.close()


def _step_up(output: Path, fallback: dict[str, str], step: float, groups: dict[str, list[str]],
             metric: str = "error") -> dict[str, str]:
    """`fallback` with the next worst linears of `output`'s report moved one step up, with their fused groups, at
    most `step` percent of the quantized linears (module docstring)."""
    report = read_report(output / REPORT_FILE)["linears"]
    budget = max(1, math.ceil(len(report) * step / 100))
    worst = worst_within([name for name, _ in ranked(report, metric)], groups, set(report), budget)
    out = dict(fallback)
    for name in worst:
        out[name] = next_scheme(report[name]["scheme"])
    return out
