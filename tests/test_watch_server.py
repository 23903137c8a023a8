"""What a live sample reads from the real llama-server, on every build where it differs:
``/metrics``' counters and their process, ``/slots``' fields, the answers of a server that
is loading or has an endpoint off, the journal lines a sample counts, and ``/proc``."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import realserver

from launcher.errors import Unreadable
from launcher.host import procfs
from launcher.server import httpclient, metrics, serverlog, slots

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import repro

BUILDS = realserver.BUILDS


def chat(url: str, words: int = 40, max_tokens: int = 12, key: str | None = None) -> dict:  # type: ignore[type-arg]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(
        url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": repro.prompt(words, 1)}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        headers=headers,
        timeout=60,
    )
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def client(url: str, key: str | None = None) -> httpx.Client:
    return httpclient.client(httpx.Client, url, key, 10.0, trust_env=False)


@pytest.mark.parametrize("build", BUILDS)
def test_metrics_counters_count_what_the_server_generated(tiny_model: Path, build: int) -> None:
    binary = realserver.build_binary(build)
    with realserver.run_server(tiny_model, ["--metrics", "-np", "2"], binary=binary) as s:
        answers = [chat(s.url) for _ in range(3)]
        with client(s.url) as c:
            m = metrics.read(c)
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    assert m.counters["tokens_predicted_total"] == generated
    # the seconds are the sum of each answer's own generation time; b9093 and b10405 add
    # whole milliseconds (each request's cut down: a request under 1 ms adds nothing); every
    # build prints six significant digits (a slow machine's 1.23456 s is off by up to 5e-6)
    ms = [a["timings"]["predicted_ms"] for a in answers]
    summed = sum(math.floor(t) for t in ms) if build in (9093, 10405) else sum(ms)
    assert m.counters["tokens_predicted_seconds_total"] == pytest.approx(
        summed / 1000, rel=1e-5, abs=2e-6
    )
    assert m.counters["prompt_tokens_total"] > 0
    assert "requests_deferred" in m.gauges


@pytest.mark.parametrize("build", BUILDS)
def test_the_process_start_header_is_the_monotonic_clock_and_new_per_process(
    tiny_model: Path, build: int
) -> None:
    binary = realserver.build_binary(build)
    starts = []
    for _ in range(2):
        before = time.monotonic() * 1e6
        with (
            realserver.run_server(tiny_model, ["--metrics"], binary=binary) as s,
            client(s.url) as c,
        ):
            starts.append(int(metrics.read(c).process_start or 0))
        assert before <= starts[-1] <= time.monotonic() * 1e6  # µs of CLOCK_MONOTONIC
    assert starts[0] != starts[1]


@pytest.mark.parametrize("build", BUILDS)
def test_metrics_without_the_flag_is_501_naming_the_fix(tiny_model: Path, build: int) -> None:
    binary = realserver.build_binary(build)
    with (
        realserver.run_server(tiny_model, binary=binary) as s,
        client(s.url) as c,
        pytest.raises(Unreadable) as e,
    ):
        metrics.read(c)
    assert e.value.status == 501
    assert "/metrics is off" in str(e.value) and "set --metrics" in str(e.value)


@pytest.mark.parametrize("build", BUILDS)
def test_metrics_and_slots_need_the_api_key_where_one_is_set(
    tiny_model: Path, build: int, tmp_path: Path
) -> None:
    key = tmp_path / "key"
    key.write_text("sk-watch\n")
    args = ["--metrics", "--api-key-file", str(key)]
    binary = realserver.build_binary(build)
    with realserver.run_server(tiny_model, args, binary=binary) as s:
        with client(s.url) as c:
            for read in (metrics.read, slots.read):
                with pytest.raises(Unreadable) as e:
                    read(c)
                assert e.value.status == 401
        with client(s.url, "sk-watch") as c:
            assert metrics.read(c).counters["tokens_predicted_total"] == 0
            assert len(slots.read(c)) >= 1


@pytest.mark.parametrize("build", BUILDS)
def test_slots_say_what_each_slot_holds_from_b10405_on(tiny_model: Path, build: int) -> None:
    binary = realserver.build_binary(build)
    with realserver.run_server(tiny_model, ["-np", "2", "-c", "2048"], binary=binary) as s:
        usage = chat(s.url)["usage"]
        with client(s.url) as c:
            got = slots.read(c)
    used = [x for x in got if x.tokens != 0]
    assert len(got) == 2 and len(used) == 1 and not used[0].busy
    assert used[0].n_ctx == 1024
    p = slots.Pressure(got, 2048)
    if build < slots.TOKENS_SINCE:
        assert used[0].tokens is None and not p.known and p.use is None
        assert "does not say what each holds" in p.describe()
    else:
        # the prompt and what was generated, but the last token sampled
        assert used[0].tokens == usage["prompt_tokens"] + usage["completion_tokens"] - 1
        assert p.use == pytest.approx(used[0].tokens / 2048)


def test_a_loading_server_answers_503_to_both_reads(tmp_path: Path, tiny_model: Path) -> None:
    # a model that is a FIFO: llama-server blocks reading it, with its HTTP port open
    fifo = tmp_path / "loading.gguf"
    os.mkfifo(fifo)
    port = realserver.free_port()
    argv = [realserver.server_binary(), "-m", str(fifo), "--port", str(port), "-lm", "none"]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 503:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never answered 503 while loading"
            time.sleep(0.05)
        with client(url) as c:
            for read in (slots.read, metrics.read):
                with pytest.raises(Unreadable) as e:
                    read(c)
                assert e.value.status == 503 and "loading" in str(e.value)
    finally:
        server.kill()
        server.wait()


def test_a_server_that_is_gone_is_named() -> None:
    with client(f"http://127.0.0.1:{realserver.free_port()}") as c, pytest.raises(Unreadable) as e:
        slots.read(c)
    assert "does not answer" in str(e.value)


@pytest.mark.parametrize("build", BUILDS)
def test_the_journal_lines_a_sample_counts(tiny_model: Path, tmp_path: Path, build: int) -> None:
    """Seed 000 in miniature on each build: every request that got a 500 is counted as a
    context-exceeded failure, every request as a request."""
    run = repro.overflow(tiny_model, tmp_path / "o.log", binary=realserver.build_binary(build))
    counts = {k: 0 for k in serverlog.TALLY_KEYS}
    for line in run.log.read_text(errors="replace").splitlines():
        key = serverlog.tally(line)
        if key is not None:
            counts[key] += 1
            if key == "failures":
                counts[serverlog.failure_kind(line)] += 1
    assert counts["context_exceeded"] == run.statuses.count(500) >= 2
    assert counts["requests"] == len(run.statuses) + 1  # the warm-up request too
    assert counts["kv_retries"] > 0


@pytest.mark.parametrize("build", BUILDS)
def test_a_request_too_long_is_counted_as_such(
    tiny_model: Path, tmp_path: Path, build: int
) -> None:
    run = repro.too_long(tiny_model, tmp_path / "t.log", binary=realserver.build_binary(build))
    kinds = [
        serverlog.failure_kind(x)
        for x in run.log.read_text(errors="replace").splitlines()
        if serverlog.tally(x) == "failures"
    ]
    assert run.statuses == (400,) and kinds == ["too_long"]


def test_proc_memory_is_rss_anon_plus_swap_of_a_live_process() -> None:
    m = procfs.memory(os.getpid())
    assert 0 < m.rss_anon <= m.rss and m.growth == m.rss_anon + m.vm_swap


def test_proc_memory_of_a_process_that_is_gone_is_named() -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    with pytest.raises(Unreadable) as e:
        procfs.memory(p.pid)
    assert f"process {p.pid} is gone" in str(e.value)
