"""The deploy transaction, top to bottom.

A config change ends either with the new config serving real completions, or with the old
one serving again::

    lock -> recover an interrupted transaction (launcher.recovery) -> render + validate
    -> unchanged? stop here -> register the rollback (the transaction record names the old
    text; launcher.errorhandler) -> store the new generation -> atomic swap of the env file
    -> systemctl restart -> gate (launcher.gate) -> commit: mark the generation deployed
    -> any failure, SIGINT, SIGTERM or SIGHUP: restore the previous generation and gate it
       -> rolled_back, or rollback_failed (a swap that did not happen restarts nothing).

A rollback skips render + validate: it takes a stored generation's own bytes, checked
by the strict parse and ``bash -n`` only (launcher.restore).

If the deployer dies (kill -9), the next invocation finds ``txn.json`` and reverts it first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from launcher import (
    budgets,
    config,
    envfile,
    handover,
    home,
    keys,
    memory,
    restore,
    service,
    store,
    validate,
    waits,
    window,
)
from launcher.errorhandler import Signals, on_error
from launcher.errors import ConfigInvalid, Interrupted, StoreError
from launcher.gate import Gate, Progress, together
from launcher.recovery import Reverter
from launcher.result import Result
from launcher.systemd import Systemd, UnitState

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
            settings.resolved_state_dir(), home.lock_path(settings.scope, settings.unit_name)
        )
        self.env_file = settings.resolved_env_file()
        policy = policy or waits.Waits.from_settings(settings)
        self.gate = Gate(self.systemd, policy, settings.base_url, progress)
        self.signals = Signals()
        self.reverter = Reverter(self.store, self.env_file, self.systemd, self.gate, self.signals)
        #: deploy even when the memory guard says the config does not fit (--force-memory)
        self.force_memory = force_memory
        self.on_phase = on_phase
        self.handover = handover.Handover()  # replaced by handover.prepare() per restart
        #: the box's devices for the memory guard (None: the binary's --list-devices)
        self.devices: validate.Devices | None = None
        #: the generation a ``rollback`` puts back: its gate gets that one's budget
        self.restoring: store.Generation | None = None

    def deploy(
        self, cfg: config.ServerConfig, check: bool = False, origin: str = "deploy"
    ) -> Result:
        """Deploy a whole desired config (``check``: validate and diff only)."""
        with self._locked(check) as recovered:
            return self._deploy(cfg, check, origin, recovered=recovered)

    def set_flags(self, tokens: list[str], check: bool = False) -> Result:
        """Change some flags of the live config."""
        with self._locked(check) as recovered:
            cfg = config.from_flags(tokens, self.live_config_data())
            return self._deploy(
                cfg, check, "set " + envfile.join_words(tokens), recovered=recovered
            )

    def unset_flags(self, names: list[str], check: bool = False) -> Result:
        with self._locked(check) as recovered:
            cfg = config.build(config.remove_flags(self.live_config_data(), names))
            return self._deploy(cfg, check, "unset " + " ".join(names), recovered=recovered)

    def rollback(self, to: int | None = None) -> Result:
        """Go back to generation ``to`` or the last known-good one: its stored bytes, checked
        cheaply (``launcher.restore``), through the same gate."""
        with self._locked() as recovered:
            t0 = time.monotonic()
            live = self.store.live()
            running = lambda: self.systemd.state().running  # noqa: E731
            target = self.store.rollback_target(to, self.reverter.live_text(), running)
            self.restoring = target  # the gate gets the budget this generation needed
            self.gate.say("validate")
            checked = restore.candidate(target)
            origin = f"rollback to {target.number}"
            result = self._proceed(
                checked, self.systemd.state(), False, origin, True, recovered, t0
            )
            if live is not None and target.number != live.number:
                self.store.back_out(live)
            return result

    def recover_only(self) -> dict[str, Any] | None:
        """The ``recover`` verb: revert what a killed deployer left; ``RollbackFailed`` when
        the restored config does not pass its gate."""
        with self._locked() as recovered:
            pass
        return self.reverter.restored_or_raise(recovered)

    def live_config_data(self) -> dict[str, Any]:
        live = self.store.live()
        if live is None:
            raise ConfigInvalid(
                f"nothing deployed yet for {self.settings.unit_name} (no live generation in "
                f"{self.store.root}); run llama-launcher install or deploy --config FILE first"
            )
        return dict(live.meta["config"])

    @contextlib.contextmanager
    def _locked(self, check: bool = False) -> Iterator[dict[str, Any] | None]:
        """Hold the lock and revert what a killed deployer left first; a check changes
        nothing, so it neither takes the lock nor recovers (it says what a real run would)."""
        if check:
            yield None
            return
        wait = budgets.lock_wait(self.settings, self.gate.waits, budgets.last_load(self.store))
        with self.store.lock(wait), self.signals.installed():
            home.claim(self.settings, self.store.root)
            yield self.reverter.recover()

    def _phase(self, phase: str) -> None:
        """Record the phase in the transaction record (and tell ``on_phase``)."""
        self.store.mark(phase=phase)
        if self.on_phase is not None:
            self.on_phase(phase)

    # -- validate -> unchanged? ------------------------------------------------------------

    def _deploy(
        self,
        cfg: config.ServerConfig,
        check: bool,
        origin: str,
        force_restart: bool = False,
        recovered: dict[str, Any] | None = None,
    ) -> Result:
        t0 = time.monotonic()
        self.gate.say("validate")
        cfg = keys.materialize(self.store, cfg, write=not check)
        if self.settings.carry_slots:
            folder = handover.slot_folder(self.settings.scope, self.store.root, self.systemd.show)
            create = not check and self.settings.scope != "system"
            cfg = handover.with_slot_dir(cfg, folder, create)
        checked, running = validate.beside_state(
            cfg,
            self.systemd.state,
            check,
            self.force_memory,
            service.view(self.settings),
            box=self.devices,
            unified=self.settings.unified_memory,
            live_meta=self._live_meta,
        )
        return self._proceed(checked, running, check, origin, force_restart, recovered, t0)

    def _proceed(
        self,
        checked: validate.Validated,
        running: UnitState | None,
        check: bool,
        origin: str,
        force_restart: bool,
        recovered: dict[str, Any] | None,
        t0: float,
    ) -> Result:
        live_text = self.reverter.live_text()
        result = Result(
            "checked" if check else "deployed",
            True,
            None,
            self.store.live_number(),
            planned=window.plan_dict(checked.plan),
            diff=config.argv_diff(self.reverter.argv_of(live_text), checked.argv),
            timings={"validate": round(time.monotonic() - t0, 3)},
            warnings=[
                *checked.memory.notes,
                *self._notes(check, running, live_text == checked.env_text),
            ],
            recovered=recovered,
        )
        down = running is not None and not running.running
        if live_text == checked.env_text and not force_restart and not down and not result.warnings:
            live = self.store.live()
            result.outcome, result.changed, result.diff = "unchanged", False, []
            result.generation = result.previous_generation
            result.message = "the rendered env file is byte-identical to the live one; "
            result.message += "nothing restarted"
            if live is not None:
                result.startup = live.meta.get("startup")
                result.client_window = self._window(checked, result.generation)
            return result
        if check:
            result.message = "valid; nothing was changed (check mode)"
            return result
        assert running is not None
        prev = result.previous_generation
        result.previous_generation = restore.adopt_unmanaged(
            self.store, live_text, prev, str(self.env_file)
        )
        old_text = live_text
        if old_text is None:
            old_text = self.reverter.deleted_live(result.warnings)
        return self._transaction(checked, old_text, origin, result, t0, running)

    def _live_meta(self) -> dict[str, Any] | None:
        live = self.store.live()
        return live.meta if live else None

    def _notes(self, check: bool, running: UnitState | None, identical: bool) -> list[str]:
        notes = []
        if check and self.store.txn():
            notes.append(
                "llama-launcher: a deploy was interrupted (txn.json); a real run reverts it "
                "first, restarting the unit"
            )
        if running is not None and not running.running and identical:
            notes.append(
                f"llama-launcher: {self.systemd.unit} is not running ({running.active}/"
                f"{running.sub}); the identical config is started again through the gate"
            )
        return notes

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
        gen = self._store(checked, live_text, prev, origin, result.planned, before)
        result.generation = gen.number
        result.memory["before"] = memory.process_memory(before) if before.running else None
        result.memory["estimate"] = checked.memory.to_dict()
        undo = lambda e: self.reverter.undo(  # noqa: E731
            e, gen, live_text, prev, result, t0, self.handover.after_rollback
        )
        with on_error(self.signals, undo):
            self._phase("swap")
            store.swap_env(self.env_file, checked.env_text)
            self._phase("swapped")
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
            result.timings.update(gate.timings)
            result.timings["restart_to_serving"] = round(time.monotonic() - t_restart, 3)
            # the front's new config, the slots restored, the held requests released
            new = handover.Endpoint(self.gate.url_for(checked.argv), key)
            result.handover = self.handover.after_gate(gen.meta, new, checked.plan.n_slots)
            result.warnings += self.handover.warnings
        with self.signals.deferred():  # the gate passed: the bookkeeping is finished first
            result.startup, result.probe = gate.startup, gate.probe
            result.warnings = [*result.warnings, *gate.warnings]
            result.memory["after"] = memory.process_memory(gate.state)
            result.memory["devices"] = memory.measured(gate.log, checked.memory.devices)
            result.client_window = window.publish(self.settings, self._window(checked, gen.number))
            result.timings["total"] = round(time.monotonic() - t0, 3)
            self.store.update(
                gen,
                outcome="deployed",
                startup=gate.startup,
                probe=gate.probe,
                memory=result.memory,
                warnings=gate.warnings,
                timings=result.timings,
                load=gate.load.to_dict() if gate.load else None,
            )
            self.store.set_live(gen.number)
            self.store.end()
        result.message = f"generation {gen.number} is serving: {checked.plan.describe()}"
        if self.signals.pending is not None:
            result.message += " (a signal arrived after the gate passed; the deploy stands)"
        return result

    def _store(
        self,
        checked: validate.Validated,
        live_text: str | None,
        prev: int | None,
        origin: str,
        planned: dict[str, Any] | None,
        before: UnitState,
    ) -> store.Generation:
        """Write the transaction record (it names the old text: the rollback is registered
        before anything live is touched), then the new generation."""
        meta = {**checked.meta(), "origin": origin, "planned": planned, "previous": prev}
        record = {"phase": "begin", "from": prev, "to": None, "env_file": str(self.env_file)}
        try:
            self.store.begin({**record, "old_text": live_text})
            gen = self.store.new(checked.env_text, meta)
            self.store.mark(to=gen.number)
            self._phase("stored")
            self._prepare_handover(live_text, prev, before)
            return gen
        except (OSError, StoreError, Interrupted) as e:
            self.reverter.discard()
            if isinstance(e, StoreError):
                raise StoreError(f"{e}; nothing live was changed") from e
            if isinstance(e, OSError):
                raise StoreError(
                    f"cannot write the new generation to {self.store.root}: {e}; "
                    "nothing live was changed (free space or fix the permissions, then retry)"
                ) from e
            raise

    def _prepare_handover(self, live_text: str | None, prev: int | None, before: UnitState) -> None:
        """Before anything live changes: hold the front, drain, save the slots."""
        old = handover.Endpoint(
            self.gate.url_for(self.reverter.argv_of(live_text)),
            keys.key_of_env(live_text, str(self.env_file)),
        )
        self.handover = handover.prepare(
            self.store.root,
            self.systemd.unit,
            old if live_text is not None else None,
            self.store.get(prev).meta if prev else None,
            before,
            self.settings.drain_timeout,
            self.gate.say,
        )

    def _window(self, checked: validate.Validated, number: int | None) -> dict[str, Any]:
        return window.window_data(self.settings.unit_name, checked, number)
