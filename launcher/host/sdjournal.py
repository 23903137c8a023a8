"""A unit's journal followed through libsystemd's sd-journal (ctypes), polled.

``journalctl -f`` hears of new entries through inotify, and journald posts its changes only
every 250 ms (``POST_CHANGE_TIMER_INTERVAL_USEC`` in journald-server.c, to coalesce them):
measured here, 0.25-0.3 s from a line to the follower. An entry is in the journal's mapped
file as soon as journald appended it, so a reader that looks every ``POLL`` seconds sees it
within that (``scripts/bench-journal`` measures both). ``Poller`` is that reader, with
``journalctl -f -o json --after-cursor``'s meaning: the unit's entries after a cursor, in
the journal's order, those of one process left out, those whose message matches a pattern
kept. ``Poller`` raises ``Unavailable`` where libsystemd cannot be loaded or the journal
not opened (then ``launcher.host.systemd`` follows with journalctl).

The journal is opened as journalctl opens it by default (``SD_JOURNAL_LOCAL_ONLY``: what
this user may read, system and user journals alike). sd-journal(3): a handle belongs to the
thread (and the process) that opened it. A Poller whose journal cannot be read any more
(libsystemd's error: a damaged file; or read in a forked child) has ``ended``, as
journalctl -f would exit.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
import weakref
from typing import Any

#: how often the poller looks for new entries while it waits (s): a ``sd_journal_next``
#: on a mapped file, no process started
POLL = 0.02
#: the most entries one look reads (the rest at the next): a read from the first entry of a
#: long journal keeps to its timeout
BATCH = 1000

_LOCAL_ONLY = 1


class Unavailable(OSError):
    """libsystemd's journal API cannot be used here (not loaded, or the journal refused)."""


_lib: Any = None


def _library() -> Any:
    """libsystemd, its prototypes declared once (raises ``Unavailable``)."""
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libsystemd.so.0", use_errno=True)
        except OSError as e:
            raise Unavailable(f"libsystemd.so.0 cannot be loaded: {e}") from e
        p, c, s, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int
        for name, args in {
            "sd_journal_open": [ctypes.POINTER(p), i],
            "sd_journal_add_match": [p, c, s],
            "sd_journal_add_disjunction": [p],
            "sd_journal_seek_cursor": [p, c],
            "sd_journal_seek_head": [p],
            "sd_journal_test_cursor": [p, c],
            "sd_journal_next": [p],
            "sd_journal_process": [p],
            "sd_journal_get_fd": [p],
            "sd_journal_get_data": [p, c, ctypes.POINTER(p), ctypes.POINTER(s)],
        }.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as e:  # a libsystemd older than these calls
                raise Unavailable(f"libsystemd.so.0 has no {name}") from e
            fn.argtypes, fn.restype = args, i
        lib.sd_journal_close.argtypes, lib.sd_journal_close.restype = [p], None
        _lib = lib
    return _lib


