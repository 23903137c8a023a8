"""The long-prompt lane as a unit's users meet it (issue 43): ``install --lane NAME`` under
the sandboxed systemd, llama-server b11434 and Debian's HAProxy 2.6. The lane is a unit of
its own that every verb takes with ``--lane``; the main unit's front sends it the long
prompts; its deploys and rollbacks hold only its own clients; ``uninstall --lane`` sends
every request to the main unit again.

The tiny model's vocabulary spells most words byte by byte, so its prompts take about a
token per byte: the lanes here route with ``--lane-bytes-per-token 1``. Which server
answered is told by its alias (``-a main``, ``-a lane``), the ``model`` of the answer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Host
from test_bake_server import until
from test_front_hold import front_of
from test_handover import installed

from launcher.deploy.restart import lane

MAIN = ["-c", "2048", "-np", "2", "-a", "main"]
LANE = ["-c", "4096", "-np", "1", "-a", "lane"]
#: a prompt of about 900 tokens, over the lanes' threshold of 600
LONG = " ".join(f"line {i} of a log" for i in range(60))


def install_lane(host: Host, *more: str) -> tuple[int, dict[str, Any]]:
    return host.cli_json(
        "install",
        "--lane",
        "long",
        "--lane-threshold",
        "600",
        "--lane-bytes-per-token",
        "1",
        "-m",
        str(host.model),
        "--llama-server",
        host.server,
        *LANE,
        *more,
    )


@pytest.fixture
def laned(host: Host) -> Iterator[Host]:
    """A unit behind its front, with the lane ``long``; both removed after the test."""
    installed(host, *MAIN, "--front", "haproxy")
    rc, out = install_lane(host)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    yield host  # the host fixture removes its units


def served_by(host: Host, content: str, max_tokens: int = 2) -> str:
    """The alias of the server that answered ``content`` through the front."""
    r = httpx.post(
        host.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["model"])


def stop_lane(host: Host) -> None:
    """The lane's unit stopped, and the front's health check seeing it down."""
    host.sandbox.systemctl("stop", lane.unit_name(host.unit, "long"))
    until(lambda: not ledger(host).up, 30)


def ledger(host: Host) -> lane.Ledger:
    found = lane.ledger(front_of(host))
    assert found is not None, "the front loads no lane"
    return found


class Agents(threading.Thread):
    """Chat agents sending short requests through the front until stopped: how many were
    answered, and every request that was not (its status or error)."""

    def __init__(self, url: str, n: int = 2) -> None:
        super().__init__(daemon=True)
        self.url, self.n = url, n
        self.stop = threading.Event()
        self.answered = 0
        self.failed: list[str] = []

    def run(self) -> None:
        workers = [threading.Thread(target=self.agent, args=(i,)) for i in range(self.n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def agent(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            for _ in range(10_000):  # bounded; stopped long before
                if self.stop.is_set():
                    return
                body = {"messages": [{"role": "user", "content": f"agent {i}"}], "max_tokens": 8}
                try:
                    r = client.post(self.url + "/v1/chat/completions", json=body)
                except httpx.HTTPError as e:
                    self.failed.append(repr(e))
                    continue
                if r.status_code == 200:
                    self.answered += 1
                else:
                    self.failed.append(f"{r.status_code} {r.text[:200]}")

    def finish(self) -> None:
        self.stop.set()
        self.join(180)


def test_a_long_prompt_goes_to_the_lane_and_a_short_one_to_the_main_server(
    laned: Host,
) -> None:
    assert served_by(laned, LONG) == "lane"
    assert served_by(laned, "hi") == "main"
    assert (ledger(laned).routed, ledger(laned).bytes) == (1, 600)


def test_the_lane_is_a_unit_every_verb_takes_with_lane(laned: Host) -> None:
    rc, out = laned.cli_json("--lane", "long", "set", "-c", "8192")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert served_by(laned, LONG) == "lane"
    rc, out = laned.cli_json("--lane", "long", "rollback")
    assert (rc, out["outcome"], out["generation"]) == (0, "deployed", 3), out
    rc, status = laned.cli_json("--lane", "long", "status")
    assert status["unit"] == lane.unit_name(laned.unit, "long")
    assert status["lane_of"] == {"name": "long", "main_unit": laned.unit}
    assert status["live_generation"] == 3
    assert "4096" in status["argv"]
    history = laned.cli("--lane", "long", "history").stdout
    assert "set -c 8192" in history


def test_status_of_the_main_unit_names_its_lane(laned: Host) -> None:
    rc, out = laned.cli_json("status")
    seen = out["front"]["lane"]
    assert (rc, seen["name"], seen["unit"]) == (0, "long", lane.unit_name(laned.unit, "long"))
    assert (seen["threshold_tokens"], seen["threshold_bytes"]) == (600, 600)
    assert seen["routing"]["up"] is True
    assert "lane: long (" in laned.cli("status").stdout


def test_a_deploy_of_the_lane_holds_its_requests_and_cuts_no_main_client(laned: Host) -> None:
    agents = Agents(laned.url)
    agents.start()
    until(lambda: agents.answered >= 2, 60)
    done: dict[str, Any] = {}
    deploy = threading.Thread(
        target=lambda: done.update(out=laned.cli_json("--lane", "long", "set", "-c", "8192"))
    )
    deploy.start()
    until(lambda: ledger(laned).held, 60)
    answered_while_held = ServedBy(laned, LONG)
    deploy.join(180)
    answered_while_held.join(180)
    agents.finish()
    rc, out = done["out"]
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert out["handover"]["lane"]["held"] is True
    assert answered_while_held.model == "lane"  # it waited at the front, not at the main
    assert agents.failed == [] and agents.answered > 2
    assert not ledger(laned).held


class ServedBy(threading.Thread):
    """``served_by`` in a thread: the alias (or the error) once it ends."""

    def __init__(self, host: Host, content: str, max_tokens: int = 2) -> None:
        super().__init__(daemon=True)
        self.host, self.content, self.max_tokens = host, content, max_tokens
        self.model = ""
        self.start()

    def run(self) -> None:
        try:
            self.model = served_by(self.host, self.content, self.max_tokens)
        except (AssertionError, httpx.HTTPError) as e:
            self.model = repr(e)


def test_a_rollback_of_the_lane_under_load_cuts_no_main_client(laned: Host) -> None:
    rc, out = laned.cli_json("--lane", "long", "set", "-c", "8192")
    assert rc == 0, out
    agents = Agents(laned.url)
    agents.start()
    until(lambda: agents.answered >= 2, 60)
    rc, out = laned.cli_json("--lane", "long", "rollback")
    long_after = served_by(laned, LONG)
    agents.finish()
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert out["handover"]["lane"]["held"] is True
    assert long_after == "lane"
    assert agents.failed == [] and agents.answered > 2


def test_a_lane_that_is_down_holds_its_requests_never_the_main_pool(laned: Host) -> None:
    unit = lane.unit_name(laned.unit, "long")
    laned.sandbox.systemctl("stop", unit)
    until(lambda: not ledger(laned).up, 30)
    waiting = ServedBy(laned, LONG)
    until(lambda: ledger(laned).waiting == 1, 30)
    assert served_by(laned, "hi") == "main"  # the main unit's clients pass
    laned.sandbox.systemctl("start", unit)
    waiting.join(120)
    assert waiting.model == "lane"
    assert ledger(laned).waited == 1


def test_the_threshold_changes_at_run_time_without_a_restart_of_haproxy(laned: Host) -> None:
    before = front_of(laned).identity()
    agents = Agents(laned.url)
    agents.start()
    until(lambda: agents.answered >= 2, 60)
    rc, out = install_lane(laned, "--lane-threshold", "5000")
    long_now = served_by(laned, LONG)
    agents.finish()
    assert rc == 0, out
    assert out["handover"]["routing"]["applied"] == "at run time (no restart of HAProxy)"
    assert front_of(laned).identity() == before
    assert long_now == "main"  # under the new threshold
    assert agents.failed == []
    assert "LLAMA_LANE_BYTES 5000" in (front_of(laned).live_text() or "")


def test_uninstall_lane_sends_every_request_to_the_main_unit(laned: Host) -> None:
    agents = Agents(laned.url)
    agents.start()
    until(lambda: agents.answered >= 2, 60)
    rc, out = laned.cli_json("uninstall", "--lane", "long")
    long_now = served_by(laned, LONG)
    agents.finish()
    assert rc == 0, out
    assert long_now == "main"
    assert agents.failed == []
    assert lane.ledger(front_of(laned)) is None
    assert not (laned.sandbox.unit_dir / lane.unit_name(laned.unit, "long")).exists()


def test_a_lane_on_another_host_is_routed_to_by_its_address(host: Host) -> None:
    installed(host, *MAIN, "--front", "haproxy")
    try:
        rc, out = host.cli_json(
            "install",
            "--lane",
            "far",
            "--lane-address",
            f"127.0.0.1:{host.port}",  # the front itself stands for another host's server
            "--lane-threshold",
            "600",
            "--lane-bytes-per-token",
            "1",
        )
        assert rc == 0, out
        spec = front_of(host).spec()
        assert spec is not None and (spec.lane, spec.lane_unit) == ("far", "")
        assert "server lane 127.0.0.1:" in (front_of(host).live_text() or "")
    finally:
        host.remove()


def test_a_lane_without_a_front_is_refused(host: Host) -> None:
    installed(host, *MAIN)
    rc, out = install_lane(host)
    assert rc == 2
    assert "has no front to route long prompts from" in out["message"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--lane-threshold", "600"], "--lane-threshold 600 needs --lane NAME"),
        (["--lane", "Long!"], "is no lane name"),
        (["--lane", "long", "--lane-threshold", "0"], "--lane-threshold 0 is no threshold"),
        (["--lane", "long", "--lane-address", "nowhere"], "--lane-address 'nowhere' is no"),
        (["--lane", "long", "--front", "haproxy"], "without --front"),
        (["--lane", "long", "--lane-slots", "2"], "--lane-slots 2 is for a lane on another"),
    ],
)
def test_bad_lane_options_are_refused_naming_the_value(
    host: Host, flags: list[str], words: str
) -> None:
    rc, out = host.cli_json("install", *host.base_flags(), *flags)
    assert rc == 2
    assert words in out["message"], out


def test_the_lane_crashing_under_a_long_prompt_cuts_no_main_client(laned: Host) -> None:
    """The lane's server killed while it reads a long prompt: that request is lost (its own
    server's crash), the main unit's agents see nothing, and systemd starts the lane again
    for the next long prompt, which waits at the front meanwhile."""
    agents = Agents(laned.url)
    agents.start()
    until(lambda: agents.answered >= 2, 60)
    victim = ServedBy(laned, LONG, max_tokens=3000)
    until(lambda: ledger(laned).routed == 1, 60)
    laned.sandbox.systemctl("kill", "--signal=SIGKILL", lane.unit_name(laned.unit, "long"))
    victim.join(120)
    next_long = served_by(laned, LONG)
    agents.finish()
    assert victim.model != "lane"  # it was cut
    assert next_long == "lane"
    assert agents.failed == [] and agents.answered > 2


def test_a_prompt_too_large_for_the_lane_gets_the_lanes_own_400(laned: Host) -> None:
    r = httpx.post(
        laned.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": LONG * 6}], "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "exceed_context_size_error"
    assert ledger(laned).routed == 1


def test_a_body_sent_in_chunks_goes_to_the_main_server(laned: Host) -> None:
    """No Content-Length, no length to route by: the main server (700 bytes, over the
    threshold, that it can hold)."""
    import json

    body = json.dumps(
        {"messages": [{"role": "user", "content": "x " * 350}], "max_tokens": 2}
    ).encode()
    r = httpx.post(
        laned.url + "/v1/chat/completions",
        content=iter([body[:100], body[100:]]),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "main"


def test_a_lane_down_past_its_wait_is_answered_503_with_retry_after(laned: Host) -> None:
    rc, out = install_lane(laned, "--lane-wait", "2")
    assert rc == 0, out
    stop_lane(laned)
    r = httpx.post(
        laned.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": LONG}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "5"
    assert "long-prompt lane did not serve within 2 s" in r.text
    assert ledger(laned).refused_wait == 1


def test_lane_requests_are_not_admitted_against_the_main_pool(host: Host) -> None:
    installed(
        host, "-c", "2048", "-np", "2", "-kvu", "-a", "main", "--front", "haproxy", "--admission"
    )
    try:
        rc, out = install_lane(host)
        assert rc == 0, out
        assert served_by(host, LONG) == "lane"
        assert served_by(host, "hi") == "main"
        from launcher.deploy.restart import admission

        admitted = admission.ledger(front_of(host))
        assert admitted is not None and admitted.admitted == 1
        assert ledger(host).routed == 1
    finally:
        host.remove()


def test_a_lane_deploy_that_changes_its_slots_tells_the_front(laned: Host) -> None:
    rc, out = laned.cli_json("--lane", "long", "set", "-np", "2", "-c", "8192")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert front_of(laned).stats()[("lane", "lane")]["slim"] == "2"
    spec = front_of(laned).spec()
    assert spec is not None and spec.lane_slots == 2


def test_check_and_render_show_the_fronts_routing(laned: Host) -> None:
    rc, out = laned.cli_json("set", "--check", "-t", "1")
    assert rc == 0, out
    routing = out["planned"]["front"]["routing"]
    assert "POST bodies over 600 bytes (prompts over 600 tokens" in routing
    assert "go to the lane long at 127.0.0.1:" in routing
    rc, out = laned.cli_json("--lane", "long", "render", "-m", str(laned.model), *LANE)
    assert rc == 0, out
    assert f"the front of {laned.unit} sends this lane (long)" in out["front"]["routing"]
    assert "routing:" in laned.cli("--lane", "long", "set", "--check", "-t", "1").stdout


def test_a_lane_whose_first_deploy_fails_is_not_routed_to(host: Host, tmp_path: Path) -> None:
    from test_deploy import BAD_TEMPLATE

    installed(host, *MAIN, "--front", "haproxy")
    template = tmp_path / "bad.jinja"
    template.write_text(BAD_TEMPLATE)
    try:
        rc, out = install_lane(host, "--chat-template-file", str(template))
        assert (rc, out["outcome"]) == (3, "rolled_back"), out
        spec = front_of(host).spec()
        assert spec is not None and spec.lane == ""
        assert served_by(host, LONG) == "main"
    finally:
        host.remove()


def test_a_client_that_leaves_while_it_waits_for_the_lane_is_no_longer_counted(
    laned: Host,
) -> None:
    stop_lane(laned)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            laned.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": LONG}], "max_tokens": 2},
            timeout=2,
        )
    until(lambda: ledger(laned).waiting == 0, 10)


def test_removing_a_lane_sends_the_requests_waiting_for_it_to_the_main_server(
    laned: Host,
) -> None:
    stop_lane(laned)
    waiting = ServedBy(laned, LONG)
    until(lambda: ledger(laned).waiting == 1, 30)
    rc, out = laned.cli_json("uninstall", "--lane", "long")
    waiting.join(120)
    assert rc == 0, out
    assert waiting.model == "main"


def test_a_lane_on_another_host_takes_as_many_requests_as_it_is_given(host: Host) -> None:
    installed(host, *MAIN, "--front", "haproxy")
    try:
        rc, out = host.cli_json(
            "install", "--lane", "far", "--lane-address", "10.0.0.9:8081", "--lane-slots", "4"
        )
        assert rc == 0, out
        assert "server lane 10.0.0.9:8081 maxconn 4" in (front_of(host).live_text() or "")
    finally:
        host.remove()


def test_the_lane_of_an_instance_is_a_unit_named_after_it() -> None:
    from launcher import cli
    from launcher.cli.deploy import settings_from

    args = ["status", "--instance", "chat", "--lane", "long", "--scope", "user"]
    ns = cli.build_parser().parse_args(args)
    lane_of = settings_from(ns)
    assert lane_of.unit_name == "llama-server-chat-lane-long.service"
    assert lane_of.resolved_env_file().name == "llama-server-chat-lane-long.env"


def test_a_lane_deployer_killed_at_its_restart_is_recovered_and_its_hold_released(
    laned: Host,
) -> None:
    """kill -9 of a lane's deploy at its restart leaves the lane held at the front (until
    the hold's deadline); the next command on the lane recovers the transaction and lets
    the lane's requests through."""
    import subprocess
    import sys

    faults = str(Path(__file__).with_name("faults.py"))
    p = subprocess.run(
        [sys.executable, faults, "restart:kill", "--lane", "long", "set", "-c", "8192", "--json"],
        env=laned.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == -9, p.stdout + p.stderr
    assert ledger(laned).held
    rc, out = laned.cli_json("--lane", "long", "recover")
    assert rc == 0, out
    assert out["recovered"]["lane"] == "released the lane's requests a killed deployer left held"
    assert not ledger(laned).held
    assert served_by(laned, LONG) == "lane"
