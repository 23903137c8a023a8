"""A unit's journal since the last entry read: a cursor kept between two runs of a reader.

``journalctl --cursor C`` starts *at* the entry C names, so the first entry says whether the
journal still holds it: when C's entry is gone (the journal was rotated and the archived
file vacuumed, or the journal was wiped), the read starts at the oldest entry kept after it
and the reader is told that what was logged in between may be missing. A cursor journalctl
refuses (``Failed to seek to cursor``: another machine's, or damaged) falls back to a time.
Measured with systemd 252 (the sandbox's journald: ``journalctl --rotate`` and
``--vacuum-files=1``; ``--after-cursor`` of a vacuumed entry silently starts at the oldest
kept one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from launcher.errors import CommandError, SystemdError
from launcher.host import proc
from launcher.host.systemd import Runner, entry_lines, unit_matches


@dataclass(frozen=True)
class Line:
    """One message line and who logged it when (Unix seconds)."""

    time: float
    pid: int
    text: str


@dataclass
class Read:
    """What a read found: the lines, the cursor to go on from, and why lines may be missing."""

    lines: list[Line] = field(default_factory=list)
    cursor: str | None = None
    lost: str | None = None


def since(
    unit: str,
    cursor: str | None,
    since_time: float | None,
    runner: Runner = proc.run,
    env: dict[str, str] | None = None,
) -> Read:
    """The unit's journal after ``cursor`` (else from ``since_time``, else from its end)."""
    env = env or proc.base_env()
    if cursor:
        try:
            return _from_cursor(unit, cursor, since_time, runner, env)
        except CommandError as e:
            read = _read(unit, _start(since_time), runner, env)
            read.lost = (
                f"journalctl refused the stored cursor ({_tail(e)}): read from "
                f"{_when(since_time)}; lines logged before it may be missing"
            )
            return read
    return _read(unit, _start(since_time), runner, env)


def _from_cursor(
    unit: str, cursor: str, since_time: float | None, runner: Runner, env: dict[str, str]
) -> Read:
    read = _read(unit, ["--cursor", cursor], runner, env, keep_first=True)
    if read.first == cursor:
        return read.without_first()
    # the cursor's entry is gone: journalctl starts at the oldest entry kept after it (with
    # nothing kept after it, the next read goes by time: the cursor names nothing any more)
    kept = read.without_first(drop=False)
    kept.lost = (
        "the journal no longer holds the last entry read (rotated and vacuumed, or wiped): "
        f"lines logged between {_when(since_time)} and the oldest entry kept may be missing"
    )
    return kept


def _start(since_time: float | None) -> list[str]:
    return ["--since", f"@{since_time:.6f}"] if since_time else ["-n", "0"]


def _when(t: float | None) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "the end"


def _tail(e: CommandError) -> str:
    lines = e.stderr.strip().splitlines()
    return lines[-1] if lines else f"status {e.status}"


@dataclass
class _Raw(Read):
    first: str | None = None
    first_lines: list[Line] = field(default_factory=list)

    def without_first(self, drop: bool = True) -> Read:
        kept = self.lines if drop else [*self.first_lines, *self.lines]
        return Read(kept, self.cursor or self.first)


def _read(
    unit: str,
    start: list[str],
    runner: Runner,
    env: dict[str, str],
    keep_first: bool = False,
) -> _Raw:
    argv = [
        "journalctl",
        "--no-pager",
        "-o",
        "json",
        "--output-fields=MESSAGE,_PID",
        *start,
        *unit_matches(unit),
    ]
    try:
        out = runner(argv, timeout=30, env=env).stdout
    except CommandError as e:
        if keep_first or "--cursor" in start:
            raise
        raise SystemdError(f"cannot read the journal of {unit}: {e}") from e
    raw = _Raw()
    for n, text in enumerate(out.splitlines()):
        try:
            entry = json.loads(text)
        except ValueError:
            continue
        lines = [
            Line(int(entry.get("__REALTIME_TIMESTAMP", 0)) / 1e6, int(entry.get("_PID", 0)), x)
            for x in entry_lines(entry)
        ]
        cur = entry.get("__CURSOR")
        if n == 0 and keep_first:
            raw.first, raw.first_lines = cur, lines
            continue
        raw.cursor = cur or raw.cursor
        raw.lines.extend(lines)
    return raw
