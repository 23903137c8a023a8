"""The bake window: a deployed generation watched for a while against the previous one, and
put back by itself when it is worse under load.

A deploy with a bake (``--bake 30m``, the setting ``bake``) writes the generation's bake
record beside its ``meta.json`` and its live record: ``generations/NNNN/bake.json``, with
the policy (the ``bake_*`` settings as they were), the baseline (the previous generation's
live record, its figures by the load they were measured at: ``launcher.watch.verdict``),
the deadline, and the settings a revert needs (the sampler's timer reads no settings).

The sampler carries the bake: every sample of the live generation judges it (``step``), and
a sample that finds a bake running keeps sampling every ``bake_interval`` until it ends
(``carry``; ``deploy --wait`` does the same in the deploy's own process). The verdicts:
``reverted`` (the revert, ``launcher.watch.revert``: one function, so a later switch in
the front can take its place), ``passed``, ``inconclusive`` (the new config stays), and
``ended`` (a later deploy or rollback replaced the generation). A revert that fails is
``revert_failed``; a sampler killed during its revert leaves ``reverting``, which the next
sample or ``recover`` settles from the generations once the deploy's recovery handled the
revert's transaction (``settle``). At most one revert per deploy: a bake ends once; a
revert's generation (a rollback) has no bake.

A sampler killed or a host rebooted mid-bake: the next sample resumes it (the record says
when and why); when the deadline passed meanwhile it ends ``inconclusive``. A restart seen
across a reboot (another boot: ``launcher.host.procfs.boot``) is not counted against the config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from launcher import waits
from launcher.deploy import store
from launcher.errors import LauncherError, StoreError
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
#: The verdict's signal when ``carry`` ended a bake no sample could judge (``_Patience``).
UNJUDGED = "unjudged"
#: How long ``carry`` waits for the journal's lines of a hard failure logged before it
#: began, before its first sample (with an early hold: ``_Looks.peek``), seconds.
PEEK = 0.1
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
    if _overcommitted(gen) is not True or old_overcommitted is not False:
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


def announce(st: store.Store, generation: int, seconds: float) -> None:
    """This deployer's bake of ``generation`` is coming: a carrier waits for it (``awaited``)
    at most ``seconds`` (the deploy's budget)."""
    path = announce_path(st)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = {"pid": os.getpid(), "generation": generation, "until": time.time() + seconds}
    store.write_json(path, data, durable=False)


def unannounce(st: store.Store) -> None:
    with contextlib.suppress(OSError):
        announce_path(st).unlink(missing_ok=True)


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
        unannounce(st)
        return None
    if not store.pid_alive(pid):
        unannounce(st)
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
    """Whether the generation's planned pool is over-committed (None: it has no plan, e.g.
    an adopted hand edit: unknown)."""
    planned = gen.meta.get("planned")
    return bool(planned.get("overcommitted")) if isinstance(planned, dict) else None


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
    if bake is None or not bake.running:
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
) -> verdict.Seen:
    """One sample as the judge reads it; ``pool``: the sample's own look at the slots,
    ``peak``: the fullest look at them since the sample before (``carry``'s polls);
    ``wedged``: why the wedge rules' count was reached (``launcher.watch.wedge``: a hard
    signal); ``stuck``: the sample was a wedged one, whose unread sources the wedge rules
    count, not the bake's unread limit (which would end the bake inconclusive first)."""
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
    bake.state = "reverted" if done.get("outcome") == "reverted" else "revert_failed"
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


# -- carrying it to its end -----------------------------------------------------------------


class Sampled(Protocol):
    """What ``carry`` reads of one sample's result (``launcher.watch.sample.Outcome``)."""

    skipped: str | None
    errors: list[str]


#: What ``carry`` takes a sample with: the fullest look since the sample before, and the
#: revert to judge it with (None: the default one).
SampleOnce = Callable[[slots.Pressure | None, "Revert | None"], "Sampled | None"]
#: Around a sample the journal's line woke, given the bake: yields the revert to judge it
#: with (``launcher.watch.revert.EarlyHold``: the front held at once), or None.
Brace = Callable[["Bake"], contextlib.AbstractContextManager["Revert | None"]]


def certain(b: Bake) -> bool:
    """Whether a request the server failed itself (the journal's line: the pool ran out, a
    decode failure) reverts ``b`` for sure: there is a generation to put back, and its
    baseline failed no request so at any load (or there is none: then every hard failure
    counts)."""
    base = b.baseline
    return b.previous is not None and (
        base is None or not any(base.had(kind, None) for kind in verdict.POOL_FAILURES)
    )


