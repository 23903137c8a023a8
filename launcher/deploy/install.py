"""First deployment on a host (``install``) and its reverse (``uninstall``)."""

from __future__ import annotations

import dataclasses
import grp
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher import config
from launcher.deploy import front, home, store
from launcher.deploy.gate import Progress
from launcher.deploy.result import Result
from launcher.deploy.transaction import Deployer
from launcher.deploy.window import client_window_path
from launcher.errors import ConfigInvalid, LauncherError
from launcher.host import service, timer, units
from launcher.host.systemd import Systemd


def site_for(
    read_only_paths: tuple[Path, ...] = (),
    memory_deny_write_execute: bool = True,
    nice: bool = False,
) -> units.Site:
    """The hardened unit's site settings: the GPU groups this host has (a group systemd
    cannot find fails the unit), and the operator's choices."""
    for p in read_only_paths:
        if not p.is_absolute() or not p.is_dir():
            raise ConfigInvalid(
                f"--read-only-path {p}: give an existing folder as an absolute path"
            )
    groups = []
    for g in units.GPU_GROUPS:
        try:
            grp.getgrnam(g)
            groups.append(g)
        except KeyError:
            pass
    return units.Site(
        groups=tuple(groups),
        read_only_paths=tuple(str(p) for p in read_only_paths),
        memory_deny_write_execute=memory_deny_write_execute,
        nice=nice,
    )


def require_root(settings: config.ToolSettings) -> None:
    """System scope writes /etc and /var/lib and talks to PID 1: root only (exit 2)."""
    if settings.scope == "system" and os.geteuid() != 0:
        raise ConfigInvalid(
            "--scope system needs root: the unit lives in /etc/systemd/system, the env file "
            "in /etc/llama-launcher and the generations in /var/lib/llama-launcher; run it "
            "with sudo, or use --scope user for a server under your own systemd manager"
        )


def require_linger(settings: config.ToolSettings) -> None:
    """A user unit stops at logout and does not start at boot unless the user lingers."""
    if settings.scope != "user":
        return
    uid = os.geteuid()
    # only the manager logind starts (user@UID.service) ends with the last session; a
    # private one (the tests' sandbox) has another runtime folder
    if os.environ.get("XDG_RUNTIME_DIR", f"/run/user/{uid}") != f"/run/user/{uid}":
        return
    import pwd

    user = pwd.getpwuid(uid).pw_name
    if not Path(f"/var/lib/systemd/linger/{user}").exists():
        raise ConfigInvalid(
            f"user scope without linger: systemd stops llama-server when {user}'s last "
            "session ends (logout) and does not start it at boot. Run "
            f"`loginctl enable-linger {user}` first, or install in system scope as root"
        )


def _unit_text(
    settings: config.ToolSettings, env_file: Path, template: bool, site: units.Site | None
) -> tuple[Path, str]:
    unit_dir = settings.resolved_unit_dir()
    state_dir = home.state_dir(settings)
    python, package_dir = units.this_python()
    if settings.scope == "system":
        python = _service_python(python, site)
        site = _with_package(site or site_for(), package_dir)
    if template:
        return unit_dir / "llama-server@.service", units.render(
            python,
            package_dir,
            str(env_file.parent / "%i.env"),
            settings.scope,
            template=True,
            state_dir=_template_state_dir(settings),
            site=site,
        )
    return unit_dir / settings.unit_name, units.render(
        python, package_dir, str(env_file), settings.scope, state_dir=str(state_dir), site=site
    )


def _with_package(site: units.Site, package_dir: str) -> units.Site:
    """A launcher package under /tmp or /var/tmp (a checkout there) is hidden from the
    service by its private /tmp: bind it in read-only, as --read-only-path would."""
    hidden = any(Path(package_dir).is_relative_to(d) for d in ("/tmp", "/var/tmp"))
    if not hidden or package_dir in site.read_only_paths:
        return site
    return dataclasses.replace(site, read_only_paths=(*site.read_only_paths, package_dir))


def _service_python(python: str, site: units.Site | None) -> str:
    """An interpreter the service's own user can execute: the one running install (a venv
    works), else the system's. ``exec`` and ``prestart`` need only the standard library."""
    groups = site.groups if site else ()
    for candidate in (python, units.DEFAULT_PYTHON):
        if Path(candidate).exists() and service.can_run(candidate, groups):
            return candidate
    raise ConfigInvalid(
        f"the service's user cannot execute {python} (a folder on its way is closed to "
        f"other users, e.g. a pyenv under /root) and {units.DEFAULT_PYTHON} is missing; "
        "install python3 (apt-get install python3) or run install from a Python every "
        "user may execute"
    )


def write_unit(unit_file: Path, text: str, force: bool = False) -> bool:
    """Write the unit atomically; refuse to replace a hand-edited one unless ``force``.
    Returns whether the file changed."""
    text = units.stamp(text)
    try:
        current = unit_file.read_text()
    except FileNotFoundError:
        current = None
    if current == text:
        return False
    if current is not None and units.hand_edited(current) and not force:
        raise ConfigInvalid(
            f"{unit_file} was edited by hand (or not written by llama-launcher); install "
            f"would replace it and lose the edit. Put site changes in a drop-in "
            f"(systemctl edit {unit_file.name}) and run install --force to replace the file"
        )
    store.atomic_write(unit_file, text.encode(), 0o644)
    return True


#: The fronts ``install --front`` knows.
FRONTS = ("none", "haproxy")


