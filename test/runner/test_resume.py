"""Resumable runs: a run stopped after unit k continues with `--resume` to the output an uninterrupted run writes.

Reference: an uninterrupted run of the same command on the same rank count; tolerance none: every file of the two
outputs has the same name and the same bytes. Stops are real: SIGTERM or SIGKILL of the main process, SIGKILL of one
rank, as soon as the run logs that unit k is done (its state is kept before that line), and a failure after the last
unit. Refusals are one line each, exit status 2, the state left as it was. The shipped W4A8 practice, shrunk to 5
samples of 96 tokens (GPTQ and the searched smoothing kept).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from reliability.faults import other_weights
from reliability.test_signals import MARKER_ENV, marked_processes

from msmodelslim.app.quant import QuantArgs, quant
from msmodelslim.cli.main import main
from msmodelslim.pipeline.resume import ResumeState
from msmodelslim.processor.save.ascendv1_saver import AscendV1Saver

from .dp_helpers import REPO, shrunken_practice

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)



@pytest.fixture(scope="module")
def practice(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shrunken_practice(REPO / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml",
                             tmp_path_factory.mktemp("practice") / "p.yaml", max_samples=5, max_seq_len=96)


@pytest.fixture(scope="module")
def reference(tiny_k3_checkpoint: Path, practice: Path, tmp_path_factory: pytest.TempPathFactory):
    """device -> the uninterrupted run's output (made once per device spec)."""
    made: dict[str, Path] = {}

    def get(device: str, model: Path = tiny_k3_checkpoint, model_type: str = "Kimi-K3", prac: Path = practice):
        key = f"{model.name}:{device}:{prac}"
        if key not in made:
            out = tmp_path_factory.mktemp("reference") / "out"
            quant(QuantArgs(model_path=str(model), save_path=str(out), device=device, model_type=model_type,
                            config_path=str(prac), trust_remote_code=model_type == "Kimi-K3"))
            made[key] = out
        return made[key]

    return get


def assert_same_files(a: Path, b: Path) -> None:
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    differing = [n for n in names if (a / n).read_bytes() != (b / n).read_bytes()]
    assert not differing, f"{len(differing)} files differ: {differing[:5]}"


def command(model: Path, save: Path, device: str, practice: Path, model_type: str = "Kimi-K3") -> list[str]:
    return ["quant", "--model_path", str(model), "--save_path", str(save), "--device", device, "--model_type",
            model_type, "--config_path", str(practice), "--trust_remote_code", str(model_type == "Kimi-K3")]


