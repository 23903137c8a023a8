"""The bake's watch of an over-committed shared pool (launcher/watch/verdict.py's ``pool``
signal, launcher/watch/bake.py's begin, launcher/watch/carry.py's carry): the overflow
reverted before it comes. Pure, over a real store in tmp_path; its real run:
tests/test_bake_server.py."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher import config
from launcher.deploy import store
from launcher.errors import Unreadable
from launcher.host import journalread
from launcher.host.systemd import UnitState
from launcher.server import slots
from launcher.server.slots import Pressure, Slot
from launcher.watch import bake, carry, record, sample, verdict
from launcher.watch.verdict import Policy, Progress, Seen, Window

T0 = 1_000_000.0
RUNNING = UnitState("active", "running", "success", 0, 0, 4242, None, "x", "loaded")
WATCHED = Policy(duration=600, interval=15, pool_limit=0.9, pool_poll=0.25)
OVER = {"overcommitted": True, "pool_cells": 1024}
#: over-committed, and admitted against at the front (issue 42): it cannot overflow
ADMITTED = {**OVER, "admitted": True}
GUARANTEED = {"overcommitted": False, "pool_cells": 4096}


def pool(*held: tuple[int, bool], cells: int = 1024) -> Pressure:
    """Slots holding (tokens, busy) of a pool of ``cells``."""
    return Pressure([Slot(i, cells, b, n, 0) for i, (n, b) in enumerate(held)], cells)


def judged(s: Seen, p: Policy = WATCHED) -> verdict.Verdict | None:
    return verdict.judge(p, None, s, Window(requests=40, completions=40), Progress(), T0)


def generations(tmp_path: Path, old: dict[str, Any], new: dict[str, Any]) -> store.Store:
    st = store.Store(tmp_path)
    st.new("A=1\n", {"time": T0 - 3600, "timings": {"total": 1}, "planned": old})
    st.new("A=2\n", {"time": T0, "timings": {"total": 2}, "previous": 1, "planned": new})
    st.set_live(2)
    return st


def test_the_need_counts_the_idle_slots_sessions_too() -> None:
    # an idle slot's cells go first when a batch finds no room, but its session comes back
    assert pool((512, True), (400, False)).need == 912 / 1024


def test_a_busy_requests_remaining_tokens_count_only_up_to_its_slots_cap() -> None:
    # a large max_tokens cannot take a slot past its cap (n_ctx): the task stops there
    slots = [Slot(0, 2048, True, 200, 3, 8187), Slot(1, 2048, False, 0, 0, None)]
    assert Pressure(slots, 4096).need == 2048 / 4096


def test_the_need_counts_what_each_busy_request_may_still_generate() -> None:
    slots = [Slot(0, 1024, True, 400, 8, 100), Slot(1, 1024, False, 300, 0, 20)]
    assert Pressure(slots, 1024).need == (400 + 100 + 300) / 1024


def test_a_slot_without_a_limit_says_no_remain() -> None:
    raw = {"id": 0, "n_ctx": 1024, "is_processing": True, "id_task": 3,
           "n_prompt_tokens": 10, "next_token": [{"n_decoded": 2, "n_remain": -1}]}  # fmt: skip
    assert slots.parse([raw])[0].remain is None
    raw["next_token"] = [{"n_decoded": 2, "n_remain": 46}]
    assert slots.parse([raw])[0].remain == 46


def test_sessions_at_the_limit_of_a_watched_pool_revert_as_hard() -> None:
    v = judged(Seen(T0 + 30, {}, busy=2, pool_need=0.93, pool_line="pool 952 of 1,024"))
    assert v is not None and (v.state, v.signal, v.hard) == ("revert", "pool", True)
    assert "need 93%" in v.reason and "pool 952 of 1,024" in v.reason


def test_the_pool_counts_in_the_warm_up_as_every_hard_signal() -> None:
    p = Policy(duration=600, warmup=600, pool_limit=0.9, pool_poll=0.25)
    v = judged(Seen(T0 + 5, {}, busy=2, pool_need=0.95), p)
    assert v is not None and v.signal == "pool"


def test_sessions_under_the_limit_do_not_revert() -> None:
    assert judged(Seen(T0 + 30, {}, busy=2, pool_need=0.89)) is None


def test_a_pool_that_is_not_watched_never_reverts_however_full() -> None:
    assert judged(Seen(T0 + 30, {}, busy=4, pool_need=1.0), Policy(duration=600)) is None


def test_an_overflow_already_counted_is_named_as_the_overflow_not_the_pool() -> None:
    v = judged(Seen(T0 + 30, {"context_exceeded": 2}, busy=4, pool_need=0.97))
    assert v is not None and v.signal == "context_exceeded"


def test_the_pool_is_watched_when_an_over_committed_pool_replaces_a_guaranteed_one(
    tmp_path: Path,
) -> None:
    st = generations(tmp_path, GUARANTEED, OVER)
    b = bake.begin(config.load_settings(bake="10m"), st, 2, 1)
    assert (b.policy.pool_limit, b.policy.pool_poll) == (0.9, 0.25)
    assert b.view()["pool_limit"] == 0.9
    assert any("sessions need 90% of it" in x for x in bake.status_lines(bake.status_of(st)))


@pytest.mark.parametrize(
    ("old", "new"),
    [(GUARANTEED, GUARANTEED), (OVER, OVER), (GUARANTEED, ADMITTED)],
    ids=[
        "guaranteed-over-guaranteed",
        "over-committed-over-over-committed",
        "admitted-over-guaranteed",
    ],
)
def test_the_pool_is_not_watched_when_a_revert_would_not_guarantee_more(
    tmp_path: Path, old: dict[str, Any], new: dict[str, Any]
) -> None:
    st = generations(tmp_path, old, new)
    b = bake.begin(config.load_settings(bake="10m"), st, 2, 1)
    assert b.policy.pool_limit == 0.0 and b.view()["pool_limit"] is None


def test_the_pool_is_watched_when_an_over_committed_pool_replaces_an_admitted_one(
    tmp_path: Path,
) -> None:
    # the front admitted against the old pool, so it could not overflow: a revert cures
    st = generations(tmp_path, ADMITTED, OVER)
    assert bake.begin(config.load_settings(bake="10m"), st, 2, 1).policy.pool_limit == 0.9


def test_a_previous_generation_without_a_plan_leaves_the_pool_unwatched(tmp_path: Path) -> None:
    # an adopted hand edit: how its pool was sized is unknown, so a revert promises nothing
    st = store.Store(tmp_path)
    st.new("A=1\n", {"time": T0 - 3600, "timings": {"total": 1}})
    st.new("A=2\n", {"time": T0, "timings": {"total": 2}, "previous": 1, "planned": OVER})
    st.set_live(2)
    assert bake.begin(config.load_settings(bake="10m"), st, 2, 1).policy.pool_limit == 0.0


def test_a_bake_limit_of_zero_turns_the_watch_off(tmp_path: Path) -> None:
    st = generations(tmp_path, GUARANTEED, OVER)
    b = bake.begin(config.load_settings(bake="10m", bake_pool_limit=0), st, 2, 1)
    assert b.policy.pool_limit == 0.0


def test_the_judge_gets_the_fullest_of_the_samples_look_and_the_polls(tmp_path: Path) -> None:
    st = generations(tmp_path, GUARANTEED, OVER)
    b = bake.begin(config.load_settings(bake="10m"), st, 2, 1)
    now, peak = pool((300, True)), pool((500, True), (460, True))
    s = bake.seen_of(b, T0 + 30, {}, 2, RUNNING, {}, now, peak)
    assert s.pool_need == pytest.approx(960 / 1024) and s.pool_line == peak.describe()


class Clock:
    """A clock that sleeping moves (and a look may too: ``cost``)."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []  # type: list[float]

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def samples_until(st: store.Store, n: int) -> tuple[list[Pressure | None], Any]:
    """A sample_once that records what it got and ends the bake at its ``n``-th call."""
    got: list[Pressure | None] = []

    def sample_once(peak: Pressure | None, revert: object) -> None:
        got.append(peak)
        if len(got) == n:
            b = bake.load(st.get(2).path)
            assert b is not None
            b.finish("passed", verdict.Verdict("passed", "window_ended", "done"), T0)
            bake.save(st.get(2).path, b)

    return got, sample_once


