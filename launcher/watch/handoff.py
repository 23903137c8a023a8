"""The hand-off from a deploy to its bake (``launcher.watch.bake``).

The verbs that change the live generation (deploy, set, unset, rollback) end the bake of the
generation they replaced; deploy, set and unset begin the new one's (a rollback never: a
revert is never reverted). The bake is watched from the deploy on, not from its sampler
timer's next tick (a minute away), because a bad config fails in its first seconds: seed
000's pool overflowed 3.5 s after the restart, as its clients' requests reached it.

- At the gate, while the new process loads, the deploy announces its bake
  (``bake.announce``) and starts its carrier, the sampler's service (``NAME-sample.service``,
  restarted if it runs: a sample, or the carry of the bake this deploy replaces; a sample
  may be cut at any point). The carrier imports what a revert needs and waits
  (``bake.awaited``).
- From its gate's pass on, the deploy itself looks out (``Lookout``): the carrier could not
  hold the front while the deploy holds the unit's lock. At a hard failure that reverts the
  bake for sure it holds the front at once (once its handover sent requests to the new
  config); a rollback of the transaction stops it first.
- Under the deploy's lock (``Deployer.then``) the bake begins; when the lookout held, its
  first sample is taken there and a revert runs under that lock (``_first_moments``), and
  the verb's outcome is ``reverted``. Then the announcement goes, and the carrier carries
  the bake, following the process's journal from its first line and watching its pool
  (``launcher.watch.carry.on_unit``).

A bake needs its carrier: ``require_carrier`` refuses ``--bake`` on a unit whose sampler
units are not installed (exit 2, nothing changed), before the deploy.

``--wait`` (and the Ansible module's ``bake``) waits for the verdict that same carrier
records, by reading the bake's record, so a person's ``set --bake`` and a playbook's task
are watched the same way. A carrier found stopped while the bake runs (killed) is started
again; one killed during its revert is recovered and the bake settled, as ``recover`` does.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from launcher.config import ToolSettings
from launcher.deploy import budgets
from launcher.deploy.outcome import Result
from launcher.deploy.restart import fronthold
from launcher.deploy.restart.front import Front
from launcher.deploy.transaction import Deployer
from launcher.errors import ConfigInvalid, LauncherError, StoreError
from launcher.host import timer
from launcher.host.systemd import Systemd
from launcher.server import serverlog
from launcher.watch import bake, carry, revert, sample, sampler, verdict

#: How often ``--wait`` reads the bake's record, and checks that its carrier runs.
POLL = 0.2
CARRIER_CHECK = 5.0
#: How long one read of the lookout's journal waits before it looks whether to stop.
LOOK = 0.05


def carrier(settings: ToolSettings) -> Systemd:
    """The sampler's service of the unit: the bake's carrier."""
    return Systemd(timer.names(settings.unit_name)[0], settings.scope)


def require_carrier(settings: ToolSettings) -> None:
    """Refuse a bake (``settings.bake`` > 0) whose carrier is not installed: the sampler's
    service and timer (``install`` writes them), before anything changes."""
    if settings.bake <= 0:
        return
    missing = []
    for name in timer.names(settings.unit_name):
        shown = Systemd(name, settings.scope).show("LoadState").get("LoadState", "")
        if shown != "loaded":
            missing.append(name)
    if not missing:
        return
    scope = settings.scope
    raise ConfigInvalid(
        f"--bake {settings.bake:g}s needs the sampler's units, which watch the bake: "
        f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed in "
        f"{scope} scope. Run `llama-launcher install` for {settings.unit_name} again (it "
        "writes them, and a config equal to the live one restarts nothing), or give "
        "--bake 0; nothing was changed"
    )


def start_carrier(settings: ToolSettings) -> dict[str, Any]:
    """Start (or restart) the bake's carrier now, without waiting for its first sample
    (``systemctl restart --no-block``; its start limit reset first: deploys in a row count
    toward it). What was done, with ``error`` when systemd refused."""
    sd = carrier(settings)
    try:
        sd.reset_failed()
        sd.restart()
    except LauncherError as e:
        return {"unit": sd.unit, "started": False, "error": str(e)}
    return {"unit": sd.unit, "started": True}


def baked(d: Deployer, verb: str, run: Callable[[], Result], wait: bool = False) -> Result:
    """Run ``run`` (a deploy, set or unset through ``d``) with its bake's hand-off (see the
    module docstring); ``wait``: the result carries the bake's verdict (``wait_for``)."""
    if d.settings.bake <= 0:
        return after(d, run(), verb)
    hand = _HandOff(d, verb)
    d.on_phase, d.then = hand.hook(d.on_phase), hand.then
    try:
        result = run()
    finally:
        hand.close()
    data = result.bake or {}
    if wait and data.get("started") and "verdict" not in data and result.generation is not None:
        data["verdict"] = wait_for(d, result.generation)
        _outcome(result, data["verdict"])
    return result


