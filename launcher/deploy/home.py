"""One unit, one state: which state folder manages a unit, and the unit's lock.

A unit's generations, transaction record and key files live in one state folder, its home.
The env file records its home beside it, in ``<env stem>.managed.json``::

    {"state_dir": "/var/lib/llama-launcher/llama-server@chat",
     "unit": "llama-server@chat.service", "scope": "system"}

Every entry point finds the home the same way (``state_dir``): the recorded folder; a state
folder given (``--state-dir``, ``LLAMA_LAUNCHER_STATE_DIR``, settings.toml, Ansible's
``state_dir``) that is not the recorded one is refused (``StateDirMismatch``, exit 2) before
anything is read or adopted, so one unit never gets a second history. An env file without a
record (an install from before the record, or none yet) has the folder given, else the default
one, and the first command that takes the unit's lock records it (``claim``).

The lock is per unit, keyed by scope and unit name, outside every state folder, so two state
folders can never deploy one unit at once (``lock_path``)::

    system scope   /run/lock/llama-launcher/<unit>.lock
    user scope     $XDG_RUNTIME_DIR/llama-launcher/<unit>.lock  (the user manager's own folder)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from launcher.deploy import store
from launcher.errors import StateDirMismatch, StoreError
from launcher.host.units import SYSTEM_LOCK_DIR

if TYPE_CHECKING:
    from launcher.config import ToolSettings


def record_path(env_file: Path) -> Path:
    """Where the env file's home is recorded: ``chat.env`` -> ``chat.managed.json``."""
    return env_file.with_name(f"{env_file.stem}.managed.json")


def lock_path(scope: str, unit_name: str) -> Path:
    """The unit's lock file: one per (scope, unit), whatever state folder a command names."""
    name = quote(unit_name, safe="@.:_-\\") + ".lock"
    if scope == "system":
        return SYSTEM_LOCK_DIR / name
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    if os.path.isdir(runtime):
        return Path(runtime) / "llama-launcher" / name
    # no runtime folder (no login session): the user's state root, fixed per user as well
    return Path.home() / ".local/state/llama-launcher/locks" / name


def _same(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def read_record(env_file: Path) -> dict[str, Any] | None:
    """The recorded home of ``env_file`` (None when there is no record)."""
    path = record_path(env_file)
    try:
        data = store.read_json(path)
    except FileNotFoundError:
        return None
    if not isinstance(data.get("state_dir"), str) or not data["state_dir"]:
        raise StoreError(f"{path} names no state_dir; move it aside to continue")
    return data


def state_dir(settings: ToolSettings) -> Path:
    """The state folder of ``settings``' unit: the recorded one, else the one given, else the
    default. A given folder that is not the recorded one raises ``StateDirMismatch``."""
    env_file = settings.resolved_env_file()
    record = read_record(env_file)
    if record is None:
        chosen = Path(os.path.abspath(settings.state_dir or settings.default_state_dir()))
        _refuse_a_second_history(settings, env_file, chosen)
        return chosen
    recorded = Path(record["state_dir"])
    unit = record.get("unit")
    if unit and unit != settings.unit_name:
        raise StateDirMismatch(
            f"{env_file} is the env file of {unit}, not of {settings.unit_name} "
            f"(recorded in {record_path(env_file)}); pass --unit {unit}, or give "
            f"{settings.unit_name} an env file of its own with --env-file",
            given=settings.state_dir or settings.default_state_dir(),
            recorded=recorded,
            record=record_path(env_file),
        )
    if settings.state_dir is not None and not _same(settings.state_dir, recorded):
        raise _mismatch(settings, env_file, settings.state_dir, recorded)
    return recorded


def _mismatch(
    settings: ToolSettings, env_file: Path, given: Path, recorded: Path
) -> StateDirMismatch:
    record = record_path(env_file)
    return StateDirMismatch(
        f"state dir {given} does not manage {settings.unit_name}: its env file {env_file} is "
        f"managed by {recorded} (recorded in {record}). Leave the state dir out (--state-dir, "
        f"LLAMA_LAUNCHER_STATE_DIR, Ansible's llama_state_dir) or pass --state-dir {recorded}; "
        f"to move the history, move that folder and edit {record}",
        given=given,
        recorded=recorded,
        record=record,
    )


def _refuse_a_second_history(settings: ToolSettings, env_file: Path, chosen: Path) -> None:
    """An env file without a record, and a state folder given that is not the default: when the
    default folder's live generation is the live env file, the default folder is its home (an
    install from before the record) and the given one would adopt it into a second history."""
    default = Path(os.path.abspath(settings.default_state_dir()))
    if _same(chosen, default):
        return
    home = store.Store(default)
    try:
        live = home.live()
        same_text = live is not None and env_file.read_bytes() == live.env_text.encode()
    except (OSError, StoreError):
        return
    if same_text and live is not None:
        raise StateDirMismatch(
            f"state dir {chosen} does not manage {settings.unit_name}: its env file {env_file} "
            f"is generation {live.number} of {default}. Leave the state dir out (--state-dir, "
            f"LLAMA_LAUNCHER_STATE_DIR, Ansible's llama_state_dir) or pass --state-dir {default}",
            given=chosen,
            recorded=default,
            record=record_path(env_file),
        )


def claim(settings: ToolSettings, root: Path) -> None:
    """Record ``root`` as the home of the unit's env file if nothing is recorded yet.
    Called with the unit's lock held, so two first commands cannot record two homes."""
    env_file = settings.resolved_env_file()
    record = read_record(env_file)
    if record is not None:
        if not _same(Path(record["state_dir"]), root):  # recorded since this command began
            raise _mismatch(settings, env_file, root, Path(record["state_dir"]))
        return
    data = {
        "state_dir": os.path.abspath(root),
        "unit": settings.unit_name,
        "scope": settings.scope,
        "recorded": time.time(),
    }
    # 0644 like the env folder's other files: it holds paths, no secrets
    store.atomic_write(record_path(env_file), (json.dumps(data, indent=2) + "\n").encode(), 0o644)


def where(settings: ToolSettings) -> list[str]:
    """The settings options that name this unit's files, for a command another unit runs
    (the words; a unit's text quotes each)."""
    return [
        "--unit",
        settings.unit_name,
        "--scope",
        settings.scope,
        "--env-file",
        str(settings.resolved_env_file()),
        "--state-dir",
        str(state_dir(settings)),
    ]
