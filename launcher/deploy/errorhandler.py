"""Run the rollback when the risky part of a transaction fails, on an exception or a signal.

certbot's ``error_handler`` in this tool's terms: ``Signals`` turns SIGINT, SIGTERM and SIGHUP
into ``Interrupted`` while a command holds the lock, so the transaction unwinds through its
``except`` like any other failure; ``on_error`` registers the rollback before the risky step
and runs it for exceptions and signals alike. While a rollback (or a recovery, or the
bookkeeping after a passed gate) runs, a signal waits (``Signals.deferred``) and is acted on
when it is done.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn

from launcher.errors import Interrupted, LauncherError

#: The signals that roll a transaction back (a closed terminal sends SIGHUP).
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Signals:
    """The signal handlers of one command, and the signal that arrived while deferred."""

    def __init__(self) -> None:
        self.deferring = False
        self.pending: int | None = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.deferring:
            self.pending = signum  # finish restoring first
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Signals raise ``Interrupted`` inside the block (the previous handlers after it)."""
        old = {s: signal.signal(s, self._handler) for s in SIGNALS}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal inside waits until the block is done (``pending``)."""
        was, self.deferring = self.deferring, True
        try:
            yield
        finally:
            self.deferring = was

    def stop_if_asked(self) -> None:
        """Act on a signal that arrived while deferred."""
        if self.pending is not None:
            raise Interrupted(self.pending)


@contextlib.contextmanager
def on_error(signals: Signals, rollback: Callable[[BaseException], NoReturn]) -> Iterator[None]:
    """Run ``rollback(error)`` (signals deferred) when the block raises a ``LauncherError``,
    an ``OSError`` or ``Interrupted``; ``rollback`` raises the outcome."""
    try:
        yield
    except (LauncherError, OSError, Interrupted) as e:
        with signals.deferred():
            rollback(e)
