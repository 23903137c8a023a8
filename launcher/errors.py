"""The one exception tree of llama-launcher. The CLI maps each leaf to an exit code.

::

    LauncherError                      exit 1 unless a leaf says otherwise
    ├── InvalidInput                   exit 2: nothing was changed
    │   ├── ConfigInvalid              a value of the typed config (names field, value, fix)
    │   │   └── StateDirMismatch       a state dir that is not the one managing the unit
    │   ├── ValidationFailed           a named step of the validation chain failed
    │   ├── OvercommitError            a shared KV pool that can be over-committed
    │   └── MemoryGuardError           the estimate does not fit the box
    ├── CommandError                   a subprocess failed (argv, status, stderr tail)
    │   └── CommandTimeout
    ├── SystemdError                   systemctl/journalctl said something unexpected
    ├── ProbeError                     the HTTP probe of llama-server failed
    │   └── Unreadable                 a source the sampler reads (/slots, /metrics, /proc,
    │                                  the journal) said nothing usable; names it and why
    ├── GateFailure                    the restarted unit failed the gate (phase, class, log)
    ├── EstimateUnsupported            (kvbytes) a model whose KV cache the estimator cannot size
    ├── StoreError                     the generation store cannot be read or written (names
    │   │                              the path and the fix)
    │   └── SwapFailed                 the live env file could not be replaced: the old one stays
    ├── LockTimeout                    exit 5: another deploy holds the lock
    ├── DeployFailed                   exit 3: the new config failed, the old one serves again
    └── RollbackFailed                 exit 4: the old config failed as well; nothing was deleted
    Interrupted (a BaseException)      exit 128+signal: SIGINT/SIGTERM/SIGHUP before it went live

Every message names the value at fault and the fix. Causes are chained with ``raise ... from``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class LauncherError(Exception):
    """Root of every error llama-launcher raises on purpose."""

    exit_code = 1

    def details(self) -> dict[str, Any]:
        """Machine-readable extras for ``--json`` output."""
        return {}


class InvalidInput(LauncherError):
    """The input is wrong; nothing on the host was changed."""

    exit_code = 2


class ConfigInvalid(InvalidInput):
    """A value of the typed config or the tool settings is invalid."""


class StateDirMismatch(ConfigInvalid):
    """The state dir given is not the one recorded as the home of the unit's env file."""

    def __init__(self, message: str, given: object, recorded: object, record: object) -> None:
        self.given, self.recorded, self.record = str(given), str(recorded), str(record)
        super().__init__(message)

    def details(self) -> dict[str, Any]:
        return {"state_dir": self.given, "recorded_state_dir": self.recorded, "record": self.record}


class ValidationFailed(InvalidInput):
    """A step of the validation chain failed on the rendered file."""

    def __init__(self, step: str, message: str) -> None:
        self.step = step
        super().__init__(f"validation step '{step}' failed: {message}")

    def details(self) -> dict[str, Any]:
        return {"step": self.step}


class OvercommitError(InvalidInput):
    """Under a unified pool, n_slots x n_ctx_slot exceeds the pool: requests fail with
    "Context size has been exceeded" when the slots fill up together."""


class MemoryGuardError(InvalidInput):
    """The config's memory estimate exceeds what the box can give."""


class CommandError(LauncherError):
    """A subprocess exited non-zero or could not run."""

    def __init__(
        self, argv: Sequence[str], status: int | None, stderr: str, note: str = ""
    ) -> None:
        self.argv = list(argv)
        self.status = status
        self.stderr = stderr
        tail = "\n".join(stderr.strip().splitlines()[-10:])
        what = f"exited with status {status}" if status is not None else "could not run"
        msg = f"command {' '.join(self.argv)!s} {what}"
        if note:
            msg += f" ({note})"
        if tail:
            msg += f":\n{tail}"
        super().__init__(msg)

    def details(self) -> dict[str, Any]:
        return {"argv": self.argv, "status": self.status, "stderr_tail": self.stderr[-2000:]}


class CommandTimeout(CommandError):
    """A subprocess did not finish within its timeout."""


class SystemdError(LauncherError):
    """systemd did something the tool cannot work with."""


class ProbeError(LauncherError):
    """llama-server did not answer the probe as it should."""


class Unreadable(ProbeError):
    """One source of a live sample could not be read: the server is down or loading, an
    endpoint is off (501), a build lacks a field, a process is gone. ``source`` names it;
    the message says why and, where there is one, the fix. A sample records it and goes on
    with the other sources."""

    def __init__(self, source: str, message: str, status: int | None = None) -> None:
        self.source, self.status = source, status
        super().__init__(message)

    def details(self) -> dict[str, Any]:
        return {"source": self.source, "status": self.status}


class GateFailure(LauncherError):
    """The gate refused the running config. Carries the phase, a class and the log tail."""

    def __init__(self, phase: str, kind: str, message: str, log_tail: list[str]) -> None:
        self.phase, self.kind, self.log_tail = phase, kind, log_tail
        super().__init__(message)

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "class": self.kind,
            "message": str(self),
            "log_tail": self.log_tail[-20:],
        }


class StoreError(LauncherError):
    """The generation store is unreadable or inconsistent."""


class SwapFailed(StoreError):
    """The live env file's folder cannot be written: the swap did not happen, the old file is
    live, whole, and nothing was restarted."""

    def __init__(self, message: str, env_file: object) -> None:
        self.env_file = str(env_file)
        super().__init__(message)

    def details(self) -> dict[str, Any]:
        return {"env_file": self.env_file}


class LockTimeout(LauncherError):
    """Another deploy holds the unit's lock."""

    exit_code = 5


class DeployFailed(LauncherError):
    """The new config failed its gate; the previous generation was restored and is healthy."""

    exit_code = 3

    def __init__(self, message: str, result: Any = None) -> None:
        self.result = result
        super().__init__(message)


class RollbackFailed(LauncherError):
    """The restore failed too. Nothing was deleted; the message says what was tried."""

    exit_code = 4

    def __init__(
        self, message: str, result: Any = None, data: dict[str, Any] | None = None
    ) -> None:
        self.result = result
        self.data = data or {}
        super().__init__(message)

    def details(self) -> dict[str, Any]:
        return self.data


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived during a transaction. Inside the risky part the
    deployer rolls back and reports; raised out of it (validation, storing the generation),
    nothing live was changed. A BaseException, so ``except Exception`` cannot swallow it."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
