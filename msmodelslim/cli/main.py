"""`msmodelslim quant|analyze|tune|eval ...`: argument parsing, logging set-up and the final summary.

Exit status: 0 done; 2 bad input (one line `msmodelslim: error: ...`, no traceback); 1 an unexpected failure
(traceback kept), or a rank that lost its peers (one line: the rank that failed first says why); 130 interrupted (SIGINT), 143 terminated (SIGTERM): every rank stopped, nothing left behind.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from msmodelslim.core.signals import Stop, sigterm_raises
from msmodelslim.errors import RankLost, Terminated, UserError
from msmodelslim.log import LOG_LEVEL_ENV, LOG_LEVELS, configure_logging, escape_controls


def _bool_literal(text: str) -> bool:
    if text == "True":
        return True
    if text == "False":
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.lower()


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log_level", type=_log_level, default=None,
                        help=f"debug | info | warning | error (default: ${LOG_LEVEL_ENV} or info)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="msmodelslim", description="Post-training quantization (msModelSlim style).")
    parser.add_argument("-V", "--version", action="version", version=f"msmodelslim {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{quant,analyze,tune,eval}")

    quant = sub.add_parser("quant", help="quantize a model and write the AscendV1 format",
                           description="Quantize a Hugging Face weight directory layer by layer.")
    _model_arguments(quant)
    quant.add_argument("--save_path", required=True, help="output directory (must not exist or be empty)")
    quant.add_argument("--target", default=None, metavar="ENGINE",
                       help="the serving engine the output is written for: vllm-ascend-0.26 | vllm-ascend-0.27 (default: the "
                             "practice's spec.target, else vllm-ascend-0.27); its load rules are checked before any "
                             "compute")
    again = quant.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the interrupted run of --save_path after the last unit every rank finished "
                            "(same arguments; its state is in .<save_path>.partial beside it)")
    again.add_argument("--fresh", action="store_true", help="discard such state and start over")
    quant.add_argument("--plan", action="store_true",
                       help="check everything a run checks and print what it would do (units, selected linears, "
                            "output size, memory per rank, time); reads headers only, writes nothing")
    quant.add_argument("--plan-json", metavar="FILE", default=None, help="with --plan, also write the plan as JSON")
    _common(quant)

    from msmodelslim.core.report import ANALYZE_METRICS, DEFAULT_TOP_K

    analyze = sub.add_parser("analyze", help="rank the linears a practice quantizes worst, without writing a model",
                             description="Quantize layer by layer in memory and rank the quantized linears by a "
                                         "sensitivity metric of the quant report; nothing but the files asked for "
                                         "is written.")
    _model_arguments(analyze, practice_required=False)
    analyze.add_argument("--metrics", default="mse", metavar="METRIC",
                         help=f"{' | '.join(ANALYZE_METRICS)} (default: mse, the relative output error)")
    analyze.add_argument("--top_k", type=int, default=DEFAULT_TOP_K, help=f"how many to list (default {DEFAULT_TOP_K})")
    analyze.add_argument("--patterns", nargs="+", default=[], metavar="GLOB",
                         help="rank only linears whose checkpoint names match one of these globs")
    analyze.add_argument("--save_path", default=None, metavar="FILE.yaml",
                         help="write the top k as disable_names (a practice's spec.fallback names_file)")
    analyze.add_argument("--report_path", default=None, metavar="FILE.json", help="write the whole quant report")
    _common(analyze)

    tune = sub.add_parser("tune", help="quantize, evaluate, fall back the worst linears, until an accuracy target",
                          description="Rounds of quantize -> evaluate -> fall back the linears the report ranks "
                                      "worst, until the perplexity increase (or the KL) is at most the target.")
    _model_arguments(tune)
    tune.add_argument("--save_path", required=True, help="output directory (must not exist or be empty)")
    tune.add_argument("--target", default=None, metavar="ENGINE",
                      help="the serving engine the output is written for: vllm-ascend-0.26 | vllm-ascend-0.27 (default: the "
                            "practice's spec.target, else vllm-ascend-0.27); its load rules are checked before any "
                            "compute")
    tune.add_argument("--dataset", required=True, help="a UTF-8 text file for the perplexity")
    targets = tune.add_mutually_exclusive_group(required=True)
    targets.add_argument("--target_ppl_delta", type=float, metavar="PCT",
                         help="accept a quantization whose perplexity is at most PCT %% above the original's")
    targets.add_argument("--target_kl", type=float, metavar="NATS",
                         help="accept a quantization whose next-token KL divergence from the original is at most "
                              "NATS per token (the original is forwarded beside every round)")
    tune.add_argument("--metric", default="impact", metavar="METRIC",
                      help="the quant report field that ranks the linears to fall back: impact (the loss-aware "
                           "score, default) or error (the linear's own relative output error)")
    tune.add_argument("--max_rounds", type=int, default=4, help="quantizations at most, the first included (4)")
    tune.add_argument("--step", type=float, default=10.0, metavar="PCT",
                      help="percent of the quantized linears moved up per round, with their fused groups (10)")
    tune.add_argument("--seq_len", type=int, default=512, help="tokens per perplexity window (512)")
    tune.add_argument("--max_windows", type=int, default=32, help="perplexity windows (32)")
    _common(tune)

    # Parsed by msmodelslim.eval itself; listed here for --help.
    sub.add_parser("eval", add_help=False, help="perplexity of the original model and of a quantized output "
                   "(msmodelslim eval --help)")
    return parser


def _model_arguments(parser: argparse.ArgumentParser, practice_required: bool = True) -> None:
    """What quant, analyze and tune take alike: the model, the devices, the practice."""
    parser.add_argument("--model_path", required=True, help="weight directory (config.json + safetensors)")
    parser.add_argument("--device", default="npu",
                        help="npu | npu:0,1,... | cuda | cuda:0,1,... | cpu | cpu:0,1 (default: npu); "
                             "one process per index")
    parser.add_argument("--device_id", type=int, nargs="+", default=None, metavar="ID",
                        help="msModelSlim's spelling of the indices: --device npu --device_id 0 1 = --device npu:0,1")
    parser.add_argument("--model_type", required=True, help="display name from config/config.ini, e.g. Kimi-K3")
    which = parser.add_mutually_exclusive_group(required=practice_required)
    which.add_argument("--quant_type", help="w4a8, w8a8, ...: picks the best practice in lab_practice/")
    which.add_argument("--config_path", "--config", dest="config_path", help="a practice YAML to use instead of the lookup (or a shipped "
                                             "practice's name)")
    parser.add_argument("--trust_remote_code", type=_bool_literal, default=False, metavar="{True,False}",
                        help="run the model code shipped in --model_path (default: False)")
    parser.add_argument("--calibration_dataset", default=None, metavar="PATH",
                        help="calibration records instead of the practice's spec.dataset: a jsonl file, or a folder "
                             "of jsonl shards (read in name order)")
    parser.add_argument("--tag", "--tags", dest="tag", nargs="+", default=(), metavar="TAG",
                        help="the scenario the practice must be verified in, e.g. Ascend_950 (MX schemes); "
                             "default: Atlas A2/A3 (lab_practice's verified_tags)")


def _version() -> str:
    from msmodelslim import __version__

    return __version__


def device_of(ns: argparse.Namespace) -> str:
    """`--device`, with msModelSlim's `--device_id` list folded in (`npu` + `0 1` -> `npu:0,1`)."""
    if ns.device_id is None:
        return ns.device
    if ":" in ns.device:
        raise UserError(f"--device {ns.device} --device_id {' '.join(map(str, ns.device_id))}: give the indices once "
                        f"(--device {ns.device.split(':')[0]} --device_id ..., or --device {ns.device})")
    return f"{ns.device}:{','.join(map(str, ns.device_id))}"


