"""The bake record and its steps (launcher/watch/bake.py) over a real store in tmp_path; the
revert is passed in (its real run: tests/test_bake_server.py)."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from launcher import config
from launcher.deploy import store
from launcher.host.systemd import UnitState
from launcher.watch import bake, carry, record, verdict
from launcher.watch.bake import Bake
from launcher.watch.verdict import Verdict

T0 = 1_000_000.0
RUNNING = UnitState("active", "running", "success", 0, 0, 4242, None, "x", "loaded")


class Reverts:
    """A revert that records what it was asked (the real one restarts a unit)."""

    def __init__(self, outcome: str = "reverted") -> None:
        self.calls: list[Verdict] = []
        self.outcome = outcome

    def __call__(self, b: Bake, why: Verdict) -> dict[str, Any]:
        self.calls.append(why)
        return {"outcome": self.outcome, "generation": 3, "message": "done"}


def two_generations(tmp_path: Path, baseline_rows: int = 3) -> store.Store:
    st = store.Store(tmp_path)
    old = st.new("A=1\n", {"time": T0 - 3600, "timings": {"total": 1}})
    new = st.new("A=2\n", {"time": T0, "timings": {"total": 2}, "previous": 1})
    rec = record.Record(old.number)
    for i in range(baseline_rows):
        counts = {"requests": 5, "completions": 5, "decode_tokens": 400, "decode_seconds": 10}
        rec.add(record.Delta(T0 - 3000 + 60 * i, record.Now(busy=4), counts))
    record.save(old.path, rec, lambda p, d, m: store.atomic_write(p, d, m))
    st.set_live(new.number)
    return st


def settings(**kw: Any) -> config.ToolSettings:
    return config.load_settings(bake="10m", **kw)


def step(st: store.Store, t: float, revert: Reverts, **counts: float) -> Bake | None:
    gen = st.get(2)
    rec = record.Record(2, totals={"requests": 50, "completions": 50})

    def seen(b: Bake) -> verdict.Seen:
        return bake.seen_of(b, t, counts, 4, RUNNING, {})

    return bake.step(gen, rec, seen, revert)


def test_a_bake_begins_with_the_previous_generations_figures_as_its_baseline(
    tmp_path: Path,
) -> None:
    st = two_generations(tmp_path)
    b = bake.begin(settings(), st, 2, 1)
    assert b.baseline is not None and b.baseline.decode_by_busy == {4: 40.0}
    on_disk = json.loads((st.get(2).path / "bake.json").read_text())
    assert on_disk["state"] == "baking" and on_disk["deadline"] == T0 + 2 + 600


def test_a_previous_generation_that_recorded_nothing_gives_no_baseline(tmp_path: Path) -> None:
    st = two_generations(tmp_path, baseline_rows=0)
    assert bake.begin(settings(), st, 2, 1).baseline is None


def test_the_deadline_of_the_running_bake_is_readable_by_others(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    assert bake.deadline(tmp_path) is None
    bake.begin(settings(), st, 2, 1)
    assert bake.deadline(tmp_path) == T0 + 2 + 600


def test_a_hard_failure_reverts_once_and_the_record_says_why(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    bake.begin(settings(), st, 2, 1)
    reverts = Reverts()
    b = step(st, T0 + 30, reverts, context_exceeded=4, failures=4)
    assert b is not None and b.state == "reverted" and len(reverts.calls) == 1
    assert reverts.calls[0].hard and reverts.calls[0].signal == "context_exceeded"
    assert step(st, T0 + 45, reverts, context_exceeded=4, failures=4) is None
    assert len(reverts.calls) == 1  # at most one revert: the bake has ended
    assert "reverted (hard: 4 request(s) failed" in bake.say(bake.load(st.get(2).path))  # type: ignore[arg-type]


def test_a_revert_whose_rollback_fails_ends_revert_failed(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    bake.begin(settings(), st, 2, 1)
    b = step(st, T0 + 30, Reverts("rollback_failed"), restarts=1)
    assert b is not None and b.state == "revert_failed"


def test_a_quiet_unit_past_the_deadline_ends_inconclusive_and_reverts_nothing(
    tmp_path: Path,
) -> None:
    st = two_generations(tmp_path)
    bake.begin(settings(), st, 2, 1)
    reverts = Reverts()
    gen = st.get(2)
    quiet = record.Record(2, totals={"requests": 1, "completions": 1})
    b = bake.step(gen, quiet, lambda b: bake.seen_of(b, T0 + 700, {}, 0, RUNNING, {}), reverts)
    assert b is not None and b.state == "inconclusive" and reverts.calls == []


def test_a_hard_failure_with_nothing_before_to_put_back_is_inconclusive(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    bake.begin(settings(), st, 2, None)
    reverts = Reverts()
    b = step(st, T0 + 30, reverts, restarts=1)
    assert b is not None and b.state == "inconclusive" and reverts.calls == []


def test_a_later_deploy_ends_a_running_bake_and_says_so(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    bake.begin(settings(), st, 2, 1)
    ended = bake.end(st, 2, "generation 3 was deployed over it")
    assert ended is not None and ended["state"] == "ended"
    assert ended["verdict"]["reason"] == "generation 3 was deployed over it"
    assert bake.end(st, 2, "again") is None


def test_a_restart_seen_after_a_reboot_is_not_counted_and_the_bake_resumes(
    tmp_path: Path,
) -> None:
    st = two_generations(tmp_path)
    b = bake.begin(settings(), st, 2, 1)
    b.boot_id = "a boot before this one"
    b.progress.last = T0 + 30
    bake.save(st.get(2).path, b)
    reverts = Reverts()
    after = step(st, T0 + 200, reverts, restarts=1)
    assert after is not None and after.state == "baking" and reverts.calls == []
    assert "the host rebooted for 170s; the bake resumed" in after.progress.notes[0]
    assert after.boot_id == bake.boot_id()


def test_carry_samples_until_the_verdict(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    bake.begin(settings(), st, 2, 1)
    clock = [T0 + 560.0]
    reverts = Reverts()

    def sample_once(peak: object, revert: object) -> None:
        assert peak is None and revert is None  # the pool is not watched: no look
        clock[0] += 15
        step(st, clock[0], reverts)

    slept: list[float] = []
    b = carry.carry(st, 2, sample_once, slept.append)
    assert b is not None and b.state == "passed" and clock[0] == T0 + 605
    assert slept == [15.0, 15.0]


class Skipped:
    """A carry whose every sample is skipped, on a clock the test moves: ``now`` seconds
    since the carry began, the wall ``offset`` seconds after the bake's start (T0 + 2)."""

    SAID = SimpleNamespace(skipped="a deploy of ll.service is in progress", errors=[])

    def __init__(self, offset: float) -> None:
        self.now, self.offset = 0.0, offset

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        assert self.now < 2000, "the carry did not give up"

    def carry(self, st: store.Store, **kw: Any) -> Bake | None:
        return carry.carry(
            st, 2, lambda peak, revert: self.SAID, self.sleep, clock=lambda: self.now,
            wall=lambda: T0 + 2 + self.offset + self.now, **kw,
        )  # fmt: skip


