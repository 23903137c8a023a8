"""The unit's ExecStartPre: before every start, put the env file back on a whole, known-good
generation if a deployer died half-way, and stage the API key for ``LoadCredential=``.

``llama-launcher prestart --env-file PATH --state-dir DIR [--stage-key PATH]`` runs with
full privileges (``ExecStartPre=+``) on every start, a boot included. A transaction record
(``txn.json``) whose lock nobody holds means the deployer is gone: a reboot between a killed
deploy and the next command would otherwise start the half-done config without its gate.
The record's previous env file is restored (atomically, owner and mode kept), and the
front's previous config if the record names one; the record stays, so the next
``llama-launcher`` command finishes the recovery (generation outcomes, the live pointer) and
gates the restored config. A fronted unit's requests are held meanwhile: the hold is
recorded (``launcher.deploy.restart.front``), so the front's release watcher takes the lock as soon
as this step lets go of it, recovers (the restart held, the gate) and releases. A held lock
means a deploy is running and restarting the unit itself: it is left alone.

Like ``launcher.host.launch`` this is on the path of every server start: standard library and
the tool's own modules that load only the standard library (the test of the package's
layout walks them).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.deploy import store
from launcher.deploy.restart import front
from launcher.errors import StoreError
from launcher.host import envfile

_USAGE = (
    "usage: llama-launcher prestart --env-file PATH --state-dir DIR [--lock PATH] "
    "[--stage-key PATH]"
)


class PrestartError(Exception):
    """The unit must not start (exit status 78, which the units do not restart)."""


def _say(message: str) -> None:
    print(f"llama-launcher: {message}", file=sys.stderr, flush=True)


def revert_pending(env_file: Path, state_dir: Path, lock: Path | None = None) -> str | None:
    """Restore the env file a dead deployer's transaction replaced; what was done, or None.
    ``lock``: the unit's deploy lock (``launcher.deploy.home.lock_path``; the unit renders it)."""
    txn_path = state_dir / "txn.json"
    if not txn_path.exists():
        return None
    lock = lock or state_dir / "lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise PrestartError(f"cannot open {lock}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return None  # a live deployer restarts the unit inside its transaction
            raise
        return _revert_locked(env_file, txn_path)
    finally:
        os.close(fd)


def hold_front(state_dir: Path, txn: dict[str, Any]) -> str:
    """The front's previous config back (the record names it) and its requests held for
    the recovery the release watcher runs next, for the budget the deploy recorded; what
    was done."""
    old = txn.get("front")
    if not isinstance(old, dict) or not old.get("unit"):
        return ""
    the_front = front.Front(state_dir, str(old["unit"]), "system")
    budget = txn.get("budget")
    try:
        the_front.put_back(txn)
        if not isinstance(budget, int | float) or isinstance(budget, bool):
            return (
                "; the front's previous config is back; the record names no budget (every "
                "deploy writes one), so requests are not held"
            )
        hold = the_front.mark_held(float(budget))
    except (OSError, StoreError) as e:
        return f"; the front's config could not be put back ({e}): requests are not held"
    try:
        the_front.pause(hold)
    except front.FrontError:
        return "; the front's previous config is back; HAProxy is down (its watcher pauses it)"
    return "; the front's previous config is back and its requests are held until the gate"


def _revert_locked(env_file: Path, txn_path: Path) -> str | None:
    try:
        txn = json.loads(txn_path.read_text())
    except FileNotFoundError:
        return None  # finished while we waited
    except (OSError, ValueError) as e:
        raise PrestartError(
            f"cannot read the transaction record {txn_path}: {e}; run llama-launcher recover"
        ) from None
    old_text = txn.get("old_text")
    what = f"the deploy of generation {txn.get('to')} was interrupted at {txn.get('phase')}"
    if old_text is None:
        raise PrestartError(
            f"{what} and there is no earlier config to start; run llama-launcher recover, "
            "then install or deploy again"
        )
    try:
        live = env_file.read_bytes().decode("utf-8", "replace")
    except FileNotFoundError:
        live = None
    reverted = live != old_text
    if reverted:
        store.swap_env(env_file, str(old_text), backup=False)
    # this start runs the previous config: the recovery gates this process (systemd names
    # its start INVOCATION_ID) instead of restarting it, which would load the model twice
    started = {
        **txn,
        "reverted_at_start": True,
        "start_invocation": os.environ.get("INVOCATION_ID"),
    }
    store.atomic_write(txn_path, (json.dumps(started, indent=2) + "\n").encode())
    # the front's config too, also when the env file was already the old one (an undo
    # killed between putting the env file back and the front's config)
    held = hold_front(txn_path.parent, txn)
    if not reverted:
        return f"{what}; the env file is the previous one already{held}" if held else None
    return (
        f"{what}; restored the env file of generation {txn.get('from')} before starting "
        f"(the next llama-launcher command finishes the recovery and gates it){held}"
    )


def stage_key(env_file: Path, stage: Path) -> None:
    """Copy the key named by the env file's API_KEY_FILE to ``stage`` (root only; empty
    when there is none), the source of the unit's ``LoadCredential=api-key:``."""
    key = b""
    try:
        values = envfile.parse(env_file.read_text(encoding="utf-8"), str(env_file))
    except (OSError, UnicodeDecodeError, envfile.EnvFileError):
        values = {}  # `exec` reports what is wrong with the env file itself
    if values.get("API_KEY_FILE"):
        path = values["API_KEY_FILE"]
        try:
            key = Path(path).read_bytes()
        except OSError as e:
            raise PrestartError(
                f"{env_file}: cannot read API_KEY_FILE={path}: {e.strerror}; "
                "fix the path or deploy a config with another api_key_file"
            ) from None
    try:
        same = stage.read_bytes() == key
    except FileNotFoundError:
        same = False
    if not same:
        store.atomic_write(stage, key, 0o600, durable=False)
    os.chmod(stage, 0o600)


def _parse_args(args: Sequence[str]) -> dict[str, str]:
    opts: dict[str, str] = {}
    it = iter(args)
    for a in it:
        name, eq, value = a.partition("=")
        if name not in ("--env-file", "--state-dir", "--lock", "--stage-key"):
            raise PrestartError(f"unexpected argument {a!r}; {_USAGE}")
        opts[name] = value if eq else next(it, "")
    if not opts.get("--env-file") or not opts.get("--state-dir"):
        raise PrestartError(f"--env-file and --state-dir are required; {_USAGE}")
    return opts


def main(args: Sequence[str]) -> int:
    """Entry point of ``llama-launcher prestart``."""
    try:
        opts = _parse_args(args)
        env_file = Path(opts["--env-file"])
        lock = Path(opts["--lock"]) if opts.get("--lock") else None
        done = revert_pending(env_file, Path(opts["--state-dir"]), lock)
        if done:
            _say(done)
        if opts.get("--stage-key"):
            stage_key(env_file, Path(opts["--stage-key"]))
    except (PrestartError, OSError, StoreError) as e:  # SwapFailed: a read-only /etc
        _say(f"cannot start: {e}")
        return envfile.EX_CONFIG
    return 0