def install(
    settings: config.ToolSettings,
    cfg: config.ServerConfig,
    template: bool = False,
    progress: Progress | None = None,
    systemd: Systemd | None = None,
    force_memory: bool = False,
    on_phase: Callable[[str], None] | None = None,
    force: bool = False,
    site: units.Site | None = None,
    front_kind: str = "none",
) -> Result:
    """Install the unit, create folders with safe modes, enable it, deploy through the gate.

    A failed first deploy leaves the unit stopped (and says why); on a host that already
    serves a config, a failed deploy leaves that config serving (the deployer rolls back).
    With the setting ``carry_slots`` (on by default), the deploy gives the config a
    ``--slot-save-path`` the service can write unless it names one (``handover.slot_folder``:
    ``STATE_DIR/slots``; in system scope the unit's ``StateDirectory=``).
    ``front_kind="haproxy"``: HAProxy holds the config's address and llama-server moves to a
    private one (``launcher.deploy.front``).
    Nothing is changed when the input is refused (a hand-edited unit without ``force``,
    system scope without root, user scope without linger).
    """
    if front_kind not in FRONTS:
        raise ConfigInvalid(
            f"--front {front_kind!r} is not a front; use one of {', '.join(FRONTS)}"
        )
    require_root(settings)
    require_linger(settings)
    env_file = settings.resolved_env_file()
    if template:
        _check_template(settings, env_file, settings.resolved_unit_dir())
    unit_file, text = _unit_text(settings, env_file, template, site or site_for())
    if unit_file.exists() and units.hand_edited(unit_file.read_text()) and not force:
        write_unit(unit_file, text)  # raises, before any folder is made
    env_file.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    state_dir = home.state_dir(settings)
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
    stage = Path(units.key_stage_path(str(state_dir)))
    if settings.scope == "system" and not stage.exists():
        store.atomic_write(stage, b"", 0o600)  # LoadCredential= needs it before any start
    unit_file.parent.mkdir(parents=True, exist_ok=True)
    write_unit(unit_file, text, force)
    systemd = systemd or Systemd(settings.unit_name, settings.scope)
    systemd.daemon_reload()
    systemd.enable()
    install_sampler(settings, env_file, template, systemd)
    deployer = Deployer(settings, systemd, progress, force_memory, on_phase)
    # no stop on failure here: with no previous config the rollback stops the unit itself,
    # and with one it serves that config again
    result = deployer.deploy(cfg, origin="install")
    if front_kind == "haproxy" and spec is not None:
        slots = int((result.planned or {}).get("n_slots") or 1)
        result.handover = {
            **(result.handover or {}),
            "front": install_front(the_front, spec, slots, settings.scope, unit_file.parent),
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
    pattern = _template_state_dir(settings)
    text = unit_file.read_text() if unit_file.exists() else ""
    if "--state-dir " in text and not any(f"--state-dir {pattern}{c}" in text for c in " \n"):
        raise ConfigInvalid(
            f"{unit_file} already finds the generations of its instances in another folder "
            f"than {pattern}; every instance shares it: leave --state-dir out, or put this "
            "instance's state beside the others'"
        )


def _template_state_dir(settings: config.ToolSettings) -> str:
    """The state folder of every instance, as the template names it (``%i``): the folder
    is named after the unit (the default) or after the instance."""
    state_dir = home.state_dir(settings)
    for name, pattern in ((settings.instance, "llama-server@%i"), (settings.env_name, "%i")):
        if state_dir.name == name:
            return str(state_dir.parent / pattern)
    raise ConfigInvalid(
        f"--state-dir {state_dir}: the template unit finds each instance's generations in "
        f"<folder>/{settings.instance} or <folder>/{settings.env_name}; name the folder so "
        "or leave --state-dir out"
    )


def uninstall(
    settings: config.ToolSettings, purge: bool = False, systemd: Systemd | None = None
) -> dict[str, Any]:
    require_root(settings)
    systemd = systemd or Systemd(settings.unit_name, settings.scope)
    state = home.state_dir(settings)  # before the record beside the env file goes
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
        client_window_path(settings),
        # the record of the unit's home stays with kept generations: a reinstall goes on there
        *([home.record_path(env_file)] if purge else []),
    ):
        if f.exists():
            f.unlink()
            done.setdefault("removed", []).append(str(f))
    done.update(_uninstall_front(settings, systemd))
    if removed := timer.remove(
        settings.resolved_unit_dir(), settings.unit_name, systemd, keep_templates=True
    ):
        done["removed_sampler"] = removed
    if purge and state.exists():
        shutil.rmtree(state)
        done["purged"] = str(state)
    else:
        done["kept_generations"] = str(state)
    systemd.daemon_reload()
    systemd.reset_failed()
    return done


def _uninstall_front(settings: config.ToolSettings, systemd: Systemd) -> dict[str, Any]:
    the_front = front.Front(home.state_dir(settings), settings.unit_name)
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


def install_sampler(
    settings: config.ToolSettings, env_file: Path, template: bool, systemd: Systemd
) -> list[str]:
    """The sampler's timer and service (``launcher.host.timer``), enabled and started: it
    skips its samples until the deploy that follows is done."""
    python, package_dir = units.this_python()
    textfile_dir = settings.metrics_textfile_dir
    if textfile_dir is not None:
        textfile_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    sampler = timer.Sampler(
        unit="llama-server@%i.service" if template else settings.unit_name,
        scope=settings.scope,
        python=python,
        package_dir=package_dir,
        state_dir=_template_state_dir(settings) if template else str(home.state_dir(settings)),
        env_file=str(env_file.parent / "%i.env") if template else str(env_file),
        interval=settings.sample_interval,
        textfile_dir=str(textfile_dir) if textfile_dir else None,
        base_url=settings.base_url,
    )
    unit_dir = settings.resolved_unit_dir()
    unit_dir.mkdir(parents=True, exist_ok=True)
    return timer.install(unit_dir, settings.unit_name, sampler, systemd, store.atomic_write)
