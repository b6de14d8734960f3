"""`msmodelslim quant ...` and `msmodelslim eval ...`: argument parsing, logging set-up and the final summary.

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

from msmodelslim.errors import RankLost, Terminated, UserError
from msmodelslim.log import LOG_LEVEL_ENV, LOG_LEVELS, configure_logging


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
    sub = parser.add_subparsers(dest="command", required=True, metavar="{quant,eval}")

    quant = sub.add_parser("quant", help="quantize a model and write the AscendV1 format",
                           description="Quantize a Hugging Face weight directory layer by layer.")
    quant.add_argument("--model_path", required=True, help="weight directory (config.json + safetensors)")
    quant.add_argument("--save_path", required=True, help="output directory (must not exist or be empty)")
    quant.add_argument("--device", default="npu",
                       help="npu | npu:0,1,... | cuda | cuda:0,1,... | cpu | cpu:0,1 (default: npu); "
                            "one process per index")
    quant.add_argument("--model_type", required=True, help="display name from config/config.ini, e.g. Kimi-K3")
    which = quant.add_mutually_exclusive_group(required=True)
    which.add_argument("--quant_type", help="w4a8, w8a8, ...: picks the best practice in lab_practice/")
    which.add_argument("--config_path", help="a practice YAML to use instead of the lookup")
    quant.add_argument("--trust_remote_code", type=_bool_literal, default=False, metavar="{True,False}",
                       help="run the model code shipped in --model_path (default: False)")
    quant.add_argument("--tag", nargs="+", default=(), metavar="TAG",
                       help="the scenario the practice must be verified in, e.g. Ascend_950 (MX schemes); default: "
                            "Atlas A2/A3 (lab_practice's verified_tags)")
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

    # Parsed by msmodelslim.eval itself; listed here for --help.
    sub.add_parser("eval", add_help=False, help="perplexity of the original model and of a quantized output "
                   "(msmodelslim eval --help)")
    return parser


def setup_logging(level: str | None) -> None:
    configure_logging(level)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _run_quant(ns: argparse.Namespace) -> int:
    from msmodelslim.app.quant import QuantArgs, practice_file_name, quant

    setup_logging(ns.log_level)
    args = QuantArgs(
        model_path=ns.model_path, save_path=ns.save_path, model_type=ns.model_type, device=ns.device,
        quant_type=ns.quant_type, config_path=ns.config_path, trust_remote_code=ns.trust_remote_code, tags=tuple(ns.tag),
        resume=ns.resume, fresh=ns.fresh,
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
    try:
        if argv and argv[0] == "eval":
            return _run_eval(argv[1:])
        ns = build_parser().parse_args(argv)  # argparse exits 2 with its own message on a bad command line
        if ns.command == "eval":  # pragma: no cover - handled above
            return _run_eval(argv[1:])
        return _run_quant(ns)
    except UserError as exc:
        print(f"msmodelslim: error: {exc}", file=sys.stderr)
        return 2
    except RankLost as exc:
        print(f"msmodelslim: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("msmodelslim: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("msmodelslim: terminated", file=sys.stderr)
        return 143


if __name__ == "__main__":
    sys.exit(main())
