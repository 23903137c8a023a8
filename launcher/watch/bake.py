"""The bake window: a deployed generation watched for a while against the previous one, and
put back by itself when it is worse under load.

A deploy with a bake (``--bake 30m``, the setting ``bake``) writes the generation's bake
record beside its ``meta.json`` and its live record: ``generations/NNNN/bake.json``, with
the policy (the ``bake_*`` settings as they were), the baseline (the previous generation's
live record, its figures by the load they were measured at: ``launcher.watch.verdict``),
the deadline, and the settings a revert needs (the sampler's timer reads no settings).

The sampler carries the bake: every sample of the live generation judges it (``step``), and
a sample that finds a bake running keeps sampling every ``bake_interval`` until it ends
(``launcher.watch.carry``; the deploy starts that sampler at its gate and judges the bake's
first moments itself, ``launcher.watch.handoff``; ``--wait`` reads the verdict it records).
The verdicts: ``reverted`` (the revert, ``launcher.watch.revert``: one function, so a later
switch in the front can take its place), ``passed``, ``inconclusive`` (the new config
stays), and ``ended`` (a later deploy or rollback replaced the generation). A revert that
fails is ``revert_failed``; a sampler killed during its revert leaves ``reverting``, which
the next sample or ``recover`` settles from the generations once the deploy's recovery
handled the revert's transaction (``settle``). At most one revert per deploy: a bake ends
once; a revert's generation (a rollback) has no bake.

A sampler killed or a host rebooted mid-bake: the next sample resumes it (the record says
when and why); when the deadline passed meanwhile it ends ``inconclusive``. A restart seen
across a reboot (another boot: ``launcher.host.procfs.boot``) is not counted against the config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.deploy import store
from launcher.errors import StoreError
from launcher.host import procfs
from launcher.server import slots
from launcher.watch import record, verdict
from launcher.watch.verdict import Baseline, Policy, Progress, Verdict

if TYPE_CHECKING:
    from launcher.config import ToolSettings
    from launcher.host.systemd import UnitState

VERSION = 1
NAME = "bake.json"
#: The states of a bake: one running, the rest final.
RUNNING = "baking"
FINAL = ("passed", "inconclusive", "reverted", "revert_failed", "ended")
#: Every state, in the metrics' order: ``reverting`` is the revert under way (a sampler
#: killed during it leaves it so until the next sample or ``recover`` settles it).
REVERTING = "reverting"
STATES = (RUNNING, REVERTING, *FINAL)
#: ``awaited``: how often it looks whether the deploy that announced its bake is done
AWAIT_POLL = 0.02

#: The revert: given the bake and its verdict, puts the previous generation back and says
#: how it went (``launcher.watch.revert.revert``'s result as a dict: outcome, ...).
Revert = Callable[["Bake", Verdict], dict[str, Any]]


@dataclass
class Bake:
    """One generation's bake record (see the module docstring)."""

    generation: int
    started: float
    policy: Policy
    baseline: Baseline | None = None
    #: the generation the revert puts back (the one that served before)
    previous: int | None = None
    state: str = RUNNING
    progress: Progress = field(default_factory=Progress)
    verdict: Verdict | None = None
    ended: float | None = None
    #: the tool settings of the deploy, for the revert (``launcher.config.load_settings``)
    settings: dict[str, Any] = field(default_factory=dict)
    boot_id: str | None = None
    #: the revert's result (outcome, generation, message, timings, handover)
    revert: dict[str, Any] | None = None

    @property
    def deadline(self) -> float:
        return self.started + self.policy.duration

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "generation": self.generation,
            "state": self.state,
            "started": self.started,
            "deadline": self.deadline,
            "ended": self.ended,
            "previous": self.previous,
            "policy": self.policy.to_dict(),
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "progress": self.progress.to_dict(),
            "verdict": self.verdict.to_dict() if self.verdict else None,
            "revert": self.revert,
            "boot_id": self.boot_id,
            "settings": self.settings,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Bake:
        if data.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} bake record")
        return cls(
            generation=int(data["generation"]),
            started=float(data["started"]),
            policy=Policy.from_dict(data["policy"]),
            baseline=Baseline.from_dict(data.get("baseline")),
            previous=data.get("previous"),
            state=str(data["state"]),
            progress=Progress.from_dict(data.get("progress")),
            verdict=Verdict.from_dict(data.get("verdict")),
            ended=data.get("ended"),
            settings=dict(data.get("settings") or {}),
            boot_id=data.get("boot_id"),
            revert=data.get("revert"),
        )

    def finish(self, state: str, why: Verdict, now: float) -> None:
        self.state, self.verdict, self.ended = state, why, now

    def view(self, now: float | None = None) -> dict[str, Any]:
        """What ``status`` and a deploy's result show: the state, the time left, the
        verdict and the figures, against the baseline."""
        now = time.time() if now is None else now
        data = {
            "generation": self.generation,
            "state": self.state,
            "deadline": self.deadline,
            "seconds_left": max(0.0, round(self.deadline - now, 1)) if self.running else None,
            "baseline": self.baseline.generation if self.baseline else None,
            "samples": self.progress.samples,
            # seconds from the deploy's commit to the first sample that judged it
            "first_sample_after": round(self.progress.first - self.started, 3)
            if self.progress.first is not None
            else None,
            "bad_samples_in_a_row": self.progress.soft_bad,
            "notes": self.progress.notes[-5:],
            # the slots' need of an over-committed pool that reverts (None: not watched)
            "pool_limit": self.policy.pool_limit or None,
            "verdict": self.verdict.to_dict() if self.verdict else None,
        }
        if self.revert is not None:
            data["revert"] = self.revert
        return data


