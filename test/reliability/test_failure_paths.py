"""Every fault a user can hand `msmodelslim quant` is one line `msmodelslim: error: ...` naming the file, tensor,
key or value, exit status 2, and nothing left behind: no output, no temporary directory, no failure folder.

Reference: the exact exit status, the number of lines on stderr (one), a regex for that line per case (faults.py),
and a listing of the save directory's parent before and after. The broken inputs are built from copies of the
one tiny Kimi-K3 checkpoint of the session.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from runner.dp_helpers import REPO, shrunken_practice

from msmodelslim.cli.main import main

from .faults import CHECKER_FAULTS, FAULTS

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)

ERROR_LINE = re.compile(r"^msmodelslim: error: (.+)$")


def failure_folders() -> set[str]:
    """What a failed run could leave in $TMPDIR: our failure notes, torch's per-rank error files."""
    tmp = Path(tempfile.gettempdir())
    return {p.name for pattern in ("msmodelslim-failures-*", "pytorch-errorfile-*") for p in tmp.glob(pattern)}


def quant_args(model: Path, save: Path, extra: list[str]) -> list[str]:
    args = ["quant", "--model_path", str(model), "--save_path", str(save), "--device", "cpu",
            "--model_type", "Kimi-K3", "--trust_remote_code", "True"]
    if "--config_path" not in extra:
        args += ["--quant_type", "w4a8"]
    return args + extra


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """`--config_path` of the shipped W4A8 practice cut to 2 samples of 32 tokens with plain numerics, for the
    complete runs below: what they check (the output's files, the publication) is the same for any run length."""
    practice = shrunken_practice(REPO / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml",
                                 tmp_path_factory.mktemp("practice") / "p.yaml", max_samples=2, max_seq_len=32,
                                 plain_numerics=True)
    return ["--config_path", str(practice)]


# The faults the checker finds from headers are unit tests of it (test_checker.py); two of them stay here, to show
# the command line's one-line rendering of a checkpoint fault found at open and at the header walk.
CLI_CASES = sorted(set(FAULTS) - set(CHECKER_FAULTS) | {"missing_shard", "missing_tensor"})


@pytest.mark.parametrize("case", CLI_CASES)
def test_fault_is_one_error_line_exit_2_and_leaves_nothing(case, broken_copy, capsys):
    model, workspace = broken_copy
    fault, expected = FAULTS[case]
    extra = fault(model, workspace)
    before = sorted(p.name for p in workspace.iterdir())
    folders = failure_folders()
    code = main(quant_args(model, workspace / "out", extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, f"{case}: exit {code}\n" + "\n".join(err[-20:])
    errors = [line for line in err if ERROR_LINE.match(line)]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), f"{case}: {err[-20:]}"
    assert re.search(expected, errors[0]), f"{case}: {errors[0]!r} does not match {expected!r}"
    assert sorted(p.name for p in workspace.iterdir()) == before, f"{case}: left {os.listdir(workspace)}"
    assert failure_folders() == folders


def test_a_data_fault_on_two_ranks_is_one_line_and_leaves_nothing_in_the_temp_folder(broken_copy, capfd):
    # both ranks meet the NaN; the launcher stops them. Reference: the whole stderr of the run (the processes' too)
    from .faults import overflowing_norm

    model, workspace = broken_copy
    overflowing_norm(model, workspace)
    folders = failure_folders()
    code = main(quant_args(model, workspace / "out", ["--device", "cpu:0,1"]))
    lines = [line for line in capfd.readouterr().err.replace("\r", "\n").splitlines()
             if line.strip() and " INFO " not in line and not line.startswith("quantizing:")]
    assert code == 2, lines[-20:]
    assert len(lines) == 1 and re.match(r"msmodelslim: error: rank \d: unit layers\.0: calibration activations "
                                        r"became NaN/Inf", lines[0]), lines[-20:]
    assert failure_folders() == folders
    assert os.listdir(workspace) == []


def test_a_save_path_filled_by_another_process_mid_run_gets_one_line_and_the_output_is_kept_aside(
        tiny_k3_checkpoint, short_run, tmp_path, capsys, monkeypatch):
    from msmodelslim.app import quant as quant_mod

    save, real = tmp_path / "out", quant_mod._publish

    def another_process_writes_the_save_path(work_dir, save_path):
        save.mkdir(exist_ok=True)
        (save / "theirs.txt").write_text("not ours")
        real(work_dir, save_path)

    monkeypatch.setattr(quant_mod, "_publish", another_process_writes_the_save_path)
    code = main(quant_args(tiny_k3_checkpoint, save, short_run))
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if ERROR_LINE.match(line)]
    assert code == 2 and len(errors) == 1 and "Traceback" not in "\n".join(err), err[-10:]
    kept = re.match(r"msmodelslim: error: --save_path \S+/out: another process wrote it during the run \(.*\); the "
                    r"finished output is in (\S+)$", errors[0])
    assert kept, errors[0]
    assert (Path(kept.group(1)) / "quant_model_description.json").is_file()
    assert os.listdir(save) == ["theirs.txt"]
    assert sorted(os.listdir(tmp_path)) == sorted(["out", Path(kept.group(1)).name])  # no lock, no temp folder


