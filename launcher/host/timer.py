"""The sampler's units: a timer and the service it starts (``llama-launcher sample``).

``install`` writes them beside the server's unit and enables the timer; ``uninstall``
removes them. For ``llama-server.service`` they are ``llama-server-sample.timer`` and
``llama-server-sample.service``; for an instance ``llama-server@chat.service`` the
templates ``llama-server-sample@.timer``/``.service``, enabled as
``llama-server-sample@chat.timer``. Every ``interval`` seconds (the setting
``sample_interval``, rendered into the timer, as ``wedged_samples`` is into the service's
command line: change them with ``install`` again) systemd starts one sample: a short
process that takes no deploy lock (``launcher.watch.sample``), runs at a lower CPU and I/O
priority than llama-server, and logs its warnings to the journal of the sample service
(``journalctl -u llama-server-sample.service``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from launcher.host import units
from launcher.host.systemd import Systemd

WriteFile = Callable[[Path, bytes, int], None]


def names(unit: str) -> tuple[str, str]:
    """(service, timer) of a server unit's sampler."""
    base = unit.removesuffix(".service")
    if "@" in base:
        prefix, instance = base.split("@", 1)
        return f"{prefix}-sample@{instance}.service", f"{prefix}-sample@{instance}.timer"
    return f"{base}-sample.service", f"{base}-sample.timer"


def file_names(unit: str) -> tuple[str, str]:
    """The unit files: the templates' for an instance."""
    service, timer = names(unit)
    if "@" in service:
        return (
            service.split("@", 1)[0] + "@.service",
            timer.split("@", 1)[0] + "@.timer",
        )
    return service, timer


@dataclass(frozen=True)
class Sampler:
    """What the sampler's units say (for a template: ``%i`` in the paths)."""

    unit: str  # the server's unit (``llama-server@%i.service`` for a template)
    scope: str
    python: str
    package_dir: str
    state_dir: str
    env_file: str
    interval: float
    textfile_dir: str | None = None
    base_url: str | None = None
    #: the setting ``wedged_samples`` (``launcher.watch.wedge``): the service reads no settings
    wedged_samples: int = 3
    #: the folders a bake's revert writes besides the state folder, in system scope (the
    #: env file's, the client window's, the lock's: ``launcher.install.install`` names them)
    revert_paths: tuple[str, ...] = ()


_SERVICE = """\
# Rendered by llama-launcher install; put site changes in a drop-in.
[Unit]
Description=One live sample of {unit} (llama-launcher sample)
After={unit}

[Service]
# ready after its first sample (launcher.host.notify): a sample that carries a bake runs on
# as a service, its start job done (a oneshot's would keep a boot unfinished for the bake)
Type=notify
Environment=PYTHONPATH={package_dir}
ExecStart={python} -m launcher sample --unit {unit} --scope {scope} --state-dir {state_dir} \
--env-file {env_file} --wedged-samples {wedged_samples}{textfile}{base_url}
# no limit on the first sample: it may revert (a deploy's budget); each read has its own
# timeout (HTTP 10 s, the journal's). One that carries a bake runs up to 24 h after it
TimeoutStartSec=infinity
# llama-server comes first: the sampler's CPU time and I/O are what it leaves over
Nice=10
IOSchedulingClass=idle
NoNewPrivileges=yes
{hardening}"""

# The sample runs as root (the state folder is root's, the server's /proc entry is another
# user's), with everything read-only but what it writes. That is its own files, and what a
# bake's revert writes: the revert is a rollback (launcher.watch.revert) that the sample
# carrying the bake runs itself, so the verdict, the rollback and the bake's record of it
# are one process and one journal (journalctl -u NAME-sample.service); a oneshot unit of its
# own would add a second process whose death between the two leaves the bake half-told, for
# no path fewer: the rollback writes the env file's folder (the env file, its backup, its
# home record), the state folder's parent (the generations, the front's config, the client
# window file beside the state folder) and the unit's lock folder (under /run: made again by
# the unit's prestart step at every boot, so it may be missing before that: "-"). /etc, /usr
# and /home stay read-only otherwise.
_SYSTEM_HARDENING = """\
ProtectSystem=strict
ReadWritePaths={state_dir}{revert_rw}{textfile_rw}
{package_bind}ProtectHome=read-only
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictNamespaces=yes
LockPersonality=yes
"""

