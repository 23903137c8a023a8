"""One live sample of a unit: read, aggregate into the live generation's record, judge a
running bake on it, write the metrics file, warn.

What one sample reads, each source on its own (one that cannot be read is named in the
outcome, and the others go on): the unit's state, llama-server's ``/health``, ``/slots``
and ``/metrics``, the process's ``/proc`` files, the unit's journal since the cursor of the
sample before, and the front's 5xx counters (``launcher.watch.reads``). It adds what
changed to the live generation's record (``launcher.watch.record``) and writes nothing when
nothing did; it keeps its own state (the counters, the journal cursor, the process it
counted for) in ``STATE_DIR/watch/sampler.json``, whose mtime is the time of the last
sample (``launcher.watch.sampler``). A server that lives but does not answer is counted,
and restarted after ``wedged_samples`` such samples in a row (``launcher.watch.wedge``). The
live generation's running bake is judged on the sample (``launcher.watch.bake.step``);
``launcher.watch.carry`` takes one sample after another while it runs.

The deploy and the sampler: the sampler never takes the unit's deploy lock, so a deploy
never waits for it. It takes a lock of its own (``STATE_DIR/watch/lock``, never waited
for: a second sampler at the same moment skips), reads the store without a lock (its files
are replaced atomically), skips while a deploy is in progress (``txn.json`` of a live
deployer), and throws its reads away when the live generation changed while it read. A
sample writes its own files only; a failure to write one (a full disk) leaves that file
whole, as it was, and is named in the outcome.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from launcher.deploy import store
from launcher.errors import StoreError
from launcher.host import journalread
from launcher.host.systemd import Systemd, UnitState
from launcher.server import metrics, serverlog, slots, vllm
from launcher.watch import bake, record, textfile, verdict, wedge
from launcher.watch.reads import Reads, pressure_of, process_of, read_all
from launcher.watch.sampler import (
    Outcome,
    State,
    Target,
    default_writer,
    deploying,
    load_state,
    own_lock,
    state_path,
)

#: Warn when the pool, or a slot's cap, is this full; warn again only after it fell under
#: ``CLEAR_AT``.
WARN_AT = 0.9
CLEAR_AT = 0.8


def deployed_at(gen: store.Generation) -> float:
    """When the generation's deploy stored it, before the restart: its process logs after."""
    return float(gen.meta.get("time") or 0)


# -- one sample ------------------------------------------------------------------------------


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
    ``peak``: the fullest look at the slots since the sample before, the carry's:
    ``launcher.watch.carry``)."""
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
    reads = read_all(target, systemd, gen, state.cursor, since, transport)
    if st.live_number() != live or deploying(st):
        out.skipped = "a deploy began while the sample read: its reads were thrown away"
        return
    run, why = wedge.count(target, gen, reads, state, transport, out)  # before _delta: the counters
    previous = _close_previous(st, state, gen, reads, write, out)
    rec = record.load(gen.path, live, repair=True)
    rec.begin(bake.served_from(gen))
    delta, pressure = _delta(clock(), gen, reads, state, rec, previous, out)
    out.unread, out.lost = reads.unread, reads.journal.lost
    out.pressure = pressure.to_dict() if pressure else None
    admitted = reads.admission is not None and reads.admission.pool > 0
    out.warnings += _warnings(target, None if admitted else pressure, delta, state)
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
        wedge.restart(
            target, systemd, st, live, state, out, lambda: _save_state(target, state, write, out)
        )
    _settle(target, st, out)
    textfile.bake_lines(st, page)  # after the judge: the file says this sample's verdict
    wedge.page_lines(state, page)
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
            b,
            delta.t,
            delta.counts,
            busy,
            reads.unit,
            reads.unread,
            pressure,
            peak,
            wedged,
            stuck,
            delta.now.deferred,
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


def default_revert(b: bake.Bake, why: verdict.Verdict) -> dict[str, Any]:
    """The revert a bake's revert verdict runs (``launcher.watch.revert.revert``): imported
    when a revert is decided, since the deployer's typed config is most of a sample's CPU
    time otherwise (the sampler's timer runs a sample a minute)."""
    from launcher.watch import revert

    assert b.previous is not None
    return revert.revert(b.generation, b.previous, b.settings, b.policy.drain, why)


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
        answered = vllm.access(line.text)
        if answered is not None:  # vLLM's access log: one line a request, with its status
            for name in answered:
                counts[name] += 1
            continue
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
    gauges = reads.metrics.gauges if reads.metrics else {}
    if store.runs_vllm(gen.meta):
        # vLLM: its KV use, requests running and waiting (preempted ones wait) from /metrics
        seen = record.Now(
            up=reads.metrics is not None,
            pool=_permille(gauges.get("kv_cache_usage")),
            slot_fill=None,
            busy=_int(gauges.get("requests_processing")),
            deferred=_int(gauges.get("requests_deferred")),
            memory=reads.memory.growth if reads.memory else None,
        )
    else:
        seen = record.Now(
            up=reads.slots is not None,
            pool=_permille(pressure.use if pressure else None),
            slot_fill=_permille(pressure.max_fill if pressure else None),
            busy=pressure.busy_slots if pressure else None,
            deferred=_int(gauges.get("requests_deferred")),
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
    ident = process_of(reads)
    prev = state.counters if state.process == ident else {}
    cur = m.counters
    names = {
        "prompt_tokens": "prompt_tokens_total",
        "prompt_seconds": "prompt_seconds_total",
        "decode_tokens": "tokens_predicted_total",
        "decode_seconds": "tokens_predicted_seconds_total",
    }
    if "preemptions_total" in cur:  # vLLM's sequences put back to wait
        names["preemptions"] = "preemptions_total"
    if any(cur.get(c, 0) < prev.get(c, 0) for c in names.values()):
        prev = {}  # counters went back: a process this reader took for the same one
    deltas = {k: cur.get(c, 0) - prev.get(c, 0) for k, c in names.items()}
    state.process, state.counters = ident, dict(cur)
    rate = metrics.rate(deltas["decode_tokens"], deltas["decode_seconds"])
    if rate is not None:
        state.decode_tps = round(rate, 3)
    out.decode_tps = rate
    return deltas


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
        answered = vllm.access(line.text)
        if answered is not None:
            if "failures" not in answered:
                continue
            kind = answered[-1]
        elif serverlog.tally(line.text) != "failures":
            continue
        else:
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
    """A pool near full (none given ``pressure`` None: the front admits against the pool,
    so a full one makes requests wait, none fail) and the overflows since the last sample."""
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