class _HandOff:
    """One deploy's hand-off to its bake: the carrier started and the bake announced at the
    gate, the lookout from the gate's pass, the bake begun (and its first moments judged)
    under the deploy's lock (``Deployer.then``)."""

    def __init__(self, d: Deployer, verb: str) -> None:
        self.d, self.verb = d, verb
        self.at_gate: dict[str, Any] | None = None
        self.announced: int | None = None
        self.lookout: Lookout | None = None
        #: what went wrong that the result should say (an announcement not written)
        self.notes: list[str] = []

    def hook(self, chained: Callable[[str], None] | None) -> Callable[[str], None]:
        def on_phase(phase: str) -> None:
            if phase == "gate" and self.at_gate is None:
                self._announce()
            elif phase == "gated" and self.lookout is None:
                self.lookout = Lookout(self.d)
            elif phase in ("serving", "released") and self.lookout is not None:
                self.lookout.free.set()
            elif phase == "rollback":  # the transaction goes back: no hold of ours in its way
                self._stop_looking()
            if chained is not None:
                chained(phase)

        return on_phase

    def _announce(self) -> None:
        """The bake announced and its carrier started; a failure here never fails the
        deploy (the carrier is started again after it, or the timer's next tick takes it)."""
        txn = self.d.store.txn()
        try:
            seconds = float(txn.get("budget") or 0) + 60.0
            self.announced = bake.announce(self.d.store, int(txn.get("to") or 0), seconds)
        except (OSError, StoreError, ValueError) as e:
            self.notes.append(f"the bake's carrier was not told to wait for it: {e}")
        self.at_gate = start_carrier(self.d.settings)

    def _stop_looking(self) -> dict[str, Any] | None:
        """The lookout stopped, and a hold it took let go; what it held."""
        lookout, self.lookout = self.lookout, None
        if lookout is None:
            return None
        held = lookout.close()
        _let_go(self.d)  # a hold it took that nothing will judge (bounded: close waited)
        return held

    def then(self, result: Result) -> Result:
        lookout, self.lookout = self.lookout, None
        held = lookout.close() if lookout is not None else None
        try:
            result = after(self.d, result, self.verb, True, self.at_gate)
            result.warnings += self.notes
        finally:
            if held is not None:
                _first_moments(self.d, result, held)
            elif lookout is not None:
                _let_go(self.d)
        return result

    def close(self) -> None:
        """After the verb, whatever it ended with: the lookout stopped (a hold it took that
        no ``then`` judged let go: the deploy did not go through), its announcement gone."""
        self._stop_looking()
        if self.announced is not None:
            bake.unannounce(self.d.store, self.announced)


