"""First deployment on a host (``install``) and its reverse (``uninstall``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from launcher import config, front, units
from launcher.deploy import Deployer, Progress, Result, client_window_path
from launcher.errors import ConfigInvalid, LauncherError
from launcher.systemd import Systemd

#: The fronts ``install --front`` knows.
FRONTS = ("none", "haproxy")


def install(
    settings: config.ToolSettings,
    cfg: config.ServerConfig,
    template: bool = False,
    progress: Progress | None = None,
    systemd: Systemd | None = None,
    force_memory: bool = False,
    front_kind: str = "none",
) -> Result:
    """Install the unit, create folders with safe modes, enable it, deploy through the gate.

    A failed first deploy leaves the unit stopped (and says why); on a host that already
    serves a config, a failed deploy leaves that config serving (the deployer rolls back).
    With the setting ``carry_slots``, the deploy gives the config ``--slot-save-path
    STATE_DIR/slots`` unless it names one (``handover.with_slot_dir``).
    ``front_kind="haproxy"``: HAProxy holds the config's address and llama-server moves to a
    private one (``launcher.front``).
    """
    if front_kind not in FRONTS:
        raise ConfigInvalid(
            f"--front {front_kind!r} is not a front; use one of {', '.join(FRONTS)}"
        )
    env_file = settings.resolved_env_file()
    unit_dir = settings.resolved_unit_dir()
    if template:
        _check_template(settings, env_file, unit_dir)
    env_file.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    state_dir = settings.resolved_state_dir()
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(state_dir, 0o700)
    the_front = front.Front(state_dir, settings.unit_name)
    spec = the_front.spec()
    if front_kind == "haproxy":
        spec = _front_spec(cfg, spec)
        # llama-server listens on the private address; the front holds the config's one
        cfg = cfg.model_copy(update={"host": spec.private_host, "port": spec.private_port})
    elif spec is not None:
        cfg = cfg.model_copy(update={"host": spec.private_host, "port": spec.private_port})
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
    deployer = Deployer(settings, systemd, progress)
    deployer.force_memory = force_memory
    # no stop on failure here: with no previous config the rollback stops the unit itself,
    # and with one it serves that config again
    result = deployer.deploy(cfg, origin="install")
    if front_kind == "haproxy" and spec is not None:
        slots = int((result.planned or {}).get("n_slots") or 1)
        result.handover = {
            **(result.handover or {}),
            "front": install_front(the_front, spec, slots, settings.scope, unit_dir),
        }
    return result


def _front_spec(cfg: config.ServerConfig, old: front.FrontSpec | None) -> front.FrontSpec:
    """The config's address becomes the public one; the private one is kept across
    re-installs (the server may be listening on it)."""
    host = "127.0.0.1"
    if old is not None and (old.public_host, old.public_port) == (cfg.host, cfg.port):
        return old
    if old is not None:
        return front.FrontSpec(cfg.host, cfg.port, old.private_host, old.private_port)
    return front.FrontSpec(cfg.host, cfg.port, host, front.free_port(host))


def install_front(
    the_front: front.Front,
    spec: front.FrontSpec,
    slots: int,
    scope: str,
    unit_dir: Path,
) -> dict[str, Any]:
    """HAProxy's config (validated, swapped), its socket and service units, started."""
    text = the_front.render(spec, slots)
    the_front.validate(text, spec)
    changed = the_front.live_text() != text
    the_front.swap(text)
    the_front.save_spec(spec)
    (unit_dir / the_front.socket_unit).write_text(the_front.socket_text(spec))
    (unit_dir / the_front.service).write_text(the_front.service_text(spec))
    sock = Systemd(the_front.socket_unit, "user" if scope == "user" else "system")
    service = Systemd(the_front.service, sock.scope)
    sock.daemon_reload()
    sock.enable()
    sock.run([*sock_ctl(sock), "start", "--", the_front.socket_unit], timeout=60, env=sock.env)
    verb = "restart" if changed else "start"
    service.run([*sock_ctl(service), verb, "--", the_front.service], timeout=60, env=service.env)
    return {
        "kind": "haproxy",
        "public": f"{spec.public_host}:{spec.public_port}",
        "private": f"{spec.private_host}:{spec.private_port}",
        "units": [the_front.socket_unit, the_front.service],
        "config": str(the_front.config_path),
    }


def sock_ctl(systemd: Systemd) -> list[str]:
    return ["systemctl", *(["--user"] if systemd.scope == "user" else [])]


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
    ):
        if f.exists():
            f.unlink()
            done.setdefault("removed", []).append(str(f))
    state = settings.resolved_state_dir()
    done.update(_uninstall_front(settings, systemd))
    if purge and state.exists():
        shutil.rmtree(state)
        done["purged"] = str(state)
    else:
        done["kept_generations"] = str(state)
    systemd.daemon_reload()
    systemd.reset_failed()
    return done


def _uninstall_front(settings: config.ToolSettings, systemd: Systemd) -> dict[str, Any]:
    the_front = front.Front(settings.resolved_state_dir(), settings.unit_name)
    unit_dir = settings.resolved_unit_dir()
    files = [unit_dir / the_front.service, unit_dir / the_front.socket_unit]
    if not any(f.exists() for f in files):
        return {}
    for unit in (the_front.service, the_front.socket_unit):
        systemd.run(
            [*sock_ctl(systemd), "disable", "--now", "--", unit], check=False, env=systemd.env
        )
    for f in files:
        f.unlink(missing_ok=True)
    the_front.spec_path.unlink(missing_ok=True)
    return {"removed_front": [str(f) for f in files]}
