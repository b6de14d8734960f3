"""Runs under torchrun (CPU, gloo): one rank per process, the ranks meet through torchrun's environment.

References: the output of the same command on two spawned processes (`--device cpu:0,1`, the same rank count: every
tensor byte for byte, the description equal: `assert_same_bytes`); for failures, exit statuses, the `msmodelslim: error:` lines, the process table (every process
of a run carries a marker in its environment) and a listing of the save directory's parent. Real torchrun
subprocesses (`python -m torch.distributed.run`), the shipped W4A8 practice shrunk to 5 samples of 96 tokens.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from reliability.faults import other_weights

from msmodelslim.app.quant import QuantArgs, quant
from msmodelslim.core.device import parse_device
from msmodelslim.core.torchrun import TorchrunRank
from msmodelslim.errors import UserError

from .dp_helpers import REPO, assert_same_bytes, shrunken_practice

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)

MARKER_ENV = "MSMODELSLIM_TEST_MARKER"


@pytest.fixture(scope="module")
def practice(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shrunken_practice(REPO / "lab_practice/kimi_k3/kimi_k3_w4a8.yaml",
                             tmp_path_factory.mktemp("practice") / "p.yaml", max_samples=5, max_seq_len=96)


@pytest.fixture(scope="module")
def single(tiny_k3_checkpoint: Path, practice: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of two spawned processes, which every torchrun layout of two ranks must reproduce byte for byte
    (the same rank count: test_data_parallel.py says what another count may change)."""
    out = tmp_path_factory.mktemp("single") / "out"
    quant(QuantArgs(model_path=str(tiny_k3_checkpoint), save_path=str(out), device="cpu:0,1", model_type="Kimi-K3",
                    config_path=str(practice), trust_remote_code=True))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(launch: list[str], model: Path, save_path: str, practice: Path, cwd: Path, marker: str = "",
             *extra: str, hide: Path | None = None, node: int | None = None) -> subprocess.Popen:
    """`torchrun LAUNCH -m msmodelslim.cli.main quant ...`; with `hide`, in a mount namespace of its own where that
    folder is an empty tmpfs (a node that does not see the shared file system); with `node` (of 2), bound to that
    node's half of this host's cores, as a node has cores of its own (both on all of them: twice the threads)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "msmodelslim.cli.main", "quant",
           "--model_path", str(model), "--save_path", save_path, "--device", "cpu", "--model_type", "Kimi-K3",
           "--config_path", str(practice), "--trust_remote_code", "True", *extra]
    if hide is not None:
        cmd = ["unshare", "--mount", "sh", "-c", f'mount -t tmpfs none "{hide}" && exec "$@"', "sh", *cmd]
    env = {**os.environ, MARKER_ENV: marker or uuid.uuid4().hex, "PYTHONUNBUFFERED": "1"}
    cores = sorted(os.sched_getaffinity(0))
    bind = None if node is None else (lambda: os.sched_setaffinity(0, cores[node::2] or cores))
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=bind)


def two_nodes(port: int) -> list[list[str]]:
    """`torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --rdzv-endpoint 127.0.0.1:PORT`, R = 0, 1."""
    return [["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test"] for r in range(2)]


def finish(*procs: subprocess.Popen, timeout: float = 240) -> list[tuple[int, str]]:
    return [(p.wait(timeout), p.stdout.read()) for p in procs]


def test_two_nodes_of_one_process_give_the_single_process_output(tiny_k3_checkpoint, practice, single, tmp_path):
    procs = [torchrun(launch, tiny_k3_checkpoint, str(tmp_path / "out"), practice, tmp_path, node=node)
             for node, launch in enumerate(two_nodes(free_port()))]
    for code, log in finish(*procs):
        assert code == 0, log[-3000:]
    assert assert_same_bytes(single, tmp_path / "out") > 100
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no lock, no temporary folder, no token left


def can_hide_a_folder() -> bool:
    """Mount namespaces (root, or a kernel that allows them): the stand-in for a node without the shared folder."""
    try:
        return subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs none /mnt"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not can_hide_a_folder(), reason="needs `unshare --mount` (root) to give one node its own view")
def test_a_save_path_one_node_does_not_see_stops_every_rank_before_any_compute(tiny_k3_checkpoint, practice,
                                                                              tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    node0, node1 = two_nodes(free_port())
    procs = [torchrun(node0, tiny_k3_checkpoint, str(shared / "out"), practice, tmp_path, node=0),
             torchrun(node1, tiny_k3_checkpoint, str(shared / "out"), practice, tmp_path, hide=shared, node=1)]
    for code, log in finish(*procs):
        errors = [line for line in log.splitlines() if line.startswith("msmodelslim: error: ")]
        assert code != 0 and len(errors) == 1, log[-3000:]
        assert "must be one directory that every node sees" in errors[0] and "rank 1 on" in errors[0]
        assert "holds experts" not in log  # stopped before loading a weight
    assert os.listdir(shared) == []


def test_a_node_with_other_weights_stops_every_rank_before_any_compute(tiny_k3_checkpoint, practice, tmp_path):
    # node 1's copy: the same config.json and index, one tensor's values changed (another revision)
    other = tmp_path / "node1_model"
    shutil.copytree(tiny_k3_checkpoint, other)
    other_weights(other)
    node0, node1 = two_nodes(free_port())
    procs = [torchrun(node0, tiny_k3_checkpoint, str(tmp_path / "out"), practice, tmp_path, node=0),
             torchrun(node1, other, str(tmp_path / "out"), practice, tmp_path, node=1)]
    for code, log in finish(*procs):
        errors = [line for line in log.splitlines() if line.startswith("msmodelslim: error: ")]
        assert code != 0 and len(errors) == 1, log[-3000:]
        assert "rank 1 on" in errors[0] and "reads another input than rank 0: the checkpoint (--model_path) " \
            "differs (its tensors_sha256)" in errors[0], errors[0]
        assert "holds experts" not in log  # stopped before loading a weight
    assert sorted(os.listdir(tmp_path)) == ["node1_model"]


def calibration_set(folder: Path, text: str) -> None:
    """`folder/calib/index.jsonl`: one image record of lab_calib/calibImages with `text`."""
    (folder / "calib" / "images").mkdir(parents=True)
    image = REPO / "lab_calib" / "calibImages" / "images" / "bar_chart.png"
    (folder / "calib" / "images" / image.name).write_bytes(image.read_bytes())
    (folder / "calib" / "index.jsonl").write_text(f'{{"image": "images/{image.name}", "text": "{text}"}}\n' * 2)


@pytest.mark.parametrize("differs", ["practice", "calibration dataset"])
def test_ranks_started_with_other_inputs_stop_before_any_compute_naming_what_differs(tiny_k3_checkpoint, practice,
                                                                                    tmp_path, differs):
    """Node 1 starts with a practice of other bytes, or with the same practice whose relative spec.dataset finds
    other records from its working directory: either would make a mixed output."""
    import yaml

    data = yaml.safe_load(practice.read_text())
    data["spec"]["dataset"] = "calib/index.jsonl"
    practices = [tmp_path / "p0.yaml", tmp_path / "p1.yaml"]
    practices[0].write_text(yaml.safe_dump(data))
    practices[1].write_text(yaml.safe_dump(data) + ("# edited on node 1\n" if differs == "practice" else ""))
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        calibration_set(tmp_path / f"node{node}", "What is shown?" if node == 0 or differs == "practice"
                        else "What else is shown?")
    launches = two_nodes(free_port())
    procs = [torchrun(launches[node], tiny_k3_checkpoint, str(tmp_path / "out"), practices[node],
                      tmp_path / f"node{node}", node=node) for node in (0, 1)]
    expected = "the practice differs (its bytes)" if differs == "practice" else \
        "the calibration dataset (spec.dataset) differs (its content)"
    for code, log in finish(*procs):
        errors = [line for line in log.splitlines() if line.startswith("msmodelslim: error: ")]
        assert code != 0 and len(errors) == 1, log[-3000:]
        assert "rank 1 on" in errors[0] and f"reads another input than rank 0: {expected}" in errors[0], errors[0]
        assert "holds experts" not in log  # stopped before loading a weight
    assert not (tmp_path / "out").exists()


def marked(marker: str) -> dict[int, int]:
    """pid -> RANK of the live msmodelslim processes of the run carrying `marker`."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0") if "=" in item)
            state = (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            cmdline = (proc / "cmdline").read_text()
        except (OSError, ValueError):
            continue
        if env.get(MARKER_ENV) == marker and "RANK" in env and "msmodelslim.cli.main" in cmdline and state != "Z":
            found[int(proc.name)] = int(env["RANK"])
    return found


@pytest.mark.parametrize("victim", [0, 1], ids=["rank 0, which holds the output", "rank 1"])
def test_a_killed_rank_stops_every_rank_and_the_run_resumes_under_torchrun(tiny_k3_checkpoint, practice, single,
                                                                          tmp_path, victim):
    marker = uuid.uuid4().hex
    proc = torchrun(["--nproc-per-node", "2"], tiny_k3_checkpoint, str(tmp_path / "out"), practice, tmp_path, marker,
                    "--log_level", "debug")
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.rstrip().endswith("unit layers.0 done"):
                done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert done.wait(180), "".join(lines[-20:])  # every unit's state is kept before that line
    os.kill(next(pid for pid, rank in marked(marker).items() if rank == victim), signal.SIGKILL)
    assert proc.wait(120) != 0
    reader.join(10)
    log = "".join(lines)
    survivor = [line for line in log.splitlines() if line.startswith("msmodelslim: ")]
    assert len(survivor) == 1, log[-3000:]  # the survivor's one line (terminated, or the peer it lost)
    ours = [line for line in log.splitlines() if 'File "' in line and f"{os.sep}msmodelslim{os.sep}" in line]
    assert not ours, log[-3000:]  # no traceback through the toolkit (torchrun prints its own report)
    deadline = time.monotonic() + 15
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked(marker) == {}
    # nothing published: the run's resumable state (rank 0 finished layers.0, rank 1 at least embed), and the way on
    assert os.listdir(tmp_path) == [".out.partial"] and "--resume" in log, log[-2000:]
    # the resumed run on one host, both processes under one torchrun: the single-process output
    (code, log), = finish(torchrun(["--nproc-per-node", "2"], tiny_k3_checkpoint, str(tmp_path / "out"), practice,
                                   tmp_path, "", "--resume"))
    assert code == 0, log[-3000:]
    assert "torchrun rank 1 of 2 (local 1 of 2) done" in log and "(2 processes, gloo, torchrun)" in log
    assert assert_same_bytes(single, tmp_path / "out") > 100 and os.listdir(tmp_path) == ["out"]


def test_the_torchrun_environment_places_the_rank(monkeypatch):
    for name, value in {"TORCHELASTIC_RUN_ID": "job", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    place = TorchrunRank.from_environment()
    assert place == TorchrunRank(3, 4, 1, 2, "10.0.0.1:29500")
    spec = parse_device("cpu:0,1", place)
    assert spec.world_size == 4 and spec.indices == (1,)
    with pytest.raises(UserError, match=r"names 3 device\(s\), but torchrun starts 2 process\(es\) per node"):
        parse_device("cpu:0,1,2", place)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(UserError, match="inconsistent: RANK=3 WORLD_SIZE=4 LOCAL_RANK=2 LOCAL_WORLD_SIZE=2"):
        TorchrunRank.from_environment()
    monkeypatch.delenv("RANK")
    with pytest.raises(UserError, match=r"\$RANK is not"):
        TorchrunRank.from_environment()


def test_without_torchrun_the_built_in_launcher_stays(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # a preset rendezvous alone is no torchrun launch
    assert TorchrunRank.from_environment() is None
