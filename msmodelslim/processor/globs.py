"""The one include / exclude rule of the processors: fnmatch globs on a checkpoint name (without `.weight`)."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence


def matching(name: str, globs: Sequence[str]) -> list[str]:
    """The globs that match `name` (case-sensitive, as checkpoint names are)."""
    return [g for g in globs if fnmatch.fnmatchcase(name, g)]


def selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """Some include glob matches and no exclude glob does."""
    return bool(matching(name, include)) and not matching(name, exclude)
