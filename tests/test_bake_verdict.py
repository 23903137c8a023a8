"""The bake's judge (launcher/watch/verdict.py): pure, over figures; one behaviour each."""

from __future__ import annotations

from typing import Any

import pytest

from launcher import config
from launcher.errors import ConfigInvalid
from launcher.watch import record, verdict
from launcher.watch.verdict import Baseline, Policy, Progress, Seen, Window

POLICY = Policy(duration=600, interval=15, warmup=120)
BASE = Baseline(1, decode_by_busy={1: 40.0, 4: 20.0}, memory_slope=0.0)
BUSY_WINDOW = Window(requests=100, completions=100)
T0 = 1_000_000.0


def seen(t: float = T0 + 200, busy: int | None = 4, **counts: float) -> Seen:
    return Seen(t, counts, busy=busy)


def judged(
    s: Seen, window: Window = BUSY_WINDOW, base: Baseline | None = BASE, p: Progress | None = None
) -> verdict.Verdict | None:
    return verdict.judge(POLICY, base, s, window, p or Progress(), T0)


# -- the settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "seconds"), [("30m", 1800.0), ("2h", 7200.0), ("90s", 90.0), ("45", 45.0), (0, 0.0)]
)
def test_a_bake_duration_is_read_in_seconds_minutes_or_hours(given: Any, seconds: float) -> None:
    assert config.load_settings(bake=given).bake == seconds


def test_a_bake_duration_that_is_not_one_is_refused_naming_it() -> None:
    with pytest.raises(ConfigInvalid, match=r"'ten minutes' is not a duration for bake.*30m"):
        config.load_settings(bake="ten minutes")


def test_a_bake_over_a_day_is_refused() -> None:
    with pytest.raises(ConfigInvalid, match="bake"):
        config.load_settings(bake="25h")


def test_the_policy_takes_the_anchors_defaults_from_the_settings() -> None:
    p = Policy.from_settings(config.load_settings(bake="30m"))
    assert (p.duration, p.interval, p.warmup, p.soft_samples, p.min_completions) == (
        1800.0,
        15.0,
        120.0,
        3,
        20,
    )
    assert (p.decode_ratio, p.memory_ratio, p.failure_rate, p.unread_limit) == (0.8, 1.5, 0.01, 4)


# -- hard ----------------------------------------------------------------------------------------


def test_a_restart_reverts_at_once_even_in_the_warm_up() -> None:
    v = judged(seen(T0 + 5, restarts=1), Window())
    assert v is not None and (v.state, v.signal, v.hard) == ("revert", "restart", True)


def test_a_restart_across_a_reboot_is_not_the_configs() -> None:
    s = Seen(T0 + 200, {"restarts": 1}, busy=0, rebooted=True, gap=30)
    assert judged(s) is None


def test_a_reboot_the_bake_resumes_after_says_so_in_its_notes() -> None:
    p = Progress()
    assert judged(Seen(T0 + 200, {"restarts": 1}, busy=0, rebooted=True, gap=5), p=p) is None
    assert any("the host rebooted; the bake resumed" in n for n in p.notes), p.notes


def test_the_unit_coming_up_after_a_reboot_is_not_a_failing_unit() -> None:
    s = Seen(T0 + 200, {}, busy=None, active="activating", sub="start", rebooted=True, gap=5)
    assert judged(s) is None


def test_a_unit_failed_after_a_reboot_still_reverts() -> None:
    s = Seen(T0 + 200, {}, busy=None, active="failed", sub="failed", rebooted=True, gap=5)
    v = judged(s)
    assert v is not None and (v.state, v.signal) == ("revert", "down")


def test_an_oom_kill_reverts() -> None:
    s = Seen(T0 + 200, {}, active="activating", sub="auto-restart", result="oom-kill")
    v = judged(s)
    assert v is not None and (v.signal, v.hard) == ("oom", True)


def test_a_failing_unit_reverts() -> None:
    v = judged(Seen(T0 + 200, {}, active="failed", sub="failed", result="exit-code"))
    assert v is not None and (v.signal, v.hard) == ("down", True)


def test_a_unit_stopped_by_hand_ends_inconclusive_and_reverts_nothing() -> None:
    v = judged(Seen(T0 + 200, {}, active="inactive", sub="dead"))
    assert v is not None and v.state == "inconclusive" and v.signal == "stopped"


def test_context_exceeded_the_baseline_never_had_reverts_at_once() -> None:
    v = judged(seen(T0 + 5, busy=4, context_exceeded=4, failures=4))
    assert v is not None and (v.signal, v.hard) == ("context_exceeded", True)
    assert "generation 1 had none at 4 busy slots" in v.reason


