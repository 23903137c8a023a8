"""Admission against the shared KV pool, at the front (``install --front haproxy
--admission``): no request is killed by another's, even in a pool that promises its slots
more than it holds.

Why: in a unified pool (``-kvu``, ``-np`` auto) every slot may grow to its whole window while
all share one pool; when the busy slots fill it together, llama-server fails *every* request
in flight at once ("Context size has been exceeded"), whichever was small. The front knows
what it let in, so it can refuse to let in what would not fit:

- **The budget.** A generation's worst case is its prompt plus what it may generate
  (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens`` or ``n_predict``;
  without one, up to its slot's window), at most one slot's window (a slot never holds more:
  the server stops it there). It is admitted when that fits the pool beside the worst cases
  of the requests admitted before it and still running. Reservations end with their streams,
  so two requests admitted together never count on the same cells. Idle slots' cached
  prompts count as free: llama-server purges an idle slot's cache when a batch needs its
  cells (WARN ``purging slot N``), and that slot's next request is read again from the
  start.
- **The count.** The prompt is counted the way the server counts it: its own chat template
  (``POST /apply-template``) and tokenizer (``POST /tokenize``, with the special tokens), on
  the server the front serves from; b9093, b10405 and b11434 all have both (and
  ``/v1/messages/count_tokens`` for Anthropic's messages; ``/v1/responses/input_tokens``
  from b10405 on; a completion's string prompt goes to ``/tokenize`` alone). A count that
  cannot be made (the server busy past 10 s, or down; a body larger than HAProxy's buffer,
  or sent in chunks; a prompt of token ids, images or audio; embeddings and other POSTs) is
  replaced by the bound that is never below it: the slot's whole window. A request the
  server refuses to count (malformed, no or a wrong key: 400, 401, 403) gets that answer at
  once. The server's own tools (``PASSIVE_*``: counts, templates, slot saves) pass uncounted.
- **The queue.** A request that does not fit waits at the front, first come first served
  (a large one at the head is not overtaken), at most ``admission_queue`` requests for at most
  ``admission_wait`` seconds; past either, 503 with ``Retry-After``. A prompt no slot can hold
  is answered at once with the server's own 400 (``exceed_context_size_error``). A client
  that leaves is taken out of the queue (``option abortonclose``; so is one that only
  half-closes its side). A stopping HAProxy (a restart) answers its waiting requests 503
  with ``Retry-After: 1``: the next one takes them, rather than systemd's stop timeout.
- **What it did not admit.** Every 200 ms the front reads the server's ``/slots`` (with the
  last key that counted): busy slots beyond the generations it admitted and that still run
  (a client that went around the front, the gate's and the sampler's probes) are each
  counted as a whole window. A lower bound: an admitted generation still waiting for a slot
  hides one taken around the front.
- **When the pool cannot be read, admission goes on, said so.** ``/slots`` that does not
  answer (the server restarting, ``--no-slots``, a key no client sent yet) counts no unseen
  slot: the front's own ledger still covers every generation it let in, and ``status``
  says ``pool_read`` false. Without a pool to admit against (a split pool, whose slots
  cannot take each other's cells; an error in the Lua) a request is admitted as before
  admission existed: open, not closed, because closing would refuse every client for a
  fault of the bookkeeping, while the server's own limits still hold.

The mechanism stays inside HAProxy: a Lua action (``admission.lua``) on the frontend, whose
waits yield to HAProxy's scheduler, and a Lua filter that ends each stream's reservation. The
deploy tells a running HAProxy the new pool (``llama admission set``, on the runtime API) when
it points the front at the new server; a restarted HAProxy reads it from its config.
``llama admission`` on the runtime API is the ledger ``status``, ``top`` and the metrics read.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from launcher.errors import LauncherError

if TYPE_CHECKING:
    from launcher.server.kvlayout import PoolPlan


class Front(Protocol):
    """What admission needs of ``launcher.deploy.restart.front.Front`` (which imports this)."""

    @property
    def scope(self) -> str: ...

    @property
    def lua_path(self) -> Path: ...

    def command(self, line: str, timeout: float = 5.0) -> str: ...


class FrontSpec(Protocol):
    """What admission needs of ``launcher.deploy.restart.front.FrontSpec``."""

    @property
    def admission_queue(self) -> int: ...

    @property
    def admission_wait(self) -> float: ...

    @property
    def pool_cells(self) -> int: ...

    @property
    def slot_cells(self) -> int: ...


#: the Lua HAProxy loads (copied beside the front's config, ``Front.lua_path``)
LUA = Path(__file__).with_name("admission.lua")
#: the bounds of the waits' histogram, in seconds (the Lua's WAIT_BOUNDS)
WAIT_BOUNDS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: HAProxy's buffer, which holds a whole request body to count (a larger one is bounded)
BUFSIZE = 1 << 20
#: the POSTs admission lets pass uncounted: they generate nothing and hold no slot (the
#: server's own tools: counts, templates, slot saves, settings). Every other POST is admitted:
#: a generation is counted, anything else (embeddings, rerank, infill) bounded by a window.
#: Exact strings and ends, no regex: a hardened HAProxy (MemoryDenyWriteExecute=) cannot
#: JIT-compile one
PASSIVE_PATHS = ("/tokenize", "/detokenize", "/apply-template", "/props", "/lora-adapters")
PASSIVE_ENDS = ("/count_tokens", "/input_tokens")
PASSIVE_BEGINNINGS = ("/slots",)

DEFAULTS_LINES = """\
    # a client that leaves while its request waits (for admission, or for the lane) is
    # taken out of the wait
    option abortonclose