class Poller:
    """The entries matching ``matches`` (journalctl's syntax: ``FIELD=value``, ``+`` for
    OR) after ``after_cursor`` (None: from the first), without those process ``skip_pid``
    logged, only those whose message matches ``grep`` (a regular expression; None: all;
    as journalctl's ``--grep``, it ignores case when it has no capital letter)."""

    def __init__(
        self,
        matches: list[str],
        after_cursor: str | None,
        skip_pid: int = 0,
        grep: str | None = None,
    ) -> None:
        self.lib = _library()
        self.skip_pid, self.grep = skip_pid, _pattern(grep) if grep else None
        #: ``launcher.host.systemd.Follower``'s: no more can be read (why: ``error``)
        self.ended, self.error = False, ""
        #: the last look stopped at ``BATCH`` entries, not at the journal's end
        self.behind = False
        self.pid = os.getpid()
        self.j = ctypes.c_void_p()
        self._check(self.lib.sd_journal_open(ctypes.byref(self.j), _LOCAL_ONLY), "open")
        # a Poller dropped unclosed lets go of the journal's files (and their disk space)
        self._closer = weakref.finalize(self, self.lib.sd_journal_close, self.j)
        try:
            # the journal's folders watched (inotify): without it, ``sd_journal_process``
            # never sees a file journald makes later (a rotation, a user's first journal)
            self._check(self.lib.sd_journal_get_fd(self.j), "watch")
            for m in matches:
                if m == "+":
                    self._check(self.lib.sd_journal_add_disjunction(self.j), "match")
                else:
                    b = m.encode()
                    self._check(self.lib.sd_journal_add_match(self.j, b, len(b)), "match")
            self._seek(after_cursor)
        except Unavailable:
            self.close()
            raise

    def _check(self, r: int, what: str) -> None:
        if r < 0:
            raise Unavailable(f"sd_journal {what}: {os.strerror(-r)}")

    def _seek(self, cursor: str | None) -> None:
        if cursor is None:
            self._check(self.lib.sd_journal_seek_head(self.j), "seek")
            return
        c = cursor.encode()
        self._check(self.lib.sd_journal_seek_cursor(self.j, c), "seek")
        # --after-cursor: the cursor's own entry, when it is still there, is not read
        if self.lib.sd_journal_next(self.j) > 0 and self.lib.sd_journal_test_cursor(self.j, c) <= 0:
            self.lib.sd_journal_seek_cursor(self.j, c)  # another entry: read it again

    def _end(self, r: int, what: str) -> bool:
        """True (and ``ended``) when libsystemd's ``r`` is an error."""
        if r < 0:
            self.ended, self.error = True, f"sd_journal {what}: {os.strerror(-r)}"
        return self.ended

    def _field(self, name: bytes) -> bytes | None:
        data, size = ctypes.c_void_p(), ctypes.c_size_t()
        if self.lib.sd_journal_get_data(self.j, name, ctypes.byref(data), ctypes.byref(size)) < 0:
            return None
        return ctypes.string_at(data, size.value)[len(name) + 1 :]

    def _new(self) -> list[str]:
        if os.getpid() != self.pid:  # a forked child: the handle is its parent's
            self.ended, self.error = True, "sd_journal: read in a forked process"
        # new and rotated files (inotify), never waits
        if self.ended or self._end(self.lib.sd_journal_process(self.j), "process"):
            return []
        lines: list[str] = []
        self.behind = True  # a whole batch read: more may wait (``read`` does not sleep)
        for _ in range(BATCH):
            r = self.lib.sd_journal_next(self.j)
            if r == 0 or self._end(r, "next"):
                self.behind = False
                break
            if self.skip_pid and self._field(b"_PID") == str(self.skip_pid).encode():
                continue
            raw = self._field(b"MESSAGE")
            if raw is None:  # no message (journalctl's json has none either)
                continue
            msg = raw.decode(errors="replace")
            if self.grep is None or self.grep.search(msg):
                lines.extend(msg.splitlines() or [""])
        return lines

    def read(self, timeout: float) -> list[str]:
        """Messages that arrived within ``timeout`` seconds (possibly none): what is new
        now, or the first new ones within ``timeout``, looked for every ``POLL`` s."""
        end = time.monotonic() + timeout
        while not (lines := self._new()) and not self.ended:
            if (left := end - time.monotonic()) <= 0:
                break
            if not self.behind:  # caught up with the journal: wait for new entries
                time.sleep(min(POLL, left))
        return lines

    def close(self) -> None:
        self._closer()  # once: sd_journal_close

    def __enter__(self) -> Poller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pattern(grep: str) -> re.Pattern[str]:
    """``grep`` compiled as journalctl's ``--grep`` reads it: case-insensitive when it has
    no capital letter (raises ``Unavailable`` for one Python cannot compile: journalctl,
    whose PCRE2 may, is the follower then)."""
    try:
        return re.compile(grep, 0 if re.search(r"[A-Z]", grep) else re.IGNORECASE)
    except re.error as e:
        raise Unavailable(f"the pattern {grep!r}: {e}") from e
