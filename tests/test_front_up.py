"""The front is never left down (launcher/deploy/restart/front.py, fronthold.py ``front_up``):
HAProxy killed at any moment of a hold that moves the private port, even with its start limit used
up, leaves the public port answering when the deploy returns, or the result's first line says
it does not and what to run. Real parts: the sandboxed systemd, llama-server b11434, Debian's
HAProxy 2.6."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import realserver
from conftest import Host
from test_front_hold import chat_status, front_of, in_background
from test_handover import HISTORY, completion, deploy_in_background, installed, result_of

from launcher.cli.results import human
from launcher.deploy.outcome import Result
from launcher.deploy.restart import fronthold
from launcher.deploy.restart.front import Front, FrontSpec


@pytest.fixture
def fronted(host: Host) -> Iterator[Host]:
    """A host with a front, its slots holding a conversation (a deploy saves and restores
    them, so it records every phase); its front units are removed after the test."""
    installed(host, "-c", "8192", "-np", "2", "--front", "haproxy")
    assert completion(host.url, HISTORY)["timings"]["prompt_n"] > 1000
    yield host  # the host fixture removes its units and their drop-ins


def use_up_start_limit(host: Host) -> None:
    """The front's service as an install from before it had no start limit left it, after
    HAProxy was killed a few times within seconds (back-to-back deploys used up systemd's
    default, 5 starts in 10 s): one start allowed an hour, and that one taken. Its next
    start is refused, and its socket unit goes down with it."""
    front = front_of(host)
    dropins = host.sandbox.unit_dir / f"{front.service}.d"
    dropins.mkdir(exist_ok=True)
    (dropins / "start-limit.conf").write_text(
        "[Unit]\nStartLimitIntervalSec=1h\nStartLimitBurst=1\n"
    )
    host.sandbox.systemctl("daemon-reload")
    host.sandbox.systemctl("restart", front.service)


def kill_front_once_held(host: Host, stop: threading.Event) -> None:
    """SIGKILL to HAProxy as soon as the deploy records its hold (the moment the issue saw
    it: within 0.4 s of the hold)."""
    front = front_of(host)
    while not front.hold_path.exists():
        if stop.is_set():
            return
        time.sleep(0.002)
    pid = int(host.sandbox.show(front.service, "MainPID")["MainPID"])
    if pid:
        os.kill(pid, signal.SIGKILL)


def moving_deploy(host: Host, moment: str) -> tuple[int, dict[str, object]]:
    """``set --port NEW`` (the private port moves: the front must be pointed at it) with
    HAProxy killed at ``moment``: ``held`` (as the hold begins), or a phase of the
    transaction (tests/faults.py ``PHASE:kill-front``)."""
    args = ("set", "--port", str(realserver.free_port()), "-a", "new")
    if moment != "held":
        return result_of(in_background(host, f"{moment}:kill-front", *args))
    stop = threading.Event()
    killer = threading.Thread(target=kill_front_once_held, args=(host, stop))
    killer.start()
    try:
        return result_of(deploy_in_background(host, *args))
    finally:
        stop.set()
        killer.join()


def answers_or_says_down(host: Host, result: dict[str, object]) -> None:
    """When the command returns: the public port answers a real completion, or the
    result's first line says the front is down."""
    status, model = chat_status(host.url, 60)
    if status == 200:
        assert model == "new"
        return
    message = str(result["message"])
    assert message.startswith("the front is down"), (status, model, result)
    assert result["front_down"] and "systemctl" in message


# "held": as the hold begins; "restart": while llama-server restarts; "restore": after the
# front was pointed at the new server, right before the release
MOMENTS = ["held", "restart", "restore"]


@pytest.mark.parametrize("moment", MOMENTS)
def test_haproxy_killed_with_its_start_limit_used_up_leaves_the_public_port_answering(
    fronted: Host, moment: str
) -> None:
    host = fronted
    use_up_start_limit(host)
    rc, result = moving_deploy(host, moment)
    answers_or_says_down(host, result)
    # the deploy waited for HAProxy (it started it, its start limit reset) rather than
    # rolling back, and the public port answers: nothing was left to say down
    assert (rc, result["outcome"]) == (0, "deployed"), result
    assert result["front_down"] is None, result["message"]
    sock = host.sandbox.show(front_of(host).socket_unit, "ActiveState")
    assert sock["ActiveState"] == "active"
    print(f"{moment}: {json.dumps(result['handover'])[:600]}; {result['warnings']}")


def test_haproxy_killed_more_often_than_a_default_start_limit_keeps_its_socket(
    fronted: Host,
) -> None:
    """The front's service has no start limit: a socket-activated service that hits one
    takes its socket unit down (the public port refuses until someone starts both)."""
    host = fronted
    front = front_of(host)
    for _ in range(6):  # systemd's default allows 5 starts in 10 s
        pid = int(host.sandbox.show(front.service, "MainPID")["MainPID"])
        if pid:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while host.sandbox.show(front.service, "MainPID")["MainPID"] in ("0", str(pid)):
            assert time.monotonic() < deadline, host.sandbox.show(front.service, "Result")
            time.sleep(0.05)
    assert host.sandbox.show(front.socket_unit, "ActiveState")["ActiveState"] == "active"
    assert chat_status(host.url, 60)[0] == 200


def test_a_front_that_cannot_start_is_said_down_in_the_first_line_with_what_to_run(
    fronted: Host,
) -> None:
    host = fronted
    front = front_of(host)
    dropins = host.sandbox.unit_dir / f"{front.service}.d"
    dropins.mkdir(exist_ok=True)
    (dropins / "broken.conf").write_text("[Service]\nExecStart=\nExecStart=/bin/false\n")
    host.sandbox.systemctl("daemon-reload")
    rc, result = moving_deploy(host, "restart")
    # the new config stands (a rollback would restart the server and leave the front as
    # down); the first thing it says is that the front is down, and the command
    assert (rc, result["outcome"]) == (0, "deployed"), result
    message = str(result["message"])
    assert message.startswith("the front is down: its public port"), message
    assert f"run `{front.start_command()}`" in message.splitlines()[0]
    assert result["front_down"] in result["warnings"]  # type: ignore[operator]
    # once HAProxy can start, the command it names brings the front back, at the new server
    (dropins / "broken.conf").unlink()
    host.sandbox.systemctl("daemon-reload")
    subprocess.run(front.start_command(), shell=True, check=True, timeout=60)
    assert chat_status(host.url, 60) == (200, "new")


def test_a_front_left_down_is_said_first_whatever_the_outcome(tmp_path: Path) -> None:
    front = Front(tmp_path, "chat.service")
    spec = FrontSpec("127.0.0.1", 8080, "127.0.0.1", 8081)
    down = fronthold.down_line(front, spec, "chat-front.service did not start:\nJob failed")
    result = Result(
        "rolled_back",
        True,
        4,
        3,
        message="generation 4 failed (front: ...); generation 3 is serving again",
        handover={"front_down": down},
    ).say_front_down()
    first = human(result).splitlines()[0]
    assert first.startswith("rolled_back: the front is down: its public port 127.0.0.1:8080"), first
    assert first.endswith("generation 3 is serving again")
    assert "run `systemctl --user reset-failed chat-front.socket chat-front.service && " in first
    assert result.to_dict()["front_down"] == down
    assert result.say_front_down().message.count(down) == 1  # said once, however often asked


def test_a_front_that_answers_changes_no_message() -> None:
    result = Result("deployed", True, 4, 3, message="generation 4 is serving", handover={})
    assert human(result.say_front_down()).splitlines()[0] == "deployed: generation 4 is serving"
    assert result.front_down is None
