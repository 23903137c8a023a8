"""The long-prompt lane (``install --lane NAME``): one-off huge prompts go to a second
llama-server, so the chat agents on the main one do not wait while they are read.

Why: llama-server reads a prompt in the same batches as the other slots' tokens, so every
agent's next token waits while an 8,000-token log is read (seed 004, "Practical sizing": send
very long, one-off prompts to a second, smaller server). A second server helps where it
has compute of its own (a GPU box, another host); two servers sharing two CPU cores only
split them (the benchmarks guide has the figures).

- **The lane is a unit of its own** (``NAME-lane-LANE.service``, its env file and state
  folder beside the main unit's): its own typed config, generations, gate, rollback, bake,
  sampler and metrics; every verb that names a unit takes it with ``--lane LANE``
  (``diagnose`` and ``bench`` with ``--unit``). It listens on a private address only the
  front uses (``Record``, ``STATE/lane.json``: a deploy keeps it there). Or the lane is an
  address on another host (``--lane-address``), with no unit here.
- **The front routes by size.** The front sees a request's body, not its tokens: a POST
  whose ``Content-Length`` is over ``lane_threshold`` x ``lane_bytes_per_token`` bytes goes to
  the lane (a token of English or code is about 4 bytes in the common vocabularies; a JSON
  body adds its own), the rest to the main server. A body sent in chunks has no length to
  route by: the main server; so do the server's own tools that generate nothing
  (``/tokenize``, ``/apply-template``, the counts: ``admission.PASSIVE_PATHS``). A prompt
  too large for the lane's window gets the lane's own 400. The threshold changes at run
  time (``llama lane set BYTES`` on the runtime API), no restart of HAProxy.
- **The lane's requests never go to the main pool.** While the lane is held (its deploy:
  ``llama lane hold``, the hold's deadline one deploy's budget away, as the front's own) or
  down (its health check, ``GET /health`` every 500 ms), they wait at the front, at most
  ``lane_wait`` seconds beyond a hold; then 503 with ``Retry-After``. A deploy of the lane
  holds only the lane: the main unit's clients pass; a deploy of the main unit holds the
  whole front, the lane's clients with the main's.

The mechanism is a Lua action (``lane.lua``) before admission's on the frontend, and a
backend ``lane`` whose server has ``maxconn`` = the lane's slots (more wait in HAProxy's
queue, as the main server's do).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from launcher.deploy.restart import admission
from launcher.errors import ConfigInvalid, LauncherError

#: the Lua HAProxy loads (copied beside the front's config)
LUA = Path(__file__).with_name("lane.lua")
#: the backend and its one server
BACKEND = "lane"
SERVER = "lane"
#: the acl that is true for a request the lane action sent to the lane
ACL = "llama_lane"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,30}$")


class Front(Protocol):
    """What the lane needs of ``launcher.deploy.restart.front.Front`` (which imports this)."""

    def command(self, line: str, timeout: float = 5.0) -> str: ...

    def stats(self) -> dict[tuple[str, str], dict[str, str]]: ...


class FrontSpec(Protocol):
    """What the lane needs of ``launcher.deploy.restart.front.FrontSpec``."""

    @property
    def lane(self) -> str: ...

    @property
    def lane_host(self) -> str: ...

    @property
    def lane_port(self) -> int: ...

    @property
    def lane_slots(self) -> int: ...

    @property
    def lane_threshold(self) -> int: ...

    @property
    def lane_bytes_per_token(self) -> int: ...

    @property
    def lane_wait(self) -> float: ...

    @property
    def lane_unit(self) -> str: ...


class LaneError(LauncherError):
    """The front's lane did not do what was asked."""

    fix = (
        "llama-launcher status shows the front and its lane; install the lane again "
        "(install --lane NAME) so that the front's config loads lane.lua"
    )


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ConfigInvalid(
            f"--lane {name!r} is no lane name; use lowercase letters, digits, - or _ "
            "(a letter or digit first, 31 at most), e.g. --lane long"
        )
    return name


def unit_name(main_unit: str, name: str) -> str:
    """The lane's unit: named after the main unit, outside a template (an instance
    ``llama-server@chat`` has the lane ``llama-server-chat-lane-NAME.service``)."""
    base = main_unit.removesuffix(".service").replace("@", "-", 1)
    return f"{base}-lane-{check_name(name)}.service"


def threshold_bytes(spec: FrontSpec) -> int:
    """The body length over which a request goes to the lane (0: no lane)."""
    return spec.lane_threshold * spec.lane_bytes_per_token if spec.lane else 0


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) of ``--lane-address``."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigInvalid(
            f"--lane-address {text!r} is no address; give HOST:PORT, e.g. 10.0.0.7:8081"
        )
    return host, int(port)


# -- the front's config --------------------------------------------------------------------