class Lookout:
    """The deploy's own watch of its new process, from its gate's pass until its bake
    begins: the carrier cannot hold the front while the deploy holds the unit's lock, and a
    bad config fails in these moments (clients' requests just sent to it). A thread (all of
    its work there: clients wait at the front while the deploy goes on) checks that a hold
    may come (a front with its release watcher, a bake a hard failure reverts for sure:
    ``carry.certain``), follows the process's journal (``carry.hard_failures``'s pattern)
    and at the first hard failure holds the front, as the early hold does
    (``launcher.watch.revert.EarlyHold``), under the lock this deploy holds, once the
    handover no longer touches the front's hold (``free``: the phase ``released`` after a
    hold, ``serving`` when the switch back sends requests to the unit); ``_first_moments``
    then judges it. ``close`` waits for the thread (a hold is bounded by HAProxy's start),
    and no hold comes after it."""

    def __init__(self, d: Deployer) -> None:
        self.d = d
        self.stop = threading.Event()
        #: set when the handover is done with the front's hold: a hold now is not undone
        self.free = threading.Event()
        #: taken by a hold and by ``close``: no hold begins after the stop
        self.holding = threading.Lock()
        #: what was held (the early hold's record), or None
        self.held: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._run, name="lookout", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(LauncherError, OSError, StoreError):
            armed = self._arm()
            if armed is not None:
                self._watch(*armed)

    def _arm(self) -> tuple[Front, int, float] | None:
        """The front, the process and the hold's length, when a hold may come."""
        d = self.d
        txn = d.store.txn()
        to, previous = txn.get("to"), txn.get("from")
        if not isinstance(to, int) or not isinstance(previous, int):
            return None
        front = Front(d.store.root, d.settings.unit_name, d.settings.scope)
        if front.spec() is None or fronthold.watcher_missing(front) is not None:
            return None
        if not carry.certain(bake.plan(d.settings, d.store, to, previous)):
            return None
        pid = d.systemd.state().main_pid
        drain = min(d.settings.drain_timeout, d.settings.bake_drain)
        seconds = budgets.deploy_total(drain, d.gate.waits, budgets.last_load(d.store))
        return (front, pid, seconds) if pid > 0 else None

    def _watch(self, front: Front, pid: int, seconds: float) -> None:
        # the journal handle is this thread's (sd-journal(3))
        follower = self.d.systemd.follow(None, grep=serverlog.HARD_FAILURE_GREP, pid=pid)
        with follower:
            while not self.stop.is_set() and not follower.ended:
                if follower.read(LOOK):
                    while not self.free.wait(LOOK):
                        if self.stop.is_set():
                            return
                    self._hold(front, seconds)
                    return

    def _hold(self, front: Front, seconds: float) -> None:
        with self.holding:
            if self.stop.is_set():
                return
            t0 = time.monotonic()
            with contextlib.suppress(LauncherError, OSError):
                front.hold(seconds)
                took = round(time.monotonic() - t0, 3)
                self.held = {"held": True, "at": time.time(), "took": took, "by": "the deploy"}

    def close(self) -> dict[str, Any] | None:
        """Stop watching (a hold under way is waited for; none begins after); what was held."""
        with self.holding:
            self.stop.set()
        self.thread.join()
        return self.held


def _first_moments(d: Deployer, result: Result, held: dict[str, Any]) -> None:
    """The lookout held the front at a hard failure: the bake's first sample, taken here
    under the deploy's lock, judges it, and a revert runs under that lock and takes the
    hold over (or ends it at its switch); a hold of this process still recorded after it
    (no revert, or one that failed before its handover) is let go."""
    data = result.bake or {}
    try:
        if not data.get("started") or result.generation is None:
            return
        gen = d.store.get(result.generation)

        def rev(b: bake.Bake, why: verdict.Verdict) -> dict[str, Any]:
            assert b.previous is not None
            done = revert.revert(b.generation, b.previous, b.settings, b.policy.drain, why, True)
            return {**done, "early_hold": held}

        out = sample.sample(sampler.target_for(d.settings), d.systemd, revert=rev)
        if out.skipped:
            result.warnings.append(
                f"the front was held at a hard failure, but the bake's first sample did not "
                f"judge it ({out.skipped}); the sampler's service judges it next"
            )
        b = bake.load(gen.path)
        if b is not None and not b.running:
            data["verdict"] = {**b.view(), "line": bake.say(b)}
            _outcome(result, data["verdict"])
    finally:
        _let_go(d)


def _let_go(d: Deployer) -> None:
    """The front released if the hold recorded is this process's."""
    with contextlib.suppress(LauncherError, OSError):
        front = Front(d.store.root, d.settings.unit_name, d.settings.scope)
        hold = front.holding()
        if hold is not None and hold.pid == os.getpid():
            front.release()


def _carried(settings: ToolSettings, at_gate: dict[str, Any] | None) -> dict[str, Any]:
    """The carrier of a bake just begun: the one the gate started, waiting for it (a start
    of an active unit does nothing), started anew if it is gone; else started now."""
    if at_gate is None or not at_gate.get("started"):
        return start_carrier(settings)
    try:
        carrier(settings).start(block=False)
    except LauncherError as e:
        return {**at_gate, "started": False, "error": str(e)}
    return {**at_gate, "at": "gate"}


