"""A unit's journal followed in place through systemd's own Python binding, polled.

``journalctl -f`` hears of new entries through inotify, and journald posts its changes only
every 250 ms (``POST_CHANGE_TIMER_INTERVAL_USEC`` in journald-server.c, to coalesce them):
measured here, 0.25-0.3 s from a line to the follower. An entry is in the journal's mapped
file as soon as journald appended it, so a reader that looks every ``POLL`` seconds sees it
within that (``scripts/bench-journal`` measures both). ``Poller`` is that reader, on
``systemd.journal.Reader`` (systemd-python, the ``journal`` extra; Debian's
``python3-systemd``), with ``journalctl -f -o json --after-cursor``'s meaning: the unit's
entries after a cursor, in the journal's order, those of one process left out, those whose
message matches a pattern kept. ``Poller`` raises ``Unavailable`` where the binding is not
installed or the journal not opened (then ``launcher.host.systemd`` follows with journalctl).

Each entry is read with the binding's low-level ``_next`` and ``_get`` (``_Reader``'s, kept
by its authors for readers that want a few fields unconverted), not ``Reader.get_next``,
which reads and converts all of an entry's ~20 fields: 20 us an entry against 2.3 for the
two fields read here. A Poller so reads 1.8 us an entry, one on libsystemd through ctypes
(this module before the binding) 3.5 (the sandbox's journal, 20,000 entries of one unit
read from the first, 2026-12-05); a follower that starts from a long-running process's
first line reads its whole log so. A new line reaches either within ``POLL``
(``scripts/bench-journal``, 30 lines: medians 3 to 11 ms, and 4 to 12 ms through ctypes).

The journal is opened as journalctl opens it by default (``LOCAL_ONLY``: what this user may
read, system and user journals alike). sd-journal(3): a handle belongs to the thread (and
the process) that opened it. A Poller whose journal cannot be read any more (libsystemd's
error: a damaged file; or read in a forked child) has ``ended``, as journalctl -f would exit.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any, Protocol

#: how often the poller looks for new entries while it waits (s): a ``sd_journal_next``
#: on a mapped file, no process started
POLL = 0.02
#: the most entries one look reads (the rest at the next): a read from the first entry of a
#: long journal keeps to its timeout
BATCH = 1000

#: imports systemd's binding's journal module (``systemd.journal``); raises ImportError
Binding = Callable[[], Any]


class Unavailable(OSError):
    """The journal cannot be read in place here (no binding, or the journal refused)."""


class Reader(Protocol):
    """The calls of ``systemd.journal.Reader`` a Poller makes (the binding has no types);
    each raises OSError with libsystemd's error."""

    def add_match(self, *matches: str) -> None: ...

    def add_disjunction(self) -> None: ...

    def seek_head(self) -> None: ...

    def seek_cursor(self, cursor: str) -> None: ...

    def test_cursor(self, cursor: str) -> bool: ...

    def _next(self, skip: int = 1) -> bool: ...

    def _get(self, field: str) -> bytes: ...

    def process(self) -> int: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


def import_journal() -> Any:
    """systemd's binding's journal module (raises ImportError where it is not installed)."""
    from systemd import journal  # no types: pyproject.toml's mypy override

    return journal


