"""What one sample reads of the unit, each source on its own (one that cannot be read is
named in ``Reads.unread``, and the others go on): the unit's state (``systemctl show``),
llama-server's ``GET /health`` (bounded: ``HEALTH_TIMEOUT``), ``GET /slots`` and
``GET /metrics`` (counters only: ``launcher.server.metrics``), the process's
``/proc/PID/status`` (``RssAnon + VmSwap``) and ``/proc/PID/stat``, the unit's journal since
the cursor of the sample before (``launcher.host.journalread``), and the front's 5xx
counters; and ``look``, the slots alone, between a bake's samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from launcher.deploy import keys, store
from launcher.deploy.restart import admission, front
from launcher.errors import LauncherError, Unreadable
from launcher.host import journalread, procfs
from launcher.host.systemd import Systemd, UnitState
from launcher.server import httpclient, metrics, probe, slots
from launcher.server.httpclient import url_from_argv
from launcher.watch.sampler import Target

#: The HTTP timeout of one read: /slots and /metrics are high-priority tasks, answered
#: between two decode batches.
HTTP_TIMEOUT = 10.0
#: Seconds ``/health`` may take: answered by llama-server's HTTP threads at once, busy or not
#: (a read that does not answer within it is a wedged sample: ``launcher.watch.wedge``).
HEALTH_TIMEOUT = 5.0
#: A look at /slots between a bake's samples (``look``): short, a look never holds a sample up
LOOK_TIMEOUT = 1.0


@dataclass
class Reads:
    """What one read of the unit found (``read_server``; the sampler adds the journal)."""

    unit: UnitState
    slots: list[slots.Slot] | None = None
    metrics: metrics.Metrics | None = None
    memory: procfs.Memory | None = None
    journal: journalread.Read = field(default_factory=journalread.Read)
    unread: dict[str, str] = field(default_factory=dict)
    #: /health within ``HEALTH_TIMEOUT``: (status, detail) as ``probe.health`` says
    health: tuple[int | None, str] | None = None
    #: the main process's state and age (``procfs.process``)
    process: procfs.Process | None = None
    #: the HTTP sources that did not answer at all (a timeout, no connection), not refused
    silent: set[str] = field(default_factory=set)
    #: the front's HAProxy, when the unit has one: (identity, 5xx sent to clients, 5xx the
    #: server sent it), from ``show stat``
    front: tuple[str, int, int] | None = None
    #: the front's admission against the pool, when it admits (``admission.Ledger``)
    admission: admission.Ledger | None = None


def read_server(
    target: Target,
    systemd: Systemd,
    gen: store.Generation,
    transport: httpx.BaseTransport | None = None,
) -> Reads:
    """The unit's state, and when it runs its server's /health, /slots and /metrics and its
    process's memory and state: each source on its own (``Reads.unread`` says which could
    not be read, why). A server whose /health does not answer within
    ``HEALTH_TIMEOUT`` is not asked for /slots and /metrics (nor for /metrics when
    /slots did not answer: the server's loop answers both), so that a wedged server's
    sample takes about that long, not their timeouts."""
    reads = Reads(systemd.state())
    if reads.unit.running:
        try:
            key = keys.key_of_env(gen.env_text, str(gen.path / "env"))
        except LauncherError as e:  # the key file went away: read without, and say why
            key = None
            reads.unread["key"] = str(e)
        with _client(target, gen, key, transport) as client:
            _read_http(reads, client, store.runs_vllm(gen.meta))
        if reads.slots and any(s.tokens is None for s in reads.slots):
            reads.unread["slots"] = (
                f"this build's /slots has no {slots.TOKENS_FIELD} (it came with "
                f"b{slots.TOKENS_SINCE}): what the slots hold and the pool use are unknown"
            )
        reads.memory = _try(reads, "proc", lambda: procfs.memory(reads.unit.main_pid))
        reads.process = _try(reads, "proc", lambda: procfs.process(reads.unit.main_pid))
    else:
        why = f"{target.unit} is {reads.unit.active}/{reads.unit.sub}: the server is down"
        reads.unread.update({"slots": why, "metrics": why, "proc": why})
    return reads


def _read_http(reads: Reads, client: httpx.Client, vllm: bool = False) -> None:
    reads.health = probe.health(client, HEALTH_TIMEOUT)
    status, detail = reads.health
    if status is None:
        why = f"skipped: /health did not answer within {HEALTH_TIMEOUT:g}s ({detail})"
        reads.unread.update({"metrics": why} if vllm else {"slots": why, "metrics": why})
        reads.silent.update({"metrics"} if vllm else {"slots", "metrics"})
        return
    if vllm:  # no /slots: its running and waiting requests and its KV use are /metrics'
        reads.metrics = _try(reads, "metrics", lambda: metrics.read(client))
        return
    reads.slots = _try(reads, "slots", lambda: slots.read(client))
    if "slots" in reads.silent:
        why = f"skipped: /slots did not answer ({reads.unread['slots']}); the server's loop "
        reads.unread["metrics"] = why + "answers /metrics alike"
        reads.silent.add("metrics")
        return
    reads.metrics = _try(reads, "metrics", lambda: metrics.read(client))


def _client(
    target: Target,
    gen: store.Generation,
    key: str | None,
    transport: httpx.BaseTransport | None,
    timeout: float = HTTP_TIMEOUT,
) -> httpx.Client:
    url = target.base_url or url_from_argv(list(gen.meta.get("argv") or []))
    return httpclient.client(httpx.Client, url, key, timeout, transport, False)


def look(
    target: Target, gen: store.Generation, transport: httpx.BaseTransport | None = None
) -> slots.Pressure:
    """The slots alone, now (``GET /slots``: no journal, no unit, no record): the bake's
    looks at an over-committed pool between its samples (``launcher.watch.carry.carry``).
    Raises ``LauncherError`` when they cannot be read (a vLLM has none: its pool is not
    watched, ``bake.plan``)."""
    key = keys.key_of_env(gen.env_text, str(gen.path / "env"))
    with _client(target, gen, key, transport, LOOK_TIMEOUT) as client:
        return slots.Pressure(slots.read(client), (gen.meta.get("planned") or {}).get("pool_cells"))


def pressure_of(gen: store.Generation, reads: Reads) -> slots.Pressure | None:
    """The pool and the slots now, against the generation's planned pool."""
    if reads.slots is None:
        return None
    return slots.Pressure(reads.slots, (gen.meta.get("planned") or {}).get("pool_cells"))


def read_all(
    target: Target,
    systemd: Systemd,
    gen: store.Generation,
    cursor: str | None,
    since: float,
    transport: httpx.BaseTransport | None,
) -> Reads:
    """What one sample reads: the server (``read_server``), the unit's journal after
    ``cursor`` (none: from ``since``) and, when the unit has a front, its 5xx counters."""
    reads = read_server(target, systemd, gen, transport)
    try:
        reads.journal = journalread.since(target.unit, cursor, since, systemd.run)
    except LauncherError as e:
        reads.unread["journal"] = str(e)
    the_front = front.Front(target.state_dir, target.unit, systemd.scope)
    spec = the_front.spec()
    if spec is not None:
        try:
            reads.front, reads.admission = front_5xx(the_front, spec.admission)
        except LauncherError as e:
            reads.unread["front"] = str(e)
    return reads


def front_5xx(
    the_front: front.Front, admits: bool = False
) -> tuple[tuple[str, int, int], admission.Ledger | None]:
    """The front's HAProxy (its identity: a restart sets its counters back) and its
    ``hrsp_5xx`` counters: the frontend's (every 5xx a client got, less the 503s of
    admission's refusals: the front's answer to a full pool, not a failure) and the
    server's (the ones llama-server sent, which its journal already counts as failed
    requests); with ``admits``, admission's ledger (read after the counters: a refusal
    between the two reads is not counted as a failure)."""
    identity = the_front.identity()
    rows = the_front.stats()
    ledger = None
    if admits:
        with contextlib.suppress(admission.AdmissionError):  # a ledger of another version
            ledger = admission.ledger(the_front)
    sent = int(rows.get((front.FRONTEND, "FRONTEND"), {}).get("hrsp_5xx") or 0)
    if ledger is not None:
        sent = max(sent - ledger.refused_queue - ledger.refused_wait, 0)
    server = sum(
        int(rows.get((front.BACKEND, name), {}).get("hrsp_5xx") or 0)
        for name in front.SERVERS.values()
    )
    return (identity, sent, server), ledger


def _try(reads: Reads, source: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Unreadable as e:
        reads.unread[source] = str(e)
        if isinstance(e.__cause__, httpx.TransportError):
            reads.silent.add(source)
        return None


def process_of(reads: Reads) -> str:
    """The process /metrics' counters belong to (its start mark, else the main pid)."""
    start = reads.metrics.process_start if reads.metrics else None
    return start or f"pid {reads.unit.main_pid}"