def stop_after(args: list[str], unit: str, how: str, cwd: Path) -> str:
    """Run `msmodelslim <args>` and stop it as soon as it logs that `unit` is done: SIGTERM / SIGKILL of the main
    process, or SIGKILL of rank 1. Returns its stderr, once the stop is complete as test_signals.py specifies it:
    the exit status of the stop (143 for SIGTERM, 1 for a rank lost), no process of the run alive, nothing left in
    its private TMPDIR."""
    marker = uuid.uuid4().hex
    tmp = cwd.parent / f"{cwd.name}-tmp"  # beside the save directory's parent, whose listing the tests check
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, MARKER_ENV: marker, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-m", "msmodelslim.cli.main", *args, "--log_level", "debug"], cwd=cwd,
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if line.rstrip().endswith(f"unit {unit} done"):
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert seen.wait(180), "".join(lines[-20:])
    if how == "rank":
        rank1 = next(int(line.split("pid ")[1].split()[0]) for line in lines if "rank 1 of 2: pid " in line)
        os.kill(rank1, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    code = proc.wait(120)
    reader.join(10)
    assert code == {"sigterm": 143, "sigkill": -signal.SIGKILL, "rank": 1}[how], "".join(lines[-20:])
    deadline = time.monotonic() + 15
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not marked_processes(marker), "processes of the run are still alive"
    assert [p for p in os.listdir(tmp) if p.startswith("msmodelslim-")] == []
    return "".join(lines)


def resumes_after(args: list[str], unit: str, how: str, workspace: Path, uninterrupted: Path) -> None:
    """A run stopped after `unit` (stop_after) leaves the state alone and says how to resume; `--resume` then writes
    the uninterrupted output, and the state goes with the publish."""
    err = stop_after(args, unit, how, workspace)
    assert "--resume" in err
    assert os.listdir(workspace) == [".out.partial"]  # no output, the state, and no lock
    assert main([*args, "--resume"]) == 0
    assert_same_files(uninterrupted, workspace / "out")
    assert os.listdir(workspace) == ["out"]


# The stops: SIGTERM of one process here, SIGKILL of a rank on the mini below, SIGKILL of the main process of two
# ranks in the `stopped` state further down (resumed by test_a_resume_drops_the_shard_...).
def test_a_run_stopped_by_sigterm_after_its_first_unit_resumes_to_the_uninterrupted_output(
        tiny_k3_checkpoint, practice, reference, tmp_path):
    resumes_after(command(tiny_k3_checkpoint, tmp_path / "out", "cpu", practice), "vision", "sigterm", tmp_path,
                  reference("cpu"))


def test_a_failure_after_the_last_unit_resumes_to_the_uninterrupted_output(tiny_k3_checkpoint, practice, reference,
                                                                          tmp_path, monkeypatch):
    save = tmp_path / "out"
    args = command(tiny_k3_checkpoint, save, "cpu", practice)

    def broken(self):
        raise RuntimeError("disk gone while finishing")

    with monkeypatch.context() as patch:
        patch.setattr(AscendV1Saver, "finish_rank", broken)
        with pytest.raises(RuntimeError, match="disk gone"):
            main(args)
    state = ResumeState(tmp_path / ".out.partial")
    assert state.resume_point(1) == 7  # vision, embed, 4 layers, head, mtp.0: every unit was done
    # no unit follows the last one: its file keeps no samples' state (only the savers' and processors')
    assert torch.load(state.root / "rank0" / "unit00007.pt", weights_only=False)["states"] == []
    assert main([*args, "--resume"]) == 0
    assert_same_files(reference("cpu"), save)


def test_a_failure_after_the_merge_leaves_no_state_that_claims_to_be_resumable(tiny_k3_checkpoint, practice,
                                                                             tmp_path, monkeypatch, capsys):
    # the merge renames the shards the state counts: from there on nothing can be resumed, and nothing stays
    save = tmp_path / "out"
    args = command(tiny_k3_checkpoint, save, "cpu", practice)
    merge = AscendV1Saver.merge

    def merged_then_broken(self, metadata, extras=None):
        merge(self, metadata, extras)
        raise RuntimeError("disk gone after the merge")

    with monkeypatch.context() as patch:
        patch.setattr(AscendV1Saver, "merge", merged_then_broken)
        with pytest.raises(RuntimeError, match="after the merge"):
            main(args)
    assert os.listdir(tmp_path) == []
    assert "can be resumed" not in capsys.readouterr().err


def test_shards_written_behind_the_compute_give_the_same_output_and_states_that_count_durable_shards(
        tiny_k3_checkpoint, practice, reference, tmp_path, monkeypatch):
    """With background threads (an accelerator's run; forced here on the CPU) each unit's shards are written and
    made durable by the saver's writer thread while the next unit computes. Reference: the in-line run's output, byte
    for byte; and every resumable state counts only shards on disk whose checksum, read back, is the one it records."""
    from msmodelslim.core.files import file_checksum
    from msmodelslim.pipeline import launch

    writers, counted = set(), []
    real_write, real_save = AscendV1Saver._write, ResumeState.save

    def write(self, tensors, entry):
        writers.add(threading.current_thread().name)
        real_write(self, tensors, entry)

    def save(self, rank, unit, state, shards):
        assert all(file_checksum(self.work_dir / name) == digest for name, digest in shards.items())
        counted.append(len(shards))
        real_save(self, rank, unit, state, shards)

    monkeypatch.setattr(launch, "background_threads", lambda request, device: True)
    monkeypatch.setattr(AscendV1Saver, "_write", write)
    monkeypatch.setattr(ResumeState, "save", save)
    assert main(command(tiny_k3_checkpoint, tmp_path / "out", "cpu", practice)) == 0
    assert writers and all(name.startswith("shard-writer") for name in writers), writers
    assert counted and counted[-1] > counted[0] > 0  # the last state counts every shard of the rank
    assert_same_files(reference("cpu"), tmp_path / "out")


@pytest.mark.parametrize("behind", [False, True], ids=["written in line", "written behind the compute"])
def test_a_disk_full_mid_run_is_one_line_keeps_the_state_and_resumes(tiny_k3_checkpoint, practice, reference,
                                                                      tmp_path, monkeypatch, capsys, behind):
    # the saver's write of layers.2 fails the way safetensors reports a full disk (in line, or in the writer thread
    # of a run with background threads), and the file system then shows no free space (a stand-in: this host's disk
    # is not filled). Reference: one error line, exit 2, the state kept, and --resume (with space again) gives the
    # uninterrupted output.
    import shutil as shutil_mod

    from msmodelslim.pipeline import launch

    save = tmp_path / "out"
    args = command(tiny_k3_checkpoint, save, "cpu", practice)
    real_usage, real_write, full = shutil_mod.disk_usage, AscendV1Saver._write, []

    def write(self, tensors, entry):
        if any(".layers.2." in name for name in tensors):
            full.append(True)
            raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
        real_write(self, tensors, entry)

    monkeypatch.setattr(launch, "background_threads", lambda request, device: behind)
    with monkeypatch.context() as patch:
        patch.setattr(AscendV1Saver, "_write", write)
        patch.setattr(shutil_mod, "disk_usage", lambda p: real_usage(p)._replace(free=0) if full else real_usage(p))
        line = refused(args, capsys)
    assert re.search(r"the file system of \S+\.out\.partial is full \(0 MiB free\) after RuntimeError: Error "
                     r"while serializing: .*StorageFull.*; free space and continue with --resume", line), line
    assert ResumeState(tmp_path / ".out.partial").resume_point(1) is not None
    assert main([*args, "--resume"]) == 0
    assert_same_files(reference("cpu"), save)


def test_kimi_linear_mini_with_a_rank_killed_resumes_on_two_ranks(mini_runs, tmp_path):
    workspace = tmp_path / "work"
    workspace.mkdir()
    args = command(mini_runs.model, workspace / "out", "cpu:0,1", mini_runs.practice, "Kimi-Linear")
    resumes_after(args, "layers.3", "rank", workspace, mini_runs.two)


# --- refusals ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stopped(tiny_k3_checkpoint: Path, practice: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace with the state of a run on cpu:0,1 whose main process was killed (SIGKILL) after layers.0, as
    that stop leaves it: no output, the state alone, and a run that said how to resume (copied for each test)."""
    workspace = tmp_path_factory.mktemp("stopped")
    err = stop_after(command(tiny_k3_checkpoint, workspace / "out", "cpu:0,1", practice), "layers.0", "sigkill",
                     workspace)
    assert "--resume" in err and os.listdir(workspace) == [".out.partial"]  # the state, and no lock
    return workspace


@pytest.fixture
def state_copy(stopped: Path, tmp_path: Path) -> Path:
    shutil.copytree(stopped, tmp_path / "ws")
    return tmp_path / "ws"


def refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("msmodelslim: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    return errors[0]


def test_a_plain_run_that_meets_resumable_state_names_both_choices(tiny_k3_checkpoint, practice, state_copy, capsys):
    args = command(tiny_k3_checkpoint, state_copy / "out", "cpu:0,1", practice)
    line = refused(args, capsys)
    assert "continue it with --resume, or start over with --fresh" in line
    assert ResumeState(state_copy / ".out.partial").has_units()
    assert refused([*args, "--plan"], capsys) == line  # the plan makes the same check


def test_a_resume_drops_the_shard_a_killed_rank_was_writing(tiny_k3_checkpoint, practice, reference, state_copy):
    # safetensors writes a shard to .tmpXXXXXX beside the others and renames it when done: a rank killed mid-write
    # leaves one, which must not be published with the output. Reference: the uninterrupted output, bytes and names.
    (state_copy / ".out.partial" / ".tmpkAwrEQ").write_bytes(b"half a shard")
    assert main([*command(tiny_k3_checkpoint, state_copy / "out", "cpu:0,1", practice), "--resume"]) == 0
    assert_same_files(reference("cpu:0,1"), state_copy / "out")
    assert os.listdir(state_copy) == ["out"]  # the state went with the publish


def test_fresh_discards_the_state_and_starts_over(tiny_k3_checkpoint, practice, reference, state_copy):
    assert main([*command(tiny_k3_checkpoint, state_copy / "out", "cpu:0,1", practice), "--fresh"]) == 0
    assert_same_files(reference("cpu:0,1"), state_copy / "out")


def test_a_fresh_discard_cut_short_leaves_no_state_that_looks_resumable(tiny_k3_checkpoint, practice, reference,
                                                                        state_copy, monkeypatch, capsys):
    # the process dies after --fresh renamed the old state away, before deleting it; the next run cleans up
    from msmodelslim.app import quant as quant_mod

    real, calls = quant_mod._remove_output, []

    def dies_while_deleting(work_dir, *files):
        calls.append(work_dir)
        if work_dir is not None and work_dir.name.endswith(".discarded") and work_dir.exists():
            raise KeyboardInterrupt  # killed in the middle of the delete
        real(work_dir, *files)

    args = command(tiny_k3_checkpoint, state_copy / "out", "cpu:0,1", practice)
    with monkeypatch.context() as patch:
        patch.setattr(quant_mod, "_remove_output", dies_while_deleting)
        assert main([*args, "--fresh"]) == 130
    assert not ResumeState(state_copy / ".out.partial").has_units()
    assert "no interrupted run of --save_path" in refused([*args, "--resume"], capsys)
    assert main(args) == 0
    assert_same_files(reference("cpu:0,1"), state_copy / "out")
    assert os.listdir(state_copy) == ["out"]


def test_resume_refuses_another_rank_count(tiny_k3_checkpoint, practice, state_copy, capsys):
    line = refused([*command(tiny_k3_checkpoint, state_copy / "out", "cpu", practice), "--resume"], capsys)
    assert "belongs to another run: the rank count differs (state 2, now 1)" in line


def test_resume_refuses_another_practice(tiny_k3_checkpoint, practice, state_copy, tmp_path, capsys):
    other = tmp_path / "other.yaml"
    other.write_text(practice.read_text().replace("max_samples: 5", "max_samples: 4"))
    line = refused([*command(tiny_k3_checkpoint, state_copy / "out", "cpu:0,1", other), "--resume"], capsys)
    assert "belongs to another run: the practice differs" in line


def test_resume_refuses_another_checkpoint(tiny_k3_checkpoint, practice, state_copy, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_k3_checkpoint, model)
    index = model / "model.safetensors.index.json"
    index.write_text(index.read_text() + "\n")  # the same weights, another index: another source
    line = refused([*command(model, state_copy / "out", "cpu:0,1", practice), "--resume"], capsys)
    assert "belongs to another run: the checkpoint (--model_path) differs" in line


def test_resume_refuses_a_checkpoint_with_other_weights_but_the_same_config_and_index(tiny_k3_checkpoint, practice,
                                                                                      state_copy, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_k3_checkpoint, model)
    other_weights(model)
    line = refused([*command(model, state_copy / "out", "cpu:0,1", practice), "--resume"], capsys)
    assert "belongs to another run: the checkpoint (--model_path) differs" in line and "tensors_sha256" in line


def test_resume_refuses_a_truncated_state_file(tiny_k3_checkpoint, practice, state_copy, capsys):
    state = ResumeState(state_copy / ".out.partial")
    last = state.resume_point(2)
    for rank in range(2):
        path = state.root / f"rank{rank}" / f"unit{last:05d}.pt"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    line = refused([*command(tiny_k3_checkpoint, state_copy / "out", "cpu:0,1", practice), "--resume"], capsys)
    assert "the resumable state is damaged" in line and "--fresh" in line


def test_resume_refuses_a_damaged_state_file_that_is_still_a_valid_archive(tiny_k3_checkpoint, practice,
                                                                           state_copy, capsys):
    # one byte of a stored tensor flipped: the archive opens and unpickles, only its checksum tells
    state = ResumeState(state_copy / ".out.partial")
    path = state.root / "rank1" / f"unit{state.resume_point(2):05d}.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    line = refused([*command(tiny_k3_checkpoint, state_copy / "out", "cpu:0,1", practice), "--resume"], capsys)
    assert f"the resumable state is damaged ({path}: its checksum differs" in line and "--fresh" in line


def test_resume_refuses_a_truncated_shard_of_the_state(tiny_k3_checkpoint, practice, state_copy, capsys):
    shards = sorted((state_copy / ".out.partial").glob(".rank*-part*.safetensors"))
    assert shards
    shards[0].write_bytes(shards[0].read_bytes()[:-100])
    line = refused([*command(tiny_k3_checkpoint, state_copy / "out", "cpu:0,1", practice), "--resume"], capsys)
    assert f"the resumable state is damaged ({shards[0]}: its checksum differs" in line


def test_resume_without_state_says_so(tiny_k3_checkpoint, practice, tmp_path, capsys):
    line = refused([*command(tiny_k3_checkpoint, tmp_path / "out", "cpu", practice), "--resume"], capsys)
    assert "no interrupted run of --save_path" in line and os.listdir(tmp_path) == []


def test_a_spilled_run_that_keeps_its_state_every_second_unit_resumes_to_the_uninterrupted_output(
        tiny_k3_checkpoint, practice, reference, tmp_path, monkeypatch):
    # spec.resume_every 2: the state is kept after units 1, 3, 5, ... (embed, layers.1, ...) and the last. Killed
    # after layers.2 (unit 4, not kept), the run resumes after layers.1 and recomputes layers.2. With
    # $MSMODELSLIM_HOST_STATE_GIB=0 every micro-batch's state between units goes to a file (pipeline/spill.py), read
    # back memory-mapped: the kept units refer to those files, a decoder unit's files to the earlier ones that hold
    # the blocks it passed through, and the kept units' files survive while the others' go. Reference: the same
    # practice run uninterrupted and in memory, bytes.
    import torch
    import yaml

    from msmodelslim.pipeline.spill import BUDGET_ENV, SpillRef, map_state

    every = tmp_path.parent / f"{tmp_path.name}-every2.yaml"  # beside the workspace, whose listing is checked
    data = yaml.safe_load(practice.read_text())
    data["spec"]["resume_every"] = 2
    every.write_text(yaml.safe_dump(data, sort_keys=False))
    expected = reference("cpu", prac=every)
    monkeypatch.setenv(BUDGET_ENV, "0")
    args = command(tiny_k3_checkpoint, tmp_path / "out", "cpu", every)
    stop_after(args, "layers.2", "sigkill", tmp_path)
    kept = sorted(p.name for p in (tmp_path / ".out.partial").rglob("resume/rank0/unit*.pt"))
    assert kept and all(int(name[4:9]) % 2 == 1 for name in kept), kept
    spilled = list((tmp_path / ".out.partial").rglob("spill/unit*/*.pt"))
    assert spilled, "nothing spilled"
    references = []
    for path in spilled:
        map_state(torch.load(path, weights_only=False), lambda ref, _keys: references.append(ref), (SpillRef,))
    assert references, "no spilled state refers to an earlier file"
    assert main([*args, "--resume"]) == 0
    assert_same_files(expected, tmp_path / "out")
    assert os.listdir(tmp_path) == ["out"]  # the spilled state went with the resumable state


def test_the_spilled_state_on_disk_stays_within_the_plans_bound(tiny_k3_checkpoint, practice, tmp_path, monkeypatch):
    # Every state spills ($MSMODELSLIM_HOST_STATE_GIB=0). Measured after every spill file written: the tensor bytes
    # in the live spill files (a reference to an earlier file counts nothing; each file's own tensors, all of them)
    # but the vision unit's, whose outputs carry the records' pixels, which the plan does not count (float32 patches:
    # here 25x a token's hidden state, at Kimi-K3 scale ~2 % of it); reference: `--plan`'s host_state disk_bytes
    # for the same practice (app/plan.py), which the peak must not pass. The files are incremental: the peak stays
    # under two whole states, where writing each unit's whole state kept at least five.
    import torch

    from msmodelslim.app.quant import plan
    from msmodelslim.pipeline.spill import BUDGET_ENV, StateSpill, state_bytes

    monkeypatch.setenv(BUDGET_ENV, "0")
    args = QuantArgs(model_path=str(tiny_k3_checkpoint), save_path=str(tmp_path / "out"), device="cpu",
                     model_type="Kimi-K3", config_path=str(practice), trust_remote_code=True)
    planned = plan(args)
    estimate, tokens = planned["memory_per_rank"]["host_state"], planned["calibration"]["tokens"]
    peak, sizes = [0], {}
    keep = StateSpill.keep

    def measured_keep(self, *a, **kw):
        kept = keep(self, *a, **kw)
        if kept.path not in sizes:
            sizes[kept.path] = state_bytes(torch.load(kept.path, weights_only=False))
        peak[0] = max(peak[0], sum(size for path, size in sizes.items()
                                   if os.path.isfile(path) and Path(path).parent.name != "unit00000"))  # vision
        return kept

    monkeypatch.setattr(StateSpill, "keep", measured_keep)
    quant(args)
    assert 0 < peak[0] <= estimate["disk_bytes"], (peak[0], estimate)
    assert peak[0] < 2 * estimate["bytes_per_token"] * tokens, (peak[0], estimate)


# --- the files a practice reads are part of the run's identity -----------------------------------------------------
@pytest.fixture(scope="module")
def stopped_with_files(tiny_k3_checkpoint: Path, practice: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace holding a practice that reads two files besides itself, a fallback's names file (`names.yaml`,
    beside it) and its calibration set (`calib/index.jsonl`, relative to the working directory), and the state of a
    run of it on one CPU process killed after layers.0 (run from the workspace)."""
    import yaml

    workspace = tmp_path_factory.mktemp("stopped_files")
    data = yaml.safe_load(practice.read_text())
    data["spec"]["dataset"] = "calib/index.jsonl"
    data["spec"]["fallback"] = [{"to": "FLOAT", "names_file": "names.yaml"}]
    (workspace / "p.yaml").write_text(yaml.safe_dump(data))
    (workspace / "names.yaml").write_text("- language_model.model.layers.2.self_attn.o_proj\n")
    (workspace / "calib" / "images").mkdir(parents=True)
    image = REPO / "lab_calib" / "calibImages" / "images" / "bar_chart.png"
    (workspace / "calib" / "images" / image.name).write_bytes(image.read_bytes())
    (workspace / "calib" / "index.jsonl").write_text(
        f'{{"image": "images/{image.name}", "text": "Which bar is the tallest?"}}\n'
        '{"text": "Calibration needs some text too."}\n' * 2)
    stop_after(command(tiny_k3_checkpoint, workspace / "out", "cpu", workspace / "p.yaml"), "layers.0",
               "sigkill", workspace)
    return workspace


@pytest.mark.parametrize("edited", ["names.yaml", "calib/index.jsonl"])
def test_resume_refuses_a_file_the_practice_reads_edited_since_the_stop_and_keeps_the_state(
        tiny_k3_checkpoint, stopped_with_files, tmp_path, monkeypatch, capsys, edited):
    """The practice's bytes are the same; the names file gained a name (a typo), or a calibration record changed:
    the published output would match neither input. Reference: one line naming the file, the state untouched."""
    workspace = tmp_path / "ws"
    shutil.copytree(stopped_with_files, workspace)
    monkeypatch.chdir(workspace)
    path = workspace / edited
    path.write_text(path.read_text().replace("o_proj\n", "o_proj\n- language_model.model.layers.2.self_atn.q_proj\n")
                    if edited == "names.yaml" else path.read_text().replace("tallest", "shortest"))
    before = sorted(str(p.relative_to(workspace)) for p in (workspace / ".out.partial").rglob("*"))
    line = refused([*command(tiny_k3_checkpoint, workspace / "out", "cpu", workspace / "p.yaml"), "--resume"],
                   capsys)
    name = ("spec.fallback[0].names_file names.yaml" if edited == "names.yaml"
            else "the calibration dataset (spec.dataset)")
    assert f"belongs to another run: {name} differs (its content)" in line, line
    assert sorted(str(p.relative_to(workspace)) for p in (workspace / ".out.partial").rglob("*")) == before


def test_a_resume_refused_for_input_found_bad_mid_run_keeps_the_state(tiny_k3_checkpoint, stopped_with_files,
                                                                     tmp_path, monkeypatch, capsys):
    """A resume whose own run stops on a bad input (here the linear plan refuses, as it does for a fallback glob
    that names no linear) leaves the interrupted run's state as it was, so that a fixed input resumes."""
    from msmodelslim.errors import UserError
    from msmodelslim.pipeline import launch

    workspace = tmp_path / "ws"
    shutil.copytree(stopped_with_files, workspace)
    monkeypatch.chdir(workspace)
    args = [*command(tiny_k3_checkpoint, workspace / "out", "cpu", workspace / "p.yaml"), "--resume"]

    def refuses(*a, **k):
        raise UserError("spec.fallback[0]: 'language_model.model.layers.2.self_atn.q_proj' names none of the "
                        "model's quantized linears")

    before = sorted(str(p.relative_to(workspace)) for p in (workspace / ".out.partial").rglob("*"))
    with monkeypatch.context() as patch:
        patch.setattr(launch, "prepare_run", refuses)
        assert "names none of the model's quantized linears" in refused(args, capsys)
    assert sorted(str(p.relative_to(workspace)) for p in (workspace / ".out.partial").rglob("*")) == before
    assert main(args) == 0 and (workspace / "out" / "quant_model_description.json").is_file()
