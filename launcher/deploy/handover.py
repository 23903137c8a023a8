"""The handover around a restart: what the deploy transaction does so that a config change
costs no agent its request or its prompt cache.

Four hooks in ``launcher.deploy.transaction`` call it, each marked ``# handover``::

    prepare()         before anything live changes: hold the front (if any), drain, save
                      the slots, start timing the old process's exit
    after_gate()      the new config passed its gate: apply the front's new config, restore
                      the slots the new KV layout can take, release the front
    after_rollback()  the old config serves again: put the front's config back, restore the
                      slots into the old config, release the front
    recover()         a deployer killed while holding: release the front

Nothing here raises for the server's sake except the front's new config (a ``GateFailure``,
so the deploy rolls back); every other problem is a line in the report.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from launcher import config
from launcher.deploy import drain
from launcher.deploy.front import Front, FrontError, FrontSpec
from launcher.errors import GateFailure
from launcher.host.systemd import UnitState
from launcher.server import slots

Say = Callable[[str, float, str], None]


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
class Handover:
    """One restart's handover; ``report`` is the ``handover`` object of the result."""

    old: Endpoint | None = None
    old_meta: dict[str, Any] | None = None
    front: Front | None = None
    front_spec: FrontSpec | None = None
    held_at: float | None = None
    saved: list[slots.Saved] = field(default_factory=list)
    save_dir: Path | None = None
    watch: drain.ExitWatch | None = None
    front_swapped: tuple[str | None, FrontSpec, int] | None = None
    report: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    # -- before the restart ----------------------------------------------------------------

    def before_restart(
        self, drain_timeout: float, running: UnitState, say: Say | None = None
    ) -> None:
        """Hold, drain, save; on a signal in between, the front is released first."""
        try:
            self._hold()
            self._drain(drain_timeout, running, say)
            self._save(drain_timeout)
        except BaseException:
            self.release()
            raise
        if running.running and running.main_pid > 0:
            self.watch = drain.ExitWatch(running.main_pid)

    def _hold(self) -> None:
        if self.front is None:
            return
        try:
            self.front.hold()
            self.held_at = time.monotonic()
            self.report["front"] = {"held": True}
        except FrontError as e:
            # a front that is down holds anyway: the socket unit keeps the port, and the
            # first connection starts HAProxy again
            self.report["front"] = {"held": False, "note": str(e)}

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
        self.save_dir = slots.save_path(cfg)
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
        full = slots.no_room(self.save_dir, estimate.get("kv_bytes"))
        if full is not None:
            report["note"] = f"nothing saved: {full}"
            self.warnings.append(f"the slots' caches are not carried: {full}")
            return
        with self.old.client() as client:
            self.saved, skipped = slots.save_all(client, self.save_dir)
        report["saved"] = [s.to_dict() for s in self.saved]
        report["skipped"] = skipped

    # -- after the gate --------------------------------------------------------------------

    def after_gate(
        self, new_meta: dict[str, Any], new: Endpoint, planned_slots: int | None
    ) -> dict[str, Any]:
        """The new config serves: its front config, the slots, the release."""
        self._apply_front(new_meta, planned_slots)  # raises GateFailure: the deploy rolls back
        self._restore(new, new_meta, "the new config")
        self.release()
        return self.finish()

    def after_rollback(self, ok: bool) -> dict[str, Any]:
        """The old config is back (``ok``: it passed its gate): the old front config, the
        slots into the old config, the release. Never raises."""
        try:
            if self.front_swapped is not None and self.front is not None:
                text, spec, n = self.front_swapped
                with contextlib.suppress(FrontError, OSError):
                    if text is not None:
                        self.front.swap(text)
                    self.front.save_spec(spec)
                    self.front.apply(spec, n)
                self.front_swapped = None
            if ok and self.old is not None and self.old_meta is not None:
                self._restore(self.old, self.old_meta, "the restored config")
            else:
                slots.discard(self.save_dir, self.saved)
        finally:
            self.release()
        return self.finish()

    def _apply_front(self, new_meta: dict[str, Any], planned_slots: int | None) -> None:
        if self.front is None or self.front_spec is None:
            return
        cfg = new_meta.get("config") or {}
        old_spec = self.front_spec
        spec = replace(
            old_spec,
            private_host=str(cfg.get("host") or old_spec.private_host),
            private_port=int(cfg.get("port") or old_spec.private_port),
        )
        n = int(planned_slots or 1)
        old_text = self.front.live_text()
        try:
            text = self.front.render(spec, n)
            if text == old_text:
                return
            self.front.validate(text, spec)
            old_n = int(((self.old_meta or {}).get("planned") or {}).get("n_slots") or n)
            self.front_swapped = (old_text, old_spec, old_n)
            self.front.swap(text)
            self.front.save_spec(spec)
            self.front.apply(spec, n)
        except (FrontError, OSError) as e:
            raise GateFailure("front", "front", f"the front's new config failed: {e}", []) from e
        self.report.setdefault("front", {})["config"] = "changed (validated, swapped, applied)"

    def _restore(self, new: Endpoint, new_meta: dict[str, Any], what: str) -> None:
        report = self.report.get("slots")
        if report is None or not self.saved:
            slots.discard(self.save_dir, self.saved)
            return
        why = slots.differences(slots.fingerprint(self.old_meta or {}), slots.fingerprint(new_meta))
        new_dir = slots.save_path(new_meta.get("config") or {})
        if new_dir != self.save_dir:
            why.append(f"{what} saves slots in {new_dir}, not {self.save_dir}")
        if why:
            reason = "KV layout changed: " + "; ".join(why)
            report["skipped"] += [
                {"slot": s.slot, "tokens": s.tokens, "reason": reason} for s in self.saved
            ]
        else:
            window = (new_meta.get("planned") or {}).get("n_ctx_slot")
            with new.client() as client:
                restored, skipped = slots.restore_all(client, self.saved, window)
            report["restored"] += restored
            report["skipped"] += skipped
        slots.discard(self.save_dir, self.saved)
        self.saved = []

    def release(self) -> None:
        """Let the held requests through (idempotent)."""
        if self.front is None or self.held_at is None:
            return
        held = time.monotonic() - self.held_at
        self.held_at = None
        front = self.report.setdefault("front", {})
        try:
            self.front.release()
            front["held_seconds"] = round(held, 3)
        except FrontError as e:
            front["release_failed"] = str(e)
            self.warnings.append(
                f"the front did not release its held requests: {e}; run `llama-launcher "
                f"recover` (or send 'enable frontend public' to {self.front.admin_socket})"
            )

    def finish(self) -> dict[str, Any]:
        if self.watch is not None:
            stop = self.watch.result()
            self.report["stop"] = stop
            line = drain.linger_warning(stop)
            if line:
                self.warnings.append(line)
            self.watch = None
        if self.warnings:
            self.report["warnings"] = list(self.warnings)
        return self.report


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


def prepare(
    state_dir: Path,
    unit: str,
    old: Endpoint | None,
    old_meta: dict[str, Any] | None,
    running: UnitState,
    drain_timeout: float,
    say: Say | None = None,
) -> Handover:
    """The handover of one restart, begun: the front held, the server drained, the slots
    saved (see the module docstring)."""
    front = Front(state_dir, unit)
    try:
        spec = front.spec()
    except FrontError as e:
        h = Handover(old, old_meta)
        h.warnings.append(f"{e}; the restart goes on without holding requests")
    else:
        h = Handover(old, old_meta, front if spec else None, spec)
    h.before_restart(drain_timeout, running, say)
    return h


def recover(state_dir: Path, unit: str) -> dict[str, Any]:
    """After a deployer was killed: release the front if it is holding."""
    front = Front(state_dir, unit)
    if front.spec() is None:
        return {}
    try:
        if front.held():
            front.release()
            return {"front": "released the requests a killed deployer left held"}
    except FrontError as e:
        return {"front": f"could not check or release the front: {e}"}
    return {}
