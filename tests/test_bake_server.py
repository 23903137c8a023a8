"""The bake on the real llama-server under the sandboxed systemd: seed 000's mistake made
live and reverted at the first sample that sees 'Context size has been exceeded' (the pool
watch off), busy slots near the whole over-committed pool reverted before it overflows (the
watch on), a quiet unit that ends inconclusive and keeps its config, and a later deploy
ending a bake.

One unit for the module; the tests run in file order, each leaving the unit serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinymodel
from conftest import Host, Sandbox
from test_watch import take

from launcher.deploy import store
from launcher.host import timer
from launcher.watch import bake, record

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import repro

#: The good config: four slots capped at 1,024 in a pool sized for all of them.
CAP = 1024
GOOD = ("-np", "4", "-kvu", "--kv-unified-per-slot", str(CAP), "-c", str(4 * CAP), "-t", "1")
#: Seed 000's mistake in small: four slots promised 1,024 each of one pool of 1,024.
OVERCOMMITTED = ("-np", "4", "-kvu", "-c", str(CAP), "-t", "1", "--allow-overcommit")
BAKE_ENV = {"LLAMA_LAUNCHER_BAKE_INTERVAL": "2", "LLAMA_LAUNCHER_BAKE_WARMUP": "0"}


@pytest.fixture(scope="module")
def baked(
    sandbox: Sandbox,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    llama_server_bin: str,
) -> Iterator[Host]:
    """The good config installed; the bake's samples every 2 s with no warm-up (the tests
    and --wait take the samples: the timer's are an hour apart)."""
    h = Host(sandbox, tmp_path_factory.mktemp("bake"), "ll-bake", tiny_model, llama_server_bin)
    h.env.update(BAKE_ENV, LLAMA_LAUNCHER_SAMPLE_INTERVAL="3600")
    assert h.install(*GOOD)[0] == 0
    yield h
    h.remove()


def deploy(h: Host, *flags: str) -> tuple[int, dict[str, Any]]:
    return h.cli_json("deploy", *h.base_flags(), *flags)


def live(h: Host) -> store.Generation:
    gen = store.Store(h.state_dir).live()
    assert gen is not None
    return gen


class Agents:
    """Four agents whose histories grow every turn, until stopped; each counts its turns
    that failed and that were answered."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.ok = [0] * 4
        self.failed = [0] * 4

    def turn(self, i: int, history: list[dict[str, str]]) -> bool:
        body = {"messages": history, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        try:
            r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        except httpx.HTTPError:
            return False  # the restart of a deploy or a revert: tried again
        if r.status_code != 200:
            return False
        history.append(
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
        )
        return True

    def agent(self, i: int) -> None:
        history = [{"role": "user", "content": repro.prompt(20, 90 + i)}]
        while not self.stop.is_set():
            if self.turn(i, history):
                self.ok[i] += 1
            else:
                self.failed[i] += 1
                time.sleep(0.2)
            history.append({"role": "user", "content": repro.prompt(20, 100 + i + len(history))})
            if len(history) > 40:  # beyond any slot's cap: begin a new session
                history[:] = history[:1]


def test_a_deploy_without_allow_overcommit_said_nothing_and_with_it_warns(baked: Host) -> None:
    rc, out = deploy(baked, *OVERCOMMITTED, "--check")
    assert rc == 0, out
    assert any("allow_overcommit: the shared KV pool holds" in w for w in out["warnings"])


def test_seed_000_made_live_is_reverted_at_the_first_sample_that_sees_the_pool_overflow(
    baked: Host,
) -> None:
    """The good config serves four agents and records a baseline; the over-committed one
    is deployed with a bake while they go on, its pool watch off (``bake_pool_limit`` 0:
    the overflow itself is the signal here); the first sample that finds 'Context size
    has been exceeded' reverts it, and the old config serves all four again."""
    good = live(baked)
    agents = Agents(baked.url)
    with ThreadPoolExecutor(4) as pool:
        try:  # the agents loop until stopped: a failure here must stop them, or it hangs
            for i in range(4):
                pool.submit(agents.agent, i)
            until(lambda: sum(agents.ok) >= 4)  # turns answered by the good config
            assert sum(agents.ok) >= 4, (agents.ok, agents.failed)
            sample = take(baked)  # the baseline's figures, with their load
            assert sample["generation"] == good.number, sample
            rc, out = _deploy_waiting(baked, *OVERCOMMITTED, LLAMA_LAUNCHER_BAKE_POOL_LIMIT="0")
        finally:
            agents.stop.set()
    assert (rc, out["outcome"]) == (6, "reverted"), json.dumps(out)[-3000:]
    verdict = out["bake"]["verdict"]["verdict"]
    assert (verdict["signal"], verdict["hard"]) == ("context_exceeded", True), verdict
    now = live(baked)
    assert now.meta["reverted_from"] == out["bake"]["started"]["generation"]
    assert now.env_text == good.env_text
    # the revert came in the sample that first saw the overflow: every failure the baked
    # generation's record has was found by one sample
    gone = store.Store(baked.state_dir).get(now.meta["reverted_from"])
    rec = record.load(gone.path, gone.number)
    seen_by = {f["sampled_before"] for f in rec.failures if f["kind"] == "context_exceeded"}
    assert len(seen_by) == 1, rec.failures
    assert bake.load(gone.path).state == "reverted"  # type: ignore[union-attr]
    # and the previous config serves them all again, four at once
    again = Agents(baked.url)
    histories = [[{"role": "user", "content": repro.prompt(20, 200 + i)}] for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(again.turn, range(4), histories))