def global_lines(spec: FrontSpec, threads_set: bool) -> str:
    """The global section's lane lines: the threshold, the wait, the Lua (one thread, as
    admission's, unless admission's lines set it already: ``threads_set``)."""
    threads = "" if threads_set else "    nbthread 1\n"
    return f"""\
    # the long-prompt lane: a POST body over this many bytes goes to it (llama lane set)
    setenv LLAMA_LANE_BYTES {threshold_bytes(spec)}
    setenv LLAMA_LANE_WAIT {spec.lane_wait:g}
{threads}    lua-load "${{LLAMA_FRONT_LANE_LUA}}"
"""


FRONTEND_LINES = f"""\
    # the long-prompt lane (lane.lua): a long body goes to the backend {BACKEND}, and waits
    # here while the lane is held or down
    http-request lua.llama_lane if METH_POST !llama_passive
"""
ACL_LINE = f"    acl {ACL} var(txn.llama_lane) -m bool\n"
USE_LINE = f"    use_backend {BACKEND} if {ACL}\n"


def backend_lines(spec: FrontSpec, server: str) -> str:
    """The lane's backend, its server at ``server`` (``HOST:PORT``): checked (``GET
    /health``, 200 once the model is loaded) every 500 ms, so that a lane that is down or
    loading holds its requests at the front; ``maxconn`` = its slots."""
    where = spec.lane_unit or "another host"
    return f"""
backend {BACKEND}
    # the long-prompt lane {spec.lane} ({where})
    option httpchk GET /health
    http-check expect status 200
    # a request sent as the lane went down is tried again (every second) while it restarts
    retries 10
    server {SERVER} {server} maxconn {max(spec.lane_slots, 1)} \
check inter 500ms fall 1 rise 1
"""


# -- the running front -----------------------------------------------------------------------


def _ask(front: Front, line: str, want: str) -> None:
    answer = front.command(line).strip()
    if answer != want:
        raise LaneError(f"the front answered {answer[:200]!r} to {line!r}")


def announce(front: Front, spec: FrontSpec) -> None:
    """Tell the running HAProxy the threshold (a changed one takes effect at once)."""
    _ask(front, f"llama lane set {threshold_bytes(spec)}", "set")


def hold(front: Front, seconds: float) -> None:
    """The lane's new requests wait at the front for ``seconds`` at most (or ``release``)."""
    _ask(front, f"llama lane hold {max(seconds, 0):.3f}", "hold")


def release(front: Front) -> None:
    _ask(front, "llama lane release", "release")


def resize(front: Front, slots: int) -> None:
    """The lane's server takes ``slots`` requests at once (``maxconn``; more wait in the
    front's queue)."""
    _ask(front, f"set maxconn server {BACKEND}/{SERVER} {max(slots, 1)}", "")


def in_flight(front: Front) -> int:
    """Requests the front sent to the lane or queued for it."""
    row = front.stats().get((BACKEND, "BACKEND"), {})
    total = 0
    for key in ("scur", "qcur"):
        with contextlib.suppress(ValueError):
            total += int(row.get(key) or 0)
    return total


@dataclass(frozen=True)
class Ledger:
    """``llama lane``: the threshold, whether the lane is held or up, what was routed."""

    bytes: int
    wait_limit: float
    held: bool
    hold_left: float
    up: bool
    routed: int
    main: int
    waited: int
    waiting: int
    refused_wait: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse(cls, text: str) -> Ledger:
        v = admission.fields(text)
        try:
            ints = ("routed", "main", "waited", "waiting", "refused_wait")
            return cls(
                bytes=int(float(v["bytes"])),
                wait_limit=float(v["wait_limit"]),
                held=v["held"] == "1",
                hold_left=float(v["hold_left"]),
                up=v["up"] == "1",
                **{k: int(float(v[k])) for k in ints},
            )
        except (KeyError, ValueError) as e:
            raise LaneError(f"'llama lane' answered no ledger ({e}): {text[:200]!r}") from None


def ledger(front: Front) -> Ledger | None:
    """The running HAProxy's lane; None when its config loads no lane."""
    text = front.command("llama lane")
    if not text.startswith("bytes "):
        return None
    return Ledger.parse(text)


# -- the lane unit's record ------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """What a lane unit knows of the front that routes to it (``STATE/lane.json``)."""

    name: str
    main_unit: str
    main_state_dir: str
    scope: str
    host: str
    port: int

    @property
    def systemd_scope(self) -> Literal["system", "user"]:
        return "system" if self.scope == "system" else "user"

    @staticmethod
    def path(state_dir: Path) -> Path:
        return state_dir / "lane.json"

    @classmethod
    def read(cls, state_dir: Path) -> Record | None:
        try:
            data = json.loads(cls.path(state_dir).read_text())
            return cls(**data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            raise LaneError(
                f"cannot read {cls.path(state_dir)} ({e}); install the lane again"
            ) from None

    def write(self, state_dir: Path) -> None:
        from launcher.deploy import store

        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        store.write_json(self.path(state_dir), asdict(self))
