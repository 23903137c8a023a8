"""First deployment on a host (``install``) and its reverse (``uninstall``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher import config, home, units
from launcher.deploy import Deployer
from launcher.errors import ConfigInvalid, LauncherError
from launcher.gate import Progress
from launcher.result import Result
from launcher.systemd import Systemd
from launcher.window import client_window_path


def install(
    settings: config.ToolSettings,
    cfg: config.ServerConfig,
    template: bool = False,
    progress: Progress | None = None,
    systemd: Systemd | None = None,
    force_memory: bool = False,
    on_phase: Callable[[str], None] | None = None,
) -> Result:
    """Install the unit, create folders with safe modes, enable it, deploy through the gate.

    A failed first deploy leaves the unit stopped (and says why); on a host that already
    serves a config, a failed deploy leaves that config serving (the deployer rolls back).
    """
    env_file = settings.resolved_env_file()
    unit_dir = settings.resolved_unit_dir()
    if template:
        _check_template(settings, env_file, unit_dir)
    env_file.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    state_dir = settings.resolved_state_dir()
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(state_dir, 0o700)
    unit_dir.mkdir(parents=True, exist_ok=True)
    if template:
        unit_file = unit_dir / "llama-server@.service"
        text = units.render(
            *units.this_python(), str(env_file.parent / "%i.env"), settings.scope, template=True
        )
    else:
        unit_file = unit_dir / settings.unit_name
        text = units.render(*units.this_python(), str(env_file), settings.scope)
    if not unit_file.exists() or unit_file.read_text() != text:
        unit_file.write_text(text)
    systemd = systemd or Systemd(settings.unit_name, settings.scope)
    systemd.daemon_reload()
    systemd.enable()
    deployer = Deployer(settings, systemd, progress, force_memory, on_phase)
    # no stop on failure here: with no previous config the rollback stops the unit itself,
    # and with one it serves that config again
    return deployer.deploy(cfg, origin="install")


def _check_template(settings: config.ToolSettings, env_file: Path, unit_dir: Path) -> None:
    """The template unit reads <folder>/%i.env for every instance: the env file must be
    named after the instance, in the folder the installed template already uses."""
    instance = settings.env_name
    if env_file.name != f"{instance}.env":
        raise ConfigInvalid(
            f"--env-file {env_file}: llama-server@{instance}.service reads "
            f"{env_file.parent / (instance + '.env')} (the template unit reads %i.env); "
            "name the file after the instance or leave --env-file out"
        )
    unit_file = unit_dir / "llama-server@.service"
    if unit_file.exists() and f"--env-file {env_file.parent}/%i.env" not in unit_file.read_text():
        raise ConfigInvalid(
            f"{unit_file} already reads the env files of its instances from another folder "
            f"than {env_file.parent}; every instance shares it: put {env_file.name} in that "
            "folder (leave --env-file out)"
        )


def uninstall(
    settings: config.ToolSettings, purge: bool = False, systemd: Systemd | None = None
) -> dict[str, Any]:
    systemd = systemd or Systemd(settings.unit_name, settings.scope)
    state = settings.resolved_state_dir()  # before the record beside the env file goes
    done: dict[str, Any] = {}
    try:
        systemd.stop()
        done["stopped"] = settings.unit_name
    except LauncherError as e:
        done["stop_error"] = str(e)
    systemd.disable()
    unit_file = settings.resolved_unit_dir() / settings.unit_name
    if unit_file.exists():
        unit_file.unlink()
        done["removed_unit"] = str(unit_file)
    env_file = settings.resolved_env_file()
    for f in (
        env_file,
        env_file.with_name(env_file.name + ".bak"),
        client_window_path(env_file),
        # the record of the unit's home stays with kept generations: a reinstall goes on there
        *([home.record_path(env_file)] if purge else []),
    ):
        if f.exists():
            f.unlink()
            done.setdefault("removed", []).append(str(f))
    if purge and state.exists():
        shutil.rmtree(state)
        done["purged"] = str(state)
    else:
        done["kept_generations"] = str(state)
    systemd.daemon_reload()
    systemd.reset_failed()
    return done
