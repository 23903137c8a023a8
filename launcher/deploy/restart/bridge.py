"""The second instance's bridge: a restart served by the unit's second instance
(``launcher.deploy.restart.standby``) instead of held at the front.

``Bridging`` is the bridge's part of a restart's handover: ``handover.Handover`` is built on
it, and the handover's hooks call its steps when the restart has a ``Bridge``::

    _bridge_in()    before the restart (``prepare``): the second instance started and gated
                    (or found warm), the unit's slots carried into it, the front switched
                    to it; False when it cannot: the restart holds instead
    _bridge_out()   the new config passed its gate (``after_gate``): the slots carried back
                    into the unit, the front switched back, the second instance kept warm
                    (the previous config, for an instant rollback) or stopped
    _rebridge()     before a rollback's restart (``rehold``): the second instance, when it
                    runs the config restored, serves again while the unit restarts
    _unbridge()     the rollback is done (``after_rollback``): the front switched back to
                    the unit, or the second instance left serving while the unit cannot

A carry (``Carry``) moves the slots between two running servers: saved on the one that
serves, restored into the other (the handover's restore, each file checked first), and
topped up after the switch with what the source's slots took in between (``_top_up``).
"""

from __future__ import annotations

import abc
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.deploy.restart import drain
from launcher.deploy.restart.front import SERVERS, Front, FrontError, FrontSpec, Hold
from launcher.deploy.restart.fronthold import serves_live
from launcher.deploy.restart.standby import Standby
from launcher.errors import LauncherError, Unreadable
from launcher.host.systemd import Scope, UnitState
from launcher.server import slots, slotsave

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True)
class Endpoint:
    """Where a llama-server answers (the unit's, the second instance's: the ends of a carry),
    and its API key."""

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


class Bridging(abc.ABC):
    """The bridge's steps of a restart's handover. The state they share is the
    ``Handover``'s (its fields, declared here), and so are the steps of its hold path they
    call (``_restore``: the slots restored; ``release``, ``finish``)."""

    old: Endpoint | None
    old_meta: dict[str, Any] | None
    front: Front | None
    saved: list[slotsave.Saved]
    save_dir: Path | None
    hold_seconds: float
    hold: Hold | None
    phase: Callable[[str], None] | None
    drain_timeout: float
    report: dict[str, Any]
    warnings: list[str]
    bridge: Bridge | None
    bridged: FrontSpec | None
    carry: Carry | None

    @abc.abstractmethod
    def _restore(
        self, new: Endpoint, new_meta: dict[str, Any], what: str, crash_fails: bool = False
    ) -> None:
        """The saved slots the server ``new`` can take, restored into it."""

    @abc.abstractmethod
    def _mark(self, phase: str) -> None:
        """``phase`` recorded in the transaction record."""

    @abc.abstractmethod
    def release(self) -> None:
        """The held requests let through."""

    @abc.abstractmethod
    def finish(self) -> dict[str, Any]:
        """The handover's report, done."""

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
            if serves_live(self.front) and b.standby.running_with(b.text):
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
                    carried["note"] = slotsave.no_carry(src_meta.get("config") or {})
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
        # both sides run the unit's server (install alone changes it): either's meta says which
        busy = drain.busy_of(self.old_meta or (self.bridge.meta if self.bridge else None))
        try:
            switched = self.front.switch(spec, n, drain_timeout, old, serving=ready, busy=busy)
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

    def _rebridge(self, spec: FrontSpec | None) -> bool:
        """Before a rollback's restart of a bridged deploy: the second instance, when it
        runs the config the rollback restores (a deploy's bridge; ``spec``: the front's for
        it) and answers, serves while the unit restarts (the front switched to it again if
        the switch back had begun, and the disk naming it); False: the restart holds."""
        b, front = self.bridge, self.front
        assert b is not None and front is not None and self.bridged is not None
        assert spec is not None
        if not b.restores or not b.standby.healthy():
            return False
        try:
            if not serves_live(front):
                back = replace(spec, serving="a")
                with self.old.client() if self.old is not None else contextlib.nullcontext() as c:
                    front.switch(
                        back, _slots(b.meta), self.drain_timeout, c, busy=drain.busy_of(b.meta)
                    )
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

    def _unbridge(self, ok: bool, spec: FrontSpec | None) -> dict[str, Any]:
        """``after_rollback`` of a bridged restart (``spec``: the front's for the restored
        config)."""
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
            assert spec is not None
            self._bridge_out(self.old, self.old_meta, spec, crash_fails=False)
        except (LauncherError, OSError) as e:
            self.warnings.append(f"the switch back to {front.unit} failed: {e}")
        finally:
            self.release()  # a rollback's restart the second instance could not bridge held
        return self.finish()


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
