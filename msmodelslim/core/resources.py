"""Where config/, lab_practice/ and lab_calib/ are: the repository top level (source checkout, editable install)
or `msmodelslim/resources/<kind>/` inside an installed wheel (setup.py maps the top-level folders there)."""

from __future__ import annotations

from pathlib import Path

import msmodelslim

RESOURCE_KINDS = ("config", "lab_practice", "lab_calib")

_PACKAGE_DIR = Path(msmodelslim.__file__).resolve().parent


def resource_path(kind: str) -> Path:
    """Directory of resource `kind` (one of config, lab_practice, lab_calib)."""
    if kind not in RESOURCE_KINDS:
        raise ValueError(f"unknown resource kind {kind!r}; expected one of {', '.join(RESOURCE_KINDS)}")
    checkout = _PACKAGE_DIR.parent
    # A source checkout has setup.py beside the package; a site-packages directory does not.
    if (checkout / "setup.py").is_file() and (checkout / kind).is_dir():
        return checkout / kind
    packaged = _PACKAGE_DIR / "resources" / kind
    if packaged.is_dir():
        return packaged
    raise FileNotFoundError(f"msmodelslim resource folder {kind!r} not found (looked in {checkout} and {packaged})")
