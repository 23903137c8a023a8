"""First deployment on a host (``install``) and its reverse (``uninstall``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from launcher import config, waits
from launcher.deploy import budgets, home, store
from launcher.deploy.gate import Progress
from launcher.deploy.outcome import Result
from launcher.deploy.restart import front, frontunits, lane, standby
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
    return units.Site(
        groups=units.host_groups(),
        read_only_paths=tuple(str(p) for p in read_only_paths),
        memory_deny_write_execute=memory_deny_write_execute,
        nice=nice,
    )


def require_root(settings: config.ToolSettings) -> None:
    """System scope writes /etc and /var/lib and talks to PID 1: root only (exit 2). A user
    who forgot sudo gets user scope by default: where the unit is installed in system
    scope, that is said, not the user manager's errors."""
    if settings.scope == "system" and os.geteuid() != 0:
        raise ConfigInvalid(
            "--scope system needs root: the unit lives in /etc/systemd/system, the env file "
            "in /etc/llama-launcher and the generations in /var/lib/llama-launcher; run it "
            "with sudo, or use --scope user for a server under your own systemd manager"
        )
    if settings.scope == "user" and os.geteuid() != 0 and "scope" not in settings.model_fields_set:
        found = system_install(settings)
        if found is not None:
            raise ConfigInvalid(
                f"{settings.unit_name} is installed in system scope ({found}): run as root "
                f"(sudo llama-launcher ...); --scope user manages a unit of your own "
                f"user's systemd instead"
            )


def system_install(settings: config.ToolSettings) -> Path | None:
    """The file that shows the unit installed in system scope (its unit file, or its env
    file's record in /etc/llama-launcher), None when there is none."""
    system = settings.model_copy(update={"scope": "system"})
    env_file = system.resolved_env_file()
    for path in (system.resolved_unit_file(), home.record_path(env_file), env_file):
        try:
            if path.exists():
                return path
        except OSError:
            continue
    return None


def require_haproxy(path: str = front.HAPROXY) -> None:
    """``--front haproxy`` needs Debian's HAProxy: refused (exit 2) before anything is
    written, not halfway with llama-server already on its private port."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ConfigInvalid(
            f"--front haproxy: HAProxy is not installed ({path} is missing); install it "
            "first with `apt-get install haproxy` (Debian 12's 2.6), then run install "
            "again; nothing was changed"
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
    settings: config.ToolSettings,
    env_file: Path,
    template: bool,
    site: units.Site | None,
    server: Literal["llama-server", "vllm"] = "llama-server",
) -> tuple[Path, str]:
    unit_dir = settings.resolved_unit_dir()
    state_dir = home.state_dir(settings)
    python, package_dir = units.this_python()
    if settings.scope == "system":
        python = _service_python(python, site)
        # the template is every instance's: an instance's own settings go to its drop-in
        own = site or site_for()
        site = _with_package(_shared_site(own) if template else own, package_dir)
    if template:
        return unit_dir / "llama-server@.service", units.render(
            python,
            package_dir,
            str(env_file.parent / "%i.env"),
            settings.scope,
            template=True,
            state_dir=_template_state_dir(settings),
            site=site,
            server=server,
        )
    return unit_dir / settings.unit_name, units.render(
        python,
        package_dir,
        str(env_file),
        settings.scope,
        state_dir=str(state_dir),
        site=site,
        server=server,
    )


def _shared_site(site: units.Site) -> units.Site:
    """What of ``site`` the template unit holds for every instance: the host's groups."""
    return units.Site(groups=site.groups)


def _instance_dropin(
    settings: config.ToolSettings, unit_file: Path, text: str, site: units.Site
) -> tuple[Path, str | None]:
    """An instance's own drop-in (``llama-server@NAME.service.d/``) and its text: the site
    settings it was given beyond the template's (None: it has none, the file goes)."""
    shared = service.view_of_text(text, unit_file)
    bound = shared.bound if shared is not None else ()
    base = dataclasses.replace(_shared_site(site), read_only_paths=bound)
    folder = unit_file.parent / f"{settings.unit_name}.d"
    return folder / units.SITE_DROPIN, units.site_dropin(site, base)


def _write_pending(pending: dict[Path, str | None], force: bool) -> None:
    """Write (or remove, for None) the files install renders, each atomically."""
    for path, text in pending.items():
        if text is None:
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # an instance's drop-in folder, when it held only this
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write_unit(path, text, force)


