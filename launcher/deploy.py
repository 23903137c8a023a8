"""The deploy transaction, top to bottom.

A config change ends either with the new config serving real completions, or with the old
one serving again::

    lock -> recover an interrupted transaction -> render + validate -> unchanged? stop here
    -> store the new generation, write the transaction record (the rollback is registered
       before anything live is touched) -> atomic swap of the env file (old one kept)
    -> journal cursor -> systemctl restart -> gate:
         the unit stays up (first exit detected, not after systemd's restart loop),
         the startup line equals the plan, /health 200, /props agrees, a real completion
    -> success: mark the generation deployed
    -> any failure, SIGINT or SIGTERM: restore the previous generation, reset-failed,
       restart, and run the same gate on it -> rolled_back, or rollback_failed.

If the deployer dies (kill -9), the next invocation finds ``txn.json`` and reverts it first.
"""

from __future__ import annotations

import contextlib
import difflib
import getpass
import hashlib
import json
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from launcher import config, envfile, handover, launch, pool, serverlog, store, validate
from launcher.errors import (
    ConfigInvalid,
    DeployFailed,
    GateFailure,
    Interrupted,
    LauncherError,
    ProbeError,
    RollbackFailed,
    StoreError,
)
from launcher.probe import Probe, read_api_key
from launcher.systemd import Systemd, UnitState

Progress = Callable[[str, float, str], None]  # (phase, elapsed seconds, last log line)


@dataclass
class GateResult:
    startup: dict[str, Any]
    props: dict[str, Any]
    probe: dict[str, Any]
    warnings: list[str]
    timings: dict[str, float]
    state: UnitState


@dataclass
class Result:
    """What a verb did: the one JSON object of ``--json``."""

    outcome: str
    changed: bool
    generation: int | None = None
    previous_generation: int | None = None
    message: str = ""
    startup: dict[str, Any] | None = None
    planned: dict[str, Any] | None = None
    probe: dict[str, Any] | None = None
    client_window: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    diff: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    failure: dict[str, Any] | None = None
    rollback: dict[str, Any] | None = None
    recovered: dict[str, Any] | None = None
    handover: dict[str, Any] | None = None  # drain, slots, front, stop (launcher/handover.py)

    @property
    def ok(self) -> bool:
        return self.outcome in ("deployed", "unchanged", "checked")

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **self.__dict__}


def plan_dict(plan: pool.PoolPlan) -> dict[str, Any]:
    return {
        "n_slots": plan.n_slots,
        "n_ctx_slot": plan.n_ctx_slot,
        "kv_unified": plan.kv_unified,
        "pool_cells": plan.n_ctx,
        "guaranteed_window": plan.guaranteed_window,
        "overcommitted": plan.overcommitted,
    }


def argv_diff(old: list[str], new: list[str]) -> list[str]:
    """A readable diff of two argvs, one flag per line."""

    def lines(argv: list[str]) -> list[str]:
        out: list[str] = []
        for word in argv:
            if (word.startswith("-") and not word[1:].replace(".", "").isdigit()) or not out:
                out.append(word)
            else:
                out[-1] += " " + envfile.join_words([word])
        return out

    return [
        d
        for d in difflib.unified_diff(lines(old), lines(new), "live", "new", lineterm="", n=0)
        if not d.startswith("@@")
    ]


def client_window_path(env_file: Path) -> Path:
    """Where clients read the guaranteed window: next to the env file, named after it (one
    per instance: ``llama-server.client-window.json``, ``chat.client-window.json``)."""
    return env_file.with_name(f"{env_file.stem}.client-window.json")