def setup_logging(level: str | None) -> None:
    configure_logging(level)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _run_quant(ns: argparse.Namespace) -> int:
    from msmodelslim.core import rank_server

    setup_logging(ns.log_level)  # (its environment variables reach the ranks through the rank server's)
    if not (ns.plan or ns.plan_json) and rank_server.wanted(device_of(ns)):
        rank_server.start()  # its imports overlap this process's own and the run's checks
    from msmodelslim.app.quant import QuantArgs, practice_file_name, quant

    args = QuantArgs(
        model_path=ns.model_path, save_path=ns.save_path, model_type=ns.model_type, device=device_of(ns),
        quant_type=ns.quant_type, config_path=ns.config_path, trust_remote_code=ns.trust_remote_code, tags=tuple(ns.tag),
        calibration_dataset=ns.calibration_dataset, resume=ns.resume, fresh=ns.fresh, target=ns.target,
    )
    if ns.plan or ns.plan_json:
        return _run_plan(args, ns.plan_json)
    result = quant(args)
    meta = result.practice.metadata
    if not result.is_main:  # a torchrun rank other than 0: rank 0 prints the summary
        print(f"msmodelslim quant: {result.device.torchrun.describe()} done in {result.seconds:.1f} s")
        return 0
    print(f"msmodelslim quant: done in {result.seconds:.1f} s")
    print(f"  model      {result.model_type} ({ns.model_path})")
    print(f"  practice   {meta.config_id} ({result.practice.quant_type}, score {meta.score:g}) from "
          f"{result.practice_path}")
    launch = ", torchrun" if result.device.torchrun else ""
    print(f"  device     {result.device} ({result.device.world_size} process"
          f"{'es' if result.device.world_size > 1 else ''}, {result.device.backend}{launch})")
    print(f"  output     {result.save_path} ({result.files} files, {_size(result.bytes)}; "
          f"practice copied to {practice_file_name(result.model_type)})")
    print(f"  copied     {', '.join(result.copied) or '-'}")
    return 0


