"""The front's port (issue 39): behind a front a desired config's ``--port`` is the port
clients use. A whole config that names the front's public port (or none) keeps the server
on its private address (``defaults.on_front``), every preview says so, and the gate judges
the process it started, at that address. Real parts for the deploys: the sandboxed systemd,
llama-server b11434, Debian's HAProxy 2.6."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import Host
from test_front_hold import front_of
from test_handover import installed

from launcher import config
from launcher.deploy import defaults
from launcher.deploy.restart.front import FrontSpec
from launcher.errors import ConfigInvalid

SPEC = FrontSpec("0.0.0.0", 18300, "127.0.0.1", 41000, standby_port=41001)


def given(**fields: Any) -> config.ServerConfig:
    """A config as a person writes it: only ``fields`` named (``model_fields_set``)."""
    return config.ServerConfig.model_validate(
        {"llama_server": "/bin/llama-server", "model": "/m.gguf", **fields}
    )


@pytest.mark.parametrize(
    ("fields", "address", "noted"),
    [
        ({"port": 18300}, ("127.0.0.1", 41000), True),  # the public port: clients use it
        ({"host": "0.0.0.0", "port": 18300}, ("127.0.0.1", 41000), True),
        ({}, ("127.0.0.1", 41000), True),  # no port named: the server stays where it is
        ({"port": 41000}, ("127.0.0.1", 41000), False),  # the private one (set's live config)
        ({"port": 9000}, ("127.0.0.1", 9000), False),  # another: the server moves there
    ],
)
def test_a_config_behind_a_front_names_the_port_clients_use(
    fields: dict[str, Any], address: tuple[str, int], noted: bool
) -> None:
    cfg, notes = defaults.on_front(given(**fields), SPEC)
    assert (cfg.host, cfg.port) == address
    assert bool(notes) is noted
    if noted:
        assert "0.0.0.0:18300" in notes[0] and "private address 127.0.0.1:41000" in notes[0]


def test_without_a_front_the_config_keeps_its_address() -> None:
    assert defaults.on_front(given(), None) == (given(), ())
    assert defaults.on_front(given(port=18300), None)[0].port == 18300


def test_the_second_instances_standby_port_is_refused() -> None:
    with pytest.raises(ConfigInvalid) as e:
        defaults.on_front(given(port=41001), SPEC)
    assert "standby port of the front's second instance" in str(e.value)
    assert "--port 18300" in str(e.value) and "nothing was changed" in str(e.value)


# -- on the real parts -----------------------------------------------------------------------


def whole(host: Host, *flags: str) -> list[str]:
    """A whole desired config naming the port clients use (an Ansible task's)."""
    return ["-m", str(host.model), "--llama-server", host.server, "--port", str(host.port), *flags]


@pytest.fixture
def fronted(host: Host) -> Iterator[Host]:
    installed(host, "-c", "4096", "-np", "2", "--front", "haproxy")
    yield host  # the host fixture removes its units


def test_a_whole_config_with_the_public_port_deploys_and_the_server_stays_private(
    fronted: Host,
) -> None:
    host = fronted
    spec = front_of(host).spec()
    assert spec is not None and spec.public_port == host.port
    private = f"127.0.0.1:{spec.private_port}"
    rc, shown = host.cli_json("render", *whole(host, "-c", "8192", "-np", "4"))
    assert rc == 0 and shown["argv"][shown["argv"].index("--port") + 1] == str(spec.private_port)
    assert f"private address {private}" in shown["notes"][0], shown
    rc, out = host.cli_json("deploy", *whole(host, "-c", "8192", "-np", "4"))
    assert (rc, out["outcome"]) == (0, "deployed"), out.get("failure") or out
    assert out["planned"]["front"] == {"public": f"127.0.0.1:{host.port}", "server": private}
    assert any(f"private address {private}" in w for w in out["warnings"]), out["warnings"]
    env = host.env_file.read_text()
    assert f"--port {spec.private_port}" in env and f"--port {host.port}" not in env
    assert (out["startup"]["n_slots"], out["startup"]["n_ctx_slot"]) == (4, 2048)
    assert host.chat()["usage"]["completion_tokens"] > 0  # through the public port
    # the same whole config again: nothing to do (an Ansible play run twice)
    rc, again = host.cli_json("deploy", *whole(host, "-c", "8192", "-np", "4"))
    assert (rc, again["outcome"]) == (0, "unchanged"), again


def test_a_whole_config_with_the_public_port_is_gated_on_the_process_it_started(
    host: Host,
) -> None:
    """With a second instance, the public port answers from the bridge (the old config)
    while the unit restarts: the gate must judge the unit's new process, at its address."""
    installed(host, "-c", "8192", "-np", "2", "--front", "haproxy", "--second-instance")
    try:
        rc, out = host.cli_json("deploy", *whole(host, "-c", "8192", "-np", "4"))
        assert (rc, out["outcome"]) == (0, "deployed"), out.get("failure") or out
        assert out["handover"]["mode"] == "switch", out["handover"]
        assert (out["startup"]["n_slots"], out["startup"]["n_ctx_slot"]) == (4, 2048)
        spec = front_of(host).spec()
        assert spec is not None and f"--port {spec.private_port}" in host.env_file.read_text()
        assert host.chat()["usage"]["completion_tokens"] > 0
    finally:
        host.remove()


def test_render_without_a_front_keeps_the_port(host: Host) -> None:
    rc, shown = host.cli_json("render", *whole(host))
    assert rc == 0 and shown["argv"][shown["argv"].index("--port") + 1] == str(host.port)
    assert shown["notes"] == []