def path_of(generation_dir: Path) -> Path:
    return generation_dir / NAME


def load(generation_dir: Path) -> Bake | None:
    """The generation's bake record; None: it has none, or one that cannot be read (a bake
    is never judged on a half-read record; ``status`` says so through ``unreadable``)."""
    try:
        data = json.loads(path_of(generation_dir).read_bytes())
        return Bake.from_json(data) if isinstance(data, dict) else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(generation_dir: Path, bake: Bake) -> None:
    """Durable (fsynced): a verdict must outlive a power cut as the deploy's record does."""
    data = json.dumps(bake.to_json(), separators=(",", ":")).encode()
    store.atomic_write(path_of(generation_dir), data, 0o600)


def boot_id() -> str | None:
    """This boot (``launcher.host.procfs.boot``): a bake records the one it began in."""
    return procfs.boot()


def served_from(gen: store.Generation) -> float:
    """When a generation began to serve: the deploy's commit (its meta's ``time`` is taken
    after the validation; ``timings`` count from the deploy's start)."""
    meta = gen.meta
    timings = meta.get("timings") or {}
    started = float(meta.get("time") or 0) - float(timings.get("validate") or 0)
    return started + float(timings.get("total") or 0)


# -- begin, end, read ------------------------------------------------------------------------


def begin(settings: ToolSettings, st: store.Store, generation: int, previous: int | None) -> Bake:
    """Start the bake of ``generation`` (just deployed over ``previous``): ``plan``'s
    record, saved."""
    bake = plan(settings, st, generation, previous)
    save(st.get(generation).path, bake)
    return bake


def plan(settings: ToolSettings, st: store.Store, generation: int, previous: int | None) -> Bake:
    """The bake of ``generation`` over ``previous`` with the policy of ``settings`` (not
    saved); the baseline is ``previous``'s live record, when it recorded anything. The
    pool is watched (``bake_pool_limit``) only when ``generation``'s shared pool is
    over-committed and ``previous``'s plan says it was not: a revert to a pool that may
    overflow too (or one of unknown size) is no cure for one that is about to."""
    gen = st.get(generation)
    baseline = None
    old_overcommitted: bool | None = None
    if previous is not None:
        with contextlib.suppress(StoreError):
            old = st.get(previous)
            old_overcommitted = _overcommitted(old)
            rec = record.load(old.path, previous)
            if rec.totals.get("samples"):
                baseline = verdict.baseline_of(rec)
    policy = Policy.from_settings(settings)
    # vLLM preempts a sequence the pool cannot hold (it waits, none fails): its pool is
    # judged by its waiting queue and preemptions, not watched for an overflow
    if (
        store.runs_vllm(gen.meta)
        or _overcommitted(gen) is not True
        or old_overcommitted is not False
    ):
        policy = dataclasses.replace(policy, pool_limit=0.0, pool_poll=0.0)
    return Bake(
        generation=generation,
        started=served_from(gen),
        policy=policy,
        baseline=baseline,
        previous=previous,
        settings=settings.model_dump(mode="json"),
        boot_id=boot_id(),
    )


# -- the hand-off from a deploy (launcher.watch.handoff) -------------------------------------


def announce_path(st: store.Store) -> Path:
    """Where a deploy with a bake says so from its gate until its bake began (the carrier it
    started at the gate waits for it)."""
    return st.root / "watch" / "handoff.json"


