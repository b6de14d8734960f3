"""The one include / exclude rule of the processors: fnmatch globs on a checkpoint name (without `.weight`).

A list is compiled once: its plain names go into a set, its patterns of one trailing star (`<prefix>*`, how a fused
group falls back) and of one leading star (`*<suffix>`) into sets by length, and the rest into one regular
expression. A list of thousands of names costs a lookup per name, not a loop over the list, and a few hundred prefix
or suffix patterns a lookup per distinct length (one expression of 400 `*...` patterns took 18 s over Kimi-K3's
~250k linears).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass

WILDCARD = re.compile(r"[*?\[]")
# Patterns are tried one by one for every linear (~150k in Kimi-K3): a few hundred cost seconds, thousands minutes.
# Plain names have no such limit (a set).
MAX_PATTERNS = 512


def check_globs(globs: list[object]) -> None:
    """At most MAX_PATTERNS patterns (ValueError)."""
    patterns = [g for g in globs if isinstance(g, str) and WILDCARD.search(g)]
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"{len(patterns)} glob patterns, above the limit of {MAX_PATTERNS} (each is tried "
                         "on every linear); list plain names, or merge patterns (e.g. '*layers.1[0-9].*')")


@dataclass(frozen=True)
class _Compiled:
    names: frozenset[str]
    prefixes: dict[int, frozenset[str]]  # length -> the literal prefixes of `<prefix>*` patterns of that length
    suffixes: dict[int, frozenset[str]]  # likewise of `*<suffix>` patterns
    rest: re.Pattern[str] | None

    def match(self, name: str) -> bool:
        return (name in self.names
                or any(name[:n] in heads for n, heads in self.prefixes.items())
                or any(len(name) >= n and name[len(name) - n:] in tails for n, tails in self.suffixes.items())
                or (self.rest is not None and self.rest.match(name) is not None))


# by the list object (a config's list is built once and never changes), holding it so that its id is not reused
_CACHE: dict[int, tuple[Sequence[str], _Compiled]] = {}


def _by_length(literals: set[str]) -> dict[int, frozenset[str]]:
    lengths: dict[int, set[str]] = {}
    for literal in literals:
        lengths.setdefault(len(literal), set()).add(literal)
    return {n: frozenset(v) for n, v in sorted(lengths.items())}


def _compile(globs: Sequence[str]) -> _Compiled:
    names = frozenset(g for g in globs if not WILDCARD.search(g))
    patterns = {g for g in globs if g not in names}
    prefixes = {g[:-1] for g in patterns if g.endswith("*") and not WILDCARD.search(g[:-1])}
    suffixes = {g[1:] for g in patterns if g.startswith("*") and not WILDCARD.search(g[1:])}
    rest = sorted(patterns - {p + "*" for p in prefixes} - {"*" + s for s in suffixes})
    return _Compiled(names, _by_length(prefixes), _by_length(suffixes),
                     re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in rest)) if rest else None)


def _compiled(globs: Sequence[str]) -> _Compiled:
    entry = _CACHE.get(id(globs))
    if entry is None or entry[0] is not globs:
        if len(_CACHE) > 1024:
            _CACHE.clear()
        entry = _CACHE[id(globs)] = (globs, _compile(globs))
    return entry[1]


def any_match(name: str, globs: Sequence[str]) -> bool:
    return _compiled(globs).match(name)


def matching(name: str, globs: Sequence[str]) -> list[str]:
    """The globs that match `name` (case-sensitive, as checkpoint names are)."""
    return [g for g in globs if fnmatch.fnmatchcase(name, g)] if any_match(name, globs) else []


def selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """Some include glob matches and no exclude glob does."""
    return any_match(name, include) and not any_match(name, exclude)