def test_a_session_near_the_whole_over_committed_pool_reverts_it_before_it_overflows(
    baked: Host,
) -> None:
    """One agent repeats a request whose session needs 92-97 % of the pool (a prompt of
    about 950 tokens and 40 to generate, in one slot of a pool of 1,024 cells: nothing can
    overflow), and the over-committed config is deployed with the pool watch at its
    default (90 %): the bake reverts it on the first look or sample, as hard, before any
    request failed for want of room."""
    good = live(baked)
    text, n = repro.sized_prompt(baked.url, 950, 7)
    assert 930 <= n <= 970, n  # with the 40 tokens it generates: under 1,024
    stop, answered = threading.Event(), [0]

    def agent() -> None:
        body = {"prompt": text, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        while not stop.is_set():
            try:
                r = httpx.post(baked.url + "/v1/completions", json=body, timeout=60)
                answered[0] += r.status_code == 200
            except httpx.HTTPError:
                time.sleep(0.1)  # the revert's restart: tried again

    with ThreadPoolExecutor(1) as pool:
        try:
            pool.submit(agent)
            until(lambda: answered[0] >= 2)
            rc, out = _deploy_waiting(baked, *OVERCOMMITTED)
        finally:
            stop.set()
    assert (rc, out["outcome"]) == (6, "reverted"), json.dumps(out)[-3000:]
    verdict = out["bake"]["verdict"]["verdict"]
    assert (verdict["signal"], verdict["hard"]) == ("pool", True), verdict
    assert verdict["figures"]["pool_need"] >= 0.9, verdict
    now = live(baked)
    assert now.env_text == good.env_text
    gone = store.Store(baked.state_dir).get(now.meta["reverted_from"])
    # no request failed (the previous test's agents' too-long histories, logged by the
    # revert's process before this deploy, are not this generation's)
    assert not record.load(gone.path, gone.number).failures


def _deploy_waiting(h: Host, *flags: str, **env: str) -> tuple[int, dict[str, Any]]:
    p = subprocess.run(
        [sys.executable, "-m", "launcher", "deploy", *h.base_flags(), *flags,
         "--drain-timeout", "5", "--bake", "10m", "--wait", "--json"],
        capture_output=True, text=True, env={**h.env, **env}, timeout=900,
    )  # fmt: skip
    try:
        return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise AssertionError(f"rc={p.returncode}\n{p.stdout}\n{p.stderr}") from None


def test_a_quiet_unit_ends_inconclusive_and_keeps_the_new_config(baked: Host) -> None:
    rc, out = deploy(baked, *GOOD[:-1], "2", "--bake", "8s", "--wait")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    verdict = out["bake"]["verdict"]
    assert verdict["state"] == "inconclusive", verdict
    assert verdict["verdict"]["signal"] == "too_little_traffic"
    assert live(baked).number == out["generation"]


def test_a_later_deploy_ends_a_running_bake_and_both_say_so(baked: Host) -> None:
    rc, first = deploy(baked, *GOOD, "--bake", "10m")
    assert (rc, first["bake"]["started"]["state"]) == (0, "baking"), first
    assert bake.deadline(baked.state_dir) == first["bake"]["started"]["deadline"]
    rc, second = deploy(baked, *GOOD[:-1], "2")
    assert rc == 0, second
    assert second["bake"]["ended"]["generation"] == first["generation"]
    ended = bake.load(store.Store(baked.state_dir).get(first["generation"]).path)
    assert ended is not None and ended.state == "ended"
    assert bake.deadline(baked.state_dir) is None


def until(done: Callable[[], bool], timeout: float = 300) -> None:
    """Wait for ``done`` (the agents' own progress, however slow this machine is)."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)


class Agent:
    """One agent asking short questions one after another (one busy slot), until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.ok = url, threading.Event(), 0

    def run(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "hello river pool"}],
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
        }
        while not self.stop.is_set():
            try:
                r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
                self.ok += r.status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)  # the restart of a deploy or a revert: asked again


