"""Logging set-up shared by the CLI and the processes it spawns.

The CLI resolves the level (`--log_level`, else `$MSMODELSLIM_LOG_LEVEL`, else info) and exports it in
`$MSMODELSLIM_LOG_LEVEL`, so a spawned worker calls `configure_logging(rank=r)` and logs at the same level.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import warnings

from tqdm import tqdm

from msmodelslim.errors import UserError

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_LEVEL_ENV = "MSMODELSLIM_LOG_LEVEL"
_FLA_CPU_WARNING = "Triton is not supported on current platform"
# C0 and C1 controls and DEL: a tag or a file name holding them could move the cursor, clear the screen or, with a
# newline, forge a log line of its own
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escape_controls(text: str, keep_newlines: bool = False) -> str:
    """`text` with control characters as `\\xNN` escapes (newlines and tabs kept when `keep_newlines`)."""
    return _CONTROL.sub(lambda m: m.group() if keep_newlines and m.group() in "\n\t" else
                        m.group().encode("unicode_escape").decode("ascii"), text)


class _Formatter(logging.Formatter):
    """Our own multi-line messages keep their lines; values inside them cannot add lines: every line after the
    first is indented, so a line of its own always starts with the time."""

    def format(self, record: logging.LogRecord) -> str:
        text = escape_controls(super().format(record), keep_newlines=True)
        return text.replace("\n", "\n    ")


class _TqdmHandler(logging.StreamHandler):
    """Writes through `tqdm.write`, which clears the progress bar first and draws it again after the line, so a
    log line never lands in the middle of the bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own contract: a failing handler reports and goes on
            self.handleError(record)


def configure_logging(level: str | None = None, rank: int | None = None) -> str:
    """Configure the root logger; returns the level name used. `rank` prefixes worker lines with `[rank r]`."""
    name = (level or os.environ.get(LOG_LEVEL_ENV) or "info").lower()
    if name not in LOG_LEVELS:
        source = "--log_level" if level else f"${LOG_LEVEL_ENV}"
        raise UserError(f"{source}={name!r}: expected one of {', '.join(LOG_LEVELS)}")
    os.environ[LOG_LEVEL_ENV] = name
    prefix = f"[rank {rank}] " if rank is not None else ""
    # fla says this at import on every host without a Triton GPU; our kernels are pure PyTorch there anyway. Also
    # for the processes we start (the forkserver imports fla before any of our code runs in it).
    warnings.filterwarnings("ignore", message=_FLA_CPU_WARNING, category=UserWarning)
    quiet = f"ignore:{_FLA_CPU_WARNING}:UserWarning"
    if quiet not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), quiet]))
    # torch.multiprocessing logs "Terminating process ... via signal SIGTERM" when one rank fails: the launcher
    # stops the others itself and says which rank failed and why
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # tqdm's default lock is a multiprocessing semaphore per process: a rank killed while holding one leaves it to
    # the resource tracker's "leaked semaphore" warning. Bars are drawn by one process (rank 0): a thread lock does.
    tqdm.set_lock(threading.RLock())
    handler = _TqdmHandler(sys.stderr)
    handler.setFormatter(_Formatter(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=getattr(logging, name.upper()), force=True, handlers=[handler])
    return name
