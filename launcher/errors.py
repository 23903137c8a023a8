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
    ├── Superseded                     a revert whose generation a deploy replaced first
    ├── DeployFailed                   exit 3: the new config failed, the old one serves again
    └── RollbackFailed                 exit 4: the old config failed as well; nothing was deleted
    Interrupted (a BaseException)      exit 128+signal: SIGINT/SIGTERM/SIGHUP before it went live

Every message names the value at fault and the fix; every class says what to do in ``fix``
(the error reference is made from the tree). Causes are chained with ``raise ... from``.
The exit statuses are ``EXIT_CODES``; a verb's outcome that is no error maps through
``OUTCOME_EXIT``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Every exit status of llama-launcher and what it means (``--help`` and the exit code
#: reference are made from it).
EXIT_CODES: tuple[tuple[str, str], ...] = (
    ("0", "success (changed or not)"),
    ("1", "other error"),
    ("2", "invalid input: nothing was changed"),
    (
        "3",
        "deploy failed: the previous config was restored and serves again (a failed first"
        " "
        "install: the unit is left stopped)",
    ),
    ("4", "rollback failed: both configs failed; nothing was deleted"),
    ("5", "lock timeout: another deploy holds the unit's lock"),
    (
        "6",
        "reverted: the new config passed the gate, but its bake found it worse under "
        "load; "
        "the previous config serves again (--wait, or a failure in the deploy's own last "
        "moments)",
    ),
    (
        "7",
        "revert failed: the bake found the new config worse under load, but its "
        "revert did not put the previous one back; the new config serves still (--wait, "
        "or a failure in the deploy's own last moments)",
    ),
    ("78", "exec only: the env file or its values are refused (systemd does not restart)"),
    ("128+signal", "SIGINT/SIGTERM/SIGHUP before the change went live (130, 143, 129)"),
    ("141", "the reader of the output went away (a closed pipe)"),
)
#: A verb's outcome -> its exit status, where the outcome is a result and not an error (the
#: errors carry theirs: ``exit_code``).
OUTCOME_EXIT = {"reverted": 6, "rollback_failed": 4, "revert_failed": 7}


class LauncherError(Exception):
    """Root of every error llama-launcher raises on purpose."""

    fix = "read the message: it names what failed and what to do; --json gives the details"

    exit_code = 1

    def details(self) -> dict[str, Any]:
        """Machine-readable extras for ``--json`` output."""
        return {}


class InvalidInput(LauncherError):
    """The input is wrong; nothing on the host was changed."""

    fix = "change the value the message names; nothing on the host was changed"

    exit_code = 2


class ConfigInvalid(InvalidInput):
    """A value of the typed config or the tool settings is invalid."""

    fix = "give a valid value: the message quotes the bad one and shows a good one"


class StateDirMismatch(ConfigInvalid):
    """The state dir given is not the one recorded as the home of the unit's env file."""

    fix = (
        "give the state folder the message names as the unit's (or none: it is read from the "
        "record beside the env file)"
    )

    def __init__(self, message: str, given: object, recorded: object, record: object) -> None:
        self.given, self.recorded, self.record = str(given), str(recorded), str(record)
        super().__init__(message)

    def details(self) -> dict[str, Any]:
        return {"state_dir": self.given, "recorded_state_dir": self.recorded, "record": self.record}


class ValidationFailed(InvalidInput):
    """A step of the validation chain failed on the rendered file."""

    fix = (
        "fix what the named step says (the env file, the binary, the model, a file the "
        "service cannot read, the port)"
    )

    def __init__(self, step: str, message: str) -> None:
        self.step = step
        super().__init__(f"validation step '{step}' failed: {message}")

    def details(self) -> dict[str, Any]:
        return {"step": self.step}


class OvercommitError(InvalidInput):
    """Under a unified pool, n_slots x n_ctx_slot exceeds the pool: requests fail with
    "Context size has been exceeded" when the slots fill up together."""

    fix = (
        "cap the slots and size the pool for all of them (the message gives the set line), "
        "split the pool, or accept the risk with --allow-overcommit (and a --bake)"
    )


class MemoryGuardError(InvalidInput):
    """The config's memory estimate exceeds what the box can give."""

    fix = (
        "choose a smaller config (fewer slots, a smaller window, a q8_0 cache: llama-launcher"
        " plan), free memory, or --force-memory"
    )


class CommandError(LauncherError):
    """A subprocess exited non-zero or could not run."""

    fix = "read the command's stderr tail in the message; run it by hand to see more"

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

    fix = "the command hung: look at the host's load and the named command"


class SystemdError(LauncherError):
    """systemd did something the tool cannot work with."""

    fix = (
        "check that systemd runs and the unit is installed (systemctl status; llama-launcher "
        "install)"
    )


class ProbeError(LauncherError):
    """llama-server did not answer the probe as it should."""

    fix = "the server did not answer as expected: llama-launcher status, and the unit's journal"


class Unreadable(ProbeError):
    """One source of a live sample could not be read: the server is down or loading, an
    endpoint is off (501), a build lacks a field, a process is gone. ``source`` names it;
    the message says why and, where there is one, the fix. A sample records it and goes on
    with the other sources."""

    fix = (
        "the sampler records it and goes on; fix the named source (the server down, an "
        "endpoint turned off, a build without the field)"
    )

    def __init__(self, source: str, message: str, status: int | None = None) -> None:
        self.source, self.status = source, status
        super().__init__(message)

    def details(self) -> dict[str, Any]:
        return {"source": self.source, "status": self.status}


class GateFailure(LauncherError):
    """The gate refused the running config. Carries the phase, a class and the log tail."""

    fix = (
        "the deploy rolled back by itself; the failure's phase, class and log tail say why "
        "the new config did not serve"
    )

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

    fix = (
        "the message names the path: free space, fix its permissions, or move a damaged file aside"
    )


class SwapFailed(StoreError):
    """The live env file's folder cannot be written: the swap did not happen, the old file is
    live, whole, and nothing was restarted."""

    fix = (
        "make the env file's folder writable (or free space) and deploy again; the old file "
        "is live and nothing restarted"
    )

    def __init__(self, message: str, env_file: object) -> None:
        self.env_file = str(env_file)
        super().__init__(message)

    def details(self) -> dict[str, Any]:
        return {"env_file": self.env_file}


class LockTimeout(LauncherError):
    """Another deploy holds the unit's lock."""

    fix = (
        "another deploy of the unit runs: wait for it (llama-launcher status shows it), or "
        "raise --lock-timeout"
    )

    exit_code = 5


class Superseded(LauncherError):
    """A revert found the generation it was to replace replaced already (a deploy or a
    rollback came first): it changed nothing."""

    fix = "nothing to do: the live generation is newer than the one the bake watched"


class DeployFailed(LauncherError):
    """The new config failed its gate; the previous generation was restored and is healthy."""

    fix = "the previous config serves again; fix what the failure names and deploy again"

    exit_code = 3

    def __init__(self, message: str, result: Any = None) -> None:
        self.result = result
        super().__init__(message)


class RollbackFailed(LauncherError):
    """The restore failed too. Nothing was deleted; the message says what was tried."""

    fix = (
        "neither config serves: llama-launcher history and the unit's journal; roll back to a"
        " generation that served (rollback --to N) or deploy a config that does"
    )

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
