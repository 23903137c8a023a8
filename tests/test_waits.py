"""The retry and wait policies (launcher.waits), the probe's retry and the error handler.

The probe's retry is driven by an ``httpx.MockTransport`` because a real llama-server does
not answer 503 and then 200 on demand (it answers 503 only while it loads); the answers
below are the shapes b11434 sends (``{"error": {"code": 503, "message": "Loading model"}}``).
"""

from __future__ import annotations

import os
import signal
from typing import NoReturn

import httpx
import pytest

from launcher import config, waits
from launcher.deploy.rollback import Signals, on_error
from launcher.errors import Interrupted, ProbeError
from launcher.server.probe import Probe

FAST = waits.Waits(probe_retry=(3, 0.001))
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
DONE = {
    "choices": [{"message": {"content": "OK"}}],
    "usage": {"completion_tokens": 2, "prompt_tokens": 9},
}


def test_the_budgets_are_the_settings() -> None:
    s = config.load_settings(
        start_timeout=7, health_timeout=8, probe_timeout=9, lock_timeout=1, settle_seconds=2
    )
    w = waits.Waits.from_settings(s, journal_catchup=3.0)
    assert (w.start, w.health, w.probe, w.lock, w.settle) == (7, 8, 9, 1, 2)
    assert w.journal_catchup == 3.0


def _probe(answers: list[httpx.Response | Exception]) -> tuple[Probe, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return Probe("http://127.0.0.1:1", "k", httpx.MockTransport(handle), FAST), seen


def test_the_completion_is_asked_again_after_a_503_and_a_dropped_connection() -> None:
    probe, seen = _probe(
        [
            httpx.Response(503, json=LOADING),
            httpx.RemoteProtocolError("reset"),
            httpx.Response(200, json=DONE),
        ]
    )
    with probe:
        done = probe.chat(5)
    assert (done.content, done.completion_tokens, len(seen)) == ("OK", 2, 3)
    assert seen[0].headers["Authorization"] == "Bearer k"


def test_the_last_503_is_judged_after_the_attempts() -> None:
    probe, seen = _probe([httpx.Response(503, json=LOADING)] * FAST.probe_retry[0])
    with probe, pytest.raises(ProbeError, match="returned 503: Loading model"):
        probe.chat(5)
    assert len(seen) == FAST.probe_retry[0]


def test_a_real_error_is_judged_at_once() -> None:
    bad = {"error": {"code": 400, "message": "bad template\nline 2"}}
    probe, seen = _probe([httpx.Response(400, json=bad)])
    with probe, pytest.raises(ProbeError, match=r"returned 400: bad template$"):
        probe.chat(5)
    assert len(seen) == 1


def test_no_connection_after_the_attempts_is_a_probe_error_naming_it() -> None:
    probe, _ = _probe([httpx.ConnectError("refused")] * FAST.probe_retry[0])
    with probe, pytest.raises(ProbeError, match="ConnectError: refused"):
        probe.chat(5)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_in_the_risky_step_runs_the_rollback(signum: int) -> None:
    signals, seen = Signals(), []

    def rollback(error: BaseException) -> NoReturn:
        seen.append(error)
        raise RuntimeError("rolled back")

    with (
        signals.installed(),
        pytest.raises(RuntimeError, match="rolled back"),
        on_error(signals, rollback),
    ):
        os.kill(os.getpid(), signum)
    assert isinstance(seen[0], Interrupted) and seen[0].signum == signum


def test_a_signal_during_the_rollback_waits_until_it_is_done() -> None:
    signals, done = Signals(), []

    def rollback(error: BaseException) -> NoReturn:
        os.kill(os.getpid(), signal.SIGTERM)
        done.append(signals.pending)
        raise RuntimeError("rolled back")

    with signals.installed(), pytest.raises(RuntimeError), on_error(signals, rollback):
        raise OSError("disk full")
    assert done == [signal.SIGTERM]
    with pytest.raises(Interrupted):
        signals.stop_if_asked()
