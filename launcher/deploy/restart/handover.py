"""The handover around a restart: what the deploy transaction does so that a config change
costs no agent its request or its prompt cache.

Hooks in ``launcher.deploy.transaction`` and ``launcher.deploy.rollback`` call it, each
marked ``# handover``::

    front_change()    before anything live changes: the front's config for the new server
                      config, validated (``haproxy -c``); the transaction record names the
                      old one
    prepare()         hold the front (if any, and only with its release watcher installed),
                      drain, save the slots, start timing the old process's exit
    swap_front()      beside the env file's swap: the front's new config on disk
    after_gate()      the new config passed its gate: point the front at it, restore the
                      slots the new KV layout can take (each file checked first), release
    rehold()          before a rollback's restart: the front held (again) for its budget
    after_rollback()  the old config serves again: point the front at it, restore the
                      slots into the old config, release the front
    hold_front()      a recovery's restart of the old config (``launcher.deploy.rollback``)
    recover()         after a recovery: the front pointed at the restored config, released

Whatever a deploy, a rollback or a recovery ends with, its last step (``front_up``, under the
unit's lock) makes the public port answer: HAProxy started again if it does not (its units'
start limit reset first: its restarts and the deploy's own starts may have used it up),
pointed at the serving server; or the report's ``front_down`` says it is down and what to
run, which the result's first line repeats.

Nothing here raises for the server's sake except HAProxy refusing the new server and a
restore that takes the server down (a ``GateFailure``, so the deploy rolls back); every other
problem is a line in the report. A HAProxy that does not come back to be pointed at the new
server is no reason to roll back: the disk names the new server, and a rollback would
restart the server and leave the front as down.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher import config
from launcher.deploy.restart import drain
from launcher.deploy.restart.front import (
    BACKEND,
    SERVERS,
    Front,
    FrontDown,
    FrontError,
    FrontSpec,
    Hold,
)
from launcher.deploy.restart.standby import Standby
from launcher.errors import ConfigInvalid, GateFailure, LauncherError, Unreadable
from launcher.host.systemd import Scope, Systemd, UnitState
from launcher.server import slots, slotsave

if TYPE_CHECKING:
    import httpx

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


@dataclass(frozen=True)
class Endpoint:
    """Where a llama-server answers, and its API key."""

    url: str
    api_key: str | None

    def client(self) -> Any:
        import httpx

        from launcher.server import httpclient

        return httpclient.client(httpx.Client, self.url, self.api_key, 10.0)


@dataclass
class Bridge:
    """A restart bridged by the second instance (``launcher.deploy.restart.standby``): it serves
    ``text`` (its generation's ``meta``) while the unit restarts, and keeps it warm for
    ``warm`` seconds after (0: stopped once the unit serves again)."""

    standby: Standby
    text: str
    argv: list[str]
    meta: dict[str, Any]
    api_key: str | None
    #: starts it and gates it on its port (``Standby.serve`` with the deploy's waits)
    serve: Callable[[], Any]
    warm: float
    generation: int | None
    #: the settings options naming the unit, for the timer that ends the warm period
    where: list[str]
    #: why the switch was chosen (the result's ``handover.switch.why``)
    why: str = ""
    #: it runs what a failed restart puts back (a deploy's bridge; a rollback's runs its
    #: target), so a rollback's restart can be bridged by it too
    restores: bool = True

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.standby.url, self.api_key)


@dataclass
class Carry:
    """A carry between two running servers, kept until the switch that follows it: what to
    top up then. A slot's last task (``/slots``' ``id_task``) changes with every request it
    takes, so ``saved_at`` (each source slot's when the carry read it, before its save) and
    ``restored_at`` (each destination slot's after the restore) tell which slots took a
    request since."""

    src: Endpoint
    src_meta: dict[str, Any]
    dst: Endpoint
    dst_meta: dict[str, Any]
    what: str
    crash_fails: bool
    saved_at: dict[int, int | None]
    restored_at: dict[int, int | None]
    #: the carry's report (``slots``); the top-up's goes under ``after_switch``
    report: dict[str, Any]


@dataclass
class Handover:
    """One restart's handover; ``report`` is the ``handover`` object of the result."""

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
            self._hold()
            self._drain(drain_timeout, running, say)
            self._save(drain_timeout)
            self._stop_standby()
        except BaseException:
            self.release()
            raise
        if running.running and running.main_pid > 0:
            self.watch = drain.ExitWatch(running.main_pid)

    def _bridge_in(self, drain_timeout: float, running: UnitState) -> bool:
        """The second instance serves the bridge's config, gated on its port, with the
        unit's slots carried into it (where the layout allows), and the front switched to
        it (what the unit's slots took after their save topped up then); False (and why,
        in the report) when it cannot: the restart is held instead. On a signal the front
        is put back on the unit (if it had switched) before it goes on."""
        b = self.bridge
        assert b is not None and self.front is not None
        sw: dict[str, Any] = {"instance": b.standby.name, "why": b.why}
        self.report["switch"] = sw
        spec = self.front.spec()
        assert spec is not None and spec.standby_port is not None
        try:
            if _serves_live(self.front) and b.standby.running_with(b.text):
                sw["started"] = "already serving"  # a killed deploy's bridge, a failed rollback
                self.bridged = replace(spec, serving="b")
                self.report["front"] = {"held": False, "serving": b.standby.name}
                return True
            t0 = time.monotonic()

            # if this deployer dies, the timer's stop-warm recovers its transaction (under
            # the lock) and stops the second instance; a warm one has the timer of the last
            # deploy until the switch, after which this one's is set (a rollback's switch
            # waits for no timer: one that cannot be set then is a warning); a bridge that
            # would have no timer is not begun (the restart holds)
            seconds = 2 * self.hold_seconds + b.warm
            warm = b.standby.running_with(b.text) and b.standby.healthy()
            if warm:
                sw["started"] = "warm: it kept this config since the last deploy"
            else:
                kept = self._keep_warm(seconds, b.generation, warn=False)
                if kept.get("note"):
                    raise FrontError(kept["note"])
                b.serve()
                sw["started"] = f"started and gated in {time.monotonic() - t0:.3f}s"
            self._mark("bridge")
            if running.running and self.old is not None:
                phase, self.phase = self.phase, None  # "restore" is a phase after the restart
                try:  # a restore that takes it down fails the bridge: the restart holds
                    self._carry(self.old, self.old_meta or {}, b.endpoint, b.meta, sw, "b", True)
                finally:
                    self.phase = phase
            if not b.standby.healthy():
                raise FrontError(f"{b.standby.name} stopped answering /health")
            old = self.old.client() if running.running and self.old is not None else None
            try:
                self.bridged, report = self._switch(
                    spec, _slots(b.meta), drain_timeout, old, sw, self._end_early_hold
                )
            finally:
                if old is not None:
                    old.close()
            sw["switched_after"] = round(time.monotonic() - t0, 3)
            sw["switched_at"] = time.time()
            if warm:  # the switch stands: a timer that cannot be set is a warning
                self._keep_warm(seconds, b.generation)
            self.report["drain"] = {**report.to_dict(), "message": report.describe()}
            self.report["front"] = {"held": False, "serving": b.standby.name}
            self._mark("bridged")
            return True
        except (LauncherError, OSError) as e:
            self.warnings.append(
                f"the second instance {b.standby.name} did not take over ({e}); this "
                "restart holds the front instead"
            )
            sw["failed"] = str(e)
            self._bridge_back(spec)
            return False
        except BaseException:
            self._bridge_back(spec)
            raise

    def _end_early_hold(self) -> None:
        """A hold of this process that no restart of this handover took (a bake's, taken at
        the journal's line of a hard failure before its revert: ``launcher.watch.revert``)
        ends when the switch serves: the requests it held go to the instance that took over,
        not after the old one's drain."""
        if self.front is None or self.hold is not None:
            return
        with contextlib.suppress(FrontError, OSError):
            held = self.front.holding()
            if held is not None and held.pid == os.getpid():
                self.front.release()
                self.report.setdefault("switch", {})["early_hold_ended_at"] = time.time()

    def _bridge_back(self, spec: FrontSpec) -> None:
        """A bridge that did not come to be: the front serves the unit as ``spec`` says
        (the switch put back if it happened), and the second instance is stopped."""
        b, front = self.bridge, self.front
        assert b is not None and front is not None
        self.bridge, self.bridged, self.carry = None, None, None
        with contextlib.suppress(LauncherError, OSError):
            if front.spec() != spec:
                front.swap(front.render(spec, _slots(self.old_meta or {})), backup=False)
                front.save_spec(spec)
            front.apply(spec, _slots(self.old_meta or {}))
        with contextlib.suppress(LauncherError, OSError):
            problem = b.standby.stop()
            if problem:  # it may run on with no timer to stop it
                self.warnings.append(problem)

    def _carry(
        self,
        src: Endpoint,
        src_meta: dict[str, Any],
        dst: Endpoint,
        dst_meta: dict[str, Any],
        report: dict[str, Any],
        what: str,
        crash_fails: bool = False,
    ) -> None:
        """The slots saved on ``src`` restored into ``dst`` (both running), as ``_restore``
        does after a restart; what happened, as ``report['slots']``. ``src`` serves on
        meanwhile: what its slots take between their save and the switch is topped up after
        it (``self.carry``, ``_top_up``)."""
        carried: dict[str, Any] = {"saved": [], "restored": [], "skipped": []}
        self.carry = None
        try:
            with self._carrying(carried, src_meta):
                self.save_dir = slotsave.save_path(src_meta.get("config") or {})
                if self.save_dir is None:
                    carried["note"] = "no --slot-save-path: no cache is carried"
                    return
                why = slotsave.differences(
                    slotsave.fingerprint(src_meta), slotsave.fingerprint(dst_meta)
                )
                if why:  # nothing could be restored: nothing is saved (a revert switches at once)
                    carried["note"] = "KV layout changed: " + "; ".join(why) + "; nothing saved"
                    return
                with src.client() as client:
                    saved_at = _tasks(client, carried)
                    self.saved, skipped = slotsave.save_all(client, self.save_dir)
                carried["saved"] = [s.to_dict() for s in self.saved]
                carried["skipped"] = skipped
                self._restore(dst, dst_meta, what, crash_fails)
                with dst.client() as client:
                    restored_at = _tasks(client, carried)
                if saved_at is not None and restored_at is not None:
                    self.carry = Carry(
                        src,
                        src_meta,
                        dst,
                        dst_meta,
                        what,
                        crash_fails,
                        saved_at,
                        restored_at,
                        carried,
                    )
        finally:
            report["slots"] = carried

    @contextlib.contextmanager
    def _carrying(self, report: dict[str, Any], src_meta: dict[str, Any]) -> Iterator[None]:
        """``_restore`` reports into ``self.report['slots']`` and checks the KV layout
        against ``self.old_meta``: for a carry's span, its own report and its source's meta."""
        kept = self.old_meta, self.report.get("slots")
        self.report["slots"], self.old_meta = report, src_meta
        try:
            yield
        finally:
            self.old_meta = kept[0]
            if kept[1] is not None:
                self.report["slots"] = kept[1]
            else:
                self.report.pop("slots", None)

    def _switch(
        self,
        spec: FrontSpec,
        n: int,
        drain_timeout: float,
        old: httpx.Client | None,
        at: dict[str, Any],
        serving: Callable[[], None] | None = None,
    ) -> tuple[FrontSpec, drain.DrainReport]:
        """``Front.switch`` (``old``: the serving server's client, for its drain) with the
        carry's top-up: once the front sends new requests to the other server (when, as
        ``at['ready_at']``), and again when the old one has drained."""

        def ready() -> None:
            at["ready_at"] = time.time()
            if serving is not None:
                serving()
            self._top_up(final=False)

        assert self.front is not None
        try:
            switched = self.front.switch(spec, n, drain_timeout, old, serving=ready)
            self._top_up(final=True)
            return switched
        finally:
            self.carry = None

    def _top_up(self, final: bool) -> None:
        """After the switch: each source slot that took a request between its save and the
        switch (a new conversation's first turn, or one more turn of a carried one) saved
        again and restored into the same slot of the destination, unless that slot has
        taken a request there since the carry (it keeps what it served). A slot still
        processing waits for the next call (``final``: none comes; it is skipped). What
        happened: the carry report's ``after_switch``."""
        c = self.carry
        if c is None:
            return
        out = c.report.setdefault("after_switch", {"saved": [], "restored": [], "skipped": []})
        folder = slotsave.save_path(c.src_meta.get("config") or {})
        phase, self.phase = self.phase, None  # the transaction's phases are the carry's
        try:
            ready = self._changed(c, out, final)
            if not ready or folder is None:
                return
            with c.src.client() as client:  # idle slots: each saved at once
                saved, skipped = slotsave.save_all(client, folder, list(ready))
            c.saved_at.update(ready)
            out["saved"] += [s.to_dict() for s in saved]
            out["skipped"] += skipped
            with self._carrying(out, c.src_meta):
                self.save_dir, self.saved = folder, saved
                self._restore(c.dst, c.dst_meta, c.what, c.crash_fails)
        except Unreadable as e:
            out["note"] = f"no top-up after the switch: {e}"
        finally:
            self.phase = phase

    def _changed(self, c: Carry, out: dict[str, Any], final: bool) -> dict[int, int | None]:
        """The source's idle slots whose last task changed since the carry saved them, and
        whose slot on the destination took no request since (slot -> that task); the others
        are skipped, in ``out``."""
        with c.src.client() as client:
            now = [s for s in slots.read(client) if s.task != c.saved_at.get(s.id)]
        if not now:
            return {}
        with c.dst.client() as client:
            there = {s.id: s for s in slots.read(client)}
        ready: dict[int, int | None] = {}
        for s in now:
            d = there.get(s.id)
            if s.busy:
                if final:
                    why = "still processing on the source after its drain"
                    out["skipped"].append({"slot": s.id, "tokens": s.tokens, "reason": why})
                continue
            if d is not None and not d.busy and d.task == c.restored_at.get(s.id):
                ready[s.id] = s.task
                continue
            c.saved_at[s.id] = s.task  # what the destination's slot served stays
            why = "it took a request after the switch before its top-up; it keeps what it served"
            out["skipped"].append({"slot": s.id, "tokens": s.tokens, "reason": why})
        return ready

    def _bridge_out(
        self, new: Endpoint, new_meta: dict[str, Any], spec: FrontSpec, crash_fails: bool
    ) -> None:
        """The unit serves again (gated): the slots the second instance took carried back
        (and topped up after the switch), the front switched to the unit (``spec``: the
        front's spec for it), and the second instance kept warm (the previous config, for
        an instant rollback) or stopped."""
        b, front = self.bridge, self.front
        assert b is not None and front is not None and self.bridged is not None
        sw = self.report["switch"]
        back: dict[str, Any] = {}
        self._carry(b.endpoint, b.meta, new, new_meta, back, "the new config", crash_fails)
        self.report["slots"] = back["slots"]
        at: dict[str, Any] = {}
        with b.endpoint.client() as c:
            _, report = self._switch(
                replace(spec, serving="b"),
                _slots(new_meta),
                self.drain_timeout,
                c,
                at,
                serving=lambda: self._mark("serving"),  # the new config takes requests
            )
        sw["back"] = {**report.to_dict(), "message": report.describe(), **at}
        if b.warm > 0:
            sw["warm"] = self._keep_warm(b.warm, b.generation)
        elif report.timed_out:  # its requests still run: the timer stops it after them
            sw["warm"] = self._keep_warm(max(self.drain_timeout, 1.0), None)
        else:
            problem = b.standby.stop()
            sw["stopped"] = problem is None
            if problem:
                self.warnings.append(problem)

    def _keep_warm(
        self, seconds: float, generation: int | None, warn: bool = True
    ) -> dict[str, Any]:
        """The second instance kept running ``seconds`` (``Standby.keep_warm``); with
        ``warn``, a timer that cannot be set (its ``note``) is a warning."""
        b = self.bridge
        assert b is not None
        kept = b.standby.keep_warm(seconds, generation, b.where)
        if warn and kept.get("note"):
            self.warnings.append(f"{b.standby.name}: {kept['note']}")
        return kept

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
        missing = watcher_missing(self.front)
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

    def rehold(self, seconds: float) -> None:
        """Before a rollback's restart: the front held for the rollback's budget, again if
        a signal came after the release (every restart of a fronted unit holds), and what
        it let in finished first."""
        if self.bridged is not None and self._rebridge():
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
        self.report["front"]["rollback_drain"] = front_drain(self.front, self.drain_timeout)

    def _rebridge(self) -> bool:
        """Before a rollback's restart of a bridged deploy: the second instance, when it
        runs the config the rollback restores (a deploy's bridge) and answers, serves
        while the unit restarts (the front switched to it again if the switch back had
        begun, and the disk naming it); False: the restart holds."""
        b, front = self.bridge, self.front
        assert b is not None and front is not None and self.bridged is not None
        if not b.restores or not b.standby.healthy():
            return False
        try:
            spec = self.change.old_spec if self.change is not None else self.bridged
            if not _serves_live(front):
                back = replace(spec, serving="a")
                with self.old.client() if self.old is not None else contextlib.nullcontext() as c:
                    front.switch(back, _slots(b.meta), self.drain_timeout, c)
            else:
                front.swap(front.render(replace(spec, serving="b"), _slots(b.meta)), backup=False)
                front.save_spec(replace(spec, serving="b"))
        except (LauncherError, OSError) as e:
            self.warnings.append(
                f"the rollback's restart could not switch to {b.standby.name}: {e}"
            )
            return False
        self.report.setdefault("switch", {})["rollback"] = f"{b.standby.name} served meanwhile"
        return True

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

        def progress(elapsed: float, line: str) -> None:
            if say:
                say("draining", elapsed, line)

        with self.old.client() as client:
            got = drain.wait_idle(
                client,
                timeout,
                front_in_flight=_safe_count(front.in_flight) if front else None,
                progress=progress,
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
            report["note"] = "the live config has no --slot-save-path: no cache is carried"
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
        self.release()
        self._mark("released")
        return self.finish()

    def after_rollback(self, ok: bool) -> dict[str, Any]:
        """The old config is back (``ok``: it passed its gate): the front pointed at it,
        the slots into the old config, the release. Never raises. With a bridge: the
        second instance served meanwhile; it is switched back from (``ok``) and stopped, or
        left serving the old config while the unit cannot (a warning says so)."""
        if self.bridge is not None:
            return self._unbridge(ok)
        try:
            if self.change is not None:
                c = self.change
                with contextlib.suppress(FrontError, OSError):
                    self._point(c.old_spec, c.old_slots)
            if ok and self.old is not None and self.old_meta is not None:
                self._restore(self.old, self.old_meta, "the restored config")
            else:
                slotsave.discard(self.save_dir, self.saved)
        finally:
            self.release()
        return self.finish()

    def _unbridge(self, ok: bool) -> dict[str, Any]:
        b, front = self.bridge, self.front
        assert b is not None and front is not None
        sw = self.report.setdefault("switch", {})
        if self.bridged is None:  # it never served: nothing to switch back from
            slotsave.discard(self.save_dir, self.saved)
            return self.finish()
        if not ok or self.old is None or self.old_meta is None:
            with contextlib.suppress(FrontError, OSError):
                front.save_spec(self.bridged)
                front.swap(front.render(self.bridged, _slots(b.meta)), backup=False)
            self.warnings.append(
                f"{b.standby.name} serves generation {b.generation}'s config while "
                f"{front.unit} cannot; `llama-launcher rollback` (or the next deploy) "
                "switches back"
            )
            sw["left_serving"] = b.standby.name
            self.release()
            return self.finish()
        try:
            self.bridge = replace(b, warm=0.0)
            spec = self.change.old_spec if self.change is not None else self.bridged
            assert spec is not None
            self._bridge_out(self.old, self.old_meta, spec, crash_fails=False)
        except (LauncherError, OSError) as e:
            self.warnings.append(f"the switch back to {front.unit} failed: {e}")
        finally:
            self.release()  # a rollback's restart the second instance could not bridge held
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
            line = drain.linger_warning(stop)
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
        up = front_up(self.front)
        if "down" in up:
            self.report["front_down"] = up["down"]
            self.warnings.append(up["down"])
        elif "revived" in up:
            self.report.setdefault("front", {})["revived"] = up["revived"]
            self.warnings.append(
                f"the front did not answer when this transaction ended ({up['revived']}); it "
                "was started again and answers"
            )


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


def _serves_live(front: Front) -> bool:
    """Whether the running HAProxy sends requests to the second instance (``llama_b`` up,
    the unit's server not)."""
    try:
        states = front.server_states()
    except FrontError:
        return False
    return states.get(SERVERS["b"]) == "UP" and states.get(SERVERS["a"]) != "UP"


def _tasks(client: httpx.Client, report: dict[str, Any]) -> dict[int, int | None] | None:
    """Each slot's last task (``Carry``); None, and why in ``report``, when ``/slots``
    cannot be read (nothing is topped up after the switch)."""
    try:
        return {s.id: s.task for s in slots.read(client)}
    except Unreadable as e:
        report["note"] = f"no top-up after the switch: {e}"
        return None


def _slots(meta: dict[str, Any]) -> int:
    return int((meta.get("planned") or {}).get("n_slots") or 1)


def _safe_count(count: Callable[[], int]) -> Callable[[], int]:
    """The front's in-flight count; 0 when its runtime API does not answer (the slots are
    still waited for)."""

    def read() -> int:
        try:
            return count()
        except FrontError:
            return 0

    return read


def slot_folder(scope: str, store_root: Path, show: Callable[..., dict[str, str]]) -> Path | None:
    """Where the server saves its slots: a folder it can write. In user scope the service
    runs as the deployer's user: ``STATE_DIR/slots``. In system scope it runs as a user of its
    own under ``ProtectSystem=strict``, and the one folder it owns is its ``StateDirectory=``
    (``/var/lib/NAME``, read from the unit); a unit without one carries no slots (None)."""
    if scope != "system":
        return store_root / "slots"
    names = show("StateDirectory").get("StateDirectory", "").split()
    return Path("/var/lib") / names[0] if names else None


def with_slot_dir(
    cfg: config.ServerConfig, folder: Path | None, create: bool
) -> config.ServerConfig:
    """With ``carry_slots`` on (the default), every config carries its slots:
    ``--slot-save-path`` is the ``slot_folder`` unless the config names one, so a whole
    desired config (``deploy --config``, Ansible) keeps it too. ``create``: make the folder
    (systemd makes a ``StateDirectory=`` itself, owned by the service's user)."""
    if cfg.slot_save_path is not None or folder is None:
        return cfg
    if create and not folder.exists():
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return cfg.model_copy(update={"slot_save_path": folder})


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


def front_change(
    state_dir: Path,
    unit: str,
    scope: Scope,
    cfg: dict[str, Any],
    planned_slots: int | None,
    old_meta: dict[str, Any] | None,
) -> FrontChange | None:
    """The front's config for the server config ``cfg`` (its host and port are the private
    address), validated with ``haproxy -c`` when it changes: before anything live changes,
    a text HAProxy refuses is refused (exit 2). None: the unit has no front."""
    front = Front(state_dir, unit, scope)
    old_spec = front.spec()
    if old_spec is None:
        return None
    spec = replace(
        old_spec,
        private_host=str(cfg.get("host") or old_spec.private_host),
        private_port=int(cfg.get("port") or old_spec.private_port),
        serving="a",  # a transaction ends with the unit serving (launcher.deploy.restart.standby)
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
) -> Handover:
    """The handover of one restart, begun: the front held (the release watcher releases it
    after ``hold_seconds`` if this process is gone or still holding), the server drained,
    the slots saved (see the module docstring); with a ``bridge``, the second instance
    serving instead."""
    front = change.front if change is not None else None
    h = Handover(old, old_meta, front, change=change, hold_seconds=hold_seconds, bridge=bridge)
    h.standby = standby
    h.phase, h.drain_timeout = phase, drain_timeout
    h.before_restart(drain_timeout, running, say)
    return h


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
    return drain.wait_idle(None, timeout, front_in_flight=_safe_count(front.in_flight)).describe()


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
    front = Front(state_dir, unit, scope)
    out = _recover_front(front, txn, drain_timeout, restored)
    up = front_up(front)
    if "down" in up:
        out["front_down"] = up["down"]
    elif "revived" in up:
        out["front_revived"] = f"it did not answer ({up['revived']}); started again"
    return out


def _recover_front(
    front: Front, txn: dict[str, Any], drain_timeout: float, restored: bool
) -> dict[str, Any]:
    try:
        spec = front.spec()
        if spec is None:
            return {}
        old = txn.get("front") or {}
        if not restored and txn and _serves_live(front):
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


def drain_side(front: Front, side: str, timeout: float) -> str:
    """Wait until the front has nothing in flight on ``side``'s server (at most
    ``timeout``); what was waited for."""
    count = _safe_count(functools.partial(front.in_flight, SERVERS[side]))
    return drain.wait_idle(None, timeout, front_in_flight=count).describe()


def bridging(state_dir: Path, unit: str, scope: Scope, text: str | None) -> bool:
    """Whether the front sends requests to the second instance and it runs ``text``: a
    recovery's restart of the unit into ``text`` then needs no hold."""
    front = Front(state_dir, unit, scope)
    try:
        spec = front.spec()
        sb = Standby.of(state_dir, unit, scope, spec)
        if sb is None or not sb.running_with(text):
            return False
        states = front.server_states()
    except (FrontError, LauncherError, OSError):
        return False
    return states.get(SERVERS["b"]) == "UP" and states.get(SERVERS["a"]) != "UP"


def _maxconn(front: Front, spec: FrontSpec) -> int:
    """The serving server's ``maxconn`` as HAProxy runs it now (the live config's slots)."""
    row = front.stats().get((BACKEND, SERVERS[spec.serving]), {})
    try:
        return max(int(row.get("slim") or 1), 1)
    except ValueError:
        return 1
