"""Stopping a run stops all of it: SIGINT / SIGTERM / SIGKILL of the main process, on one device and on two ranks,
leave no process, no output, no lock and no failure folder, and exit 130 / 143; the temporary output stays only as
a run's resumable state, and then the run says how to resume it. Here SIGINT and SIGTERM of a run on two ranks; the
stops test/runner/test_resume.py makes and resumes (SIGTERM of a one-process run, SIGKILL of the main process of two
ranks, SIGKILL of a rank) are checked the same way by its `stop_after`. A preset MASTER_ADDR / MASTER_PORT is
honoured, and a rendezvous that cannot happen fails with one line, not a hang.

Reference: exit statuses, the process table (every process of a run carries a marker in its environment), and
listings of the save directory's parent and of the run's private TMPDIR. Real `msmodelslim quant` subprocesses.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from msmodelslim.core.signals import sigterm_raises
from msmodelslim.pipeline.resume import ResumeState

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)

MARKER_ENV = "MSMODELSLIM_TEST_MARKER"


def marked_processes(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if f"{MARKER_ENV}={marker}".encode() in environ.split(b"\0") and state != "Z":
            found.append(int(proc.name))
    return found


class Run:
    """`msmodelslim quant` in a subprocess, its stderr collected line by line."""

    def __init__(self, model: Path, workspace: Path, device: str, env: dict[str, str] | None = None) -> None:
        self.marker = uuid.uuid4().hex
        self.workspace = workspace
        self.tmp = workspace.parent / "tmp"
        self.tmp.mkdir(exist_ok=True)
        full_env = {**os.environ, MARKER_ENV: self.marker, "TMPDIR": str(self.tmp), "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        cmd = [sys.executable, "-m", "msmodelslim.cli.main", "quant", "--model_path", str(model),
               "--save_path", str(workspace / "out"), "--device", device, "--model_type", "Kimi-K3",
               "--quant_type", "w4a8", "--trust_remote_code", "True"]
        self.proc = subprocess.Popen(cmd, env=full_env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"never saw {text!r}; stderr:\n" + "".join(self.lines[-30:]))
            time.sleep(0.1)

    def finish(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def assert_nothing_left(self, resumable_allowed: bool = False) -> None:
        """No process, no lock, no failure folder, no output; with `resumable_allowed`, the temporary output may
        stay when it holds resumable state (a unit every rank finished), and then the run said how to resume."""
        deadline = time.monotonic() + 15
        while marked_processes(self.marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marked_processes(self.marker) == [], "processes of the run are still alive"
        self._reader.join(5)  # every writer of the pipe is gone: read what they said to its end
        left = sorted(os.listdir(self.workspace))
        if resumable_allowed and left == [".out.partial"]:
            state = ResumeState(self.workspace / ".out.partial")
            assert state.recorded_fingerprint() and state.has_units(), "a temporary output without resumable state"
            assert any("--resume" in line for line in self.lines), "".join(self.lines[-10:])
        else:
            assert left == [], f"left in the save parent: {left}"
        assert [p for p in os.listdir(self.tmp) if p.startswith("msmodelslim-")] == []


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_the_main_process_stops_every_rank_and_removes_the_output(tiny_k3_checkpoint, workspace, signum,
                                                                            code):
    port = free_port()
    run = Run(tiny_k3_checkpoint, workspace, "cpu:0,1", env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    run.wait_for("rank 1/2 holds experts")  # both ranks are up and computing
    assert any(f"ranks meet at 127.0.0.1:{port} (from MASTER_ADDR/MASTER_PORT)" in line for line in run.lines)
    time.sleep(1.0)
    run.proc.send_signal(signum)
    assert run.finish() == code
    run.assert_nothing_left(resumable_allowed=True)


def test_rendezvous_that_cannot_happen_fails_with_one_line(tiny_k3_checkpoint, workspace):
    # MASTER_PORT held by a listener that is no rendezvous store: rank 0 cannot serve it, rank 1 cannot use it
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        start = time.monotonic()
        run = Run(tiny_k3_checkpoint, workspace, "cpu:0,1",
                  env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "MSMODELSLIM_RENDEZVOUS_TIMEOUT": "5"})
        code = run.finish(timeout=120)
    assert code == 2, "".join(run.lines[-20:])
    errors = [line for line in run.lines if line.startswith("msmodelslim: error: ")]
    assert len(errors) == 1 and "Traceback" not in "".join(run.lines), "".join(run.lines[-20:])
    assert f"no rendezvous at 127.0.0.1:{port} (from MASTER_ADDR/MASTER_PORT) within 5 s" in errors[0]
    assert time.monotonic() - start < 90
    run.assert_nothing_left()


def test_a_second_signal_during_cleanup_on_a_slow_file_system_does_not_cut_it_short(tmp_path, monkeypatch):
    # The cleanup's first step (is the state resumable?) is slowed to 0.5 s, a stand-in for a slow shared file
    # system, and a second SIGTERM arrives in the middle of it. Reference: the temporary output is gone and the run
    # ends with the first signal's Terminated.
    from msmodelslim.app import quant as quant_mod
    from msmodelslim.errors import Terminated

    work_dir = tmp_path / ".out.partial"
    (work_dir / "resume").mkdir(parents=True)
    (work_dir / "half-written.safetensors").write_bytes(b"0" * 1000)
    slow = quant_mod.ResumeState.resume_point

    def slow_resume_point(self, world):
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        time.sleep(0.5)
        return slow(self, world)

    monkeypatch.setattr(quant_mod.ResumeState, "resume_point", slow_resume_point)
    with pytest.raises(Terminated), sigterm_raises() as stop, quant_mod._on_failure(stop, work_dir, 1):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert os.listdir(tmp_path) == []


def test_a_signal_while_a_failed_rank_prints_its_last_line_neither_kills_it_nor_raises(tmp_path):
    # torchrun's agent signals every rank once one died; a survivor that already unwound (it lost its peer) may get
    # that SIGTERM while it says so. Reference: the subprocess's exit status and stderr; the SIGTERM is sent from
    # inside the write of the last line, so the signal lands in the window under test on every run.
    script = tmp_path / "last_line.py"
    script.write_text(
        "import os, signal, sys\n"
        "from msmodelslim.cli import main as cli\n"
        "from msmodelslim.errors import RankLost\n"
        "class Err:\n"
        "    def write(self, text):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        sys.__stderr__.write(text)\n"
        "    def flush(self):\n"
        "        sys.__stderr__.flush()\n"
        "def lost(argv):\n"
        "    raise RankLost('rank 1 is gone')\n"
        "cli._run = lost\n"
        "sys.stderr = Err()\n"
        "sys.exit(cli.main(['quant']))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert done.stderr.splitlines() == ["msmodelslim: error: rank 1 is gone"], done.stderr[-2000:]
