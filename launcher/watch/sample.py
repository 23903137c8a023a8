"""One live sample of a unit: read, aggregate into the live generation's record, write the
metrics file, warn.

What one sample reads, each source on its own (one that cannot be read is named in the
outcome, and the others go on): the unit's state (``systemctl show``), llama-server's
``GET /health`` (bounded), ``GET /slots`` and ``GET /metrics`` (counters only:
``launcher.server.metrics``), the process's ``/proc/PID/status`` (``RssAnon + VmSwap``) and
``/proc/PID/stat``, and the unit's journal since the cursor of the sample before
(``launcher.host.journalread``). It adds what changed to the live generation's record
(``launcher.watch.record``) and writes nothing when nothing did; it keeps its own state (the
counters, the journal cursor, the process it counted for) in
``STATE_DIR/watch/sampler.json``, whose mtime is the time of the last sample. A server that
lives but does not answer is counted, and restarted after ``wedged_samples`` such samples
in a row (``launcher.watch.wedge``).

The deploy and the sampler: the sampler never takes the unit's deploy lock, so a deploy
never waits for it. It takes a lock of its own (``STATE_DIR/watch/lock``, never waited
for: a second sampler at the same moment skips), reads the store without a lock (its files
are replaced atomically), skips while a deploy is in progress (``txn.json`` of a live
deployer), and throws its reads away when the live generation changed while it read. A
sample writes its own files only; a failure to write one (a full disk) leaves that file
whole, as it was, and is named in the outcome.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from launcher import waits
from launcher.deploy import budgets, home, keys, store
from launcher.deploy.restart import front
from launcher.errors import LauncherError, ProbeError, StoreError, Unreadable
from launcher.host import journalread, procfs
from launcher.host.systemd import Follower, Systemd, UnitState
from launcher.server import httpclient, metrics, probe, serverlog, slots
from launcher.server.httpclient import url_from_argv
from launcher.watch import bake, record, textfile, verdict, wedge

if TYPE_CHECKING:
    from launcher.config import ToolSettings

#: Warn when the pool, or a slot's cap, is this full; warn again only after it fell under
#: ``CLEAR_AT``.
WARN_AT = 0.9
CLEAR_AT = 0.8
#: The HTTP timeout of one read: /slots and /metrics are high-priority tasks, answered
#: between two decode batches.
HTTP_TIMEOUT = 10.0
#: A look at /slots between a bake's samples (``look``): short, a look never holds a sample up
LOOK_TIMEOUT = 1.0
#: The 1-token completion of the wedge rules is sent once, never retried: it has its bound
ONCE = waits.Waits(probe_retry=(1, 0.0))


def default_writer(path: Path, data: bytes, mode: int) -> None:
    """Atomic replace (temp file in the same folder, rename), not fsynced: a killed sampler
    leaves the old file or the new one; a power loss may cost the last samples."""
    store.atomic_write(path, data, mode, durable=False)


@dataclass(frozen=True)
class Target:
    """The unit a sample watches, and where its files are."""

    unit: str
    state_dir: Path
    textfile_dir: Path | None = None
    base_url: str | None = None
    #: wedged samples in a row that restart the unit (``launcher.watch.wedge``; 0: off)
    wedged_samples: int = wedge.SAMPLES

    @property
    def folder(self) -> Path:
        return self.state_dir / "watch"


def target_for(settings: ToolSettings, textfile_dir: Path | None = None) -> Target:
    """The unit of ``settings``, its one state folder (``launcher.deploy.home``), and the
    metrics folder (``textfile_dir``, else the setting ``metrics_textfile_dir``)."""
    return Target(
        unit=settings.unit_name,
        state_dir=home.state_dir(settings),
        textfile_dir=textfile_dir or settings.metrics_textfile_dir,
        base_url=settings.base_url,
        wedged_samples=settings.wedged_samples,
    )


@dataclass
class Outcome:
    """What one sample did (``--json`` prints ``to_dict``)."""

    unit: str
    generation: int | None = None
    skipped: str | None = None
    unread: dict[str, str] = field(default_factory=dict)
    lost: str | None = None
    wrote: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    pressure: dict[str, Any] | None = None
    counts: dict[str, float] = field(default_factory=dict)
    decode_tps: float | None = None
    #: the live generation's bake after this sample (``launcher.watch.bake``)
    bake: dict[str, Any] | None = None
    #: a wedged sample (``launcher.watch.wedge``): samples in a row, the limit, why, and
    #: whether this sample restarted the unit
    wedged: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **self.__dict__}


# -- the sampler's own state -------------------------------------------------------------------


@dataclass
class State:
    """What the next sample needs of this one (``sampler.json``)."""

    generation: int | None = None
    pid: int = 0
    process: str | None = None
    counters: dict[str, float] = field(default_factory=dict)
    cursor: str | None = None
    n_restarts: int | None = None
    #: the boot the pid and NRestarts were read in (``bake.boot_id``)
    boot: str | None = None
    #: the front's HAProxy as last read: [its identity, 5xx it sent, 5xx the server sent]
    front: list[Any] | None = None
    #: what was warned about and has not fallen under CLEAR_AT since ("pool", "slot 2")
    warned: list[str] = field(default_factory=list)
    decode_tps: float | None = None
    unread: dict[str, str] = field(default_factory=dict)
    #: the counts of the generations before the live one (the metrics' totals)
    past: dict[str, float] | None = None
    #: generation number -> outcome, and the newest deploy's time and duration
    outcomes: dict[str, str] = field(default_factory=dict)
    last_deploy: list[float | None] = field(default_factory=lambda: [None, None])
    #: the wedged samples in a row: [the process's pid, how many] (empty: none)
    wedged: list[Any] = field(default_factory=list)
    #: the last process a sample saw answer /health 200 (past its load)
    answered: int = 0
    #: the unit's restarts by the wedge rules, since this state began (the metrics' counter)
    wedged_restarts: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True, separators=(",", ":")).encode()


def state_path(target: Target) -> Path:
    return target.folder / "sampler.json"


def load_state(target: Target) -> tuple[State, float | None]:
    """The state of the sample before, and when it ran (the file's mtime)."""
    path = state_path(target)
    try:
        data = json.loads(path.read_bytes())
        known = State.__dataclass_fields__
        state = State(**{k: v for k, v in data.items() if k in known})
        if not isinstance(state.warned, list):
            state.warned = []
        if not isinstance(state.wedged, list):
            state.wedged = []
        return state, path.stat().st_mtime
    except FileNotFoundError:
        return State(), None
    except (OSError, ValueError, TypeError):
        return State(), None  # damaged: counted afresh from the live generation's start


def last_run(target: Target) -> float | None:
    """When the last sample ran (None: never)."""
    try:
        return state_path(target).stat().st_mtime
    except OSError:
        return None


@contextlib.contextmanager
def own_lock(folder: Path) -> Iterator[bool]:
    """The sampler's own lock, never waited for: False when another sample holds it."""
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                yield False
                return
            raise
        yield True
    finally:
        os.close(fd)


def deploying(st: store.Store) -> bool:
    """A deploy is in progress: its transaction record is there and its deployer lives (a
    killed deployer's record waits for the next command; sampling goes on meanwhile)."""
    txn = st.txn()
    if not txn:
        return False
    try:
        pid = int(txn.get("pid") or 0)
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return True
    return True


def deployed_at(gen: store.Generation) -> float:
    """When the generation's deploy stored it, before the restart: its process logs after."""
    return float(gen.meta.get("time") or 0)


# -- one sample ------------------------------------------------------------------------------


@dataclass
class Reads:
    """What one read of the unit found (``read_server``; the sampler adds the journal)."""

    unit: UnitState
    slots: list[slots.Slot] | None = None
    metrics: metrics.Metrics | None = None
    memory: procfs.Memory | None = None
    journal: journalread.Read = field(default_factory=journalread.Read)
    unread: dict[str, str] = field(default_factory=dict)
    #: /health within ``wedge.HEALTH_TIMEOUT``: (status, detail) as ``probe.health`` says
    health: tuple[int | None, str] | None = None
    #: the main process's state and age (``procfs.process``)
    process: procfs.Process | None = None
    #: the HTTP sources that did not answer at all (a timeout, no connection), not refused
    silent: set[str] = field(default_factory=set)
    #: the front's HAProxy, when the unit has one: (identity, 5xx sent to clients, 5xx the
    #: server sent it), from ``show stat``
    front: tuple[str, int, int] | None = None


def sample(
    target: Target,
    systemd: Systemd,
    clock: Callable[[], float] = time.time,
    write: record.Writer = default_writer,
    transport: httpx.BaseTransport | None = None,
    revert: bake.Revert | None = None,
    peak: slots.Pressure | None = None,
) -> Outcome:
    """Take one sample of ``target`` (see the module docstring); a running bake of the live
    generation is judged on it (``launcher.watch.bake.step``; ``revert``: the revert;
    ``peak``: the fullest look at the slots since the sample before, ``bake.carry``'s)."""
    t0 = time.monotonic()
    out = Outcome(target.unit)
    try:
        target.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        with own_lock(target.folder) as mine:
            if not mine:
                out.skipped = f"another sample of {target.unit} is running"
            else:
                _sample(target, systemd, clock, write, transport, out, revert, peak)
    except OSError as e:
        out.errors.append(store.write_failed(e, target.folder, "--state-dir"))
    out.seconds = round(time.monotonic() - t0, 4)
    return out


def _sample(
    target: Target,
    systemd: Systemd,
    clock: Callable[[], float],
    write: record.Writer,
    transport: httpx.BaseTransport | None,
    out: Outcome,
    revert: bake.Revert | None = None,
    peak: slots.Pressure | None = None,
) -> None:
    st = store.Store(target.state_dir)
    state, before = load_state(target)
    live = st.live_number()
    if deploying(st):
        out.skipped = f"a deploy of {target.unit} is in progress; the next sample goes on"
        return
    if live is None:
        out.skipped = f"nothing deployed for {target.unit} yet (no live generation)"
        page = textfile.page_of(target.unit, st, state, None, None, None)
        textfile.publish_page(target.textfile_dir, page, write, out)
        return
    gen = st.get(live)
    out.generation = live
    store.sweep_temp([target.folder, gen.path, *filter(None, [target.textfile_dir])])
    # the journal from the last sample on; a generation's first sample from its deploy
    since = before if before and state.generation == live else deployed_at(gen)
    reads = _read(target, systemd, gen, state, since, transport)
    if st.live_number() != live or deploying(st):
        out.skipped = "a deploy began while the sample read: its reads were thrown away"
        return
    run, why = _wedge(target, gen, reads, state, transport, out)  # before _delta: the counters
    previous = _close_previous(st, state, gen, reads, write, out)
    rec = record.load(gen.path, live, repair=True)
    rec.begin(bake.served_from(gen))
    delta, pressure = _delta(clock(), gen, reads, state, rec, previous, out)
    out.unread, out.lost = reads.unread, reads.journal.lost
    out.pressure = pressure.to_dict() if pressure else None
    out.warnings += _warnings(target, pressure, delta, state)
    state.unread = reads.unread
    changed = rec.changed_by(delta)
    if changed:
        rec.add(delta)
        if reads.journal.lost:
            rec.notes.append(reads.journal.lost)
    page = textfile.page_of(target.unit, st, state, rec, pressure, reads)  # caches in the state
    # the state first: a record written without it would be counted twice by the next sample
    if _save_state(target, state, write, out) and changed:
        _save(gen.path, rec, write, out, "live record")
    due = wedge.due(run, target.wedged_samples)
    hard = f"{run} samples in a row: {why}" if due else None
    judged = _judge(gen, rec, delta, reads, out, revert, pressure, peak, hard, why is not None)
    if due and not _reverted(judged):
        _restart(target, systemd, st, live, state, write, out)
    _settle(target, st, out)
    textfile.bake_lines(st, page)  # after the judge: the file says this sample's verdict
    _wedge_lines(state, page)
    textfile.publish_page(target.textfile_dir, page, write, out)


def _judge(
    gen: store.Generation,
    rec: record.Record,
    delta: record.Delta,
    reads: Reads,
    out: Outcome,
    revert: bake.Revert | None,
    pressure: slots.Pressure | None,
    peak: slots.Pressure | None,
    wedged: str | None = None,
    stuck: bool = False,
) -> bake.Bake | None:
    """The bake's step on this sample (after it is recorded: the judge reads the record);
    ``wedged``: the wedge rules' count reached (a hard signal), ``stuck``: this sample was
    a wedged one. Returns the bake it judged (None: none runs, or it was not recorded)."""
    row = rec.minutes[-1] if rec.minutes else None
    minute = float(int(delta.t // record.MINUTE) * record.MINUTE)
    busy = delta.now.busy
    if row is not None and row[0] == minute and row[record.COL["busy_peak"]] is not None:
        busy = int(row[record.COL["busy_peak"]] or 0)

    def seen(b: bake.Bake) -> verdict.Seen:
        return bake.seen_of(
            b, delta.t, delta.counts, busy, reads.unit, reads.unread, pressure, peak, wedged, stuck
        )

    try:
        judged = bake.step(gen, rec, seen, revert or default_revert)
    except OSError as e:
        out.errors.append(f"the bake record was not updated (it stays as it was): {_why(e)}")
        return None
    if judged is None:
        return None
    out.bake = judged.view(delta.t)
    if judged.verdict is not None:
        out.warnings.append(bake.say(judged))
    return judged


def _reverted(judged: bake.Bake | None) -> bool:
    """This sample's verdict ran the bake's revert (which restarted the unit)."""
    return judged is not None and judged.verdict is not None and judged.verdict.state == "revert"


def _settle(target: Target, st: store.Store, out: Outcome) -> None:
    """A revert whose sampler was killed during it: its bake settled once the deploy's
    recovery handled the transaction (``launcher.watch.bake.settle``), a warning till then."""
    try:
        b = bake.settle(st)
    except (OSError, StoreError) as e:
        out.errors.append(f"the bake record was not updated (it stays as it was): {e}")
        return
    if b is None:
        return
    out.bake = b.view()
    if b.state == bake.REVERTING:
        out.warnings.append(
            f"bake of generation {b.generation}: its revert was cut (the sampler was killed "
            f"during it); its transaction waits for the recovery: llama-launcher recover "
            f"--unit {target.unit}"
        )
    else:
        out.warnings.append(bake.say(b))


def read_server(
    target: Target,
    systemd: Systemd,
    gen: store.Generation,
    transport: httpx.BaseTransport | None = None,
) -> Reads:
    """The unit's state, and when it runs its server's /health, /slots and /metrics and its
    process's memory and state: each source on its own (``Reads.unread`` says which could
    not be read, why). A server whose /health does not answer within
    ``wedge.HEALTH_TIMEOUT`` is not asked for /slots and /metrics (nor for /metrics when
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
            _read_http(reads, client)
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


def _read_http(reads: Reads, client: httpx.Client) -> None:
    reads.health = probe.health(client, wedge.HEALTH_TIMEOUT)
    status, detail = reads.health
    if status is None:
        why = f"skipped: /health did not answer within {wedge.HEALTH_TIMEOUT:g}s ({detail})"
        reads.unread.update({"slots": why, "metrics": why})
        reads.silent.update({"slots", "metrics"})
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
    looks at an over-committed pool between its samples (``launcher.watch.bake.carry``).
    Raises ``LauncherError`` when they cannot be read."""
    key = keys.key_of_env(gen.env_text, str(gen.path / "env"))
    with _client(target, gen, key, transport, LOOK_TIMEOUT) as client:
        return slots.Pressure(slots.read(client), (gen.meta.get("planned") or {}).get("pool_cells"))


@contextlib.contextmanager
def hard_failures(systemd: Systemd) -> Iterator[Callable[[float], bool] | None]:
    """A wait that the unit's journal cuts short (``Systemd.follow`` with a pattern): ``wake(s)``
    waits up to ``s`` seconds and returns True as soon as the server logs a request it
    failed itself (``serverlog.HARD_FAILURE_GREP``), so a bake samples at once, not at its
    next interval (``launcher.watch.bake.carry``). It follows the running process's lines
    from its start (``_process_follower``), so one it logged before the carry began (an
    overflow between the front's release and the bake's start) wakes it at once. The
    journal is read in place, so a new line wakes it within ``launcher.host.sdjournal.POLL``
    (journalctl -f, the fallback, hears of one only every 250 ms: ``scripts/bench-journal``).
    None when the journal cannot be followed (or no start found: it would replay the whole
    journal); a follower that ends (a journalctl without PCRE2) leaves plain sleeps."""
    try:
        follower = _process_follower(systemd)
    except LauncherError:
        follower = None
    if follower is None:
        yield None
        return
    with follower:

        def wake(seconds: float) -> bool:
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0:
                if follower.ended:
                    time.sleep(left)
                    return False
                if follower.read(left):
                    return True
            return False

        yield wake


def _process_follower(systemd: Systemd) -> Follower | None:
    """The unit's running process's hard failures, from its first line: matched by its pid
    (a user manager's units have no ``_SYSTEMD_INVOCATION_ID`` in the journal where journald
    cannot read the invocation from the cgroup); with none running, from its invocation's
    first entry, or the journal's end. None when no cursor can be had (it would replay the
    whole journal)."""
    state = systemd.state()
    if state.running and state.main_pid > 0:
        return systemd.follow(None, grep=serverlog.HARD_FAILURE_GREP, pid=state.main_pid)
    # no process (yet): from its invocation's first entry, or the journal's end
    invocation = state.invocation_id
    cursor = systemd.invocation_cursor(invocation) if invocation else systemd.cursor()
    return systemd.follow(cursor, grep=serverlog.HARD_FAILURE_GREP) if cursor else None


def carry(
    target: Target,
    systemd: Systemd,
    st: store.Store,
    gen: store.Generation,
    sample_once: bake.SampleOnce,
) -> bake.Bake | None:
    """``bake.carry`` of ``gen``'s bake on the live unit: its looks at the slots, the
    sampler's lock, the journal's wake and, when a hard failure reverts it for sure
    (``bake.certain``) and the unit has a front, the early hold at the journal's line
    (what the sampler's service and ``deploy --wait`` carry it with)."""
    with hard_failures(systemd) as wake:
        return bake.carry(
            st,
            gen.number,
            sample_once,
            look=lambda: look(target, gen),
            lock=lambda: own_lock(target.folder),
            wake=wake,
            brace=_early_hold(gen) if wake is not None else None,
        )


def _early_hold(gen: store.Generation) -> bake.Brace | None:
    """The early hold for ``gen``'s bake (``launcher.watch.revert.EarlyHold``), when one may
    come: made now, the deployer's modules imported now, not at the journal's line."""
    b = bake.load(gen.path)
    if b is None or not b.running or not bake.certain(b):
        return None
    from launcher.watch import revert

    return revert.EarlyHold.of(b)


def default_revert(b: bake.Bake, why: verdict.Verdict) -> dict[str, Any]:
    """The revert a bake's revert verdict runs (``launcher.watch.revert.revert``): imported
    when a revert is decided, since the deployer's typed config is most of a sample's CPU
    time otherwise (the sampler's timer runs a sample a minute)."""
    from launcher.watch import revert

    assert b.previous is not None
    return revert.revert(b.generation, b.previous, b.settings, b.policy.drain, why)


def pressure_of(gen: store.Generation, reads: Reads) -> slots.Pressure | None:
    """The pool and the slots now, against the generation's planned pool."""
    if reads.slots is None:
        return None
    return slots.Pressure(reads.slots, (gen.meta.get("planned") or {}).get("pool_cells"))


def _read(
    target: Target,
    systemd: Systemd,
    gen: store.Generation,
    state: State,
    since: float,
    transport: httpx.BaseTransport | None,
) -> Reads:
    reads = read_server(target, systemd, gen, transport)
    try:
        reads.journal = journalread.since(target.unit, state.cursor, since, systemd.run)
    except LauncherError as e:
        reads.unread["journal"] = str(e)
    the_front = front.Front(target.state_dir, target.unit, systemd.scope)
    if the_front.spec() is not None:
        try:
            reads.front = front_5xx(the_front)
        except LauncherError as e:
            reads.unread["front"] = str(e)
    return reads


def front_5xx(the_front: front.Front) -> tuple[str, int, int]:
    """The front's HAProxy (its identity: a restart sets its counters back) and its
    ``hrsp_5xx`` counters: the frontend's (every 5xx a client got) and the server's (the
    ones llama-server sent, which its journal already counts as failed requests)."""
    identity = the_front.identity()
    rows = the_front.stats()
    sent = rows.get((front.FRONTEND, "FRONTEND"), {}).get("hrsp_5xx") or 0
    server = sum(
        int(rows.get((front.BACKEND, name), {}).get("hrsp_5xx") or 0)
        for name in front.SERVERS.values()
    )
    return identity, int(sent), server


def _front_failures(reads: Reads, state: State) -> int:
    """Requests the front failed itself since the last sample (a 502 when the server cut
    the connection, a 503 with no server, a 504): the 5xx clients got beyond those the
    server sent. From zero for an HAProxy not seen before (a restart sets them back)."""
    if reads.front is None:
        return 0
    identity, sent, server = reads.front
    prev = state.front if state.front and state.front[0] == identity else None
    state.front = [identity, sent, server]
    if prev is None:
        return 0
    return max(0, (sent - int(prev[1])) - (server - int(prev[2])))


def _try(reads: Reads, source: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Unreadable as e:
        reads.unread[source] = str(e)
        if isinstance(e.__cause__, httpx.TransportError):
            reads.silent.add(source)
        return None


# -- a wedged server (launcher.watch.wedge) --------------------------------------------------


def _wedge(
    target: Target,
    gen: store.Generation,
    reads: Reads,
    state: State,
    transport: httpx.BaseTransport | None,
    out: Outcome,
) -> tuple[int, str | None]:
    """This sample under the wedge rules: the wedged samples in a row with it, and why it
    is one (None: it is not). Sends the 1-token completion when the rules ask for it. Runs
    before ``_delta``: it compares /metrics' counters with the sample before's."""
    unit = reads.unit
    if reads.health is not None and reads.health[0] == 200:
        state.answered = unit.main_pid
    look = _look_of(gen, reads, state) if unit.running and target.wedged_samples else None
    if look is not None and look.suspect:
        look = dataclasses.replace(look, completion=_completes(target, gen, transport))
    why = wedge.judge(look)
    run = wedge.run_of(state.wedged, unit.main_pid, why)
    state.wedged = [unit.main_pid, run] if run else []
    if why is not None:
        limit = target.wedged_samples
        out.wedged = {
            "pid": unit.main_pid,
            "samples": run,
            "limit": limit,
            "why": why,
            "restarted": False,
        }
        if not wedge.due(run, limit):
            out.warnings.append(
                f"{target.unit}: the server (pid {unit.main_pid}) lives but does not answer: "
                f"{why}; wedged sample {run} in a row, restarted at {limit}"
            )
    return run, why


def _look_of(gen: store.Generation, reads: Reads, state: State) -> wedge.Look:
    status, detail = reads.health or (None, "not read")
    m = reads.metrics
    before = state.counters if m is not None and state.process == _process_of(reads) else None
    silent = "metrics" in reads.silent and reads.slots is None
    return wedge.Look(
        health=status,
        detail=detail,
        zombie=reads.process is not None and reads.process.zombie,
        loaded=_loaded(gen, reads, state),
        loop=wedge.loop_of(m, silent, before),
    )


def _loaded(gen: store.Generation, reads: Reads, state: State) -> bool:
    """The unit's process is past its load: a sample saw it answer /health 200, it served
    when its generation's gate passed (it started before), or it is older than its start
    budget (sized by the generation's last load: ``launcher.deploy.budgets``). A process
    whose age cannot be read counts only once a sample saw it answer."""
    if state.answered == reads.unit.main_pid:
        return True
    if reads.process is None:
        return False
    if time.time() - reads.process.age < bake.served_from(gen):
        return True
    b = budgets.for_deploy(waits.Waits(), budgets.Load.of_meta(gen.meta))
    return reads.process.age > b.start + b.health


def _completes(
    target: Target, gen: store.Generation, transport: httpx.BaseTransport | None
) -> bool | None:
    """Whether a 1-token completion comes back within ``wedge.COMPLETION_TIMEOUT``: any
    HTTP answer counts, an error too (None: it could not be sent)."""
    try:
        key = keys.key_of_env(gen.env_text, str(gen.path / "env"))
        url = target.base_url or url_from_argv(list(gen.meta.get("argv") or []))
        with probe.Probe(url, key, transport, ONCE) as p:
            p.chat(wedge.COMPLETION_TIMEOUT, max_tokens=1)
    except ProbeError as e:
        return not isinstance(e.__cause__, httpx.TransportError)
    except LauncherError:
        return None
    return True


def _restart(
    target: Target,
    systemd: Systemd,
    st: store.Store,
    live: int,
    state: State,
    write: record.Writer,
    out: Outcome,
) -> None:
    """Restart the wedged unit (``systemctl restart --no-block``: systemd stops it, with
    ``SIGCONT`` and, at ``TimeoutStopSec``, ``SIGKILL``; the next sample sees the new
    process) and record why: the live generation's meta, the journal, the metrics. Not
    while a deploy is in progress: it restarts the unit itself."""
    assert out.wedged is not None
    pid, run, why = out.wedged["pid"], out.wedged["samples"], out.wedged["why"]
    if deploying(st) or st.live_number() != live:
        return
    try:
        systemd.restart()
    except LauncherError as e:
        out.errors.append(f"{target.unit}: the wedged server was not restarted: {e}")
        return
    out.wedged["restarted"] = True
    state.wedged, state.wedged_restarts = [], state.wedged_restarts + 1
    out.warnings.append(
        f"{target.unit}: restarted: the server (pid {pid}) lived but did not answer {run} "
        f"samples in a row: {why}"
    )
    _save_state(target, state, write, out)
    try:
        gen = st.get(live)
        kept = list(gen.meta.get("wedged_restarts") or [])
        kept.append(wedge.record_of(time.time(), pid, run, why))
        st.update(gen, wedged_restarts=kept[-wedge.KEEP :])
    except StoreError as e:
        out.errors.append(f"the wedge restart was not recorded in generation {live}: {e}")


def _wedge_lines(state: State, page: textfile.Page) -> None:
    page.add("llama_launcher_wedged_samples", state.wedged[1] if state.wedged else 0)
    page.add("llama_launcher_wedged_restarts_total", state.wedged_restarts)


def _close_previous(
    st: store.Store,
    state: State,
    gen: store.Generation,
    reads: Reads,
    write: record.Writer,
    out: Outcome,
) -> set[int]:
    """When another generation went live since the last sample: its record gets what its
    process logged and the time up to the new one's start. Returns the pids whose lines
    belonged to it."""
    old = state.generation
    if old is None or old == gen.number:
        return set()
    pids = {state.pid} if state.pid else set()
    try:
        old_gen = st.get(old)
    except StoreError:
        return pids  # purged meanwhile
    rec = record.load(old_gen.path, old, repair=True)
    counts = _tally([x for x in reads.journal.lines if x.pid in pids])
    if any(counts.values()):
        rec.add(record.Delta(bake.served_from(gen), rec.now, counts))
    rec.close(bake.served_from(gen))
    _save(old_gen.path, rec, write, out, f"live record of generation {old}")
    if state.past is not None:
        for k, v in rec.totals.items():
            state.past[k] = state.past.get(k, 0) + v
    # a new process with counters of its own; not a restart within the generation
    state.generation, state.process, state.counters = gen.number, None, {}
    state.pid, state.n_restarts = 0, None
    return pids


def _tally(lines: list[journalread.Line]) -> dict[str, float]:
    counts: dict[str, float] = dict.fromkeys(serverlog.TALLY_KEYS, 0)
    for line in lines:
        key = serverlog.tally(line.text)
        if key is None:
            continue
        counts[key] += 1
        if key == "failures":
            counts[serverlog.failure_kind(line.text)] += 1
    counts["completions"] = max(0, counts["completions"] - counts["failures"])
    return counts


def _delta(
    now: float,
    gen: store.Generation,
    reads: Reads,
    state: State,
    rec: record.Record,
    previous: set[int],
    out: Outcome,
) -> tuple[record.Delta, slots.Pressure | None]:
    lines = own_lines(
        reads.journal.lines, previous, deployed_at(gen), reads.unit.main_pid, state.generation
    )
    counts = _tally(lines)
    counts.update(_counter_deltas(reads, state, out))
    # the front's own failures are failed requests the journal never saw
    counts["failures"] = counts.get("failures", 0) + _front_failures(reads, state)
    counts["restarts"] = _restarts(reads.unit, state, gen.number)
    state.cursor = reads.journal.cursor or state.cursor
    if reads.journal.lost and not reads.journal.cursor:
        state.cursor = None
    pressure = pressure_of(gen, reads)
    seen = record.Now(
        up=reads.slots is not None,
        pool=_permille(pressure.use if pressure else None),
        slot_fill=_permille(pressure.max_fill if pressure else None),
        busy=pressure.busy_slots if pressure else None,
        deferred=_int((reads.metrics.gauges if reads.metrics else {}).get("requests_deferred")),
        memory=reads.memory.growth if reads.memory else None,
    )
    out.counts = {k: v for k, v in counts.items() if v}
    return record.Delta(now, seen, counts, _failures(lines, rec, state)), pressure


def own_lines(
    lines: list[journalread.Line],
    previous: set[int],
    deployed: float,
    main_pid: int | None,
    sampled: int | None,
) -> list[journalread.Line]:
    """The lines the live generation's processes logged: not those of the generation the
    sample before saw (``previous``, its pids), nor of any process that logged before the
    live generation's deploy (``deployed``) other than its main one: a generation that
    served between two samples (a revert, then a deploy before the next sample) logged
    them. ``sampled`` None: the first sample ever, read from the deploy on, where only the
    main process is the generation's (the replaced one logged too)."""
    older = {x.pid for x in lines if x.time < deployed} - {main_pid}
    mine = [x for x in lines if x.pid not in previous and x.pid not in older]
    if sampled is None and main_pid:
        mine = [x for x in mine if x.pid == main_pid]
    return mine


def _counter_deltas(reads: Reads, state: State, out: Outcome) -> dict[str, float]:
    """Tokens and the server's own seconds since the last sample, from /metrics' counters:
    from zero for a process not seen before (a restart sets them back)."""
    m = reads.metrics
    if m is None:
        return {}
    ident = _process_of(reads)
    prev = state.counters if state.process == ident else {}
    cur = m.counters
    names = {
        "prompt_tokens": "prompt_tokens_total",
        "prompt_seconds": "prompt_seconds_total",
        "decode_tokens": "tokens_predicted_total",
        "decode_seconds": "tokens_predicted_seconds_total",
    }
    if any(cur.get(c, 0) < prev.get(c, 0) for c in names.values()):
        prev = {}  # counters went back: a process this reader took for the same one
    deltas = {k: cur.get(c, 0) - prev.get(c, 0) for k, c in names.items()}
    state.process, state.counters = ident, dict(cur)
    rate = metrics.rate(deltas["decode_tokens"], deltas["decode_seconds"])
    if rate is not None:
        state.decode_tps = round(rate, 3)
    out.decode_tps = rate
    return deltas


def _process_of(reads: Reads) -> str:
    """The process /metrics' counters belong to (its start mark, else the main pid)."""
    start = reads.metrics.process_start if reads.metrics else None
    return start or f"pid {reads.unit.main_pid}"


def _restarts(unit: UnitState, state: State, generation: int) -> int:
    """Processes replaced within the generation since the last sample (systemd's NRestarts,
    or a new MainPID that no deploy explains)."""
    boot = bake.boot_id()
    if state.boot != boot:
        # a new boot (or the first sample that knows boots): its process is the boot's, not
        # a restart. Counted from the sample that sees it run: one taken while the unit was
        # still coming up would see the boot's process as new at the next sample
        if unit.main_pid:
            state.boot, state.generation = boot, generation
            state.pid, state.n_restarts = unit.main_pid, unit.n_restarts
        return 0
    n = 0
    if state.generation == generation and unit.main_pid and state.pid:
        grew = unit.n_restarts - state.n_restarts if state.n_restarts is not None else 0
        n = max(grew, 1 if unit.main_pid != state.pid else 0)
    state.generation = generation
    state.pid = unit.main_pid or state.pid
    state.n_restarts = unit.n_restarts
    return max(n, 0)


def _failures(
    lines: list[journalread.Line], rec: record.Record, state: State
) -> list[dict[str, Any]]:
    """The requests that failed, grouped per second and kind, each with the pool as the
    sample before it saw it."""
    events: dict[tuple[int, str], dict[str, Any]] = {}
    for line in lines:
        if serverlog.tally(line.text) != "failures":
            continue
        kind = serverlog.failure_kind(line.text)
        event = events.setdefault(
            (int(line.time), kind),
            {
                "t": round(line.time, 3),
                "kind": kind,
                "requests": 0,
                "pool_before": rec.now.pool,
                "slot_fill_before": rec.now.slot_fill,
                "sampled_before": rec.last,
            },
        )
        event["requests"] += 1
    return list(events.values())


def _warnings(
    target: Target,
    pressure: slots.Pressure | None,
    delta: record.Delta,
    state: State,
) -> list[str]:
    out = []
    if pressure is not None and pressure.known:
        over = pressure.over(WARN_AT)
        new = [k for k in over if k not in state.warned]
        if new:
            out.append(
                f"KV pool of {target.unit}: {', '.join(over.values())} (warns at "
                f"{WARN_AT:.0%}): {pressure.describe()}. When the busy slots fill the pool "
                "together every request fails with 'Context size has been exceeded': cap "
                "the slots (--kv-unified-per-slot) and size the pool for all of them "
                "(llama-launcher plan)"
            )
        # warned again only after it fell under CLEAR_AT
        state.warned = sorted({*over, *(k for k in state.warned if k in pressure.over(CLEAR_AT))})
    failed = delta.counts.get("context_exceeded", 0)
    if failed:
        before = next((f for f in delta.failures if f["kind"] == "context_exceeded"), None)
        pool = before["pool_before"] if before else None
        at = f"; the sample before saw the pool at {pool / 10:.1f} %" if pool is not None else ""
        out.append(
            f"{target.unit}: {int(failed)} request(s) failed with 'Context size has been "
            f"exceeded' since the last sample{at} (llama-launcher diagnose --unit "
            f"{target.unit})"
        )
    return out


def _permille(share: float | None) -> int | None:
    return None if share is None else round(share * 1000)


def _int(x: float | None) -> int | None:
    return None if x is None else int(x)


# -- writing ---------------------------------------------------------------------------------


def _save(path: Path, rec: record.Record, write: record.Writer, out: Outcome, what: str) -> None:
    try:
        record.save(path, rec, write)
        out.wrote.append(str(record.path_of(path)))
    except OSError as e:
        out.errors.append(f"the {what} was not updated (it stays whole, as it was): {_why(e)}")


def _save_state(target: Target, state: State, write: record.Writer, out: Outcome) -> bool:
    """Write the state when it changed (else only its mtime); False when it could not be
    written: the sample's figures are then not recorded either (the next sample counts
    them from the old state, once)."""
    path = state_path(target)
    data = state.to_bytes()
    try:
        if path.read_bytes() == data:
            os.utime(path)  # nothing changed: the mtime says when the sample ran
            return True
    except FileNotFoundError:
        pass
    except OSError as e:
        out.errors.append(f"the sampler's state was not read back: {_why(e)}")
        return False
    try:
        write(path, data, 0o600)
    except OSError as e:
        out.errors.append(
            f"the sampler's state was not updated: {_why(e)}; nothing of this sample was "
            "recorded (the next sample counts it from the old state)"
        )
        return False
    out.wrote.append(str(path))
    return True


def _why(e: OSError) -> str:
    fix = {errno.ENOSPC: "free space", errno.EDQUOT: "free space", errno.EROFS: "remount it"}
    return f"cannot write {e.filename or '?'}: {e.strerror or e}" + (
        f"; {fix[e.errno]}" if e.errno in fix else ""
    )
