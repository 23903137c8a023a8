"""The handover around a restart: what the deploy transaction does so that a config change
costs no agent its request or its prompt cache.

Hooks in ``launcher.deploy.transaction`` and ``launcher.deploy.rollback`` call it, each
marked ``# handover``::

    front_change()    before anything live changes: the front's config for the new server
                      config, validated (``haproxy -c``); the transaction record names the
                      old one
    prepare()         hold the front (if any, and only with its release watcher installed),
                      drain, save the slots, start timing the old process's exit; with a
                      ``Bridge``, the second instance serves instead (``_bridge_in``)
    swap_front()      beside the env file's swap: the front's new config on disk
    after_gate()      the new config passed its gate: point the front at it, restore the
                      slots the new KV layout can take (each file checked first), release;
                      or switch back from the second instance (``_bridge_out``)
    rehold()          before a rollback's restart: the front held (again) for its budget, or
                      the second instance serving again (``_rebridge``)
    after_rollback()  the old config serves again: point the front at it, restore the
                      slots into the old config, release the front (``_unbridge``)

Here is the hold path: the front held, the server drained, its slots saved, then restored
into the new server and the front released. A restart with a ``Bridge`` is switched instead
(the ``_bridge_*`` steps are ``launcher.deploy.restart.bridge``'s, a base of ``Handover``:
the slots carried between two running servers, the front switched to the second instance
and back). A recovery's hold and release (``hold_front``, ``recover``) and every
transaction's last step (``front_up``: the public port answers, or the report's
``front_down`` says what to run) are ``launcher.deploy.restart.fronthold``'s.

Nothing here raises for the server's sake except HAProxy refusing the new server and a
restore that takes the server down (a ``GateFailure``, so the deploy rolls back); every other
problem is a line in the report. A HAProxy that does not come back to be pointed at the new
server is no reason to roll back: the disk names the new server, and a rollback would
restart the server and leave the front as down.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from launcher import config
from launcher.deploy import store
from launcher.deploy.restart import drain, fronthold, lane
from launcher.deploy.restart.bridge import Bridge, Bridging, Carry, Endpoint
from launcher.deploy.restart.front import Front, FrontDown, FrontError, FrontSpec, Hold
from launcher.deploy.restart.standby import Standby
from launcher.errors import ConfigInvalid, GateFailure, LauncherError
from launcher.host.systemd import Scope, UnitState
from launcher.server import slotsave

Say = Callable[[str, float, str], None]
#: Records a phase in the transaction record (``Deployer._phase``; tests inject faults there).
Phase = Callable[[str], None]


@dataclass(frozen=True)
class FrontChange:
    """The front's config before and after one deploy: its text, spec and slots."""

    front: Front
    old_text: str | None
    old_spec: FrontSpec
    old_slots: int
    text: str
    spec: FrontSpec
    slots: int

    @property
    def changed(self) -> bool:
        return self.text != self.old_text or self.spec != self.old_spec

    def record(self) -> dict[str, Any]:
        """What the transaction record keeps: the old text and spec (``Front.put_back``)."""
        return {
            "unit": self.front.unit,
            "old_text": self.old_text,
            "old_spec": self.old_spec.to_dict(),
            "old_slots": self.old_slots,
        }


