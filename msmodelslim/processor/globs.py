"""The one include / exclude rule of the processors: fnmatch globs on a checkpoint name (without `.weight`).

A list is compiled once: its plain names go into a set and its patterns into one regular expression, so a list of
thousands of names (a fallback of every linear of a layer range) costs a lookup per name, not a loop over the list.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence

_WILDCARD = re.compile(r"[*?\[]")
# Patterns are tried one by one for every linear (~150k in Kimi-K3): a few hundred cost seconds, thousands minutes.
# Plain names have no such limit (a set).
MAX_PATTERNS = 512


def check_globs(globs: list[object]) -> None:
    """At most MAX_PATTERNS patterns (ValueError)."""
    patterns = [g for g in globs if isinstance(g, str) and _WILDCARD.search(g)]
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"{len(patterns)} glob patterns, above the limit of {MAX_PATTERNS} (each is tried "
                         "on every linear); list plain names, or merge patterns (e.g. '*layers.1[0-9].*')")


_Compiled = tuple[frozenset[str], "re.Pattern[str] | None"]
# by the list object (a config's list is built once and never changes), holding it so that its id is not reused
_CACHE: dict[int, tuple[Sequence[str], _Compiled]] = {}


def _compile(globs: Sequence[str]) -> _Compiled:
    names = frozenset(g for g in globs if not _WILDCARD.search(g))
    patterns = sorted({g for g in globs if g not in names})
    return names, re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in patterns)) if patterns else None


def _compiled(globs: Sequence[str]) -> _Compiled:
    entry = _CACHE.get(id(globs))
    if entry is None or entry[0] is not globs:
        if len(_CACHE) > 1024:
            _CACHE.clear()
        entry = _CACHE[id(globs)] = (globs, _compile(globs))
    return entry[1]


def any_match(name: str, globs: Sequence[str]) -> bool:
    names, pattern = _compiled(globs)
    return name in names or (pattern is not None and pattern.match(name) is not None)


def matching(name: str, globs: Sequence[str]) -> list[str]:
    """The globs that match `name` (case-sensitive, as checkpoint names are)."""
    return [g for g in globs if fnmatch.fnmatchcase(name, g)] if any_match(name, globs) else []


def selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """Some include glob matches and no exclude glob does."""
    return any_match(name, include) and not any_match(name, exclude)