class Poller:
    """The entries matching ``matches`` (journalctl's syntax: ``FIELD=value``, ``+`` for
    OR) after ``after_cursor`` (None: from the first), without those process ``skip_pid``
    logged, only those whose message matches ``grep`` (a regular expression; None: all;
    as journalctl's ``--grep``, it ignores case when it has no capital letter).
    ``binding``: imports the binding's journal module (None: ``import_journal``)."""

    def __init__(
        self,
        matches: list[str],
        after_cursor: str | None,
        skip_pid: int = 0,
        grep: str | None = None,
        binding: Binding | None = None,
    ) -> None:
        self.skip_pid, self.grep = skip_pid, _pattern(grep) if grep else None
        #: ``launcher.host.systemd.Follower``'s: no more can be read (why: ``error``)
        self.ended, self.error = False, ""
        #: the last look stopped at ``BATCH`` entries, not at the journal's end
        self.behind = False
        self.pid = os.getpid()
        self.reader = _open(binding or import_journal)
        try:
            # the journal's folders watched (inotify): without it, ``process`` never sees a
            # file journald makes later (a rotation, a user's first journal)
            self.reader.fileno()
            for m in matches:
                if m == "+":
                    self.reader.add_disjunction()
                else:
                    self.reader.add_match(m)
            self._seek(after_cursor)
        except OSError as e:
            self.close()
            raise Unavailable(f"the journal cannot be followed: {_why(e)}") from e

    def _seek(self, cursor: str | None) -> None:
        if cursor is None:
            self.reader.seek_head()
            return
        self.reader.seek_cursor(cursor)
        # --after-cursor: the cursor's own entry, when it is still there, is not read
        if self.reader._next() and not self.reader.test_cursor(cursor):
            self.reader.seek_cursor(cursor)  # another entry: read it again

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; None (and ``ended``) when libsystemd answers an error."""
        try:
            return fn(*args)
        except OSError as e:
            self.ended, self.error = True, f"sd_journal {what}: {_why(e)}"
            return None

    def _field(self, name: str) -> bytes | None:
        try:
            return self.reader._get(name)
        except (KeyError, OSError):  # not in the entry, or unreadable: as if not
            return None

    def _new(self) -> list[str]:
        lines: list[str] = []
        self.behind = True  # a whole batch read: more may wait (``read`` does not sleep)
        for _ in range(BATCH):
            if not self._call("next", self.reader._next):  # the journal's end, or an error
                self.behind = False
                break
            if self.skip_pid and self._field("_PID") == b"%d" % self.skip_pid:
                continue
            raw = self._field("MESSAGE")
            if raw is None:  # no message (journalctl's json has none either)
                continue
            msg = raw.decode(errors="replace")
            if self.grep is None or self.grep.search(msg):
                lines.extend(msg.splitlines() or [""])
        return lines

    def read(self, timeout: float) -> list[str]:
        """Messages that arrived within ``timeout`` seconds (possibly none): what is new
        now, or the first new ones within ``timeout``, looked for every ``POLL`` s."""
        if os.getpid() != self.pid:  # a forked child: the handle is its parent's
            self.ended, self.error = True, "sd_journal: read in a forked process"
        lines: list[str] = []
        end = time.monotonic() + timeout
        if not self.ended:
            self._call("process", self.reader.process)  # new and rotated files, never waits
        while not self.ended and not (lines := self._new()):
            if (left := end - time.monotonic()) <= 0:
                break
            if not self.behind:  # caught up with the journal: wait for new entries
                # up to POLL, less when inotify tells of a change first; then ``process``
                self._call("wait", self.reader.wait, min(POLL, left))
        return lines

    def close(self) -> None:
        self.reader.close()  # sd_journal_close; again: nothing

    def __enter__(self) -> Poller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open(binding: Binding) -> Reader:
    """The binding's Reader on the local journal, as journalctl opens it (raises
    ``Unavailable``)."""
    try:
        journal = binding()
    except ImportError as e:
        raise Unavailable(
            f"systemd's Python binding is not installed ({e}): "
            "pip install 'llama-launcher[journal]' (or apt-get install python3-systemd)"
        ) from e
    try:
        reader: Reader = journal.Reader()
    except OSError as e:
        raise Unavailable(f"the journal cannot be opened: {_why(e)}") from e
    return reader


def _why(e: OSError) -> str:
    return e.strerror or str(e)


def _pattern(grep: str) -> re.Pattern[str]:
    """``grep`` compiled as journalctl's ``--grep`` reads it: case-insensitive when it has
    no capital letter (raises ``Unavailable`` for one Python cannot compile: journalctl,
    whose PCRE2 may, is the follower then)."""
    try:
        return re.compile(grep, 0 if re.search(r"[A-Z]", grep) else re.IGNORECASE)
    except re.error as e:
        raise Unavailable(f"the pattern {grep!r}: {e}") from e
