"""Who listens on a TCP address (launcher/host/ports.py), the validation step that refuses a
port another process holds (``validate.check_port``) and the gate's test that a /health
answer is its own process's (``gate._serves``): on real sockets this test binds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import realserver
from conftest import Sandbox

from launcher import config
from launcher.config import validate
from launcher.deploy import gate
from launcher.errors import ValidationFailed
from launcher.host import ports
from launcher.host.systemd import UnitState

HEAD = "  sl local_address rem_address st tx_queue rx_queue tr tm->when retrnsmt uid timeout inode"


def row(local: str, st: str, inode: int, remote: str = "00000000:0000") -> str:
    """A line of /proc/net/tcp{,6} as the kernel prints it (little-endian words)."""
    return f"   0: {local} {remote} {st} 00000000:00000000 00:00000000 00000000 1000 0 {inode} 1 0"


V6_ANY = "0" * 32
TCP = "\n".join(
    [
        HEAD,
        row("0100007F:1F90", "0A", 4242),  # 127.0.0.1:8080, listening
        row("00000000:4778", "0A", 4243),  # 0.0.0.0:18296
        row("0100007F:1F90", "01", 4244, "0100007F:D431"),  # a connection to it
    ]
)
TCP6 = "\n".join(
    [
        HEAD,
        row("0" * 24 + "01000000:1F91", "0A", 4245, V6_ANY + ":0000"),  # [::1]:8081
        row(V6_ANY + ":4779", "0A", 4246, V6_ANY + ":0000"),  # [::]:18297
    ]
)


@pytest.mark.skipif(sys.byteorder != "little", reason="the tables are a little-endian kernel's")
@pytest.mark.parametrize(
    ("text", "listening"),
    [
        (TCP, [("127.0.0.1", 8080, 4242), ("0.0.0.0", 18296, 4243)]),  # not the connection
        (TCP6, [("::1", 8081, 4245), ("::", 18297, 4246)]),
    ],
)
def test_the_tables_give_the_listening_sockets(text: str, listening: list[tuple]) -> None:  # type: ignore[type-arg]
    assert [(s.host, s.port, s.inode) for s in ports.parse_table(text)] == listening


@pytest.mark.parametrize(
    ("held", "wanted", "clash"),
    [
        ("127.0.0.1", "127.0.0.1", True),
        ("0.0.0.0", "127.0.0.1", True),
        ("127.0.0.1", "0.0.0.0", True),
        ("127.0.0.1", "127.0.0.2", False),
        ("::", "127.0.0.1", True),  # a dual-stack wildcard takes IPv4 too
        ("::1", "127.0.0.1", False),
        ("::ffff:127.0.0.1", "127.0.0.1", True),
        ("127.0.0.1", "::", True),
        ("127.0.0.1", "::1", False),
        ("127.0.0.1", "localhost", False),  # a name: not judged
    ],
)
def test_which_listener_keeps_a_bind_from_succeeding(held: str, wanted: str, clash: bool) -> None:
    assert ports.clashes(held, wanted) is clash


@contextmanager
def listening(host: str = "127.0.0.1") -> Iterator[socket.socket]:
    with socket.socket() as s:
        s.bind((host, 0))
        s.listen()
        yield s


def test_a_socket_this_process_listens_on_is_found_with_its_holder() -> None:
    with listening() as s:
        port = s.getsockname()[1]
        found = ports.on("127.0.0.1", port)
        assert [(f.host, f.port) for f in found] == [("127.0.0.1", port)]
        assert found[0].inode in (ports.socket_inodes(os.getpid()) or set())
        held = ports.holders({found[0].inode})
    comm = Path("/proc/self/comm").read_text().strip()
    assert [(h.pid, h.comm) for h in held] == [(os.getpid(), comm)]
    assert ports.on("127.0.0.1", port) == []  # closed: nothing listens


def test_the_unit_of_a_process_is_the_innermost_service_of_its_cgroup(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text(
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/llama-server-front.service\n"
    )
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "cgroup").write_text("12:cpu:/x\n1:name=systemd:/system.slice/cron.service\n")
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "cgroup").write_text("0::/\n")
    assert ports.unit_of(7, tmp_path) == "llama-server-front.service"
    assert ports.unit_of(8, tmp_path) == "cron.service"
    assert ports.unit_of(9, tmp_path) is None
    assert ports.unit_of(10, tmp_path) is None  # gone


def cfg(port: int, host: str = "127.0.0.1") -> config.ServerConfig:
    return config.ServerConfig(
        llama_server=Path("/bin/llama-server"), model=Path("/m.gguf"), host=host, port=port
    )


def state(main_pid: int) -> UnitState:
    return UnitState("active", "running", "success", 0, 0, main_pid, None, "x", "loaded")


def test_a_port_another_process_holds_is_refused_naming_it() -> None:
    with listening() as s:
        port = s.getsockname()[1]
        with pytest.raises(ValidationFailed) as e:
            validate.check_port(cfg(port, "0.0.0.0"), state(1))
    assert e.value.step == "port"
    message = str(e.value)
    assert f"the port {port} on 0.0.0.0 is held by" in message
    assert f"pid {os.getpid()}" in message and f"127.0.0.1:{port}" in message
    assert "another --port" in message and "nothing was changed" in message


def test_the_serving_servers_own_port_is_no_refusal() -> None:
    with listening() as s:
        port = s.getsockname()[1]
        validate.check_port(cfg(port), state(os.getpid()))  # its MainPID
        unit = ports.unit_of(os.getpid())
        if unit is not None:  # a process in a unit: that unit's own socket
            validate.check_port(cfg(port), None, unit)
        validate.check_port(cfg(port, "127.0.0.2"), state(1))  # another address


def test_the_gate_takes_an_answer_only_from_the_process_listening_there() -> None:
    with (
        listening() as s,
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as other,
    ):
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        try:
            assert gate._serves(os.getpid(), url) is True
            assert gate._serves(other.pid, url) is False  # alive, but not the listener
        finally:
            other.kill()
    assert gate._serves(os.getpid(), "http://localhost:1") is True  # a name: not judged


@pytest.fixture
def unit_listening(sandbox: Sandbox) -> Iterator[tuple[str, int]]:
    """A transient unit of the sandboxed manager whose process listens on a port."""
    unit, port = f"ll-listener-{uuid.uuid4().hex[:6]}.service", realserver.free_port()
    code = (
        f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); "
        "s.listen(); time.sleep(120)"
    )
    run = ["systemd-run", "--user", "--quiet", "--collect", f"--unit={unit}"]
    subprocess.run([*run, sys.executable, "-c", code], check=True, timeout=60)
    try:
        deadline = time.monotonic() + 30
        while not ports.on("127.0.0.1", port):
            assert time.monotonic() < deadline, f"{unit} never listened on {port}"
            time.sleep(0.05)
        yield unit, port
    finally:
        sandbox.systemctl("stop", unit, check=False)


def test_a_process_is_named_with_its_unit(unit_listening: tuple[str, int]) -> None:
    unit, port = unit_listening
    held = ports.holders({s.inode for s in ports.on("127.0.0.1", port)})
    assert [h.unit for h in held] == [unit]
    validate.check_port(cfg(port), None, unit)  # the unit's own socket
    with pytest.raises(ValidationFailed) as e:
        validate.check_port(cfg(port), None, "llama-server.service")
    assert f"pid {held[0].pid}, {unit})" in str(e.value) and f"stop {unit}" in str(e.value)


def test_the_gate_takes_an_answer_from_another_process_of_the_unit(
    unit_listening: tuple[str, int],
) -> None:
    """A wrapper script as the unit's main process: its child llama-server listens."""
    unit, port = unit_listening
    url = f"http://127.0.0.1:{port}"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as wrapper:
        try:
            assert gate._serves(wrapper.pid, url, unit) is True
            assert gate._serves(wrapper.pid, url, "another.service") is False
        finally:
            wrapper.kill()
