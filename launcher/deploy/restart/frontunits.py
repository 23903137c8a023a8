"""The front's systemd units, rendered (``install --front haproxy`` writes them): the socket
unit that owns the public port (``NAME-front.socket``), HAProxy's service behind it
(``NAME-front.service``), and the release watcher's path and service units
(``NAME-front-release.path``, ``.service``: ``launcher.deploy.restart.release``). What they
serve, and why a socket unit holds the port, is ``launcher.deploy.restart.front``'s.
"""

from __future__ import annotations

from launcher.deploy.restart import admission, lane
from launcher.deploy.restart.front import Front, FrontSpec, address
from launcher.host import units


def socket_text(front: Front, spec: FrontSpec) -> str:
    """``NAME-front.socket``: the public port, which systemd holds for HAProxy."""
    return f"""\
# Rendered by llama-launcher: the public port of {front.unit}, held by systemd so that
# requests wait in the listen backlog while HAProxy is paused or restarted.
[Unit]
Description=public port of {front.unit} (llama-launcher front)

[Socket]
ListenStream={address(spec.public_host, spec.public_port)}
Backlog=4096
Service={front.service}

[Install]
WantedBy=sockets.target
"""


def service_text(front: Front, spec: FrontSpec) -> str:
    """``NAME-front.service``: HAProxy, started by its socket (hardened in system scope)."""
    if front.scope == "system":
        config, hardening = "%d/haproxy.cfg", _system_hardening(front)
    else:
        config, hardening = str(front.config_path), "NoNewPrivileges=yes\n"
    return f"""\
# Rendered by llama-launcher: HAProxy in front of {front.unit}.
[Unit]
Description=HAProxy front of {front.unit} (llama-launcher)
Requires={front.socket_unit}
After={front.socket_unit}
# no start limit: a socket-activated service that hits one takes its socket unit down with
# it (Result=service-start-limit-hit), and the public port refuses every connection until
# someone starts both by hand. A HAProxy killed a few times within seconds (each restart
# counts, and so does a deploy's start of it) must come back; one that cannot start at all
# (its config is validated before every swap) is tried again every RestartSec
StartLimitIntervalSec=0

# started by its socket; llama-launcher validates the config (haproxy -c) before it is swapped
[Service]
Type=notify
Environment=LLAMA_FRONT_BIND=fd@3
Environment=LLAMA_FRONT_LUA={admission.lua_env(front)}
Environment=LLAMA_FRONT_LANE_LUA={admission.lua_env(front, lane.LUA, front.lane_lua_path)}
ExecStart={spec.haproxy} -Ws -f {config}
# SIGUSR1: a soft stop, requests in flight finish (SIGTERM would cut them)
KillSignal=SIGUSR1
TimeoutStopSec=30
Restart=on-failure
RestartSec=1
{hardening}"""


def _system_hardening(front: Front) -> str:
    """HAProxy parses every client's HTTP on the public port. It needs the socket its
    socket unit bound (no privilege), its config and its runtime socket: a user of its
    own that owns nothing else, the config handed over by PID 1 as a credential (read
    at every start; a deploy changes the running process through the runtime API, so
    there is no reload), the runtime socket in its ``RuntimeDirectory=``."""
    return f"""\
# HAProxy parses every client's HTTP: a user of its own, which sees its config only as a
# credential PID 1 reads for it (at every start) and keeps its runtime socket in /run.
DynamicUser=yes
LoadCredential=haproxy.cfg:{front.config_path}
LoadCredential={admission.LUA.name}:{front.lua_path}
LoadCredential={lane.LUA.name}:{front.lane_lua_path}
RuntimeDirectory={front.admin_socket.parent.name}
RuntimeDirectoryMode=0700
UMask=0077
CapabilityBoundingSet=
AmbientCapabilities=
NoNewPrivileges=yes
PrivateDevices=yes
PrivateUsers=yes
PrivateTmp=yes
ProtectSystem=strict
ProtectHome=yes
ProcSubset=pid
{units.KERNEL_SANDBOX}RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
RemoveIPC=yes
KeyringMode=private
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
SystemCallErrorNumber=EPERM
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX
"""


def release_path_text(front: Front) -> str:
    """``NAME-front-release.path``: starts the release watcher while a hold is recorded."""
    return f"""\
# Rendered by llama-launcher: while a hold on the front of {front.unit} is recorded, its
# release watcher runs (a holder that dies, or outlives its deadline, is released).
[Unit]
Description=release watcher trigger of the front of {front.unit} (llama-launcher)

[Path]
PathExists={front.hold_path}
Unit={front.release_service}

[Install]
WantedBy=paths.target
"""


def release_service_text(front: Front, python: str, package_dir: str, where: list[str]) -> str:
    """The watcher: ``llama-launcher front-release`` with the unit's settings
    (``where``: the words ``--unit NAME --scope ... --env-file ... --state-dir ...``), run
    by the tool's own interpreter (the unit's ``python -S`` lacks its dependencies); each
    word quoted as systemd reads ``ExecStart=`` (``units.exec_word``)."""
    argv = " ".join(units.exec_word(w) for w in [python, "-m", "launcher", "front-release"])
    words = " ".join(units.exec_word(w) for w in [*where, "--json"])
    return f"""\
# Rendered by llama-launcher: releases the front of {front.unit} when the holder is gone
# (it recovers the holder's transaction first) or when the hold outlives its deadline.
[Unit]
Description=release watcher of the front of {front.unit} (llama-launcher)
# its path unit starts it while a hold is recorded, and must never be refused a start: a
# watcher that gave up would leave the front paused
StartLimitIntervalSec=0

[Service]
Type=exec
Environment=PYTHONPATH={package_dir}
ExecStart={argv} {words}
# a release that failed (HAProxy not answering) is tried again, every 5 s
Restart=on-failure
RestartSec=5
"""
