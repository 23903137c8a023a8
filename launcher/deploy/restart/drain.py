"""Wait until llama-server has nothing in flight before it is restarted.

A vLLM server has no /slots: its ``/metrics`` (requests running and waiting) says when it is
idle (``busy_vllm``), and its own ``--shutdown-timeout`` drains what comes after.

llama-server does not drain on SIGTERM (b11434, measured: every stream in flight is cut at
once, and the process then lingers ~30 s until systemd's ``TimeoutStopSec`` ends it with
SIGKILL; idle, it exits in ~20 ms). So a restart waits until ``GET /slots`` shows no slot
``is_processing``, bounded by a timeout; with an admission-holding front
(``launcher.deploy.restart.front``) it also waits until the front has no request in flight
or queued, which closes the race of a request that arrives between the last poll and the SIGTERM.

The HTTP client is passed in (``httpx.Client`` with the base URL and the API key), so a test
hands in the real server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

#: How often /slots is asked while waiting: a local server answers in about a millisecond.
POLL_SECONDS = 0.05


class DrainUnavailable(Exception):
    """/slots cannot tell whether the server is busy (the reason is the message)."""


@dataclass(frozen=True)
class Busy:
    """One slot that is processing, as ``GET /slots`` shows it."""

    slot: int
    task: int | None
    prompt_tokens: int | None
    decoded: int | None

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass
class DrainReport:
    """What a drain waited for, how long, and what a timeout cut."""

    waited_for: str
    seconds: float = 0.0
    busy_at_start: list[int] = field(default_factory=list)
    front_in_flight_at_start: int = 0
    timed_out: bool = False
    cut: list[Busy] = field(default_factory=list)
    cut_at_front: int = 0
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {**self.__dict__, "cut": [b.to_dict() for b in self.cut]}
        return {k: v for k, v in data.items() if v is not None}

    def describe(self) -> str:
        if self.skipped:
            return f"no drain: {self.skipped}"
        if self.timed_out:
            slots = ", ".join(
                f"slot {b.slot} (task {b.task}, {b.decoded} tokens generated)" for b in self.cut
            )
            front = f"; {self.cut_at_front} request(s) in flight at the front" * bool(
                self.cut_at_front
            )
            return (
                f"the drain timed out after {self.seconds:.1f}s: the restart cut "
                f"{slots or 'no slot'}{front} (raise --drain-timeout to wait longer)"
            )
        if not self.busy_at_start and not self.front_in_flight_at_start:
            return "drained: nothing was in flight"
        return (
            f"drained: waited {self.seconds:.2f}s for {self.waited_for} "
            f"(slots busy at the start: {self.busy_at_start or 'none'})"
        )


def busy_slots(client: httpx.Client, timeout: float = 10.0) -> list[Busy]:
    """The slots that are processing; ``DrainUnavailable`` when /slots cannot say."""
    import httpx

    try:
        r = client.get("/slots", timeout=timeout)
    except httpx.HTTPError as e:
        raise DrainUnavailable(f"GET /slots failed: {type(e).__name__}: {e}") from e
    if r.status_code == 501:
        raise DrainUnavailable("the server runs with --no-slots, so it cannot say if it is busy")
    if r.status_code == 401:
        raise DrainUnavailable("GET /slots returned 401: the API key of the live config is wrong")
    if r.status_code != 200:
        raise DrainUnavailable(f"GET /slots returned {r.status_code}: {r.text[:200]}")
    try:
        slots = r.json()
        return [_busy(s) for s in slots if s.get("is_processing")]
    except (ValueError, AttributeError, TypeError) as e:
        raise DrainUnavailable(f"GET /slots is not a list of slots: {r.text[:200]}") from e


def busy_vllm(client: httpx.Client, timeout: float = 10.0) -> list[Busy]:
    """vLLM's requests running or waiting (``GET /metrics``: it has no /slots), one ``Busy``
    each; ``DrainUnavailable`` when /metrics cannot say."""
    import httpx

    from launcher.server import vllm

    try:
        r = client.get("/metrics", timeout=timeout)
    except httpx.HTTPError as e:
        raise DrainUnavailable(f"GET /metrics failed: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise DrainUnavailable(f"GET /metrics returned {r.status_code}: {r.text[:200]}")
    seen = vllm.metrics(r.text)
    if "vllm:num_requests_running" not in seen:
        raise DrainUnavailable("GET /metrics has no vllm:num_requests_running")
    n = int(seen["vllm:num_requests_running"] + seen.get("vllm:num_requests_waiting", 0))
    return [Busy(i, None, None, None) for i in range(n)]


def busy_of(meta: dict[str, Any] | None) -> Callable[[httpx.Client], list[Busy]] | None:
    """How the server of a generation's ``meta`` says what it does: ``busy_vllm`` for a
    vLLM config, None (``wait_idle``'s default, ``busy_slots``) for llama-server's."""
    from launcher.deploy import store

    return busy_vllm if store.runs_vllm(meta) else None


def _busy(slot: dict[str, Any]) -> Busy:
    nxt = slot.get("next_token")
    first = nxt[0] if isinstance(nxt, list) and nxt else nxt if isinstance(nxt, dict) else {}
    return Busy(
        int(slot["id"]),
        slot.get("id_task"),
        slot.get("n_prompt_tokens"),
        first.get("n_decoded") if isinstance(first, dict) else None,
    )


def wait_idle(
    client: httpx.Client | None,
    timeout: float,
    front_in_flight: Callable[[], int] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    progress: Callable[[float, str], None] | None = None,
    busy: Callable[[httpx.Client], list[Busy]] | None = None,
) -> DrainReport:
    """Wait until no slot is processing (and the front, if any, has nothing in flight), at
    most ``timeout`` seconds. Never raises for the server's sake: the report says why it did
    not wait (``skipped``) or what the timeout cut. Without a ``client`` only the front is
    waited for (a held front: nothing new comes in, what is in flight finishes). ``busy``:
    how the server says what it is doing (default ``busy_slots``; vLLM: ``busy_vllm``)."""
    asked = busy or busy_slots
    what = ""
    if client is not None:
        what = (
            "no request running or waiting (vLLM's GET /metrics)"
            if asked is busy_vllm
            else "no slot processing (GET /slots)"
        )
    if front_in_flight is not None:
        what += " and " * bool(what) + "no request in flight or queued at the front"
    report = DrainReport(what)
    t0 = clock()
    first = True

    def step() -> DrainReport | None:
        nonlocal first
        try:
            busy = asked(client) if client is not None else []
        except DrainUnavailable as e:
            report.skipped = str(e)
            report.seconds = round(clock() - t0, 3)
            return report
        at_front = front_in_flight() if front_in_flight is not None else 0
        if first:
            report.busy_at_start = [b.slot for b in busy]
            report.front_in_flight_at_start = at_front
            first = False
        elapsed = clock() - t0
        if not busy and not at_front:
            report.seconds = round(elapsed, 3)
            return report
        if elapsed >= timeout:
            report.timed_out, report.cut, report.cut_at_front = True, busy, at_front
            report.seconds = round(elapsed, 3)
            return report
        if progress:
            progress(elapsed, f"waiting for slot(s) {[b.slot for b in busy]} to finish")
        return None

    from launcher import waits

    done = waits.drain(POLL_SECONDS, sleep)(step)
    assert done is not None  # the policy stops only on a report
    return done


class ExitWatch:
    """Times how long the replaced process takes to go after the restart's SIGTERM.

    A drained llama-server exits in milliseconds; one that lingers (a request that came in
    after the drain, or the server's own shutdown bug) is what systemd ends with SIGKILL at
    ``TimeoutStopSec``. A thread watches ``/proc/PID`` (the manager reaps the process, so a
    zombie is gone too).
    """

    LINGER_SECONDS = 1.0

    def __init__(self, pid: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = pid
        self.clock = clock
        self.t0 = clock()
        self.gone_after: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if not _running(self.pid):
                self.gone_after = round(self.clock() - self.t0, 3)
                return
            self._stop.wait(0.005)

    def result(self) -> dict[str, Any]:
        """Stop watching; what was seen (the gate has passed: the old process is gone)."""
        self._stop.set()
        self._thread.join(1.0)
        if self.gone_after is None and not _running(self.pid):
            self.gone_after = round(self.clock() - self.t0, 3)
        data: dict[str, Any] = {"old_pid": self.pid, "exited_after": self.gone_after}
        data["lingered"] = self.gone_after is None or self.gone_after > self.LINGER_SECONDS
        return data


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # the state letter follows the command name in parentheses (which may hold spaces)
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"")


#: a vLLM's stop that takes this long was ended by SIGKILL (its unit's TimeoutStopSec, 60 s,
#: ``launcher.host.units.VLLM_STOP_SECONDS``, less a margin for systemd's own steps)
VLLM_KILLED_AFTER = 58.0


def linger_warning(watch: dict[str, Any], vllm: bool = False) -> str | None:
    """A line for the result when the old process did not exit at once. vLLM takes seconds
    to stop (its drain, its engine's teardown): said only when the unit's TimeoutStopSec
    ended it with SIGKILL, a stop that hung."""
    after = watch.get("exited_after")
    took = f"{after:.1f}s" if after is not None else "longer than the gate"
    if vllm:
        if after is not None and after < VLLM_KILLED_AFTER:
            return None
        return (
            f"the old vLLM (pid {watch['old_pid']}) took {took} to exit after SIGTERM: it hung "
            "(on an open connection, or a drain longer than its --shutdown-timeout) and "
            "systemd ended it with SIGKILL at TimeoutStopSec"
        )
    if not watch.get("lingered"):
        return None
    return (
        f"the old llama-server (pid {watch['old_pid']}) took {took} to exit after SIGTERM "
        "(llama-server does not drain; systemd ends it with SIGKILL at TimeoutStopSec)"
    )