def releasable_memory(state: UnitState) -> int:
    """What restarting the running server gives back to MemAvailable: its anonymous memory
    (KV cache, buffers; weights loaded without mmap). The pages of an mmap'd model count in
    MemAvailable already, as reclaimable page cache, so they are not counted twice."""
    if not state.running or state.main_pid <= 0:
        return 0
    try:
        for line in Path(f"/proc/{state.main_pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def process_memory(state: UnitState) -> int | None:
    """The service's memory: the cgroup's MemoryCurrent, else MainPID's RSS from /proc."""
    if state.memory_current:
        return state.memory_current
    if state.main_pid > 0:
        try:
            for line in Path(f"/proc/{state.main_pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


class Deployer:
    """Runs deploy, rollback and recovery for one unit. Collaborators are passed in."""

    def __init__(
        self,
        settings: config.ToolSettings,
        systemd: Systemd | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.settings = settings
        self.systemd = systemd or Systemd(settings.unit_name, settings.scope)
        self.store = store.Store(settings.resolved_state_dir())
        self.env_file = settings.resolved_env_file()
        self.progress = progress
        self._rolling_back = False
        self._pending_signal: int | None = None
        self.spawn_warnings: list[str] = []
        #: deploy even when the memory guard says the config does not fit (--force-memory)
        self.force_memory = False
        self.handover = handover.Handover()  # handover: replaced by prepare() per restart

    # -- entry points ----------------------------------------------------------------------

    def deploy(
        self, cfg: config.ServerConfig, check: bool = False, origin: str = "deploy"
    ) -> Result:
        """Deploy a whole desired config (``check``: validate and diff only)."""
        with self._locked(check) as recovered:
            result = self._deploy_locked(cfg, check, origin)
            result.recovered = recovered
            return result

    def set_flags(self, tokens: list[str], check: bool = False) -> Result:
        """Change some flags of the live config."""
        with self._locked(check) as recovered:
            base = self.live_config_data()
            cfg = config.from_flags(tokens, base)
            result = self._deploy_locked(cfg, check, "set " + envfile.join_words(tokens))
            result.recovered = recovered
            return result

    def unset_flags(self, names: list[str], check: bool = False) -> Result:
        with self._locked(check) as recovered:
            data = config.remove_flags(self.live_config_data(), names)
            cfg = config.build(data)
            result = self._deploy_locked(cfg, check, "unset " + " ".join(names))
            result.recovered = recovered
            return result

    def rollback(self, to: int | None = None) -> Result:
        """Go back to generation ``to`` or the last known-good one, through the same gate."""
        with self._locked() as recovered:
            live = self.store.live()
            text = self._live_text()
            if to is not None:
                target: store.Generation | None = self.store.get(to)
            elif (
                live is not None
                and live.good
                and (
                    text != live.env_text
                    or not self.systemd.state().running
                    or live.meta.get("gate_failed_at")
                )
            ):
                # the live file was changed behind our back, or the unit is down: the live
                # generation is the last known-good one
                target = live
            else:
                target = self._previous_good(live, text)
            if target is None:
                raise StoreError(
                    f"no known-good generation other than the live one "
                    f"({live.number if live else None}) in "
                    f"{self.store.gen_dir}; see llama-launcher history"
                )
            cfg = config.build(dict(target.meta["config"]))
            result = self._deploy_locked(
                cfg, False, f"rollback to {target.number}", force_restart=True
            )
            if live is not None and target.number != live.number:
                # a later rollback must not bring back the config this one backed out,
                # in whichever generations it was deployed
                for gen in self.store.all():
                    if gen.env_text == live.env_text:
                        self.store.update(gen, rolled_back_from=True)
            result.recovered = recovered
            return result

    def _previous_good(
        self, live: store.Generation | None, text: str | None
    ) -> store.Generation | None:
        """The newest known-good generation before the live one with a different config."""
        for n in reversed(self.store.numbers()):
            gen = self.store.get(n)
            if live is not None and n >= live.number:
                continue
            if gen.good and not gen.meta.get("rolled_back_from") and gen.env_text != text:
                return gen
        return None

    def recover_only(self) -> dict[str, Any] | None:
        """The ``recover`` verb: revert what a killed deployer left; ``RollbackFailed`` when
        the restored config does not pass its gate."""
        with self._locked() as recovered:
            pass
        rec = recovered or {}
        gate = rec.get("gate")
        if gate is not None and not gate.get("ok"):
            raise RollbackFailed(
                f"restored the env file of generation {rec['from']} (the deploy of generation "
                f"{rec['to']} was interrupted at {rec['interrupted_phase']}), but it failed its "
                f"gate: {gate.get('message')}. Nothing was deleted; read `journalctl -u "
                f"{self.systemd.unit}`, fix the cause, then run llama-launcher rollback",
                data={"recovered": rec},
            )
        return recovered

    # -- helpers ---------------------------------------------------------------------------

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
        with self.store.lock(self.settings.lock_timeout), self._signals():
            yield self._recover()

    @contextlib.contextmanager
    def _deferred_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM inside wait until the block is done (``_pending_signal``)."""
        was, self._rolling_back = self._rolling_back, True
        try:
            yield
        finally:
            self._rolling_back = was

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        def handler(signum: int, frame: FrameType | None) -> None:
            if self._rolling_back:
                self._pending_signal = signum  # finish restoring first
                return
            raise Interrupted(signum)

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _checkpoint(self, phase: str) -> None:
        """Record the phase in the transaction record.

        Fault injection for the crash-safety tests (documented in README):
        ``LLAMA_LAUNCHER_FAULT=PHASE:kill`` kills the deployer with SIGKILL at PHASE;
        ``PHASE:pause`` sleeps there (60 s) so a test can signal it at a known point.
        """
        self.store.mark(phase=phase)
        fault = os.environ.get("LLAMA_LAUNCHER_FAULT", "")
        at, _, action = fault.partition(":")
        if at == phase and action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif at == phase and action == "pause":
            time.sleep(60)

    def _say(self, phase: str, elapsed: float = 0.0, line: str = "") -> None:
        if self.progress:
            self.progress(phase, elapsed, line)

    def _materialize_key(self, cfg: config.ServerConfig, write: bool) -> config.ServerConfig:
        """Turn ``api_key`` into a 0600 key file named by a salted hash (so the same key
        renders the same file, and a new key a new one); the config keeps only the path."""
        if cfg.api_key is None:
            return cfg
        self.store.ensure()
        salt_path = self.store.root / "key-salt"
        if not salt_path.exists():
            store.atomic_write(salt_path, secrets.token_hex(16).encode(), 0o600)
        key = cfg.api_key.get_secret_value()
        if "\n" in key or not key:
            raise ConfigInvalid("api_key must be one non-empty line")
        digest = hashlib.sha256(salt_path.read_bytes() + key.encode()).hexdigest()[:16]
        path = self.store.root / "keys" / f"{digest}.key"
        if write and not path.exists():
            path.parent.mkdir(mode=0o700, exist_ok=True)
            store.atomic_write(path, (key + "\n").encode(), 0o600)
        return cfg.model_copy(update={"api_key": None, "api_key_file": path})

    # -- recovery --------------------------------------------------------------------------

    def _recover(self) -> dict[str, Any] | None:
        """Complete or revert a transaction a dead deployer left behind."""
        txn = self.store.txn()
        if not txn:
            return None
        with self._deferred_signals():  # a recovery is a rollback: it is not interrupted
            report = self._recover_txn(txn)
        if self._pending_signal is not None:  # asked to stop during it: stop now
            raise Interrupted(self._pending_signal)
        return report

    def _recover_txn(self, txn: dict[str, Any]) -> dict[str, Any]:
        # Under the lock the record's writer is gone (the lock dies with its holder); its pid
        # may belong to another process by now (a reboot), so it is not consulted.
        phase = str(txn.get("phase", "begin"))
        report: dict[str, Any] = {
            "interrupted_phase": phase,
            "from": txn.get("from"),
            "to": txn.get("to"),
        }
        old_text = txn.get("old_text")
        if phase in ("begin", "stored") and self._new_file_is_live(txn, old_text):
            # the record's phase is written without fsync, the swap with it: after a power
            # loss the new file can be live while the record still says it was not swapped
            phase = "gate"
            report["interrupted_phase"] = f"{txn.get('phase')} (the new file was live)"
        if phase in ("begin", "stored"):
            report["action"] = "nothing live was touched; discarded"
        else:
            self._restore_text(old_text)
            if phase in ("restart", "gate"):
                report["action"] = "restored the previous env file and restarted it"
                report["gate"] = self._restart_old(txn.get("from"), old_text)
            else:
                report["action"] = "restored the previous env file (no restart had happened)"
            if txn.get("from") is not None:
                self.store.set_live(int(txn["from"]))
        if txn.get("to"):
            with contextlib.suppress(StoreError):
                gen = self.store.get(int(txn["to"]))
                self.store.update(gen, outcome="interrupted")
        report.update(handover.recover(self.store.root, self.systemd.unit))  # handover
        if not report.get("gate", {"ok": True}).get("ok") and txn.get("from") is not None:
            with contextlib.suppress(StoreError):
                self.store.update(self.store.get(int(txn["from"])), gate_failed_at=time.time())
        self.store.end()
        return report

    def _new_file_is_live(self, txn: dict[str, Any], old_text: str | None) -> bool:
        if not txn.get("to"):
            return False
        try:
            new_text = self.store.get(int(txn["to"])).env_text
            live = self._live_text()
        except (StoreError, OSError):
            return False
        return live == new_text and live != old_text

    def _live_text(self) -> str | None:
        """The live env file as it is on disk: no newline translation (a CR in it is what
        the launcher refuses); bytes that are not UTF-8 (the launcher refuses them too) read
        as U+FFFD, so the file differs from any rendering (the swap's .bak keeps the bytes)."""
        try:
            return self.env_file.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return None

    def _restore_text(self, old_text: str | None) -> None:
        if old_text is None:
            with contextlib.suppress(FileNotFoundError):
                self.env_file.unlink()
        elif self._live_text() != old_text:
            store.swap_env(self.env_file, old_text, backup=False)

    def _restart_old(self, number: Any, old_text: str | None) -> dict[str, Any]:
        """Start the restored config and gate it; never raises: the result says ``ok``."""
        if old_text is None:
            try:
                self.systemd.stop()
                self.systemd.reset_failed()
            except LauncherError as e:
                return {"ok": False, "message": f"could not stop the unit: {e}"}
            return {"ok": True, "note": "there was no previous config; the unit is stopped"}
        plan = None
        if number:
            with contextlib.suppress(StoreError, ConfigInvalid, KeyError):
                gen = self.store.get(int(number))
                plan = config.build(dict(gen.meta["config"])).pool_plan(
                    gen.meta.get("model", {}).get("n_ctx_train")
                )

        def reset_then_state() -> UnitState:
            self.systemd.reset_failed()
            return self.systemd.state()

        try:
            cursor, before = _together(self.systemd.cursor, reset_then_state)
            self.systemd.restart()
            argv = self._argv_of(old_text)
            gate = self.gate(plan, cursor, before, self._key_for_text(old_text), argv)
            return {"ok": True, "startup": gate.startup}
        except LauncherError as e:  # a gate, a probe, systemctl or journalctl: reported
            return {"ok": False, "message": str(e)}

    def _key_for_text(self, env_text: str | None) -> str | None:
        if not env_text:
            return None
        try:
            values = envfile.parse(env_text, str(self.env_file))
        except envfile.EnvFileError:
            return None  # a hand-written file the strict parser refuses: probe without a key
        path = values.get("API_KEY_FILE")
        return read_api_key(Path(path)) if path else None

    # -- the transaction -------------------------------------------------------------------

    def _deploy_locked(
        self, cfg: config.ServerConfig, check: bool, origin: str, force_restart: bool = False
    ) -> Result:
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        cfg = self._materialize_key(cfg, write=not check)
        cfg = handover.with_slot_dir(cfg, self.store.root, self.settings.carry_slots, not check)
        self._say("validate")
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as workers:
            # the unit's state (a systemctl) is read beside the validation's own processes
            shown = workers.submit(self.systemd.state)

            def unit_state() -> UnitState | None:
                try:
                    return shown.result()
                except LauncherError:
                    if not check:
                        raise
                    return None  # check mode works without a reachable systemd (a build box)

            def releasable() -> int:
                running = unit_state()
                return releasable_memory(running) if running else 0

            checked = validate.validate(cfg, releasable=releasable, force_memory=self.force_memory)
            running = unit_state()
        timings["validate"] = round(time.monotonic() - t0, 3)
        live_text = self._live_text()
        live_argv = self._argv_of(live_text)
        diff = argv_diff(live_argv, checked.argv)
        planned = plan_dict(checked.plan)
        prev_number = self.store.live_number()
        down = running is not None and not running.running
        notes = []
        if check and self.store.txn():
            notes.append(
                "llama-launcher: a deploy was interrupted (txn.json); a real run reverts it "
                "first, restarting the unit"
            )
        if running is not None and down and live_text == checked.env_text:
            notes.append(
                f"llama-launcher: {self.systemd.unit} is not running ({running.active}/"
                f"{running.sub}); the identical config is started again through the gate"
            )
        if live_text == checked.env_text and not force_restart and not down and not notes:
            live = self.store.live()
            return Result(
                "unchanged",
                False,
                prev_number,
                prev_number,
                message="the rendered env file is byte-identical to the live one; "
                "nothing restarted",
                planned=planned,
                timings=timings,
                startup=live.meta.get("startup") if live else None,
                client_window=self._window_data(checked, prev_number) if live else None,
            )
        if check:
            return Result(
                "checked",
                True,
                None,
                prev_number,
                message="valid; nothing was changed (check mode)",
                planned=planned,
                diff=diff,
                timings=timings,
                warnings=notes,
            )
        assert running is not None
        prev_number = self._adopt_unmanaged(live_text, prev_number)
        result = Result(
            "deployed", True, None, prev_number, planned=planned, diff=diff, timings=timings
        )
        result.warnings = notes
        return self._transaction(checked, live_text, prev_number, origin, result, t0, running)

    def _argv_of(self, text: str | None) -> list[str]:
        if text is None:
            return []
        try:
            return launch.argv_from_values(envfile.parse(text, str(self.env_file)))
        except (envfile.EnvFileError, launch.LaunchError):
            return ["(unreadable live env file)"]

    def _adopt_unmanaged(self, live_text: str | None, prev: int | None) -> int | None:
        """A live env file the store does not know (hand-written) is kept as a generation,
        so it can be rolled back to. Nothing is lost."""
        if live_text is None:
            return prev
        if prev is not None and self.store.get(prev).env_text == live_text:
            return prev
        gen = self.store.new(
            live_text,
            {"origin": "adopted: found in the live env file", "time": time.time(), "config": {}},
        )
        self.store.update(gen, outcome="adopted")
        return gen.number

    def _transaction(
        self,
        checked: validate.Validated,
        live_text: str | None,
        prev_number: int | None,
        origin: str,
        result: Result,
        t0: float,
        before: UnitState,
    ) -> Result:
        planned, timings = result.planned, result.timings
        meta = {
            "time": time.time(),
            "user": _user(),
            "origin": origin,
            "argv": checked.argv,
            "config": checked.config.masked(),
            "model": checked.model,
            "llama_server": {
                "path": checked.server.path,
                "version": checked.server.version,
                "fingerprint": checked.server.fingerprint,
            },
            "planned": planned,
            "previous": prev_number,
            "kv_estimate": checked.memory.to_dict(),
        }
        # The rollback is registered before the risky step: the record names the old text.
        try:
            self.store.begin(
                {
                    "phase": "begin",
                    "from": prev_number,
                    "to": None,
                    "env_file": str(self.env_file),
                    "old_text": live_text,
                }
            )
            gen = self.store.new(checked.env_text, meta)
            self.store.mark(to=gen.number)
            self._checkpoint("stored")
            # handover: hold the front, drain, save the slots (nothing live is changed yet)
            old = handover.Endpoint(
                self.url_for(self._argv_of(live_text)), self._key_for_text(live_text)
            )
            self.handover = handover.prepare(
                self.store.root,
                self.systemd.unit,
                old if live_text is not None else None,
                self.store.get(prev_number).meta if prev_number else None,
                before,
                self.settings.drain_timeout,
                self._say,
            )
        except (OSError, Interrupted) as e:
            # nothing live was touched: the record goes, a stored generation stays as a trace
            with self._deferred_signals(), contextlib.suppress(OSError, StoreError):
                if self.store.txn().get("to"):
                    gone = self.store.get(int(self.store.txn()["to"]))
                    self.store.update(gone, outcome="interrupted")
                self.store.end()
            if isinstance(e, OSError):
                raise StoreError(
                    f"cannot write the new generation to {self.store.root}: {e}; "
                    "nothing live was changed (free space or fix the permissions, then retry)"
                ) from e
            raise
        result.generation = gen.number
        result.memory["before"] = process_memory(before) if before.running else None
        result.memory["estimate"] = checked.memory.to_dict()
        try:
            self._checkpoint("swap")
            store.swap_env(self.env_file, checked.env_text)
            self._checkpoint("swapped")
            cursor, _ = _together(self.systemd.cursor, self.systemd.reset_failed)
            self._checkpoint("restart")
            t_restart = time.monotonic()
            self.systemd.restart()
            self._checkpoint("gate")
            gate = self.gate(
                checked.plan,
                cursor,
                before,
                read_api_key(checked.config.api_key_file),
                checked.argv,
            )
            timings.update(gate.timings)
            timings["restart_to_serving"] = round(time.monotonic() - t_restart, 3)
            result.handover = self.handover.after_gate(  # handover: front, restore, release
                meta,
                handover.Endpoint(
                    self.url_for(checked.argv), read_api_key(checked.config.api_key_file)
                ),
                checked.plan.n_slots,
            )
            result.warnings += self.handover.warnings
        except (LauncherError, OSError, Interrupted) as e:
            return self._fail(e, gen, live_text, prev_number, result, t0)
        # the gate passed: the bookkeeping is finished before a signal is acted on
        with self._deferred_signals():
            result.startup, result.probe = gate.startup, gate.probe
            result.warnings = [*result.warnings, *gate.warnings]
            result.memory["after"] = process_memory(gate.state)
            result.client_window = self._client_window(checked, gen.number)
            timings["total"] = round(time.monotonic() - t0, 3)
            self.store.update(
                gen,
                outcome="deployed",
                startup=gate.startup,
                probe=gate.probe,
                memory=result.memory,
                warnings=gate.warnings,
                timings=timings,
            )
            self.store.set_live(gen.number)
            self.store.end()
        result.message = f"generation {gen.number} is serving: {checked.plan.describe()}"
        if self._pending_signal is not None:
            result.message += " (a signal arrived after the gate passed; the deploy stands)"
        return result

    def _fail(
        self,
        error: BaseException,
        gen: store.Generation,
        live_text: str | None,
        prev_number: int | None,
        result: Result,
        t0: float,
    ) -> Result:
        with self._deferred_signals():  # a signal waits until the old config is back
            failure = (
                error.to_dict()
                if isinstance(error, GateFailure)
                else {
                    "phase": "interrupted" if isinstance(error, Interrupted) else "gate",
                    "class": "interrupted"
                    if isinstance(error, Interrupted)
                    else type(error).__name__,
                    "message": str(error),
                    "log_tail": self._tail(),
                }
            )
            self._say("rollback")
            # the old config first: every millisecond here is clients without a model
            restored = False
            try:
                self._restore_text(live_text)
                restored = True
            except OSError as e:
                # the record stays: the next invocation restores the file before anything else
                rb: dict[str, Any] = {
                    "ok": False,
                    "message": f"cannot write the previous env file back to {self.env_file}: "
                    f"{e}; the transaction record in {self.store.root} keeps it",
                }
            else:
                rb = self._restart_old(prev_number, live_text)
            result.handover = self.handover.after_rollback(bool(rb.get("ok")))  # handover
            with contextlib.suppress(OSError):
                self.store.update(gen, outcome="failed", failure=failure)
                if restored:
                    self.store.end()
                    if prev_number is not None:
                        self.store.set_live(prev_number)
        result.failure, result.rollback = failure, rb
        result.timings["total"] = round(time.monotonic() - t0, 3)
        if rb.get("ok"):
            result.outcome = "rolled_back"
            what = (
                f"generation {prev_number} is serving again"
                if live_text is not None
                else rb.get("note", "")
            )
            result.message = (
                f"generation {gen.number} failed ({failure['class']}: {failure['message']}); {what}"
            )
            exc: LauncherError = DeployFailed(result.message, result)
        else:
            result.outcome = "rollback_failed"
            if prev_number is not None:
                with contextlib.suppress(StoreError):
                    self.store.update(self.store.get(prev_number), gate_failed_at=time.time())
            result.message = (
                f"generation {gen.number} failed ({failure['message']}) and restoring generation "
                f"{prev_number} failed too ({rb.get('message')}). Nothing was deleted"
                + (
                    f": the old env file is back in {self.env_file}; "
                    if restored
                    else f", but {self.env_file} still holds the new file: free space or fix "
                    "the permissions, then run llama-launcher recover; "
                )
                + f"read `journalctl -u {self.systemd.unit}`, fix the cause (model, binary, "
                "port, memory), then run llama-launcher rollback"
            )
            exc = RollbackFailed(result.message, result)
        if self._pending_signal is not None or isinstance(error, Interrupted):
            result.message += " (interrupted by a signal)"
        raise exc

    def _tail(self, n: int = 30) -> list[str]:
        try:
            return self.systemd.tail(n)
        except LauncherError:
            return []

    def _client_window(self, checked: validate.Validated, number: int) -> dict[str, Any]:
        """Publish the guaranteed per-slot window next to the env file (seed 000)."""
        data = self._window_data(checked, number)
        path = client_window_path(self.env_file)
        store.atomic_write(path, (json.dumps(data, indent=2) + "\n").encode(), 0o644)
        return data

    def _window_data(self, checked: validate.Validated, number: int | None) -> dict[str, Any]:
        plan = checked.plan
        data = {
            "unit": self.settings.unit_name,
            "generation": number,
            "per_slot_window": plan.guaranteed_window,
            "slots": plan.n_slots,
            "n_ctx_slot": plan.n_ctx_slot,
            "pool_cells": plan.n_ctx,
            "kv_unified": plan.kv_unified,
            "cache_type_k": str(checked.config.cache_type_k or "f16"),
            "cache_type_v": str(checked.config.cache_type_v or "f16"),
        }
        return data

    # -- the gate --------------------------------------------------------------------------

    def url_for(self, argv: list[str]) -> str:
        """The probe's base URL: the setting, else --host/--port of the argv being gated."""
        if self.settings.base_url:
            return self.settings.base_url
        return url_from_argv(argv)

    def gate(
        self,
        plan: pool.PoolPlan | None,
        cursor: str | None,
        before: UnitState,
        api_key: str | None,
        argv: list[str],
    ) -> GateResult:
        """Wait for the restarted unit to serve; raise GateFailure with the reason."""
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        probe = Probe(self.url_for(argv), api_key)
        try:
            scan, log, before, pid = self._wait_ready(probe, cursor, before, t0)
            timings["healthy"] = round(time.monotonic() - t0, 3)
            # The startup line (a journal read) and the unit's state (a systemctl) are read
            # beside /props and the chat: each costs a process start. Failures are reported
            # in the order of the checks: startup line, plan, /props, completion.
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(2) as workers:
                read = workers.submit(self._startup_line, scan, log, cursor, before.main_pid)
                shown = workers.submit(self.systemd.state)
                asked: tuple[dict[str, Any], Any] | BaseException
                try:
                    props = probe.props()
                    self._compare_props(plan, props, log)
                    asked = props, probe.chat(self.settings.probe_timeout)
                except (ProbeError, GateFailure) as e:
                    asked = e
                scan, log = read.result()
                state = shown.result()
            startup = scan.startup
            assert startup is not None
            startup_d = {
                "n_slots": startup.n_slots,
                "n_ctx_slot": startup.n_ctx_slot,
                "kv_unified": startup.kv_unified,
                "pool_cells": startup.pool_cells,
                "config_file": startup.config_file,
            }
            if plan is not None:
                self._compare(plan, startup_d, log)
            if isinstance(asked, BaseException):
                raise asked
            props, completion = asked
            timings["completion"] = round(time.monotonic() - t0, 3)
        except ProbeError as e:
            raise GateFailure("probe", "probe", str(e), self._tail(30)) from e
        finally:
            probe.close()
        if self.settings.settle_seconds:
            time.sleep(self.settings.settle_seconds)
            state = self.systemd.state()
        # still up after the completion: what systemd said meanwhile, and its process now
        dead = _dead(state, before, True)
        if not dead and not _alive(pid):
            state = self.systemd.state()
            dead = _dead(state, before, True) or f"llama-server (pid {pid}) exited"
        if dead:
            raise self._exited(dead, log + self._tail(20))
        return GateResult(
            startup_d,
            {
                "total_slots": props.get("total_slots"),
                "n_ctx": props.get("default_generation_settings", {}).get("n_ctx"),
            },
            completion.to_dict(),
            [*self.spawn_warnings, *startup.warnings],
            timings,
            state,
        )

    def _wait_ready(
        self, probe: Probe, cursor: str | None, before: UnitState, t0: float
    ) -> tuple[serverlog.StartupScan, list[str], UnitState, int]:
        """Until the *new* process answers /health 200: watch the unit (its first exit fails
        the gate), follow its journal (progress and the startup line) and poll /health.

        /health is asked only once systemd shows the new process: until then a 200 could come
        from the old server, still shutting down.
        """
        scan = serverlog.StartupScan()
        log: list[str] = []
        started = respawned = False
        pid = 0  # the new process, once systemd shows it
        next_state = 0.0
        t_startup: float | None = None
        health_wait = 0.005  # a local llama-server answers /health in about a millisecond
        # lines of the process the restart replaced are no evidence about the new one (it may
        # have been starting itself: a deployer killed mid-gate, then recovered)
        old_pid = before.main_pid
        with self.systemd.follow(cursor, old_pid) as journal:
            while True:
                lines = journal.read(0.005)
                log.extend(lines)
                scan.feed_all(lines)
                now = time.monotonic()
                if t_startup is None and scan.startup is not None:
                    t_startup = now
                gone = pid > 0 and not _alive(pid)
                if gone:
                    next_state = now  # the new process is gone: ask systemd why, now
                if now >= next_state:
                    # Until the new process shows, often. Then its pid is watched every loop
                    # (a free syscall: a bad config exits within milliseconds) and systemd is
                    # asked rarely: each `systemctl show` takes CPU the loading server needs.
                    next_state = now + (0.02 if pid <= 0 else 0.25)
                    state = self.systemd.state()
                    started = (
                        started
                        or state.invocation_id != before.invocation_id
                        or state.main_pid not in (0, before.main_pid)
                    )
                    if started:
                        pid = state.main_pid
                    dead = _dead(state, before, started)
                    if dead and state.exec_main_status in SPAWN_FAILURES and not respawned:
                        # systemd itself failed to spawn the process (e.g. 219/CGROUP while the
                        # old process's cgroup was still being torn down): not the config's fault
                        respawned, started, before, pid = True, False, state, 0
                        self.spawn_warnings.append(
                            f"systemd failed to spawn the service (status "
                            f"{state.exec_main_status}, {state.result}); restarted it once more"
                        )
                        self.systemd.reset_failed()
                        self.systemd.restart()
                        continue
                    if dead:
                        raise self._exited(dead, self._last_words(cursor, log, old_pid))
                if started and not gone:
                    status, detail = probe.health(health_wait)
                    if status is None and detail == "TimeoutError" and now - t0 > 1.0:
                        # something holds the port but does not answer (yet): ask again with
                        # more patience, but first look at the unit (it may have died). Not at
                        # once: a config that cannot bind a taken port dies within milliseconds.
                        health_wait = min(health_wait * 2, 1.0)
                    if status == 200:
                        # the 200 must come from our process, not from whatever else may hold
                        # the port: the process systemd started must still be there
                        if pid <= 0 or not _alive(pid):
                            dead = _dead(self.systemd.state(), before, True)
                            if dead:
                                raise self._exited(dead, self._last_words(cursor, log, old_pid))
                            continue
                        return scan, log, before, pid
                    self._say("loading", now - t0, log[-1] if log else detail)
                self._check_deadline(now, t0, t_startup, log)

    def _check_deadline(
        self, now: float, t0: float, t_startup: float | None, log: list[str]
    ) -> None:
        if t_startup is None and now > t0 + self.settings.start_timeout:
            raise GateFailure(
                "startup",
                "timeout",
                f"no startup line within {self.settings.start_timeout:g}s "
                "(raise --start-timeout for a large model)",
                log[-30:],
            )
        if t_startup is not None and now > t_startup + self.settings.health_timeout:
            raise GateFailure(
                "health",
                "timeout",
                f"/health did not return 200 within {self.settings.health_timeout:g}s of the "
                "startup line (raise --health-timeout for a large model)",
                log[-30:],
            )

    def _startup_line(
        self, scan: serverlog.StartupScan, log: list[str], cursor: str | None, old_pid: int
    ) -> tuple[serverlog.StartupScan, list[str]]:
        """The startup line, once the server is healthy. It is in the journal file already;
        journald only tells followers about new entries every 250 ms, so read the file."""
        deadline = time.monotonic() + 2.0
        while scan.startup is None:
            log, _ = self.systemd.messages(cursor, skip_pid=old_pid)
            scan = serverlog.StartupScan().feed_all(log)
            if scan.startup is None:
                if time.monotonic() > deadline:
                    raise GateFailure(
                        "startup",
                        "no_startup_line",
                        "llama-server is healthy but its journal has no 'initializing, n_slots "
                        f"= ...' line (log format of build {serverlog.TESTED_BUILD} expected; "
                        "is this another build?)",
                        log[-30:],
                    )
                time.sleep(0.02)
        return scan, log

    def _last_words(self, cursor: str | None, followed: list[str], old_pid: int) -> list[str]:
        """The dead process's journal since the restart: the lines followed so far when they
        say why it died, else read until they do. journald may still be storing its last
        lines: for at most half a second."""
        if serverlog.classify(followed):
            return followed
        deadline = time.monotonic() + 0.5
        while True:
            lines, _ = self.systemd.messages(cursor, skip_pid=old_pid)
            if serverlog.classify(lines) or time.monotonic() > deadline:
                return lines or followed
            time.sleep(0.02)

    def _exited(self, reason: str, log: list[str]) -> GateFailure:
        hit = serverlog.classify(log)
        kind, sentence = hit if hit else ("exited", "")
        msg = reason + (f": {sentence}" if sentence else "")
        return GateFailure("startup", kind, msg, log[-30:])

    def _compare(self, plan: pool.PoolPlan, startup: dict[str, Any], log: list[str]) -> None:
        want = {
            "n_slots": plan.n_slots,
            "n_ctx_slot": plan.n_ctx_slot,
            "kv_unified": plan.kv_unified,
        }
        got = {k: startup[k] for k in want}
        if got != want:
            bad = ", ".join(
                f"{k} = {got[k]} (planned {want[k]})" for k in want if got[k] != want[k]
            )
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

    def _compare_props(
        self, plan: pool.PoolPlan | None, props: dict[str, Any], log: list[str]
    ) -> None:
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


def url_from_argv(argv: list[str]) -> str:
    """http://HOST:PORT from llama-server's --host/--port (defaults 127.0.0.1:8080)."""
    host, port = "127.0.0.1", "8080"
    for i, word in enumerate(argv[:-1]):
        if word == "--host":
            host = argv[i + 1].split(",")[0]
        elif word == "--port":
            port = argv[i + 1]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


#: Exit statuses systemd uses for its own failures to spawn a process (200 CHDIR .. 243
#: CREDENTIALS, systemd.exec(5) "Process Exit Codes"); llama-server itself exits 0 or 1.
SPAWN_FAILURES = range(200, 244)


def _dead(state: UnitState, before: UnitState, started: bool) -> str | None:
    """Why the unit is not running after our restart, or None while it still may be fine."""
    if state.n_restarts > before.n_restarts:
        return (
            f"llama-server exited with status {state.exec_main_status} and systemd "
            f"restarted it ({state.n_restarts - before.n_restarts} restart(s))"
        )
    if not started:
        return None
    if state.active in ("failed", "inactive") or state.sub in ("auto-restart", "failed", "dead"):
        status = state.exec_main_status
        if status == envfile.EX_CONFIG:
            return f"the launcher refused the env file (status {status})"
        return f"llama-server exited with status {status} ({state.result})"
    return None


def _together(*calls: Callable[[], Any]) -> list[Any]:
    """Run independent systemctl/journalctl calls at once: each costs a process start."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as workers:
        futures = [workers.submit(call) for call in calls]
        return [f.result() for f in futures]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
