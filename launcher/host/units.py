"""The systemd unit files, rendered from one template.

The files in the repository's ``units/`` folder are this template rendered with the defaults
(a test keeps them equal); ``install`` renders it again with the real launcher path, env file,
state folder, scope and site settings, so a pip-installed tool needs no repository folder.

In system scope llama-server runs as a dynamic user (``DynamicUser=yes``) under hardening
that keeps GPUs reachable; PID 1 hands it the env file and the API key as credentials
(``LoadCredential=``), so nothing the tool keeps under /etc/llama-launcher or
/var/lib/llama-launcher needs to be readable by it. Before every start a lean, privileged
``ExecStartPre=`` of the standard-library launcher reverts a transaction a killed deployer
left behind (a reboot between the kill and the next command must not start the half-done
config ungated) and stages the API key for the credential.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

#: The folder of the system scope's unit locks (FHS: lock files belong in /run/lock).
SYSTEM_LOCK_DIR = Path("/run/lock/llama-launcher")

DEFAULT_PYTHON = "/usr/bin/python3"
#: Where the ``launcher`` package is on Debian 12: ``pip install`` as root, then a Debian
#: package; ``python -S`` skips site-packages processing, so PYTHONPATH names both.
DEFAULT_PACKAGE_DIR = "/usr/local/lib/python3.11/dist-packages:/usr/lib/python3/dist-packages"
#: Credential names the launcher reads from ``$CREDENTIALS_DIRECTORY``.
ENV_CREDENTIAL = "env-file"
KEY_CREDENTIAL = "api-key"
#: Device classes of GPUs (/proc/devices names): NVIDIA's /dev/nvidia0..N and nvidiactl
#: (nvidia-frontend), nvidia-uvm, nvidia-caps; /dev/dri/* (drm) and AMD's /dev/kfd. A class
#: this host's kernel does not have is skipped by systemd.
GPU_DEVICES = (
    "char-nvidia-frontend",
    "char-nvidia-uvm",
    "char-nvidia-caps",
    "char-drm",
    "char-kfd",
)
#: The groups GPU device nodes belong to on Debian (udev rules).
GPU_GROUPS = ("render", "video")


#: the folders a unit's PrivateTmp=yes replaces with the service's own, empty ones
PRIVATE_TMP = ("/tmp", "/var/tmp")


def hidden_by_private_tmp(path: str) -> bool:
    """Whether ``path`` lies under a folder PrivateTmp=yes hides from the service."""
    return any(Path(path).is_relative_to(d) for d in PRIVATE_TMP)


@dataclass(frozen=True)
class Site:
    """Site-specific settings of the hardened unit (system scope), rendered into it.

    ``groups``: supplementary groups of the service (the GPU nodes' groups that exist here);
    ``read_only_paths``: folders bound read-only into the service's view, e.g. models kept
    under a folder its sandbox hides (/tmp, /var/tmp);
    ``memory_deny_write_execute``: off for GPU drivers that JIT-compile (ROCm/HIP reportedly);
    ``nice``: grant CAP_SYS_NICE for llama-server's ``--prio`` (and allow its syscalls).
    """

    groups: tuple[str, ...] = GPU_GROUPS
    read_only_paths: tuple[str, ...] = ()
    memory_deny_write_execute: bool = True
    nice: bool = False


_HEADER = "# Rendered by llama-launcher; `llama-launcher install` writes it with this host's paths."
_TEMPLATE = (
    _HEADER
    + """
[Unit]
Description={server}{what}, launched by llama-launcher
Documentation={docs}
{after}# A bad config must never loop: at most 5 starts in 5 minutes (manual restarts count too;
# `llama-launcher rollback` runs `systemctl reset-failed` first).
StartLimitIntervalSec=300
StartLimitBurst=5

[Service]
Type=exec
# `llama-launcher exec` without site-packages processing (-S): it needs only the standard
# library and its own package, and it runs on every start. It execs llama-server itself.
Environment=PYTHONPATH={package_dir}
{prestart}ExecStart={python} -S -m launcher exec --env-file {env_file}{port}
Restart=on-failure
RestartSec=2
# 78 (EX_CONFIG): the launcher refused the env file; restarting cannot fix that.
RestartPreventExitStatus=78
TimeoutStartSec=30
{stop}
KillMode=mixed
SyslogIdentifier={ident}
{hardening}{install}"""
)

_PRESTART = """\
# Before every start (a boot too), with full privileges (+): revert a deploy that was killed
# half-way, so its config never starts ungated, and stage the API key for LoadCredential=.
ExecStartPre=+{python} -S -m launcher prestart --env-file {env_file} --state-dir {state_dir} \
--lock {lock} --stage-key {key_stage}
"""

# The user manager cannot switch users or set up most sandboxing for an unprivileged user.
_USER_HARDENING = """\
# Hardening that keeps the model readable and a GPU reachable (no PrivateDevices=).
NoNewPrivileges=yes
LockPersonality=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
LimitMEMLOCK=infinity
"""

_SYSTEM_HARDENING = """\
# llama-server parses untrusted JSON, chat templates and GGUF files: it runs as a user of its
# own that owns nothing but its StateDirectory, and sees the env file and the API key only as
# credentials PID 1 reads for it.
DynamicUser=yes
StateDirectory={state_directory}
{groups}LoadCredential={env_credential}:{env_file}
LoadCredential={key_credential}:{key_stage}
UMask=0077
# No PrivateDevices= (it hides GPU nodes even with DeviceAllow=): only the GPU classes.
DevicePolicy=closed
{devices}ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=yes
{paths}NoNewPrivileges=yes
{caps}{kernel}{realtime}RestrictSUIDSGID=yes
LockPersonality=yes
{mdwe}RemoveIPC=yes
KeyringMode=private
SystemCallArchitectures=native
SystemCallFilter=@system-service
{syscall_deny}SystemCallErrorNumber=EPERM
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX
LimitMEMLOCK=infinity
"""


#: The kernel's own interfaces, closed to every system unit the tool writes (llama-server's
#: and the HAProxy front's).
KERNEL_SANDBOX = """\
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
RestrictNamespaces=yes
"""


def _system_hardening(env_file: str, key_stage: str, state_directory: str, site: Site) -> str:
    if site.nice:
        # --prio N: setpriority/sched_setscheduler need CAP_SYS_NICE and @resources
        caps = "CapabilityBoundingSet=CAP_SYS_NICE\nAmbientCapabilities=CAP_SYS_NICE\n"
        syscall_deny, realtime = "SystemCallFilter=~@privileged\n", ""
    else:
        caps = "CapabilityBoundingSet=\nAmbientCapabilities=\n"
        syscall_deny, realtime = (
            "SystemCallFilter=~@privileged @resources\n",
            "RestrictRealtime=yes\n",
        )
    return _SYSTEM_HARDENING.format(
        state_directory=state_directory,
        groups=f"SupplementaryGroups={' '.join(site.groups)}\n" if site.groups else "",
        env_credential=ENV_CREDENTIAL,
        env_file=env_file,
        key_credential=KEY_CREDENTIAL,
        key_stage=key_stage,
        devices="".join(f"DeviceAllow={d} rw\n" for d in GPU_DEVICES),
        paths="".join(f"BindReadOnlyPaths={p}\n" for p in site.read_only_paths),
        caps=caps,
        kernel=KERNEL_SANDBOX,
        realtime=realtime,
        mdwe="MemoryDenyWriteExecute=yes\n"
        if site.memory_deny_write_execute
        else "# MemoryDenyWriteExecute= off: this site's GPU driver compiles code at run time\n",
        syscall_deny=syscall_deny,
    )


def host_groups() -> tuple[str, ...]:
    """The GPU groups this host has (a group systemd cannot find fails the unit)."""
    import grp

    found = []
    for g in GPU_GROUPS:
        try:
            grp.getgrnam(g)
            found.append(g)
        except KeyError:
            pass
    return tuple(found)


def state_directory(template: bool) -> str:
    """The unit's ``StateDirectory=`` (a folder under /var/lib), as ``render`` writes it;
    ``%i`` is each instance's name."""
    return "llama-server@%i" if template else "llama-server"


#: systemd's strict user name (src/basic/user-util.c ``valid_user_group_name``): what a name
#: must be for ``DynamicUser=`` to take the unit's own name rather than a hash of it
_USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,30}")


