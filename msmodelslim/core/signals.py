"""SIGTERM and SIGINT as exceptions that unwind a run (cleanup runs, the CLI says why in one line), and the spans
in which they must wait: a failure's cleanup, and the last line itself."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass

from msmodelslim.errors import Terminated

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@dataclass
class Stop:
    """The signal that stopped the run, if one did; `settled` once the run has unwound and only its last line is
    left to print: a signal then must neither raise inside that line nor kill the process before it."""

    signum: int | None = None
    settled: bool = False

    def replace(self, error: BaseException) -> BaseException:
        """What the run failed with: the signal's own exception when a signal came, whatever the code it
        interrupted made of it (an exception raised inside a library can surface as another error)."""
        if self.signum is None or isinstance(error, (Terminated, KeyboardInterrupt)):
            return error
        return KeyboardInterrupt() if self.signum == signal.SIGINT else Terminated(self.signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[Stop]:
    """SIGTERM unwinds like Ctrl-C does (ranks stopped, temporary output removed or kept as resumable state), then
    exits 143; both signals are remembered (`Stop`). Only the first one unwinds: a second, a few milliseconds later
    (a supervisor, an impatient Ctrl-C; torchrun's agent signalling a rank that already lost its peer), would
    interrupt the cleanup the first one started. Nested uses restore the outer one's handler."""
    stop = Stop()

    def handler(signum: int, frame: object) -> None:
        if stop.signum is not None or stop.settled:
            return  # the run is already unwinding, or has unwound: a second signal must not cut that short
        stop.signum = signum
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    try:
        previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    except ValueError:  # not the main thread (an embedding application): leave its signals alone
        yield stop
        return
    try:
        yield stop
    finally:
        for s, handler_before in previous.items():
            signal.signal(s, handler_before)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT / SIGTERM wait until the block is done (then the first one is delivered): under torchrun the agent
    signals every rank as soon as one fails, and a signal must not cut a failure's cleanup short."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
