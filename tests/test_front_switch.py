"""The front's switch between two servers (issue 28's first step), on the real HAProxy 2.6
and two real llama-servers: agents streaming through the front all the while, none may fail,
and every request that starts after the switch is answered by the new server. Each server
has its own ``--alias``, which its answers name as their ``model``."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import realserver

from launcher.bench import chat
from launcher.deploy.restart import front
from launcher.deploy.restart.front import Front, FrontError, FrontSpec

SLOTS = 2


@dataclass
class Answer:
    started: float
    ended: float
    model: str | None
    status: int | None
    done: bool
    finish: str | None = None  # ``length``: it generated every token it was asked for
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None


def stream(url: str, max_tokens: int) -> Answer:
    """One streamed chat completion read to its end: who answered, and whether it ended."""
    body = {
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    started = time.monotonic()
    with httpx.Client(timeout=60, trust_env=False) as client:
        r = chat.stream_chat(client, body, url=url + chat.CHAT_PATH)
    return Answer(started, time.monotonic(), r.model, r.status, r.done, r.finish_reason, r.failure)


@dataclass
class Agents:
    """Agents that send streamed chats through the front one after another until stopped."""

    url: str
    n: int = 3
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(self.n)]

    def _loop(self) -> None:
        while not self.stop.is_set():
            a = stream(self.url, 8)
            with self.lock:
                self.answers.append(a)

    def __enter__(self) -> Agents:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)


@dataclass
class Pair:
    front: Front
    spec: FrontSpec
    url: str  # the public address
    haproxy: subprocess.Popen[bytes]
    env: dict[str, str]

    def restart_haproxy(self) -> None:
        """HAProxy stopped and started again from the config on disk."""
        self.haproxy.terminate()
        self.haproxy.wait(10)
        self.haproxy = start_haproxy(self.front, self.env)


def until(done: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.005)


def port_of(url: str) -> int:
    port = urlparse(url).port
    assert port is not None
    return port


def start_haproxy(f: Front, env: dict[str, str]) -> subprocess.Popen[bytes]:
    f.admin_socket.unlink(missing_ok=True)
    p = subprocess.Popen(
        [front.HAPROXY, "-db", "-f", str(f.config_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            f.stats()
            return p
        except FrontError:
            assert p.poll() is None and time.monotonic() < deadline, "HAProxy did not start"
            time.sleep(0.02)


@pytest.fixture
def pair(tmp_path: Path, tiny_model: Path) -> Iterator[Pair]:
    """Servers ``a`` and ``b`` behind one front that sends requests to ``a``."""
    args = ["-np", str(SLOTS), "-c", "8192", "-t", "1"]
    with (
        realserver.run_server(tiny_model, [*args, "--alias", "a"]) as a,
        realserver.run_server(tiny_model, [*args, "--alias", "b"]) as b,
    ):
        f = Front(tmp_path, "llama-server.service")
        public = realserver.free_port()
        spec = FrontSpec(
            "127.0.0.1", public, "127.0.0.1", port_of(a.url), standby_port=port_of(b.url)
        )
        text = f.render(spec, SLOTS)
        f.validate(text, spec)
        f.swap(text, backup=False)
        f.save_spec(spec)
        env = dict(os.environ, LLAMA_FRONT_BIND=f"127.0.0.1:{public}")
        p = Pair(f, spec, f"http://127.0.0.1:{public}", start_haproxy(f, env), env)
        try:
            yield p
        finally:
            p.haproxy.terminate()
            p.haproxy.wait(10)


def test_the_idle_server_is_in_maint_until_the_switch(pair: Pair) -> None:
    assert pair.front.server_states() == {"llama": "UP", "llama_b": "MAINT"}
    assert {stream(pair.url, 4).model for _ in range(6)} == {"a"}


def test_the_switch_cuts_nothing_and_sends_every_later_request_to_the_new_server(
    pair: Pair,
) -> None:
    answers: list[Answer] = []
    long = threading.Thread(target=lambda: answers.append(stream(pair.url, 2500)))
    long.start()
    until(lambda: pair.front.in_flight("llama") >= 1)  # the long answer is under way on a
    with Agents(pair.url) as agents:
        until(lambda: len(agents.answers) >= 3)
        t_switch = time.monotonic()
        switched, report = pair.front.switch(pair.spec, SLOTS, 120.0)
        after = time.monotonic()
        until(lambda: sum(a.started > after for a in agents.answers) >= 3)
    long.join(120)
    assert [a for a in agents.answers if not a.ok] == []
    assert {a.model for a in agents.answers if a.started > after} == {"b"}
    assert "a" in {a.model for a in agents.answers if a.ended < t_switch}
    # the drain waited for what a was answering: the long answer ended whole, on a
    assert answers[0].ended > t_switch and not report.timed_out
    assert report.front_in_flight_at_start >= 1 and pair.front.in_flight("llama") == 0
    assert (answers[0].ok, answers[0].model, answers[0].finish) == (True, "a", "length")
    assert pair.front.server_states() == {"llama": "MAINT", "llama_b": "UP"}
    assert switched.serving == "b" and pair.front.spec() == switched


def test_a_switch_back_serves_the_first_server_again(pair: Pair) -> None:
    there, _ = pair.front.switch(pair.spec, SLOTS, 120.0)
    with Agents(pair.url) as agents:
        until(lambda: len(agents.answers) >= 3)
        back, _ = pair.front.switch(there, SLOTS, 120.0)
        after = time.monotonic()
        until(lambda: sum(a.started > after for a in agents.answers) >= 3)
    assert [a for a in agents.answers if not a.ok] == []
    assert {a.model for a in agents.answers if a.started > after} == {"a"}
    assert back.serving == "a" and pair.front.server_states()["llama_b"] == "MAINT"


def test_an_haproxy_restarted_after_the_switch_serves_the_new_server(pair: Pair) -> None:
    pair.front.switch(pair.spec, SLOTS, 120.0)
    pair.restart_haproxy()  # from the config on disk: the switch rewrote it
    assert pair.front.server_states() == {"llama": "MAINT", "llama_b": "UP"}
    assert {stream(pair.url, 4).model for _ in range(6)} == {"b"}


def test_the_drain_timeout_leaves_the_old_request_to_finish_on_the_old_server(
    pair: Pair,
) -> None:
    answers: list[Answer] = []
    long = threading.Thread(target=lambda: answers.append(stream(pair.url, 3000)))
    long.start()
    until(lambda: pair.front.in_flight("llama") >= 1)
    _, report = pair.front.switch(pair.spec, SLOTS, 0.0)
    long.join(60)
    assert report.timed_out and report.cut_at_front == 1
    assert (answers[0].ok, answers[0].model) == (True, "a")  # maint cut nothing


def test_apply_of_the_saved_spec_settles_a_switch_left_half_way(pair: Pair) -> None:
    # what a deployer killed right after the switch's first runtime command leaves: the
    # disk names b, and both servers take requests
    switched = replace(pair.spec, serving="b")
    pair.front.swap(pair.front.render(switched, SLOTS))
    pair.front.save_spec(switched)
    pair.front.command(f"set server {front.BACKEND}/{front.STANDBY} state ready")
    assert pair.front.server_states() == {"llama": "UP", "llama_b": "UP"}
    saved = pair.front.spec()
    assert saved is not None
    pair.front.apply(saved, SLOTS)
    assert pair.front.server_states() == {"llama": "MAINT", "llama_b": "UP"}
    assert {stream(pair.url, 4).model for _ in range(6)} == {"b"}


class RefusesReady(Front):
    """The real front, but HAProxy's answer to ``state ready`` is an error (what the real
    one says to a command when its socket breaks half-way cannot be timed)."""

    def _expect_empty(self, line: str) -> None:
        if line.endswith("state ready") and front.STANDBY in line:
            raise FrontError(f"{line!r} answered: (the test's refusal)")
        super()._expect_empty(line)


def test_a_switch_whose_command_fails_puts_the_old_config_back(pair: Pair) -> None:
    before = pair.front.live_text()
    refusing = RefusesReady(pair.front.dir.parent, pair.front.unit)
    with pytest.raises(FrontError, match="the test's refusal"):
        refusing.switch(pair.spec, SLOTS, 120.0)
    assert pair.front.live_text() == before and pair.front.spec() == pair.spec
    assert pair.front.server_states() == {"llama": "UP", "llama_b": "MAINT"}
    assert {stream(pair.url, 4).model for _ in range(6)} == {"a"}


def test_a_front_with_one_server_has_nothing_to_switch_to(tmp_path: Path) -> None:
    f = Front(tmp_path, "llama-server.service")
    with pytest.raises(FrontError, match="one server: there is nothing to switch to"):
        f.switch(FrontSpec("127.0.0.1", 8080, "127.0.0.1", 18080), SLOTS, 1.0)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"serving": "c"}, "serving is 'c'; it is 'a' or 'b'"),
        ({"serving": "b"}, "serving is 'b' but there is no standby_port"),
        ({"standby_port": 18080}, "standby_port is private_port"),
    ],
)
def test_a_front_spec_that_cannot_serve_is_refused_naming_the_field(
    tmp_path: Path, extra: dict[str, object], says: str
) -> None:
    f = Front(tmp_path, "llama-server.service")
    spec = FrontSpec("127.0.0.1", 8080, "127.0.0.1", 18080).to_dict()
    f.dir.mkdir()
    f.spec_path.write_text(json.dumps({**spec, **extra}))
    with pytest.raises(FrontError, match="move it aside") as e:
        f.spec()
    assert says in str(e.value)