def notes(st: store.Store) -> list[str]:
    b = bake.load(st.get(2).path)
    assert b is not None
    return b.progress.notes


def watched(tmp_path: Path, **kw: Any) -> store.Store:
    st = generations(tmp_path, GUARANTEED, OVER)
    bake.begin(config.load_settings(bake="10m", **kw), st, 2, 1)
    return st


def unwatched(tmp_path: Path) -> store.Store:
    """A bake whose pool is not watched (the config before guaranteed no more)."""
    st = generations(tmp_path, GUARANTEED, GUARANTEED)
    bake.begin(config.load_settings(bake="10m"), st, 2, 1)
    return st


def test_a_look_at_the_limit_between_samples_samples_at_once_with_it(tmp_path: Path) -> None:
    st = watched(tmp_path)
    looks = iter([pool((100, True)), pool((300, True)), pool((950, True))])
    got, sample_once = samples_until(st, 2)
    clock = Clock()
    carry.carry(st, 2, sample_once, clock.sleep, lambda: next(looks), clock, wall=lambda: T0)
    assert got[0] is None and got[1] is not None and got[1].need == 950 / 1024
    assert clock.slept == [0.25, 0.25, 0.25]  # the third look found it: no wait for the rest


def test_a_second_look_at_the_limit_in_a_row_waits_for_the_intervals_sample(
    tmp_path: Path,
) -> None:
    # a sample that was skipped (a deploy holds the lock) is not tried again at every look
    st = watched(tmp_path, bake_interval=1)
    got, sample_once = samples_until(st, 4)
    clock = Clock()
    carry.carry(st, 2, sample_once, clock.sleep, lambda: pool((950, True)), clock, wall=lambda: T0)
    assert clock.slept == [0.25] + [0.25] * 4 + [0.25]
    assert all(p is not None and p.need == 950 / 1024 for p in got[1:])