def _with_package(site: units.Site, package_dir: str) -> units.Site:
    """A launcher package under /tmp or /var/tmp (a checkout there) is hidden from the
    service by its private /tmp: bind it in read-only, as --read-only-path would."""
    if not units.hidden_by_private_tmp(package_dir) or package_dir in site.read_only_paths:
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
    cfg: config.AnyConfig,
    template: bool = False,
    progress: Progress | None = None,
    systemd: Systemd | None = None,
    force_memory: bool = False,
    on_phase: Callable[[str], None] | None = None,
    force: bool = False,
    site: units.Site | None = None,
    front_kind: str = "none",
    second_instance: bool = False,
    admission: Admission | None = None,
) -> Result:
    """Install the unit, create folders with safe modes, enable it, deploy through the gate.

    A failed first deploy leaves the unit stopped (and says why); on a host that already
    serves a config, a failed deploy leaves that config serving (the deployer rolls back).
    With the setting ``carry_slots`` (on by default), the deploy gives the config a
    ``--slot-save-path`` the service can write unless it names one (``handover.slot_folder``:
    ``STATE_DIR/slots``; in system scope the unit's ``StateDirectory=``).
    ``front_kind="haproxy"``: HAProxy holds the config's address and llama-server moves to a
    private one (``launcher.deploy.restart.front``); ``second_instance``: and a second instance on a
    standby port of the front (``launcher.deploy.restart.standby``), which serves while the unit
    restarts and keeps the previous config warm after; ``admission``: the front admits
    requests against the shared KV pool (``launcher.deploy.restart.admission``), and a pool
    that promises more than it holds passes the over-commit guard.
    Nothing is changed when the input is refused (a hand-edited unit without ``force``,
    system scope without root, user scope without linger, any step of the validation chain,
    which runs on the unit as it will be written before anything is). An instance of the
    template gets the site settings it was given in a drop-in of its own
    (``llama-server@NAME.service.d/``), so another instance's install never changes them.
    """
    if isinstance(cfg, config.VllmConfig) and settings.scope == "system":
        raise ConfigInvalid(
            "--backend vllm installs in user scope for now: the hardened system unit "
            "(DynamicUser, ProtectHome, MemoryDenyWriteExecute) is not tested with vLLM, "
            "which writes a cache under its home and generates code at run time; install as "
            "a user with linger (--scope user); nothing was changed"
        )
    the_front, spec = _refuse_early(settings, cfg, template, front_kind, second_instance)
    if admission is not None and front_kind != "haproxy":
        raise ConfigInvalid(
            "--admission is the front's: install with --front haproxy --admission; nothing "
            "was changed"
        )
    env_file = settings.resolved_env_file()
    if template:
        _check_template(settings, env_file, settings.resolved_unit_dir())
    site = site or site_for()
    server: Literal["llama-server", "vllm"] = (
        "vllm" if isinstance(cfg, config.VllmConfig) else "llama-server"
    )
    unit_file, pending = _pending_units(settings, env_file, template, site, force, server)
    systemd = systemd or Systemd(settings.unit_name, settings.scope)
    deployer = Deployer(settings, systemd, progress, force_memory, on_phase)
    # the whole validation chain on the unit as it will be, before anything is written: a
    # refused install changes nothing (no unit, folder, key file or wants link left behind)
    deployer.pending = pending
    if front_kind == "haproxy":
        deployer.admits = admission is not None
    deployer.deploy(cfg, check=True, origin="install")
    deployer.pending = {}
    state_dir = _make_folders(settings, env_file)
    if front_kind == "haproxy":
        spec = _front_spec(cfg, spec, second_instance, admission)
    if spec is not None:
        # llama-server listens on the private address; the front holds the config's one
        cfg = cfg.model_copy(update={"host": spec.private_host, "port": spec.private_port})
    stage = Path(units.key_stage_path(str(state_dir)))
    if settings.scope == "system" and not stage.exists():
        store.atomic_write(stage, b"", 0o600)  # LoadCredential= needs it before any start
    _write_pending(pending, force)
    systemd.daemon_reload()
    systemd.enable()
    install_sampler(settings, env_file, template, systemd)
    # no stop on failure here: with no previous config the rollback stops the unit itself,
    # and with one it serves that config again
    result = deployer.deploy(cfg, origin="install")
    if front_kind == "haproxy" and spec is not None:
        _install_front_units(
            settings, result, the_front, spec, unit_file.parent, site, systemd, force
        )
    return result