"""
#: the server's own tools (``PASSIVE_*``), which neither admission nor the lane takes
PASSIVE_LINES = f"""\
    acl llama_passive path {" ".join(PASSIVE_PATHS)}
    acl llama_passive path_end {" ".join(PASSIVE_ENDS)}
    acl llama_passive path_beg {" ".join(PASSIVE_BEGINNINGS)}
"""
FRONTEND_LINES = f"""\
    # admission against the shared KV pool (admission.lua; llama-launcher status shows it)
    filter lua.llama_release
    http-request wait-for-body time 10s at-least {BUFSIZE} if METH_POST !llama_passive !llama_lane
    http-request lua.llama_admit if METH_POST !llama_passive !llama_lane
"""


def pool_of(plan: PoolPlan) -> tuple[int, int]:
    """The cells admission counts against and a slot's window: a shared pool's; (0, 0) for
    split pools, whose slots cannot take each other's cells (nothing to admit against)."""
    return (plan.n_ctx, plan.n_ctx_slot) if plan.kv_unified else (0, 0)


def global_lines(spec: FrontSpec, server: str) -> str:
    """The global section's admission lines: the Lua, its settings, a buffer for a body."""
    return f"""\
    # admission: the pool and the queue's bounds; a deploy changes the pool at run time
    setenv LLAMA_ADMIT_POOL {spec.pool_cells}
    setenv LLAMA_ADMIT_SLOT {spec.slot_cells}
    setenv LLAMA_ADMIT_QUEUE {spec.admission_queue}
    setenv LLAMA_ADMIT_WAIT {spec.admission_wait:g}
    setenv LLAMA_ADMIT_SERVER {server}
    tune.bufsize {BUFSIZE}
    # one thread: HAProxy 2.6's Lua filter, on the state lua-load shares between threads,
    # corrupted its stack and crashed the worker under load with two
    nbthread 1
    lua-load "${{LLAMA_FRONT_LUA}}"
"""


def place(path: Path, source: Path = LUA) -> None:
    """This package's Lua ``source`` (admission's, or the lane's) at ``path`` (the credential
    a system-scope HAProxy is handed)."""
    text = source.read_bytes()
    with contextlib.suppress(OSError):
        if path.read_bytes() == text:
            return
    from launcher.deploy import store

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    store.atomic_write(path, text, 0o644)