def announce(st: store.Store, generation: int, seconds: float) -> int:
    """This deployer's bake of ``generation`` is coming: a carrier waits for it (``awaited``)
    while this process lives, at most ``seconds`` (the deploy's budget and a minute; one that
    stops waiting takes a sample that a deploy under way skips, and the deployer starts it
    again after). Returns this deployer's pid, which names the announcement."""
    path = announce_path(st)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = {"pid": os.getpid(), "generation": generation, "until": time.time() + seconds}
    store.write_json(path, data, durable=False)
    return os.getpid()


def unannounce(st: store.Store, pid: int) -> None:
    """The announcement of deployer ``pid`` removed (not one another deployer wrote since)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        path = announce_path(st)
        if int(json.loads(path.read_bytes())["pid"]) == pid:
            path.unlink()


def announced(st: store.Store) -> tuple[int, float] | None:
    """The deployer that announced a bake (``announce``) and until when, while it lives (a
    stale announcement, its deployer killed, is removed)."""
    path = announce_path(st)
    try:
        said = json.loads(path.read_bytes())
        pid, until = int(said["pid"]), float(said["until"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # half-written or damaged: the next announcement replaces it
    if not store.pid_alive(pid):
        unannounce(st, pid)
        return None
    return pid, until


def awaited(
    st: store.Store, sleep: Callable[[float], None] = time.sleep
) -> tuple[store.Generation, Bake] | None:
    """The bake a deploy announced (``announce``: it started this carrier at its gate,
    ``launcher.watch.handoff``), once the deploy is done with it: waited for while the
    announcement stands and its deployer lives (until its deadline). Then the live
    generation's bake, if it runs (None: the deploy did not make the generation live, or
    began no bake, or its first moments decided it)."""
    said = announced(st)
    if said is None:
        return None
    pid, until = said
    path = announce_path(st)
    while path.exists() and store.pid_alive(pid) and time.time() < until:
        sleep(AWAIT_POLL)
    found = live_bake(st)
    return found if found is not None and found[1].running else None


def _overcommitted(gen: store.Generation) -> bool | None:
    """Whether the generation's planned pool can overflow: over-committed, and not admitted
    against at the front (whose admission keeps it from overflowing: a full pool there is a
    wait, no reason to revert). None: it has no plan (an adopted hand edit): unknown."""
    planned = gen.meta.get("planned")
    if not isinstance(planned, dict):
        return None
    return bool(planned.get("overcommitted")) and not planned.get("admitted")


def live_bake(st: store.Store) -> tuple[store.Generation, Bake] | None:
    """The live generation and its bake record (running or not), if it has one."""
    live = st.live_number()
    if live is None:
        return None
    with contextlib.suppress(StoreError):
        gen = st.get(live)
        bake = load(gen.path)
        if bake is not None:
            return gen, bake
    return None


def reverted_by_live(st: store.Store) -> Bake | None:
    """When the live generation is a bake's revert: the bake it ended."""
    live = st.live()
    source = live.meta.get("reverted_from") if live else None
    if isinstance(source, int):
        with contextlib.suppress(StoreError):
            return load(st.get(source).path)
    return None


def newest(st: store.Store) -> Bake | None:
    """The bake a reader of the unit cares about now: the live generation's, else the one
    the live generation's revert ended (the metrics file's ``llama_launcher_bake_*``)."""
    found = live_bake(st)
    return found[1] if found is not None else reverted_by_live(st)


def deadline(state_dir: Path) -> float | None:
    """When the live generation's running bake ends (Unix seconds); None: none runs. What a
    reader outside the watch needs of a bake (e.g. how long to keep the old config warm)."""
    found = live_bake(store.Store(state_dir))
    return found[1].deadline if found and found[1].running else None


def end(st: store.Store, generation: int | None, why: str) -> dict[str, Any] | None:
    """A later deploy or rollback replaced ``generation``: its running bake ends
    (``ended``). Returns what the bake was, for the later verb's result; None: none ran."""
    if generation is None:
        return None
    try:
        gen = st.get(generation)
    except StoreError:
        return None
    bake = load(gen.path)
    # a bake whose revert was decided but never ran (its carrier waited for the lock this
    # verb held, or was killed at its gate) ends as well: its generation is replaced
    if bake is None or bake.state not in (RUNNING, REVERTING):
        return None
    bake.finish("ended", Verdict("ended", "replaced", why), time.time())
    save(gen.path, bake)
    return bake.view()


# -- one sample --------------------------------------------------------------------------------