def _refuse_early(
    settings: config.ToolSettings,
    cfg: config.AnyConfig,
    template: bool,
    front_kind: str,
    second_instance: bool,
) -> tuple[front.Front, front.FrontSpec | None]:
    """Refuse what install cannot do before anything is written (a front it does not know,
    no HAProxy, a second instance without the front, no root, no linger, an installed
    front's public address moved); the unit's front and its spec (None: none installed)."""
    if front_kind not in FRONTS:
        raise ConfigInvalid(
            f"--front {front_kind!r} is not a front; use one of {', '.join(FRONTS)}"
        )
    if front_kind == "haproxy":
        require_haproxy()
    if second_instance:
        require_second_instance(settings, front_kind, template)
    require_root(settings)
    require_linger(settings)
    the_front = front.Front(home.state_dir(settings), settings.unit_name, settings.scope)
    spec = the_front.spec()
    if front_kind == "haproxy":
        require_same_public(the_front, spec, cfg)
    return the_front, spec


def _pending_units(
    settings: config.ToolSettings,
    env_file: Path,
    template: bool,
    site: units.Site,
    force: bool,
    server: Literal["llama-server", "vllm"] = "llama-server",
) -> tuple[Path, dict[Path, str | None]]:
    """The unit file and the files install will write (an instance's drop-in beside it);
    a hand-edited one is refused here, unless ``force``, before any folder is made."""
    unit_file, text = _unit_text(settings, env_file, template, site, server)
    pending: dict[Path, str | None] = {unit_file: text}
    if template and settings.scope == "system":
        dropin, dropin_text = _instance_dropin(settings, unit_file, text, site)
        pending[dropin] = dropin_text
    for path, new in pending.items():
        if new is not None and path.exists() and units.hand_edited(path.read_text()) and not force:
            write_unit(path, new)  # raises
    return unit_file, pending


def _make_folders(settings: config.ToolSettings, env_file: Path) -> Path:
    """The env file's folder and the state folder (private to the service), made; the
    state folder."""
    env_file.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    state_dir = home.state_dir(settings)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(state_dir, 0o700)
    return state_dir


def _install_front_units(
    settings: config.ToolSettings,
    result: Result,
    the_front: front.Front,
    spec: front.FrontSpec,
    unit_dir: Path,
    site: units.Site,
    systemd: Systemd,
    force: bool,
) -> None:
    """After the first deploy: the front (sized for the slots the deploy planned) and the
    second instance, when it has a standby port; what they are goes into the handover."""
    planned = result.planned or {}
    slots = int(planned.get("n_slots") or 1)
    unified = bool(planned.get("kv_unified"))  # split pools: nothing to admit against
    spec = dataclasses.replace(
        spec,
        pool_cells=int(planned.get("pool_cells") or 0) if unified else 0,
        slot_cells=int(planned.get("n_ctx_slot") or 0) if unified else 0,
    )
    watcher = frontunits.release_service_text(the_front, *units.this_python(), home.where(settings))
    result.handover = {
        **(result.handover or {}),
        "front": install_front(the_front, spec, slots, settings.scope, unit_dir, watcher),
    }
    if spec.standby_port is not None:
        result.handover["second_instance"] = install_standby(
            settings, spec, unit_dir, site, systemd, force
        )


def require_second_instance(settings: config.ToolSettings, front_kind: str, template: bool) -> None:
    """``--second-instance`` needs the front (it switches between the two) and, in system
    scope, a unit whose dynamic user has a name (the second instance runs as that user, so
    each reads the slots the other saved): systemd names it after the unit, up to its ``@``,
    unless that is no valid user name."""
    if front_kind != "haproxy":
        raise ConfigInvalid(
            "--second-instance needs --front haproxy: the front switches between the two"
        )
    if settings.scope == "system" and "@" in settings.unit_name and not template:
        raise ConfigInvalid(
            f"--second-instance: {settings.unit_name} names an instance of a template but "
            "is installed as a unit of its own; install the instance with --instance NAME"
        )
    if settings.scope == "system" and units.dynamic_user(settings.unit_name) is None:
        prefix = units.unit_prefix(settings.unit_name)
        raise ConfigInvalid(
            f"--second-instance: systemd gives {settings.unit_name} a hashed dynamic user "
            f"({prefix!r} is no valid user name: a letter or _ first, then letters, digits, _ "
            "or -, 31 at most), which a second instance cannot share; install it under a "
            "unit name that is one (--unit NAME.service)"
        )


def install_standby(
    settings: config.ToolSettings,
    spec: front.FrontSpec,
    unit_dir: Path,
    site: units.Site | None,
    systemd: Systemd,
    force: bool = False,
) -> dict[str, Any]:
    """The second instance's unit (``NAME-b.service``, never enabled: only a deployer
    starts it) on the front's standby port."""
    assert spec.standby_port is not None
    python, package_dir = units.this_python()
    state_dir = home.state_dir(settings)
    if settings.scope == "system":
        python = _service_python(python, site)
        site = _with_package(site or site_for(), package_dir)
    name = standby.unit_name(settings.unit_name)
    text = units.render_standby(
        settings.unit_name,
        spec.standby_port,
        python,
        package_dir,
        str(standby.env_path(state_dir)),
        settings.scope,
        str(state_dir),
        site,
        "vllm" if store.runs_vllm(store.Store(state_dir).live_meta()) else "llama-server",
    )
    write_unit(unit_dir / name, text, force)
    systemd.daemon_reload()
    return {"unit": name, "port": spec.standby_port}