@dataclass
class Handover(Bridging):
    """One restart's handover; ``report`` is the ``handover`` object of the result. The
    bridge's steps are ``Bridging``'s."""

    old: Endpoint | None = None
    old_meta: dict[str, Any] | None = None
    front: Front | None = None
    held_at: float | None = None
    saved: list[slotsave.Saved] = field(default_factory=list)
    save_dir: Path | None = None
    watch: drain.ExitWatch | None = None
    change: FrontChange | None = None
    #: how long a hold may last before the release watcher releases it (one deploy's budget)
    hold_seconds: float = 0.0
    hold: Hold | None = None
    phase: Phase | None = None
    drain_timeout: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: the second instance serving while the unit restarts (None: the front holds)
    bridge: Bridge | None = None
    #: the front's spec while the second instance serves (``switch``'s return)
    bridged: FrontSpec | None = None
    #: the unit's second instance when this restart holds instead: stopped before the
    #: restart (after the drain), so that its memory is free for the new config
    standby: Standby | None = None
    #: the carry into the server the front switches to, until that switch's top-up
    carry: Carry | None = None
    #: a long-prompt lane's front (``lane.Record``): the lane alone is held there, the
    #: main unit's clients pass
    lane_front: Front | None = None
    lane_held: bool = False

    # -- before the restart ----------------------------------------------------------------

    def before_restart(
        self, drain_timeout: float, running: UnitState, say: Say | None = None
    ) -> None:
        """Hold, drain, save; on a signal in between, the front is released first. With a
        bridge: the second instance serves instead, and nothing is held."""
        if self.bridge is not None and self._bridge_in(drain_timeout, running):
            if running.running and running.main_pid > 0:
                self.watch = drain.ExitWatch(running.main_pid)
            return
        try:
            self._hold_lane(self.hold_seconds)
            self._hold()
            self._drain(drain_timeout, running, say)
            self._save(drain_timeout)
            self._stop_standby()
        except BaseException:
            self.release()
            raise
        if running.running and running.main_pid > 0:
            self.watch = drain.ExitWatch(running.main_pid)

    def _stop_standby(self) -> None:
        """A held restart of a unit with a second instance: the second instance stopped
        (what the front sent it has finished in the drain), its memory free for the new
        config; a warm previous config is gone, so a later rollback holds."""
        sb = self.standby
        if sb is None:
            return
        try:
            if not sb.systemd.state().running:
                return
        except LauncherError:
            return
        problem = sb.stop()
        self.report["second_instance"] = problem or f"{sb.name} stopped before the restart"
        if problem:
            self.warnings.append(problem)

    def _hold(self) -> None:
        if self.front is None:
            return
        missing = fronthold.watcher_missing(self.front)
        if missing is not None:
            self.report["front"] = {"held": False, "note": missing}
            self.warnings.append(missing)
            return
        try:
            self.hold = self.front.hold(self.hold_seconds)
            self.held_at = time.monotonic()
            self.report["front"] = {"held": True, "release_after": round(self.hold_seconds, 1)}
        except FrontError as e:
            self.report["front"] = {"held": False, "note": str(e)}
            self.warnings.append(f"requests were not held during the restart: {e}")

    def _hold_lane(self, seconds: float) -> None:
        """A lane's restart: its new requests wait at the main unit's front (``lane.hold``,
        released by ``release`` or at the hold's deadline, one deploy's budget)."""
        if self.lane_front is None:
            return
        try:
            lane.hold(self.lane_front, seconds)
            self.lane_held = True
            self.report["lane"] = {"held": True, "release_after": round(seconds, 1)}
        except LauncherError as e:
            self.report["lane"] = {"held": False, "note": str(e)}
            self.warnings.append(f"the lane's requests were not held during the restart: {e}")

    def rehold(self, seconds: float) -> None:
        """Before a rollback's restart: the front held for the rollback's budget, again if
        a signal came after the release (every restart of a fronted unit holds), and what
        it let in finished first."""
        if self.lane_front is not None:
            self._hold_lane(seconds)
        if self.bridged is not None and self._rebridge(self._restored_spec()):
            return
        if self.bridged is not None and self.front is not None:
            self.report.setdefault("front", {})["held"] = True  # every restart holds
        elif self.front is None or not (self.report.get("front") or {}).get("held"):
            return
        try:
            self._recheck()
            self.hold = self.front.hold(seconds)
            if self.held_at is None:
                self.held_at = time.monotonic()
        except FrontError as e:
            self.warnings.append(f"the rollback's restart was not held: {e}")
            return
        self.report["front"]["rollback_drain"] = fronthold.front_drain(
            self.front, self.drain_timeout
        )

    def _restored_spec(self) -> FrontSpec | None:
        """The front's spec for the config a rollback restores: the transaction record's
        old one (the spec the switch to the second instance read, with no front change)."""
        return self.change.old_spec if self.change is not None else self.bridged

    def _recheck(self) -> None:
        """HAProxy restarted during the hold: paused again, what it let through recorded."""
        if self.front is not None and self.hold is not None and self.held_at is not None:
            with contextlib.suppress(FrontError):
                self.hold = self.front.recheck(self.hold, "the deploy", start=True)

    def _drain(self, timeout: float, running: UnitState, say: Say | None) -> None:
        if self.old is None or not running.running:
            self.report["drain"] = {"skipped": "the unit was not running"}
            return
        if timeout <= 0:
            self.report["drain"] = {"skipped": "--no-drain: restarted at once"}
            return
        front = self.front if self.front is not None and self.held_at is not None else None
        in_flight = fronthold.safe_count(front.in_flight) if front else None
        lane_front = self.lane_front
        if front is None and lane_front is not None and self.lane_held:
            in_flight = fronthold.safe_count(lambda: lane.in_flight(lane_front))

        def progress(elapsed: float, line: str) -> None:
            if say:
                say("draining", elapsed, line)

        with self.old.client() as client:
            got = drain.wait_idle(
                client,
                timeout,
                front_in_flight=in_flight,
                progress=progress,
                busy=drain.busy_of(self.old_meta),
            )
        self.report["drain"] = {**got.to_dict(), "message": got.describe()}
        if got.timed_out:
            self.warnings.append(got.describe())

    def _save(self, drain_timeout: float) -> None:
        cfg = (self.old_meta or {}).get("config") or {}
        self.save_dir = slotsave.save_path(cfg)
        report: dict[str, Any] = {"saved": [], "restored": [], "skipped": []}
        self.report["slots"] = report
        if self.save_dir is None:
            report["note"] = slotsave.no_carry(cfg)
            return
        drained = self.report.get("drain", {})
        if self.old is None or "skipped" in drained or drained.get("timed_out"):
            why = drained.get("skipped") or "the drain timed out"
            report["note"] = f"nothing saved ({why}; a save waits for its slot to finish)"
            return
        estimate = ((self.old_meta or {}).get("memory") or {}).get("estimate") or {}
        full = slotsave.no_room(self.save_dir, estimate.get("kv_bytes"))
        if full is not None:
            report["note"] = f"nothing saved: {full}"
            self.warnings.append(f"the slots' caches are not carried: {full}")
            return
        with self.old.client() as client:
            self.saved, skipped = slotsave.save_all(client, self.save_dir)
        report["saved"] = [s.to_dict() for s in self.saved]
        report["skipped"] = skipped

    # -- after the gate --------------------------------------------------------------------

    def swap_front(self) -> None:
        """The front's new config on disk, beside the env file's swap: a HAProxy that its
        socket unit starts again from now on points at the new server. While the second
        instance serves, the disk names it; the switch back writes the new config's."""
        if self.bridged is not None:
            return
        if self.change is not None and self.change.changed:
            self.change.front.swap(self.change.text)
            self.change.front.save_spec(self.change.spec)

    def after_gate(
        self, new_meta: dict[str, Any], new: Endpoint, planned_slots: int | None
    ) -> dict[str, Any]:
        """The new config serves: the front pointed at it, the slots, the release."""
        if self.bridge is not None:
            try:
                spec = self.change.spec if self.change is not None else self.bridged
                assert spec is not None
                self._bridge_out(new, new_meta, spec, crash_fails=True)
            except (FrontError, OSError) as e:
                raise GateFailure("front", "front", f"the switch back failed: {e}", []) from e
            self._mark("released")
            return self.finish()
        self._apply_front()  # raises GateFailure: the deploy rolls back
        self._restore(new, new_meta, "the new config", crash_fails=True)
        self._lane_slots(planned_slots)
        self.release()
        self._mark("released")
        return self.finish()

    def after_rollback(self, ok: bool) -> dict[str, Any]:
        """The old config is back (``ok``: it passed its gate): the front pointed at it,
        the slots into the old config, the release. Never raises. With a bridge: the
        second instance served meanwhile; it is switched back from (``ok``) and stopped, or
        left serving the old config while the unit cannot (a warning says so)."""
        if self.bridge is not None:
            return self._unbridge(ok, self._restored_spec())
        try:
            if self.change is not None:
                c = self.change
                with contextlib.suppress(FrontError, OSError):
                    self._point(c.old_spec, c.old_slots)
            if ok and self.old is not None and self.old_meta is not None:
                self._restore(self.old, self.old_meta, "the restored config")
                self._lane_slots((self.old_meta.get("planned") or {}).get("n_slots"))
            else:
                slotsave.discard(self.save_dir, self.saved)
        finally:
            self.release()
        return self.finish()

    def _apply_front(self) -> None:
        if self.change is None:
            return
        c = self.change
        try:
            self._point(c.spec, c.slots)
        except FrontDown as e:
            # the new config stands: the disk names its server, so the HAProxy that starts
            # next sends requests to it; the transaction's end starts it (``front_up``)
            self.report.setdefault("front", {})["not_pointed"] = str(e)
            self.warnings.append(f"HAProxy did not come back to be pointed at the new server: {e}")
            return
        except (FrontError, OSError) as e:
            raise GateFailure(
                "front", "front", f"HAProxy refused to send requests to the new server: {e}", []
            ) from e
        if c.changed:
            self.report.setdefault("front", {})["config"] = "changed (validated, swapped, applied)"

    def _point(self, spec: FrontSpec, n: int) -> None:
        """The running HAProxy pointed at ``spec``'s server. One that died meanwhile is
        waited for (systemd starts it again, or this process does: ``Front.started``),
        paused again while held, and pointed; ``FrontDown`` when it does not come back."""
        assert self.front is not None
        try:
            self._recheck()
            self.front.apply(spec, n)
        except FrontDown:
            if self.hold is not None and self.held_at is not None:
                self.hold = self.front.recheck(self.hold, "the deploy", start=True)
            else:
                self.front.started()
            self.front.apply(spec, n)

    def _mark(self, phase: str) -> None:
        if self.phase is not None:
            self.phase(phase)

    def _restore(
        self, new: Endpoint, new_meta: dict[str, Any], what: str, crash_fails: bool = False
    ) -> None:
        """Restore the saved slots the new config can take. ``crash_fails``: a restore that
        takes the server down fails the gate (a rollback then restores none of them)."""
        report = self.report.get("slots")
        if report is None or not self.saved:
            slotsave.discard(self.save_dir, self.saved)
            return
        why = slotsave.differences(
            slotsave.fingerprint(self.old_meta or {}), slotsave.fingerprint(new_meta)
        )
        new_dir = slotsave.save_path(new_meta.get("config") or {})
        if why or new_dir is None:
            reason = (
                "KV layout changed: " + "; ".join(why)
                if why
                else f"{what} has no --slot-save-path to restore from"
            )
            report["skipped"] += [
                {"slot": s.slot, "tokens": s.tokens, "reason": reason} for s in self.saved
            ]
        else:
            if new_dir != self.save_dir:
                self._move_to(new_dir, report)
            self._restore_checked(new, new_meta, report, crash_fails)
        slotsave.discard(self.save_dir, self.saved)
        self.saved = []

    def _move_to(self, folder: Path, report: dict[str, Any]) -> None:
        """The saved files into ``folder``, where the config to restore into reads them
        (its ``--slot-save-path`` changed); those that cannot move are discarded."""
        assert self.save_dir is not None
        moved, skipped = slotsave.move(self.saved, self.save_dir, folder)
        slotsave.discard(self.save_dir, [s for s in self.saved if s not in moved])
        report["skipped"] += skipped
        report["moved"] = {"from": str(self.save_dir), "to": str(folder), "files": len(moved)}
        self.save_dir, self.saved = folder, moved

    def _restore_checked(
        self, new: Endpoint, new_meta: dict[str, Any], report: dict[str, Any], crash_fails: bool
    ) -> None:
        assert self.save_dir is not None
        sound, damaged = slotsave.check_files(
            self.save_dir, self.saved, slotsave.bytes_per_token(new_meta)
        )
        report["skipped"] += damaged
        if sound:
            self._mark("restore")
        window = (new_meta.get("planned") or {}).get("n_ctx_slot")
        with new.client() as client:
            try:
                restored, skipped = slotsave.restore_all(client, sound, window)
            except slotsave.RestoreCrashed as e:
                slotsave.discard(self.save_dir, self.saved)
                self.saved = []
                report["skipped"].append({"slot": e.slot, "reason": str(e)})
                if crash_fails:
                    raise GateFailure("restore", "slot_restore_crashed", str(e), []) from e
                self.warnings.append(str(e))
                return
        report["restored"] += restored
        report["skipped"] += skipped

    def release(self) -> None:
        """Let the held requests through (idempotent); say what HAProxy restarts let
        through unheld, and whether the watcher released the front first."""
        self._release_lane()
        if self.front is None or self.held_at is None:
            return
        held = time.monotonic() - self.held_at
        front = self.report.setdefault("front", {})
        try:
            self._recheck()
            self.held_at = None
            hold = self.front.holding()
            if hold is None:
                front["released_by_watcher"] = True
                self.warnings.append(
                    f"the front's release watcher released the held requests after "
                    f"{self.hold_seconds:.0f}s (one deploy's budget), before this deploy "
                    "was done: requests after that were not held"
                )
            elif hold.restarts:
                self._report_restarts(front, hold)
            self.front.release()
            front["held_seconds"] = round(held, 3)
        except FrontError as e:
            self.held_at = None
            front["release_failed"] = str(e)
            self.warnings.append(
                f"the front did not release its held requests: {e}; its release watcher "
                f"does by {self.front.release_service} (or run `llama-launcher recover`)"
            )

    def _lane_slots(self, slots: int | None) -> None:
        """A lane whose slots changed: the front sends it that many requests at once (the
        running HAProxy now; its config on disk with the main unit's next deploy)."""
        if self.lane_front is None or not slots:
            return
        try:
            lane.resize(self.lane_front, int(slots))
            self._save_lane_slots(int(slots))
        except LauncherError as e:
            self.warnings.append(f"the front still sends the lane its old number of requests: {e}")

    def _save_lane_slots(self, slots: int) -> None:
        """The lane's slots in the main unit's front spec, under the main unit's lock (its
        deploys write the same spec), when it is free now; else the main unit's next
        install writes them, and the running HAProxy has them already."""
        from launcher.deploy import store
        from launcher.deploy.home import lock_path

        assert self.lane_front is not None
        spec = self.lane_front.spec()
        if spec is None or not spec.lane or spec.lane_slots == slots:
            return
        main = store.Store(
            self.lane_front.dir.parent, lock_path(self.lane_front.scope, self.lane_front.unit)
        )
        try:
            with main.lock(0):
                spec = self.lane_front.spec()
                if spec is not None and spec.lane:
                    self.lane_front.save_spec(replace(spec, lane_slots=slots))
        except LauncherError:
            self.report.setdefault("lane", {})["slots"] = (
                f"the front sends the lane {slots} at once; its spec says so after the "
                "main unit's deploy in progress"
            )

    def _release_lane(self) -> None:
        if self.lane_front is None or not self.lane_held:
            return
        self.lane_held = False
        try:
            lane.release(self.lane_front)
        except LauncherError as e:
            self.report.setdefault("lane", {})["release_failed"] = str(e)
            self.warnings.append(
                f"the front did not release the lane's held requests: {e}; they go on at the "
                "hold's deadline (one deploy's budget)"
            )

    def _report_restarts(self, front: dict[str, Any], hold: Hold) -> None:
        """What clients saw of HAProxy's restarts during the hold (the last restart's
        numbers read again now: its counters are final while it is paused)."""
        assert self.front is not None
        events = [dict(e) for e in hold.restarts]
        events[-1].update(self.front.unheld(hold.front or ""))
        front["restarted"] = events
        for e in events:
            self.warnings.append(
                f"HAProxy was restarted during the hold (pid {e.get('pid_before')} -> "
                f"{e.get('pid_after')}, noticed by {e.get('noticed_by')}): for about "
                f"{e.get('seconds_unheld', '?')}s it was not holding; it passed "
                f"{e.get('requests', '?')} requests on, {e.get('answered_5xx', '?')} of them "
                "answered 5xx; it is held again and points at the serving config"
            )

    def finish(self) -> dict[str, Any]:
        if self.watch is not None:
            stop = self.watch.result()
            self.report["stop"] = stop
            line = drain.linger_warning(stop, store.runs_vllm(self.old_meta))
            if line:
                self.warnings.append(line)
            self.watch = None
        if self.front is not None:
            self._front_up()
        if self.warnings:
            self.report["warnings"] = list(self.warnings)
        return self.report

    def _front_up(self) -> None:
        """The transaction's last step: the public port answers (``front_up``), or the
        report says it does not."""
        assert self.front is not None
        up = fronthold.front_up(self.front)
        if "down" in up:
            self.report["front_down"] = up["down"]
            self.warnings.append(up["down"])
        elif "revived" in up:
            self.report.setdefault("front", {})["revived"] = up["revived"]
            self.warnings.append(
                f"the front did not answer when this transaction ended ({up['revived']}); it "
                "was started again and answers"
            )


