"""The bake behind the HAProxy front: the front's own failures (the 5xx HAProxy sends when
no server answers, which llama-server's journal never sees) are failed requests of the
sample, as the bake's failure rate counts them. Real parts: the sandboxed systemd,
llama-server b11434, Debian's HAProxy 2.6."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import Host
from test_handover import installed
from test_watch import take


@pytest.fixture
def fronted(host: Host) -> Iterator[Host]:
    host.env["LLAMA_LAUNCHER_SAMPLE_INTERVAL"] = "3600"  # the test takes the samples
    installed(host, "-c", "2048", "-np", "2", "--front", "haproxy")
    yield host
    host.cli("uninstall")


def status_of(url: str) -> int:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code
    except httpx.HTTPError:
        return 0


def test_a_sample_counts_the_fronts_own_5xx_as_failed_requests(fronted: Host) -> None:
    assert status_of(fronted.url) == 200
    take(fronted)  # the front's counters as they were
    fronted.sandbox.systemctl("stop", fronted.unit)  # no server behind the front
    answered = [status_of(fronted.url) for _ in range(3)]
    assert all(code >= 500 for code in answered), answered
    fronted.sandbox.systemctl("start", fronted.unit)
    deadline = time.monotonic() + 120
    while status_of(fronted.url) != 200:
        assert time.monotonic() < deadline, "the server did not serve again"
        time.sleep(0.5)
    out = take(fronted)
    assert out["counts"].get("failures", 0) >= 3, out["counts"]
    assert "front" not in out["unread"], out["unread"]