def require_same_public(
    the_front: front.Front, old: front.FrontSpec | None, cfg: config.AnyConfig
) -> None:
    """A front already installed keeps its public address: its socket unit holds the old
    one, and ``systemctl start`` of an active socket binds nothing new. Another address is
    refused (exit 2) before anything is written."""
    if old is None or (old.public_host, old.public_port) == (cfg.host, cfg.port):
        return
    raise ConfigInvalid(
        f"--front haproxy: the front of {the_front.unit} listens on "
        f"{old.public_host}:{old.public_port} ({the_front.socket_unit}); install cannot move "
        f"it to {cfg.host}:{cfg.port}. Run `llama-launcher uninstall` (it keeps the "
        "generations), then install --front haproxy again with the new address, or install "
        f"with --host {old.public_host} --port {old.public_port}; nothing was changed"
    )


@dataclasses.dataclass(frozen=True)
class Admission:
    """``install --front haproxy --admission``: the admission queue's bounds."""

    queue: int = 64
    wait: float = 120.0

    def __post_init__(self) -> None:
        if self.queue < 1:
            raise ConfigInvalid(
                f"--admission-queue {self.queue} is no queue length; use 1 or more, e.g. 64"
            )
        if not 0 < self.wait <= 86400:
            raise ConfigInvalid(
                f"--admission-wait {self.wait:g} is no wait; use seconds over 0, e.g. 120"
            )


def _front_spec(
    cfg: config.AnyConfig,
    old: front.FrontSpec | None,
    second: bool = False,
    admission: Admission | None = None,
) -> front.FrontSpec:
    """The config's address becomes the public one; the private one is kept across
    re-installs (the server may be listening on it; ``require_same_public`` refused a
    public address that moved). Admission is as this install says (off without it)."""
    host = old.private_host if old is not None else "127.0.0.1"
    spec = old or front.FrontSpec(cfg.host, cfg.port, host, front.free_port(host))
    spec = dataclasses.replace(
        spec,
        admission=admission is not None,
        admission_queue=admission.queue if admission else spec.admission_queue,
        admission_wait=admission.wait if admission else spec.admission_wait,
    )
    while second and spec.standby_port in (None, spec.private_port):
        spec = dataclasses.replace(spec, standby_port=front.free_port(host))
    return spec


def install_front(
    the_front: front.Front,
    spec: front.FrontSpec,
    slots: int,
    scope: str,
    unit_dir: Path,
    watcher: str,
) -> dict[str, Any]:
    """HAProxy's config (validated, swapped), its socket and service units and the release
    watcher's path and service units (``watcher``: the service's text), started."""
    text = the_front.render(spec, slots)
    the_front.validate(text, spec)
    changed = the_front.live_text() != text
    the_front.swap(text)
    the_front.save_spec(spec)
    files = {
        the_front.socket_unit: frontunits.socket_text(the_front, spec),
        the_front.service: frontunits.service_text(the_front, spec),
        the_front.release_path: frontunits.release_path_text(the_front),
        the_front.release_service: watcher,
    }
    for name, unit_text in files.items():
        changed |= name == the_front.service and _read(unit_dir / name) != unit_text
        store.atomic_write(unit_dir / name, unit_text.encode(), 0o644)
    sock = Systemd(the_front.socket_unit, "user" if scope == "user" else "system")
    service = Systemd(the_front.service, sock.scope)
    sock.daemon_reload()
    ctl = sock_ctl(sock)
    sock.run([*ctl, "enable", "--", the_front.socket_unit, the_front.release_path], env=sock.env)
    sock.run([*ctl, "start", "--", the_front.socket_unit, the_front.release_path], env=sock.env)
    verb = "restart" if changed else "start"
    service.run([*ctl, verb, "--", the_front.service], timeout=60, env=service.env)
    return {
        "kind": "haproxy",
        "public": f"{spec.public_host}:{spec.public_port}",
        "private": f"{spec.private_host}:{spec.private_port}",
        "units": list(files),
        "config": str(the_front.config_path),
    }


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


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
    """Stop, disable and remove the unit and its env file (an instance: its drop-in, and
    the template with the template's last instance); the generations are kept (and said
    so) unless ``purge``, which removes everything else install made: the state folder,
    the service's own ``StateDirectory=``, the record, the unit's lock and the folders left
    empty. Under the unit's lock (``LockTimeout`` when a deploy holds it past the wait),
    the front's release watcher stopped first."""
    require_root(settings)
    systemd = systemd or Systemd(settings.unit_name, settings.scope)
    state = home.state_dir(settings)  # before the record beside the env file goes
    # under the unit's lock: no deploy, recovery or release watcher restarts the unit
    # while it is taken apart (a deploy in progress is waited for, as another deploy would)
    st = store.Store(state, home.lock_path(settings.scope, settings.unit_name))
    wait = budgets.lock_wait(settings, waits.Waits.from_settings(settings), budgets.last_load(st))
    with st.lock(wait):
        return _uninstall(settings, purge, systemd, state)


