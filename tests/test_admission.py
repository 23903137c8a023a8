"""Admission against the shared KV pool at the front (issue 42): HAProxy's Lua
(``launcher/deploy/restart/admission.lua``) admits a generation only when its worst case fits
what the pool has left. Real parts: Debian's HAProxy 2.6 with the config ``Front.render``
writes, llama-server b11434 with an over-committed shared pool (``-np 4 -kvu -c 1024``: each
slot may grow to 1,024 cells, the four share 1,024). The mechanics' tests use a model deep
enough that a 900-token generation takes seconds, so that one request holds the pool while
the next one arrives; they wait on what the ledger says, never on a clock."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.deploy.restart import admission
from launcher.deploy.restart.front import HAPROXY, Front, FrontSpec, address, free_port
from launcher.watch import reads, textfile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import repro

POOL = 1024
SERVER_FLAGS = ["-c", str(POOL), "-np", "4", "-kvu", "-t", "1"]


@dataclass
class Server:
    port: int
    proc: subprocess.Popen[bytes]


def start_server(binary: str, model: Path, log: Path, *more: str) -> Server:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, "-m", str(model), "--port", str(port), *SERVER_FLAGS, *more],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return Server(port, proc)
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"llama-server did not start: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def slow_server(
    llama_server_bin: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A model deep enough that 900 tokens take seconds on one thread."""
    import tinymodel

    d = tmp_path_factory.mktemp("slow")
    model = tinymodel.write(
        d / "slow.gguf", tinymodel.Shape(layers=8, n_embd=512, heads=8, kv_heads=4, ff=1024)
    )
    server = start_server(llama_server_bin, model, d / "server.log")
    yield server
    stop(server.proc)