def front_change(
    state_dir: Path,
    unit: str,
    scope: Scope,
    cfg: dict[str, Any],
    planned_slots: int | None,
    old_meta: dict[str, Any] | None,
    pool: tuple[int, int] = (0, 0),
) -> FrontChange | None:
    """The front's config for the server config ``cfg`` (its host and port are the private
    address), validated with ``haproxy -c`` when it changes: before anything live changes,
    a text HAProxy refuses is refused (exit 2). ``pool``: the shared pool's cells and a
    slot's window that admission counts against ((0, 0): a split pool). None: the unit
    has no front."""
    front = Front(state_dir, unit, scope)
    old_spec = front.spec()
    if old_spec is None:
        return None
    spec = replace(
        old_spec,
        private_host=str(cfg.get("host") or old_spec.private_host),
        private_port=int(cfg.get("port") or old_spec.private_port),
        serving="a",  # a transaction ends with the unit serving (launcher.deploy.restart.standby)
        pool_cells=pool[0],
        slot_cells=pool[1],
    )
    n = int(planned_slots or 1)
    old_n = int(((old_meta or {}).get("planned") or {}).get("n_slots") or n)
    old_text = front.live_text()
    text = front.render(spec, n)
    if text != old_text:
        try:
            front.validate(text, spec)
        except FrontError as e:
            raise ConfigInvalid(f"{e}; nothing was changed") from e
    return FrontChange(front, old_text, old_spec, old_n, text, spec, n)