def _uninstall(
    settings: config.ToolSettings, purge: bool, systemd: Systemd, state: Path
) -> dict[str, Any]:
    done: dict[str, Any] = {}
    # the front's release watcher first: it takes the lock and restarts the unit once we
    # let go of it, and its path unit starts it again while a hold is recorded
    watcher = _front_units(settings)[:2]
    if _stop_units(systemd, watcher):
        done["stopped_watcher"] = [name for name, _ in watcher]
    try:
        systemd.stop()
        done["stopped"] = settings.unit_name
    except LauncherError as e:
        done["stop_error"] = str(e)
    if purge and settings.scope == "system" and systemd.clean_state():
        done["cleaned"] = f"the service's StateDirectory= of {settings.unit_name}"
    systemd.disable()
    unit_file = settings.resolved_unit_dir() / settings.unit_name
    env_file = settings.resolved_env_file()
    for f in (
        unit_file,
        *_instance_files(settings, env_file),
        env_file,
        env_file.with_name(env_file.name + ".bak"),
        client_window_path(settings),
        # the record of the unit's home stays with kept generations: a reinstall goes on there
        *([home.record_path(env_file)] if purge else []),
    ):
        if not f.is_file():
            continue
        f.unlink()
        if f == unit_file:
            done["removed_unit"] = str(f)
        else:
            done.setdefault("removed", []).append(str(f))
    done.update(_uninstall_standby(settings, systemd))
    done.update(_uninstall_front(settings, systemd))
    # an instance's sampler templates stay while another instance of the template uses them
    others = "@" in settings.unit_name and bool(_other_instances(settings, env_file))
    if removed := timer.remove(
        settings.resolved_unit_dir(), settings.unit_name, systemd, keep_templates=others
    ):
        done["removed_sampler"] = removed
    if purge and state.exists():
        shutil.rmtree(state)
        done["purged"] = str(state)
    elif state.exists():
        done["kept_generations"] = str(state)
        done["kept"] = (
            f"the generations in {state} and the record {home.record_path(env_file)} that "
            "names them: install goes on there; uninstall --purge deletes them"
        )
    systemd.daemon_reload()
    systemd.reset_failed()
    if purge:
        done["removed_empty"] = _remove_empty(settings, env_file, state)
    return done


def _instance_files(settings: config.ToolSettings, env_file: Path) -> list[Path]:
    """An instance's own drop-in, and the template after the template's last instance."""
    if "@" not in settings.unit_name:
        return []
    unit_dir = settings.resolved_unit_dir()
    files = [unit_dir / f"{settings.unit_name}.d" / units.SITE_DROPIN]
    if not _other_instances(settings, env_file):
        files.append(settings.resolved_unit_file())
    return files


def _other_instances(settings: config.ToolSettings, env_file: Path) -> list[str]:
    """The template's other installed instances: their env files beside this one's, with
    the record install wrote naming an instance of the template."""
    template = settings.unit_name.split("@", 1)[0] + "@"
    others = []
    for env in env_file.parent.glob("*.env"):
        if env == env_file:
            continue
        try:
            record = home.read_record(env)
        except LauncherError:
            continue
        unit = str((record or {}).get("unit", ""))
        if unit.startswith(template):
            others.append(unit)
    return others


def _remove_empty(settings: config.ToolSettings, env_file: Path, state: Path) -> list[str]:
    """After a purge: the unit's lock, then the folders install made, where left empty."""
    lock = home.lock_path(settings.scope, settings.unit_name)
    lock.unlink(missing_ok=True)
    folders = [lock.parent, env_file.parent, state.parent]
    folders.append(settings.resolved_unit_dir() / f"{settings.unit_name}.d")
    removed = []
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only an empty one
            removed.append(str(folder))
    return removed


