"""The live watch on the real llama-server under the sandboxed systemd: the sampler's timer,
what one sample records, four agents past 90 % of a shared pool and the journal warning,
``status``/``top`` against ``/slots``, node_exporter reading the metrics file, ``compare`` of
two generations, and the faults a sample must survive.

One unit for the module (installed once, as in tests/test_system_scope.py); the tests run in
file order, each leaving the unit serving. The faults that damage a record get units of
their own.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import realserver
from conftest import Host, Sandbox
from test_watch_record import samples_of

from launcher.deploy import home, store
from launcher.host import timer
from launcher.host.systemd import Systemd
from launcher.server import serverlog
from launcher.watch import carry, record, sample, sampler, textfile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import repro

#: Four slots of 1,024 in one shared pool of 4,096 (the fix of seed 000, in small): four
#: agents can fill it past 90 % without a failure.
CAP, POOL = 1024, 4096
FLAGS = ("-np", "4", "-kvu", "--kv-unified-per-slot", str(CAP), "-t", "1")


@pytest.fixture(scope="module")
def watched(
    sandbox: Sandbox,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    llama_server_bin: str,
) -> Iterator[Host]:
    root = tmp_path_factory.mktemp("watch")
    model = root / "model.gguf"
    shutil.copy(tiny_model, model)
    h = Host(sandbox, root, "ll-watch", model, llama_server_bin)
    h.env["LLAMA_LAUNCHER_SAMPLE_INTERVAL"] = "3600"  # the tests take the samples
    h.env["LLAMA_LAUNCHER_METRICS_TEXTFILE_DIR"] = str(root / "prom")
    rc, out = h.install(*FLAGS)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    first_timer_sample(h)
    yield h
    h.remove()


def first_timer_sample(h: Host) -> None:
    """Wait for the sample the timer takes a second after install (the next one is an hour
    away): the tests' own samples must not race it."""
    ran_once(h.sandbox.show, timer.names(h.unit)[0])


def ran_once(show: Callable[..., dict[str, str]], service: str) -> None:
    """Wait until ``service`` (the sampler's) has run to its end once (``show``: systemctl show)."""
    deadline = time.monotonic() + 60
    while show(service, "ExecMainExitTimestampMonotonic").get(
        "ExecMainExitTimestampMonotonic", "0"
    ) in ("0", ""):
        assert time.monotonic() < deadline, f"{service} never ran"
        time.sleep(0.1)