def seen_of(
    bake: Bake,
    t: float,
    counts: dict[str, float],
    busy: int | None,
    unit: UnitState,
    unread: dict[str, str],
    pool: slots.Pressure | None = None,
    peak: slots.Pressure | None = None,
    wedged: str | None = None,
    stuck: bool = False,
    waiting: int | None = None,
) -> verdict.Seen:
    """One sample as the judge reads it; ``pool``: the sample's own look at the slots,
    ``peak``: the fullest look at them since the sample before (``launcher.watch.carry``'s
    looks); ``wedged``: why the wedge rules' count was reached (``launcher.watch.wedge``: a
    hard signal); ``stuck``: the sample was a wedged one, whose unread sources the wedge rules
    count, not the bake's unread limit (which would end the bake inconclusive first);
    ``waiting``: the requests the server queues (llama-server's deferred, vLLM's waiting)."""
    looks = [p for p in (pool, peak) if p is not None and p.need is not None]
    fullest = max(looks, key=lambda p: p.need or 0.0) if looks else None
    now_boot = boot_id()
    rebooted = bool(bake.boot_id and now_boot and now_boot != bake.boot_id)
    last = bake.progress.last
    return verdict.Seen(
        t=t,
        counts=counts,
        busy=busy,
        active=unit.active,
        sub=unit.sub,
        result=unit.result,
        unread=tuple(k for k in unread if k in ("slots", "metrics", "journal"))
        if unit.running and not stuck
        else (),
        gap=t - last if last is not None else None,
        rebooted=rebooted,
        pool_need=fullest.need if fullest else None,
        pool_line=fullest.describe() if fullest else None,
        wedged=wedged,
        waiting=waiting,
    )


def step(
    gen: store.Generation,
    rec: record.Record,
    seen_now: Callable[[Bake], verdict.Seen],
    revert: Revert,
) -> Bake | None:
    """Judge the live generation's running bake on one sample (the sampler calls it after
    the sample is recorded); a revert verdict puts the previous generation back through
    ``revert``. Returns the bake (None: none runs)."""
    bake = load(gen.path)
    if bake is None or not bake.running:
        return None
    seen = seen_now(bake)
    if seen.rebooted:
        bake.boot_id = boot_id()
    why = verdict.judge(
        bake.policy, bake.baseline, seen, verdict.Window.of(rec), bake.progress, bake.started
    )
    if why is None:
        save(gen.path, bake)
        return bake
    if why.state != "revert":
        bake.finish(why.state, why, seen.t)
        save(gen.path, bake)
        return bake
    if bake.previous is None:
        bake.finish(
            "inconclusive",
            Verdict(
                "inconclusive",
                why.signal,
                f"{why.reason}; but no generation served before this one: nothing to put "
                "back, the new config stays",
                why.hard,
                why.figures,
            ),
            seen.t,
        )
        save(gen.path, bake)
        return bake
    # the verdict first: a sampler killed mid-revert leaves a bake that says what it did
    bake.finish(REVERTING, why, seen.t)
    save(gen.path, bake)
    done = revert(bake, why)
    bake.revert = done
    outcome = done.get("outcome")
    # "ended": a deploy replaced the generation before the revert could (it changed nothing)
    bake.state = outcome if outcome in ("reverted", "ended") else "revert_failed"
    save(gen.path, bake)
    return bake


# -- a revert its sampler did not live to record -------------------------------------------


def settle(st: store.Store) -> Bake | None:
    """A sampler killed during a revert leaves the bake ``reverting``. The deploy's recovery
    handles the revert's transaction (``recover``, the next deploy, the front's release
    watcher, the unit's prestart at its next start); once none is pending, the generations
    say how the revert ended: a live generation newer than the baked one with the config of
    the one before it is the revert (``reverted``, and tagged ``reverted_from`` when the
    sampler died before it did that); anything else means it was undone (``revert_failed``,
    naming the fix). Returns the reverting bake (still ``reverting`` while a transaction is
    pending), or None when no bake is reverting."""
    found = _reverting(st)
    if found is None:
        return None
    gen, b = found
    if st.txn():
        return b
    live = st.live()
    if live is not None and live.number > b.generation and _is_revert(st, live, b):
        if live.meta.get("reverted_from") != b.generation:
            st.update(
                live,
                origin=f"revert of {b.generation} after its bake (settled)",
                reverted_from=b.generation,
                bake_verdict=b.verdict.to_dict() if b.verdict else None,
            )
        b.state = "reverted"
        b.revert = {
            "outcome": "reverted",
            "generation": live.number,
            "previous_generation": b.generation,
            "message": f"the sampler was killed during the revert, after its commit: "
            f"generation {b.previous}'s config serves as generation {live.number}",
        }
    else:
        now = live.number if live is not None else None
        serves = "the baked config" if now == b.generation else "deployed since"
        b.state = "revert_failed"
        b.revert = {
            "outcome": "revert_failed",
            "generation": now,
            "message": f"the sampler was killed during the revert and the recovery undid it: "
            f"generation {now} serves ({serves}); put the old config back with "
            f"llama-launcher rollback --to {b.previous}",
        }
    save(gen.path, b)
    return b