def _run_analyze(ns: argparse.Namespace) -> int:
    from msmodelslim.app.analyze import AnalyzeArgs, analyze

    setup_logging(ns.log_level)
    result = analyze(AnalyzeArgs(
        model_path=ns.model_path, model_type=ns.model_type, device=device_of(ns), quant_type=ns.quant_type,
        config_path=ns.config_path, trust_remote_code=ns.trust_remote_code, tags=tuple(ns.tag), metrics=ns.metrics,
        calibration_dataset=ns.calibration_dataset,
        top_k=ns.top_k, patterns=list(ns.patterns), save_path=ns.save_path, report_path=ns.report_path))
    print(f"msmodelslim analyze: the {len(result.top)} of {result.considered} quantized linears with the largest "
          f"{result.metric} ({result.basis})")
    width = max((len(name) for name, _ in result.top), default=0)
    for rank, (name, value) in enumerate(result.top, 1):
        scheme = result.report["linears"][name]["scheme"]
        print(f"  {rank:>3}  {name:<{width}}  {scheme:<14} {value:.4g}")
    for what, path in (("disable_names", ns.save_path), ("report", ns.report_path)):
        if path:
            print(f"  {what} written to {path}")
    return 0


def _run_tune(ns: argparse.Namespace) -> int:
    from msmodelslim.app.tune import TuneArgs, tune

    setup_logging(ns.log_level)
    result = tune(TuneArgs(
        model_path=ns.model_path, save_path=ns.save_path, model_type=ns.model_type, dataset=ns.dataset,
        target_ppl_delta=ns.target_ppl_delta, target_kl=ns.target_kl, metric=ns.metric, device=device_of(ns), quant_type=ns.quant_type, config_path=ns.config_path,
        trust_remote_code=ns.trust_remote_code, tags=tuple(ns.tag), max_rounds=ns.max_rounds, step=ns.step,
        calibration_dataset=ns.calibration_dataset, target=ns.target,
        seq_len=ns.seq_len, max_windows=ns.max_windows))
    target = f"KL {ns.target_kl:g}" if ns.target_kl is not None else f"{ns.target_ppl_delta:g} %"
    print(f"msmodelslim tune: {'target reached' if result.reached else 'target NOT reached'} "
          f"({target}) in {len(result.rounds)} round(s)")
    for r in result.rounds:
        mark = "  <- published" if r is result.chosen else ""
        kl = "" if r.kl is None else f", KL {r.kl:.5f} +- {r.kl_se or 0:.5f}"
        print(f"  round {r.index}: {len(r.fallback):>4} linears fallen back, perplexity {r.ppl_orig:.4f} -> "
              f"{r.ppl_quant:.4f} ({r.delta_pct:+.2f} %){kl}{mark}")
    print(f"  output     {result.save_path} (its practice, with the fallback, is copied beside the weights)")
    return 0


def _run_plan(args: Any, json_path: str | None) -> int:
    from msmodelslim.app.plan import describe
    from msmodelslim.app.quant import plan

    result = plan(args)
    print(f"msmodelslim quant --plan: {args.model_type} with {result['practice']} on {result['device']}")
    print(describe(result))
    if json_path:
        try:
            Path(json_path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise UserError(f"--plan-json {json_path}: cannot write it ({exc.strerror})") from None
        print(f"plan written to {json_path}")
    return 0


def _run_eval(argv: list[str]) -> int:
    level = None
    rest: list[str] = []
    i = 0
    while i < len(argv):  # --log_level is ours; everything else belongs to msmodelslim.eval
        arg = argv[i]
        if arg == "--log_level" and i + 1 < len(argv):
            level, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--log_level="):
            level = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if level is not None and level.lower() not in LOG_LEVELS:
        raise UserError(f"--log_level {level!r}: expected one of {', '.join(LOG_LEVELS)}")
    setup_logging(level)
    import msmodelslim.eval as evaluation

    cli_main = getattr(evaluation, "cli_main", None)
    if cli_main is None:
        raise RuntimeError("msmodelslim.eval has no cli_main(argv)")
    result = cli_main(rest)
    return int(result) if isinstance(result, int) else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with sigterm_raises() as stop:  # until the last line is out: a signal then must not kill the process before it
        try:
            return _run(argv)
        except UserError as exc:
            return _last_line(stop, f"error: {escape_controls(str(exc))}", 2)
        except RankLost as exc:
            return _last_line(stop, f"error: {escape_controls(str(exc))}", 1)
        except KeyboardInterrupt:
            return _last_line(stop, "interrupted", 130)
        except Terminated:
            return _last_line(stop, "terminated", 143)


def _run(argv: list[str]) -> int:
    if argv and argv[0] == "eval":
        return _run_eval(argv[1:])
    ns = build_parser().parse_args(argv)  # argparse exits 2 with its own message on a bad command line
    if ns.command == "eval":  # pragma: no cover - handled above
        return _run_eval(argv[1:])
    if ns.command == "analyze":
        return _run_analyze(ns)
    if ns.command == "tune":
        return _run_tune(ns)
    return _run_quant(ns)


def _last_line(stop: Stop, what: str, status: int) -> int:
    """The one line a stopped run ends with; signals that come now (torchrun's agent signals a rank that already
    lost its peer) are ignored: the run has unwound, and the line says why it stopped."""
    stop.settled = True
    print(f"msmodelslim: {what}", file=sys.stderr)
    return status

if __name__ == "__main__":
    sys.exit(main())
