"""Errors caused by what the user asked for (arguments, files, YAML): shown as one line, exit status 2.

Any layer may raise `UserError`; the CLI prints `error: <message>` without a traceback. Everything else is a bug
or an environment failure and keeps its traceback (exit status 1).
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user; the message names the offending file, key or value."""


class ResumableError(UserError):
    """Bad input from the environment that the user fixes outside the run (a full disk): one line and exit status 2
    like any UserError, but the run's resumable state is kept, and `--resume` continues once it is fixed."""


class Terminated(BaseException):
    """SIGTERM received: unwinds like KeyboardInterrupt (cleanup runs), and the CLI exits 143."""

    def __init__(self, signum: int = 15) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


class RankLost(RuntimeError):
    """A collective failed because another rank stopped or cannot be reached. This rank stops with one line and
    exit status 1; the rank that failed first says why (the built-in launcher reports that one)."""


def shown(value: object, limit: int = 80) -> str:
    """`repr(value)` for a message (control characters come out escaped, also inside lists), cut to `limit`
    characters so that a huge value cannot flood the one error line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} characters)"