def after(
    d: Deployer,
    result: Result,
    verb: str,
    bakes: bool = True,
    at_gate: dict[str, Any] | None = None,
) -> Result:
    """After a verb that changed the live generation: the bake it replaced ends (said in the
    result); with ``bakes`` and the setting ``bake``, the new generation's begins and its
    carrier runs (``at_gate``: the one started at the deploy's gate, which waits for it;
    started again if it is gone)."""
    if result.outcome != "deployed" or result.generation is None:
        return result
    prev = result.previous_generation
    data: dict[str, Any] = {}
    ended = bake.end(d.store, prev, f"generation {result.generation} replaced it ({verb})")
    if ended is not None:
        data["ended"] = ended
        result.warnings.append(
            f"the bake of generation {prev} ended before its verdict: generation "
            f"{result.generation} replaced it"
        )
    if bakes and d.settings.bake > 0:
        started = bake.begin(d.settings, d.store, result.generation, prev)
        data["started"] = started.view()
        data["carrier"] = _carried(d.settings, at_gate)
        if not data["carrier"]["started"]:
            result.warnings.append(
                f"the bake is not watched until the sampler's timer starts "
                f"{data['carrier']['unit']} (within sample_interval): "
                f"{data['carrier']['error']}"
            )
    result.bake = data or None
    return result


def wait_for(
    d: Deployer,
    generation: int,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Wait for the verdict of ``generation``'s bake, as its carrier records it; the bake's
    view as it ended (``state`` still ``baking`` or ``reverting``, with a ``note``, when no
    verdict came within the bake's deadline and its carrier's patience)."""
    path = d.store.get(generation).path
    b = bake.load(path)
    checked = clock()
    while b is not None and b.state in (bake.RUNNING, bake.REVERTING):
        if time.time() > b.deadline + _patience(b):
            view = {**b.view(), "line": None}
            view["note"] = (
                f"no verdict was recorded by the bake's deadline and its carrier's patience; "
                f"see `llama-launcher status --unit {d.settings.unit_name}` and "
                f"`journalctl -u {carrier(d.settings).unit}`"
            )
            return view
        if clock() - checked >= CARRIER_CHECK:
            checked = clock()
            b = _keep_carried(d, b) or b
            if not (b.running or b.state == bake.REVERTING):
                break
        sleep(POLL)
        b = bake.load(path) or b
    if b is None:
        return {"generation": generation, "state": "unknown", "note": "no bake record"}
    return {**b.view(), "line": bake.say(b)}


def _patience(b: bake.Bake) -> float:
    """How long past its deadline a bake may still get its verdict: the carrier's patience
    (``carry._Patience``, three times its grace when another sample holds the lock) and a
    revert's transaction."""
    grace = b.policy.unread_limit * b.policy.interval
    return 3 * grace + b.policy.interval + 600.0


def _keep_carried(d: Deployer, b: bake.Bake) -> bake.Bake | None:
    """A carrier found stopped: started again while the bake runs; when it died during the
    revert, the revert's transaction recovered and the bake settled (``recover``'s work).
    Returns the bake as it is now (None: nothing changed)."""
    sd = carrier(d.settings)
    try:
        if sd.state().active in ("active", "activating", "reloading"):
            return None
    except LauncherError:
        return None
    if b.running:
        start_carrier(d.settings)
        return None
    with contextlib.suppress(LauncherError, StoreError, OSError):
        d.recover_only()
        return bake.settle(d.store)
    return None


def _outcome(result: Result, verdict: dict[str, Any]) -> None:
    """The verb's outcome after the bake's verdict (``--wait``): ``reverted`` (the previous
    config serves again), ``revert_failed`` (a revert was due and did not happen, or was
    undone: the new config serves still), ``rollback_failed`` (the revert's rollback failed
    both ways: neither serves); a bake that passed or ended inconclusive leaves it
    ``deployed``. The message says the verdict either way."""
    state = verdict.get("state")
    line = verdict.get("line") or ""
    if state == "reverted":
        done = verdict.get("revert") or {}
        result.outcome = "reverted"
        result.generation = done.get("generation", result.generation)
    elif state == "revert_failed":
        done = verdict.get("revert") or {}
        both = done.get("outcome") == "rollback_failed"
        result.outcome = "rollback_failed" if both else "revert_failed"
    if state in ("reverted", "revert_failed"):
        result.message = line
    elif line:
        result.message += f"; {line}"
    elif verdict.get("note"):
        result.warnings.append(str(verdict["note"]))
