"""core.resources: config/, lab_practice/ and lab_calib/ are found in a source checkout and inside a built wheel
(as msmodelslim/resources/<kind>/). The wheel is built from a copy of the sources (no build files in the tree)
and unpacked; the reference is the list of files under the top-level folders of this checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from msmodelslim.core.resources import RESOURCE_KINDS, resource_path

REPO = Path(__file__).resolve().parents[2]


def shipped_files() -> set[str]:
    files = set()
    for kind in RESOURCE_KINDS:
        for path in (REPO / kind).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                files.add(f"msmodelslim/resources/{path.relative_to(REPO).as_posix()}")
    return files


def test_source_checkout_uses_top_level_folders():
    for kind in RESOURCE_KINDS:
        assert resource_path(kind) == REPO / kind
    with pytest.raises(ValueError, match="unknown resource kind"):
        resource_path("models")


def test_wheel_ships_every_resource_file_and_resolves_them(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src)
    for name in ("msmodelslim", *RESOURCE_KINDS):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ".",
                            "-w", str(tmp_path / "dist")], cwd=src, check=True, capture_output=True, text=True)
    assert "Warning" not in build.stdout + build.stderr, build.stderr[-2000:]  # e.g. setuptools' "would be ignored"
    (wheel,) = (tmp_path / "dist").glob("msmodelslim-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path / "site")
    expected = shipped_files()
    assert expected <= names, sorted(expected - names)
    assert "msmodelslim/resources/config/config.ini" in names
    assert sum(n.endswith(".png") for n in names) == 16
    # Installed layout: no setup.py beside the package, so the packaged copies are used.
    code = ("from msmodelslim.core.resources import resource_path as r;"
            "from msmodelslim.model.registry import resolve_model_type as m;"
            "print(r('lab_practice')); print(r('lab_calib')); print(m('Kimi-K3').group)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    site = tmp_path / "site" / "msmodelslim" / "resources"
    assert out.stdout.split() == [str(site / "lab_practice"), str(site / "lab_calib"), "kimi_k3"]