_TIMER = """\
# Rendered by llama-launcher install (the setting sample_interval; install again to change it).
[Unit]
Description=Live samples of {unit} every {interval:g}s (llama-launcher)

[Timer]
OnActiveSec=1s
OnUnitActiveSec={interval:g}s
AccuracySec={accuracy}

[Install]
WantedBy=timers.target
"""


def render_service(s: Sampler) -> str:
    textfile = f" --textfile-dir {s.textfile_dir}" if s.textfile_dir else ""
    base_url = f" --base-url {s.base_url}" if s.base_url else ""
    hardening = ""
    if s.scope == "system":
        # a launcher package under /tmp or /var/tmp (a checkout there) is bound in, as the
        # server's unit binds it (install's _with_package)
        hidden = units.hidden_by_private_tmp(s.package_dir)
        hardening = _SYSTEM_HARDENING.format(
            state_dir=s.state_dir,
            revert_rw="".join(f" {p}" for p in s.revert_paths),
            textfile_rw=f" -{s.textfile_dir}" if s.textfile_dir else "",
            package_bind=f"BindReadOnlyPaths={s.package_dir}\n" if hidden else "",
        )
    return _SERVICE.format(
        unit=s.unit,
        package_dir=s.package_dir,
        python=s.python,
        scope=s.scope,
        state_dir=s.state_dir,
        env_file=s.env_file,
        wedged_samples=s.wedged_samples,
        textfile=textfile,
        base_url=base_url,
        hardening=hardening,
    )


def render_timer(s: Sampler) -> str:
    # systemd's default AccuracySec is a minute: a timer of seconds needs a finer one
    accuracy = "100ms" if s.interval < 10 else "1s"
    return _TIMER.format(unit=s.unit, interval=s.interval, accuracy=accuracy)


def install(
    unit_dir: Path, unit: str, sampler: Sampler, systemd: Systemd, write: WriteFile
) -> list[str]:
    """Write the sampler's two units (through ``write``: atomically, 0644) and enable and
    start the timer of ``unit``. Returns the unit files written."""
    service_file, timer_file = file_names(unit)
    write(unit_dir / service_file, render_service(sampler).encode(), 0o644)
    write(unit_dir / timer_file, render_timer(sampler).encode(), 0o644)
    systemd.daemon_reload()
    timer = names(unit)[1]
    systemd.run([*_ctl(systemd), "enable", "--", timer], timeout=60, env=systemd.env)
    # started, or restarted: a timer already running keeps the interval it was started with
    systemd.run([*_ctl(systemd), "restart", "--", timer], timeout=60, env=systemd.env)
    return [str(unit_dir / service_file), str(unit_dir / timer_file)]


def remove(unit_dir: Path, unit: str, systemd: Systemd, keep_templates: bool) -> list[str]:
    """Stop and disable the sampler of ``unit`` and remove its unit files (an instance's
    templates stay while ``keep_templates``: other instances use them)."""
    service, timer = names(unit)
    systemd.run(
        [*_ctl(systemd), "disable", "--now", "--", timer, service],
        check=False,
        timeout=60,
        env=systemd.env,
    )
    removed: list[str] = []
    if "@" in service and keep_templates:
        return removed
    for name in file_names(unit):
        path = unit_dir / name
        if path.exists():
            path.unlink()
            removed.append(str(path))
    return removed


def _ctl(systemd: Systemd) -> list[str]:
    return ["systemctl", *(["--user"] if systemd.scope == "user" else [])]
