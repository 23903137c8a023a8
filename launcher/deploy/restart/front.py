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
front, no slot processing) -> save slots -> swap the env file and the front's config
together (validated with ``haproxy -c`` before anything live changed; the transaction
record names the old text) -> restart llama-server -> gate on the private address ->
restore slots -> point the running HAProxy at the new server (``set server ... addr``,
``set maxconn server``, through the runtime API on a unix socket) -> release (``enable
frontend``), to the new config or, after a rollback, to the old one.

A hold never depends on its holder staying alive. Before it pauses, the holder writes
``front/hold.json`` (its pid, since when, and a deadline one deploy's budget away); the
path unit ``NAME-front-release.path`` starts the release watcher
(``launcher.deploy.restart.release``) while that file exists. The watcher waits for the unit's
deploy lock: a holder that dies lets go of it, and the watcher recovers the transaction
(the previous env file and front config, restarted under the hold and gated) and releases;
a holder still holding at the deadline is released without. Releasing removes the file.
HAProxy restarted during a hold (killed; its socket unit starts it again from the config on
disk, not paused) is noticed by its process (``show info``: worker pid and start time),
paused again, and what it let through unheld is recorded in the hold.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from launcher.deploy import store
from launcher.deploy.restart import admission, lane
from launcher.errors import CommandError, ConfigInvalid, LauncherError
from launcher.host import proc
from launcher.host.systemd import Systemd

if TYPE_CHECKING:
    import httpx

    from launcher.deploy.restart import drain

HAPROXY = "/usr/sbin/haproxy"
FRONTEND = "public"
BACKEND = "llama"
SERVER = "llama"
#: the backend's second server, for a second instance of the unit (``FrontSpec.standby_port``)
STANDBY = "llama_b"
#: the servers by side: ``a`` listens on ``private_port``, ``b`` on ``standby_port``
SERVERS = {"a": SERVER, "b": STANDBY}
#: unix socket paths are limited to 108 bytes (sun_path)
SUN_PATH_MAX = 107
#: the frontend's ``show stat`` status while ``disable frontend`` holds it
PAUSED = ("PAUSED", "STOP")


class FrontError(LauncherError):
    """The front (HAProxy or its runtime API) did not do what was asked."""

    fix = (
        "llama-launcher status shows the front; the message names the HAProxy command it "
        "refused or the unit to start (systemctl start NAME-front.socket NAME-front.service)"
    )


class FrontDown(FrontError):
    """HAProxy did not answer at all (not running, stopping, or its start failed), as
    opposed to answering and refusing: nothing is wrong with what was asked of it."""

    fix = "run the command the message names: it resets and starts the front's units"


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
    #: a second instance's private port (None: the backend has one server): the backend's
    #: second server, ``llama_b``; of the two, the one that does not serve is in ``maint``
    standby_port: int | None = None
    #: which server takes the requests: ``a`` (``llama`` on ``private_port``) or ``b``
    serving: str = "a"
    #: admission against the shared KV pool (``launcher.deploy.restart.admission``): a
    #: generation waits at the front until its worst case fits what the pool has left
    admission: bool = False
    #: requests that may wait for room at once; past it: 503 with Retry-After
    admission_queue: int = 64
    #: seconds a request may wait for room; past it: 503 with Retry-After
    admission_wait: float = 120.0
    #: the shared pool's cells and one slot's window, from the deploy's plan (0: a split
    #: pool or none planned yet; every request is admitted)
    pool_cells: int = 0
    slot_cells: int = 0
    #: the long-prompt lane (``launcher.deploy.restart.lane``): its name ("": none), its
    #: unit on this host ("": an address on another host), its server's address and slots
    lane: str = ""
    lane_unit: str = ""
    lane_host: str = ""
    lane_port: int = 0
    lane_slots: int = 1
    #: a request whose prompt may be longer than this many tokens goes to the lane: its body
    #: over ``lane_threshold`` x ``lane_bytes_per_token`` bytes (the front sees no tokens)
    lane_threshold: int = 0
    lane_bytes_per_token: int = 4
    #: seconds a lane request waits for a lane that is down (beyond a deploy's hold)
    lane_wait: float = 120.0

    def __post_init__(self) -> None:
        if self.lane and not (0 < self.lane_port < 65536 and self.lane_host):
            raise ValueError(
                f"lane {self.lane!r} has no address: {self.lane_host}:{self.lane_port}"
            )
        if self.lane and (self.lane_threshold < 1 or self.lane_bytes_per_token < 1):
            raise ValueError("lane_threshold and lane_bytes_per_token are 1 or more")
        if self.lane and not self.lane_wait > 0:
            raise ValueError(f"lane_wait is {self.lane_wait}; it is over 0 seconds")
        if self.admission_queue < 1:
            raise ValueError(f"admission_queue is {self.admission_queue}; it is 1 or more")
        if not self.admission_wait > 0:
            raise ValueError(f"admission_wait is {self.admission_wait}; it is over 0 seconds")
        if self.serving not in SERVERS:
            raise ValueError(f"serving is {self.serving!r}; it is 'a' or 'b'")
        if self.serving == "b" and self.standby_port is None:
            raise ValueError("serving is 'b' but there is no standby_port for it")
        if self.standby_port is not None and self.standby_port == self.private_port:
            raise ValueError(f"standby_port is private_port ({self.private_port})")

    @property
    def idle(self) -> str:
        """The side that does not serve (``b`` with no second server)."""
        return "b" if self.serving == "a" else "a"

    def port(self, side: str) -> int:
        """The private port of ``side`` (``a`` or ``b``)."""
        if side == "b":
            if self.standby_port is None:
                raise ValueError("the front has no second server (no standby_port)")
            return self.standby_port
        return self.private_port

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Hold:
    """A hold on the front, as ``front/hold.json`` records it for the release watcher."""

    pid: int  # the holder (a deployer, a recovery, the unit's prestart step)
    since: float  # when the front was first held (time.time())
    deadline: float  # the watcher releases the front then, whether the holder is gone or not
    #: the HAProxy worker that was paused ("PID:START" of ``show info``; None: it was down)
    front: str | None = None
    #: HAProxy's restarts seen during the hold (``Front.recheck``)
    restarts: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "restarts": list(self.restarts)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hold:
        return cls(
            int(data["pid"]),
            float(data["since"]),
            float(data["deadline"]),
            data.get("front"),
            tuple(data.get("restarts") or ()),
        )


class Front:
    """The front of one llama-server unit: its files under ``STATE/front`` and its units
    (their texts: ``launcher.deploy.restart.frontunits``)."""

    def __init__(
        self, state_dir: Path, unit: str, scope: Literal["system", "user"] = "user"
    ) -> None:
        self.dir = state_dir / "front"
        self.unit = unit
        self.scope: Literal["system", "user"] = scope
        #: the front's units are named after the unit, outside the llama-server template:
        #: ``llama-server@chat-front.service`` would be an instance of it, and every
        #: ``llama-server@.service.d/`` drop-in would apply to HAProxy and the watcher
        self.base = unit.removesuffix(".service").replace("@", "-", 1) + "-front"
        self.service = f"{self.base}.service"
        self.socket_unit = f"{self.base}.socket"
        self.release_path = f"{self.base}-release.path"
        self.release_service = f"{self.base}-release.service"
        self._lock_depth = 0  # how deep this object holds front/hold.lock (_hold_locked)

    @property
    def spec_path(self) -> Path:
        return self.dir / "front.json"

    @property
    def config_path(self) -> Path:
        return self.dir / "haproxy.cfg"

    @property
    def admin_socket(self) -> Path:
        """The runtime API. In system scope HAProxy runs as a user of its own that cannot
        enter the root-only state folder: the socket is in its ``RuntimeDirectory=``."""
        if self.scope == "system":
            return Path("/run") / self.base / "admin.sock"
        return self.dir / "admin.sock"

    @property
    def hold_path(self) -> Path:
        return self.dir / "hold.json"

    @property
    def hold_lock_path(self) -> Path:
        """The lock every read-modify-write of ``hold.json`` is made under (``_hold_locked``)."""
        return self.dir / "hold.lock"

    def spec(self) -> FrontSpec | None:
        """The front's spec, or None when this unit has no front."""
        try:
            data = json.loads(self.spec_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise FrontError(f"cannot read {self.spec_path}: {e}; move it aside") from e
        try:
            return FrontSpec(**data)
        except (TypeError, ValueError) as e:  # a key missing, unknown or wrong (a hand edit)
            raise FrontError(
                f"{self.spec_path} is no front spec ({e}); move it aside and run install "
                "--front haproxy again"
            ) from e

    def save_spec(self, spec: FrontSpec) -> None:
        store.write_json(self.spec_path, spec.to_dict())

    # -- the config file -------------------------------------------------------------------

    @property
    def lua_path(self) -> Path:
        """Admission's Lua beside the config (``admission.lua``: HAProxy loads it at start)."""
        return self.dir / admission.LUA.name

    @property
    def lane_lua_path(self) -> Path:
        """The lane's Lua beside the config (``lane.lua``)."""
        return self.dir / lane.LUA.name

    def render(self, spec: FrontSpec, slots: int) -> str:
        """HAProxy's config: the public listener (the socket unit's fd), one server with
        ``maxconn`` = the server's slots (more requests wait in HAProxy's queue, not in
        llama-server's), long timeouts for streamed generations; with ``admission``, the
        generations admitted against the shared pool (``admission.global_lines``)."""
        if len(str(self.admin_socket)) > SUN_PATH_MAX:
            raise ConfigInvalid(
                f"the front's runtime socket {self.admin_socket} is longer than a unix socket "
                f"path may be ({SUN_PATH_MAX} bytes); use a shorter --state-dir"
            )
        admit = spec.admission
        server = address(spec.private_host, spec.port(spec.serving))
        routes = admission.PASSIVE_LINES + lane.ACL_LINE if (admit or spec.lane) else ""
        if spec.lane:
            routes += lane.FRONTEND_LINES
        return f"""\
# Rendered by llama-launcher: the front of {self.unit}. Deploys change it (validated with
# haproxy -c, swapped atomically, the old one kept as .bak); edits are replaced.
global
    stats socket {self.admin_socket} mode 600 level admin
    log stderr format short local0 notice
{admission.global_lines(spec, server) if admit else ""}\
{lane.global_lines(spec, admit) if spec.lane else ""}
defaults
    mode http
    log global
    # one request per connection: a held request is a new connection in the listen backlog
    option httpclose
{admission.DEFAULTS_LINES if admit or spec.lane else ""}\
    timeout connect 5s
    timeout client 1h
    timeout server 1h
    timeout queue {spec.queue_timeout:g}s

frontend {FRONTEND}
    # the public socket from {self.socket_unit}; paused during a deploy, never closed
    bind "${{LLAMA_FRONT_BIND}}"
{routes}{admission.FRONTEND_LINES if admit else ""}\
{lane.USE_LINE if spec.lane else ""}\
    default_backend {BACKEND}

backend {BACKEND}
{self._servers(spec, slots)}{self._lane_backend(spec)}"""

    def _servers(self, spec: FrontSpec, slots: int) -> str:
        """The backend's server lines: the serving one, and a second instance's in ``maint``
        (``disabled``) while it does not serve."""
        sides = ("a", "b") if spec.standby_port is not None else ("a",)
        return "".join(
            f"    server {SERVERS[side]} {address(spec.private_host, spec.port(side))} "
            f"maxconn {max(slots, 1)}{' disabled' if side != spec.serving else ''}\n"
            for side in sides
        )

    def _lane_backend(self, spec: FrontSpec) -> str:
        """The long-prompt lane's backend ("" without a lane)."""
        if not spec.lane:
            return ""
        return lane.backend_lines(spec, address(spec.lane_host, spec.lane_port))

    def validate(self, text: str, spec: FrontSpec) -> None:
        """``haproxy -c`` on the text, the public address in place of the socket unit's fd
        (``-c`` binds nothing). The temporary copy is named as ``store.atomic_write`` names
        its files, so a run that finds it left by a killed process removes it
        (``store.sweep_temp``)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.dir / f".haproxy-check.cfg.tmp-{os.getpid()}"
        try:
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            proc.run(
                [spec.haproxy, "-c", "-f", str(tmp)],
                env=proc.base_env(
                    LLAMA_FRONT_BIND=address(spec.public_host, spec.public_port),
                    LLAMA_FRONT_LUA=str(admission.LUA),
                    LLAMA_FRONT_LANE_LUA=str(lane.LUA),
                ),
                timeout=30,
            )
        except CommandError as e:
            raise FrontError(f"haproxy -c refused the front's config: {e}") from e
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def live_text(self) -> str | None:
        try:
            return self.config_path.read_text()
        except FileNotFoundError:
            return None

    def swap(self, text: str, backup: bool = True) -> None:
        """Install the validated text atomically, keeping the old one as ``.bak``; admission's
        Lua beside it, as this version of the package has it."""
        admission.place(self.lua_path)
        admission.place(self.lane_lua_path, lane.LUA)
        store.swap_env(self.config_path, text, backup)

    def put_back(self, record: dict[str, Any]) -> bool:
        """The config and spec a transaction record names as the old ones (``front`` in
        ``txn.json``), back on disk; whether the record named any."""
        old = record.get("front")
        if not isinstance(old, dict):
            return False
        text = old.get("old_text")
        if text is not None and self.live_text() != text:
            self.swap(str(text), backup=False)
        if isinstance(old.get("old_spec"), dict):
            store.write_json(self.spec_path, old["old_spec"])
        return True

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
            raise FrontDown(
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

    def in_flight(self, server: str = "BACKEND") -> int:
        """Requests the front has sent to llama-server or queued for it (``server``: for
        that one of the backend's servers only)."""
        row = self.stats().get((BACKEND, server), {})
        return _int(row.get("scur")) + _int(row.get("qcur"))

    def held(self) -> bool:
        row = self.stats().get((FRONTEND, "FRONTEND"), {})
        return row.get("status") in PAUSED

    def info(self) -> dict[str, str]:
        """``show info``, by field."""
        text = self.command("show info")
        return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)

    def identity(self) -> str:
        """The HAProxy process serving the runtime API: its worker's pid and start time
        (``show info``), which a restart changes. A worker that is stopping (its master was
        killed: systemd stops what is left before it starts HAProxy again) is no front."""
        info = self.info()
        pid = info.get("Pid", "?")
        if info.get("Stopping", "0") != "0" or _orphaned(pid):
            raise FrontDown(f"HAProxy (pid {pid}) is stopping; {self.service} restarts it")
        return f"{pid}:{info.get('Start_time_sec', '?')}"

    def apply(self, spec: FrontSpec, slots: int) -> None:
        """Point the running HAProxy's serving server at the spec's address with ``maxconn``
        = slots; with a second server, the serving one ``ready`` and the other in ``maint``
        (what a switch cut short left running is put as the spec on disk says)."""
        self._point(spec, spec.serving, slots)
        if spec.standby_port is not None:
            self._expect_empty(f"set server {BACKEND}/{SERVERS[spec.serving]} state ready")
            self._expect_empty(f"set server {BACKEND}/{SERVERS[spec.idle]} state maint")

    def _point(self, spec: FrontSpec, side: str, slots: int) -> None:
        name = SERVERS[side]
        self.command(f"set server {BACKEND}/{name} addr {spec.private_host} port {spec.port(side)}")
        self._expect_empty(f"set maxconn server {BACKEND}/{name} {max(slots, 1)}")
        if spec.admission:
            try:
                admission.announce(self, spec, address(spec.private_host, spec.port(side)))
            except admission.AdmissionError as e:  # what the handover's callers handle
                raise FrontError(str(e)) from e

    def switch(
        self,
        spec: FrontSpec,
        slots: int,
        drain_timeout: float,
        old_server: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        serving: Callable[[], None] | None = None,
        busy: Callable[[httpx.Client], list[drain.Busy]] | None = None,
    ) -> tuple[FrontSpec, drain.DrainReport]:
        """Send new requests to the server that does not serve (the second instance, gated,
        with ``slots``; the caller holds the unit's deploy lock): the config and spec that
        name it as serving go on disk first, then it is ``ready`` and the one that served
        ``drain`` (HAProxy sends it nothing new; its requests finish); then a wait until the
        old one has no request in flight or queued at the front and, given ``old_server``,
        no slot processing (``busy``: how it says so, ``drain.wait_idle``'s; at most
        ``drain_timeout``; the front's count alone when it cannot say), then ``maint``. The
        new server is ready before the old one drains: with no usable server HAProxy 2.6
        answers 503 at once, so there is never such a moment; ``serving`` is called then,
        before the drain. From the first write on, the disk names the new server, so a
        HAProxy restarted then serves it, and ``apply`` of the saved spec puts a running
        HAProxy the switch left half-way as the disk says. A runtime command that fails puts
        the old config, spec and states back before it raises. ``maint`` cuts nothing: what
        the timeout left runs to its end on the old server (the report names it). Returns
        the spec that serves now and the drain's report."""
        from launcher.deploy.restart import drain  # here: prestart's lean path loads this module

        if spec.standby_port is None:
            raise FrontError("the front has one server: there is nothing to switch to")
        old, new = SERVERS[spec.serving], SERVERS[spec.idle]
        switched = replace(spec, serving=spec.idle)
        text = self.render(switched, slots)
        self.validate(text, switched)
        old_text = self.live_text()
        self._point(spec, spec.idle, slots)
        self.swap(text)
        self.save_spec(switched)
        try:
            self._expect_empty(f"set server {BACKEND}/{new} state ready")
            self._expect_empty(f"set server {BACKEND}/{old} state drain")
        except FrontError:
            with contextlib.suppress(FrontError, OSError):
                if old_text is not None:
                    self.swap(old_text, backup=False)
                self.save_spec(spec)
                self.apply(spec, slots)
            raise
        if serving is not None:
            serving()
        in_flight = functools.partial(self.in_flight, old)
        report = drain.wait_idle(old_server, drain_timeout, in_flight, sleep=sleep, busy=busy)
        if report.skipped is not None and old_server is not None:
            report = drain.wait_idle(None, drain_timeout, in_flight, sleep=sleep)
        self._expect_empty(f"set server {BACKEND}/{old} state maint")
        return switched, report

    def server_states(self) -> dict[str, str]:
        """The backend's servers and their state in ``show stat``: ``UP`` (which it calls
        ``no check``: the servers have no health check), ``MAINT``, ``DRAIN``."""
        rows = self.stats()
        states = {n: rows[(BACKEND, n)]["status"] for n in SERVERS.values() if (BACKEND, n) in rows}
        return {n: "UP" if s == "no check" else s for n, s in states.items()}

    # -- the hold ----------------------------------------------------------------------------

    def holding(self) -> Hold | None:
        """The recorded hold, or None. A record that cannot be read is a hold past its
        deadline (its watcher releases the front at once)."""
        try:
            return Hold.from_dict(json.loads(self.hold_path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return Hold(0, 0.0, 0.0)

    @contextlib.contextmanager
    def _hold_locked(self) -> Iterator[None]:
        """Hold ``front/hold.lock`` (``flock``, exclusive). Several processes change the
        record (a deployer, the release watcher, a recovery, the unit's prestart step): each
        reads it again under this lock and writes or removes it before letting go, so none
        writes back a deadline another just moved or re-creates a record another just
        removed. Sections are short (a file, at most three runtime-API commands of 5 s
        each); the lock dies with its holder. Re-entered by the same object, it is held once."""
        if self._lock_depth:
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
            return
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.hold_lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._lock_depth = 1
            try:
                yield
            finally:
                self._lock_depth = 0
        finally:
            os.close(fd)

    def hold(self, seconds: float) -> Hold:
        """Stop accepting: new connections wait in the socket unit's listen backlog. The
        hold is recorded first (``mark_held``), so that the release watcher releases the
        front within ``seconds`` if this process dies or is still holding then. A HAProxy
        that is down is started first (its socket unit would start it unpaused on the next
        connection); one that cannot be paused is not held (the record goes)."""
        hold = self.mark_held(seconds)
        try:
            self._expect_empty(f"disable frontend {FRONTEND}")
        except FrontError:
            try:
                self._start()
                self._expect_empty(f"disable frontend {FRONTEND}")
            except FrontError:
                self._drop(hold)
                raise
        return self._paused(hold)

    def pause(self, hold: Hold) -> Hold:
        """Pause a running HAProxy for a recorded hold (no start: the unit's prestart step,
        where a HAProxy that is down is paused by the watcher once its socket starts it)."""
        self._expect_empty(f"disable frontend {FRONTEND}")
        return self._paused(hold)

    def mark_held(self, seconds: float) -> Hold:
        """Record a hold by this process for ``seconds`` (taking over a recorded one: the
        deadline moves, when it began and what was seen are kept)."""
        old = self.holding()
        if old is not None and old.pid:
            with contextlib.suppress(FrontError):
                self.recheck(old, "the next holder")
        with self._hold_locked():
            now = time.time()
            old = self.holding()
            hold = Hold(os.getpid(), now, now + seconds)
            if old is not None and old.pid:
                hold = replace(hold, since=old.since, front=old.front, restarts=old.restarts)
            self._record(hold)
        return hold

    def _paused(self, hold: Hold) -> Hold:
        try:
            identity = self.identity()
        except FrontError:
            return hold  # paused; the next recheck learns which process it is
        with self._hold_locked():
            latest = self.holding()
            if latest is None or (latest.pid, latest.deadline) != (hold.pid, hold.deadline):
                return latest or hold  # released or held again meanwhile: theirs stands
            hold = replace(latest, front=identity)
            self._record(hold)
        return hold

    def _drop(self, hold: Hold) -> None:
        """Remove the record of ``hold`` (not one another holder wrote since)."""
        with self._hold_locked():
            latest = self.holding()
            if latest is not None and (latest.pid, latest.deadline) == (hold.pid, hold.deadline):
                self.hold_path.unlink(missing_ok=True)

    def _start(self) -> str:
        """Start HAProxy (a restart systemd has pending starts now) and wait until a live
        one answers; its identity. Its units are reset first (``reset-failed``): a start
        limit that HAProxy's restarts used up (an install from before the service had none)
        would refuse the start, and would have taken the socket unit down with the service.
        A start that systemd failed (it raced systemd's own restart of a killed HAProxy: the
        job ends with that one's result) is asked again (``waits.front_start``)."""
        # imported here: the unit's prestart step loads this module under python -S, and
        # never starts HAProxy
        from launcher import waits

        policy = waits.Waits()
        try:
            waits.front_start(policy, LauncherError)(self._start_units)
        except LauncherError as e:
            raise FrontDown(f"the front is down and {self.service} did not start: {e}") from e
        return str(waits.front_up(policy, FrontError)(self.identity))

    def _start_units(self) -> None:
        service = Systemd(self.service, self.scope)
        Systemd(self.socket_unit, self.scope).reset_failed()
        service.reset_failed()
        service.start(timeout=30)  # its socket unit with it (Requires=)

    def started(self) -> str:
        """The live HAProxy's identity, started first (``_start``) when it does not answer."""
        try:
            return self.identity()
        except FrontError:
            return self._start()

    def recheck(self, hold: Hold, by: str, start: bool = False) -> Hold:
        """The hold after a restart of HAProxy during it, if any: a new process (its socket
        unit starts one from the config on disk, not paused) is paused again, and what it
        let through is recorded (its requests and 5xx answers so far, how long it ran).
        ``start``: a HAProxy that is down (killed, its restart pending) is started first,
        for a caller that is about to use it. The record is read again under the lock: a
        hold released meanwhile is neither paused again nor recorded again."""
        try:
            now = self.identity()
        except FrontError:
            if not start:
                return hold  # down: new connections wait in the socket unit's backlog
            now = self._start()
        if now == hold.front:
            return hold
        with self._hold_locked():
            latest = self.holding()
            if latest is None:
                return hold  # released meanwhile: nothing holds, nothing to record
            if latest.front == now:
                return latest  # another process noticed it first
            self._expect_empty(f"disable frontend {FRONTEND}")
            event = {"pid_before": _pid(latest.front), "pid_after": _pid(now), "noticed_by": by}
            event.update(self.unheld(now))
            latest = replace(latest, front=now, restarts=(*latest.restarts, event))
            self._record(latest)
        return latest

    def unheld(self, identity: str) -> dict[str, int]:
        """What the HAProxy process ``identity`` let through before it was paused: its
        requests and their 5xx answers (its counters start at its own start), and how
        long it ran (``show info`` Uptime_sec; all 0 when another process answers)."""
        try:
            info = self.info()
            row = self.stats().get((FRONTEND, "FRONTEND"), {})
        except FrontError:
            return {}
        if f"{info.get('Pid', '?')}:{info.get('Start_time_sec', '?')}" != identity:
            return {}
        return {
            "seconds_unheld": _int(info.get("Uptime_sec")),
            "requests": _int(row.get("req_tot")),
            "answered_5xx": _int(row.get("hrsp_5xx")),
        }

    def release(self) -> None:
        """Accept again (the held connections are served), then drop the hold's record. A
        HAProxy that is down holds nobody (its socket unit starts it unpaused)."""
        with self._hold_locked():
            self._enable()
            self.hold_path.unlink(missing_ok=True)

    def release_due(self) -> Hold | None:
        """The recorded hold, released when its deadline has passed (read again under the
        lock: a holder that held again meanwhile moved it); None when it has not passed or
        no hold is recorded."""
        with self._hold_locked():
            hold = self.holding()
            if hold is None or time.time() < hold.deadline:
                return None
            self._enable()
            self.hold_path.unlink(missing_ok=True)
            return hold

    def _enable(self) -> None:
        try:
            self._expect_empty(f"enable frontend {FRONTEND}")
        except FrontError as e:
            try:
                active = Systemd(self.service, self.scope).state().active
            except LauncherError as down:
                raise FrontError(
                    f"{e}; and systemd did not say whether {self.service} runs: {down}"
                ) from down
            if active == "active":
                raise

    def _record(self, hold: Hold) -> None:
        store.write_json(self.hold_path, hold.to_dict(), durable=False)

    def state(self) -> dict[str, Any]:
        """The front for ``status``: ``open``, ``held`` (since, by which pid, until when its
        watcher waits) or ``down`` (HAProxy not running: its socket unit starts it)."""
        hold = self.holding()
        out: dict[str, Any] = {"public": None, "private": None}
        with contextlib.suppress(FrontError):
            if (spec := self.spec()) is not None:
                out["public"] = address(spec.public_host, spec.public_port)
                out["private"] = address(spec.private_host, spec.private_port)
        try:
            live = self.stats().get((FRONTEND, "FRONTEND"), {}).get("status")
        except FrontError as e:
            live, out["note"] = None, str(e)
        out["frontend"] = live
        if hold is not None:
            out.update(
                state="held",
                held_since=hold.since,
                held_by_pid=hold.pid,
                holder_alive=store.pid_alive(hold.pid) if hold.pid else False,
                release_deadline=hold.deadline,
                restarts=list(hold.restarts),
            )
        elif live in ("PAUSED", "STOP"):
            out["state"] = "held"  # by no record: the next run that takes the lock releases it
        else:
            out["state"] = "open" if live else "down"
        return out

    # -- the end of a transaction ------------------------------------------------------------

    def refusing(self, spec: FrontSpec) -> str | None:
        """Why the public port does not answer as ``spec`` says (None: it does): HAProxy not
        answering its runtime API, its frontend paused with no hold recorded (no watcher
        would release it), or its serving server at another address. A frontend paused for
        a recorded hold answers: its holder or its watcher releases it."""
        try:
            self.identity()
            rows = self.stats()
        except FrontError as e:
            return str(e)
        status = rows.get((FRONTEND, "FRONTEND"), {}).get("status")
        if status in PAUSED and self.holding() is None:
            return f"its frontend is {status} with no hold recorded"
        name, want = SERVERS[spec.serving], address(spec.private_host, spec.port(spec.serving))
        addr = rows.get((BACKEND, name), {}).get("addr")
        if addr != want:
            return f"its server {name} is at {addr or 'no address'}, not {want}"
        return None

    def revive(self, spec: FrontSpec) -> None:
        """The front as ``spec`` says: HAProxy started when it does not answer (its units
        reset first, ``_start``), its frontend enabled when no hold is recorded, its serving
        server pointed at the spec (``maxconn`` as it runs now: after a start, the config on
        disk, which the transaction wrote with the spec)."""
        self.started()
        rows = self.stats()
        if rows.get((FRONTEND, "FRONTEND"), {}).get("status") in PAUSED:
            with self._hold_locked():
                if self.holding() is None:
                    self._enable()
        row = rows.get((BACKEND, SERVERS[spec.serving]), {})
        if row.get("addr") != address(spec.private_host, spec.port(spec.serving)):
            self.apply(spec, max(_int(row.get("slim")), 1))

    def units_state(self) -> str:
        """The socket unit's and the service's states, as a person reads them."""
        parts = []
        for unit in (self.socket_unit, self.service):
            try:
                p = Systemd(unit, self.scope).show("ActiveState", "SubState", "Result")
            except LauncherError as e:
                parts.append(f"{unit}: unknown ({e})")
                continue
            parts.append(f"{unit} {p.get('ActiveState')}/{p.get('SubState')} ({p.get('Result')})")
        return ", ".join(parts)

    def start_command(self) -> str:
        """What a person runs to start the front again: a start limit reset first, then
        HAProxy restarted (its socket unit started with it, Requires=; a listening one keeps
        the connections in its backlog)."""
        ctl = "systemctl --user" if self.scope == "user" else "systemctl"
        return (
            f"{ctl} reset-failed {self.socket_unit} {self.service} && {ctl} restart {self.service}"
        )

    def _expect_empty(self, line: str) -> None:
        out = self.command(line).strip()
        if out and "already" not in out.lower():
            raise FrontError(f"the front refused {line!r}: {out}")


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def _orphaned(pid: str) -> bool:
    """Whether HAProxy's worker ``pid`` lost its master (killed: a zombie until systemd
    reaps it, then the worker is reparented; the worker is going, and systemd starts
    HAProxy again). False when /proc cannot tell (another pid namespace)."""
    try:
        ppid = _status(pid)["PPid"]
        parent = _status(ppid)
    except (OSError, KeyError):
        return False
    return parent.get("Name") != "haproxy" or parent.get("State", "").startswith("Z")


def _status(pid: str) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _pid(identity: str | None) -> int | None:
    head = (identity or "").partition(":")[0]
    return int(head) if head.isdigit() else None


def address(host: str, port: int) -> str:
    """``host:port`` as HAProxy and systemd read it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for the server's private address."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