def _front_units(settings: config.ToolSettings) -> list[tuple[str, Path]]:
    """The front's units and their files: the release watcher's path and service first."""
    the_front = front.Front(home.state_dir(settings), settings.unit_name, settings.scope)
    unit_dir = settings.resolved_unit_dir()
    names = [
        the_front.release_path,
        the_front.release_service,
        the_front.service,
        the_front.socket_unit,
    ]
    return [(name, unit_dir / name) for name in names]


def _stop_units(systemd: Systemd, units_files: list[tuple[str, Path]]) -> bool:
    """``systemctl disable --now`` of the units whose files are installed; whether any was."""
    installed = [name for name, f in units_files if f.exists()]
    for unit in installed:
        systemd.run(
            [*sock_ctl(systemd), "disable", "--now", "--", unit], check=False, env=systemd.env
        )
    return bool(installed)


def _uninstall_standby(settings: config.ToolSettings, systemd: Systemd) -> dict[str, Any]:
    """The second instance stopped and its unit, env file and warm record removed."""
    name = standby.unit_name(settings.unit_name)
    unit_file = settings.resolved_unit_dir() / name
    if not unit_file.exists():
        return {}
    ctl = sock_ctl(systemd)
    stop = name.removesuffix(".service") + "-stop"
    systemd.run(
        [*ctl, "stop", "--", f"{stop}.timer", f"{stop}.service", name],
        check=False,
        env=systemd.env,
    )
    state = home.state_dir(settings)
    files = [
        unit_file,
        standby.env_path(state),
        state / "front" / "warm.json",
        standby.key_stage_path(state),
    ]
    for f in files:
        f.unlink(missing_ok=True)
    return {"removed_second_instance": [str(f) for f in files[:2]]}


def _uninstall_front(settings: config.ToolSettings, systemd: Systemd) -> dict[str, Any]:
    the_front = front.Front(home.state_dir(settings), settings.unit_name, settings.scope)
    units_files = _front_units(settings)
    files = [f for _, f in units_files]
    if not any(f.exists() for f in files):
        return {}
    _stop_units(systemd, units_files[2:])
    kept: dict[str, Any] = {}
    with contextlib.suppress(LauncherError):
        spec = the_front.spec()
        if spec is not None and spec.lane_unit:
            kept["kept_lane"] = (
                f"the lane {spec.lane} ({spec.lane_unit}) stays installed, with no front to "
                f"route to it: uninstall --lane {spec.lane} removes it"
            )
    for f in files:
        f.unlink(missing_ok=True)
    the_front.spec_path.unlink(missing_ok=True)
    the_front.hold_path.unlink(missing_ok=True)
    the_front.hold_lock_path.unlink(missing_ok=True)
    return {"removed_front": [str(f) for f in files], **kept}


def revert_paths(settings: config.ToolSettings, env_file: Path) -> tuple[str, ...]:
    """The folders a bake's revert writes, which the sample service that runs it must be
    able to write in system scope (``launcher.host.timer``): the env file's, the client
    window file's (the state folder's parent: the generations and the front's files are
    under it), and the unit's lock folder (``-``: under /run, missing until the unit's
    first start of a boot makes it)."""
    return (
        str(env_file.parent),
        str(client_window_path(settings).parent),
        f"-{units.SYSTEM_LOCK_DIR}",
    )


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
        wedged_samples=settings.wedged_samples,
        revert_paths=revert_paths(settings, env_file),
    )
    unit_dir = settings.resolved_unit_dir()
    unit_dir.mkdir(parents=True, exist_ok=True)
    return timer.install(unit_dir, settings.unit_name, sampler, systemd, store.atomic_write)


# -- the long-prompt lane (launcher/deploy/restart/lane.py) -----------------------------------


@dataclass(frozen=True)
class LaneOptions:
    """``install --lane NAME``: the lane and how the front routes to it."""

    name: str
    #: tokens: a request whose prompt may be longer goes to the lane
    threshold: int = 4096
    bytes_per_token: int = 4
    wait: float = 120.0
    #: an address on another host (None: a unit of this host, on a private port)
    address: str | None = None
    #: requests the front sends a lane on another host at once (a lane of this host: its
    #: own -np)
    slots: int | None = None

    def __post_init__(self) -> None:
        lane.check_name(self.name)
        if self.threshold < 1:
            raise ConfigInvalid(
                f"--lane-threshold {self.threshold} is no threshold; give the prompt tokens "
                "over which a request goes to the lane, e.g. 4096"
            )
        if not 1 <= self.bytes_per_token <= 16:
            raise ConfigInvalid(
                f"--lane-bytes-per-token {self.bytes_per_token} is out of range; use 1 to 16 "
                "(4 for English and code; 1 never sends a long prompt to the main server)"
            )
        if not 0 < self.wait <= 86400:
            raise ConfigInvalid(
                f"--lane-wait {self.wait:g} is no wait; use seconds over 0, e.g. 120"
            )
        if self.address is not None:
            lane.parse_address(self.address)
        if self.slots is not None and self.address is None:
            raise ConfigInvalid(
                f"--lane-slots {self.slots} is for a lane on another host (with "
                "--lane-address); a lane of this host takes as many as its -np; nothing was "
                "changed"
            )
        if self.slots is not None and not 1 <= self.slots <= 4096:
            raise ConfigInvalid(
                f"--lane-slots {self.slots} is out of range; give the lane server's slots "
                "(its -np), e.g. 4"
            )