def test_a_config_that_decodes_several_times_slower_is_reverted_as_soft(
    baked: Host, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same config on a model eight times deeper (16 layers for 2: several times the
    decode work per token, whatever else the CPU runs, where -t 1 against -t 2 on a busy
    2-core box goes either way): its decode tok/s, from the server's own /metrics
    counters at one busy slot, stays under 0.8x the baseline's for three samples in a row
    with 20 completions in the window, and the bake reverts it as soft."""
    deep = tinymodel.write(
        tmp_path_factory.mktemp("deep") / "deep.gguf", tinymodel.Shape(layers=16)
    )
    rc, out = deploy(baked, *GOOD)  # the baseline: the good config at -t 1
    assert rc == 0, out
    good = live(baked)
    agent = Agent(baked.url)
    worker = threading.Thread(target=agent.run)
    worker.start()
    try:
        for _ in range(3):  # the baseline's figures, measured at one busy slot
            answered = agent.ok
            time.sleep(2)
            until(lambda n=answered + 2: agent.ok >= n)  # completions between two samples
            assert take(baked)["generation"] == good.number
        assert agent.ok >= 3, agent.ok
        flags = [*GOOD, "-m", str(deep), "--drain-timeout", "5", "--bake", "10m", "--wait"]
        rc, out = _deploy_waiting(baked, *flags)
    finally:
        agent.stop.set()
        worker.join()
    assert (rc, out["outcome"]) == (6, "reverted"), json.dumps(out)[-3000:]
    verdict = out["bake"]["verdict"]["verdict"]
    assert (verdict["signal"], verdict["hard"]) == ("decode_speed", False), verdict
    assert "3 bad samples in a row" in verdict["reason"], verdict
    assert verdict["figures"]["completions"] >= 20, verdict
    now = live(baked)
    assert now.env_text == good.env_text
    assert now.meta["reverted_from"] == out["bake"]["started"]["generation"]


def test_a_sampler_killed_during_its_revert_leaves_it_to_recover_which_settles_the_bake(
    baked: Host,
) -> None:
    """The sampler's service carrying the bake (the deploy started it) finds the crash and
    begins the revert; killed during it, it leaves the bake ``reverting``; ``recover``
    handles the revert's transaction and settles the bake from what the generations say."""
    rc, out = deploy(baked, *GOOD)  # the config before the bake
    assert rc == 0, out
    rc, out = deploy(baked, *GOOD[:-1], "2", "--bake", "10m")
    assert (rc, out["bake"]["started"]["state"]) == (0, "baking"), out
    gen = store.Store(baked.state_dir).get(out["generation"])
    service = timer.names(baked.unit)[0]  # the carrier the deploy started
    baked.sandbox.systemctl("kill", "--signal=SIGKILL", baked.unit)  # a crash
    deadline = time.monotonic() + 300
    while (b := bake.load(gen.path)) is None or b.state != bake.REVERTING:
        assert b is None or b.state == bake.RUNNING, b.to_json() if b else None
        assert time.monotonic() < deadline, "no revert began"
        time.sleep(0.005)
    baked.sandbox.systemctl("kill", "--signal=SIGKILL", service)  # during the revert
    assert bake.load(gen.path).state == bake.REVERTING  # type: ignore[union-attr]
    rc, out = baked.cli_json("recover")
    assert rc == 0, out
    settled = out["bake"]
    assert settled["state"] in ("reverted", "revert_failed"), settled
    assert bake.load(gen.path).state == settled["state"]  # type: ignore[union-attr]
    now = live(baked)
    if settled["state"] == "reverted":  # the revert had committed: the old config serves
        assert now.meta["reverted_from"] == gen.number
    else:  # the recovery undid it: the baked config serves, and the fix is named
        assert "llama-launcher rollback --to" in settled["revert"]["message"]
    answered = Agents(baked.url)  # and a config serves again
    deadline = time.monotonic() + 120
    while not answered.turn(0, [{"role": "user", "content": "hi"}]):
        assert time.monotonic() < deadline, ("nothing serves after the recovery", out)
        time.sleep(0.5)