@pytest.fixture
def baking(tmp_path: Path) -> store.Store:
    """Generation 2 baking: 10 minutes, a sample every 15 s, unread limit 4."""
    s = two_generations(tmp_path)
    bake.begin(settings(), s, 2, 1)
    return s


def test_a_carry_no_sample_judges_past_the_deadline_ends_the_bake_unjudged(
    baking: store.Store,
) -> None:
    c = Skipped(offset=600)  # at its deadline from the start
    b = c.carry(baking)
    assert b is not None and b.verdict is not None
    assert (b.state, b.verdict.signal) == ("inconclusive", carry.UNJUDGED)
    assert "(the last: a deploy of ll.service is in progress)" in b.verdict.reason
    assert 60 <= c.now < 75  # four intervals
    assert bake.load(baking.get(2).path) == b  # recorded


def test_a_carry_whose_samples_are_skipped_before_the_deadline_waits_for_it(
    baking: store.Store,
) -> None:
    c = Skipped(offset=0)
    b = c.carry(baking)
    assert b is not None and b.state == "inconclusive"
    assert 600 <= c.now < 615


def test_a_carry_waits_for_a_deploy_under_way_within_its_budget(baking: store.Store) -> None:
    baking.begin({"started": T0 + 602, "budget": 300.0})  # began at the deadline
    c = Skipped(offset=600)
    b = c.carry(baking)
    assert b is not None and b.state == "inconclusive"
    assert 360 <= c.now < 375  # its budget and four intervals


