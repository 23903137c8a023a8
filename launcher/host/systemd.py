"""systemctl and journalctl, read in their machine-readable forms.

``systemctl show -p ...`` (never ``status`` prose) and ``journalctl -o json --cursor``;
a journal followed is read in place (``launcher.host.sdjournal``, systemd's Python
binding), ``journalctl -f`` where it cannot be. Entries after a cursor are read with
``--cursor C`` and C's own entry left out: systemd 252's ``--after-cursor`` skips one entry
more than it should when C's entry is not the unit's (``cursor()`` is the whole journal's
end), the unit's first.
The journal is matched with ``_SYSTEMD_UNIT=U + _SYSTEMD_USER_UNIT=U`` so the same query finds
a system unit and a user unit. The runner is passed in (default: ``launcher.host.proc.run``), so
tests hand in the real sandbox, never a patched module; so is the binding's import.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal, Protocol

from launcher.errors import CommandError, ConfigInvalid, SystemdError
from launcher.host import proc

Runner = Callable[..., proc.Result]
Scope = Literal["system", "user"]

STATE_PROPS = (
    "ActiveState",
    "SubState",
    "Result",
    "NRestarts",
    "ExecMainStatus",
    "ExecMainCode",
    "MainPID",
    "MemoryCurrent",
    "InvocationID",
    "LoadState",
    "TimeoutStopUSec",
)


@dataclass(frozen=True)
class UnitState:
    """The unit's state from ``systemctl show``."""

    active: str
    sub: str
    result: str
    n_restarts: int
    exec_main_status: int
    main_pid: int
    memory_current: int | None
    invocation_id: str
    load_state: str
    #: TimeoutStopSec in seconds (None: infinity, or not said): systemd's SIGKILL after it
    timeout_stop: float | None = None

    @property
    def running(self) -> bool:
        return self.active == "active" and self.sub == "running" and self.main_pid > 0

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


#: The units of a systemd time span as ``systemctl show`` prints one (``1min 30s``,
#: ``500ms``; src/basic/time-util.c format_timespan), in seconds.
_SPAN_UNITS = {
    "y": 31557600.0,
    "M": 2630016.0,
    "w": 604800.0,
    "d": 86400.0,
    "h": 3600.0,
    "min": 60.0,
    "s": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "μs": 1e-6,
}
_SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*(y|M|w|d|h|min|ms|us|μs|s)")


def timespan(text: str) -> float | None:
    """Seconds of a time span ``systemctl show`` prints (``1min 30s``, ``90s``, ``500ms``);
    None for ``infinity``, an empty value or a form this reader does not know."""
    text = text.strip()
    parts = _SPAN.findall(text)
    if not parts or _SPAN.sub("", text).strip():
        return None
    return sum(float(n) * _SPAN_UNITS[unit] for n, unit in parts)


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


