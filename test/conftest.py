"""Fixtures shared by the whole suite: the one generated tiny Kimi-K3 checkpoint of a session; the `slow` marker.

Tiers: `make test` runs everything (CI); `make test-fast` (`pytest -m "not slow"`) leaves out the tests marked
`slow`: whole quantization runs in subprocesses or on several ranks, and the consumer tests' outputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a whole quantization run (subprocess, several ranks, the consumer "
                                       "outputs); left out by `make test-fast`")
MAKE_CHECKPOINT = REPO / "example" / "multimodal_vlm" / "Kimi-K3" / "make_checkpoint.py"


@pytest.fixture(scope="session")
def tiny_k3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset of the stand-in (seed 0), generated once per session. Read-only: copy it to damage it."""
    out = tmp_path_factory.mktemp("ckpt") / "Kimi-K3-tiny"
    subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--preset", "tiny", "--out", str(out)], check=True,
                   capture_output=True)
    return out
