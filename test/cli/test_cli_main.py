"""cli.main: argument parsing, exit codes (0 ok, 2 user error as one line, 1 unexpected with traceback),
--log_level / $MSMODELSLIM_LOG_LEVEL, the printed summary and the `eval` subcommand hand-off.
The quant service is a stub here (test/app/quant_fixtures.py); references are literal outputs and exit codes."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from msmodelslim.cli import main as cli
from msmodelslim.pipeline import launch

REPO = Path(__file__).resolve().parents[2]


def quant_argv(model: Path, save: Path, *extra: str) -> list[str]:
    return ["quant", "--model_path", str(model), "--save_path", str(save), "--device", "cpu",
            "--model_type", "Kimi-K3", *extra]


def test_success_prints_summary(tmp_path, model_dir, practice_file, stub_service, capsys):
    code = cli.main(quant_argv(model_dir, tmp_path / "out", "--config_path", str(practice_file), "--tag", "t1"))
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("msmodelslim quant: done in ")
    assert "stub_w4a8 (w4a8, score 10)" in out and f"output     {tmp_path / 'out'} (3 files" in out
    assert "practice copied to Kimi-K3_best_practice.yaml" in out


def test_user_error_is_one_line_exit_2(tmp_path, model_dir, practice_file, stub_service, capsys):
    code = cli.main(quant_argv(model_dir, tmp_path / "out", "--config_path", str(practice_file),
                               "--model_type", "Nope"))
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("msmodelslim: error: --model_type 'Nope' is not registered")
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_unexpected_error_keeps_traceback(tmp_path, model_dir, practice_file, stub_service, monkeypatch):
    def broken(request):
        raise RuntimeError("internal bug")

    monkeypatch.setattr(launch, "run_service", broken)
    with pytest.raises(RuntimeError, match="internal bug"):  # propagates: Python prints it and exits 1
        cli.main(quant_argv(model_dir, tmp_path / "out", "--config_path", str(practice_file)))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--quant_type", "w4a8", "--config_path", "x.yaml"], "not allowed with argument"),
        ([], "one of the arguments --quant_type --config_path/--config is required"),
        (["--quant_type", "w4a8", "--device_id", "x"], "argument --device_id: invalid int value: 'x'"),
        (["--quant_type", "w4a8", "--trust_remote_code", "true"], "expected True or False, got 'true'"),
        (["--quant_type", "w4a8", "--log_level", "loud"], "expected one of debug, info, warning, error"),
    ],
)
def test_bad_command_lines_exit_2(tmp_path, extra, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(quant_argv(tmp_path, tmp_path / "o", *extra))
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_msmodelslim_spellings_config_tags_and_device_id_run_like_ours(tmp_path, model_dir, practice_file,
                                                                       stub_service, capsys):
    argv = ["quant", "--model_path", str(model_dir), "--save_path", str(tmp_path / "out"), "--device", "cpu",
            "--device_id", "0", "--model_type", "Kimi-K3", "--config", str(practice_file), "--tags", "t1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "stub_w4a8 (w4a8, score 10)" in out and "device     cpu:0 (1 process" in out


def test_device_id_beside_indices_in_device_is_one_line_exit_2(tmp_path, model_dir, practice_file, capsys):
    code = cli.main(quant_argv(model_dir, tmp_path / "out", "--config", str(practice_file), "--device", "cpu:0,1",
                               "--device_id", "2"))
    err = capsys.readouterr().err
    assert code == 2 and err == ("msmodelslim: error: --device cpu:0,1 --device_id 2: give the indices once "
                                 "(--device cpu --device_id ..., or --device cpu:0,1)\n")


def test_version_flag_prints_the_toolkit_version(capsys):
    from msmodelslim import __version__

    for flag in ("-V", "--version"):
        with pytest.raises(SystemExit) as info:
            cli.main([flag])
        assert info.value.code == 0 and capsys.readouterr().out == f"msmodelslim {__version__}\n"


def test_trust_remote_code_literal():
    ns = cli.build_parser().parse_args(["quant", "--model_path", "m", "--save_path", "s", "--model_type", "K",
                                        "--quant_type", "w4a8", "--trust_remote_code", "True"])
    assert ns.trust_remote_code is True and ns.device == "npu"


def test_log_level_from_flag_and_env(monkeypatch):
    monkeypatch.setenv(cli.LOG_LEVEL_ENV, "warning")
    cli.setup_logging(None)
    assert logging.getLogger().level == logging.WARNING
    cli.setup_logging("debug")
    assert logging.getLogger().level == logging.DEBUG
    monkeypatch.setenv(cli.LOG_LEVEL_ENV, "chatty")
    with pytest.raises(cli.UserError, match="MSMODELSLIM_LOG_LEVEL='chatty'"):
        cli.setup_logging(None)
    cli.setup_logging("info")


def test_eval_subcommand_delegates_to_msmodelslim_eval(monkeypatch):
    import msmodelslim.eval as evaluation

    seen = []
    monkeypatch.setattr(evaluation, "cli_main", lambda argv: seen.append(argv) or 0)
    argv = ["eval", "--model_path", "m", "--quant_path", "q", "--dataset", "d.txt", "--log_level", "warning",
            "--seq-len", "128", "--max-windows", "2", "--trust_remote_code", "False", "--device", "cpu"]
    assert cli.main(argv) == 0
    assert seen == [["--model_path", "m", "--quant_path", "q", "--dataset", "d.txt", "--seq-len", "128",
                     "--max-windows", "2", "--trust_remote_code", "False", "--device", "cpu"]]
    assert logging.getLogger().level == logging.WARNING


def test_console_entry_point_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "msmodelslim.cli", "--help"], capture_output=True, text=True,
                         cwd=REPO, check=True)
    assert "{quant,analyze,tune,eval}" in out.stdout
    out = subprocess.run([sys.executable, "-m", "msmodelslim.cli", "eval", "--help"], capture_output=True,
                         text=True, cwd=REPO)
    assert out.returncode == 0 and "--quant_path" in out.stdout and "--max-windows" in out.stdout
