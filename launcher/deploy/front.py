"""An admission-holding front: HAProxy (Debian's 2.6) holds the public port, llama-server
listens on a private address, and a deploy holds new requests at the front while it
restarts the server.

How HAProxy 2.6 keeps new requests waiting instead of refusing them (checked on 2.6.12):

- A server in ``maint`` or ``drain`` is no help: with no usable server, a new request gets
  503 "No server is available" at once; the backend queue (``timeout queue``) holds only
  requests for servers that are *full* (``maxconn``).
- ``disable frontend`` pauses the listener. On a socket HAProxy bound itself that
  disconnects it (new connections are refused). On an *inherited* socket (``bind fd@3``,
  here from a systemd ``.socket`` unit) HAProxy only stops accepting
  (src/proto_tcp.c ``tcp_suspend_receiver``: an inherited fd is never disconnected): the
  kernel completes the handshakes and keeps the connections in the listen backlog, the
  clients' requests wait there, and ``enable frontend`` accepts them all.
- Every request comes on its own connection (``option httpclose``), so a client's next
  request is a new connection that the paused listener holds; a kept-alive connection would
  carry it past the pause.
- The socket unit owns the public port, so HAProxy itself can restart (a new front config)
  without refusing anyone either, and a stopped HAProxy is started by the first connection.

The deploy: hold (``disable frontend``) -> drain (no request in flight or queued at the
front, no slot processing) -> save slots -> restart llama-server -> gate on the private
address -> restore slots -> apply the front's new config (``set server ... addr``,
``set maxconn server``, through the runtime API on a unix socket; the file is validated
with ``haproxy -c`` and swapped atomically, the old one kept) -> release (``enable
frontend``), to the new config or, after a rollback, to the old one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from launcher.deploy import store
from launcher.errors import CommandError, ConfigInvalid, LauncherError
from launcher.host import proc

HAPROXY = "/usr/sbin/haproxy"
FRONTEND = "public"
BACKEND = "llama"
SERVER = "llama"
#: unix socket paths are limited to 108 bytes (sun_path)
SUN_PATH_MAX = 107


class FrontError(LauncherError):
    """The front (HAProxy or its runtime API) did not do what was asked."""


@dataclass(frozen=True)
class FrontSpec:
    """Where the front listens and where it sends requests; kept in ``front/front.json``."""

    public_host: str
    public_port: int
    private_host: str
    private_port: int
    haproxy: str = HAPROXY
    #: how long a request may wait in HAProxy's queue for a free slot (maxconn = slots)
    queue_timeout: float = 3600.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Front:
    """The front of one llama-server unit: its files under ``STATE/front`` and its units."""

    def __init__(self, state_dir: Path, unit: str) -> None:
        self.dir = state_dir / "front"
        self.unit = unit
        base = unit.removesuffix(".service")
        self.service = f"{base}-front.service"
        self.socket_unit = f"{base}-front.socket"

    @property
    def spec_path(self) -> Path:
        return self.dir / "front.json"

    @property
    def config_path(self) -> Path:
        return self.dir / "haproxy.cfg"

    @property
    def admin_socket(self) -> Path:
        return self.dir / "admin.sock"

    def spec(self) -> FrontSpec | None:
        """The front's spec, or None when this unit has no front."""
        try:
            data = json.loads(self.spec_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise FrontError(f"cannot read {self.spec_path}: {e}; move it aside") from e
        return FrontSpec(**data)

    def save_spec(self, spec: FrontSpec) -> None:
        store.write_json(self.spec_path, spec.to_dict())

    # -- the config file -------------------------------------------------------------------

    def render(self, spec: FrontSpec, slots: int) -> str:
        """HAProxy's config: the public listener (the socket unit's fd), one server with
        ``maxconn`` = the server's slots (more requests wait in HAProxy's queue, not in
        llama-server's), long timeouts for streamed generations."""
        if len(str(self.admin_socket)) > SUN_PATH_MAX:
            raise ConfigInvalid(
                f"the front's runtime socket {self.admin_socket} is longer than a unix socket "
                f"path may be ({SUN_PATH_MAX} bytes); use a shorter --state-dir"
            )
        return f"""\
# Rendered by llama-launcher: the front of {self.unit}. Deploys change it (validated with
# haproxy -c, swapped atomically, the old one kept as .bak); edits are replaced.
global
    stats socket {self.admin_socket} mode 600 level admin
    log stderr format short local0 notice

defaults
    mode http
    log global
    # one request per connection: a held request is a new connection in the listen backlog
    option httpclose
    timeout connect 5s
    timeout client 1h
    timeout server 1h
    timeout queue {spec.queue_timeout:g}s

frontend {FRONTEND}
    # the public socket from {self.socket_unit}; paused during a deploy, never closed
    bind "${{LLAMA_FRONT_BIND}}"
    default_backend {BACKEND}

backend {BACKEND}
    server {SERVER} {_addr(spec.private_host, spec.private_port)} maxconn {max(slots, 1)}
"""

    def validate(self, text: str, spec: FrontSpec) -> None:
        """``haproxy -c`` on the text, the public address in place of the socket unit's fd
        (``-c`` binds nothing)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=".haproxy-check-", suffix=".cfg", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            proc.run(
                [spec.haproxy, "-c", "-f", tmp],
                env=proc.base_env(LLAMA_FRONT_BIND=_addr(spec.public_host, spec.public_port)),
                timeout=30,
            )
        except CommandError as e:
            raise FrontError(f"haproxy -c refused the front's config: {e}") from e
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def live_text(self) -> str | None:
        try:
            return self.config_path.read_text()
        except FileNotFoundError:
            return None

    def swap(self, text: str) -> None:
        """Install the validated text atomically, keeping the old one as ``.bak``."""
        store.swap_env(self.config_path, text)

    # -- the units -------------------------------------------------------------------------

    def socket_text(self, spec: FrontSpec) -> str:
        return f"""\
# Rendered by llama-launcher: the public port of {self.unit}, held by systemd so that
# requests wait in the listen backlog while HAProxy is paused or restarted.
[Unit]
Description=public port of {self.unit} (llama-launcher front)

[Socket]
ListenStream={_addr(spec.public_host, spec.public_port)}
Backlog=4096
Service={self.service}

[Install]
WantedBy=sockets.target
"""

    def service_text(self, spec: FrontSpec) -> str:
        return f"""\
# Rendered by llama-launcher: HAProxy in front of {self.unit}.
[Unit]
Description=HAProxy front of {self.unit} (llama-launcher)
Requires={self.socket_unit}
After={self.socket_unit}

# started by its socket; llama-launcher validates the config (haproxy -c) before it is swapped
[Service]
Type=notify
Environment=LLAMA_FRONT_BIND=fd@3
ExecStart={spec.haproxy} -Ws -f {self.config_path}
ExecReload=/bin/kill -USR2 $MAINPID
# SIGUSR1: a soft stop, requests in flight finish (SIGTERM would cut them)
KillSignal=SIGUSR1
TimeoutStopSec=30
Restart=on-failure
RestartSec=1
NoNewPrivileges=yes
"""

    # -- the runtime API -------------------------------------------------------------------

    def command(self, line: str, timeout: float = 5.0) -> str:
        """One command on HAProxy's runtime API (the stats socket, level admin)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(str(self.admin_socket))
                s.sendall(line.encode() + b"\n")
                chunks = []
                while chunk := s.recv(65536):
                    chunks.append(chunk)
        except OSError as e:
            raise FrontError(
                f"the front's runtime API ({self.admin_socket}) did not answer {line!r}: "
                f"{e.strerror or e}; is {self.service} running?"
            ) from e
        return b"".join(chunks).decode(errors="replace")

    def stats(self) -> dict[tuple[str, str], dict[str, str]]:
        """``show stat``, by (proxy, server)."""
        text = self.command("show stat")
        lines = text.splitlines()
        if not lines or not lines[0].startswith("# "):
            raise FrontError(f"'show stat' returned no table: {text[:200]!r}")
        head = lines[0][2:].split(",")
        out = {}
        for line in lines[1:]:
            if line:
                row = dict(zip(head, line.split(","), strict=False))
                out[(row["pxname"], row["svname"])] = row
        return out

    def in_flight(self) -> int:
        """Requests the front has sent to llama-server or queued for it."""
        row = self.stats().get((BACKEND, "BACKEND"), {})
        return _int(row.get("scur")) + _int(row.get("qcur"))

    def held(self) -> bool:
        row = self.stats().get((FRONTEND, "FRONTEND"), {})
        return row.get("status") in ("PAUSED", "STOP")

    def hold(self) -> None:
        """Stop accepting: new connections wait in the socket unit's listen backlog."""
        self._expect_empty(f"disable frontend {FRONTEND}")

    def release(self) -> None:
        """Accept again: the held connections are served."""
        self._expect_empty(f"enable frontend {FRONTEND}")

    def apply(self, spec: FrontSpec, slots: int) -> None:
        """Point the running HAProxy at the spec's server with ``maxconn`` = slots."""
        self.command(
            f"set server {BACKEND}/{SERVER} addr {spec.private_host} port {spec.private_port}"
        )
        self._expect_empty(f"set maxconn server {BACKEND}/{SERVER} {max(slots, 1)}")

    def _expect_empty(self, line: str) -> None:
        out = self.command(line).strip()
        if out and "already" not in out.lower():
            raise FrontError(f"the front refused {line!r}: {out}")


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for the server's private address."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