def test_locked_save_path_is_refused_at_once(tiny_k3_checkpoint, tmp_path, capsys):
    import fcntl

    from msmodelslim.app.quant import _side_name

    save = tmp_path / "out"
    lock = _side_name(save, "lock")
    with open(lock, "w") as held:
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        code = main(quant_args(tiny_k3_checkpoint, save, []))
    err = capsys.readouterr().err
    assert code == 2 and "another msmodelslim run (pid 4242) is writing it" in err
    assert not save.exists()


def test_full_disk_is_refused_before_the_run(tiny_k3_checkpoint, tmp_path, capsys, monkeypatch):
    import shutil as shutil_mod

    from msmodelslim.app import quant as quant_mod

    real = shutil_mod.disk_usage
    monkeypatch.setattr(quant_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    code = main(quant_args(tiny_k3_checkpoint, tmp_path / "out", []))
    err = capsys.readouterr().err
    assert code == 2 and re.search(r"has 0\.00 GiB free; the output of \S+ can take up to 0\.00 GiB", err), err
    assert sorted(os.listdir(tmp_path)) == []


def test_output_keeps_only_consumer_files_with_one_mode_under_a_long_name(tiny_k3_checkpoint, short_run, tmp_path,
                                                                         capsys):
    # files of other kinds (a link to one too) never reach the output; a 250-byte name is valid and must work
    model = tmp_path / "model"
    shutil.copytree(tiny_k3_checkpoint, model)
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    (model / "notes.txt").symlink_to(secret)
    (model / "README.txt").write_text("a note of the vendor")
    (model / "tokenizer_config.json.bak").write_text("{}")
    save = tmp_path / ("o" * 250)
    code = main(quant_args(model, save, short_run))
    assert code == 0, capsys.readouterr().err
    names = {p.name for p in save.iterdir()}
    assert not names & {"notes.txt", "README.txt", "tokenizer_config.json.bak"}
    assert {"config.json", "tokenizer.json", "modeling_kimi_k3.py", "quant_model_description.json"} <= names
    files = [p for p in save.rglob("*") if p.is_file()]
    assert all(b"private" not in p.read_bytes() for p in files)
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o644"}
    assert {oct(p.stat().st_mode & 0o777) for p in [save, *save.rglob("*")] if p.is_dir()} == {"0o755"}
    assert sorted(os.listdir(tmp_path)) == sorted(["model", "secret.txt", save.name])  # no lock, no temp dir


def test_hugging_face_cache_layout_gives_an_output_with_real_files_of_the_same_content(tiny_k3_checkpoint, short_run,
                                                                                       tmp_path, capsys):
    # The cache's snapshot is links into blobs/ under content hashes. Reference: the output's consumer files are
    # regular files (not links) byte-equal to the blobs (config.json: same keys but quantization_config).
    import hashlib
    import json

    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for src in sorted(tiny_k3_checkpoint.iterdir()):
        blob = blobs / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, blob)
        (snapshot / src.name).symlink_to(Path("../../blobs") / blob.name)
    save = tmp_path / "out"
    code = main(quant_args(snapshot, save, short_run))
    assert code == 0, capsys.readouterr().err
    for name in ["tokenizer.json", "tokenizer_config.json", "processor_config.json", "generation_config.json",
                 "modeling_kimi_k3.py", "configuration_kimi_k3.py", "processing_kimi_k3.py"]:
        out = save / name
        assert out.is_file() and not out.is_symlink(), name
        assert out.read_bytes() == (tiny_k3_checkpoint / name).read_bytes(), name
    source_config = json.loads((tiny_k3_checkpoint / "config.json").read_text())
    assert set(json.loads((save / "config.json").read_text())) >= set(source_config) - {"quantization_config"}
    assert re.search(r"copied +config\.json, configuration_kimi_k3\.py, generation_config\.json", capsys.readouterr().out)


