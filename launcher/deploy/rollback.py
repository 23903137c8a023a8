"""Going back: every way the deploy puts a config that served back in place.

One word for one concept, three ways in:

- **rollback** (``llama-launcher rollback [--to N]``; ``candidate``): a person puts back a
  generation that served, from its stored bytes, not a re-rendering of its config. Serving
  before proved what the memory guard and the pool check would say (and a generation
  deployed with ``--force-memory`` was let past them on purpose), so they are not run
  again; the cheap checks on the bytes are (``validate.check_bytes``: the launcher's strict
  parse and ``bash -n``), and so are the checks of what can change under a config after it
  served (``validate.check_served``: the binary runs and knows the flags, every file it
  names is there and the service can read it, the slot folder can be written). A refusal
  there changes nothing: the old process keeps serving. The gate still proves the restored
  config serves. A hand-written live file the store adopts (``adopted``) gets the argv and
  the typed config read from its bytes, so ``history`` shows what it ran and a later
  ``set`` can build on it.
- **undo** (``Reverter.undo``): a deploy whose new config failed puts the old one back.
  ``on_error`` registers it before the risky step and runs it on an exception and on a
  signal alike (certbot's ``error_handler`` in this tool's terms: ``Signals`` turns SIGINT,
  SIGTERM and SIGHUP into ``Interrupted`` while a command holds the lock, so the transaction
  unwinds through its ``except`` like any other failure; while an undo, a recovery or the
  bookkeeping after a passed gate runs, a signal waits, ``Signals.deferred``, and is acted
  on when it is done).
- **recovery** (``Reverter.recover``, run first by every verb that takes the lock, by the
  front's release watcher and by the unit's prestart step): what a deployer that died
  mid-transaction left is undone from its transaction record.

Undo and recovery restore the old env file first (every millisecond here is clients without
a model), and the front's old config with it (the transaction record names both), restart
it, held at the front if the unit has one, and run the same gate on it; the outcome is
"restored and serving" or "restore failed", never an exception from the restore itself.

A bake's **revert** (``launcher.watch.revert``) is a rollback the bake decides: the same
verb, run by the sampler when the new config is worse under load.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from launcher import config
from launcher.config import memory, validate
from launcher.config import vllm as vllm_config
from launcher.deploy import budgets, keys, store
from launcher.deploy.gate import Gate, together
from launcher.deploy.restart import bridge, fronthold
from launcher.deploy.restart.front import Front
from launcher.errors import (
    ConfigInvalid,
    DeployFailed,
    GateFailure,
    Interrupted,
    LauncherError,
    RollbackFailed,
    StoreError,
    SwapFailed,
)
from launcher.host import envfile, launch, service
from launcher.host.systemd import Systemd, UnitState
from launcher.server import kvlayout, slotsave, vllm

if TYPE_CHECKING:
    from launcher.deploy.outcome import Result


# -- signals: the undo registered before the risky step --------------------------------------

#: The signals that roll a transaction back (a closed terminal sends SIGHUP).
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Signals:
    """The signal handlers of one command, and the signal that arrived while deferred."""

    def __init__(self) -> None:
        self.deferring = False
        self.pending: int | None = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.deferring:
            self.pending = signum  # finish restoring first
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Signals raise ``Interrupted`` inside the block (the previous handlers after it)."""
        old = {s: signal.signal(s, self._handler) for s in SIGNALS}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal inside waits until the block is done (``pending``)."""
        was, self.deferring = self.deferring, True
        try:
            yield
        finally:
            self.deferring = was

    def stop_if_asked(self) -> None:
        """Act on a signal that arrived while deferred."""
        if self.pending is not None:
            raise Interrupted(self.pending)


@contextlib.contextmanager
def on_error(signals: Signals, rollback: Callable[[BaseException], NoReturn]) -> Iterator[None]:
    """Run ``rollback(error)`` (signals deferred) when the block raises a ``LauncherError``,
    an ``OSError`` or ``Interrupted``; ``rollback`` raises the outcome."""
    try:
        yield
    except (LauncherError, OSError, Interrupted) as e:
        with signals.deferred():
            rollback(e)


# -- rollback: a stored generation's own bytes, checked --------------------------------------

#: The checks a restore runs: on the stored bytes, and on what can change after serving (the
#: pool and the memory guard of ``validate.STEPS`` served).
STEPS = ("lint", "bash -n", "llama-server", "flags", "model", "files", "service")


def config_of_argv(argv: list[str], key_file: str | None = None) -> config.AnyConfig:
    """The typed config an env file's argv means; ``ConfigInvalid`` when it has none (no
    ``-m``, a relative path, ...)."""
    if vllm.is_vllm_argv(argv):
        base: dict[str, Any] = {"backend": "vllm", "vllm_python": argv[0]}
        if key_file:
            base["api_key_file"] = key_file
        return config.onto(argv[3:], base)
    words, i = [], 1
    while i < len(argv):
        if argv[i] in ("--log-colors", "--api-key-file"):  # the launcher adds these itself
            i += 2
            continue
        words.append(argv[i])
        i += 1
    base = {"llama_server": argv[0]}
    if key_file:
        base["api_key_file"] = key_file
    return config.from_flags(words, base)


def adopted(text: str, source: str) -> dict[str, Any]:
    """argv and masked config of a hand-written env file (empty where its bytes do not
    parse: it is kept all the same, and restored as it is)."""
    try:
        values = envfile.parse(text, source)
        argv = launch.argv_from_values(values, source)
    except (envfile.EnvFileError, launch.LaunchError):
        return {"argv": [], "config": {}}
    try:
        cfg = config_of_argv(argv, values.get("API_KEY_FILE"))
    except ConfigInvalid:
        return {"argv": argv, "config": {}}
    return {"argv": argv, "config": cfg.masked()}


def adopt_unmanaged(
    st: store.Store, live_text: str | None, prev: int | None, source: str
) -> int | None:
    """A live env file the store does not know (hand-written) is kept as a generation, so it
    can be rolled back to; its number (``prev`` when the live file is that generation's)."""
    if live_text is None or (prev is not None and st.get(prev).env_text == live_text):
        return prev
    meta = {
        "origin": "adopted: found in the live env file",
        "time": time.time(),
        **adopted(live_text, source),
    }
    gen = st.new(live_text, meta)
    st.update(gen, outcome="adopted")
    return gen.number


def candidate(
    gen: store.Generation,
    svc: service.ServiceView | None = None,
    made: Path | None = None,
    workdir: Path | None = None,
) -> validate.Validated:
    """Generation ``gen``'s stored bytes, checked cheaply, as the deploy's ``Validated``;
    ``svc`` and ``made`` as for ``validate.validate``."""
    text = gen.env_text
    with tempfile.TemporaryDirectory(prefix="llama-launcher-", dir=workdir) as tmp:
        path = Path(tmp) / "restore.env"
        path.write_bytes(text.encode())
        os.chmod(path, 0o600)
        argv = validate.check_bytes(path)
    values = envfile.parse(text, str(gen.path / "env"))
    cfg = _config(gen, argv, values.get("API_KEY_FILE"))
    if isinstance(cfg, config.VllmConfig):
        return validate.served_vllm(cfg, text, values, argv, _need(gen.meta.get("kv_estimate")))
    model = dict(gen.meta.get("model") or {"path": str(cfg.model)})
    plan = cfg.pool_plan(model.get("n_ctx_train"))
    info = validate.check_served(cfg, argv, svc, made)
    need = _need(gen.meta.get("kv_estimate"))
    return validate.Validated(cfg, text, values, argv, plan, model, info, need, steps=STEPS)


def _config(gen: store.Generation, argv: list[str], key_file: str | None) -> config.AnyConfig:
    """The stored typed config; read from the bytes for an adopted hand edit (stored
    without one before the adoption read it)."""
    data = gen.meta.get("config") or {}
    try:
        return config.of(dict(data)) if data else config_of_argv(argv, key_file)
    except ConfigInvalid as e:
        raise ConfigInvalid(
            f"generation {gen.number}'s env file ({gen.path / 'env'}) has no config the gate "
            f"can check ({e}); put it back by hand with cp, then restart the unit"
        ) from e


def _plan_of(gen: store.Generation) -> kvlayout.PoolPlan:
    """The pool a stored generation was planned with, for the gate of its restore."""
    cfg = config.of(dict(gen.meta["config"]))
    if isinstance(cfg, config.VllmConfig):
        shape = vllm_config.ModelShape.read(cfg.model)
        return vllm_config.pool_plan(cfg, shape, _cpu_of(gen))[0]
    return cfg.pool_plan(gen.meta.get("model", {}).get("n_ctx_train"))


def _cpu_of(gen: store.Generation) -> bool:
    """Whether a vLLM generation ran vLLM's CPU build (its recorded version says so)."""
    info = gen.meta.get("vllm") or {}
    return bool(info.get("cpu")) or "+cpu" in str(info.get("version", ""))


def _need(estimate: dict[str, Any] | None) -> memory.Need:
    """The memory estimate recorded when the generation was deployed (not re-made)."""
    e = estimate or {}
    return memory.Need(
        kv=e.get("kv_bytes"),
        weights=int(e.get("weights_bytes") or 0),
        cache_ram=int(e.get("cache_ram_bytes") or 0),
        estimate=e.get("estimate"),
        unsupported=e.get("unsupported") or (None if e else "not recorded"),
    )


# -- undo and recovery: the old env file back, restarted and gated ---------------------------

#: Phases of the record before ``systemctl restart`` was asked for: the old process still
#: runs the old config, so undoing the swap is all a rollback does (nothing restarts).
#: ``bridge``, ``bridged``: the second instance serves (launcher.deploy.restart.standby), the unit
#: still runs the old config.
BEFORE_RESTART = ("begin", "stored", "bridge", "bridged", "swap", "swapped")
NOT_RESTARTED = {
    "ok": True,
    "note": "nothing was restarted (the failure came before the restart); the old env file "
    "is live and the unit is as it was before",
}


class Reverter:
    """Restores one unit's env file from the store and gets it serving again."""

    def __init__(
        self,
        st: store.Store,
        env_file: Path,
        systemd: Systemd,
        gate: Gate,
        signals: Signals,
        drain_timeout: float = 0.0,
    ) -> None:
        self.store, self.env_file, self.systemd, self.gate = st, env_file, systemd, gate
        self.signals = signals
        #: how long a recovery's restart behind a held front waits for what is in flight
        self.drain_timeout = drain_timeout

    def live_text(self) -> str | None:
        """The live env file as it is on disk: no newline translation (a CR in it is what
        the launcher refuses); bytes that are not UTF-8 (the launcher refuses them too) read
        as U+FFFD, so the file differs from any rendering (the swap's .bak keeps the bytes)."""
        try:
            return self.env_file.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return None

    def notes(self, check: bool, running: UnitState | None, identical: bool) -> list[str]:
        """What a deploy warns of before it starts: a transaction a real run reverts first,
        a stopped unit whose identical config is started again."""
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

    def deleted_live(self, warnings: list[str]) -> str | None:
        """The live env file is gone (deleted by hand): what a failure restores, the live
        generation's bytes when it is known-good (rather than leaving the unit stopped)."""
        live = self.store.live()
        if live is None or not live.good:
            return None
        warnings.append(
            f"llama-launcher: the live env file {self.env_file} is missing; if this deploy "
            f"fails, generation {live.number}'s env file is put back and started"
        )
        return live.env_text

    def argv_of(self, text: str | None) -> list[str]:
        return launch.argv_of_text(text, str(self.env_file))

    def restore_text(self, old_text: str | None, txn: dict[str, Any] | None = None) -> None:
        """The old env file back, and the front's old config the record names (``txn``)."""
        if old_text is None:
            with contextlib.suppress(FileNotFoundError):
                self.env_file.unlink()
        elif self.live_text() != old_text:
            store.swap_env(self.env_file, old_text, backup=False)
        if txn:
            Front(self.store.root, self.systemd.unit, self.systemd.scope).put_back(txn)

    def restart_old(
        self,
        number: Any,
        old_text: str | None,
        hold: Callable[[float], None] | None = None,
        running: UnitState | None = None,
    ) -> dict[str, Any]:
        """Start the restored config and gate it; never raises: the result says ``ok``.
        ``hold``: called with the restart's budget before it (a fronted unit holds).
        ``running``: the unit's start that already runs the restored config (the prestart
        step reverted before it): gated as it is, not restarted."""
        if old_text is None:
            try:
                self.systemd.stop()
                self.systemd.reset_failed()
            except LauncherError as e:
                return {"ok": False, "message": f"could not stop the unit: {e}"}
            return {"ok": True, "note": "there was no previous config; the unit is stopped"}
        plan, load = None, None
        if number:
            with contextlib.suppress(StoreError, ConfigInvalid, KeyError):
                gen = self.store.get(int(number))
                load = budgets.Load.of_meta(gen.meta)
                plan = _plan_of(gen)
        # the budget its own generation needed; the stop is a phase of its own (a hung
        # server that ignores SIGTERM takes TimeoutStopSec to go, and the start waits)
        budget = budgets.for_rollback(self.gate.waits, load)

        def reset_then_state() -> UnitState:
            self.systemd.reset_failed()
            state = self.systemd.state()
            self.systemd.cancel_auto_restart(state)  # the failed config's crash: ours restarts
            return state

        try:
            if running is not None:
                cursor, before = self._since_start(running)
            else:
                cursor, before = together(self.systemd.cursor, reset_then_state)
            if hold is not None:
                hold(budgets.restart_total(self.gate.waits, budget, before))
            if running is None:
                self.systemd.restart()
            key = keys.key_of_env(old_text, str(self.env_file))
            gate = self.gate(plan, cursor, before, key, self.argv_of(old_text), budget)
            # a start gated part-way through its load measured no load
            if number and gate.load is not None and running is None:
                self._mark(int(number), load=gate.load.to_dict())
            out: dict[str, Any] = {"ok": True, "startup": gate.startup, "timings": gate.timings}
            if running is not None:
                out["note"] = (
                    "gated the start that runs it (the unit's prestart step had put it back "
                    "before that start); not restarted"
                )
            return out
        except LauncherError as e:  # a gate, a probe, systemctl or journalctl: reported
            return {"ok": False, "message": str(e)}

    def _since_start(self, running: UnitState) -> tuple[str | None, UnitState]:
        """The journal cursor before the start ``running`` (its first line: the prestart
        step's) and the state "before" it: the gate then takes that start as the new
        process, however far its load has come."""
        cursor = self.systemd.invocation_cursor(running.invocation_id)
        return cursor, replace(running, main_pid=0, invocation_id="")

    def started_reverted(self, txn: dict[str, Any]) -> UnitState | None:
        """The unit's start that the prestart step reverted the env file for (the record
        names its invocation), while it still runs or loads; None otherwise (it is
        restarted then)."""
        invocation = txn.get("start_invocation")
        if not txn.get("reverted_at_start") or not invocation:
            return None
        try:
            state = self.systemd.state()
        except LauncherError:
            return None
        if state.invocation_id != invocation or state.active not in ("active", "activating"):
            return None
        return state

    # -- a dead deployer's transaction -----------------------------------------------------

    def recover(self) -> dict[str, Any] | None:
        """Complete or revert a transaction a dead deployer left behind, and remove the
        temporary files a killed writer left (``store.sweep_temp``)."""
        removed = self.sweep()
        txn = self.store.txn()
        if not txn:
            released = self.release_held()
            if removed:
                released["removed_temp_files"] = removed
            return released or None
        with self.signals.deferred():  # a recovery is a rollback: it is not interrupted
            report = self._recover(txn)
        self.signals.stop_if_asked()  # asked to stop during it: stop now
        if removed:
            report["removed_temp_files"] = removed
        return report

    def sweep(self) -> list[str]:
        """The folders ``store.atomic_write`` writes in for this unit: the env file's, the
        state dir, its generations and key files, the client window's folder and the
        front's (``haproxy -c``'s copies too); and the slot files a killed deploy saved, in
        the slot folders of the live generation and of an interrupted transaction's two."""
        root = self.store.root
        folders = [self.env_file.parent, root, root / "keys", root.parent, root / "front"]
        folders += [self.store.gen_dir / f"{n:04d}" for n in self.store.numbers()]
        return store.sweep_temp(folders) + store.remove_left(
            self._slot_folders(), slotsave.is_slot_file
        )

    def _slot_folders(self) -> list[Path]:
        numbers: list[Any] = [self.store.live_number()]
        with contextlib.suppress(StoreError):
            txn = self.store.txn()
            numbers += [txn.get("from"), txn.get("to")]
        folders: list[Path] = []
        for n in numbers:
            if not isinstance(n, int):
                continue
            with contextlib.suppress(StoreError):
                folder = slotsave.save_path(self.store.get(n).meta.get("config") or {})
                if folder is not None and folder not in folders:
                    folders.append(folder)
        return folders

    def release_held(self) -> dict[str, Any]:
        """No transaction to recover, but the front held (a hold recorded whose holder died
        after the transaction ended or could not release, or a front paused with no
        record): released."""
        where = (self.store.root, self.systemd.unit, self.systemd.scope)
        if not fronthold.left_held(*where):
            return {}
        return fronthold.recover(*where, {})

    def restored_or_raise(self, report: dict[str, Any] | None) -> dict[str, Any] | None:
        """``report`` of ``recover``; ``RollbackFailed`` when the restored config failed its
        gate."""
        gate = (report or {}).get("gate")
        if report is not None and gate is not None and not gate.get("ok"):
            raise RollbackFailed(
                f"restored the env file of generation {report['from']} (the deploy of "
                f"generation {report['to']} was interrupted at {report['interrupted_phase']}), "
                f"but it failed its gate: {gate.get('message')}. Nothing was deleted; read "
                f"`journalctl -u {self.systemd.unit}`, fix the cause, then run "
                "llama-launcher rollback",
                data={"recovered": report},
            )
        return report

    def _recover(self, txn: dict[str, Any]) -> dict[str, Any]:
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
            self.restore_text(old_text, txn)
            if phase not in BEFORE_RESTART:
                report["action"] = "restored the previous env file and restarted it"
                report["gate"] = self.restart_old(
                    txn.get("from"),
                    old_text,
                    lambda seconds: report.update(self._hold(seconds, old_text)),
                    self.started_reverted(txn),
                )
            else:
                report["action"] = "restored the previous env file (no restart had happened)"
            if txn.get("from") is not None:
                self.store.set_live(int(txn["from"]))
        if txn.get("to"):
            self._mark(int(txn["to"]), outcome="interrupted")
        # handover: the front pointed at the restored config, and released
        restored = bool(report.get("gate", {"ok": True}).get("ok"))
        report.update(
            fronthold.recover(
                self.store.root,
                self.systemd.unit,
                self.systemd.scope,
                txn,
                self.drain_timeout,
                restored,
            )
        )
        if not report.get("gate", {"ok": True}).get("ok") and txn.get("from") is not None:
            self._mark(int(txn["from"]), gate_failed_at=time.time())
        self.store.end()
        return report

    def _hold(self, seconds: float, old_text: str | None = None) -> dict[str, Any]:
        # handover: a recovery's restart holds the front like a deploy's, unless the second
        # instance serves the restored config meanwhile (a killed deploy's bridge)
        if bridge.bridging(self.store.root, self.systemd.unit, self.systemd.scope, old_text):
            return {"front_hold": "not held: the second instance serves this config meanwhile"}
        return fronthold.hold_front(
            self.store.root, self.systemd.unit, self.systemd.scope, seconds, self.drain_timeout
        )

    def discard(self) -> None:
        """Nothing live was touched: the record goes, a stored generation stays as a trace."""
        with self.signals.deferred(), contextlib.suppress(OSError, StoreError):
            to = self.store.txn().get("to")
            if to:
                self._mark(int(to), outcome="interrupted")
            self.store.end()

    def _mark(self, number: int, **changes: Any) -> None:
        with contextlib.suppress(StoreError):
            self.store.update(self.store.get(number), **changes)

    def _new_file_is_live(self, txn: dict[str, Any], old_text: str | None) -> bool:
        if not txn.get("to"):
            return False
        try:
            new_text = self.store.get(int(txn["to"])).env_text
            live = self.live_text()
        except (StoreError, OSError):
            return False
        return live == new_text and live != old_text

    # -- a failed deploy -------------------------------------------------------------------

    def undo(
        self,
        error: BaseException,
        gen: store.Generation,
        live_text: str | None,
        prev_number: int | None,
        result: Result,
        t0: float,
        after_restore: Callable[[bool], dict[str, Any]] | None = None,
        hold: Callable[[float], None] | None = None,
    ) -> NoReturn:
        """Restore generation ``prev_number`` after ``error``; raise ``DeployFailed`` when it
        serves again, ``RollbackFailed`` when it does not (signals are deferred by the
        caller, ``on_error``). ``after_restore`` gets whether the old config
        serves again (the handover: the front's old config, the slots, the release);
        ``hold`` is called with the restart's budget before it (the front held for it)."""
        failure = self._failure(error)
        self.gate.say("rollback")
        restarted = self._phase() not in BEFORE_RESTART
        restored = False
        try:
            self.restore_text(live_text, self._txn())
            restored = True
        except (OSError, StoreError) as e:
            # the record stays: the next invocation restores the file before anything else
            rb: dict[str, Any] = {
                "ok": False,
                "message": f"cannot write the previous env file back to {self.env_file}: "
                f"{e}; the transaction record in {self.store.root} keeps it",
            }
        else:
            rb = (
                self.restart_old(prev_number, live_text, hold) if restarted else dict(NOT_RESTARTED)
            )
        if after_restore is not None:
            result.handover = after_restore(bool(rb.get("ok")))
            # what the handover warned of (the front's restarts, a hold that failed, a front
            # left down) is the rollback's news too
            said = set(result.warnings)
            result.warnings += [w for w in result.handover.get("warnings", []) if w not in said]
        with contextlib.suppress(OSError, StoreError):
            self.store.update(gen, outcome="failed", failure=failure)
            if restored:
                self.store.end()
                if prev_number is not None:
                    self.store.set_live(prev_number)
        result.failure, result.rollback = failure, rb
        result.timings["total"] = round(time.monotonic() - t0, 3)
        exc: LauncherError
        if rb.get("ok"):
            result.outcome = "rolled_back"
            what = (
                f"generation {prev_number} is serving again"
                if live_text is not None and "note" not in rb
                else rb.get("note", "")
            )
            result.message = (
                f"generation {gen.number} failed ({failure['class']}: {failure['message']}); {what}"
            )
            exc = DeployFailed(result.say_front_down().message, result)
        else:
            result.outcome = "rollback_failed"
            if prev_number is not None:
                self._mark(prev_number, gate_failed_at=time.time())
            result.message = self._restore_failed(gen, failure, prev_number, rb, restored)
            exc = RollbackFailed(result.say_front_down().message, result)
        if self.signals.pending is not None or isinstance(error, Interrupted):
            result.message += " (interrupted by a signal)"
        raise exc

    def _txn(self) -> dict[str, Any]:
        try:
            return self.store.txn()
        except StoreError:
            return {}

    def _phase(self) -> str:
        """The phase the transaction record reached (``gate`` when it cannot be read)."""
        try:
            return str(self.store.txn().get("phase", "gate"))
        except StoreError:
            return "gate"

    def _failure(self, error: BaseException) -> dict[str, Any]:
        if isinstance(error, GateFailure):
            return error.to_dict()
        if isinstance(error, SwapFailed):
            return {"phase": "swap", "class": "swap_failed", "message": str(error), "log_tail": []}
        interrupted = isinstance(error, Interrupted)
        return {
            "phase": "interrupted" if interrupted else "gate",
            "class": "interrupted" if interrupted else type(error).__name__,
            "message": str(error),
            "log_tail": self.gate.tail(),
        }

    def _restore_failed(
        self,
        gen: store.Generation,
        failure: dict[str, Any],
        prev_number: int | None,
        rb: dict[str, Any],
        restored: bool,
    ) -> str:
        return (
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