def take(h: Host, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``llama-launcher sample --json``."""
    return sampled(lambda: h.cli_json("sample", *args, env=env))


def sampled(run: Callable[[], tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """What ``run`` (a sample, as rc and JSON) said, run again while the timer's own sample
    held the sampler's lock."""
    for _ in range(100):
        rc, out = run()
        if not str(out.get("skipped") or "").startswith("another sample"):
            assert rc == (0 if out.get("ok") else 1), out
            return out
        time.sleep(0.1)
    raise AssertionError("the sampler's lock was never free")


def server_slots(h: Host) -> list[dict[str, Any]]:
    return httpx.get(h.url + "/slots", timeout=10).json()  # type: ignore[no-any-return]


def counters(h: Host) -> dict[str, float]:
    from launcher.server import metrics

    return metrics.parse(httpx.get(h.url + "/metrics", timeout=10).text)


def live_record(h: Host) -> record.Record:
    st = store.Store(h.state_dir)
    gen = st.live()
    assert gen is not None
    return record.load(gen.path, gen.number)


def chat(h: Host, words: int = 30, seed: int = 1, max_tokens: int = 8) -> dict[str, Any]:
    r = httpx.post(
        h.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": repro.prompt(words, seed)}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=60,
    )
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


# -- the sampler's units and the deployed config -----------------------------------------------


def test_install_writes_and_enables_the_samplers_timer(watched: Host) -> None:
    service, timer_unit = timer.names(watched.unit)
    assert (service, timer_unit) == ("ll-watch-sample.service", "ll-watch-sample.timer")
    text = (watched.sandbox.unit_dir / timer_unit).read_text()
    assert "OnUnitActiveSec=3600s" in text
    # (enabled: the sandbox's unit path holds no .wants folders; tests/test_watch_system.py
    # sees it enabled under a real PID 1)
    assert watched.sandbox.show(timer_unit, "ActiveState") == {"ActiveState": "active"}
    exec_start = (watched.sandbox.unit_dir / service).read_text()
    assert (
        f"sample --unit {watched.unit} --scope user --state-dir {watched.state_dir}" in exec_start
    )


def test_the_deploy_renders_metrics_and_render_and_check_show_it(watched: Host) -> None:
    assert "--metrics" in watched.env_file.read_text()
    p = watched.cli("render", *watched.base_flags(), "-c", "2048")
    assert p.returncode == 0 and "--metrics" in p.stdout, p.stdout + p.stderr
    _, out = watched.cli_json("check", *watched.base_flags(), *FLAGS, "--no-slots")
    assert "+--no-slots" in out["diff"] and "---metrics" in out["diff"], out["diff"]


def test_a_sample_records_what_the_server_counted(watched: Host) -> None:
    take(watched)  # the baseline: everything since the process started
    n = [chat(watched, seed=i)["usage"] for i in range(5)]
    out = take(watched)
    assert out["counts"].get("requests") == 5, json.dumps(out)
    assert out["counts"]["completions"] == 5
    assert out["counts"]["decode_tokens"] == sum(u["completion_tokens"] for u in n)
    c = counters(watched)
    s = live_record(watched).summary()
    # every token the server generated since its start: the gate's probe too
    assert s.decode_tokens == c["tokens_predicted_total"]
    assert s.decode_tps == pytest.approx(
        c["tokens_predicted_total"] / c["tokens_predicted_seconds_total"], rel=1e-6
    )
    assert s.prompt_tokens == c["prompt_tokens_total"]


def test_a_sample_that_finds_nothing_changed_writes_nothing(watched: Host) -> None:
    take(watched)
    rec = record.path_of(store.Store(watched.state_dir).live().path)  # type: ignore[union-attr]
    prom = watched.root / "prom" / textfile.file_name(watched.unit)
    before = (rec.read_bytes(), rec.stat().st_mtime_ns, prom.read_bytes())
    out = take(watched)
    assert out["wrote"] == [] and out["counts"] == {}
    assert (rec.read_bytes(), rec.stat().st_mtime_ns, prom.read_bytes()) == before


# -- pool pressure, live ---------------------------------------------------------------------


def test_four_agents_past_90_percent_of_the_shared_pool_warn_in_the_journal(
    watched: Host,
) -> None:
    """Seed 000's shape in small: four agents generate at once until each slot reaches its
    cap, and ``/slots`` adds up to more than 90 % of the shared pool; the sampler's service,
    started as its timer starts it, logs a warning with every slot's figures.

    Under a unified pool llama-server clears every idle slot when a new task starts (it saves
    them to the host prompt cache: ``--cache-idle-slots``, on with ``--cache-ram``), so only
    slots that were busy together fill it; the four start together, and the burst is sent
    again should one of them have finished before the last one started. Once they are done
    no task starts, so the idle slots hold what they held: the sample reads what the test
    read before it and after it."""

    def agent(i: int) -> None:
        body = {
            "messages": [{"role": "user", "content": repro.prompt(2, 60 + i)}],
            "max_tokens": 2 * CAP,  # until the slot's cap stops it (finish_reason "length")
            "ignore_eos": True,
            "temperature": 0,
        }
        r = httpx.post(watched.url + "/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()

    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            list(pool.map(agent, range(4)))
            total = sum(s.get("n_prompt_tokens", 0) for s in server_slots(watched))
            if total >= 0.9 * POOL:
                break
    assert total >= 0.9 * POOL, f"four agents held only {total} of {POOL} cells"
    service = timer.names(watched.unit)[0]
    log, warnings = _sample_started(watched, service)
    assert f"  pool: {total:,} of {POOL:,} cells" in log, log  # what this sample read
    assert f"warning: KV pool of {watched.unit}: pool {round(100 * total / POOL)}%" in log, log
    for s in server_slots(watched):
        assert f"{s['id']}: {s['n_prompt_tokens']:,}/{s['n_ctx']:,} idle" in log
    assert "KV pool of" in warnings  # logged at priority warning, not info


def _sample_started(h: Host, service: str) -> tuple[str, str]:
    """The sampler's service started as its timer starts it, and what that one sample wrote
    to the journal: all of it, and its lines at priority warning.

    Its lines are read by its process id, not by its unit: journald names a line's unit from
    the sender's cgroup as it takes the line in, and the sample exits as soon as it has
    written (a user manager, unlike PID 1, does not tell journald the unit of a stream): on a
    busy machine journald takes the first line in after the exit, and then none of its lines
    carries a unit."""
    h.sandbox.systemctl("start", service)  # ready after its sample: returns then
    pid = h.sandbox.show(service, "ExecMainPID")["ExecMainPID"]
    assert pid not in ("", "0"), f"{service} ran no process"

    def lines(*args: str) -> str:
        return subprocess.run(
            ["journalctl", "--no-pager", "-o", "cat", *args, f"_PID={pid}"],
            capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip

    def ended(log: str) -> bool:  # the last line of a sample's report says what it wrote
        return any(x.startswith(("  wrote:", "  nothing changed")) for x in log.splitlines())

    # journald may store a stream's lines a moment after the process ended
    deadline = time.monotonic() + 60
    while not ended(log := lines()):
        assert time.monotonic() < deadline, f"the sample's report never reached the journal: {log}"
        time.sleep(0.1)
    return log, lines("-p", "warning")


def test_status_and_top_show_what_slots_says(watched: Host) -> None:
    slots = server_slots(watched)
    rc, status = watched.cli_json("status")
    rc2, top = watched.cli_json("top", "--once")
    assert rc == rc2 == 0
    for shown in (status["watch"]["pool"], top["pool"]):
        got = [(s["id"], s["tokens"], s["n_ctx"], s["busy"]) for s in shown["slots"]]
        want = [(s["id"], s["n_prompt_tokens"], s["n_ctx"], s["is_processing"]) for s in slots]
        assert got == want
        assert shown["used"] == sum(s["n_prompt_tokens"] for s in slots)
        assert shown["pool_cells"] == POOL
    assert status["watch"]["last_hour"]["pool_peak"] >= 0.9  # the sample of the last test
    text = watched.cli("status").stdout
    for s in slots:
        assert f"slot {s['id']}: {s['n_prompt_tokens']:>9,} / {s['n_ctx']:<9,}" in text


def test_node_exporter_reads_the_metrics_file(watched: Host) -> None:
    take(watched)
    port = realserver.free_port()
    exporter = subprocess.Popen(
        ["/usr/bin/prometheus-node-exporter", "--collector.disable-defaults",
         "--collector.textfile", f"--collector.textfile.directory={watched.root / 'prom'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        page = _scrape(f"http://127.0.0.1:{port}/metrics", exporter)
    finally:
        exporter.terminate()
        exporter.wait(10)
    samples = {(n, tuple(sorted(lab.items()))): v for n, lab, v in samples_of(page)}
    file = textfile.file_name(watched.unit)
    assert samples[("node_textfile_scrape_error", ())] == 0
    assert any(n == "node_textfile_mtime_seconds" and file in str(lab) for n, lab in samples)
    unit = ("unit", watched.unit)
    for s in server_slots(watched):
        key = ("llama_launcher_slot_tokens", tuple(sorted([("slot", str(s["id"])), unit])))
        assert samples[key] == s["n_prompt_tokens"]
    live = store.Store(watched.state_dir).live_number()
    assert samples[("llama_launcher_serving_generation", (unit,))] == live
    deployed = ("llama_launcher_deploys_total", tuple(sorted([("outcome", "deployed"), unit])))
    assert samples[deployed] >= 1
    assert samples[("llama_launcher_kv_pool_tokens", (unit,))] == POOL


def _scrape(url: str, exporter: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 30
    while True:
        assert exporter.poll() is None, "node_exporter exited"
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return r.text
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "node_exporter never answered"
        time.sleep(0.1)


# -- the record of each generation; compare --------------------------------------------------


def _drive(h: Host, requests: int, samples: int) -> dict[str, float]:
    """``requests`` chats spread over ``samples`` samples; the server's counters after the
    last sample (nothing runs in between)."""
    for k in range(samples):
        for i in range(requests // samples):
            chat(h, words=20, seed=100 + k * 10 + i, max_tokens=16)
        take(h)
    return counters(h)


def test_compare_of_two_generations_that_differ_in_threads(watched: Host) -> None:
    rc, out = watched.cli_json("set", "-t", "1", "-b", "512")  # a fresh process: generation A
    assert (rc, out["outcome"]) == (0, "deployed"), out
    a = out["generation"]
    take(watched)
    ca = _drive(watched, 25, 5)
    rc, out = watched.cli_json("set", "-t", "2")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    b = out["generation"]
    take(watched)
    cb = _drive(watched, 25, 5)
    rc, cmp = watched.cli_json("compare", str(a), str(b))
    assert rc == 0 and cmp["enough"], cmp["verdict"]
    decode = next(r for r in cmp["figures"] if r["field"] == "decode_tps")
    # each side from its own server's counters: the tokens over the seconds it spent on them
    assert decode["a"] == pytest.approx(
        ca["tokens_predicted_total"] / ca["tokens_predicted_seconds_total"], rel=1e-6
    )
    assert decode["b"] == pytest.approx(
        cb["tokens_predicted_total"] / cb["tokens_predicted_seconds_total"], rel=1e-6
    )
    assert "--t 1" in cmp["diff"] and "+-t 2" in cmp["diff"]
    text = watched.cli("compare", str(a), str(b)).stdout
    assert "decode tok/s" in text and "errors per 1,000 requests" in text
    rc, hist = watched.cli_json("history")
    by = {g["generation"]: g for g in hist["generations"]}
    assert by[a]["watched"]["requests"] >= 25 and by[b]["watched"]["requests"] >= 25
    assert by[a]["watched"]["served_hours"] > 0


def test_compare_says_when_there_is_too_little_data(watched: Host) -> None:
    rc, out = watched.cli_json("set", "-t", "1")
    assert rc == 0, out
    rc, cmp = watched.cli_json("compare", str(out["previous_generation"]), str(out["generation"]))
    assert rc == 0 and not cmp["enough"]
    assert cmp["verdict"].startswith("too little data to compare: generation")
    assert "never sampled" in cmp["verdict"] or "fewer than" in cmp["verdict"]


def test_compare_of_a_generation_that_does_not_exist_names_the_ones_there_are(
    watched: Host,
) -> None:
    rc, out = watched.cli_json("compare", "1", "999")
    assert rc == 1 and "no generation 999" in out["message"] and "generations: 1" in out["message"]


# -- faults: the sample says what it could not read ------------------------------------------


def test_a_sample_of_a_stopped_server_says_it_is_down_and_a_restart_is_counted(
    watched: Host,
) -> None:
    take(watched)
    watched.sandbox.systemctl("stop", watched.unit)
    out = take(watched)
    assert "the server is down" in out["unread"]["slots"]
    assert live_record(watched).now.up is False
    watched.sandbox.systemctl("start", watched.unit)
    realserver.wait_healthy(watched.url)
    out = take(watched)
    assert out["counts"].get("restarts") == 1 and "slots" not in out["unread"]
    assert live_record(watched).summary().restarts == 1


def test_a_config_without_metrics_is_sampled_and_says_why_there_is_no_decode_speed(
    watched: Host,
) -> None:
    off = {"LLAMA_LAUNCHER_METRICS_ENDPOINT": "false"}
    rc, out = watched.cli_json("unset", "--metrics", env=off)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert "--metrics" not in watched.env_file.read_text()
    out = take(watched)
    assert "/metrics is off (501" in out["unread"]["metrics"]
    assert "set --metrics" in out["unread"]["metrics"]
    assert out["pressure"]["pool_cells"] == POOL  # the slots are still read
    rc, out = watched.cli_json("set", "--metrics")
    assert rc == 0, out


def test_a_sample_never_takes_the_deploy_lock(watched: Host) -> None:
    lock = home.lock_path("user", watched.unit)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a deploy holds it
        out = take(watched)
        assert out["skipped"] is None and out["generation"] is not None
    finally:
        os.close(fd)


def test_a_deploy_never_waits_for_a_sample(watched: Host) -> None:
    folder = watched.state_dir / "watch"
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a sample that never ends
        rc, out = watched.cli_json("set", "-t", "2", env={"LLAMA_LAUNCHER_LOCK_TIMEOUT": "0"})
        assert (rc, out["outcome"]) == (0, "deployed"), out
        assert take_once(watched)["skipped"] == f"another sample of {watched.unit} is running"
    finally:
        os.close(fd)


def take_once(h: Host) -> dict[str, Any]:
    return h.cli_json("sample")[1]


def test_a_sample_during_a_deploy_is_skipped_and_the_deploy_goes_on(watched: Host) -> None:
    faults = str(Path(__file__).with_name("faults.py"))
    deployer = subprocess.Popen(
        [sys.executable, faults, "swapped:pause", "set", "-t", "1", "--json"],
        env=watched.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while store.Store(watched.state_dir).txn().get("phase") != "swapped":
            assert deployer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        out = take_once(watched)
        assert (
            out["skipped"] == f"a deploy of {watched.unit} is in progress; the next sample goes on"
        )
    finally:
        deployer.send_signal(signal.SIGTERM)  # the deployer rolls back and reports
        deployer.communicate(timeout=120)
    assert deployer.returncode in (3, 143), deployer.returncode
    assert take(watched)["skipped"] is None


def test_a_full_disk_leaves_every_file_whole_and_the_next_sample_counts_once(
    watched: Host,
) -> None:
    take(watched)
    st = store.Store(watched.state_dir)
    gen = st.live()
    assert gen is not None
    rec_path = record.path_of(gen.path)
    before = rec_path.read_bytes()
    for i in range(3):
        chat(watched, seed=500 + i)

    def full(path: Path, data: bytes, mode: int) -> None:
        raise OSError(28, "No space left on device", str(path))

    target = sampler.Target(watched.unit, watched.state_dir, watched.root / "prom")
    out = sample.sample(target, Systemd(watched.unit, "user"), write=full)
    assert not out.ok and "No space left on device" in out.errors[0]
    assert "free space" in out.errors[0] and out.wrote == []
    assert rec_path.read_bytes() == before
    requests = record.load(gen.path, gen.number).summary().requests
    out = take(watched)
    assert out["counts"]["requests"] == 3
    assert record.load(gen.path, gen.number).summary().requests == requests + 3


def test_uninstall_removes_the_samplers_units(watched: Host) -> None:
    service, timer_unit = timer.names(watched.unit)
    rc, out = watched.cli_json("uninstall")
    assert rc == 0, out
    assert str(watched.sandbox.unit_dir / timer_unit) in out["removed_sampler"]
    assert not (watched.sandbox.unit_dir / service).exists()
    assert watched.sandbox.show(timer_unit, "LoadState")["LoadState"] == "not-found"


# -- a sampler killed mid-write; every build -------------------------------------------------


def test_a_sampler_killed_at_any_moment_leaves_a_whole_record(host: Host) -> None:
    host.env["LLAMA_LAUNCHER_SAMPLE_INTERVAL"] = "3600"
    rc, out = host.install("-c", "4096", "-np", "2")
    assert rc == 0, out
    first_timer_sample(host)
    gen = store.Store(host.state_dir).live()
    assert gen is not None
    big = record.Record(gen.number)  # a week of rows: each rewrite is a megabyte
    t0 = time.time() - 7 * 86400
    for i in range(7 * 24 * 60):
        big.add(record.Delta(t0 + 60 * i, record.Now(pool=i % 1000), {"requests": 1}))
    record.save(gen.path, big, lambda p, d, m: store.atomic_write(p, d, m))
    path = record.path_of(gen.path)
    rng = random.Random(26)
    for _ in range(12):
        chat(host, seed=rng.randrange(1000))  # something to record
        p = subprocess.Popen(
            [sys.executable, "-m", "launcher", "sample"], env=host.env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(rng.uniform(0.05, 1.0))
        p.kill()
        p.wait()
        data = json.loads(path.read_bytes())  # the old record or the new one, whole
        assert record.Record.from_json(data).summary().requests >= 7 * 24 * 60
    take(host)
    assert not list(gen.path.glob(".live.json.tmp-*"))  # what a killed sampler left: swept


@pytest.mark.parametrize("build", realserver.BUILDS)
def test_a_sample_on_every_build(host: Host, build: int) -> None:
    host.server = realserver.build_binary(build)
    host.env["LLAMA_SERVER_BIN"] = host.server
    host.env["LLAMA_LAUNCHER_SAMPLE_INTERVAL"] = "3600"
    rc, out = host.install("-c", "2048", "-np", "2", "-kvu", "--allow-overcommit")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    first_timer_sample(host)
    chat(host)
    out = take(host)
    c = counters(host)
    assert live_record(host).summary().decode_tokens == c["tokens_predicted_total"]
    assert out["counts"]["requests"] >= 1
    if build < 10405:
        assert "has no n_prompt_tokens (it came with b10405)" in out["unread"]["slots"]
        assert out["pressure"]["used"] is None
    else:
        assert "slots" not in out["unread"]
        held = sum(s.get("n_prompt_tokens", 0) for s in server_slots(host))
        assert out["pressure"]["used"] == held > 0


TOO_LONG = (
    "srv    send_error: task id = 5, error: request (1100 tokens) exceeds the available context "
    "size (1024 tokens), try increasing it"
)
OVERFLOW = "srv    send_error: task id = 12, error: Context size has been exceeded."


@pytest.mark.parametrize("kind", ["in place", "journalctl"])
def test_the_journal_follower_of_a_bake_reads_the_servers_failures_not_the_clients(
    sandbox: Sandbox, kind: str
) -> None:
    """From the journal's end on: read in place (``launcher.host.sdjournal``, Python's
    ``re``) or, where it cannot be, ``journalctl -f --grep`` (PCRE2) on this systemd."""
    unit = f"llw-grep-{os.getpid()}.service"
    sandbox.log_as(unit, OVERFLOW)  # before the follower: not read again
    systemd = Systemd(unit, "user")
    follow = systemd.follow if kind == "in place" else systemd.follow_journalctl
    with follow(systemd.cursor(), grep=serverlog.HARD_FAILURE_GREP) as journal:
        sandbox.log_as(unit, TOO_LONG)
        sandbox.log_as(unit, OVERFLOW)
        lines: list[str] = []
        for _ in range(30):
            lines += journal.read(1.0)
            if lines:
                break
    assert lines == [OVERFLOW]  # the journal keeps order: the too-long line came first


def test_the_journal_wakes_a_bake_at_a_request_the_server_failed(sandbox: Sandbox) -> None:
    unit = f"llw-wake-{os.getpid()}.service"
    with carry.hard_failures(Systemd(unit, "user")) as wake:
        assert wake is not None
        sandbox.log_as(unit, OVERFLOW)
        assert wake(30.0) is True