def eval_error_of_an_output_recording(source: dict, model: Path, tmp_path: Path, capsys) -> str:
    """`msmodelslim eval` of `model` against an output whose description records `source`: its one error line."""
    import json

    from msmodelslim.serving.ascendv1 import DESCRIPTION_NAME

    out = tmp_path / "out"
    out.mkdir()
    (out / DESCRIPTION_NAME).write_text(json.dumps({"version": "1.0.0", "metadata": {"source": source}}))
    (out / "quant_model_weights.safetensors.index.json").write_text('{"weight_map": {}}')
    text = tmp_path / "t.txt"
    text.write_text("hello " * 200)
    code = main(["eval", "--model_path", str(model), "--quant_path", str(out), "--dataset", str(text),
                 "--trust_remote_code", "True"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_eval_of_an_output_made_from_other_weights_of_the_same_config_and_index_is_refused(tiny_k3_checkpoint,
                                                                                          tmp_path, capsys):
    # the output records the source's identity; the other checkpoint differs only in its tensors' values
    from msmodelslim.source.checkpoint import source_identity

    from .faults import other_weights

    model = tmp_path / "model"
    shutil.copytree(tiny_k3_checkpoint, model)
    other_weights(model)
    line = eval_error_of_an_output_recording(source_identity(tiny_k3_checkpoint), model, tmp_path, capsys)
    assert re.match(r"msmodelslim: error: --quant_path .* was quantized from another checkpoint than "
                    r"--model_path .* \(source tensors_sha256 [0-9a-f]{64} != [0-9a-f]{64}\)", line), line


def test_eval_of_an_output_made_from_another_checkpoint_is_refused(tiny_k3_checkpoint, tmp_path, capsys):
    line = eval_error_of_an_output_recording({"config_sha256": "abc"}, tiny_k3_checkpoint, tmp_path, capsys)
    assert re.match(r"msmodelslim: error: --quant_path .* was quantized from another checkpoint than "
                    r"--model_path .* \(source config_sha256 abc != [0-9a-f]{64}\)", line), line


def test_eval_of_a_missing_output_is_one_line(tiny_k3_checkpoint, tmp_path, capsys):
    code = main(["eval", "--model_path", str(tiny_k3_checkpoint), "--quant_path", str(tmp_path / "nope"),
                 "--dataset", str(tmp_path / "t.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("msmodelslim: error: "), err


def test_long_calibration_record_is_cut_to_the_default_token_cap(tiny_k3_checkpoint):
    # a 1 MB record would be ~600k tokens; the default cap (spec.max_seq_len absent) keeps the run bounded
    from msmodelslim.core.calib import CalibRecord
    from msmodelslim.core.config import DEFAULT_MAX_SEQ_LEN
    from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter

    with KimiK3ModelAdapter(tiny_k3_checkpoint, trust_remote_code=True) as adapter:
        samples = adapter.prepare_samples([CalibRecord(text="word " * 20000), CalibRecord(text="a short one")],
                                          max_seq_len=DEFAULT_MAX_SEQ_LEN)
    assert samples[0]["input_ids"].shape == (1, DEFAULT_MAX_SEQ_LEN)
    assert samples[1]["input_ids"].shape[1] < 16