def lane_settings(main: config.ToolSettings, name: str) -> config.ToolSettings:
    """The lane's own settings: its unit named after the main one, its env file and state
    folder beside the main unit's."""
    unit = lane.unit_name(main.unit_name, name)
    stem = unit.removesuffix(".service")
    return main.model_copy(
        update={
            "unit": unit,
            "env_file": main.resolved_env_file().with_name(f"{stem}.env"),
            "state_dir": home.state_dir(main).parent / stem,
        }
    )


def _main_front(main: config.ToolSettings) -> tuple[front.Front, front.FrontSpec]:
    the_front = front.Front(home.state_dir(main), main.unit_name, main.scope)
    spec = the_front.spec()
    if spec is None:
        raise ConfigInvalid(
            f"--lane: {main.unit_name} has no front to route long prompts from; install it "
            "with --front haproxy first; nothing was changed"
        )
    return the_front, spec


def install_lane(
    main: config.ToolSettings,
    cfg: config.ServerConfig | None,
    options: LaneOptions,
    **install_args: Any,
) -> Result | dict[str, Any]:
    """The lane: its unit installed and deployed through its own gate (``cfg``; none for an
    address on another host), then the main unit's front routing to it. A threshold alone
    that changed is told to the running HAProxy; a new lane restarts HAProxy softly (what
    it serves finishes). A lane whose deploy failed is not routed to (a lane routed before
    stays as it was: its old config serves again)."""
    the_front, spec = _main_front(main)
    if spec.lane and spec.lane != options.name:
        raise ConfigInvalid(
            f"--lane {options.name}: the front of {main.unit_name} routes to the lane "
            f"{spec.lane} already; remove it first (uninstall --lane {spec.lane}); nothing "
            "was changed"
        )
    own = lane_settings(main, options.name)
    if options.address is not None:
        if spec.lane_unit and spec.lane == options.name:
            raise ConfigInvalid(
                f"--lane-address: the lane {options.name} is the unit {spec.lane_unit} of this "
                f"host; uninstall --lane {options.name} first; nothing was changed"
            )
        host, port = lane.parse_address(options.address)
        result: Result | dict[str, Any] = {
            "ok": True,
            "lane": options.name,
            "address": options.address,
        }
        slots, unit = options.slots or 1, ""
    else:
        if cfg is None:
            raise ConfigInvalid(
                "--lane needs the lane's config (llama-server flags or --config), or "
                "--lane-address HOST:PORT for a lane on another host"
            )
        host = spec.private_host
        same = spec.lane == options.name and spec.lane_unit and spec.lane_port
        port = spec.lane_port if same else _free_port(host, spec)
        cfg = cfg.model_copy(update={"host": host, "port": port})
        result = install(own, cfg, front_kind="none", **install_args)
        if not result.ok:
            return result
        main_state = str(home.state_dir(main))
        record = lane.Record(options.name, main.unit_name, main_state, main.scope, host, port)
        record.write(home.state_dir(own))
        slots = int((result.planned or {}).get("n_slots") or 1)
        unit = own.unit_name

    def wire(now: front.FrontSpec) -> front.FrontSpec:
        return dataclasses.replace(
            now,
            lane=options.name,
            lane_unit=unit,
            lane_host=host,
            lane_port=port,
            lane_slots=slots,
            lane_threshold=options.threshold,
            lane_bytes_per_token=options.bytes_per_token,
            lane_wait=options.wait,
        )

    routed = route(main, the_front, wire)
    if isinstance(result, Result):
        result.handover = {**(result.handover or {}), "routing": routed}
    else:
        result["front"] = routed
    return result


def _free_port(host: str, spec: front.FrontSpec) -> int:
    """A free port for the lane, none of the front's own (the second instance's standby
    port is free while it does not run)."""
    taken = {spec.public_port, spec.private_port, spec.standby_port}
    for _ in range(100):
        port = front.free_port(host)
        if port not in taken:
            return port
    raise ConfigInvalid(f"no free port for the lane on {host}; nothing was changed")


