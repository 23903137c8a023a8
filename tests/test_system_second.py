"""The second instance in system scope: systemd 252 as PID 1 (scripts/sysbed), as root. One
bed for the module, the unit installed once with ``--front haproxy --second-instance``; the
tests walk it in file order: a deploy is bridged by ``llama-server-b.service`` running as the
unit's own dynamic user (so it reads the slots the unit saved), the rollback in the warm
period is a switch to it, an instance of the template gets one too, and uninstall removes
it."""

from __future__ import annotations

from typing import Any

import pytest
from test_system_front import killed_at_gate, recovered
from test_system_scope import (  # noqa: F401 (the fixtures placed, `system`, tool, wheelhouse)
    PORT,
    System,
    placed_step2,
    system_after_step1,
    tool,
    wheelhouse,
)

SECOND = "llama-server-b.service"
UNIT = "llama-server.service"
#: the name of this module's own bed (the imported ``system`` fixture boots it)
BED = "lls"


@pytest.fixture(scope="module")
def paired(placed: System) -> dict[str, Any]:
    """The production install guide's steps 1 and 2, then install with the front and the
    second instance (step 7)."""
    rc, out = placed.cli_json(
        "install", *placed.flags(), "-c", "4096", "-np", "2", "--front", "haproxy",
        "--second-instance",
    )  # fmt: skip
    assert (rc, out.get("outcome")) == (0, "deployed"), out
    return out


def test_a_deploy_is_bridged_by_the_second_instance_as_the_units_own_user(
    system: System, paired: dict[str, Any]
) -> None:
    code, body = system.bed.chat(PORT)
    assert code == 200 and body["usage"]["completion_tokens"] > 0
    # a turn in a slot, which the bridge carries into the second instance and back
    rc, out = system.cli_json("set", "-t", "2")
    assert (rc, out["outcome"], out["handover"]["mode"]) == (0, "deployed", "switch"), out
    sw = out["handover"]["switch"]
    assert sw["slots"]["restored"], sw  # it read the files the unit saved
    assert system.bed.show(SECOND, "ActiveState")["ActiveState"] == "active"
    assert system.uid_of(system.main_pid(SECOND)) == system.uid_of(system.main_pid(UNIT))
    assert system.bed.chat(PORT)[0] == 200


def test_a_rollback_in_the_warm_period_is_a_switch(system: System, paired: dict[str, Any]) -> None:
    rc, out = system.cli_json("rollback")
    assert (rc, out["outcome"], out["handover"]["mode"]) == (0, "deployed", "switch"), out
    assert out["handover"]["switch"]["started"].startswith("warm"), out["handover"]
    assert system.bed.show(SECOND, "ActiveState")["ActiveState"] == "inactive"
    assert system.bed.chat(PORT)[0] == 200


def test_a_reboot_after_a_deployer_killed_mid_switch_comes_up_on_the_unit_alone(
    system: System, paired: dict[str, Any]
) -> None:
    env = "/etc/llama-launcher/llama-server.env"
    good = system.bed.read(env)
    killed_at_gate(system, "set", "-t", "3")  # the second instance served the old config
    assert system.bed.show(SECOND, "ActiveState")["ActiveState"] == "active"
    system.bed.reboot()
    assert system.wait_serving(PORT) == 200
    recovered(system)
    assert system.bed.read(env) == good
    assert system.bed.show(SECOND, "ActiveState")["ActiveState"] == "inactive"
    assert system.cli_json("status")[1]["front"]["second_instance"]["serving"] is False
    assert system.bed.chat(PORT)[0] == 200


def test_an_instance_of_the_template_gets_a_second_instance_as_the_templates_user(
    system: System, paired: dict[str, Any]
) -> None:
    unit, second = "llama-server@chat.service", "llama-server-chat-b.service"
    flags = [*system.flags(8081), "-c", "2048", "-np", "1"]
    rc, out = system.cli_json(
        "install", "--instance", "chat", *flags, "--front", "haproxy", "--second-instance"
    )
    assert (rc, out.get("outcome")) == (0, "deployed"), out
    assert system.bed.chat(8081)[0] == 200  # a turn in its slot, to carry
    rc, out = system.cli_json("set", "--instance", "chat", "-t", "2")
    assert (rc, out["outcome"], out["handover"]["mode"]) == (0, "deployed", "switch"), out
    assert out["handover"]["switch"]["slots"]["restored"], out["handover"]["switch"]
    assert system.uid_of(system.main_pid(second)) == system.uid_of(system.main_pid(unit))
    rc, out = system.cli_json("rollback", "--instance", "chat")
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    assert system.bed.chat(8081)[0] == 200
    rc, out = system.cli_json("uninstall", "--instance", "chat", "--purge")
    assert rc == 0, out
    assert system.bed.show(second, "LoadState")["LoadState"] == "not-found"


def test_uninstall_purge_removes_the_second_instance(
    system: System, paired: dict[str, Any]
) -> None:
    rc, out = system.cli_json("uninstall", "--purge")
    assert rc == 0, out
    assert "/etc/systemd/system/llama-server-b.service" in out["removed_second_instance"]
    assert system.bed.show(SECOND, "LoadState")["LoadState"] == "not-found"