def test_a_carry_gives_up_unrecorded_when_another_sample_keeps_the_lock(
    baking: store.Store,
) -> None:
    c = Skipped(offset=600)
    b = c.carry(baking, lock=lambda: contextlib.nullcontext(False))
    assert b is not None and b.verdict is not None and b.state == "inconclusive"
    assert "not recorded: another sample keeps the sampler's lock" in b.verdict.reason
    assert 180 <= c.now < 195  # three times as long
    assert bake.load(baking.get(2).path).state == "baking"  # type: ignore[union-attr]


@pytest.mark.parametrize("state", ["passed", "ended"])
def test_carry_of_a_bake_that_ended_samples_nothing(tmp_path: Path, state: str) -> None:
    st = two_generations(tmp_path)
    b = bake.begin(settings(), st, 2, 1)
    b.state = state
    bake.save(st.get(2).path, b)
    calls: list[int] = []
    assert carry.carry(st, 2, lambda p, r: calls.append(1), lambda s: None) is not None
    assert calls == []


def test_an_unreadable_bake_record_is_no_bake(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    (st.get(2).path / "bake.json").write_text("{not json")
    assert bake.load(st.get(2).path) is None and bake.deadline(tmp_path) is None


# -- a reboot and the sampler's count of restarts ----------------------------------------------


def _unit(pid: int, n_restarts: int = 0, active: str = "active") -> UnitState:
    return UnitState(active, "running", "success", n_restarts, 0, pid, None, "x", "loaded")


def test_the_first_process_of_a_new_boot_is_no_restart() -> None:
    from launcher.watch import sample, sampler

    state = sampler.State(generation=2, pid=4242, n_restarts=3, boot="the boot before")
    assert sample._restarts(_unit(77), state, 2) == 0
    assert (state.pid, state.n_restarts, state.boot) == (77, 0, bake.boot_id())


def test_a_new_boot_seen_while_the_unit_comes_up_is_counted_from_its_process() -> None:
    """A sample taken after the boot but before the unit runs (no MainPID yet) keeps the
    boot unseen: the next sample's new process is the boot's, not a restart."""
    from launcher.watch import sample, sampler

    state = sampler.State(generation=2, pid=4242, n_restarts=0, boot="the boot before")
    assert sample._restarts(_unit(0, active="activating"), state, 2) == 0
    assert sample._restarts(_unit(77), state, 2) == 0


def test_a_new_process_in_the_same_boot_is_a_restart() -> None:
    from launcher.watch import sample, sampler

    state = sampler.State(generation=2, pid=4242, n_restarts=0, boot=bake.boot_id())
    assert sample._restarts(_unit(77, n_restarts=1), state, 2) == 1


# -- the metrics file --------------------------------------------------------------------------


def bake_series(st: store.Store) -> dict[str, float]:
    from test_watch_record import samples_of

    from launcher.watch import textfile

    page = textfile.Page("llama-server.service")
    textfile.bake_lines(st, page)
    return {
        name + (f"{{{lab['state']}}}" if "state" in lab else ""): v
        for name, lab, v in samples_of(page.render())
    }


def test_the_metrics_file_says_a_bake_runs_and_when_it_ends(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    b = bake.begin(settings(), st, 2, 1)
    got = bake_series(st)
    assert got["llama_launcher_bake_state{baking}"] == 1
    assert sum(v for k, v in got.items() if k.startswith("llama_launcher_bake_state")) == 1
    assert set(bake.STATES) == {
        k.split("{")[1].rstrip("}") for k in got if k.startswith("llama_launcher_bake_state")
    }
    assert got["llama_launcher_bake_generation"] == 2
    assert got["llama_launcher_bake_deadline_timestamp_seconds"] == pytest.approx(b.deadline)


def test_the_metrics_file_says_the_bake_the_live_revert_ended(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    bake.begin(settings(), st, 2, 1)
    step(st, T0 + 100, Reverts(), restarts=1)  # reverted
    revert = st.new("A=1\n", {"time": T0 + 101, "reverted_from": 2})
    st.set_live(revert.number)
    got = bake_series(st)
    assert got["llama_launcher_bake_state{reverted}"] == 1
    assert got["llama_launcher_bake_state{baking}"] == 0
    assert got["llama_launcher_bake_generation"] == 2


def test_a_unit_that_never_baked_has_no_bake_series(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    assert not any(k.startswith("llama_launcher_bake") for k in bake_series(st))


def _proc(root: Path, btime: int, pid1_start: int) -> Path:
    (root / "1").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  1 2 3\nbtime {btime}\nprocesses 9\n")
    fields = ["S", *(["0"] * 18), str(pid1_start), "0"]  # field 22: the start, in ticks
    (root / "1" / "stat").write_text(f"1 (systemd (x)) {' '.join(fields)}\n")
    return root


def test_a_boot_is_the_kernels_boot_time_and_pid_1s_start(tmp_path: Path) -> None:
    from launcher.host import procfs

    assert procfs.boot(_proc(tmp_path, 1796160993, 25)) == "1796160993:25"


def test_a_containers_reboot_is_another_boot_though_the_kernel_is_the_same(
    tmp_path: Path,
) -> None:
    """systemd-nspawn's reboot: the host's kernel (its boot time) stays, PID 1 is new."""
    from launcher.host import procfs

    before = procfs.boot(_proc(tmp_path, 1796160993, 25))
    assert procfs.boot(_proc(tmp_path, 1796160993, 1447240)) != before


def test_an_unreadable_boot_is_none(tmp_path: Path) -> None:
    from launcher.host import procfs

    assert procfs.boot(tmp_path) is None


# -- a sampler killed during its revert ----------------------------------------------------------


def cut_revert(tmp_path: Path) -> store.Store:
    """Generation 2's bake decided a revert and its sampler died during it (``reverting``)."""
    st = two_generations(tmp_path)
    b = bake.begin(settings(), st, 2, 1)
    why = Verdict("revert", "restart", "the unit restarted 1 time(s) since the last sample", True)
    b.finish("reverting", why, T0 + 100)
    bake.save(st.get(2).path, b)
    return st


def test_a_revert_cut_after_it_was_recorded_is_settled_reverted(tmp_path: Path) -> None:
    st = cut_revert(tmp_path)
    revert = st.new("A=1\n", {"time": T0 + 101, "outcome": "deployed", "reverted_from": 2})
    st.set_live(revert.number)
    b = bake.settle(st)
    assert b is not None and b.state == "reverted"
    assert (b.revert or {})["generation"] == revert.number
    assert bake.load(st.get(2).path).state == "reverted"  # type: ignore[union-attr]


def test_a_revert_cut_after_its_commit_is_told_by_the_config_that_serves(tmp_path: Path) -> None:
    """The rollback committed (generation 1's config live as generation 3), the sampler died
    before it tagged it: the generations say it was the revert, and it is tagged now."""
    st = cut_revert(tmp_path)
    rollback = st.new("A=1\n", {"time": T0 + 101, "outcome": "deployed"})
    st.set_live(rollback.number)
    b = bake.settle(st)
    assert b is not None and b.state == "reverted"
    assert st.get(rollback.number).meta["reverted_from"] == 2
    assert bake.newest(st) is not None and bake.newest(st).state == "reverted"  # type: ignore[union-attr]


def test_a_revert_the_recovery_undid_is_settled_revert_failed_naming_the_fix(
    tmp_path: Path,
) -> None:
    st = cut_revert(tmp_path)  # the baked generation 2 is live again
    b = bake.settle(st)
    assert b is not None and b.state == "revert_failed"
    assert "llama-launcher rollback --to 1" in (b.revert or {})["message"]
    assert "revert_failed" in bake.say(b) or "failed" in bake.say(b)


def test_a_cut_revert_whose_transaction_is_pending_waits_for_the_recovery(tmp_path: Path) -> None:
    st = cut_revert(tmp_path)
    st.begin({"phase": "swapped", "from": 2, "to": 3})
    b = bake.settle(st)
    assert b is not None and b.state == "reverting"
    assert bake.load(st.get(2).path).state == "reverting"  # type: ignore[union-attr]


def test_nothing_reverting_settles_nothing(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    bake.begin(settings(), st, 2, 1)
    assert bake.settle(st) is None


def test_a_sample_names_recover_while_a_cut_revert_waits_for_it(tmp_path: Path) -> None:
    from launcher.watch import sample, sampler

    st = cut_revert(tmp_path)
    st.begin({"phase": "swapped", "from": 2, "to": 3})
    out = sampler.Outcome("llama-server.service")
    sample._settle(sampler.Target("llama-server.service", tmp_path), st, out)
    assert out.bake is not None and out.bake["state"] == "reverting"
    assert any("llama-launcher recover --unit llama-server.service" in w for w in out.warnings)


def test_a_sample_settles_a_cut_revert_once_its_transaction_is_gone(tmp_path: Path) -> None:
    from launcher.watch import sample, sampler

    st = cut_revert(tmp_path)
    out = sampler.Outcome("llama-server.service")
    sample._settle(sampler.Target("llama-server.service", tmp_path), st, out)
    assert out.bake is not None and out.bake["state"] == "revert_failed"
    assert any("the revert" in w and "failed" in w for w in out.warnings), out.warnings


# -- the front's own failures --------------------------------------------------------------------


def _front_reads(identity: str, sent: int, server: int) -> Any:
    from launcher.watch import reads

    return reads.Reads(RUNNING, front=(identity, sent, server))


def test_the_fronts_own_5xx_are_failed_requests() -> None:
    """The 5xx clients got beyond those llama-server sent (the journal counts those)."""
    from launcher.watch import sample, sampler

    state = sampler.State()
    assert sample._front_failures(_front_reads("9:100", 2, 1), state) == 0  # the first read
    assert sample._front_failures(_front_reads("9:100", 9, 3), state) == 5


def test_a_restarted_front_counts_from_zero_again() -> None:
    from launcher.watch import sample, sampler

    state = sampler.State()
    sample._front_failures(_front_reads("9:100", 40, 0), state)
    assert sample._front_failures(_front_reads("12:200", 3, 0), state) == 0
    assert sample._front_failures(_front_reads("12:200", 4, 0), state) == 1


def test_a_unit_without_a_front_has_no_front_failures() -> None:
    from launcher.watch import reads, sample, sampler

    assert sample._front_failures(reads.Reads(RUNNING), sampler.State()) == 0


# -- the hand-off's announcement and a revert a deploy came before -------------------------


def test_an_announcement_is_removed_only_by_the_deployer_that_wrote_it(tmp_path: Path) -> None:
    st = store.Store(tmp_path)
    pid = bake.announce(st, 2, 60)
    bake.unannounce(st, pid + 1)  # another run (a check, a lock timeout) leaves it alone
    assert bake.announced(st) == (pid, pytest.approx(bake.announced(st)[1]))  # type: ignore[index]
    bake.unannounce(st, pid)
    assert bake.announced(st) is None and not bake.announce_path(st).exists()


def test_a_stale_announcement_is_not_waited_for_and_goes(tmp_path: Path) -> None:
    st = store.Store(tmp_path)
    gone = subprocess.Popen(["true"])  # a deployer that exited (a pid no process has)
    gone.wait()
    path = bake.announce_path(st)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": gone.pid, "generation": 2, "until": T0 * 2}))
    assert bake.announced(st) is None and not path.exists()
    assert bake.awaited(st) is None


def test_a_revert_a_deploy_came_before_ends_the_bake_and_changes_nothing(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    bake.begin(settings(bake_warmup=0), st, 2, 1)
    b = step(st, T0 + 30, Reverts("ended"), context_exceeded=3, failures=3, requests=3)
    assert b is not None and b.state == "ended", b.to_json()


def test_a_later_deploy_ends_a_bake_whose_revert_never_ran(tmp_path: Path) -> None:
    st = two_generations(tmp_path)
    gen = st.get(2)
    b = bake.begin(settings(), st, 2, 1)
    b.state = bake.REVERTING  # its carrier waited for the lock the deploy held
    bake.save(gen.path, b)
    assert bake.end(st, 2, "generation 3 replaced it (set)") is not None
    assert bake.load(gen.path).state == "ended"  # type: ignore[union-attr]