def test_slow_looks_never_stretch_the_interval(tmp_path: Path) -> None:
    st = watched(tmp_path, bake_interval=1)
    _, sample_once = samples_until(st, 3)
    clock = Clock()

    def slow() -> Pressure:
        clock.now += 2.0  # a server that answers in 2 s
        return pool((100, True))

    carry.carry(st, 2, sample_once, clock.sleep, slow, clock, wall=lambda: T0)
    assert clock.slept == [0.25, 0.25] and clock.now == 4.5  # one look per interval


def test_looks_that_cannot_read_the_pool_for_the_unread_limit_stop_with_a_note(
    tmp_path: Path,
) -> None:
    st = watched(tmp_path, bake_interval=1, bake_unread_limit=1)  # one interval: 4 looks
    got, sample_once = samples_until(st, 3)
    clock = Clock()
    looks: list[int] = []

    def unreadable() -> Pressure:
        looks.append(1)
        raise Unreadable("slots", "/slots is off (501)")

    carry.carry(st, 2, sample_once, clock.sleep, unreadable, clock, wall=lambda: T0)
    assert got == [None, None, None] and len(looks) == 4  # then only the samples
    assert clock.slept == [0.25] * 4 + [1.0]
    assert any("pool watch stopped after 4 looks" in n for n in notes(st))


def test_a_build_whose_slots_say_nothing_of_what_they_hold_counts_as_unreadable(
    tmp_path: Path,
) -> None:
    st = watched(tmp_path, bake_interval=1, bake_unread_limit=2)  # two intervals: 8 looks
    _, sample_once = samples_until(st, 3)
    clock = Clock()
    b9093 = Pressure([Slot(0, 1024, True, None, 3)], 1024)  # no n_prompt_tokens
    carry.carry(st, 2, sample_once, clock.sleep, lambda: b9093, clock, wall=lambda: T0)
    assert any("says nothing of what a slot holds" in n for n in notes(st))


def test_a_look_that_fails_once_does_not_stop_the_watch(tmp_path: Path) -> None:
    st = watched(tmp_path, bake_interval=1)
    got, sample_once = samples_until(st, 2)
    clock = Clock()
    looks = iter([None, pool((950, True))])

    def flaky() -> Pressure:
        now = next(looks)
        if now is None:
            raise Unreadable("slots", "the server does not answer: ReadTimeout")
        return now

    carry.carry(st, 2, sample_once, clock.sleep, flaky, clock, wall=lambda: T0)
    assert got[1] is not None and clock.slept == [0.25, 0.25]


def test_a_watched_bake_reverts_on_the_look_through_the_step(tmp_path: Path) -> None:
    st = generations(tmp_path, GUARANTEED, OVER)
    bake.begin(config.load_settings(bake="10m"), st, 2, 1)
    asked: list[verdict.Verdict] = []

    def revert(b: bake.Bake, why: verdict.Verdict) -> dict[str, Any]:
        asked.append(why)
        return {"outcome": "reverted", "generation": 3, "message": "done"}

    peak = pool((600, True), (380, True))
    rec = record.Record(2, totals={"requests": 40, "completions": 40})
    b = bake.step(
        st.get(2), rec, lambda b: bake.seen_of(b, T0 + 30, {}, 2, RUNNING, {}, None, peak), revert
    )
    assert b is not None and b.state == "reverted" and asked[0].signal == "pool"