class AdmissionError(LauncherError):
    """The front's admission did not take the pool it was given."""

    fix = (
        "llama-launcher status shows the front; reinstall it with "
        "install --front haproxy --admission so that its config loads admission.lua"
    )


def announce(front: Front, spec: FrontSpec, server: str) -> None:
    """Tell the running HAProxy the pool the deploy planned and the server it counts on."""
    line = f"llama admission set {spec.pool_cells} {spec.slot_cells} {server}"
    answer = front.command(line).strip()
    if answer != "set":
        raise AdmissionError(f"the front answered {answer[:200]!r} to {line!r}")


@dataclass(frozen=True)
class Ledger:
    """``llama admission``: the pool, what is reserved, waiting and refused, the waits."""

    pool: int
    slot: int
    reserved: int
    running: int
    waiting: int
    admitted: int
    waited: int
    refused_queue: int
    refused_wait: int
    refused_large: int
    #: requests the server refused when asked to count them (malformed, no or a wrong key):
    #: its answer went to the client at once
    refused_server: int
    left: int
    #: prompts counted by the server's tokenizer, those bounded by a window, and the tokens
    #: of the counted ones
    counted: int
    bounded: int
    prompt_tokens: int
    released: int
    #: busy slots the front did not admit (read from /slots), each counted as a whole window
    unseen: int
    #: whether the last read of /slots answered; reads that did not, since HAProxy started
    pool_read: bool
    pool_unread: int
    queue_limit: int
    wait_limit: float
    #: cumulative counts of waits <= each of WAIT_BOUNDS, their number and their sum
    wait_buckets: tuple[int, ...]
    wait_count: int
    wait_sum: float

    @property
    def taken(self) -> int:
        """What admission counts as taken: its reservations and the unseen busy slots."""
        return self.reserved + self.unseen * min(self.slot, self.pool)

    @property
    def free(self) -> int:
        return max(self.pool - self.taken, 0)

    @property
    def refused(self) -> int:
        return self.refused_queue + self.refused_wait + self.refused_large

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "taken": self.taken, "free": self.free, "refused": self.refused}

    @classmethod
    def parse(cls, text: str) -> Ledger:
        values = fields(text)
        try:
            return cls(
                **{
                    name: int(float(values[name]))
                    for name in (
                        "pool",
                        "slot",
                        "reserved",
                        "running",
                        "waiting",
                        "admitted",
                        "waited",
                        "refused_queue",
                        "refused_wait",
                        "refused_large",
                        "refused_server",
                        "left",
                        "counted",
                        "bounded",
                        "prompt_tokens",
                        "released",
                        "unseen",
                        "pool_unread",
                        "queue_limit",
                        "wait_count",
                    )
                },
                pool_read=values["pool_read"] == "1",
                wait_limit=float(values["wait_limit"]),
                wait_buckets=tuple(int(values[f"wait_le_{b:g}"]) for b in WAIT_BOUNDS),
                wait_sum=float(values["wait_sum"]),
            )
        except (KeyError, ValueError) as e:
            raise AdmissionError(
                f"'llama admission' answered no ledger ({e}): {text[:200]!r}"
            ) from None


def fields(text: str) -> dict[str, str]:
    """The ``key value`` lines the front's Lua answers on the runtime API (``llama
    admission``, ``llama lane``), by key."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            values[key] = value.strip()
    return values


def ledger(front: Front) -> Ledger | None:
    """The running HAProxy's ledger; None when its config loads no admission."""
    text = front.command("llama admission")
    if not text.startswith("pool "):
        return None
    return Ledger.parse(text)


def lua_env(front: Front, source: Path = LUA, copy: Path | None = None) -> str:
    """Where the front's service finds the Lua ``source`` (admission's ``LLAMA_FRONT_LUA``,
    the lane's ``LLAMA_FRONT_LANE_LUA``): its ``copy`` beside the config (default
    ``front.lua_path``), or in system scope the credential PID 1 hands it."""
    if front.scope == "system":
        return "%d/" + source.name
    return os.fspath(copy or front.lua_path)