def prepare(
    old: Endpoint | None,
    old_meta: dict[str, Any] | None,
    running: UnitState,
    drain_timeout: float,
    change: FrontChange | None,
    hold_seconds: float,
    say: Say | None = None,
    phase: Phase | None = None,
    bridge: Bridge | None = None,
    standby: Standby | None = None,
    lane_front: Front | None = None,
) -> Handover:
    """The handover of one restart, begun: the front held (the release watcher releases it
    after ``hold_seconds`` if this process is gone or still holding), the server drained,
    the slots saved (see the module docstring); with a ``bridge``, the second instance
    serving instead."""
    front = change.front if change is not None else None
    h = Handover(old, old_meta, front, change=change, hold_seconds=hold_seconds, bridge=bridge)
    h.standby, h.lane_front = standby, lane_front
    h.phase, h.drain_timeout = phase, drain_timeout
    h.before_restart(drain_timeout, running, say)
    return h


def slot_folder(scope: str, store_root: Path, show: Callable[..., dict[str, str]]) -> Path | None:
    """Where the server saves its slots: a folder it can write. In user scope the service
    runs as the deployer's user: ``STATE_DIR/slots``. In system scope it runs as a user of its
    own under ``ProtectSystem=strict``, and the one folder it owns is its ``StateDirectory=``
    (``/var/lib/NAME``, read from the unit); a unit without one carries no slots (None)."""
    if scope != "system":
        return store_root / "slots"
    names = show("StateDirectory").get("StateDirectory", "").split()
    return Path("/var/lib") / names[0] if names else None


def with_slot_dir(cfg: config.AnyConfig, folder: Path | None, create: bool) -> config.AnyConfig:
    """With ``carry_slots`` on (the default), every config carries its slots:
    ``--slot-save-path`` is the ``slot_folder`` unless the config names one, so a whole
    desired config (``deploy --config``, Ansible) keeps it too. ``create``: make the folder
    (systemd makes a ``StateDirectory=`` itself, owned by the service's user)."""
    if isinstance(cfg, config.VllmConfig) or cfg.slot_save_path is not None or folder is None:
        return cfg  # vLLM has no slots to save
    if create and not folder.exists():
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return cfg.model_copy(update={"slot_save_path": folder})
