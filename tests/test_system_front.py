"""The HAProxy front in system scope: systemd as PID 1 (scripts/sysbed), as root. One bed for
the module, the unit installed once with ``--front haproxy``; the tests walk it in file order:
HAProxy serves the public port as a user of its own, its unit's exposure is within the
threshold, a deploy holds behind it, and a deployer killed while holding is released by the
front's release watcher, which recovers its transaction (nothing else runs meanwhile)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_bake_system import FINAL, until
from test_system_scope import (  # noqa: F401 (the fixtures placed, `system`, tool, wheelhouse)
    EXPOSURE_LIMIT,
    PORT,
    TIMEOUTS,
    System,
    placed_step2,
    system_after_step1,
    tool,
    wheelhouse,
)

FRONT = "llama-server-front.service"
#: the name of this module's own bed (the imported ``system`` fixture boots it)
BED = "llf"


@pytest.fixture(scope="module")
def fronted(placed: System) -> dict[str, Any]:
    """The production install guide's steps 1 and 2, then install with the front (step 7)."""
    rc, out = placed.cli_json(
        "install", *placed.flags(), "-c", "4096", "-np", "2", "--front", "haproxy"
    )
    assert (rc, out.get("outcome")) == (0, "deployed"), out
    return out


def test_haproxy_serves_the_public_port_as_a_user_of_its_own(
    system: System, fronted: dict[str, Any]
) -> None:
    assert fronted["handover"]["front"]["public"] == f"127.0.0.1:{PORT}"
    code, body = system.bed.chat(PORT)
    assert code == 200 and body["usage"]["completion_tokens"] > 0
    master = system.main_pid(FRONT)
    workers = system.bed.read(f"/proc/{master}/task/{master}/children").split()
    assert workers, "HAProxy's master has no worker"
    for pid in (master, *map(int, workers)):
        assert 61184 <= system.uid_of(pid) <= 65519, pid  # a dynamic user, not root
        assert system.cmdline(pid)[0] == "/usr/sbin/haproxy"


def test_the_front_units_exposure_is_within_the_threshold(
    system: System, fronted: dict[str, Any]
) -> None:
    p = system.bed.run("systemd-analyze", "security", f"--threshold={EXPOSURE_LIMIT}", FRONT)
    level = re.search(r"Overall exposure level for \S+: ([\d.]+) (\S+)", p.stdout)
    assert level, p.stdout + p.stderr
    print(f"exposure of {FRONT}: {level.group(1)} {level.group(2)}")
    assert p.returncode == 0, f"exposure {level.group(1)} > 2.0"


def test_a_deploy_holds_requests_behind_the_hardened_front(
    system: System, fronted: dict[str, Any]
) -> None:
    rc, out = system.cli_json("set", "-t", "2")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    front = out["handover"]["front"]
    assert front["held"] is True and front["held_seconds"] > 0, front
    rc, status = system.cli_json("status")
    assert status["front"]["state"] == "open", status["front"]
    assert system.bed.chat(PORT)[0] == 200


ENV_FILE = "/etc/llama-launcher/llama-server.env"


def killed_at_gate(system: System, *change: str) -> None:
    """A deploy of ``change`` killed (SIGKILL) when the transaction records ``gate``."""
    faults = str(Path(__file__).with_name("faults.py"))
    pairs = [f"{k}={v}" for k, v in TIMEOUTS.items()]
    p = system.bed.run("env", *pairs, sys.executable, faults, "gate:kill", *change, "--json")
    assert p.returncode in (-9, 137), p.stdout + p.stderr


def recovered(system: System) -> None:
    """Wait until no transaction is pending and the front is open."""
    deadline = time.monotonic() + 60
    while True:
        _, status = system.cli_json("status")
        if not status["pending_transaction"] and status["front"]["state"] == "open":
            return
        assert time.monotonic() < deadline, status
        time.sleep(0.5)


def test_a_deployer_killed_while_holding_is_released_by_the_watcher(
    system: System, fronted: dict[str, Any]
) -> None:
    before = system.bed.read(ENV_FILE)
    killed_at_gate(system, "set", "-t", "1")
    # nothing runs but the installed units: the held request is answered (30 s: the
    # client's timeout, within one deploy's budget)
    code, body = system.bed.chat(PORT)
    assert code == 200, body
    recovered(system)
    assert system.bed.read(ENV_FILE) == before  # recovered: the previous config serves
    journal = system.bed.journal("llama-server-front-release.service")
    assert '"outcome": "recovered"' in journal, journal[-2000:]


