"""The bake is watched from the deploy on (launcher/watch/handoff.py): a plain ``set --bake``,
the path a person takes (the CLI returns after the gate), starts the sampler's service that
carries the bake, not the timer's next tick; a bake on a unit whose sampler units are
missing is refused with nothing changed; ``--wait`` waits for that same carrier's verdict.
Real parts: the sandboxed systemd, llama-server b11434. The sampler's timers here tick once
an hour, so a bake sampled at all was sampled by the carrier the deploy started."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import Host
from test_bake_server import until
from test_handover import installed
from test_watch import take

from launcher.deploy import store
from launcher.deploy.restart.front import Front
from launcher.host import timer
from launcher.watch import bake, record

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import repro

BAKE_ENV = {
    "LLAMA_LAUNCHER_SAMPLE_INTERVAL": "3600",
    "LLAMA_LAUNCHER_BAKE_INTERVAL": "2",
    "LLAMA_LAUNCHER_BAKE_WARMUP": "0",
}


@pytest.fixture
def unit(host: Host) -> Iterator[Host]:
    host.env.update(BAKE_ENV)
    installed(host, "-c", "2048", "-np", "2", "-t", "1")
    yield host  # the host fixture removes its units


def bake_of(h: Host, generation: int) -> bake.Bake:
    b = bake.load(store.Store(h.state_dir).get(generation).path)
    assert b is not None
    return b


def sampled(h: Host, generation: int, timeout: float = 120) -> bake.Bake:
    """The bake once a sample judged it (however slow this machine is)."""
    deadline = time.monotonic() + timeout
    while (b := bake_of(h, generation)).progress.samples < 1:
        assert time.monotonic() < deadline, f"no sample judged the bake: {b.to_json()}"
        time.sleep(0.1)
    return b


def test_a_plain_set_with_a_bake_is_sampled_by_the_carrier_the_deploy_started(unit: Host) -> None:
    rc, out = unit.cli_json("set", "-t", "2", "--bake", "10m")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    service = timer.names(unit.unit)[0]
    carried = out["bake"]["carrier"]
    assert (carried["unit"], carried["started"]) == (service, True), out["bake"]
    b = sampled(unit, out["generation"])
    assert b.running, b.to_json()
    assert b.progress.first is not None and b.progress.first >= b.started
    # it goes on carrying the bake, a service that runs, not the timer's one sample
    assert unit.sandbox.show(service, "ActiveState")["ActiveState"] == "active"
    rc, status = unit.cli_json("status")
    assert rc == 0, status
    assert status["bake"]["samples"] >= 1 and status["bake"]["first_sample_after"] is not None


def test_a_later_deploy_restarts_the_carrier_for_its_own_bake(unit: Host) -> None:
    rc, first = unit.cli_json("set", "-t", "2", "--bake", "10m")
    assert rc == 0, first
    sampled(unit, first["generation"])
    rc, second = unit.cli_json("set", "-t", "1", "--bake", "10m")
    assert rc == 0, second
    assert second["bake"]["ended"]["generation"] == first["generation"]
    assert bake_of(unit, first["generation"]).state == "ended"
    assert sampled(unit, second["generation"]).running


def test_a_bake_on_a_unit_without_its_sampler_units_is_refused_and_nothing_changes(
    unit: Host,
) -> None:
    names = timer.names(unit.unit)
    unit.sandbox.systemctl("disable", "--now", names[1], check=False)
    for name in timer.file_names(unit.unit):
        (unit.sandbox.unit_dir / name).unlink()
    unit.sandbox.systemctl("daemon-reload")
    before = (unit.env_file.read_text(), unit.state()["MainPID"])
    rc, out = unit.cli_json("set", "-t", "2", "--bake", "10m")
    assert rc == 2, out
    assert out["error"] == "ConfigInvalid", out
    assert names[0] in out["message"] and "llama-launcher install" in out["message"], out
    assert (unit.env_file.read_text(), unit.state()["MainPID"]) == before
    rc, out = unit.cli_json("set", "-t", "2")  # without a bake it deploys
    assert (rc, out["outcome"]) == (0, "deployed"), out


def test_wait_returns_the_verdict_the_carrier_recorded(unit: Host) -> None:
    rc, out = unit.cli_json("set", "-t", "2", "--bake", "6s", "--wait")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    verdict = out["bake"]["verdict"]
    assert verdict["state"] == "inconclusive", verdict  # a quiet unit: too little traffic
    assert verdict["state"] == bake_of(unit, out["generation"]).state
    assert "inconclusive" in out["message"], out["message"]


# -- seed 000 through the default path, behind the front -----------------------------------

#: The good config: four slots capped at CAP in a pool sized for all of them; the bad one:
#: seed 000's mistake in small, four slots promised CAP each of one pool of CAP.
CAP = 1024
GOOD = ("-np", "4", "-kvu", "--kv-unified-per-slot", str(CAP), "-c", str(4 * CAP), "-t", "1")
OVERCOMMITTED = ("-np", "4", "-kvu", "-c", str(CAP), "-t", "1", "--allow-overcommit")


class Agents:
    """Four agents whose histories grow every turn (a pause of 0.3-0.7 s between turns, as
    a coding agent's tools take), each request's (sent, ended, ok, why not)."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.fresh: set[int] = set()
        self.done: list[tuple[float, float, bool, str]] = []

    def agent(self, i: int) -> None:
        history = [{"role": "user", "content": repro.prompt(20, 90 + i)}]
        while not self.stop.is_set():
            if i in self.fresh:  # a new session at the deploy: it grows into the new pool
                self.fresh.discard(i)
                history[:] = history[:1]
            body = {"messages": history, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            sent, why = time.time(), ""
            try:
                r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
                ok = r.status_code == 200 and "choices" in r.text
                if not ok:
                    why = "too_long" if "exceeds the available context" in r.text else r.text[:80]
            except httpx.HTTPError as e:
                ok, why = False, f"cut: {e}"
            self.done.append((sent, time.time(), ok, why))
            if ok:
                history.append(r.json()["choices"][0]["message"])
            time.sleep(0.3 + 0.1 * i)
            history.append({"role": "user", "content": repro.prompt(20, 100 + i + len(history))})
            if why == "too_long" or len(history) > 40:
                history[:] = history[:1]  # past its slot's window: it compacts (a new session)

    def answered(self) -> int:
        return sum(1 for _, _, ok, _ in self.done if ok)


@pytest.fixture(params=["haproxy", "switch"])
def fronted(host: Host, request: pytest.FixtureRequest) -> Iterator[Host]:
    host.env["LLAMA_LAUNCHER_SAMPLE_INTERVAL"] = "3600"
    front = ["--second-instance"] if request.param == "switch" else []
    installed(host, *GOOD, "--front", "haproxy", *front)
    yield host  # the host fixture removes its units


def test_seed_000_baked_behind_the_front_loses_no_request_sent_after_the_first_hard_signal(
    fronted: Host,
) -> None:
    """The over-committed pool deployed with ``--bake`` through the default path (the CLI
    returns after the gate; nothing waits) while four agents' histories grow into it: the
    carrier the deploy started samples it within its first interval, the bake reverts it
    (the pool watch at its limit, or an overflow), and no request an agent sent after the
    first hard signal is lost: the front held (or switched) from then on."""
    agents = Agents(fronted.url)
    with ThreadPoolExecutor(4) as pool:
        try:
            for i in range(4):
                pool.submit(agents.agent, i)
            until(lambda: agents.answered() >= 8)
            assert take(fronted)["generation"] is not None  # the baseline, with its load
            agents.fresh.update(range(4))
            rc, out = fronted.cli_json(
                "deploy", *fronted.base_flags(), *OVERCOMMITTED, "--drain-timeout", "5",
                "--bake", "10m",
            )  # fmt: skip
            # reverted at once when the pool overflowed in the deploy's own last moments
            assert (rc, out["outcome"]) in ((0, "deployed"), (6, "reverted")), out
            generation = out["bake"]["started"]["generation"]
            until(lambda: bake_of(fronted, generation).state not in bake.STATES[:2], timeout=600)
            time.sleep(2)  # the agents' turns after the revert, answered
        finally:
            agents.stop.set()
    b = bake_of(fronted, generation)
    assert b.state == "reverted" and b.verdict is not None and b.verdict.hard, b.to_json()
    assert b.progress.first is not None and b.progress.first - b.started < b.policy.interval
    st = store.Store(fronted.state_dir)
    gone = st.get(generation)
    rec = record.load(gone.path, generation)
    overflows = [f["t"] for f in rec.failures if f["kind"] == "context_exceeded"]
    overflows += [e for s, e, ok, why in agents.done if "Context size" in why and e >= b.started]
    assert b.ended is not None
    first = min([*overflows, b.ended])
    live = st.live()
    assert live is not None and live.meta.get("reverted_from") == generation
    serving = bake.served_from(live)
    switched = ((b.revert or {}).get("handover") or {}).get("switch", {}).get("switched_at")
    if switched:
        serving = min(serving, float(switched))
    # the front was held at the first hard signal (early: by the deploy in its last moments,
    # or by the bake's carrier at a journal line or a look at the pool's limit), and from
    # then on every request waited for the old config: none sent after the hold was lost
    early = (b.revert or {}).get("early_hold") or {}
    assert early.get("held"), b.to_json()
    held = max(first, float(early["at"]))
    lost = [
        (s - first, why)
        for s, e, ok, why in agents.done
        if not ok and s >= held and why != "too_long"
    ]
    said = {
        "first_hard_after_start": first - b.started,
        "first_sample_after_start": (b.progress.first or 0) - b.started,
        "verdict_after_start": b.ended - b.started,
        "overflows": sorted(round(o - b.started, 3) for o in overflows)[:8],
        "early": (b.revert or {}).get("early_hold"),
        "started": b.started,
        "notes": b.progress.notes,
        "verdict": b.verdict.to_dict(),
        "serving_after_start": serving - b.started,
        "lost_after_first_hard_signal": [
            round(s - first, 3)
            for s, e, ok, why in agents.done
            if not ok and s >= first and why != "too_long"
        ],
    }
    assert not lost, (lost, said)
    assert agents.answered() > 8


def test_a_config_failing_as_the_front_releases_it_is_reverted_by_the_deploy_itself(
    host: Host, tmp_path: Path
) -> None:
    """Four requests held at the front through the restart reach the over-committed pool
    together as the deploy releases them, and overflow it in its last moments, before the
    deploy returns: the deploy's own lookout holds the front at the journal's line, and its
    first sample and the revert run in the deploy, which ends ``reverted`` (exit 6)."""
    host.env["LLAMA_LAUNCHER_SAMPLE_INTERVAL"] = "3600"
    installed(host, *GOOD, "--front", "haproxy")
    try:
        text, n = repro.sized_prompt(host.url, 350, 3)
        assert 4 * (n + 48) > CAP > n + 48, n  # each fits; the four together do not
        go, overflowed = tmp_path / "go", tmp_path / "overflowed"
        faults = str(Path(__file__).with_name("faults.py"))
        deployer = subprocess.Popen(
            [sys.executable, faults, f"gated:wait:{go},released:wait:{overflowed}",
             "deploy", *host.base_flags(),
             *OVERCOMMITTED, "--bake", "10m", "--json"],
            env=host.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while store.Store(host.state_dir).txn().get("phase") != "gated":
            assert deployer.poll() is None and time.monotonic() < deadline, deployer.stderr
            time.sleep(0.05)
        body = {"prompt": text, "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            held = [
                pool.submit(httpx.post, host.url + "/v1/completions", json=body, timeout=120)
                for _ in range(4)
            ]
            time.sleep(1)  # in the front's backlog, all four
            assert not any(f.done() for f in held)
            go.touch()
            # the deploy waits after its release until the pool overflowed: in its last
            # moments, as a fast overflow comes, whatever this machine's speed
            deadline = time.monotonic() + 120
            while "Context size has been exceeded" not in host.journal():
                assert deployer.poll() is None and time.monotonic() < deadline, "no overflow"
                time.sleep(0.05)
            overflowed.touch()
            out_text, err = deployer.communicate(timeout=300)
        out = json.loads(out_text.strip().splitlines()[-1])
        assert (deployer.returncode, out["outcome"]) == (6, "reverted"), (out, err[-2000:])
        verdict = out["bake"]["verdict"]
        assert verdict["state"] == "reverted", verdict
        assert verdict["revert"]["early_hold"]["by"] == "the deploy", verdict["revert"]
        live = store.Store(host.state_dir).live()
        assert (
            live is not None and live.meta["reverted_from"] == out["bake"]["started"]["generation"]
        )
        assert host.chat()["usage"]["completion_tokens"] > 0  # the old config serves
        assert Front(host.state_dir, host.unit).holding() is None  # no hold left behind
    finally:
        host.remove()