def dynamic_user(unit: str) -> str | None:
    """The user ``DynamicUser=yes`` without ``User=`` gives ``unit``: its name up to the
    ``@`` (src/core/unit.c ``user_from_unit_name``: every instance of a template shares it),
    or None where systemd would hash the name (``_du...``), which no other unit can name."""
    prefix = unit_prefix(unit)
    return prefix if _USER_NAME.fullmatch(prefix) else None


def unit_prefix(unit: str) -> str:
    """``unit``'s name up to its ``@`` (the whole name, less ``.service``, without one)."""
    return unit.removesuffix(".service").split("@", 1)[0]


#: The file of one instance's own site settings, in ``llama-server@NAME.service.d/``: the
#: template is shared by every instance, so what ``install --instance NAME`` is given for
#: that one instance goes here (systemd reads it after the template).
SITE_DROPIN = "50-llama-launcher-site.conf"


def site_dropin(site: Site, shared: Site) -> str | None:
    """The drop-in that gives one instance of the template the site settings ``site`` on top
    of the template's own (``shared``); None when they are the template's."""
    own = [p for p in site.read_only_paths if p not in shared.read_only_paths]
    lines = [f"BindReadOnlyPaths={p}" for p in own]
    if not site.memory_deny_write_execute and shared.memory_deny_write_execute:
        lines.append("MemoryDenyWriteExecute=no")
    if site.nice and not shared.nice:
        # the template's bounding set is empty and its filter denies @resources: the same
        # three lines as a rendered unit with nice, the filter reset first
        lines += [
            "CapabilityBoundingSet=CAP_SYS_NICE",
            "AmbientCapabilities=CAP_SYS_NICE",
            "SystemCallFilter=",
            "SystemCallFilter=@system-service",
            "SystemCallFilter=~@privileged",
            "RestrictRealtime=no",
        ]
    if not lines:
        return None
    return (
        _HEADER
        + "\n# This instance's own site settings (install --instance), on top of the template.\n"
        + "[Service]\n"
        + "".join(f"{line}\n" for line in lines)
    )