def test_a_sample_counts_no_line_of_a_process_that_logged_before_its_generations_deploy() -> None:
    # a revert's process served between two samples, then a deploy: its lines, before and
    # after that deploy (its drain), are not the new generation's; the new process's are
    line = journalread.Line
    lines = [line(T0 - 5, 11, "a"), line(T0 + 1, 11, "b"), line(T0 + 2, 12, "c")]
    assert [x.text for x in sample.own_lines(lines, {10}, T0, 12, 1)] == ["c"]


def test_a_sample_counts_the_main_process_even_when_it_logged_before_the_deploy() -> None:
    # an adopted hand edit: the generation is younger than the process that serves it
    lines = [journalread.Line(T0 - 5, 12, "a"), journalread.Line(T0 + 2, 12, "b")]
    assert [x.text for x in sample.own_lines(lines, set(), T0, 12, 1)] == ["a", "b"]


class Journal:
    """A journal that reports a hard failure at the given waits (their count from 1), on
    the test's clock: a wait it does not cut runs its whole time."""

    def __init__(self, clock: Clock, at: set[int]) -> None:
        self.clock, self.at, self.waits = clock, at, 0

    def __call__(self, seconds: float) -> bool:
        self.waits += 1
        if self.waits in self.at:
            self.clock.now += 0.01  # the line comes 10 ms into the wait
            return True
        self.clock.sleep(seconds)
        return False


def test_a_hard_failure_in_the_journal_between_two_looks_samples_at_once(tmp_path: Path) -> None:
    st = watched(tmp_path)
    got, sample_once = samples_until(st, 2)
    clock = Clock()
    journal = Journal(clock, at={3})
    carry.carry(
        st, 2, sample_once, clock.sleep, lambda: pool((100, True)), clock, lambda: T0,
        wake=journal,
    )  # fmt: skip
    assert len(got) == 2 and clock.now == pytest.approx(0.51)  # two looks, then the line


def test_a_second_hard_failure_in_the_journal_in_a_row_waits_for_the_intervals_sample(
    tmp_path: Path,
) -> None:
    st = watched(tmp_path, bake_interval=1)
    _, sample_once = samples_until(st, 3)
    clock = Clock()
    journal = Journal(clock, at={1, 2})
    carry.carry(
        st, 2, sample_once, clock.sleep, lambda: pool((100, True)), clock, lambda: T0,
        wake=journal,
    )  # fmt: skip
    # the first cut the wait short; the second only a look's pause: the interval ran to its end
    assert clock.now == pytest.approx(0.01 + 1.0) and journal.waits > 2


def test_a_bake_without_a_pool_watch_is_woken_by_the_journal_too(tmp_path: Path) -> None:
    st = unwatched(tmp_path)  # nothing to look at
    got, sample_once = samples_until(st, 2)
    clock = Clock()
    carry.carry(st, 2, sample_once, clock.sleep, lambda: pool((100, True)), clock, lambda: T0,
                wake=Journal(clock, at={1}))  # fmt: skip
    assert got == [None, None] and clock.now == pytest.approx(0.01)


def test_a_second_hard_failure_in_the_journal_lets_an_unwatched_interval_run_to_its_end(
    tmp_path: Path,
) -> None:
    st = unwatched(tmp_path)
    _, sample_once = samples_until(st, 3)
    clock = Clock()
    carry.carry(st, 2, sample_once, clock.sleep, lambda: pool((100, True)), clock, lambda: T0,
                wake=Journal(clock, at={1, 2}))  # fmt: skip
    assert clock.now == pytest.approx(0.01 + 15.0)


class Braces:
    """A brace (``carry.carry``'s early hold) that records the bakes it was entered for and
    yields ``REVERT`` as the revert to judge with."""

    REVERT = object()

    def __init__(self) -> None:
        self.entered: list[int] = []
        self.left = 0

    @contextlib.contextmanager
    def __call__(self, b: bake.Bake) -> Iterator[Any]:
        self.entered.append(b.generation)
        try:
            yield self.REVERT
        finally:
            self.left += 1


