"""The budgets of a restart (launcher.deploy.budgets), the stop's TimeoutStopSec as systemctl
prints it, and the /health backoff (launcher.waits.Backoff)."""

from __future__ import annotations

import pytest

from launcher import config, waits
from launcher.deploy import budgets
from launcher.deploy.budgets import Load
from launcher.host import systemd

W = waits.Waits()  # nothing given: every budget sized
SLOW = Load(stop=0.02, start=200.0, health=1.0, stop_budget=35.0)
TINY = Load(stop=0.02, start=0.04, health=0.01, stop_budget=35.0)


@pytest.mark.parametrize(
    ("last", "start", "health"),
    [
        (None, 120.0, 300.0),  # never measured: the floors
        (TINY, 120.0, 300.0),  # a 40 ms load keeps the floors
        (SLOW, 800.0, 300.0),  # a 200 s load gets 4 x 200 s
    ],
)
def test_a_deploy_is_sized_by_the_units_last_load(
    last: Load | None, start: float, health: float
) -> None:
    b = budgets.for_deploy(W, last)
    assert (b.start, b.health) == (start, health)


def test_a_given_budget_replaces_the_sized_one_for_a_deploy() -> None:
    b = budgets.for_deploy(waits.Waits(start=5, health=6), SLOW)
    assert (b.start, b.health) == (5, 6)


def test_a_rollback_gets_its_own_generations_budget_however_short_the_given_one() -> None:
    b = budgets.for_rollback(waits.Waits(start=5, health=5), SLOW)
    assert (b.start, b.health) == (800.0, 300.0)
    assert budgets.for_rollback(waits.Waits(start=2000, health=5), TINY).start == 2000


def test_progress_expects_the_measured_load() -> None:
    assert budgets.for_deploy(W, SLOW).expected == 201.0
    assert budgets.for_deploy(W, None).expected is None


def test_the_load_is_read_from_the_gates_timings() -> None:
    load = Load.from_timings({"stopped": 1.5, "startup_line": 4.0, "healthy": 4.25}, 35.0)
    assert load == Load(1.5, 2.5, 0.25, 35.0)
    assert Load.of_meta({"load": load.to_dict()}) == load


def test_a_generation_stored_before_loads_were_recorded_has_its_timings() -> None:
    assert Load.of_meta({"timings": {"healthy": 3.0, "completion": 3.2}}) == Load(0, 3.0, 0)
    assert Load.of_meta({"timings": {"validate": 0.1}}) is None
    assert Load.of_meta({"load": {"stop": "x"}}) is None
    assert Load.of_meta(None) is None


def test_the_default_lock_wait_is_one_deploys_budget() -> None:
    s = config.load_settings(drain_timeout=10, probe_timeout=20)
    w = waits.Waits.from_settings(s)
    # drain 10 + stop 35 + start 800 + health 300 + probe 20 + settle 0
    assert budgets.lock_wait(s, w, SLOW) == 1165
    assert budgets.lock_wait(config.load_settings(lock_timeout=3), w, SLOW) == 3


def test_unset_settings_leave_the_budgets_to_be_sized() -> None:
    w = waits.Waits.from_settings(config.load_settings())
    assert (w.start, w.health) == (None, None)


@pytest.mark.parametrize(
    ("shown", "seconds"),
    [
        ("30s", 30.0),
        ("1min 30s", 90.0),
        ("500ms", 0.5),
        ("1h 2min 3.5s", 3723.5),
        ("infinity", None),
        ("", None),
        ("30 parsecs", None),
    ],
)
def test_timeout_stop_sec_as_systemctl_show_prints_it(shown: str, seconds: float | None) -> None:
    assert systemd.timespan(shown) == seconds


def test_an_infinite_stop_timeout_still_has_a_bound() -> None:
    assert budgets.stop_budget(None, 5.0) == budgets.DEFAULT_STOP + 5.0
    assert budgets.stop_budget(4.0, 5.0) == 9.0


def test_health_polls_back_off_to_their_cap_and_start_over() -> None:
    now = [0.0]
    b = waits.Backoff(0.01, 0.05, clock=lambda: now[0])
    pauses = []
    for _ in range(5):
        assert b.due()
        b.tried()
        pauses.append(round(b.next_at - now[0], 3))
        assert not b.due()
        now[0] = b.next_at
    assert pauses == [0.01, 0.02, 0.04, 0.05, 0.05]
    b.tried()
    b.reset()
    assert b.due() and b.pause == 0.01


def test_health_polls_stay_fast_for_the_first_moments() -> None:
    now = [0.0]
    b = waits.Backoff(0.01, 0.5, fast_for=0.05, clock=lambda: now[0])
    pauses = []
    while now[0] < 0.2:
        b.tried()
        pauses.append(round(b.next_at - now[0], 3))
        now[0] = b.next_at
    assert pauses[:5] == [0.01] * 5  # 0 .. 0.05 s: every 10 ms
    assert pauses[5:8] == [0.01, 0.02, 0.04]  # then doubled