def route(
    main: config.ToolSettings,
    the_front: front.Front,
    change: Callable[[front.FrontSpec], front.FrontSpec],
) -> dict[str, Any]:
    """The main unit's front with ``change`` made to its spec (its lane added, changed or
    removed), read and written under the main unit's lock (a deploy of it changes the same
    spec): a threshold alone that changed goes to the running HAProxy (no restart);
    anything else is installed as ``install_front`` does."""
    st = store.Store(home.state_dir(main), home.lock_path(main.scope, main.unit_name))
    wait = budgets.lock_wait(main, waits.Waits.from_settings(main), budgets.last_load(st))
    with st.lock(wait):
        now = the_front.spec()
        if now is None:
            raise ConfigInvalid(
                f"{main.unit_name} lost its front meanwhile (uninstalled?); nothing was routed"
            )
        spec = change(now)
        slots = _front_slots(st)
        text = the_front.render(spec, slots)
        the_front.validate(text, spec)
        old = the_front.live_text() or ""
        out: dict[str, Any] = {
            "lane": spec.lane or None,
            "threshold_tokens": spec.lane_threshold if spec.lane else None,
            "threshold_bytes": lane.threshold_bytes(spec),
            "changed": text != old or spec != now,
        }
        if not out["changed"]:
            return out
        if spec.lane and _threshold_only(old, text):
            the_front.swap(text)
            the_front.save_spec(spec)
            try:
                lane.announce(the_front, spec)
                out["applied"] = "at run time (no restart of HAProxy)"
            except LauncherError as e:
                out["applied"] = f"on disk; the running HAProxy did not take it: {e}"
            return out
        unit_dir = main.resolved_unit_dir()
        watcher = frontunits.release_service_text(the_front, *units.this_python(), home.where(main))
        out.update(install_front(the_front, spec, slots, main.scope, unit_dir, watcher))
        return out


def _threshold_only(old: str, new: str) -> bool:
    """Whether two front configs differ in the lane's threshold alone."""

    def rest(text: str) -> list[str]:
        return [line for line in text.splitlines() if "LLAMA_LANE_BYTES" not in line]

    return old != new and rest(old) == rest(new)


def _front_slots(st: store.Store) -> int:
    """The main server's slots (the front's ``maxconn``), from its live generation's plan."""
    meta = st.live_meta() or {}
    return int((meta.get("planned") or {}).get("n_slots") or 1)


def uninstall_lane(main: config.ToolSettings, name: str, purge: bool = False) -> dict[str, Any]:
    """The lane out of the main unit's front, then its unit removed as ``uninstall`` removes
    one (``purge``: its generations too). First the running HAProxy sends every request to
    the main server (those waiting for the lane too), and what the lane serves finishes (at
    most ``drain_timeout``); then HAProxy restarts softly without the lane. A lane whose
    front is gone already (the main unit uninstalled first) is removed alone."""
    lane.check_name(name)
    the_front = front.Front(home.state_dir(main), main.unit_name, main.scope)
    spec = the_front.spec()
    own = lane_settings(main, name)
    installed = (own.resolved_unit_dir() / own.unit_name).exists()
    done: dict[str, Any] = {}
    if spec is not None and spec.lane == name:
        done["drain"] = _unroute(the_front, main.drain_timeout)

        def plain(now: front.FrontSpec) -> front.FrontSpec:
            return dataclasses.replace(
                now, lane="", lane_unit="", lane_host="", lane_port=0, lane_slots=1,
                lane_threshold=0,
            )  # fmt: skip

        done["front"] = route(main, the_front, plain)
    elif not installed:
        routes = f"the lane {spec.lane}" if spec is not None and spec.lane else "no lane"
        raise ConfigInvalid(
            f"--lane {name}: {main.unit_name} has no lane {name} (its front routes to "
            f"{routes}, and {own.unit_name} is not installed); nothing was changed"
        )
    if installed:
        lane.Record.path(home.state_dir(own)).unlink(missing_ok=True)
        done["lane"] = uninstall(own, purge)
    return done


def _unroute(the_front: front.Front, timeout: float) -> str:
    """The running HAProxy sends no request to the lane from now on (``llama lane set 0``;
    those waiting for it go to the main server), and what it sent there finishes."""
    from launcher.deploy.restart import drain, fronthold

    try:
        the_front.command("llama lane set 0")
    except LauncherError as e:
        return f"not drained: {e}"

    in_flight = fronthold.safe_count(lambda: lane.in_flight(the_front))
    return drain.wait_idle(None, timeout, front_in_flight=in_flight).describe()
