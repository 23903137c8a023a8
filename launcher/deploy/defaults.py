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
  ``--metrics``, the counters the live sampler reads (``launcher.config.endpoints``).

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
from launcher.deploy import handover, keys, store
from launcher.errors import LauncherError
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


def target(
    settings: config.ToolSettings,
    store_root: Path,
    systemd: Systemd,
    pending: Mapping[Path, str | None] | None = None,
) -> Target:
    """The unit of ``settings``; ``pending``: files install is about to write (None: remove)."""
    if settings.scope != "system":
        return Target(None, store_root / "slots")
    view = service.view(settings.resolved_unit_file(), settings.unit_name, pending)
    if view is not None:
        return Target(view, Path(view.state_dirs[0]) if view.state_dirs else None)
    show = _state_directory(settings, systemd)
    return Target(None, handover.slot_folder("system", store_root, show))


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
    cfg: config.ServerConfig,
    to: Target,
    write: bool,
) -> config.ServerConfig:
    """``cfg`` as the deploy writes it (``write`` False: a preview, which makes nothing)."""
    cfg = keys.materialize(st, cfg, write)
    if settings.carry_slots:
        create = write and settings.scope != "system"  # systemd makes a StateDirectory=
        cfg = handover.with_slot_dir(cfg, to.slot_folder, create)
    return endpoints.with_metrics(cfg, settings.metrics_endpoint)


def make_slot_folder(settings: config.ToolSettings, to: Target, cfg: config.ServerConfig) -> None:
    """A rollback's config carried in the deploy's own slot folder gets it back if it was
    removed (user scope: the deploy makes it; systemd makes a ``StateDirectory=``)."""
    folder = to.slot_folder
    if settings.scope != "system" and folder is not None and cfg.slot_save_path == folder:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
