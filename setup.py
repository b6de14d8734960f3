"""The packages of the wheel (the metadata is in pyproject.toml).

config/, lab_practice/ and lab_calib/ stay at the top level, where msModelSlim users look for them, and ship as
msmodelslim/resources/<folder>/ (msmodelslim.core.resources.resource_path finds either place). Every folder below
them is a package of its own, so that setuptools installs its files without a "would be ignored" warning each.
"""

import sys
from pathlib import Path

from setuptools import find_packages, setup

RESOURCES = {  # folder -> the file kinds it ships
    "config": ("*.ini",),
    "lab_practice": ("*.md", "*.yaml"),
    "lab_calib": ("*.md", "*.py", "*.jsonl", "*.png"),
}
HERE = Path(__file__).resolve().parent


def resource_packages() -> dict[str, tuple[str, tuple[str, ...]]]:
    """package -> (its folder, relative to the checkout; the globs of its files)."""
    packages = {}
    for folder, kinds in RESOURCES.items():
        for directory in sorted([HERE / folder, *(p for p in (HERE / folder).rglob("*") if p.is_dir())]):
            if "__pycache__" in directory.parts:
                continue
            rel = directory.relative_to(HERE)
            packages[".".join(("msmodelslim", "resources", *rel.parts))] = (rel.as_posix(), kinds)
    return packages


# An editable install imports from the checkout, where resource_path finds the folders in place; mapping them would
# make setuptools install an import hook (and warn about it) instead of a plain path entry.
RESOURCE_PACKAGES = {} if "editable_wheel" in sys.argv else resource_packages()
setup(
    packages=find_packages(include=["msmodelslim", "msmodelslim.*"]) + list(RESOURCE_PACKAGES),
    package_dir={"": ".", **{name: folder for name, (folder, _) in RESOURCE_PACKAGES.items()}},
    package_data={**{name: list(kinds) for name, (_, kinds) in RESOURCE_PACKAGES.items()},
                  "msmodelslim.core": ["ascend_a2a3_rules.json"], "msmodelslim.app": ["plan_records.json"]},
)
