"""The systemd unit files, rendered from one template.

The files in the repository's ``units/`` folder are this template rendered with the defaults
(a test keeps them equal); ``install`` renders it again with the real launcher path, env file
and scope, so a pip-installed tool needs no repository folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

DEFAULT_PYTHON = "/usr/bin/python3"
DEFAULT_PACKAGE_DIR = "/usr/local/lib/python3/dist-packages"

_TEMPLATE = """\
# Rendered by llama-launcher; `llama-launcher install` writes it with this host's paths.
[Unit]
Description=llama.cpp llama-server{what}, launched by llama-launcher
Documentation=https://github.com/ggml-org/llama.cpp/tree/master/tools/server
{after}# A bad config must never loop: at most 5 starts in 5 minutes (manual restarts count too;
# `llama-launcher rollback` runs `systemctl reset-failed` first).
StartLimitIntervalSec=300
StartLimitBurst=5

[Service]
Type=exec
# `llama-launcher exec` without site-packages processing (-S): it needs only the standard
# library and its own package, and it runs on every start. It execs llama-server itself.
Environment=PYTHONPATH={package_dir}
ExecStart={python} -S -m launcher exec --env-file {env_file}
Restart=on-failure
RestartSec=2
# 78 (EX_CONFIG): the launcher refused the env file; restarting cannot fix that.
RestartPreventExitStatus=78
TimeoutStartSec=30
TimeoutStopSec=30
KillMode=mixed
SyslogIdentifier={ident}
# Hardening that keeps the model readable and a GPU reachable (no PrivateDevices=).
NoNewPrivileges=yes
LockPersonality=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
LimitMEMLOCK=infinity

[Install]
WantedBy={wanted_by}
"""


def render(
    python: str = DEFAULT_PYTHON,
    package_dir: str = DEFAULT_PACKAGE_DIR,
    env_file: str = "/etc/llama-launcher/llama-server.env",
    scope: Literal["system", "user"] = "system",
    template: bool = False,
) -> str:
    """The unit file text. ``template`` renders ``llama-server@.service`` (one env file per
    instance, ``%i``)."""
    return _TEMPLATE.format(
        what=" instance %i" if template else "",
        after=(
            "After=network-online.target\nWants=network-online.target\n"
            if scope == "system"
            else ""
        ),
        python=python,
        package_dir=package_dir,
        env_file=env_file,
        ident="llama-server-%i" if template else "llama-server",
        wanted_by="multi-user.target" if scope == "system" else "default.target",
    )


def this_python() -> tuple[str, str]:
    """(the interpreter running llama-launcher, the folder holding the ``launcher`` package)."""
    import sys

    import launcher

    return sys.executable, str(Path(launcher.__file__).resolve().parent.parent)


def default_files() -> dict[str, str]:
    """The files shipped in ``units/``: the defaults of ``render``."""
    return {
        "llama-server.service": render(),
        "llama-server@.service": render(env_file="/etc/llama-launcher/%i.env", template=True),
    }