class Systemd:
    """One unit under one manager (system, or the calling user's)."""

    def __init__(
        self,
        unit: str,
        scope: Scope = "system",
        runner: Runner = proc.run,
        binding: Callable[[], Any] | None = None,
    ) -> None:
        self.unit = unit
        self.scope = scope
        self.run = runner
        #: imports systemd's Python binding's journal module for ``follow`` (None:
        #: ``systemd.journal``; the tests hand in one that fails, as where it is missing)
        self.binding = binding
        self.env = proc.base_env()

    def _ctl(self, *args: str, check: bool = True, timeout: float = 90.0) -> proc.Result:
        argv = ["systemctl", *(["--user"] if self.scope == "user" else []), *args]
        return self.run(argv, check=check, timeout=timeout, env=self.env)

    def show(self, *props: str) -> dict[str, str]:
        out = self._ctl("show", "-p", ",".join(props), "--", self.unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def state(self) -> UnitState:
        p = self.show(*STATE_PROPS)
        mem = p.get("MemoryCurrent", "")
        return UnitState(
            active=p.get("ActiveState", ""),
            sub=p.get("SubState", ""),
            result=p.get("Result", ""),
            n_restarts=_int(p.get("NRestarts")),
            exec_main_status=_int(p.get("ExecMainStatus")),
            main_pid=_int(p.get("MainPID")),
            # older systemd prints UINT64_MAX for "not set"
            memory_current=int(mem) if mem.isdigit() and int(mem) < 2**63 else None,
            invocation_id=p.get("InvocationID", ""),
            load_state=p.get("LoadState", ""),
            timeout_stop=timespan(p.get("TimeoutStopUSec", "")),
        )

    def restart(self) -> None:
        """``systemctl restart --no-block``: the gate, not systemctl, waits for readiness."""
        self._ctl("restart", "--no-block", "--", self.unit)

    def stop(self) -> None:
        self._ctl("stop", "--", self.unit)

    def cancel_auto_restart(self, state: UnitState) -> None:
        """Stop the unit when ``state`` has it waiting in ``auto-restart`` (its process died;
        systemd starts it again after RestartSec). Our restart would otherwise race systemd's
        timer: a start by the timer between our reads and our restart raises NRestarts, and
        the gate takes that for the new process dying. A stop from there is instant: no
        process runs."""
        if state.sub == "auto-restart":
            self.stop()

    def start(self, timeout: float = 90.0, block: bool = True) -> None:
        """``systemctl start``: returns once the unit is up (a ``Type=notify`` one ready);
        ``block`` False: once the start job is queued (a unit already active: nothing)."""
        self._ctl("start", *([] if block else ["--no-block"]), "--", self.unit, timeout=timeout)

    def reset_failed(self) -> None:
        """Clear the start-limit counter: manual restarts count toward StartLimitBurst."""
        self._ctl("reset-failed", "--", self.unit, check=False)

    def daemon_reload(self) -> None:
        self._ctl("daemon-reload")

    def enable(self) -> None:
        self._ctl("enable", "--", self.unit)

    def disable(self) -> None:
        self._ctl("disable", "--", self.unit, check=False)

    def clean_state(self) -> bool:
        """``systemctl clean --what=state``: remove the stopped unit's ``StateDirectory=``
        (for a dynamic user, ``/var/lib/private/NAME`` and its ``/var/lib/NAME`` link).
        False when systemd refused (the unit is running, or an older systemd)."""
        return self._ctl("clean", "--what=state", "--", self.unit, check=False).status == 0

    # -- journal ---------------------------------------------------------------------------

    def _journal_argv(self, *args: str, pid: int = 0) -> list[str]:
        return ["journalctl", "--no-pager", *args, *unit_matches(self.unit, pid)]

    def cursor(self) -> str | None:
        """The journal's current end, to read only what comes after it."""
        return self._first_cursor("-n", "1")

    def invocation_cursor(self, invocation_id: str) -> str | None:
        """A cursor to read one start of the unit from (``InvocationID``): its first entry,
        which is never the startup line (an ``ExecStartPre=``'s line, or the server's
        first), or the journal's end when that start has logged nothing yet."""
        return self._first_cursor(f"_SYSTEMD_INVOCATION_ID={invocation_id}") or self.cursor()

    def _first_cursor(self, *args: str) -> str | None:
        """The cursor of the first entry ``journalctl -o json ARGS`` prints (None: none)."""
        r = self.run(
            ["journalctl", "--no-pager", "-o", "json", *args],
            check=False,
            timeout=30,
            env=self.env,
        )
        for line in r.stdout.splitlines():
            try:
                return str(json.loads(line)["__CURSOR"])
            except (ValueError, KeyError):
                continue
        return None

    def messages(
        self, after_cursor: str | None, limit: int | None = None, skip_pid: int = 0
    ) -> tuple[list[str], str | None]:
        """The unit's journal messages after ``after_cursor``; returns (lines, new cursor).
        ``skip_pid``: leave out what that process logged (the one a restart replaced)."""
        args = ["-o", "json"]
        if after_cursor:
            args += ["--cursor", after_cursor]
        if limit:
            args += ["-n", str(limit)]
        try:
            r = self.run(self._journal_argv(*args), timeout=30, env=self.env)
        except CommandError as e:
            raise SystemdError(f"cannot read the journal of {self.unit}: {e}") from e
        lines, cursor = [], after_cursor
        for raw in r.stdout.splitlines():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            cursor = entry.get("__CURSOR", cursor)
            if after_cursor is None or cursor != after_cursor:  # not the cursor's own
                lines.extend(entry_lines(entry, skip_pid))
        return lines, cursor

    def follow(
        self, after_cursor: str | None, skip_pid: int = 0, grep: str | None = None, pid: int = 0
    ) -> Follower:
        """Follow the unit's journal from ``after_cursor``, without what process
        ``skip_pid`` logs; ``grep``: only the messages that match it; ``pid``: only what that
        process of the unit logs (from its first line, with no cursor). Read in place
        (``launcher.host.sdjournal``, systemd's Python binding: a new line within 20 ms),
        else with ``journalctl -f`` (journald tells it of new lines every 250 ms; ``grep`` is
        then journalctl's ``--grep``, a PCRE2 pattern: a journalctl built without PCRE2
        exits at once)."""
        # imported here: the unit's ExecStart (python -S) loads this module and has no use
        # for the journal's binding (tests/test_layout.py)
        from launcher.host import sdjournal

        with contextlib.suppress(sdjournal.Unavailable):
            matches = unit_matches(self.unit, pid)
            return sdjournal.Poller(matches, after_cursor, skip_pid, grep, self.binding)
        return self.follow_journalctl(after_cursor, skip_pid, grep, pid)

    def follow_journalctl(
        self, after_cursor: str | None, skip_pid: int = 0, grep: str | None = None, pid: int = 0
    ) -> JournalFollower:
        """``follow`` with ``journalctl -f`` (what it falls back to)."""
        args = ["-f", "-o", "json"]
        args += ["--cursor", after_cursor] if after_cursor else ["-n", "all"]
        args += ["--grep", grep] if grep else []
        argv = self._journal_argv(*args, pid=pid)
        return JournalFollower(argv, self.env, skip_pid, after_cursor)

    def tail(self, n: int = 30) -> list[str]:
        """The unit's last ``n`` journal messages."""
        return self.messages(None, limit=n)[0]


class Follower(Protocol):
    """A unit's journal followed (``Systemd.follow``): ``read`` waits up to its timeout
    for new messages; ``ended`` once no more can come."""

    ended: bool

    def read(self, timeout: float) -> list[str]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Follower: ...

    def __exit__(self, *exc: object) -> None: ...


class JournalFollower:
    """A running ``journalctl -f -o json``: messages as journald stores them, without
    spawning journalctl on every poll."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        skip_pid: int = 0,
        skip_cursor: str | None = None,
    ) -> None:
        #: left out: what process ``skip_pid`` logged, the entry ``skip_cursor`` names
        self.skip_pid, self.skip_cursor = skip_pid, skip_cursor
        self.proc = proc.spawn(argv, env)
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = b""
        #: journalctl ended (its output closed): ``read`` returns at once from then on
        self.ended = False

    def read(self, timeout: float) -> list[str]:
        """Messages that arrived within ``timeout`` seconds (possibly none)."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        self.ended = self.ended or not chunk
        self.buffer += chunk
        *complete, self.buffer = self.buffer.split(b"\n")
        lines: list[str] = []
        for raw in complete:
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if self.skip_cursor is None or entry.get("__CURSOR") != self.skip_cursor:
                lines.extend(entry_lines(entry, self.skip_pid))
        return lines

    def close(self) -> None:
        proc.end(self.proc)

    def __enter__(self) -> JournalFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def entry_lines(entry: dict[str, Any], skip_pid: int = 0) -> list[str]:
    """The message lines of one ``journalctl -o json`` entry; none when process ``skip_pid``
    logged it. journald stores a message that is not UTF-8 as a byte array."""
    if skip_pid and entry.get("_PID") == str(skip_pid):
        return []
    msg = entry.get("MESSAGE")
    if isinstance(msg, list):
        msg = bytes(msg).decode(errors="replace")
    return (msg.splitlines() or [""]) if isinstance(msg, str) else []


def unit_matches(unit: str, pid: int = 0) -> list[str]:
    """Journal matches for a unit of either manager: ``_SYSTEMD_UNIT=U + _SYSTEMD_USER_UNIT=U``
    (a user manager run as root - the sandbox - logs its units as system units); ``pid``:
    only what that process of the unit logged."""
    own = [f"_PID={pid}"] if pid > 0 else []
    return [*own, f"_SYSTEMD_UNIT={unit}", "+", *own, f"_SYSTEMD_USER_UNIT={unit}"]


def journal_argv(unit: str, since: str | None = None) -> list[str]:
    """``journalctl -o cat`` for a system or a --user unit (the '+' ORs the two matches)."""
    if not unit or unit.startswith("-") or "/" in unit:
        raise ConfigInvalid(f"unit name {unit!r} is not valid; give a name like llama.service")
    if "." not in unit:
        unit += ".service"
    argv = [
        "journalctl",
        "--no-pager",
        "-o",
        "cat",
        f"_SYSTEMD_UNIT={unit}",
        "+",
        f"_SYSTEMD_USER_UNIT={unit}",
    ]
    if since:
        argv += ["--since", since]
    return argv


@contextlib.contextmanager
def journal(unit: str, since: str | None = None) -> Iterator[IO[bytes]]:
    """Stream a unit's journal messages (bytes, one per line) in constant memory."""
    with proc.stream(
        journal_argv(unit, since), "check the unit name and --since", proc.base_env()
    ) as out:
        yield out