def exec_word(word: str) -> str:
    """One word of an ``ExecStart=`` line, written so that systemd reads it back as it is
    (systemd.service(5), "Command lines"): ``%`` and ``$`` doubled (a specifier, a
    variable), and a word holding a space, a quote, a backslash or a control character in
    double quotes, with C escapes. For a concrete value: a ``%i`` meant as a specifier is
    not one."""
    word = word.replace("%", "%%").replace("$", "$$")
    if word and not any(c.isspace() or c in "\"'\\;" or not c.isprintable() for c in word):
        return word
    escaped = "".join(_ESCAPES.get(c, c) for c in word)
    return f'"{escaped}"'


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def key_stage_path(state_dir: str) -> str:
    """Where the prestart step copies the API key for the unit's ``LoadCredential=``: in the
    state folder (root only), because systemd loads the credentials for the ExecStartPre=
    too, so the file must exist before the first start of every boot."""
    return f"{state_dir}/api-key"


_LLAMA_STOP = """\
# llama-server does not drain: a busy one cuts its streams at SIGTERM, then lingers (~30 s
# measured, b11434) with nothing left to finish; idle it exits in ~20 ms. A deploy saves the
# slots before its restart, so the SIGKILL at 10 s loses nothing and serves again sooner.
TimeoutStopSec=10"""

#: a vLLM unit's TimeoutStopSec: vLLM drains for its --shutdown-timeout (at most
#: ``launcher.config.vllm.MAX_SHUTDOWN``), then tears its engine down (seconds)
VLLM_STOP_SECONDS = 60
_VLLM_STOP = f"""\
# vLLM drains what is in flight for its --shutdown-timeout, then stops its engine (7-10 s
# with 10, measured on a CPU); a stop that hangs on an open connection (its default abort
# mode, seen 2 times in 5) is ended here with SIGKILL, and the deploy says so.
TimeoutStopSec={VLLM_STOP_SECONDS}
# vLLM's temporary files (its processes' IPC sockets, a distributed-init file) go in a folder
# of this unit's own (TMPDIR), which systemd removes at every stop, however it ended
RuntimeDirectory=%N
RuntimeDirectoryMode=0700"""

#: what a unit's server is: its Description= and Documentation=
_SERVERS = {
    "llama-server": (
        "llama.cpp llama-server",
        "https://github.com/ggml-org/llama.cpp/tree/master/tools/server",
        _LLAMA_STOP,
    ),
    "vllm": ("vLLM server", "https://docs.vllm.ai/en/latest/cli/serve/", _VLLM_STOP),
}


def render(
    python: str = DEFAULT_PYTHON,
    package_dir: str = DEFAULT_PACKAGE_DIR,
    env_file: str = "/etc/llama-launcher/llama-server.env",
    scope: Literal["system", "user"] = "system",
    template: bool = False,
    state_dir: str | None = None,
    site: Site | None = None,
    server: Literal["llama-server", "vllm"] = "llama-server",
) -> str:
    """The unit file text. ``template`` renders ``llama-server@.service`` (one env file per
    instance, ``%i``); ``state_dir`` is the unit's generation store (default: the system
    scope's ``/var/lib/llama-launcher/<unit>``); ``server``: what the env file runs."""
    name, docs, stop = _SERVERS[server]
    unit = "llama-server@%i" if template else "llama-server"
    state = state_dir or f"/var/lib/llama-launcher/{unit}"
    system = scope == "system"
    key_stage = key_stage_path(state)
    return _TEMPLATE.format(
        server=name,
        docs=docs,
        stop=stop,
        what=" instance %i" if template else "",
        after=("After=network-online.target\nWants=network-online.target\n" if system else ""),
        python=python,
        package_dir=package_dir,
        env_file=env_file,
        state_dir=state,
        prestart=_PRESTART.format(
            python=python,
            env_file=env_file,
            state_dir=state,
            # the deploy lock of this unit (launcher.deploy.home.lock_path; %n is the unit's name)
            lock=f"{SYSTEM_LOCK_DIR}/%n.lock",
            key_stage=key_stage,
        )
        if system
        else "",
        ident="llama-server-%i" if template else "llama-server",
        port="",
        hardening=_system_hardening(env_file, key_stage, state_directory(template), site or Site())
        if system
        else _USER_HARDENING,
        install=f"\n[Install]\nWantedBy={'multi-user.target' if system else 'default.target'}\n",
    )


