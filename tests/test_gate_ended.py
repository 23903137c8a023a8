"""How the gate words a llama-server that ended (launcher.deploy.gate.ended): an OOM kill is
named as one, whether systemd saw it (cgroup v2: Result=oom-kill) or saw only its SIGKILL."""

from __future__ import annotations

from launcher.deploy import gate
from launcher.host.systemd import UnitState


def dead(result: str, status: int) -> UnitState:
    return UnitState("failed", "failed", result, 0, status, 0, None, "x", "loaded")


def test_an_oom_kill_systemd_saw_is_named_as_one() -> None:
    assert "OOM killer ended llama-server" in gate.ended(dead("oom-kill", 9))


def test_a_sigkill_is_said_to_be_the_oom_killers_or_a_kill_9() -> None:
    words = gate.ended(dead("signal", 9))
    assert "SIGKILL" in words and "OOM killer" in words and "kill -9" in words


def test_an_exit_status_is_said_as_it_is() -> None:
    assert gate.ended(dead("exit-code", 1)) == "llama-server exited with status 1 (exit-code)"
