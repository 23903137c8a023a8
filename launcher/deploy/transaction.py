"""The deploy transaction, top to bottom.

A config change ends either with the new config serving real completions, or with the old
one serving again::

    lock -> recover an interrupted transaction (launcher.deploy.rollback) -> render + validate
    -> unchanged? stop here -> register the rollback (the transaction record names the old
    text; launcher.deploy.rollback) -> store the new generation -> atomic swap of the env file
    -> systemctl restart -> gate (launcher.deploy.gate) -> commit: mark the generation deployed
    -> any failure, SIGINT, SIGTERM or SIGHUP: restore the previous generation and gate it
       -> rolled_back, or rollback_failed (a swap that did not happen restarts nothing).

A rollback skips render and the memory and pool checks: it takes a stored generation's own
bytes, checked by the strict parse, ``bash -n`` and what can change after a config served
(``validate.check_served``; launcher.deploy.rollback).

If the deployer dies (kill -9), the next invocation finds ``txn.json`` and reverts it first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from launcher import config, waits
from launcher.config import beside, memory, validate
from launcher.deploy import budgets, defaults, home, keys, rollback, store, window
from launcher.deploy.gate import Gate, Progress, together
from launcher.deploy.outcome import Result
from launcher.deploy.restart import admission, fronthold, handover, standby
from launcher.deploy.restart.bridge import Bridge, Endpoint, bridging
from launcher.deploy.restart.front import Front
from launcher.deploy.rollback import Reverter, Signals, on_error
from launcher.errors import ConfigInvalid, Interrupted, LauncherError, StoreError, Superseded
from launcher.host.systemd import Systemd, UnitState

#: Called with each phase as it is recorded (tests pass one in to inject a fault there).
OnPhase = Callable[[str], None]


class Deployer:
    """Runs deploy, rollback and recovery for one unit. Collaborators are passed in."""

    def __init__(
        self,
        settings: config.ToolSettings,
        systemd: Systemd | None = None,
        progress: Progress | None = None,
        force_memory: bool = False,
        on_phase: OnPhase | None = None,
        policy: waits.Waits | None = None,
    ) -> None:
        self.settings = settings
        self.systemd = systemd or Systemd(settings.unit_name, settings.scope)
        self.store = store.Store(
            home.state_dir(settings), home.lock_path(settings.scope, settings.unit_name)
        )
        self.env_file = settings.resolved_env_file()
        policy = policy or waits.Waits.from_settings(settings)
        self.gate = Gate(self.systemd, policy, self._probe_url(), progress)
        self.signals = Signals()
        self.reverter = Reverter(
            self.store, self.env_file, self.systemd, self.gate, self.signals, settings.drain_timeout
        )
        #: deploy even when the memory guard says the config does not fit (--force-memory)
        self.force_memory = force_memory
        self.on_phase = on_phase
        self.handover = handover.Handover()  # replaced by handover.prepare() per restart
        #: the box's devices for the memory guard (None: the binary's --list-devices)
        self.devices: validate.Devices | None = None
        #: the generation a ``rollback`` puts back: its gate gets that one's budget
        self.restoring: store.Generation | None = None
        #: refuse a unit systemd does not know (``require_unit``); the state read for it
        self.unit_required = False
        self.early: UnitState | None = None
        #: files ``install`` is about to write (the unit, an instance's drop-in; None: to be
        #: removed): the validation reads the unit from them (``defaults.target``)
        self.pending: dict[Path, str | None] = {}
        #: the front admits against the shared pool (None: as the front's spec says; install
        #: sets it before the front it installs exists)
        self.admits: bool | None = None
        #: why a unit with a second instance holds this restart instead of switching
        self.held_because: str | None = None
        #: that second instance, stopped before the held restart (``Handover.standby``)
        self.idle_standby: standby.Standby | None = None
        #: the caller holds the unit's deploy lock already (a bake's revert under its early
        #: hold, ``launcher.watch.revert.EarlyHold``): the verbs do not take it again
        self.lock_held = False
        #: what ``deploy`` and ``change`` do after their transaction, under the same lock
        #: (the bake's hand-off: ``launcher.watch.handoff``)
        self.then: Callable[[Result], Result] | None = None

    def _probe_url(self) -> str | None:
        """The setting ``base_url``, except behind a front: the gate probes the process it
        started at its own (private) address, never the front's ports, where whichever
        server the front sends to (a second instance bridging the restart) answers."""
        with contextlib.suppress(LauncherError):
            if Front(self.store.root, self.settings.unit_name, self.settings.scope).spec():
                return None
        return self.settings.base_url

    def require_unit(self) -> None:
        """A deploy restarts the unit: the next verb refuses, before anything changes, when
        it is not there (checked under the lock, on the state the deploy then uses)."""
        self.unit_required = True

    def _unit_state(self) -> UnitState:
        """The state read under the lock, once, unless a recovery changed it; else now."""
        state, self.early = self.early, None
        return state or self.systemd.state()

    def _check_unit(self) -> None:
        self.early = self.systemd.state()
        if self.early.load_state == "not-found":
            scope = self.settings.scope
            raise ConfigInvalid(
                f"{self.settings.unit_name} is not installed in {scope} scope (systemctl"
                f"{' --user' if scope == 'user' else ''} knows no such unit); run "
                "llama-launcher install first (it writes the unit and deploys the config "
                "through the gate), or name the unit you installed with --unit"
            )

    def deploy(self, cfg: config.AnyConfig, check: bool = False, origin: str = "deploy") -> Result:
        """Deploy a whole desired config (``check``: validate and diff only)."""
        with self._locked(check) as recovered:
            return self._then(self._deploy(cfg, check, origin, recovered), check)

    def change(
        self, edit: Callable[[dict[str, Any]], config.AnyConfig], origin: str, check: bool
    ) -> Result:
        """Deploy ``edit`` of the live config (``set``, ``unset``), read under the lock."""
        with self._locked(check) as recovered:
            cfg = edit(self.store.live_config(self.settings.unit_name))
            return self._then(self._deploy(cfg, check, origin, recovered), check)

    def _then(self, result: Result, check: bool) -> Result:
        """``then`` of a deploy that went through (or found nothing to change), still under
        the lock, a signal deferred until it is done: the generation is committed, and what
        follows (the bake's hand-off, a revert in its first moments) finishes; the result
        says a signal came."""
        if self.then is None or check:
            return result
        with self.signals.deferred():
            result = self.then(result)
        if self.signals.pending is not None:
            result.message += " (a signal arrived after the gate passed; the deploy stands)"
        return result

    def rollback(self, to: int | None = None, only_if_live: int | None = None) -> Result:
        """Go back to generation ``to`` or the last known-good one: its stored bytes, checked
        cheaply (``launcher.deploy.rollback``), through the same gate. ``only_if_live``: only
        while that generation is the live one (a bake's revert), else ``Superseded``."""
        with self._locked() as recovered:
            t0 = time.monotonic()
            live = self.store.live()
            if only_if_live is not None and (live is None or live.number != only_if_live):
                now = live.number if live is not None else None
                raise Superseded(
                    f"generation {only_if_live} is no longer live (generation {now} is): "
                    "nothing was reverted"
                )
            state = self._unit_state()
            running = lambda: state.running  # noqa: E731
            target = self.store.rollback_target(to, self.reverter.live_text(), running)
            self.restoring = target  # the gate gets the budget this generation needed
            self.gate.say("validate")
            unit = self._target()
            checked = rollback.candidate(target, unit.view, unit.slot_folder)
            defaults.make_slot_folder(self.settings, unit, checked.config)
            origin = f"rollback to {target.number}"
            result = self._proceed(checked, state, False, origin, True, recovered, t0)
            if live is not None and target.number != live.number:
                self.store.back_out(live)
            return result

    def preview(self, cfg: config.AnyConfig) -> defaults.Deployed:
        """``cfg`` as a deploy would write it (``render``): the deploy's defaults added,
        nothing made."""
        return defaults.deployed_config(self.settings, self.store, cfg, self._target(), False)

    def front_of(self, cfg: config.AnyConfig) -> dict[str, str] | None:
        """Where clients reach ``cfg`` and how the front routes (``render``, the plan)."""
        return defaults.front_address(self._target(), cfg)

    def _target(self) -> defaults.Target:
        return defaults.target(self.settings, self.store.root, self.systemd, self.pending)

    def recover_only(self, when: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """The ``recover`` verb: revert what a killed deployer left; ``RollbackFailed`` when
        the restored config does not pass its gate. ``when``: asked under the lock whether
        there is still something to do (the front's release watcher: a hold recorded)."""
        with self._locked(when=when) as recovered:
            pass
        return self.reverter.restored_or_raise(recovered)

    @contextlib.contextmanager
    def _locked(
        self, check: bool = False, when: Callable[[], bool] | None = None
    ) -> Iterator[dict[str, Any] | None]:
        """Hold the lock and revert what a killed deployer left first; a check changes
        nothing, so it neither takes the lock nor recovers (it says what a real run would)."""
        if check:
            yield None
            return
        wait = budgets.lock_wait(self.settings, self.gate.waits, budgets.last_load(self.store))
        lock = contextlib.nullcontext() if self.lock_held else self.store.lock(wait)
        with lock, self.signals.installed():
            if when is not None and not when():
                yield None
                return
            if self.unit_required:
                self._check_unit()  # before the state dir or its record is made
            self.store.ensure()
            home.claim(self.settings, self.store.root)
            recovered = self.reverter.recover()
            if recovered:
                self.early = None  # a recovery restarts the unit
            yield recovered

    def _phase(self, phase: str) -> None:
        """Record the phase in the transaction record (and tell ``on_phase``)."""
        self.store.mark(phase=phase)
        self._tell(phase)

    def _tell(self, phase: str) -> None:
        """Tell ``on_phase`` (a phase not recorded: ``rollback``, the undo beginning)."""
        if self.on_phase is not None:
            self.on_phase(phase)

    # -- validate -> unchanged? ------------------------------------------------------------

    def _admits(self) -> bool:
        """Whether the unit's front admits requests against the shared pool, which lets a
        pool that promises more than it holds through the over-commit guard."""
        if self.admits is not None:
            return self.admits
        try:
            spec = Front(self.store.root, self.systemd.unit, self.settings.scope).spec()
        except LauncherError:
            return False
        return spec is not None and spec.admission

    def _deploy(
        self,
        cfg: config.AnyConfig,
        check: bool,
        origin: str,
        recovered: dict[str, Any] | None = None,
    ) -> Result:
        t0 = time.monotonic()
        self.gate.say("validate")
        unit = self._target()
        deployed = defaults.deployed_config(self.settings, self.store, cfg, unit, write=not check)
        checked, running = validate.beside_state(
            deployed.config,
            self._unit_state,
            check,
            self.force_memory,
            unit.view,
            box=self.devices,
            unified=self.settings.unified_memory,
            live_meta=self.store.live_meta,
            made=unit.slot_folder,
            unit=self.systemd.unit,
            admitted=self._admits(),
        )
        front = defaults.front_address(unit, checked.config)
        return self._proceed(
            checked, running, check, origin, False, recovered, t0, deployed.notes, front
        )

    def _proceed(
        self,
        checked: validate.Validated,
        running: UnitState | None,
        check: bool,
        origin: str,
        force_restart: bool,
        recovered: dict[str, Any] | None,
        t0: float,
        said: Sequence[str] = (),
        front: dict[str, str] | None = None,
    ) -> Result:
        """``said``: the notes of the deploy's defaults, said when the deploy changes
        something; ``front``: the plan's ``front`` (where clients reach the server)."""
        live_text = self.reverter.live_text()
        notes = self.reverter.notes(check, running, live_text == checked.env_text)
        planned = window.plan_dict(checked.plan)
        if checked.admitted:
            planned["admitted"] = True
        if front is not None:
            planned["front"] = front
        result = Result(
            "checked" if check else "deployed",
            True,
            None,
            self.store.live_number(),
            planned=planned,
            diff=config.argv_diff(self.reverter.argv_of(live_text), checked.argv),
            timings={"validate": round(time.monotonic() - t0, 3)},
            warnings=[*checked.memory.notes, *checked.warnings, *notes],
            recovered=recovered,
            argv=checked.argv,
            env=checked.env_text,
        )
        down = running is not None and not running.running
        # the guard's notes (a fit deferred to the server) are no reason to restart
        if live_text == checked.env_text and not force_restart and not down and not notes:
            live = self.store.live()
            window_data = self._window(checked, result.previous_generation) if live else None
            return result.unchanged(live.meta.get("startup") if live else None, window_data)
        result.warnings += said  # a deploy that writes nothing new has nothing to say of it
        if running is not None and running.running:
            result.memory["beside"] = self._beside(checked, running)
        if check:
            result.message = "valid; nothing was changed (check mode)"
            return result
        assert running is not None
        prev = result.previous_generation
        result.previous_generation = rollback.adopt_unmanaged(
            self.store, live_text, prev, str(self.env_file)
        )
        old_text = live_text
        if old_text is None:
            old_text = self.reverter.deleted_live(result.warnings)
        return self._transaction(checked, old_text, origin, result, t0, running)

    def _beside(self, checked: validate.Validated, running: UnitState) -> dict[str, Any]:
        """Whether the new config would fit as a second instance beside the running one."""
        live = self.store.live_meta() or {}
        now = beside.running_of(running.main_pid, live.get("config"))
        try:
            free = memory.mem_available()
        except ConfigInvalid as e:  # no MemAvailable: the guard was forced off, or refused
            return beside.Beside(None, str(e)).to_dict()
        return beside.fit(checked.memory, checked.config, now, free).to_dict()

    # -- register the rollback -> store + swap -> restart -> gate -> commit ----------------

    def _transaction(
        self,
        checked: validate.Validated,
        live_text: str | None,
        origin: str,
        result: Result,
        t0: float,
        before: UnitState,
    ) -> Result:
        prev = result.previous_generation
        old_meta = self.store.get(prev).meta if prev else None
        # handover: the front's config for the new one, validated before anything changes
        change = handover.front_change(
            self.store.root,
            self.systemd.unit,
            self.settings.scope,
            {"host": checked.config.host, "port": checked.config.port},
            checked.plan.n_slots,
            old_meta,
            admission.pool_of(checked.plan),
        )
        bridge = self._bridge_for(change, live_text, old_meta, prev, before, result)
        gen = self._store(checked, live_text, prev, origin, result.planned, before, change, bridge)
        result.generation = gen.number
        result.memory["before"] = memory.process_memory(before) if before.running else None
        result.memory["estimate"] = checked.memory.to_dict()

        def undo(e: BaseException) -> NoReturn:
            self._tell("rollback")  # not recorded: the record's phase says where it failed
            self.reverter.undo(
                e,
                gen,
                live_text,
                prev,
                result,
                t0,
                self.handover.after_rollback,
                self.handover.rehold,
            )

        with on_error(self.signals, undo):
            self._phase("swap")
            store.swap_env(self.env_file, checked.env_text)
            self.handover.swap_front()  # handover: the front's config beside the env file
            self._phase("swapped")
            self.systemd.cancel_auto_restart(before)  # a crashed unit: ours is the restart
            cursor, _ = together(self.systemd.cursor, self.systemd.reset_failed)
            self._phase("restart")
            t_restart = time.monotonic()
            self.systemd.restart()
            self._phase("gate")
            key = keys.read_api_key(checked.config.api_key_file)
            budget = budgets.for_gate(self.gate.waits, self.store, self.restoring)
            gate = self.gate(
                checked.plan, cursor, before, key, checked.argv, budget, self.handover.watch
            )
            self._phase("gated")
            result.timings.update(gate.timings)
            result.timings["restart_to_serving"] = round(time.monotonic() - t_restart, 3)
            # the front's new config, the slots restored, the held requests released
            new = Endpoint(self.gate.url_for(checked.argv), key)
            result.handover = self.handover.after_gate(gen.meta, new, checked.plan.n_slots)
            result.warnings += self.handover.warnings
        with self.signals.deferred():  # the gate passed: the bookkeeping is finished first
            result.startup, result.probe = gate.startup, gate.probe
            result.warnings = [*result.warnings, *gate.warnings]
            result.memory["after"] = memory.process_memory(gate.state)
            if not isinstance(checked.config, config.VllmConfig):
                result.memory["devices"] = memory.measured(gate.log, checked.memory.devices)
            result.client_window = window.publish(self.settings, self._window(checked, gen.number))
            result.timings["total"] = round(time.monotonic() - t0, 3)
            self.store.commit(gen, memory=result.memory, timings=result.timings, **gate.record())
        result.message = f"generation {gen.number} is serving: {checked.describe()}"
        if self.signals.pending is not None:
            result.message += " (a signal arrived after the gate passed; the deploy stands)"
        return result.say_front_down()

    def _store(
        self,
        checked: validate.Validated,
        live_text: str | None,
        prev: int | None,
        origin: str,
        planned: dict[str, Any] | None,
        before: UnitState,
        change: handover.FrontChange | None,
        bridge: Bridge | None = None,
    ) -> store.Generation:
        """The transaction record (it names the old env file and front config) and the new
        generation, then the handover (hold the front, drain, save the slots): nothing live
        has changed yet."""
        meta = {**checked.meta(), "origin": origin, "planned": planned, "previous": prev}
        record: dict[str, Any] = {
            "phase": "begin",
            "from": prev,
            "to": None,
            "env_file": str(self.env_file),
        }
        if change is not None:
            record["front"] = change.record()
        last = budgets.last_load(self.store)
        hold_for = budgets.deploy_total(self.settings.drain_timeout, self.gate.waits, last)
        record["budget"] = round(hold_for, 1)
        try:
            gen = self.store.stage(checked.env_text, meta, {**record, "old_text": live_text})
            self._phase("stored")
            old = None
            if live_text is not None:
                url = self.gate.url_for(self.reverter.argv_of(live_text))
                old = Endpoint(url, keys.key_of_env(live_text, str(self.env_file)))
            old_meta = self.store.get(prev).meta if prev else None
            self.handover = handover.prepare(
                old,
                old_meta,
                before,
                self.settings.drain_timeout,
                change,
                hold_for,
                self.gate.say,
                self._phase,
                bridge,
                self.idle_standby,
                fronthold.lane_front(self.store.root),
            )
            if bridge is not None or self.held_because is not None:
                switched = self.handover.bridge is not None
                self.handover.report["mode"] = "switch" if switched else "hold"
                if self.held_because is not None:
                    self.handover.report["hold_because"] = self.held_because
            return gen
        except Interrupted:
            self.reverter.discard()
            raise
        except (OSError, StoreError) as e:
            self.reverter.discard()
            raise store.nothing_live_changed(e, self.store.root) from e

    def _bridge_for(
        self,
        change: handover.FrontChange | None,
        live_text: str | None,
        old_meta: dict[str, Any] | None,
        prev: int | None,
        before: UnitState,
        result: Result,
    ) -> Bridge | None:
        """Whether this restart is bridged by the unit's second instance (``switch``), and
        with what; None: the front holds (or there is no front), and the result's notes say
        why when a second instance is installed."""
        self.held_because, self.idle_standby = None, None  # this transaction's own
        spec = change.old_spec if change is not None else None
        sb = standby.Standby.of(self.store.root, self.systemd.unit, self.systemd.scope, spec)
        if sb is None:
            return None
        mode = self.settings.handover
        target = self.restoring
        text, meta, number = live_text, old_meta, prev
        if target is not None:  # a rollback: only to what the second instance keeps warm
            text, meta, number = target.env_text, target.meta, target.number
        why = self._no_switch(mode, sb, before, text, meta, target, result)
        if why is not None:
            self.held_because, self.idle_standby = f"{sb.name}: {why}", sb
            return None
        assert text is not None and meta is not None
        argv = self.reverter.argv_of(text)
        key = keys.key_of_env(text, str(self.env_file))
        load = budgets.Load.of_meta(meta)

        def serve() -> Any:
            return sb.serve(text, argv, key, self.gate.waits, load, self.gate.progress)

        warm = 0.0 if target is not None else max(self.settings.keep_warm, self.settings.bake)
        return Bridge(
            sb,
            text,
            argv,
            meta,
            key,
            serve,
            warm,
            number,
            home.where(self.settings),
            restores=target is None,
            why="the second instance keeps it warm"
            if target is not None
            else f"handover = {mode}"
            + (": it fits beside the running one" if mode == "auto" else ""),
        )

    def _no_switch(
        self,
        mode: str,
        sb: standby.Standby,
        before: UnitState,
        text: str | None,
        meta: dict[str, Any] | None,
        target: store.Generation | None,
        result: Result,
    ) -> str | None:
        """Why the restart is held rather than switched (None: it switches)."""
        if mode == "hold":
            return "the setting handover is hold"
        if target is not None:  # the unit may be down (a crashed config): the warm one serves
            if not sb.keeps(text):
                return (
                    f"{sb.name} does not keep generation {target.number} warm (its warm "
                    "period is over, or another generation is there)"
                )
            return None
        if text is None or meta is None:
            return "there is no previous config to serve meanwhile"
        where = (self.store.root, self.systemd.unit, self.systemd.scope)
        # the second instance serves this config already (a failed rollback left it so)
        already = bridging(*where, text)
        if not before.running and not already:
            return f"{self.systemd.unit} is not running: there is nothing to serve meanwhile"
        missing = sb.missing()
        if missing is not None:
            return missing
        beside = result.memory.get("beside") or {}
        if mode == "auto" and not already and beside.get("fits") is not True:
            return f"the second instance may not fit: {beside.get('why') or 'not measured'}"
        return None

    def stop_warm(self) -> dict[str, Any]:
        """``stop-warm``: under the lock, the second instance stopped when its warm period
        is over and it does not serve."""
        with self._locked() as recovered:
            front = Front(self.store.root, self.systemd.unit, self.systemd.scope)
            spec = front.spec()
            sb = standby.Standby.of(self.store.root, self.systemd.unit, self.systemd.scope, spec)
            if sb is None or spec is None:
                return {"stopped": False, "why": "the unit has no second instance"}
            timeout = self.settings.drain_timeout
            out = standby.stop_due(sb, spec, idle=lambda: fronthold.drain_side(front, "b", timeout))
            if recovered:
                out["recovered"] = recovered
            return out

    def _window(self, checked: validate.Validated, number: int | None) -> dict[str, Any]:
        return window.window_data(self.settings.unit_name, checked, number)
