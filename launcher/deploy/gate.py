"""The gate: is the restarted unit serving the config it was given?

    the replaced process is gone (the stop: its own budget, the unit's TimeoutStopSec) ->
    the new process shows in systemd (its first exit fails the gate, not systemd's restart
    loop) -> the startup line equals the plan -> /health 200 from that process -> /props
    agrees -> a real completion -> the process is still up

A vLLM unit (``launcher.server.vllm``: the argv runs ``vllm serve``) is gated the same way
on its own lines: ``non-default args`` equal to the plan, ``KV cache size: N tokens,
Maximum concurrency for W tokens`` equal to the planned pool and window, ``Application
startup complete.``; it has no /props, and the completion names its served model.

The probe goes to the address of the argv being gated (unless the setting ``base_url`` names
another; a deploy behind a front never passes one: ``Deployer``), and a /health 200 counts
only when the process systemd started has the socket listening there (``_serves``): a verdict
names figures of that process, never of another that holds its port (a front's bridge).

Every wait is a policy of ``launcher.waits``; the budgets of one restart are a
``budgets.Budget`` (sized by the config's measured load, or the settings). The start clock
runs from the moment the replaced process is gone, so a slow stop costs the start nothing.
The gate's timings (seconds since the restart: ``stopped``, ``startup_line``, ``healthy``,
``completion``) are what the next restart's budgets are sized by. A failure raises
``GateFailure`` (phase, class, message, the classified log tail).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

import tenacity

from launcher import waits
from launcher.config import vllm as vllm_config
from launcher.deploy import budgets
from launcher.deploy.restart import drain
from launcher.errors import GateFailure, LauncherError, ProbeError
from launcher.host import envfile, ports
from launcher.host.systemd import Follower, Systemd, UnitState
from launcher.server import binary, kvlayout, serverlog, vllm
from launcher.server.httpclient import url_from_argv

if TYPE_CHECKING:
    from launcher.server.probe import Completion, Probe


T = TypeVar("T")


class Progress(Protocol):
    """(phase, elapsed seconds, the last log line, the expected seconds when measured)."""

    def __call__(
        self, phase: str, elapsed: float, line: str, expected: float | None = None, /
    ) -> None: ...


#: Exit statuses systemd uses for its own failures to spawn a process (200 CHDIR .. 243
#: CREDENTIALS, systemd.exec(5) "Process Exit Codes"); llama-server itself exits 0 or 1.
SPAWN_FAILURES = range(200, 244)


class SpawnFailed(Exception):
    """systemd could not spawn the process (not the config's fault): restart once more."""

    def __init__(self, state: UnitState) -> None:
        super().__init__(f"status {state.exec_main_status}")
        self.state = state


@dataclass
class GateResult:
    startup: dict[str, Any]
    props: dict[str, Any]
    probe: dict[str, Any]
    warnings: list[str]
    timings: dict[str, float]
    state: UnitState
    log: list[str] = field(default_factory=list)  # the new process's lines up to serving
    load: budgets.Load | None = None  # what this start took (the next budgets' measure)

    def record(self) -> dict[str, Any]:
        """What a generation's meta keeps of its gate."""
        load = self.load.to_dict() if self.load else None
        return {
            "startup": self.startup,
            "probe": self.probe,
            "warnings": self.warnings,
            "load": load,
        }


@dataclass
class _Ready:
    scan: serverlog.StartupScan | vllm.StartupScan
    log: list[str]
    before: UnitState
    pid: int
    #: the startup values came from /props (a startup line in no known form): the warning
    unread: str | None = None


class Gate:
    """Gates the restarts of one unit. ``warnings`` collects what the waits saw (a respawn)."""

    def __init__(
        self,
        systemd: Systemd,
        policy: waits.Waits,
        base_url: str | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.systemd = systemd
        self.waits = policy
        self.base_url = base_url
        self.progress = progress
        self.warnings: list[str] = []
        self.binary = "llama-server"
        #: the argv being gated runs vLLM (``__call__``)
        self.vllm = False
        self.budget = budgets.for_deploy(policy, None)  # this restart's (``__call__``)

    def url_for(self, argv: list[str]) -> str:
        """The probe's base URL: the setting, else --host/--port of the argv being gated."""
        return self.base_url or url_from_argv(argv)

    def __call__(
        self,
        plan: kvlayout.PoolPlan | None,
        cursor: str | None,
        before: UnitState,
        api_key: str | None,
        argv: list[str],
        budget: budgets.Budget | None = None,
        old: drain.ExitWatch | None = None,
    ) -> GateResult:
        """Wait for the restarted unit to serve; raise GateFailure with the reason.

        ``budget``: this restart's (default: the policy's, floors where unset); ``old``: the
        watch on the replaced process (the handover's), else the gate starts one."""
        t0 = time.monotonic()
        self.binary = argv[0] if argv else "llama-server"  # its build names an unread startup
        self.vllm = vllm.is_vllm_argv(argv)
        self.argv = argv
        self.budget = budget or budgets.for_deploy(self.waits, None)
        timings: dict[str, float] = {}
        # imported here, after the restart: httpx's import runs while the server loads
        from launcher.server.probe import Probe

        with Probe(self.url_for(argv), api_key, policy=self.waits) as probe:
            try:
                ready = self._wait_ready(probe, cursor, before, t0, old, timings)
                timings["healthy"] = round(time.monotonic() - t0, 3)
                startup, log, props, completion, state = self._check(probe, plan, cursor, ready)
                timings["completion"] = round(time.monotonic() - t0, 3)
            except ProbeError as e:
                raise GateFailure("probe", "probe", str(e), self.tail(30)) from e
        if self.waits.settle:
            time.sleep(self.waits.settle)
            state = self.systemd.state()
        # still up after the completion: what systemd said meanwhile, and its process now
        dead = _dead(state, ready.before, True)
        if not dead and not _alive(ready.pid):
            state = self.systemd.state()
            dead = _dead(state, ready.before, True) or f"{self.name} (pid {ready.pid}) exited"
        if dead:
            raise self.exited(dead, log + self.tail(20))
        return GateResult(
            startup,
            {
                "total_slots": props.get("total_slots"),
                "n_ctx": props.get("default_generation_settings", {}).get("n_ctx"),
            },
            completion.to_dict(),
            [
                *self.warnings,
                *(ready.scan.startup.warnings if ready.scan.startup else []),
                *([ready.unread] if ready.unread else []),
            ],
            timings,
            state,
            log,
            budgets.Load.from_timings(timings, self.budget.stop_for(before, self.waits.stop_grace)),
        )

    @property
    def name(self) -> str:
        """The server being gated, in words."""
        return "vLLM" if self.vllm else "llama-server"

    def scanner(self) -> serverlog.StartupScan | vllm.StartupScan:
        """A fresh reader of the startup lines of the server being gated."""
        return vllm.StartupScan() if self.vllm else serverlog.StartupScan()

    def classify(self, lines: list[str]) -> tuple[str, str] | None:
        return vllm.classify(lines) if self.vllm else serverlog.classify(lines)

    def exited(self, reason: str, log: list[str]) -> GateFailure:
        hit = self.classify(log)
        kind, sentence = hit if hit else ("exited", "")
        return GateFailure(
            "startup", kind, reason + (f": {sentence}" if sentence else ""), log[-30:]
        )

    def _beside(
        self, ready: _Ready, cursor: str | None, ask: Callable[[], T]
    ) -> tuple[serverlog.StartupScan | vllm.StartupScan, list[str], UnitState, T | BaseException]:
        """``ask`` (the HTTP checks) while the startup line (a journal read) and the unit's
        state (a systemctl) are read beside it: each costs a process start. What ``ask``
        raised is returned, for the caller to report in the order of its checks."""
        with ThreadPoolExecutor(2) as workers:
            read = workers.submit(self._startup_line, ready, cursor)
            shown = workers.submit(self.systemd.state)
            asked: T | BaseException
            try:
                asked = ask()
            except (ProbeError, GateFailure) as e:
                asked = e
            scan, log = read.result()
            return scan, log, shown.result(), asked

    def _check_vllm(
        self,
        probe: Probe,
        plan: kvlayout.PoolPlan | None,
        cursor: str | None,
        ready: _Ready,
    ) -> tuple[dict[str, Any], list[str], dict[str, Any], Completion, UnitState]:
        """vLLM's startup lines against the plan, and a real completion of its served
        model (it has no /props: what /props says of llama-server, the lines say)."""
        scan, log, state, asked = self._beside(
            ready, cursor, lambda: probe.chat(self.waits.probe, model=vllm.served_name(self.argv))
        )
        startup = scan.startup
        if startup is None or not isinstance(startup, vllm.Startup):
            raise GateFailure(
                "startup",
                "startup_unread",
                "vLLM serves, but its startup lines (non-default args, KV cache size, "
                "Application startup complete.) were not found in the journal",
                log[-30:],
            )
        startup_d = {
            "n_slots": startup.n_slots if startup.n_slots is not None else (plan and plan.n_slots),
            "n_ctx_slot": startup.n_ctx_slot,
            "kv_unified": True,
            "pool_cells": startup.pool_cells,
            "config_file": None,
            "max_concurrency": startup.concurrency,
            "non_default_args": {k: repr(v) for k, v in startup.non_default.items()},
        }
        if plan is not None:
            self.warnings += _compare_vllm(plan, startup, self.argv, log)
        if isinstance(asked, BaseException):
            raise asked
        props = {
            "total_slots": startup_d["n_slots"],
            "default_generation_settings": {"n_ctx": startup.n_ctx_slot},
        }
        return startup_d, log, props, asked, state

    def _check(
        self,
        probe: Probe,
        plan: kvlayout.PoolPlan | None,
        cursor: str | None,
        ready: _Ready,
    ) -> tuple[dict[str, Any], list[str], dict[str, Any], Completion, UnitState]:
        """The startup line, /props and the completion of a healthy server.

        The startup line (a journal read) and the unit's state (a systemctl) are read beside
        /props and the chat: each costs a process start. Failures are reported in the order
        of the checks: startup line, plan, /props, completion."""
        if self.vllm:
            return self._check_vllm(probe, plan, cursor, ready)

        def ask() -> tuple[dict[str, Any], Completion]:
            props = probe.props()
            _compare_props(plan, props, ready.log)
            return props, probe.chat(self.waits.probe)

        ready.scan, log, state, asked = self._beside(ready, cursor, ask)
        startup = ready.scan.startup
        assert not isinstance(startup, vllm.Startup)
        if startup is None:
            assert isinstance(ready.scan, serverlog.StartupScan)
            # a build whose startup line this launcher cannot read: /props says the rest
            if isinstance(asked, BaseException):
                raise asked
            startup, ready.unread = serverlog.startup_from_props(
                asked[0], binary.describe(self.binary), ready.scan
            )
        startup_d = {
            "n_slots": startup.n_slots,
            "n_ctx_slot": startup.n_ctx_slot,
            "kv_unified": startup.kv_unified,
            "pool_cells": startup.pool_cells,
            "config_file": startup.config_file,
        }
        if plan is not None:
            _compare(plan, startup_d, log)
        if isinstance(asked, BaseException):
            raise asked
        props, completion = asked
        return startup_d, log, props, completion, state

    def _wait_ready(
        self,
        probe: Probe,
        cursor: str | None,
        before: UnitState,
        t0: float,
        old: drain.ExitWatch | None,
        timings: dict[str, float],
    ) -> _Ready:
        """Until the *new* process answers /health 200 (``waits.respawn`` around
        ``waits.ready``); ``timings`` gets when the old process went and the startup line."""
        watch = _Watch(self, probe, cursor, before, t0, old)
        try:
            return self._respawning(watch)
        finally:
            watch.finish(timings)

    def _respawning(self, watch: _Watch) -> _Ready:
        def respawned(error: BaseException) -> None:
            assert isinstance(error, SpawnFailed)
            self.warnings.append(
                f"systemd failed to spawn the service (status {error.state.exec_main_status}, "
                f"{error.state.result}); restarted it once more"
            )
            watch.respawned += 1
            watch.restart_from(error.state)
            self.systemd.reset_failed()
            self.systemd.restart()

        ready: _Ready = waits.respawn(self.waits, SpawnFailed, respawned)(watch.run)
        return ready

    def _startup_line(
        self, ready: _Ready, cursor: str | None
    ) -> tuple[serverlog.StartupScan | vllm.StartupScan, list[str]]:
        """The startup line, once the server is healthy. It is in the journal file already
        while the follower may be a poll behind it (journalctl -f, the fallback, 250 ms),
        so read the file."""
        if ready.scan.startup is not None:
            return ready.scan, ready.log
        old_pid = ready.before.main_pid

        def read() -> tuple[serverlog.StartupScan | vllm.StartupScan, list[str]]:
            log, _ = self.systemd.messages(cursor, skip_pid=old_pid)
            return self.scanner().feed_all(log), log

        # not found: a form this launcher does not know, and the gate reads /props instead
        return waits.journal_catchup(self.waits, lambda r: r[0].startup is not None)(read)

    def last_words(self, cursor: str | None, followed: list[str], old_pid: int) -> list[str]:
        """The dead process's journal since the restart, read until it says why the process
        died (``waits.last_words``; the lines followed so far when it never does): read even
        when the followed lines name a cause, as a later line can name a more specific one
        (a draft model fails with the main model's lines first)."""
        lines: list[str] = waits.last_words(self.waits, lambda r: bool(self.classify(r)))(
            lambda: self.systemd.messages(cursor, skip_pid=old_pid)[0]
        )
        return lines if self.classify(lines) or not followed else followed

    def tail(self, n: int = 30) -> list[str]:
        try:
            return self.systemd.tail(n)
        except LauncherError:
            return []

    def say(
        self, phase: str, elapsed: float = 0.0, line: str = "", expected: float | None = None
    ) -> None:
        if self.progress:
            self.progress(phase, elapsed, line, expected)


class _Watch:
    """One wait for the new process: the replaced one gone (the stop), then follow its
    journal (progress and the startup line), watch the unit (its first exit fails the gate)
    and poll /health (capped exponential backoff: ``waits.health_polls``).

    /health is asked only once systemd shows the new process: until then a 200 could come
    from the old server, still shutting down.
    """

    def __init__(
        self,
        gate: Gate,
        probe: Probe,
        cursor: str | None,
        before: UnitState,
        t0: float,
        old: drain.ExitWatch | None = None,
    ) -> None:
        self.gate, self.probe, self.cursor, self.t0 = gate, probe, cursor, t0
        self.w, self.budget = gate.waits, gate.budget
        self.stop_budget = self.budget.stop_for(before, self.w.stop_grace)
        # lines of the process the restart replaced are no evidence about the new one (it
        # may have been starting itself: a deployer killed mid-gate, then recovered)
        self.old_pid = before.main_pid
        self.respawned = 0
        self.health_polls = waits.health_polls(self.w)
        self.own_watch = old is None or old.pid != before.main_pid
        #: the probe's URL is the gated argv's own address, where the process must listen
        self.own_address = gate.base_url is None
        self.exit_watch = old if not self.own_watch else _exit_watch(before.main_pid)
        self.restart_from(before)

    def restart_from(self, before: UnitState) -> None:
        self.before = before
        self.scan = self.gate.scanner()
        self.log: list[str] = []
        self.started = False
        self.pid = 0  # the new process, once systemd shows it
        self.next_state = 0.0
        # the start clock: the replaced process gone (a respawn replaces a dead one)
        self.t_stopped: float | None = None if self.respawned == 0 else time.monotonic()
        self.t_startup: float | None = None
        self.health_wait = self.w.health_timeouts[0]
        self.answered = False  # the port has answered HTTP (any status) since the restart
        self.health_polls.reset()

    def finish(self, timings: dict[str, float]) -> None:
        """Put the phases' ends into ``timings`` (seconds since the restart); stop the
        gate's own watch on the replaced process."""
        for name, at in (("stopped", self.t_stopped), ("startup_line", self.t_startup)):
            if at is not None:
                timings[name] = round(at - self.t0, 3)
        if self.own_watch and self.exit_watch is not None:
            self.exit_watch.result()

    def _stopped(self, now: float) -> None:
        self.t_stopped = now
        self.health_polls.reset()  # the start: /health fast again for its first moments

    def _old_gone(self) -> bool:
        return self.exit_watch is None or self.exit_watch.gone_after is not None

    def run(self) -> _Ready:
        with self.gate.systemd.follow(self.cursor, self.old_pid) as journal:
            ready = waits.ready(self.expired, self.timed_out)(self.step, journal)
            assert ready is not None
            return ready

    def step(self, journal: Follower) -> _Ready | None:
        lines = journal.read(self.w.journal_poll)
        self.log.extend(lines)
        self.scan.feed_all(lines)
        now = time.monotonic()
        if self.t_startup is None and self.scan.startup is not None:
            self.t_startup = now
            self.health_polls.reset()  # the weights are loaded: /health turns 200 now
        gone = self.pid > 0 and not _alive(self.pid)
        if gone:
            self.next_state = now  # the new process is gone: ask systemd why, now
        if self.t_stopped is None and self._old_gone():
            self._stopped(now)
            self.next_state = now  # look for the new process at once
        if now >= self.next_state:
            self._look_at_unit(now)
        if self.t_stopped is None and self.started:
            self._stopped(now)
        if self.t_stopped is None:
            self.gate.say(
                "stopping",
                now - self.t0,
                f"waiting for the old server (pid {self.old_pid}) to exit "
                f"(at most {self.stop_budget:g}s)",
            )
            return None
        if not self.started or gone or not self.health_polls.due():
            return None
        self.health_polls.tried()
        status, detail = self.probe.health(self.health_wait)
        if (
            status is None
            and detail == self.probe.TIMEOUT
            and now - self.t0 > self.w.health_patience_after
        ):
            # something holds the port but does not answer (yet): ask again with more
            # patience, but first look at the unit (it may have died)
            cap = self.w.health_timeouts[1] if self.answered else self.w.health_unanswered_cap
            self.health_wait = min(self.health_wait * 2, cap)
        self.answered = self.answered or status is not None
        if status == 200:
            # the 200 must come from our process, not from whatever else may hold the port:
            # the process systemd started must still be there, listening at the address (one
            # that cannot bind it exits, and its log says why)
            if self.pid > 0 and _alive(self.pid):
                unit = self.gate.systemd.unit
                if not self.own_address or _serves(self.pid, self.probe.base_url, unit):
                    return _Ready(self.scan, self.log, self.before, self.pid)
                return None
            dead = _dead(self.gate.systemd.state(), self.before, True)
            if dead:
                raise self._died(dead)
            return None
        line = self.log[-1] if self.log else detail
        self.gate.say("loading", now - self.t_stopped, line, self.budget.expected)
        return None

    def _look_at_unit(self, now: float) -> None:
        # rarely while the old process stops too (its exit is watched, not asked for)
        self.next_state = now + self.w.state_polls[self.pid > 0 or self.t_stopped is None]
        state = self.gate.systemd.state()
        self.started = (
            self.started
            or state.invocation_id != self.before.invocation_id
            or state.main_pid not in (0, self.before.main_pid)
        )
        if self.started:
            self.pid = state.main_pid
        dead = _dead(state, self.before, self.started)
        if dead and state.exec_main_status in SPAWN_FAILURES and self.respawned < self.w.respawns:
            raise SpawnFailed(state)
        if dead:
            raise self._died(dead)

    def _died(self, reason: str) -> GateFailure:
        return self.gate.exited(reason, self.gate.last_words(self.cursor, self.log, self.old_pid))

    def expired(self) -> bool:
        now = time.monotonic()
        if self.t_stopped is None:
            return now > self.t0 + self.stop_budget
        if self.t_startup is None:
            return now > self.t_stopped + self.budget.start
        return now > self.t_startup + self.budget.health

    def timed_out(self, _state: tenacity.RetryCallState) -> Any:
        if self.t_stopped is None:
            raise GateFailure(
                "stop",
                "timeout",
                f"the old server (pid {self.old_pid}) did not exit within "
                f"{self.stop_budget:g}s of the restart (the unit's TimeoutStopSec and "
                f"{self.w.stop_grace:g}s); read `systemctl status {self.gate.systemd.unit}`",
                self.log[-30:],
            )
        if self.t_startup is None:
            raise GateFailure(
                "startup",
                "timeout",
                f"no startup line within {self.budget.start:g}s of the old process's exit "
                "(raise --start-timeout for a large model)",
                self.log[-30:],
            )
        raise GateFailure(
            "health",
            "timeout",
            f"/health did not return 200 within {self.budget.health:g}s of the "
            "startup line (raise --health-timeout for a large model)",
            self.log[-30:],
        )


def _compare_vllm(
    plan: kvlayout.PoolPlan, startup: vllm.Startup, argv: list[str], log: list[str]
) -> list[str]:
    """vLLM's lines against the plan, failing the gate where they differ: every typed flag
    the argv sets that ``non-default args`` names has the argv's value there (a flag it
    leaves out is at vLLM's default, which the argv asked for); the KV line's window is
    ``--max-model-len``, and where the plan's arithmetic is exact (``plan.exact``) its pool
    and its concurrency are the planned ones. Returns what the lines say beside the plan: a
    pool vLLM sized that holds fewer whole sequences than ``--max-num-seqs``, a line it
    could not read."""
    bad: list[str] = []
    said: list[str] = []
    nd = startup.non_default
    if "unread" in nd:
        said.append(f"vLLM's non-default args line could not be read: {str(nd['unread'])[:200]}")
    fields, _ = vllm_config.parse_flags(argv[3:])
    for name, value in fields.items():
        key = vllm_config.NON_DEFAULT_KEY.get(name)
        if key is None or key not in nd:
            continue
        got = nd[key][0] if isinstance(nd[key], list) and len(nd[key]) == 1 else nd[key]
        if not _same(got, value):
            bad.append(f"{key} = {got!r} (the argv says {value!r})")
    if startup.n_ctx_slot != plan.n_ctx_slot:
        bad.append(f"the window = {startup.n_ctx_slot} tokens (planned {plan.n_ctx_slot})")
    if plan.exact:
        if startup.pool_cells != plan.n_ctx:
            bad.append(f"the KV cache = {startup.pool_cells} tokens (planned {plan.n_ctx})")
        want = plan.n_ctx / plan.n_ctx_slot
        if abs(startup.concurrency - want) > 0.01 * max(want, 1):
            bad.append(f"the maximum concurrency = {startup.concurrency:g}x (planned {want:.2f}x)")
    elif startup.concurrency < plan.n_slots:
        said.append(
            f"vLLM's KV pool holds {startup.pool_cells} tokens: {startup.concurrency:g} "
            f"sequences of {startup.n_ctx_slot} at once, fewer than --max-num-seqs "
            f"{plan.n_slots}; when all are long the rest wait (vLLM preempts, none fails)"
        )
    if bad:
        raise GateFailure(
            "startup",
            "gate_mismatch",
            "vLLM's startup lines differ from the plan: " + ", ".join(bad),
            log[-30:],
        )
    return said


def _same(got: Any, want: Any) -> bool:
    """A ``non-default args`` value (Python's) against the argv's word."""
    if isinstance(got, bool) or isinstance(want, bool):
        return str(got).lower() == str(want).lower()
    try:
        return float(got) == float(want)
    except (TypeError, ValueError):
        return str(got) == str(want)


def _compare(plan: kvlayout.PoolPlan, startup: dict[str, Any], log: list[str]) -> None:
    want = {"n_slots": plan.n_slots, "n_ctx_slot": plan.n_ctx_slot, "kv_unified": plan.kv_unified}
    got = {k: startup[k] for k in want}
    want = {k: v for k, v in want.items() if got[k] is not None}  # what the log did not say
    got = {k: got[k] for k in want}
    if got == want:
        return
    bad = ", ".join(f"{k} = {got[k]} (planned {want[k]})" for k in want if got[k] != want[k])
    cause = ""
    if startup.get("config_file"):
        cause = (
            f"; llama-server read the config file {startup['config_file']} - "
            "remove it or put its settings into the typed config"
        )
    elif got["n_ctx_slot"] < want["n_ctx_slot"]:
        cause = "; fit may have shrunk the context to fit memory - set -c explicitly"
    raise GateFailure(
        "startup",
        "gate_mismatch",
        f"the startup line differs from the plan: {bad}{cause}",
        log[-30:],
    )


def _compare_props(plan: kvlayout.PoolPlan | None, props: dict[str, Any], log: list[str]) -> None:
    if plan is None:
        return
    slots = props.get("total_slots")
    n_ctx = props.get("default_generation_settings", {}).get("n_ctx")
    if slots != plan.n_slots or n_ctx != plan.n_ctx_slot:
        raise GateFailure(
            "probe",
            "gate_mismatch",
            f"/props says total_slots = {slots}, n_ctx = {n_ctx}; planned "
            f"{plan.n_slots} and {plan.n_ctx_slot}",
            log[-30:],
        )


def _dead(state: UnitState, before: UnitState, started: bool) -> str | None:
    """Why the unit is not running after our restart, or None while it still may be fine."""
    if state.n_restarts > before.n_restarts:
        return (  # the state is the restarted process's: how the first one ended is the journal's
            f"llama-server exited and systemd restarted it "
            f"({state.n_restarts - before.n_restarts} restart(s))"
        )
    if not started:
        return None
    if state.active in ("failed", "inactive") or state.sub in ("auto-restart", "failed", "dead"):
        status = state.exec_main_status
        if status == envfile.EX_CONFIG:
            return f"the launcher refused the env file (status {status})"
        return ended(state)
    return None


#: what systemd says of a process that a SIGKILL ended (ExecMainStatus is the signal's number)
_SIGKILL = 9


def ended(state: UnitState) -> str:
    """How llama-server ended, in words: an OOM kill named as one. Where systemd sees the
    memory controller (cgroup v2) it says ``Result=oom-kill``; elsewhere (cgroup v1, a limit
    outside the unit) the kernel's OOM killer shows only as a SIGKILL."""
    status = state.exec_main_status
    if state.result == "oom-kill":
        return (
            "the kernel's OOM killer ended llama-server (Result=oom-kill): the config needs "
            "more memory than the unit may use (MemoryMax=) or the host has"
        )
    if state.result == "signal" and status == _SIGKILL:
        return (
            "llama-server was killed by SIGKILL (status 9): the kernel's OOM killer sends it "
            "when memory runs out (`journalctl -k` says 'Killed process'), as does a kill -9"
        )
    return f"llama-server exited with status {status} ({state.result})"


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run independent systemctl/journalctl calls at once: each costs a process start."""
    with ThreadPoolExecutor(len(calls)) as workers:
        futures = [workers.submit(call) for call in calls]
        return [f.result() for f in futures]


def _exit_watch(pid: int) -> drain.ExitWatch | None:
    return drain.ExitWatch(pid) if pid > 0 else None


def _serves(pid: int, url: str, unit: str | None = None) -> bool:
    """Whether the socket listening at ``url``'s address is process ``pid``'s, or another
    process's of ``unit`` (a wrapper script's llama-server, its child); True when that
    cannot be told (its open files hidden, a host name, nothing listed)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return True
    if parts.hostname is None or port is None:
        return True
    found = {s.inode for s in ports.on(parts.hostname, port)}
    mine = ports.socket_inodes(pid)
    if not found or mine is None or mine & found:
        return True
    return unit is not None and any(h.unit == unit for h in ports.holders(found))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
