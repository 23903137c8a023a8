"""The bake behind the HAProxy front: the front's own failures (the 5xx HAProxy sends when
no server answers, which llama-server's journal never sees) are failed requests of the
sample, as the bake's failure rate counts them; the early hold at the journal's line of a
hard failure (launcher/watch/revert.py's ``EarlyHold``). Real parts: the sandboxed systemd,
llama-server b11434, Debian's HAProxy 2.6."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import Host
from test_handover import installed
from test_watch import take

from launcher.deploy import store
from launcher.deploy.restart.front import Front
from launcher.errors import LockTimeout
from launcher.watch import bake, carry, revert, verdict


@pytest.fixture
def fronted(host: Host) -> Iterator[Host]:
    host.env["LLAMA_LAUNCHER_SAMPLE_INTERVAL"] = "3600"  # the test takes the samples
    installed(host, "-c", "2048", "-np", "2", "--front", "haproxy")
    yield host  # the host fixture removes its units


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


def baking(h: Host) -> bake.Bake:
    """A second generation whose bake a hard failure reverts for sure."""
    rc, out = h.cli_json("set", "-t", "1", "--bake", "10m")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    b = bake.load(store.Store(h.state_dir).get(out["generation"]).path)
    assert b is not None and carry.certain(b), b
    return b


def test_the_early_hold_holds_the_front_under_the_deploy_lock_and_lets_go_without_a_revert(
    fronted: Host,
) -> None:
    b = baking(fronted)
    early = revert.EarlyHold.of(b)
    assert early is not None
    with ThreadPoolExecutor(1) as pool:
        with early(b) as rev:
            assert rev is not None
            hold = early.front.holding()
            assert hold is not None and hold.pid == os.getpid(), hold
            with pytest.raises(LockTimeout), early.store.lock(0):
                pass  # a deploy now waits for it
            waiting = pool.submit(status_of, fronted.url)
            time.sleep(1)
            assert not waiting.done()  # held at the front
        assert waiting.result(timeout=60) == 200
    assert early.front.holding() is None and early.front.state()["state"] == "open"


def test_an_early_hold_a_deploy_under_way_keeps_from_holding_says_why_in_the_bakes_notes(
    fronted: Host,
) -> None:
    b = baking(fronted)
    early = revert.EarlyHold.of(b)
    assert early is not None
    with early.store.lock(0), early(b) as rev:  # a deploy under way has the unit's lock
        assert rev is None
        assert early.front.holding() is None
    got = bake.load(store.Store(fronted.state_dir).get(b.generation).path)
    assert got is not None
    said = [n for n in got.progress.notes if "nothing was held early" in n]
    assert said and "another deploy holds" in said[0], got.progress.notes


def test_a_revert_under_the_early_hold_puts_the_old_config_back_and_serves_what_it_held(
    fronted: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = baking(fronted)
    early = revert.EarlyHold.of(b)
    assert early is not None
    why = verdict.Verdict("revert", "context_exceeded", "the test's", hard=True)
    releases: list[float] = []
    release = Front.release

    def counted(self: Front) -> None:
        releases.append(time.time())
        release(self)

    monkeypatch.setattr(Front, "release", counted)
    with ThreadPoolExecutor(1) as pool:
        with early(b) as rev:
            assert rev is not None
            waiting = pool.submit(status_of, fronted.url)
            done = rev(b, why)  # its rollback runs under the early hold's lock
        assert waiting.result(timeout=60) == 200
    assert (done["outcome"], done["early_hold"]["held"]) == ("reverted", True), done
    assert done["handover"]["front"]["held"] is True, done["handover"]
    # held throughout: released once, by the revert's handover once the old config served
    # (not by the rollback's recovery of the hold at its start, as a dead holder's)
    assert len(releases) == 1, releases
    assert " -t 1 " not in fronted.env_file.read_text()
    assert early.front.holding() is None and early.front.state()["state"] == "open"