def revert_seen(st: store.Store, n: int) -> tuple[list[Any], Any]:
    """A sample_once that records the revert it got and ends the bake at its ``n``-th call."""
    reverts: list[Any] = []
    _, ends = samples_until(st, n)

    def sample_once(peak: Pressure | None, revert: Any) -> None:
        reverts.append(revert)
        ends(peak, revert)

    return reverts, sample_once


def test_the_sample_a_journal_line_woke_is_taken_inside_the_brace_with_its_revert(
    tmp_path: Path,
) -> None:
    st = watched(tmp_path)
    reverts, sample_once = revert_seen(st, 2)
    clock, braces = Clock(), Braces()
    carry.carry(
        st, 2, sample_once, clock.sleep, lambda: pool((100, True)), clock, lambda: T0,
        wake=Journal(clock, at={3}), brace=braces,
    )  # fmt: skip
    assert reverts == [None, Braces.REVERT]  # the first sample was no line's
    assert (braces.entered, braces.left) == ([2], 1)


def test_a_sample_a_look_at_the_limit_took_is_braced(tmp_path: Path) -> None:
    st = watched(tmp_path)
    reverts, sample_once = revert_seen(st, 2)
    clock, braces = Clock(), Braces()
    looks = iter([pool((100, True)), pool((950, True))])
    carry.carry(st, 2, sample_once, clock.sleep, lambda: next(looks), clock, lambda: T0,
                wake=Journal(clock, at=set()), brace=braces)  # fmt: skip
    assert reverts == [None, Braces.REVERT] and braces.entered == [2]


def test_a_line_that_may_not_cut_the_wait_takes_no_brace_for_the_intervals_sample(
    tmp_path: Path,
) -> None:
    st = watched(tmp_path, bake_interval=1)
    reverts, sample_once = revert_seen(st, 3)
    clock, braces = Clock(), Braces()
    carry.carry(
        st, 2, sample_once, clock.sleep, lambda: pool((100, True)), clock, lambda: T0,
        wake=Journal(clock, at={2, 3}), brace=braces,  # the 1st: the look before the 1st sample
    )  # fmt: skip
    assert reverts == [None, Braces.REVERT, None] and braces.entered == [2]


def test_a_line_logged_before_the_carry_began_braces_its_first_sample(tmp_path: Path) -> None:
    # the follower reads the process's lines from its start: an overflow during the gate
    st = watched(tmp_path)
    reverts, sample_once = revert_seen(st, 2)
    clock, braces = Clock(), Braces()
    journal = Journal(clock, at={1})
    carry.carry(st, 2, sample_once, clock.sleep, lambda: pool((100, True)), clock, lambda: T0,
                wake=journal, brace=braces)  # fmt: skip
    assert reverts == [Braces.REVERT, None] and braces.entered == [2]


def test_a_carry_without_a_brace_does_not_look_at_the_journal_before_its_first_sample(
    tmp_path: Path,
) -> None:
    st = unwatched(tmp_path)
    _, sample_once = samples_until(st, 1)
    journal = Journal(Clock(), at=set())
    carry.carry(st, 2, sample_once, lambda s: None, wake=journal)
    assert journal.waits == 0


def baked(tmp_path: Path, baseline: verdict.Baseline | None, previous: int | None) -> bake.Bake:
    b = bake.begin(config.load_settings(bake="10m"), generations(tmp_path, GUARANTEED, OVER), 2, 1)
    return dataclasses.replace(b, baseline=baseline, previous=previous)


def test_a_hard_failure_reverts_for_sure_when_the_baseline_failed_no_request_so(
    tmp_path: Path,
) -> None:
    assert carry.certain(baked(tmp_path, verdict.Baseline(1, failures={}), 1))
    assert carry.certain(baked(tmp_path, None, 1))  # no baseline: every hard failure counts


@pytest.mark.parametrize("kind", verdict.POOL_FAILURES)
def test_a_hard_failure_is_not_sure_to_revert_when_the_baseline_had_one_at_any_load(
    tmp_path: Path, kind: str
) -> None:
    base = verdict.Baseline(1, failures={kind: {4: 1}})  # at 4 busy slots: a sample at 1 passes
    assert not carry.certain(baked(tmp_path, base, 1))


def test_a_hard_failure_is_not_sure_to_revert_with_nothing_to_put_back(tmp_path: Path) -> None:
    assert not carry.certain(baked(tmp_path, None, None))