def test_context_exceeded_with_no_baseline_reverts() -> None:
    v = judged(seen(context_exceeded=1, failures=1), base=None)
    assert v is not None and v.signal == "context_exceeded"


def test_context_exceeded_the_baseline_also_had_at_that_load_is_no_hard_signal() -> None:
    base = Baseline(1, failures={"context_exceeded": {4: 2}})
    v = judged(seen(busy=4, context_exceeded=1, failures=1), Window(1000, 1000, 1), base)
    assert v is None


def test_the_baselines_failures_at_a_lighter_load_do_not_excuse_a_heavier_one() -> None:
    base = Baseline(1, failures={"decode_failed": {2: 5}})
    v = judged(seen(busy=4, decode_failed=1, failures=1), Window(1000, 1000, 1), base)
    assert v is not None and v.signal == "decode_failed"


def test_failed_requests_over_one_percent_revert() -> None:
    base = Baseline(1, failures={"context_exceeded": {4: 9}})
    v = judged(seen(context_exceeded=2, failures=2), Window(100, 98, 2), base)
    assert v is not None and (v.signal, v.hard) == ("failed_requests", True)


def test_requests_too_long_for_their_slot_are_the_clients_and_do_not_count() -> None:
    v = judged(seen(too_long=5, failures=5), Window(100, 95, 5, too_long=5))
    assert v is None


# -- soft ------------------------------------------------------------------------------------


def slow(t: float) -> Seen:
    return seen(t, busy=4, decode_tokens=1000, decode_seconds=100)  # 10 tok/s against 20


def test_decode_speed_under_the_ratio_reverts_after_three_bad_samples_in_a_row() -> None:
    p = Progress()
    assert judged(slow(T0 + 200), p=p) is None
    assert judged(slow(T0 + 215), p=p) is None
    v = judged(slow(T0 + 230), p=p)
    assert v is not None and (v.state, v.signal, v.hard) == ("revert", "decode_speed", False)
    assert "10.0 tok/s at 4 busy slot(s), under 0.8x generation 1's 20.0" in v.reason


def test_a_good_sample_breaks_the_run_of_bad_ones() -> None:
    p = Progress()
    judged(slow(T0 + 200), p=p)
    judged(slow(T0 + 215), p=p)
    judged(seen(T0 + 230, busy=4, decode_tokens=2000, decode_seconds=100), p=p)
    assert judged(slow(T0 + 245), p=p) is None and p.soft_bad == 1


def test_decode_speed_compares_only_at_a_similar_number_of_busy_slots() -> None:
    p = Progress(soft_bad=2)
    # at 1 busy slot the baseline decoded 40 tok/s; at 8 it has nothing to compare with
    assert judged(seen(busy=8, decode_tokens=1000, decode_seconds=100), p=p) is None
    assert p.soft_bad == 2


def test_decode_speed_does_not_count_in_the_warm_up() -> None:
    p = Progress(soft_bad=2)
    assert judged(slow(T0 + 60), p=p) is None and p.soft_bad == 2


def test_decode_speed_does_not_count_under_twenty_completions() -> None:
    p = Progress(soft_bad=2)
    assert judged(slow(T0 + 200), Window(19, 19), p=p) is None and p.soft_bad == 2


def test_with_no_baseline_a_soft_signal_never_counts() -> None:
    p = Progress(soft_bad=2)
    assert judged(slow(T0 + 200), base=None, p=p) is None and p.soft_bad == 2


def test_memory_growing_faster_than_the_baselines_slope_is_a_bad_sample() -> None:
    mib = verdict.MIB
    base = Baseline(1, memory_slope=100.0 * mib)
    points = [(T0 + 60 * i, float(1000 * mib + i * 20 * mib)) for i in range(5)]  # 1,200 MiB/h
    bad = verdict.soft_signals(POLICY, base, seen(), Window(100, 100, memory=points), 200)
    assert bad and bad[0].startswith("memory_growth: 1200 MiB/h, over 256 MiB/h")


def test_memory_growth_under_the_floor_is_never_bad_against_a_flat_baseline() -> None:
    points = [(T0 + 60 * i, float(1000 * verdict.MIB + i * verdict.MIB)) for i in range(5)]
    bad = verdict.soft_signals(POLICY, BASE, seen(), Window(100, 100, memory=points), 200)
    assert bad == []


# -- the end ---------------------------------------------------------------------------------


def test_a_quiet_window_ends_inconclusive_and_keeps_the_new_config() -> None:
    v = judged(seen(T0 + 600, busy=0), Window(3, 3))
    assert v is not None and (v.state, v.signal) == ("inconclusive", "too_little_traffic")
    assert "nothing was judged on missing data" in v.reason


