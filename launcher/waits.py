"""Every retry and wait of the tool, each a named tenacity policy, in one place.

The budgets come from the settings (``Waits.from_settings``); the short intervals are fields
of ``Waits`` with the reason for their value, so a caller (a test, a measured budget) can
hand in others instead of editing a loop.

=================  =========================================================================
policy             what it waits for
=================  =========================================================================
``lock``           another deploy to release the state dir's lock (``lock_timeout``)
``ready``          the restarted unit: the replaced process gone (the unit's TimeoutStopSec),
                   then the new process, the startup line (``start``), ``/health`` 200
                   (``health``); the budgets are sized per restart (``launcher.deploy.budgets``)
``health_polls``   the pause between two ``/health`` requests while the server loads: short
                   for the first moments of the start, then doubled to the cap; short again
                   once the startup line is seen
``respawn``        systemd failing to spawn the process: restarted once more, not judged
``journal_catchup``  the startup line in the journal file once the server is healthy
``last_words``     journald storing the lines of a process that died
``probe_post``     the first request to a server that just turned healthy (503, a reset)
``drain``          no slot processing before a restart (the step itself keeps the deadline,
                   ``drain_timeout``, and says what the timeout cut)
``front_up``       the front's HAProxy back after a restart (systemd starts it again
                   ``RestartSec`` after it died), for a deploy that must pause it
``front_start``    a start of the front's HAProxy that systemd failed, asked again
``every``          the next live sample of ``sample --every`` (until the process is stopped)
=================  =========================================================================
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import tenacity
from tenacity import (
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_fixed,
    wait_none,
)


class BudgetSettings(Protocol):
    """The settings the budgets come from (``launcher.config.ToolSettings``)."""

    @property
    def start_timeout(self) -> float | None: ...
    @property
    def health_timeout(self) -> float | None: ...
    @property
    def probe_timeout(self) -> float: ...
    @property
    def settle_seconds(self) -> float: ...
    @property
    def lock_timeout(self) -> float | None: ...


@dataclass(frozen=True)
class Waits:
    """The numbers of every policy below (seconds unless named otherwise)."""

    # the budgets, from the settings (``from_settings``); None: sized per restart from the
    # measured load (``launcher.deploy.budgets``: max(floor, load_factor x measured))
    start: float | None = None  # the old process gone -> the startup line (start_timeout)
    health: float | None = None  # the startup line -> /health 200 (health_timeout)
    probe: float = 60.0  # the real completion (probe_timeout)
    settle: float = 0.0  # the extra stay-up wait after the completion (settle_seconds)
    lock: float = 30.0  # another deploy's lock (lock_timeout; unset: one deploy's budget)
    # the start and health budgets of a config never measured: today's model on a slow disk
    floors: tuple[float, float] = (120.0, 300.0)
    # a load may take this many times the last measured one (a cold page cache, a busy disk)
    load_factor: float = 4.0
    # the stop: the restart -> the replaced process gone; None: the unit's TimeoutStopSec
    # (systemd sends SIGKILL then) and this grace for the kill and the reaping
    stop: float | None = None
    stop_grace: float = 5.0

    # the gate's loop: one journal read paces it; `systemctl show` until the new process
    # shows (a bad config exits within milliseconds), then rarely (each call takes CPU the
    # loading server needs)
    journal_poll: float = 0.005
    state_polls: tuple[float, float] = (0.02, 0.25)
    # /health's timeout: a local llama-server answers in about a millisecond; doubled up to
    # the second while something holds the port but does not answer, but only after the
    # first second (a config that cannot bind a taken port dies within milliseconds)
    health_timeouts: tuple[float, float] = (0.005, 1.0)
    health_patience_after: float = 1.0
    # ... and to no more than this until the port has answered HTTP once: a request that
    # waits on a holder that never answers delays seeing the new process die (bench-deploy's
    # crashing config: a stand-in that loads before it binds a taken port)
    health_unanswered_cap: float = 0.1
    # the pause between two /health requests: a loading server answers 503 within a
    # millisecond, so without a pause a long load meant 100+ requests a second; the first
    # pause is short and stays so for the first moments (a tiny model is healthy within
    # ~100 ms of its start), then it is doubled to the cap
    # capped at 0.05 s: twenty requests a second (each a millisecond of the server's HTTP
    # thread), and a server ready while the gate waits is seen within 0.05 s; the startup
    # line that makes the polls fast again reaches the journal's follower within its poll
    # (20 ms; journalctl -f, the fallback, up to 0.25 s late)
    # (bench-deploy's "restart -> serving, gated" shows what the cap costs)
    health_polls: tuple[float, float] = (0.01, 0.05)
    health_fast_for: float = 0.5

    # a follower may be a poll behind (journalctl -f, the fallback: journald tells it of
    # new entries every 250 ms), the files have them before; a dead process's last lines
    # may still be on their way into them
    journal_catchup: float = 2.0
    # read until the lines name the cause; 0.5 s was too short on a busy 2-core machine (a
    # taken port reported as a bare exit, 2026-12-02); under the unit's RestartSec (2 s),
    # so a crash whose cause is seen at once still rolls back before systemd starts it again
    last_words: float = 1.5
    reread: float = 0.02  # between two reads of the journal file
    lock_poll: float = 0.05  # between two tries of the lock
    # the front's HAProxy, started again by systemd (RestartSec=1) or by `systemctl start`
    front_up: float = 30.0
    front_poll: float = 0.05
    # a `systemctl start` of the front that failed: a start job that raced systemd's own
    # restart of a killed HAProxy ends with that one's result; attempts, the pause between
    # (the service's RestartSec)
    front_starts: tuple[int, float] = (3, 1.0)
    # a POST to a server that just turned healthy: attempts, the first pause (then doubled)
    probe_retry: tuple[int, float] = (3, 0.05)
    # restarts after systemd itself failed to spawn the process (219/CGROUP and friends)
    respawns: int = 1

    @classmethod
    def from_settings(cls, settings: BudgetSettings, **overrides: Any) -> Waits:
        """The budgets of ``settings`` (each field's comment names its setting), and
        ``overrides`` of any field."""
        budgets = {field: getattr(settings, name) for field, name in _SETTING_OF.items()}
        given = {field: value for field, value in budgets.items() if value is not None}
        return replace(cls(**given), **overrides)


#: The setting each budget comes from.
_SETTING_OF = {
    "start": "start_timeout",
    "health": "health_timeout",
    "probe": "probe_timeout",
    "settle": "settle_seconds",
    "lock": "lock_timeout",
}


def lock(w: Waits, timeout: float | None = None) -> Retrying:
    """Try a non-blocking lock again while it raises ``BlockingIOError``; the last error is
    raised when ``timeout`` (default ``w.lock``) has passed."""
    return Retrying(
        retry=retry_if_exception_type(BlockingIOError),
        stop=stop_after_delay(w.lock if timeout is None else timeout),
        wait=wait_fixed(w.lock_poll),
        reraise=True,
    )


def ready(
    expired: Callable[[], bool], give_up: Callable[[tenacity.RetryCallState], Any]
) -> Retrying:
    """Call a poll step again while it returns None (its own journal read paces it) until it
    returns what it waited for, raises, or ``expired()``; then ``give_up`` raises."""
    return Retrying(
        retry=retry_if_result(lambda r: r is None),
        stop=lambda _state: expired(),
        wait=wait_none(),
        retry_error_callback=give_up,
    )


def respawn(
    w: Waits, failed: type[BaseException], before_retry: Callable[[BaseException], None]
) -> Retrying:
    """Run the wait again after ``failed`` (systemd could not spawn the process), ``w.respawns``
    times (``before_retry`` gets the failure and restarts the unit)."""

    def hook(state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None
        error = state.outcome.exception()
        assert error is not None
        before_retry(error)

    return Retrying(
        retry=retry_if_exception_type(failed),
        stop=stop_after_attempt(1 + w.respawns),
        wait=wait_none(),
        before_sleep=hook,
        reraise=True,
    )


class Backoff:
    """Capped exponential pauses (``first`` for ``fast_for`` seconds after a reset, then
    doubled up to ``cap``): ``due()`` says whether the next try is due, ``tried()`` schedules
    the one after, ``reset()`` makes it due now. For a poll inside a loop that another wait
    paces (the gate's journal read), where a tenacity ``Retrying`` around the call does not
    fit."""

    def __init__(
        self,
        first: float,
        cap: float,
        fast_for: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.first, self.cap, self.fast_for, self.clock = first, cap, fast_for, clock
        self.reset()

    def reset(self) -> None:
        self.pause = self.first
        self.next_at = 0.0
        self.fast_until = self.clock() + self.fast_for

    def due(self) -> bool:
        return self.clock() >= self.next_at

    def tried(self) -> None:
        now = self.clock()
        self.next_at = now + self.pause
        if now >= self.fast_until:
            self.pause = min(self.pause * 2, self.cap)


def health_polls(w: Waits) -> Backoff:
    """The pauses between two /health requests while the server loads."""
    return Backoff(*w.health_polls, fast_for=w.health_fast_for)


def _last_result(state: tenacity.RetryCallState) -> Any:
    assert state.outcome is not None
    return state.outcome.result()


def until(w: Waits, budget: float, done: Callable[[Any], bool]) -> Retrying:
    """Call again every ``w.reread`` while ``done(result)`` is false, for ``budget`` seconds;
    then the last result is returned (the caller judges it). Used as ``journal_catchup``
    and ``last_words``."""
    return Retrying(
        retry=retry_if_result(lambda r: not done(r)),
        stop=stop_after_delay(budget),
        wait=wait_fixed(w.reread),
        retry_error_callback=_last_result,
    )


def journal_catchup(w: Waits, done: Callable[[Any], bool]) -> Retrying:
    return until(w, w.journal_catchup, done)


def last_words(w: Waits, done: Callable[[Any], bool]) -> Retrying:
    return until(w, w.last_words, done)


def probe_post(
    w: Waits, retry_on: type[BaseException] | tuple[type[BaseException], ...]
) -> Retrying:
    """A request retried on a dropped connection (``retry_on``) or a 503, ``w.probe_retry``
    (attempts, first pause; then doubled); the last answer (or error) is the caller's to judge."""
    return Retrying(
        retry=retry_if_exception_type(retry_on)
        | retry_if_result(lambda r: getattr(r, "status_code", None) == 503),
        stop=stop_after_attempt(w.probe_retry[0]),
        wait=wait_exponential(multiplier=w.probe_retry[1]),
        retry_error_callback=_last_result,
    )


def front_up(w: Waits, down: type[BaseException]) -> Retrying:
    """Ask the front again while it raises ``down``, for ``w.front_up`` seconds; the last
    error is raised then."""
    return Retrying(
        retry=retry_if_exception_type(down),
        stop=stop_after_delay(w.front_up),
        wait=wait_fixed(w.front_poll),
        reraise=True,
    )


def front_start(w: Waits, failed: type[BaseException]) -> Retrying:
    """Start the front again after ``failed``, ``w.front_starts`` (attempts, the pause
    between); the last error is raised then."""
    return Retrying(
        retry=retry_if_exception_type(failed),
        stop=stop_after_attempt(w.front_starts[0]),
        wait=wait_fixed(w.front_starts[1]),
        reraise=True,
    )


def drain(poll: float, sleep: Callable[[float], None] = time.sleep) -> Retrying:
    """Call a drain step again every ``poll`` seconds while it returns None; the step
    returns its report when the server is idle, unreachable or past its deadline."""
    return Retrying(retry=retry_if_result(lambda r: r is None), wait=wait_fixed(poll), sleep=sleep)


def every(interval: float, sleep: Callable[[float], None] = time.sleep) -> Retrying:
    """Call a step again every ``interval`` seconds, without end (``sample --every``: one
    process that pays its imports once); an exception of the step ends it."""
    return Retrying(retry=retry_if_result(lambda _: True), wait=wait_fixed(interval), sleep=sleep)


def every_while(interval: float, sleep: Callable[[float], None] = time.sleep) -> Retrying:
    """Call a step again every ``interval`` seconds while it returns True (the bake's
    samples until its verdict); an exception of the step ends it."""
    return Retrying(retry=retry_if_result(bool), wait=wait_fixed(interval), sleep=sleep)