def render_standby(
    unit: str,
    port: int,
    python: str = DEFAULT_PYTHON,
    package_dir: str = DEFAULT_PACKAGE_DIR,
    env_file: str = "/var/lib/llama-launcher/llama-server/standby.env",
    scope: Literal["system", "user"] = "system",
    state_dir: str | None = None,
    site: Site | None = None,
    server: Literal["llama-server", "vllm"] = "llama-server",
) -> str:
    """The unit file of ``unit``'s second instance (``launcher.deploy.restart.standby``):
    llama-server on the front's standby ``port``, from an env file of its own (``env_file``:
    the config it serves while the unit restarts, then keeps warm), with the unit's own
    hardening, user and ``StateDirectory=`` (so each reads the other's saved slots). No
    prestart (only a deployer starts it, under the unit's lock, after writing its env file)
    and no ``[Install]``: it is never enabled, and a boot starts the unit alone."""
    name = unit.removesuffix(".service")
    state = state_dir or f"/var/lib/llama-launcher/{name}"
    system = scope == "system"
    key_stage = f"{state}/standby-api-key"  # its own (launcher.deploy.restart.standby.key_stage)
    hardening = _USER_HARDENING
    if system:
        user = dynamic_user(unit)
        if user is None:
            raise ValueError(
                f"{unit}: systemd gives it a hashed dynamic user, which no unit can name"
            )
        # the unit's own StateDirectory=, whatever its name; an instance's has its name in it
        _, at, instance = name.partition("@")
        shared = state_directory(bool(at)).replace("%i", instance)
        hardening = _system_hardening(env_file, key_stage, shared, site or Site()).replace(
            "DynamicUser=yes\n",
            f"DynamicUser=yes\n# the unit's own user: its StateDirectory (the saved slots) is "
            f"shared\nUser={user}\n",
            1,
        )
    label, docs, stop = _SERVERS[server]
    return _TEMPLATE.format(
        server=label,
        docs=docs,
        stop=stop,
        what=f" (the second instance of {unit})",
        after=("After=network-online.target\nWants=network-online.target\n" if system else ""),
        python=python,
        package_dir=package_dir,
        env_file=env_file,
        prestart="# started only by a deployer of the unit, under its lock: no prestart step\n",
        port=f" --port {port}",
        ident=f"{name}-b",
        hardening=hardening,
        install="# never enabled: a boot starts the unit alone\n",
    )


#: The last line of a unit file install writes: the hash of the lines above it, so a hand
#: edit (which install would lose) is told apart from an older rendering (which it updates).
_STAMP = "# llama-launcher {digest}: install replaces this file, and refuses to replace a hand edit"


def stamp(text: str) -> str:
    """``text`` with its stamp line."""
    return text + _STAMP.format(digest=hashlib.sha256(text.encode()).hexdigest()[:16]) + "\n"


def hand_edited(text: str) -> bool:
    """True when ``text`` is not a unit file install wrote, unchanged. A file of a release
    before the stamp (its first line, no stamp) counts as a rendering: it is updated."""
    body, _, last = text.rstrip("\n").rpartition("\n")
    if text.startswith(_HEADER) and not last.startswith("# llama-launcher "):
        return False
    return stamp(body + "\n") != text


def this_python() -> tuple[str, str]:
    """(the interpreter running llama-launcher, the folder holding the ``launcher`` package)."""
    import sys

    import launcher

    return sys.executable, str(Path(launcher.__file__).resolve().parent.parent)


def default_files() -> dict[str, str]:
    """The files shipped in ``units/``: the defaults of ``render``, stamped as install
    writes them (install updates a copy of them in place)."""
    return {
        "llama-server.service": stamp(render()),
        "llama-server@.service": stamp(
            render(env_file="/etc/llama-launcher/%i.env", template=True)
        ),
    }