def _reverting(st: store.Store) -> tuple[store.Generation, Bake] | None:
    """The newest generations' bake that is ``reverting`` (a revert makes one generation
    after the baked one, a deploy since then another)."""
    for n in reversed(st.numbers()[-3:]):
        with contextlib.suppress(StoreError):
            gen = st.get(n)
            b = load(gen.path)
            if b is not None and b.state == REVERTING:
                return gen, b
    return None


def _is_revert(st: store.Store, live: store.Generation, b: Bake) -> bool:
    if live.meta.get("reverted_from") == b.generation:
        return True
    if b.previous is None:
        return False
    try:
        return live.env_text == st.get(b.previous).env_text
    except StoreError:
        return False


# -- what it says ----------------------------------------------------------------------------


def note(st: store.Store, generation: int, text: str) -> None:
    """A line in a running bake's notes (``status --json`` shows the last five)."""
    with contextlib.suppress(OSError, StoreError):
        gen = st.get(generation)
        b = load(gen.path)
        if b is not None and b.running:
            b.progress.notes.append(text)
            save(gen.path, b)


def say(b: Bake) -> str:
    """The bake's verdict in one line (the journal's, a deploy's)."""
    v = b.verdict
    head = f"bake of generation {b.generation}"
    if v is None:
        return f"{head}: {b.state}"
    kind = "hard" if v.hard else "soft"
    if b.state == "reverted":
        now = (b.revert or {}).get("generation")
        return (
            f"{head}: reverted ({kind}: {v.reason}); generation {b.previous}'s config serves "
            f"again as generation {now}"
        )
    if b.state == "revert_failed":
        return (
            f"{head}: the revert ({kind}: {v.reason}) failed: "
            f"{(b.revert or {}).get('message', '?')}"
        )
    return f"{head}: {b.state}: {v.reason}"


def status_of(st: store.Store, now: float | None = None) -> dict[str, Any] | None:
    """``status``'s bake: the live generation's (state, time left, verdict, its figures
    against the baseline's); when the live generation is a revert, the bake it ended."""
    found = live_bake(st)
    if found is not None:
        gen, b = found
        rec = record.load(gen.path, gen.number)
        window = verdict.Window.of(rec)
        summary = rec.summary()
        return {
            **b.view(now),
            "figures": {
                "completions": window.completions,
                "requests": window.requests,
                "failed": window.failed,
                "decode_tps_median": summary.decode_tps_median,
                "memory_slope": summary.memory_slope,
                "baseline_decode_by_busy": b.baseline.decode_by_busy if b.baseline else None,
                "baseline_memory_slope": b.baseline.memory_slope if b.baseline else None,
            },
        }
    ended = reverted_by_live(st)
    if ended is not None:
        return {"reverted": ended.view(now), "line": say(ended)}
    return None


def status_lines(data: dict[str, Any] | None) -> list[str]:
    """``status``'s text of ``status_of``."""
    if not data:
        return []
    if "reverted" in data:
        return [f"  bake: {data['line']}"]
    head = f"  bake of generation {data['generation']}: {data['state']}"
    if data.get("seconds_left") is not None:
        head += f", {data['seconds_left']:.0f}s left"
    base = data.get("baseline")
    head += (
        f" (against generation {base})" if base is not None else " (no baseline: hard signals only)"
    )
    lines = [head]
    f = data.get("figures") or {}
    tps = f.get("decode_tps_median")
    lines.append(
        f"    {f.get('completions', 0)} completions, {f.get('failed', 0)} failed of "
        f"{f.get('requests', 0)} requests; decode {'?' if tps is None else f'{tps:.1f}'} tok/s"
        + (
            f" (baseline by busy slots: {f['baseline_decode_by_busy']})"
            if f.get("baseline_decode_by_busy")
            else ""
        )
    )
    if data.get("pool_limit"):
        lines.append(
            f"    the over-committed pool is watched: a revert when the slots' sessions need "
            f"{data['pool_limit']:.0%} of it"
        )
    if data.get("verdict"):
        lines.append(f"    verdict: {data['verdict']['state']}: {data['verdict']['reason']}")
    return lines