def test_a_busy_window_with_nothing_bad_passes() -> None:
    v = judged(seen(T0 + 600, busy=4, decode_tokens=2000, decode_seconds=100))
    assert v is not None and v.state == "passed"


def test_signals_unreadable_four_samples_in_a_row_end_inconclusive_not_in_a_revert() -> None:
    p = Progress()
    unread = [Seen(T0 + 200 + 15 * i, {}, busy=4, unread=("metrics",)) for i in range(4)]
    results = [judged(s, p=p) for s in unread]
    assert results[:3] == [None, None, None]
    assert results[3] is not None and (results[3].state, results[3].signal) == (
        "inconclusive",
        "unreadable",
    )


def test_a_sampler_away_past_the_deadline_ends_inconclusive() -> None:
    v = judged(Seen(T0 + 900, {}, busy=0, gap=700))
    assert v is not None and (v.state, v.signal) == ("inconclusive", "gap")


def test_a_sampler_away_before_the_deadline_resumes_and_says_so() -> None:
    p = Progress()
    assert judged(Seen(T0 + 300, {}, busy=0, gap=200), p=p) is None
    assert p.notes and "the sampler did not run for 200s; the bake resumed" in p.notes[0]


# -- the baseline ----------------------------------------------------------------------------


def test_the_baseline_keeps_decode_medians_by_the_busy_slots_they_were_measured_at() -> None:
    rec = record.Record(1)
    for i, (busy, tokens) in enumerate([(1, 400), (1, 600), (4, 200), (4, 200), (4, 100)]):
        now = record.Now(busy=busy, memory=1 << 30)
        rec.add(record.Delta(T0 + 60 * i, now, {"decode_tokens": tokens, "decode_seconds": 10}))
    base = verdict.baseline_of(rec)
    assert base.decode_by_busy == {1: 50.0, 4: 20.0}
    assert base.decode_at(3) == 20.0 and base.decode_at(7) is None


def test_the_baseline_records_pool_failures_with_the_busy_slots_of_their_minute() -> None:
    rec = record.Record(1)
    rec.add(record.Delta(T0, record.Now(busy=3), {"context_exceeded": 2, "failures": 2}))
    base = verdict.Baseline.from_dict(verdict.baseline_of(rec).to_dict())
    assert (
        base is not None and base.had("context_exceeded", 3) and not base.had("context_exceeded", 4)
    )


# -- vLLM: it queues what its pool cannot hold ------------------------------------------------


def queued(waiting: int, **counts: float) -> Seen:
    return Seen(T0 + 200, {"preemptions": 0, **counts}, busy=2, waiting=waiting)


def test_a_vllm_that_preempts_where_the_baseline_never_queued_is_a_bad_sample() -> None:
    base = Baseline(1, waited_by_busy={2: 0, 4: 0})
    bad = verdict.soft_signals(POLICY, base, queued(3, preemptions=5), BUSY_WINDOW, 200)
    assert bad == [
        "preempting: 5 sequence(s) preempted and 3 request(s) waiting at 2 busy; "
        "generation 1 never queued at that load"
    ]


def test_a_vllm_queueing_where_the_baseline_queued_too_is_no_bad_sample() -> None:
    base = Baseline(1, waited_by_busy={1: 2, 4: 0})
    assert verdict.soft_signals(POLICY, base, queued(3, preemptions=5), BUSY_WINDOW, 200) == []


def test_a_baseline_never_sampled_at_that_load_judges_no_preemption() -> None:
    base = Baseline(1, waited_by_busy={1: 0})
    assert verdict.soft_signals(POLICY, base, queued(3, preemptions=2), BUSY_WINDOW, 200) is None


def test_a_queue_without_preemptions_is_no_sign() -> None:
    """Fewer sequences (--max-num-seqs) queue by design."""
    base = Baseline(1, waited_by_busy={2: 0, 4: 0})
    assert verdict.soft_signals(POLICY, base, queued(3), BUSY_WINDOW, 200) is None


def test_llama_servers_deferred_requests_are_not_judged_as_a_queue() -> None:
    base = Baseline(1, waited_by_busy={2: 0, 4: 0})
    s = Seen(T0 + 200, {}, busy=2, waiting=3)  # no preemption counter: not vLLM
    assert verdict.soft_signals(POLICY, base, s, BUSY_WINDOW, 200) is None


def test_the_baseline_keeps_the_most_a_minute_queued_by_its_load() -> None:
    rec = record.Record(1)
    for t, busy, deferred in ((T0, 2, 0), (T0 + 60, 2, 3), (T0 + 120, 4, 1)):
        rec.add(record.Delta(t, record.Now(up=True, busy=busy, deferred=deferred), {"requests": 1}))
    assert verdict.baseline_of(rec).waited_by_busy == {2: 3, 4: 1}
