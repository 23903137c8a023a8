"""The front around a restart that no deploy's handover holds, and at the end of every
transaction. ``launcher.deploy.rollback`` calls it for a recovery (the calls marked
``# handover``)::

    hold_front()      before a recovery's restart of the old config: the front held (if any,
                      and only with its release watcher installed), what it let in finished
    recover()         after a recovery (or a deployer killed while holding): the front
                      pointed at the restored config and released, a second instance that
                      bridged the killed deploy stopped once its requests finished
    left_held()       whether the front is held with no transaction to recover (``recover``
                      then releases it)

Whatever a deploy, a rollback or a recovery ends with, its last step (``front_up``, under the
unit's lock) makes the public port answer: HAProxy started again if it does not (its units'
start limit reset first: its restarts and the deploy's own starts may have used it up),
pointed at the serving server; or the report's ``front_down`` says it is down and what to
run (``down_line``), which the result's first line repeats.

The reads a hold and a switch share are here too: whether the release watcher that ends a
hold is installed (``watcher_missing``), what the front has in flight (``front_drain``,
``drain_side``), and whether it sends requests to the second instance (``serves_live``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from launcher.deploy.restart import drain, lane
from launcher.deploy.restart.front import BACKEND, SERVERS, Front, FrontError, FrontSpec
from launcher.deploy.restart.standby import Standby
from launcher.errors import LauncherError
from launcher.host.systemd import Scope, Systemd


def hold_front(
    state_dir: Path, unit: str, scope: Scope, seconds: float, drain_timeout: float
) -> dict[str, Any]:
    """Hold the front (if any) for a recovery's restart, and let what is in flight finish
    (at most ``drain_timeout``): the held requests reach the restored config once it passed
    its gate (``recover`` releases them)."""
    front = Front(state_dir, unit, scope)
    try:
        if front.spec() is None or watcher_missing(front) is not None:
            return {}
        hold = front.holding()
        if hold is not None:
            front.recheck(hold, "the recovery")
        front.hold(seconds)
    except FrontError as e:
        return {"front_hold": f"the restart was not held: {e}"}
    return {
        "front_hold": f"held for the restart (released by its watcher after {seconds:.0f}s)",
        "front_drain": front_drain(front, drain_timeout),
    }


def front_drain(front: Front, timeout: float) -> str:
    """Before a restart behind a held front: what the front let in finishes (at most
    ``timeout``); what was waited for."""
    if timeout <= 0:
        return "no drain: restarted at once"
    return drain.wait_idle(None, timeout, front_in_flight=safe_count(front.in_flight)).describe()


def left_held(state_dir: Path, unit: str, scope: Scope) -> bool:
    """Whether the front is held with no transaction to recover: a hold recorded (its
    holder died after the transaction ended, or could not release), or a front paused with
    no record (``status`` says the next run that takes the lock releases it). Not a hold
    this process recorded: a bake's early hold, whose revert now takes it over (releasing
    it here would let requests through to the failing config until the revert holds)."""
    front = Front(state_dir, unit, scope)
    if (hold := front.holding()) is not None:
        return hold.pid != os.getpid()
    try:
        return front.spec() is not None and front.held()
    except FrontError:
        return False  # no front, or its HAProxy is down: nobody is held


def recover(
    state_dir: Path,
    unit: str,
    scope: Scope,
    txn: dict[str, Any],
    drain_timeout: float = 120.0,
    restored: bool = True,
) -> dict[str, Any]:
    """After a recovery (or a deployer killed while holding): the front pointed at the
    restored server config (the record's old spec) and released if it is held; a second
    instance that bridged the killed deploy stopped once its requests finished; and the
    public port answering (``front_up``), or ``front_down`` saying it does not."""
    out = _release_lane(state_dir)
    front = Front(state_dir, unit, scope)
    out.update(_recover_front(front, txn, drain_timeout, restored))
    up = front_up(front)
    if "down" in up:
        out["front_down"] = up["down"]
    elif "revived" in up:
        out["front_revived"] = f"it did not answer ({up['revived']}); started again"
    return out


def lane_front(state_dir: Path) -> Front | None:
    """The front that routes to the lane whose state folder is ``state_dir`` (None: the
    unit is no lane, or the main unit's front no longer names it)."""
    try:
        record = lane.Record.read(state_dir)
        if record is None:
            return None
        front = Front(Path(record.main_state_dir), record.main_unit, record.systemd_scope)
        spec = front.spec()
    except LauncherError:
        return None
    return front if spec is not None and spec.lane == record.name else None


def _release_lane(state_dir: Path) -> dict[str, Any]:
    """A lane's recovery: what its killed deployer held at the front goes on now (the hold
    would end at its deadline)."""
    front = lane_front(state_dir)
    if front is None:
        return {}
    try:
        ledger = lane.ledger(front)
        if ledger is None or not ledger.held:
            return {}
        lane.release(front)
    except LauncherError as e:
        return {"lane": f"could not release the lane's held requests: {e}"}
    return {"lane": "released the lane's requests a killed deployer left held"}


def _recover_front(
    front: Front, txn: dict[str, Any], drain_timeout: float, restored: bool
) -> dict[str, Any]:
    try:
        spec = front.spec()
        if spec is None:
            return {}
        old = txn.get("front") or {}
        if not restored and txn and serves_live(front):
            # the restored config failed its gate, and the second instance serves it: it
            # goes on serving (the disk naming it) until a rollback or a deploy switches back
            spec = replace(spec, serving="b")
            front.swap(front.render(spec, int(old.get("old_slots") or 1)), backup=False)
            front.save_spec(spec)
            return {"second_instance": "serves the previous config: the unit's restart failed"}
        hold = front.holding()
        held = hold is not None or front.held()
        if hold is not None:
            hold = front.recheck(hold, "the recovery")
        with contextlib.suppress(FrontError):
            front.apply(spec, int(old.get("old_slots") or _maxconn(front, spec)))
        out: dict[str, Any] = {}
        if held:
            front.release()
            out["front"] = "released the requests a killed deployer left held"
            if hold is not None and hold.restarts:
                out["front_restarted"] = list(hold.restarts)
        bridged = _stop_bridge(front, spec, drain_timeout) if txn else None
        if bridged:
            out["second_instance"] = bridged
        return out
    except FrontError as e:
        return {"front": f"could not check or release the front: {e}"}


def _stop_bridge(front: Front, spec: FrontSpec, drain_timeout: float) -> str | None:
    """After a recovery, the second instance a killed deploy started is stopped (the unit
    serves the restored config; nothing of the second instance is a generation), once what
    the front sent it has finished (at most ``drain_timeout``)."""
    sb = Standby.of(front.dir.parent, front.unit, front.scope, spec)
    if sb is None or spec.serving != "a":
        return None
    try:
        running = sb.systemd.state().running
    except LauncherError:
        return None
    if not running:
        return None
    waited = drain_side(front, "b", drain_timeout)
    return sb.stop() or f"{sb.name} stopped (the killed deploy's bridge; {waited})"


def front_up(front: Front) -> dict[str, Any]:
    """The last step of a transaction that touched the front (a deploy, a rollback, a
    recovery; under the unit's lock): the public port answers as the spec on disk says
    (``Front.refusing``), HAProxy started again and pointed (``Front.revive``) when it does
    not. ``{}``: it answered; ``revived``: why it did not before it was started again;
    ``down``: the line that says it still does not, and what to run."""
    try:
        spec = front.spec()
    except FrontError:
        return {}  # a spec that cannot be read: the deploy refused it, a recovery says so
    why = front.refusing(spec) if spec is not None else None
    if spec is None or why is None:
        return {}
    try:
        front.revive(spec)
        still = front.refusing(spec)
    except (LauncherError, OSError) as e:
        still = str(e)
    if still is None:
        return {"revived": why}
    return {"down": down_line(front, spec, f"{front.units_state()}: {still}")}


def down_line(front: Front, spec: FrontSpec, why: str) -> str:
    """The line that says the front is down: its public port, the command that starts it
    again, and ``why`` (made one line: the result's first line carries it)."""
    public = f"{spec.public_host}:{spec.public_port}"
    return (
        f"the front is down: its public port {public} does not answer; run "
        f"`{front.start_command()}`, then `llama-launcher status` ({' '.join(why.split())})"
    )


def watcher_missing(front: Front) -> str | None:
    """Why the front must not be held (its release watcher is not installed), or None."""
    try:
        active = Systemd(front.release_path, front.scope).show("ActiveState").get("ActiveState")
    except LauncherError as e:
        active = f"unknown ({e})"
    if active == "active":
        return None
    return (
        f"requests were not held: the front's release watcher {front.release_path} is "
        f"{active}, so nothing would release them if this deploy died; run `llama-launcher "
        "install --front haproxy` again to install it"
    )


def drain_side(front: Front, side: str, timeout: float) -> str:
    """Wait until the front has nothing in flight on ``side``'s server (at most
    ``timeout``); what was waited for."""
    count = safe_count(functools.partial(front.in_flight, SERVERS[side]))
    return drain.wait_idle(None, timeout, front_in_flight=count).describe()


def serves_live(front: Front) -> bool:
    """Whether the running HAProxy sends requests to the second instance (``llama_b`` up,
    the unit's server not)."""
    try:
        states = front.server_states()
    except FrontError:
        return False
    return states.get(SERVERS["b"]) == "UP" and states.get(SERVERS["a"]) != "UP"


def safe_count(count: Callable[[], int]) -> Callable[[], int]:
    """The front's in-flight count; 0 when its runtime API does not answer (the slots are
    still waited for)."""

    def read() -> int:
        try:
            return count()
        except FrontError:
            return 0

    return read


def _maxconn(front: Front, spec: FrontSpec) -> int:
    """The serving server's ``maxconn`` as HAProxy runs it now (the live config's slots)."""
    row = front.stats().get((BACKEND, SERVERS[spec.serving]), {})
    try:
        return max(int(row.get("slim") or 1), 1)
    except ValueError:
        return 1