def test_a_start_after_a_killed_deploy_holds_until_the_watcher_has_recovered(
    system: System, fronted: dict[str, Any]
) -> None:
    before = system.bed.read(ENV_FILE)
    watcher = "llama-server-front-release.path"
    system.bed.systemctl("stop", watcher)  # the deploy then holds nothing, and nothing recovers
    killed_at_gate(system, "set", "-t", "3")
    system.bed.systemctl("start", watcher)
    # a start with the transaction pending and its lock free (a reboot, a crash restart):
    # prestart reverts the env file and records the hold; the watcher recovers, releases
    system.bed.systemctl("restart", "llama-server.service")
    started = system.bed.show("llama-server.service", "InvocationID", "MainPID")
    code, body = system.bed.chat(PORT)
    assert code == 200, body
    recovered(system)
    assert system.bed.read(ENV_FILE) == before
    journal = system.bed.journal("llama-server.service")
    assert "its requests are held until the gate" in journal, journal[-3000:]
    # the watcher gated that start, which runs the previous config: the model loaded once
    now = system.bed.show("llama-server.service", "InvocationID", "MainPID")
    assert now == started, "the watcher restarted the start prestart had reverted"
    watcher = system.bed.journal("llama-server-front-release.service")
    assert "gated the start that runs it" in watcher, watcher[-3000:]


def test_a_bakes_hard_failure_is_reverted_through_the_front_by_the_timers_sampler(
    system: System, fronted: dict[str, Any]
) -> None:
    """The sample service, hardened, reverts through the front: the front's config and its
    hold (state folder), the runtime API (HAProxy's /run folder), the env file (/etc)."""
    before = system.bed.read(ENV_FILE)
    bake = {"LLAMA_LAUNCHER_BAKE_INTERVAL": "2", "LLAMA_LAUNCHER_BAKE_WARMUP": "0"}
    rc, out = system.cli_json("set", "-t", "1", "--bake", "10m", **bake)
    assert (rc, out["bake"]["started"]["state"]) == (0, "baking"), out
    baked = out["generation"]
    path = f"/var/lib/llama-launcher/llama-server/generations/{baked:04d}/bake.json"

    def bake_now() -> dict[str, Any]:
        try:
            return json.loads(system.bed.read(path))  # type: ignore[no-any-return]
        except (FileNotFoundError, ValueError):
            return {}

    system.bed.systemctl("stop", "llama-server-sample.service")
    assert system.bed.systemctl("restart", "llama-server-sample.timer").returncode == 0
    until(lambda: bake_now().get("progress", {}).get("samples"), "the timer's sample")
    assert system.bed.systemctl("kill", "--signal=SIGKILL", "llama-server.service").returncode == 0
    ended = until(lambda: (b := bake_now()).get("state") in FINAL and b, "the bake's verdict")
    assert (ended["state"], ended["revert"]["outcome"]) == ("reverted", "reverted"), ended
    assert system.bed.read(ENV_FILE) == before
    recovered(system)  # no transaction left, the front open
    assert system.bed.chat(PORT)[0] == 200


def test_the_hardened_front_admits_against_the_pool(
    system: System, fronted: dict[str, Any]
) -> None:
    """Installed again with ``--admission``: the Lua reaches HAProxy as a credential, the
    over-committed shared pool passes, and the ledger counts a chat through the front."""
    rc, out = system.cli_json(
        "install", *system.flags(), "-c", "4096", "-np", "2", "-kvu", "--front", "haproxy",
        "--admission",
    )  # fmt: skip
    journal = system.bed.run("journalctl", "-u", FRONT, "-n", "40", "--no-pager").stdout
    assert (rc, out.get("outcome")) == (0, "deployed"), journal
    assert system.bed.chat(PORT)[0] == 200
    rc, status = system.cli_json("status")
    seen = status["front"]["admission"]
    assert (rc, seen["state"], seen["pool"], seen["counted"]) == (0, "on", 4096, 1), seen


def test_the_hardened_front_routes_long_prompts_to_a_lane(
    system: System, fronted: dict[str, Any]
) -> None:
    """``install --lane``: the lane is a hardened unit of its own (a user of its own), its
    Lua reaches HAProxy as a credential, a long prompt is served by the lane and a short one
    by the main server; ``uninstall --lane`` takes it out again."""
    lane_unit = "llama-server-lane-long.service"
    rc, out = system.cli_json(
        "install", "--lane", "long", "--lane-threshold", "600", "--lane-bytes-per-token", "1",
        "-m", system.model, "-c", "4096", "-np", "1", "-a", "lane",
    )  # fmt: skip
    journal = system.bed.run("journalctl", "-u", FRONT, "-n", "40", "--no-pager").stdout
    try:
        assert (rc, out.get("outcome")) == (0, "deployed"), (out, journal)
        assert 61184 <= system.uid_of(system.main_pid(lane_unit)) <= 65519
        long = " ".join(f"line {i} of a log" for i in range(60))
        code, body = system.bed.chat(PORT, content=long)
        assert (code, body.get("model")) == (200, "lane"), body
        code, body = system.bed.chat(PORT)
        assert code == 200 and body.get("model") != "lane", body
        rc, status = system.cli_json("status")
        seen = status["front"]["lane"]
        assert (seen["unit"], seen["routing"]["routed"], seen["routing"]["up"]) == (
            lane_unit,
            1,
            True,
        ), seen
    finally:
        rc, out = system.cli_json("uninstall", "--lane", "long")
    assert rc == 0, out
    assert system.bed.chat(PORT)[0] == 200