@pytest.fixture(scope="module")
def fast_server(
    llama_server_bin: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    server = start_server(llama_server_bin, tiny_model, tmp_path_factory.mktemp("fast") / "log")
    yield server
    stop(server.proc)


@pytest.fixture(scope="module")
def no_slots_server(
    llama_server_bin: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A server whose /slots does not answer (``--no-slots``: 501)."""
    log = tmp_path_factory.mktemp("noslots") / "log"
    server = start_server(llama_server_bin, tiny_model, log, "--no-slots")
    yield server
    stop(server.proc)


KEY = "admission-test-key"


@pytest.fixture(scope="module")
def keyed_server(
    llama_server_bin: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A server with an API key (its /health answers without one)."""
    log = tmp_path_factory.mktemp("keyed") / "log"
    server = start_server(llama_server_bin, tiny_model, log, "--api-key", KEY)
    yield server
    stop(server.proc)


@dataclass
class Proxy:
    """HAProxy run from the config ``Front.render`` writes, in the foreground."""

    front: Front
    spec: FrontSpec
    url: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=Path)

    def ledger(self) -> admission.Ledger:
        found = admission.ledger(self.front)
        assert found is not None, "the front loads no admission"
        return found

    def until(self, what: Callable[[admission.Ledger], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if what(self.ledger()):
                return
            time.sleep(0.02)
        pytest.fail(f"the ledger never got there: {self.ledger()}\n{self.log.read_text()}")


@contextlib.contextmanager
def run_front(tmp_path: Path, server: Server, **fields: Any) -> Iterator[Proxy]:
    front = Front(tmp_path / "state", "adm.service")
    public = free_port()
    spec = FrontSpec(
        "127.0.0.1",
        public,
        "127.0.0.1",
        server.port,
        **{"admission": True, "pool_cells": POOL, "slot_cells": POOL, **fields},
    )
    front.dir.mkdir(parents=True)
    text = front.render(spec, 4)
    front.validate(text, spec)
    front.swap(text)
    log = tmp_path / "haproxy.log"
    env = {
        **os.environ,
        "LLAMA_FRONT_BIND": address("127.0.0.1", public),
        "LLAMA_FRONT_LUA": str(front.lua_path),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [HAPROXY, "-W", "-db", "-f", str(front.config_path)], env=env, stdout=out, stderr=out
        )
    proxy = Proxy(front, spec, f"http://127.0.0.1:{public}", proc, log)
    deadline = time.monotonic() + 20
    while not front.admin_socket.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield proxy
    finally:
        stop(proc)


@pytest.fixture
def front_on(tmp_path: Path) -> Iterator[Callable[..., Proxy]]:
    """``front_on(server, **spec_fields)``: a front with admission before ``server``."""
    with contextlib.ExitStack() as stack:

        def start(server: Server, **fields: Any) -> Proxy:
            return stack.enter_context(run_front(tmp_path / "front", server, **fields))

        yield start


def chat(text: str, max_tokens: int | None, **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "ignore_eos": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return {**body, **more}


class Call(threading.Thread):
    """One request in a thread: its status, body and when it ended."""

    def __init__(self, url: str, body: dict[str, Any], timeout: float = 120) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.timeout = url, body, timeout
        self.status: int | None = None
        self.text = ""
        self.headers: dict[str, str] = {}
        self.ended = 0.0
        self.start()

    def run(self) -> None:
        try:
            r = httpx.post(self.url + "/v1/chat/completions", json=self.body, timeout=self.timeout)
            self.status, self.text, self.headers = r.status_code, r.text, dict(r.headers)
        except httpx.HTTPError as e:
            self.text = repr(e)
        self.ended = time.monotonic()


def long_on_fast(proxy: Proxy) -> Call:
    """A generation of the fast model's whole window: it holds the pool a moment."""
    return Call(proxy.url, chat("hold the pool", None))


def long(proxy: Proxy) -> Call:
    """A generation that reserves most of the pool (its prompt and 900 tokens) for seconds."""
    call = Call(proxy.url, chat("hold the pool", 900))
    proxy.until(lambda led: led.running == 1)
    return call


def test_a_generation_that_does_not_fit_waits_until_the_one_before_it_ends(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(slow_server)
    first = long(proxy)
    second = Call(proxy.url, chat("then me", 200))
    proxy.until(lambda led: led.waiting == 1)
    first.join(120)
    second.join(120)
    assert (first.status, second.status) == (200, 200), (first.text, second.text)
    assert proxy.ledger().waited == 1


def test_generations_that_fit_together_are_admitted_at_once(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(slow_server)
    calls = [Call(proxy.url, chat(f"agent {i}", 150)) for i in range(3)]
    for c in calls:
        c.join(120)
    assert [c.status for c in calls] == [200, 200, 200]
    ledger = proxy.ledger()
    assert (ledger.admitted, ledger.waited) == (3, 0)


def anthropic(answer: dict[str, Any]) -> int:
    """Anthropic's usage counts the prompt's cached tokens apart."""
    usage = answer["usage"]
    return int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens") or 0)


@pytest.mark.parametrize(
    ("path", "body", "told"),
    [
        ("/v1/chat/completions", chat("count me", 5), lambda a: a["usage"]["prompt_tokens"]),
        ("/v1/messages", {"system": "be brief", **chat("count me", 5)}, anthropic),
        ("/completion", {"prompt": "count me", "n_predict": 5}, lambda a: a["tokens_evaluated"]),
        (
            "/v1/completions",
            {"prompt": "count me", "max_tokens": 5},
            lambda a: a["usage"]["prompt_tokens"],
        ),
        (
            "/v1/responses",
            {"input": "count me", "max_output_tokens": 5},
            lambda a: a["usage"]["input_tokens"],
        ),
    ],
    ids=["chat", "messages", "completion", "v1-completions", "responses"],
)
def test_the_prompt_is_counted_as_the_server_counts_it(
    fast_server: Server,
    front_on: Callable[..., Proxy],
    path: str,
    body: dict[str, Any],
    told: Callable[[dict[str, Any]], int],
) -> None:
    proxy = front_on(fast_server)
    r = httpx.post(proxy.url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    ledger = proxy.ledger()
    assert (ledger.counted, ledger.bounded, ledger.prompt_tokens) == (1, 0, told(r.json()))


def test_a_body_sent_in_chunks_is_bounded_by_the_slots_window(
    fast_server: Server, front_on: Callable[..., Proxy]
) -> None:
    """Without a Content-Length the front cannot tell a whole body from one still coming."""
    proxy = front_on(fast_server)
    body = json.dumps(chat("chunked", 5)).encode()
    r = httpx.post(proxy.url + "/v1/chat/completions", content=iter([body]), timeout=60)
    assert r.status_code == 200, r.text
    assert (proxy.ledger().counted, proxy.ledger().bounded) == (0, 1)


def test_a_prompt_of_tokens_is_bounded_by_the_slots_window(
    fast_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(fast_server)
    r = httpx.post(
        proxy.url + "/completion", json={"prompt": [1, 2, 3], "n_predict": 2}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert (proxy.ledger().counted, proxy.ledger().bounded) == (0, 1)


def test_a_prompt_no_slot_can_hold_gets_the_servers_own_400_at_once(
    fast_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(fast_server)
    body = {"model": "tiny", **chat("a" * 1100, 5)}
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60)
    direct = httpx.post(f"http://127.0.0.1:{fast_server.port}/v1/chat/completions", json=body)
    assert (r.status_code, direct.status_code) == (400, 400)
    assert r.json() == direct.json()  # the server's own words and figures
    assert r.json()["error"]["type"] == "exceed_context_size_error"
    assert proxy.ledger().refused_large == 1


def test_a_request_the_server_refuses_to_count_gets_its_answer_at_once(
    fast_server: Server, front_on: Callable[..., Proxy]
) -> None:
    """A malformed body is not queued behind the pool: the server's 400 comes back."""
    proxy = front_on(fast_server)
    first = long_on_fast(proxy)
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
        timeout=60,
    )
    first.join(120)
    assert r.status_code == 400 and "parse error" in r.json()["error"]["message"]
    assert (proxy.ledger().refused_server, proxy.ledger().waiting) == (1, 0)


def test_a_wrong_key_gets_the_servers_401_at_once_and_a_right_one_is_counted(
    keyed_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(keyed_server)
    wrong = httpx.post(
        proxy.url + "/v1/chat/completions",
        json=chat("who am I", 5),
        headers={"authorization": "Bearer wrong"},
        timeout=60,
    )
    assert wrong.status_code == 401
    right = httpx.post(
        proxy.url + "/v1/chat/completions",
        json=chat("who am I", 5),
        headers={"authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert right.status_code == 200, right.text
    proxy.until(lambda led: led.pool_read)  # /slots read with the key that counted
    ledger = proxy.ledger()
    assert (ledger.refused_server, ledger.counted, ledger.bounded) == (1, 1, 0)


def test_the_servers_own_tools_pass_uncounted(
    fast_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(fast_server)
    r = httpx.post(proxy.url + "/tokenize", json={"content": "hello"}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"]
    ledger = proxy.ledger()
    assert (ledger.admitted, ledger.counted, ledger.bounded) == (0, 0, 0)


def test_past_the_queues_length_a_request_gets_503_with_retry_after(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(slow_server, admission_queue=1)
    first = long(proxy)
    waiting = Call(proxy.url, chat("I wait", 200))
    proxy.until(lambda led: led.waiting == 1)
    r = httpx.post(proxy.url + "/v1/chat/completions", json=chat("no room", 200), timeout=60)
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1
    assert "admission queue is full" in r.json()["error"]["message"]
    first.join(120)
    waiting.join(120)
    assert waiting.status == 200
    assert proxy.ledger().refused_queue == 1


def test_past_the_wait_a_request_gets_503_with_retry_after(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(slow_server, admission_wait=0.3)
    first = long(proxy)
    r = httpx.post(proxy.url + "/v1/chat/completions", json=chat("no room", 200), timeout=60)
    first.join(120)
    assert r.status_code == 503 and "retry-after" in r.headers
    assert "no room in the KV pool" in r.json()["error"]["message"]
    assert proxy.ledger().refused_wait == 1


def test_a_client_that_leaves_the_queue_is_taken_out_of_it(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(slow_server)
    first = long(proxy)
    leaving = Call(proxy.url, chat("I leave", 200), timeout=0.5)
    leaving.join(30)
    proxy.until(lambda led: led.waiting == 0)
    first.join(120)
    ledger = proxy.ledger()
    assert (ledger.left, ledger.admitted) == (1, 1)


def test_a_stream_cut_short_gives_its_cells_back(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(slow_server)
    with httpx.stream(
        "POST", proxy.url + "/v1/chat/completions", json=chat("cut me", 900, stream=True)
    ) as r:
        next(r.iter_lines())
    proxy.until(lambda led: led.reserved == 0 and led.released == 1)
    assert proxy.ledger().running == 0


def test_when_the_server_stops_answering_the_count_each_request_is_bounded(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    """Mid-run the server the front counts on and reads /slots from stops answering (its
    address is wrong): each prompt is bounded by the slot's window, so each generation
    reserves the whole pool and waits; the pool is said unread."""
    proxy = front_on(slow_server)
    proxy.until(lambda led: led.pool_read)
    assert proxy.front.command(f"llama admission set {POOL} {POOL} 127.0.0.1:1").strip() == "set"
    proxy.until(lambda led: not led.pool_read)
    first = Call(proxy.url, chat("bounded", 900))
    proxy.until(lambda led: led.running == 1)
    second = Call(proxy.url, chat("bounded too", 10))
    proxy.until(lambda led: led.waiting == 1)
    first.join(120)
    second.join(120)
    assert (first.status, second.status) == (200, 200)
    ledger = proxy.ledger()
    assert (ledger.bounded, ledger.counted, ledger.waited) == (2, 0, 1)


def test_a_busy_slot_the_front_did_not_admit_is_counted_as_a_whole_window(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    """A generation sent around the front (to the server's own port) holds a slot: the
    front counts it as a whole window, so its next generation waits for it."""
    proxy = front_on(slow_server)
    around = Call(f"http://127.0.0.1:{slow_server.port}", chat("around the front", 900))
    proxy.until(lambda led: led.unseen == 1)
    through = Call(proxy.url, chat("through it", 20))
    proxy.until(lambda led: led.waiting == 1)
    around.join(120)
    through.join(120)
    assert (around.status, through.status) == (200, 200), (around.text, through.text)
    assert proxy.ledger().waited == 1


def test_when_the_pool_cannot_be_read_admission_goes_on_its_own_ledger(
    no_slots_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(no_slots_server)
    proxy.until(lambda led: led.pool_unread > 0)
    load = Load(proxy.url, turns=6).run()
    assert load.failures == []
    ledger = proxy.ledger()
    assert (ledger.pool_read, ledger.unseen, ledger.admitted) == (False, 0, 24)


def test_without_a_pool_every_request_is_admitted(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    """A split pool (pool 0): nothing to admit against, as without admission."""
    proxy = front_on(slow_server, pool_cells=0, slot_cells=0)
    first = Call(proxy.url, chat("no pool", 100))
    second = Call(proxy.url, chat("no pool either", 100))
    first.join(120)
    second.join(120)
    assert (first.status, second.status) == (200, 200)
    assert proxy.ledger().admitted == 0


# -- the load that kills sessions in an over-committed pool --------------------------------


@dataclass
class Load:
    """Four agents whose histories grow every turn until their cells pass the pool; a failed
    request ends its agent's session (it begins a new one)."""

    url: str
    turns: int = 12
    failures: list[str] = field(default_factory=list)
    answered: int = 0

    def agent(self, i: int) -> None:
        history = [{"role": "user", "content": repro.prompt(20, 90 + i)}]
        for _turn in range(self.turns):
            body = {"messages": history, "max_tokens": 48, "ignore_eos": True, "temperature": 0}
            r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
            if r.status_code == 200 and "choices" in r.text:
                self.answered += 1
                history.append(r.json()["choices"][0]["message"])
                history.append({"role": "user", "content": repro.prompt(12, 7 * _turn + i)})
                if len(json.dumps(history)) > 700:  # a slot's window ahead: compact
                    history[:] = history[-1:]
            else:
                self.failures.append(r.text[:200])
                history[:] = [{"role": "user", "content": repro.prompt(20, 300 + i)}]

    def run(self) -> Load:
        agents = [threading.Thread(target=self.agent, args=(i,)) for i in range(4)]
        for a in agents:
            a.start()
        for a in agents:
            a.join(600)
        return self


def test_without_admission_the_load_overflows_the_shared_pool(fast_server: Server) -> None:
    """The control: the load of the next test, straight to the server, kills sessions."""
    load = Load(f"http://127.0.0.1:{fast_server.port}").run()
    assert any("Context size has been exceeded" in f for f in load.failures), load.failures


def test_with_admission_the_same_load_loses_nothing(
    fast_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(fast_server)
    load = Load(proxy.url).run()
    assert load.failures == []
    assert load.answered == 4 * load.turns
    ledger = proxy.ledger()
    assert ledger.waited > 0  # the pool was full at times: admission made requests wait
    assert ledger.reserved == 0 and ledger.running == 0


def test_a_deploy_tells_the_running_front_its_pool(
    fast_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(fast_server)
    proxy.front.apply(replace(proxy.spec, pool_cells=2048, slot_cells=512), 4)
    ledger = proxy.ledger()
    assert (ledger.pool, ledger.slot) == (2048, 512)


def test_an_answered_stream_leaves_nothing_in_flight_at_the_front(
    fast_server: Server, front_on: Callable[..., Proxy]
) -> None:
    """The release filter lets the stream end: a deploy's drain waits for nothing left."""
    proxy = front_on(fast_server)
    with httpx.stream(
        "POST", proxy.url + "/v1/chat/completions", json=chat("stream me", 30, stream=True)
    ) as r:
        lines = list(r.iter_lines())
    assert "data: [DONE]" in lines
    proxy.until(lambda led: led.released == 1)
    assert proxy.front.in_flight() == 0


def test_a_refusal_is_the_fronts_answer_not_a_failed_request(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    """The sampler and the bake count the 5xx the front sent beyond the server's; the 503s
    of admission's refusals are not among them."""
    proxy = front_on(slow_server, admission_wait=0.3)
    first = long(proxy)
    r = httpx.post(proxy.url + "/v1/chat/completions", json=chat("no room", 200), timeout=60)
    first.join(120)
    assert r.status_code == 503
    raw = proxy.front.stats()[("public", "FRONTEND")]["hrsp_5xx"]
    (_identity, sent, server), ledger = reads.front_5xx(proxy.front, admits=True)
    assert (int(raw), sent, server) == (1, 0, 0)  # HAProxy counts the 503; the sample not
    assert ledger is not None and ledger.refused_wait == 1


def test_the_metrics_file_shows_the_ledger(
    fast_server: Server, front_on: Callable[..., Proxy]
) -> None:
    proxy = front_on(fast_server)
    httpx.post(proxy.url + "/v1/chat/completions", json=chat("count me", 5), timeout=60)
    proxy.until(lambda led: led.released == 1)
    page = textfile.Page("adm.service")
    textfile.admission_lines(proxy.ledger(), page)
    families = {f.name: f for f in text_string_to_metric_families(page.render())}
    requests = {
        s.labels["outcome"]: s.value for s in families["llama_launcher_admission_requests"].samples
    }
    assert (requests["admitted"], requests["waited"], requests["refused_queue"]) == (1, 0, 0)
    pool = {
        s.labels["state"]: s.value for s in families["llama_launcher_admission_pool_tokens"].samples
    }
    assert pool == {"reserved": 0, "unseen": 0, "free": POOL}
    waits = {
        (s.name, s.labels.get("le")): s.value
        for s in families["llama_launcher_admission_wait_seconds"].samples
    }
    assert waits[("llama_launcher_admission_wait_seconds_bucket", "+Inf")] == 1
    assert waits[("llama_launcher_admission_wait_seconds_count", None)] == 1


def test_a_stopping_front_sends_its_waiting_requests_to_the_next_one(
    slow_server: Server, front_on: Callable[..., Proxy]
) -> None:
    """A soft stop (SIGUSR1: systemd's stop of the front) lets the running generation end,
    and answers a waiting one 503 with Retry-After 1 at once: it asks the next HAProxy
    rather than wait until the stop's timeout cuts it."""
    proxy = front_on(slow_server)
    first = long(proxy)
    waiting = Call(proxy.url, chat("I wait", 200))
    proxy.until(lambda led: led.waiting == 1)
    assert proxy.proc is not None
    proxy.proc.send_signal(signal.SIGUSR1)
    waiting.join(60)
    first.join(120)
    assert (waiting.status, waiting.headers.get("retry-after")) == (503, "1"), waiting.text
    assert first.status == 200


def test_a_prompt_the_front_cannot_spell_again_is_bounded_not_refused(
    fast_server: Server, front_on: Callable[..., Proxy]
) -> None:
    """HAProxy's JSON reader gives \\u00e9 as a raw byte: the body the front makes for the
    tokenizer is not the client's, so the server's refusal of it is no answer to the client.
    The request is bounded and goes to the server, whose own answer comes back."""
    proxy = front_on(fast_server)
    body = json.dumps({"prompt": "caf\u00e9 and more", "n_predict": 2})
    headers = {"content-type": "application/json"}
    r = httpx.post(proxy.url + "/completion", content=body, headers=headers, timeout=60)
    direct = httpx.post(
        f"http://127.0.0.1:{fast_server.port}/completion", content=body, headers=headers
    )
    assert (r.status_code, r.text) == (direct.status_code, direct.text)
    ledger = proxy.ledger()
    assert (ledger.bounded, ledger.refused_server, ledger.admitted) == (1, 0, 1)
