"""Logging set-up shared by the CLI and the processes it spawns.

The CLI resolves the level (`--log_level`, else `$MSMODELSLIM_LOG_LEVEL`, else info) and exports it in
`$MSMODELSLIM_LOG_LEVEL`, so a spawned worker calls `configure_logging(rank=r)` and logs at the same level.
"""

from __future__ import annotations

import logging
import os

from msmodelslim.errors import UserError

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_LEVEL_ENV = "MSMODELSLIM_LOG_LEVEL"


def configure_logging(level: str | None = None, rank: int | None = None) -> str:
    """Configure the root logger; returns the level name used. `rank` prefixes worker lines with `[rank r]`."""
    name = (level or os.environ.get(LOG_LEVEL_ENV) or "info").lower()
    if name not in LOG_LEVELS:
        source = "--log_level" if level else f"${LOG_LEVEL_ENV}"
        raise UserError(f"{source}={name!r}: expected one of {', '.join(LOG_LEVELS)}")
    os.environ[LOG_LEVEL_ENV] = name
    prefix = f"[rank {rank}] " if rank is not None else ""
    logging.basicConfig(level=getattr(logging, name.upper()), force=True,
                        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s", datefmt="%H:%M:%S")
    return name
