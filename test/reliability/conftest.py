"""The reliability tests' broken inputs start from a writable copy of the session's tiny Kimi-K3 checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture
def broken_copy(tiny_k3_checkpoint: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a writable copy of the checkpoint, a workspace that is also the parent of --save_path)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_k3_checkpoint, model)
    workspace = tmp_path / "work"
    workspace.mkdir()
    return model, workspace
