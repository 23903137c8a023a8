"""A wedged server is noticed (launcher/watch/wedge.py, the sampler's use of it): the
counting rules, pure; the sampler's look at a server whose loop stalls (a transport handed
in: the real llama-server cannot stall its loop while /health answers); and a SIGSTOPped
real llama-server under the sandboxed systemd: restarted by the sampler after the count, or,
while a bake runs, reverted by the bake.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import realserver
from conftest import Host
from test_bake import T0, Reverts, two_generations
from test_bake import settings as bake_settings
from test_watch import first_timer_sample, take
from test_watch_record import samples_of

from launcher.deploy import store
from launcher.host import procfs, timer
from launcher.host.systemd import Systemd, UnitState
from launcher.server import metrics
from launcher.watch import bake, record, sample, sampler, textfile, verdict, wedge
from launcher.watch.reads import HEALTH_TIMEOUT, Reads
from launcher.watch.wedge import Look

PID = 4242
RUNNING = UnitState("active", "running", "success", 0, 0, PID, None, "x", "loaded")
NO_ANSWER = f"/health did not answer within {HEALTH_TIMEOUT:g}s (timeout)"


def m(waiting: float = 0, **counters: float) -> metrics.Metrics:
    base = {"prompt_tokens_total": 10.0, "tokens_predicted_total": 5.0, "n_decode_total": 7.0}
    return metrics.Metrics({**base, **counters}, {"requests_deferred": waiting}, "start-1")


BEFORE = m().counters


# -- the rules, pure ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("look", "wedged"),
    [
        (Look(health=None, detail="timeout"), NO_ANSWER),
        (Look(health=503, detail="Loading model"), None),  # a load is never a wedge
        (Look(health=None, detail="timeout", loaded=False), None),  # young, never answered
        (Look(health=None, detail="timeout", zombie=True), None),
        (Look(health=None, detail="ConnectError"), None),  # nobody listens there: a wrong URL
        (Look(health=200, loop=wedge.STALLED, completion=True), None),
        (Look(health=200, loop=wedge.PROGRESS, completion=False), None),
        (Look(health=200, loop=wedge.IDLE, completion=False), None),
        (Look(health=200, loop=wedge.UNKNOWN, completion=False), None),
    ],
)
def test_what_one_sample_is(look: Look, wedged: str | None) -> None:
    assert wedge.judge(look) == wedged


def test_no_look_is_no_wedge() -> None:
    assert wedge.judge(None) is None  # the unit is not running: systemd's to handle


@pytest.mark.parametrize("loop", [wedge.STALLED, wedge.SILENT])
def test_health_that_answers_with_a_loop_that_does_not_and_no_completion_is_wedged(
    loop: str,
) -> None:
    look = Look(health=200, loop=loop, completion=False)
    assert look.suspect
    why = wedge.judge(look)
    assert why is not None and "1-token completion did not" in why


@pytest.mark.parametrize(
    ("now", "silent", "before", "loop"),
    [
        (m(waiting=2, n_decode_total=8.0), False, BEFORE, wedge.PROGRESS),  # busy, progressing
        (m(waiting=2), False, BEFORE, wedge.STALLED),
        (m(), False, BEFORE, wedge.IDLE),
        (m(waiting=2), False, None, wedge.UNKNOWN),  # the process's first read
        (None, True, BEFORE, wedge.SILENT),
        (None, False, BEFORE, wedge.UNKNOWN),  # /metrics off: only /health judges
    ],
)
def test_what_the_loop_did(
    now: metrics.Metrics | None, silent: bool, before: dict[str, float] | None, loop: str
) -> None:
    assert wedge.loop_of(now, silent, before) == loop


def test_a_build_without_n_decode_total_is_never_stalled() -> None:
    """Its token counters move only when a request ends: a long generation looks still."""
    now = metrics.Metrics({"tokens_predicted_total": 5.0}, {"requests_processing": 1}, None)
    assert wedge.loop_of(now, False, {"tokens_predicted_total": 5.0}) == wedge.UNKNOWN


def test_the_count_in_a_row_restarts_at_the_setting() -> None:
    run: list[Any] = []
    for n in (1, 2, 3):
        k = wedge.run_of(run, PID, NO_ANSWER)
        assert k == n and wedge.due(k, 3) == (n == 3)
        run = [PID, k]


def test_a_recovery_resets_the_count() -> None:
    assert wedge.run_of([PID, 2], PID, None) == 0


def test_a_new_process_starts_its_own_count() -> None:
    assert wedge.run_of([PID, 2], PID + 1, NO_ANSWER) == 1


def test_zero_is_off() -> None:
    assert not wedge.due(100, 0)


def test_history_says_why_it_restarted() -> None:
    line = wedge.line_of([wedge.record_of(0.0, PID, 3, NO_ANSWER)])
    assert line is not None and line.startswith("restarted: wedged 3 samples in a row at ")
    assert NO_ANSWER in line
    assert wedge.line_of([]) is None


def test_a_wedge_during_a_bake_is_a_hard_signal_its_revert_puts_the_previous_config_back(
    tmp_path: Path,
) -> None:
    st = two_generations(tmp_path)
    bake.begin(bake_settings(), st, 2, 1)
    revert = Reverts()
    why = f"2 samples in a row: {NO_ANSWER}"

    def seen(b: bake.Bake) -> verdict.Seen:
        return bake.seen_of(b, T0 + 60, {}, None, RUNNING, {}, wedged=why, stuck=True)

    judged = bake.step(st.get(2), record.Record(2), seen, revert)
    assert judged is not None and judged.state == "reverted"
    (v,) = revert.calls
    assert (v.signal, v.hard) == ("wedged", True) and NO_ANSWER in v.reason
    assert sample._reverted(judged)  # so the sampler does not restart it besides


def test_a_wedged_samples_unread_sources_do_not_end_a_bake_inconclusive() -> None:
    """They are the wedge rules' to count: a bake must not end unreadable before the wedge
    count reverts it."""
    b = bake.Bake(2, 0.0, verdict.Policy(600))
    unread = {"slots": "skipped", "metrics": "skipped"}
    assert bake.seen_of(b, 1.0, {}, None, RUNNING, unread, stuck=True).unread == ()
    assert bake.seen_of(b, 1.0, {}, None, RUNNING, unread).unread == ("slots", "metrics")


def test_install_renders_the_setting_into_the_samplers_command_line() -> None:
    s = timer.Sampler(
        unit="llama-server.service", scope="user", python="/usr/bin/python3",
        package_dir="/opt/ll", state_dir="/s", env_file="/e.env", interval=60.0,
        wedged_samples=5,
    )  # fmt: skip
    assert " --env-file /e.env --wedged-samples 5" in timer.render_service(s)


# -- the process: zombie and age ---------------------------------------------------------------


def test_a_process_state_and_age_come_from_its_stat(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    ticks = os.sysconf("SC_CLK_TCK")
    fields = ["T", *["0"] * 18, str(100 * ticks)]  # field 3 (state) .. field 22 (starttime)
    (tmp_path / "7" / "stat").write_text(f"7 (llama server) {' '.join(fields)} 0 0\n")
    (tmp_path / "uptime").write_text("160.00 300.00\n")
    p = procfs.process(7, tmp_path)
    assert (p.state, p.age, p.zombie) == ("T", pytest.approx(60.0), False)


def test_a_stopped_process_reads_stopped_and_young() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while (p := procfs.process(child.pid)).state != "T":
            assert time.monotonic() < deadline, p
            time.sleep(0.01)
        assert not p.zombie and 0 <= p.age < 10
        child.kill()
        while (p := procfs.process(child.pid)).state != "Z":  # not reaped yet
            assert time.monotonic() < deadline, p
            time.sleep(0.01)
        assert p.zombie
    finally:
        child.kill()
        child.wait()


# -- the sampler's look (a transport for a loop that stalls) ---------------------------------


def live_generation(tmp_path: Path, served: float) -> store.Store:
    st = store.Store(tmp_path)
    gen = st.new("A=1\n", {"time": served, "argv": ["--port", "9"], "timings": {"total": 0}})
    st.set_live(gen.number)
    return st


class Server:
    """/health answers 200; a completion times out (the loop stalls): what the real
    llama-server cannot be made to do while its HTTP threads run."""

    def __init__(self) -> None:
        self.completions = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        self.completions += 1
        raise httpx.ReadTimeout("no answer", request=request)


def look(
    tmp_path: Path, now: metrics.Metrics, server: Server, answered: int = PID
) -> tuple[int, str | None, sampler.State]:
    st = live_generation(tmp_path, time.time() - 3600)
    gen = st.live()
    assert gen is not None
    state = sampler.State(counters=dict(BEFORE), process="start-1", answered=answered)
    reads = Reads(RUNNING, metrics=now, health=(200, "ok"), process=procfs.Process("S", 60.0))
    target = sampler.Target("llama-server.service", tmp_path)
    out = sampler.Outcome(target.unit)
    run, why = wedge.count(target, gen, reads, state, httpx.MockTransport(server), out)
    return run, why, state


def test_a_busy_server_that_progresses_is_never_sent_a_completion(tmp_path: Path) -> None:
    server = Server()
    run, why, _ = look(tmp_path, m(waiting=4, n_decode_total=99.0), server)
    assert (run, why, server.completions) == (0, None, 0)


def test_an_idle_server_is_never_sent_a_completion(tmp_path: Path) -> None:
    server = Server()
    run, why, _ = look(tmp_path, m(), server)
    assert (run, why, server.completions) == (0, None, 0)


def test_a_stalled_loop_whose_completion_times_out_is_a_wedged_sample(tmp_path: Path) -> None:
    server = Server()
    run, why, state = look(tmp_path, m(waiting=2), server)
    assert server.completions == 1  # sent once, never retried: it has its bound
    assert run == 1 and why is not None and "requests wait" in why
    assert state.wedged == [PID, 1]


def test_a_process_that_started_after_its_gate_and_never_answered_is_loading(
    tmp_path: Path,
) -> None:
    st = live_generation(tmp_path, time.time() - 3600)  # served an hour ago
    gen = st.live()
    assert gen is not None
    state = sampler.State()
    reads = Reads(RUNNING, health=(None, "timeout"), process=procfs.Process("S", 5.0))
    assert not wedge._loaded(gen, reads, state)  # a restart a minute ago: within its budget
    old = Reads(RUNNING, health=(None, "timeout"), process=procfs.Process("S", 7200.0))
    assert wedge._loaded(gen, old, state)  # it served at the gate
    state.answered = PID
    assert wedge._loaded(gen, reads, state)  # a sample saw it answer


def test_a_sample_during_a_deploy_is_skipped_and_keeps_the_count(tmp_path: Path) -> None:
    st = live_generation(tmp_path, time.time())
    target = sampler.Target("llama-server.service", tmp_path)
    target.folder.mkdir(parents=True)
    sampler.state_path(target).write_bytes(sampler.State(wedged=[PID, 2]).to_bytes())
    st.begin({"phase": "swapped"})  # this process is the deployer
    out = sample.sample(target, Systemd("llama-server.service", "user"))
    assert out.skipped is not None and "a deploy" in out.skipped
    assert sampler.load_state(target)[0].wedged == [PID, 2]


# -- a SIGSTOPped llama-server under the sandboxed systemd -------------------------------------


def test_a_stopped_server_is_restarted_by_the_sampler_after_the_count(host: Host) -> None:
    prom = host.root / "prom"
    host.env.update(
        LLAMA_LAUNCHER_SAMPLE_INTERVAL="3600",  # the test takes the samples
        LLAMA_LAUNCHER_WEDGED_SAMPLES="2",
        LLAMA_LAUNCHER_METRICS_TEXTFILE_DIR=str(prom),
    )
    rc, out = host.install("-c", "2048", "-np", "2")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    first_timer_sample(host)
    service = timer.names(host.unit)[0]
    assert "--wedged-samples 2" in (host.sandbox.unit_dir / service).read_text()
    assert take(host)["wedged"] is None
    pid = int(host.state()["MainPID"])
    os.kill(pid, signal.SIGSTOP)
    try:
        first = take(host)  # through the settings
        assert first["wedged"] == {
            "pid": pid, "samples": 1, "limit": 2, "why": NO_ANSWER, "restarted": False
        }  # fmt: skip
        assert "skipped: /health did not answer" in first["unread"]["slots"]
        # the second as the timer runs it: --wedged-samples from the unit's command line
        host.sandbox.systemctl("start", service)
        new = _new_process(host, pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    realserver.wait_healthy(host.url)
    assert host.chat()["usage"]["completion_tokens"] > 0
    after = take(host)
    assert after["wedged"] is None and after["counts"].get("restarts") == 1, after
    said = f"restarted: the server (pid {pid}) lived but did not answer 2 samples"
    log = _lines_of(host, service, said)
    assert said in log, log
    gen = store.Store(host.state_dir).live()
    assert gen is not None
    (kept,) = gen.meta["wedged_restarts"]
    assert (kept["pid"], kept["samples"], kept["why"]) == (pid, 2, NO_ANSWER)
    rc, hist = host.cli_json("history")
    assert hist["generations"][-1]["wedged_restarts"] == [kept]
    assert "restarted: wedged 2 samples in a row" in host.cli("history").stdout
    page = (prom / textfile.file_name(host.unit)).read_text()
    series = {name: v for name, _, v in samples_of(page)}
    assert series["llama_launcher_wedged_restarts_total"] == 1
    assert series["llama_launcher_wedged_samples"] == 0
    assert record.load(gen.path, gen.number).summary().restarts == 1
    assert int(host.state()["MainPID"]) == new


def test_a_stopped_server_during_a_bake_is_reverted_by_the_bake_not_restarted(
    host: Host,
) -> None:
    host.env.update(
        LLAMA_LAUNCHER_SAMPLE_INTERVAL="3600",
        LLAMA_LAUNCHER_WEDGED_SAMPLES="2",
        LLAMA_LAUNCHER_BAKE_INTERVAL="2",
        LLAMA_LAUNCHER_BAKE_WARMUP="0",
    )
    flags = ("-c", "2048", "-np", "2")
    rc, out = host.install(*flags)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    first_timer_sample(host)
    rc, out = host.cli_json("deploy", *host.base_flags(), *flags, "-t", "1", "--bake", "10m")
    assert (rc, out["bake"]["started"]["state"]) == (0, "baking"), out
    baked = out["generation"]
    pid = int(host.state()["MainPID"])
    st = store.Store(host.state_dir)
    os.kill(pid, signal.SIGSTOP)
    try:
        # the sampler's service the deploy started carries the bake to its verdict
        deadline = time.monotonic() + 300
        while (b := bake.load(st.get(baked).path)) is None or b.state in bake.STATES[:2]:
            assert time.monotonic() < deadline, b.to_json() if b else None
            time.sleep(0.2)
        _new_process(host, pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert b.state == "reverted" and b.verdict is not None, b.to_json()
    v = b.verdict
    assert (v.signal, v.hard) == ("wedged", True) and NO_ANSWER in v.reason
    gen = st.live()
    assert gen is not None and gen.meta["reverted_from"] == baked
    assert "-t" not in gen.meta["argv"]  # the config before the bake's
    assert "wedged_restarts" not in st.get(baked).meta  # the revert restarted it, once
    realserver.wait_healthy(host.url)
    assert host.chat()["usage"]["completion_tokens"] > 0


def _new_process(h: Host, old: int) -> int:
    """The unit's main process once systemd replaced ``old`` (its stop: SIGTERM with
    SIGCONT, SIGKILL at TimeoutStopSec)."""
    deadline = time.monotonic() + 60
    while True:
        state = h.state()
        pid = int(state["MainPID"])
        if pid not in (0, old) and state["SubState"] == "running":
            return pid
        assert time.monotonic() < deadline, f"{h.unit} was not restarted: {state}"
        time.sleep(0.1)


def _lines_of(h: Host, service: str, text: str) -> str:
    """What the service's last process logged, once it holds ``text`` (else after 30 s),
    read by its pid: a user manager does not tell journald a stream's unit, so the lines of
    a process that ended before journald took them in carry none."""
    pid = h.sandbox.show(service, "ExecMainPID")["ExecMainPID"]
    deadline = time.monotonic() + 30
    while True:
        log = subprocess.run(
            ["journalctl", "--no-pager", "-o", "cat", f"_PID={pid}"],
            capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
        if text in log or time.monotonic() > deadline:
            return log
        time.sleep(0.1)
