"""The carry of a bake: sampled every ``bake_interval`` from its start to its verdict (by the
sampler's service, which the deploy starts: ``launcher.watch.handoff``), the journal's word
of a hard failure sampling at once, the looks at an over-committed pool between two samples,
the early hold of a failure ``certain`` to revert, and the bound that ends a bake no sample
could judge (``carry``).

One sample and its judge: ``launcher.watch.sample``, ``launcher.watch.bake.step``; the bake
record: ``launcher.watch.bake``; the early hold: ``launcher.watch.revert.EarlyHold``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from launcher import waits
from launcher.deploy import store
from launcher.errors import LauncherError, StoreError
from launcher.host.systemd import Follower, Systemd
from launcher.server import serverlog, slots
from launcher.watch import bake, reads, verdict
from launcher.watch.bake import Bake, Revert
from launcher.watch.sampler import Target, own_lock
from launcher.watch.verdict import Policy, Verdict

#: The verdict's signal when ``carry`` ended a bake no sample could judge (``_Patience``).
UNJUDGED = "unjudged"
#: How long ``carry`` waits for the journal's lines of a hard failure logged before it
#: began, before its first sample (with an early hold: ``_Looks.peek``), seconds.
PEEK = 0.1


class Sampled(Protocol):
    """What ``carry`` reads of one sample's result (``launcher.watch.sampler.Outcome``)."""

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
    the sampler's service does); returns its bake as it ended.

    Between two samples it waits on ``wake`` (``hard_failures``: the unit's journal
    followed) where it has one: a request the server failed itself (the pool ran out, a
    decode failure) samples at once, so a hard failure is judged within a sample's time,
    not at the next interval (once per interval, as a look at the limit, below, and apart
    from it: a server that fails requests the judge does not hold against it, as its
    baseline did, is not sampled at every failure). The sample a line woke is taken inside
    ``brace`` (the early hold of a failure ``certain`` to revert, ``launcher.watch.revert``),
    with the revert it yields, and so is the sample a look at the pool's limit took (below:
    a look at the limit is the pool watch's own hard signal, so the front holds from it on,
    not from the revert's handover a moment later); with a brace, a line already in the
    journal when the carry begins (``wake`` follows the process's lines from its start)
    braces the first sample.

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
            return bake.load(st.get(generation).path)
        except StoreError:
            return None

    first = bake_of()
    if first is None or not first.running:
        return first
    looks = _Looks(
        first.policy, look, sleep, clock, lambda text: bake.note(st, generation, text), wake
    )
    patience = _Patience(st, generation, first.policy, clock, wall, lock)

    def again() -> bool:
        # a journal line of a hard failure, or a look at the pool's limit, cut the wait:
        # the sample that judges it is braced (the front held before it reads anything)
        peak, woke = looks.take(), looks.cut_by in ("journal", "limit")
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
            b = bake.load(gen.path)
        except StoreError:
            return None
        if b is None or not b.running:
            return b
        if not mine:
            reason += "; not recorded: another sample keeps the sampler's lock"
        b.finish("inconclusive", Verdict("inconclusive", UNJUDGED, reason), self.wall())
        if mine:
            try:
                bake.save(gen.path, b)
            except OSError as e:
                why = f"{reason}; not recorded: {e.strerror or e}"
                b.finish("inconclusive", Verdict("inconclusive", UNJUDGED, why), self.wall())
        return b


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


# -- on the live unit ------------------------------------------------------------------------


def on_unit(
    target: Target,
    systemd: Systemd,
    st: store.Store,
    gen: store.Generation,
    sample_once: SampleOnce,
) -> Bake | None:
    """``carry`` of ``gen``'s bake on the live unit: its looks at the slots, the
    sampler's lock, the journal's wake and, when a hard failure reverts it for sure
    (``certain``) and the unit has a front, the early hold at the journal's line
    (what the sampler's service carries it with)."""
    with hard_failures(systemd) as wake:
        return carry(
            st,
            gen.number,
            sample_once,
            look=lambda: reads.look(target, gen),
            lock=lambda: own_lock(target.folder),
            wake=wake,
            brace=_early_hold(gen) if wake is not None else None,
        )


@contextlib.contextmanager
def hard_failures(systemd: Systemd) -> Iterator[Callable[[float], bool] | None]:
    """A wait that the unit's journal cuts short (``Systemd.follow`` with a pattern): ``wake(s)``
    waits up to ``s`` seconds and returns True as soon as the server logs a request it
    failed itself (``serverlog.HARD_FAILURE_GREP``), so a bake samples at once, not at its
    next interval (``carry``). It follows the running process's lines from its start
    (``_process_follower``), so one it logged before the carry began (an overflow between
    the front's release and the bake's start) wakes it at once. The
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


def _early_hold(gen: store.Generation) -> Brace | None:
    """The early hold for ``gen``'s bake (``launcher.watch.revert.EarlyHold``), when one may
    come: made now, the deployer's modules imported now, not at the journal's line."""
    b = bake.load(gen.path)
    if b is None or not b.running or not certain(b):
        return None
    # the deployer's modules (a revert's) are loaded only where an early hold may come
    from launcher.watch import revert

    return revert.EarlyHold.of(b)