def carry(
    st: store.Store,
    generation: int,
    sample_once: SampleOnce,
    sleep: Callable[[float], None] = time.sleep,
    look: Callable[[], slots.Pressure | None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    lock: Callable[[], contextlib.AbstractContextManager[bool]] | None = None,
    wake: Callable[[float], bool] | None = None,
    brace: Brace | None = None,
) -> Bake | None:
    """Sample every ``bake_interval`` while ``generation``'s bake runs and it is live (what
    the sampler's service and ``deploy --wait`` do); returns its bake as it ended.

    Between two samples it waits on ``wake`` (``sample.hard_failures``: the unit's journal
    followed) where it has one: a request the server failed itself (the pool ran out, a
    decode failure) samples at once, so a hard failure is judged within a sample's time,
    not at the next interval (once per interval, as a look at the limit, below, and apart
    from it: a server that fails requests the judge does not hold against it, as its
    baseline did, is not sampled at every failure). The sample a line woke is taken inside
    ``brace`` (the early hold of a failure ``certain`` to revert, ``launcher.watch.revert``),
    with the revert it yields; with one, a line already in the journal when the carry begins
    (``wake`` follows the process's lines from its start) braces the first sample.

    A bake that watches its pool (``Policy.pool_limit``) also looks at the slots every
    ``pool_poll`` seconds between samples (``look``: ``GET /slots`` alone, a few
    milliseconds): a sample's interval is longer than a pool takes to fill when the agents'
    turns are short. A look that finds the slots' need at the limit samples at once (once
    per interval: a second one waits for the interval's sample, so a sample that was
    skipped, e.g. during a deploy, is not tried again at every look), and ``sample_once``
    gets the fullest look since the sample before (the judge's ``pool_need``: the server
    may have freed the cells by the time the sample reads them). Looks never stretch the
    interval: they stop at its end, however slow the server answers (``clock``). When the
    looks cannot read the pool for ``unread_limit`` intervals in a row (the server down,
    ``/slots`` off, a build whose ``/slots`` says nothing of what a slot holds) they stop,
    with a note in the bake's record; the samples go on judging it.

    A carry never outlives its bake (``_Patience``): past the deadline (``wall``, the
    judge's clock) a sample always ends the bake, so one that no sample judged for
    ``unread_limit`` intervals past it, with no deploy under way within its budget (every
    sample skipped: a deployer stopped, another sampler stuck holding the lock; or its
    verdict never saved), ends ``inconclusive`` (``UNJUDGED``), naming what the last sample
    said, recorded under the sampler's lock (``lock``)."""

    def bake_of() -> Bake | None:
        try:
            return load(st.get(generation).path)
        except StoreError:
            return None

    first = bake_of()
    if first is None or not first.running:
        return first
    looks = _Looks(first.policy, look, sleep, clock, lambda text: note(st, generation, text), wake)
    patience = _Patience(st, generation, first.policy, clock, wall, lock)

    def again() -> bool:
        peak, woke = looks.take(), looks.cut_by == "journal"
        live = st.live_number() == generation
        b = bake_of() if woke and brace is not None and live else None
        with brace(b) if brace is not None and b is not None else _unbraced() as rev:
            said = sample_once(peak if live else None, rev)
        now = bake_of()
        if now is None or not now.running or st.live_number() != generation:
            return False
        return not patience.gave_up(now, said)

    if brace is not None:
        looks.peek(PEEK)  # a line logged before the carry began braces its first sample
    waits.every_while(first.policy.interval, looks.wait)(again)
    return patience.ended or bake_of()


@contextlib.contextmanager
def _unbraced() -> Iterator[Revert | None]:
    yield None


class _Patience:
    """``carry``'s bound (see there). The verdict is recorded under the sampler's lock; a
    lock another sample keeps for three times as long ends the carry with the verdict said
    (the result ``carry`` returns) but not recorded."""

    def __init__(
        self,
        st: store.Store,
        generation: int,
        policy: Policy,
        clock: Callable[[], float],
        wall: Callable[[], float],
        lock: Callable[[], contextlib.AbstractContextManager[bool]] | None,
    ) -> None:
        self.st, self.generation, self.clock, self.wall = st, generation, clock, wall
        self.lock = lock or (lambda: contextlib.nullcontext(True))
        self.grace = policy.unread_limit * policy.interval
        self.samples, self.since = -1, clock()
        #: the bake as the carry ended it (None: it did not)
        self.ended: Bake | None = None

    def gave_up(self, b: Bake, said: Sampled | None) -> bool:
        now = self.clock()
        if b.progress.samples != self.samples:  # a sample judged it
            self.samples, self.since = b.progress.samples, now
            return False
        idle = now - self.since
        if idle < self.grace or self.wall() < b.deadline or self._deploy_under_way():
            return False
        with contextlib.ExitStack() as held:
            try:
                mine = held.enter_context(self.lock())
            except OSError:  # no lock file to take: as if another sample kept it
                mine = False
            if not mine and idle < 3 * self.grace:
                return False  # another sample holds the lock: it may judge it yet
            self.ended = self._end(idle, said, mine)
        return True

    def _deploy_under_way(self) -> bool:
        """A deploy's transaction within its budget: it may yet replace the generation."""
        try:
            txn = self.st.txn()
            return bool(txn) and self.wall() < (
                float(txn.get("started") or 0) + float(txn.get("budget") or 0) + self.grace
            )
        except (OSError, ValueError, StoreError):
            return False

    def _end(self, idle: float, said: Sampled | None, mine: bool) -> Bake | None:
        errors = said.errors if said is not None else []
        last = (said.skipped if said is not None else None) or (
            errors[0] if errors else "it judged nothing"
        )
        reason = (
            f"no sample could judge the bake for {idle:.0f}s, its deadline past (the last: "
            f"{last}): it ends inconclusive, the new config stays"
        )
        try:
            gen = self.st.get(self.generation)
            b = load(gen.path)
        except StoreError:
            return None
        if b is None or not b.running:
            return b
        if not mine:
            reason += "; not recorded: another sample keeps the sampler's lock"
        b.finish("inconclusive", Verdict("inconclusive", UNJUDGED, reason), self.wall())
        if mine:
            try:
                save(gen.path, b)
            except OSError as e:
                why = f"{reason}; not recorded: {e.strerror or e}"
                b.finish("inconclusive", Verdict("inconclusive", UNJUDGED, why), self.wall())
        return b


def note(st: store.Store, generation: int, text: str) -> None:
    """A line in a running bake's notes (``status --json`` shows the last five)."""
    with contextlib.suppress(OSError, StoreError):
        gen = st.get(generation)
        b = load(gen.path)
        if b is not None and b.running:
            b.progress.notes.append(text)
            save(gen.path, b)


class _Looks:
    """``carry``'s wait between two samples: with the pool watched, a look at the slots
    every ``pool_poll`` until the interval's end, the fullest kept for the next sample, and
    the wait cut short by a look at the limit or, with ``wake``, by the journal's word of a
    hard failure (see ``carry``)."""

    def __init__(
        self,
        policy: Policy,
        look: Callable[[], slots.Pressure | None] | None,
        sleep: Callable[[float], None],
        clock: Callable[[], float],
        note: Callable[[str], None],
        wake: Callable[[float], bool] | None = None,
    ) -> None:
        self.policy, self.look, self.sleep, self.clock, self.note, self.wake = (
            policy,
            look,
            sleep,
            clock,
            note,
            wake,
        )
        self.on = look is not None and bool(policy.pool_limit and policy.pool_poll)
        self.fullest: slots.Pressure | None = None
        self.unread, self.why = 0, ""
        #: what ended the last wait early ("limit", "journal"): the next wait runs on past
        #: it, to its end (each cuts one wait short in two)
        self.triggered: set[str] = set()
        #: what cut the last wait short (None: it ran to its end)
        self.cut_by: str | None = None
        #: as long as the samples' own unread limit (``unread_limit`` intervals), in looks
        per = max(1, math.ceil(policy.interval / (policy.pool_poll or 1)))
        self.give_up = policy.unread_limit * per

    def peek(self, seconds: float) -> None:
        """Before the first sample: the journal's word of a hard failure within ``seconds``
        (one the server logged before the carry began: the follower reads the process's
        lines from its start) counts as a wait it cut short."""
        if self.wake is not None and self.wake(seconds):
            self._cut("journal")

    def take(self) -> slots.Pressure | None:
        """The fullest look since the sample before (and none kept for the next)."""
        peak, self.fullest = self.fullest, None
        return peak

    def wait(self, seconds: float) -> None:
        end, looking = self.clock() + seconds, self.on
        self.cut_by = None
        while self.on and (left := end - self.clock()) > 1e-9:
            if self._pause(min(self.policy.pool_poll, left)):
                return
            now = self._one()
            if now is None:
                continue
            if self.fullest is None or (now.need or 0.0) > (self.fullest.need or 0.0):
                self.fullest = now
            if (now.need or 0.0) >= self.policy.pool_limit and self._cut("limit"):
                return
        # no looks (or they stopped): the rest of the interval as one wait
        rest = end - self.clock() if looking else seconds
        if rest > 1e-9 and self._pause(rest):
            return
        self.triggered.clear()

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds``; True when the journal's word of a hard failure cut it short
        (a line that may not cut it, the wait before having been cut, waits on)."""
        if self.wake is None:
            self.sleep(seconds)
            return False
        end = self.clock() + seconds
        while (left := end - self.clock()) > 1e-9:
            if self.wake(left) and self._cut("journal"):
                return True
        return False

    def _cut(self, why: str) -> bool:
        """Whether ``why`` may end this wait early (it did not end the one before)."""
        if why in self.triggered:
            return False
        self.triggered.add(why)
        self.cut_by = why
        return True

    def _one(self) -> slots.Pressure | None:
        """One look; None when it could not read the pool (counted: ``give_up``)."""
        assert self.look is not None
        try:
            now = self.look()
        except (LauncherError, OSError) as e:
            now, why = None, str(e)
        else:
            why = "its /slots says nothing of what a slot holds"
        if now is not None and now.need is not None:
            self.unread = 0
            return now
        self.unread, self.why = self.unread + 1, why
        if self.unread >= self.give_up:
            self.on = False
            self.note(
                f"the pool watch stopped after {self.unread} looks in a row that could not "
                f"read the pool ({self.why}); the samples judge it"
            )
        return None


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
