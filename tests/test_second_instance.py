"""The second instance (launcher/deploy/restart/standby.py, issue 28): a fronted unit whose deploys
are bridged by ``NAME-b.service`` on the front's standby port, so nothing is held, and whose
previous config stays warm there for an instant rollback. Real parts: the sandboxed systemd,
llama-server b11434, Debian's HAProxy 2.6; agents stream through the front all the while."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Host
from test_deploy import BAD_TEMPLATE
from test_front_hold import front_of, in_background, with_fault
from test_front_switch import Agents, Answer, stream, until
from test_handover import HISTORY, installed, result_of
from test_watch import take

from launcher.config import memory
from launcher.deploy import store
from launcher.deploy.restart import standby
from launcher.deploy.restart.front import SERVERS
from launcher.server import slotsave
from launcher.watch import bake, revert, verdict


@pytest.fixture
def paired(host: Host) -> Iterator[Host]:
    """A host with a front and a second instance; its units are removed after the test."""
    installed(host, "-c", "8192", "-np", "2", "--front", "haproxy", "--second-instance")
    yield host  # the host fixture removes its units


def second(host: Host) -> str:
    return standby.unit_name(host.unit)


def active(host: Host, unit: str) -> str:
    return host.sandbox.show(unit, "ActiveState")["ActiveState"]


def serving(host: Host) -> dict[str, str]:
    return front_of(host).server_states()


#: A conversation of about 700 tokens that shares no prefix with ``HISTORY``.
CONVERSATION = " ".join(f"a lamp {i} glows" for i in range(40))


def failed(agents: Agents) -> list[Any]:
    return [a for a in agents.answers if not a.ok]


def test_install_writes_a_second_instance_that_is_never_enabled(paired: Host) -> None:
    unit_file = paired.sandbox.unit_dir / second(paired)
    text = unit_file.read_text()
    spec = front_of(paired).spec()
    assert spec is not None and spec.standby_port not in (None, spec.private_port)
    assert f"--port {spec.standby_port}" in text
    assert "[Install]" not in text
    assert paired.sandbox.show(second(paired), "UnitFileState")["UnitFileState"] == "static"
    assert active(paired, second(paired)) == "inactive"


def test_a_deploy_is_bridged_by_the_second_instance_and_holds_nothing(paired: Host) -> None:
    with Agents(paired.url) as agents:
        time.sleep(1)
        rc, out = paired.cli_json("set", "-t", "2")
        time.sleep(1)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    h = out["handover"]
    assert h["mode"] == "switch", h
    assert h["front"]["held"] is False
    assert not failed(agents), failed(agents)[:3]
    assert len(agents.answers) > 5
    # the unit serves the new config; the second instance keeps the old one warm
    assert serving(paired) == {SERVERS["a"]: "UP", SERVERS["b"]: "MAINT"}
    assert active(paired, second(paired)) == "active"
    assert " -t 2 " not in standby.env_path(paired.state_dir).read_text()
    assert " -t 2 " in paired.env_file.read_text()
    assert h["switch"]["warm"]["generation"] == out["previous_generation"]


def test_status_says_the_second_instance_keeps_the_previous_config_warm(paired: Host) -> None:
    rc, out = paired.cli_json("set", "-t", "2")
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    rc, st = paired.cli_json("status")
    b = st["front"]["second_instance"]
    assert (b["unit"], b["active"], b["serving"]) == (second(paired), "active", False), b
    assert b["warm_until"] > time.time()
    assert "keeps the previous config warm" in paired.cli("status").stdout


def test_a_long_answer_on_the_unit_finishes_whole_before_the_unit_restarts(
    paired: Host,
) -> None:
    long: list[Answer] = []
    t = threading.Thread(target=lambda: long.append(stream(paired.url, 1500)), daemon=True)
    t.start()
    time.sleep(1)  # it is generating on the unit
    rc, out = paired.cli_json("set", "-t", "2")
    t.join(120)
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    assert long and long[0].ok and long[0].finish == "length", long
    assert not out["handover"]["drain"].get("cut"), out["handover"]["drain"]


@pytest.mark.parametrize("phase", ["restore", "released"])
def test_a_signal_during_the_switch_back_rolls_back_behind_the_second_instance(
    paired: Host, phase: str
) -> None:
    with Agents(paired.url) as agents:
        time.sleep(0.5)
        p = in_background(paired, f"{phase}:pause", "set", "-t", "2")
        store_ = store.Store(paired.state_dir)
        deadline = time.monotonic() + 120
        while (store_.txn() or {}).get("phase") != phase:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        rc, out = result_of(p)
        time.sleep(0.5)
    assert (rc, out["outcome"]) == (3, "rolled_back"), out
    assert "served meanwhile" in out["handover"]["switch"]["rollback"], out["handover"]
    assert not failed(agents), failed(agents)[:3]
    assert " -t 2 " not in paired.env_file.read_text()
    assert serving(paired) == {SERVERS["a"]: "UP", SERVERS["b"]: "MAINT"}
    assert active(paired, second(paired)) == "inactive"


def test_a_held_restart_stops_a_warm_second_instance_first(paired: Host) -> None:
    rc, out = paired.cli_json("set", "-t", "2")
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    rc, out = paired.cli_json("set", "-t", "1", env={"LLAMA_LAUNCHER_HANDOVER": "hold"})
    assert (rc, out["handover"]["mode"]) == (0, "hold"), out
    assert "stopped before the restart" in out["handover"]["second_instance"]
    assert active(paired, second(paired)) == "inactive"
    assert serving(paired) == {SERVERS["a"]: "UP", SERVERS["b"]: "MAINT"}


def test_a_rollback_in_the_warm_period_is_a_switch_to_the_warm_instance(paired: Host) -> None:
    rc, out = paired.cli_json("set", "-t", "2")
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    pid = paired.state()["MainPID"]
    with Agents(paired.url) as agents:
        time.sleep(1)
        rc, back = paired.cli_json("rollback")
        time.sleep(1)
    assert (rc, back["outcome"]) == (0, "deployed"), back
    sw = back["handover"]["switch"]
    assert sw["started"].startswith("warm"), sw
    # the front sent the agents to the warm instance before the unit's restart began: the
    # deployer's clock and systemd's, both CLOCK_REALTIME
    assert paired.state()["MainPID"] != pid  # restarted
    assert sw["switched_at"] <= stopping_began(paired), sw
    assert not failed(agents), failed(agents)[:3]
    assert " -t 2 " not in paired.env_file.read_text()
    assert active(paired, second(paired)) == "inactive"  # a rollback keeps nothing warm
    assert serving(paired)[SERVERS["a"]] == "UP"


def stopping_began(host: Host) -> float:
    """When the unit's last stop began (``ActiveExitTimestamp``), in seconds since the epoch."""
    out = host.sandbox.systemctl(
        "show", "--timestamp=us+utc", "-p", "ActiveExitTimestamp", "--value", host.unit
    ).stdout.strip()  # e.g. "Fri 2026-12-04 23:51:08.080012 UTC"; the day's name left out
    at = datetime.datetime.strptime(out.split(" ", 1)[1], "%Y-%m-%d %H:%M:%S.%f UTC")
    return at.replace(tzinfo=datetime.UTC).timestamp()


def no_timers(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``systemd-run`` refuses every transient unit, as a manager
    that denies them would (the fault passed in: a script on PATH before the real one)."""
    shim = tmp_path / "no-systemd-run"
    shim.mkdir()
    fake = shim / "systemd-run"
    fake.write_text(
        "#!/bin/sh\necho 'Failed to start transaction: Access denied (the test refuses it)' >&2\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    return {"PATH": f"{shim}:{os.environ['PATH']}"}


def test_a_warm_rollback_whose_timer_cannot_be_set_switches_and_warns(
    paired: Host, tmp_path: Path
) -> None:
    rc, out = paired.cli_json("set", "-t", "2")
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    with Agents(paired.url) as agents:
        time.sleep(1)
        rc, back = paired.cli_json("rollback", env=no_timers(tmp_path))
        time.sleep(1)
    assert (rc, back["outcome"]) == (0, "deployed"), back
    assert back["handover"]["switch"]["started"].startswith("warm"), back["handover"]
    warned = [w for w in back["warnings"] if "no timer stops it" in w]
    assert warned and "Access denied" in warned[0] and "stop-warm" in warned[0], back["warnings"]
    assert not failed(agents), failed(agents)[:3]
    assert " -t 2 " not in paired.env_file.read_text()
    assert active(paired, second(paired)) == "inactive"


def test_a_deploy_whose_bridge_would_have_no_timer_holds_instead(
    paired: Host, tmp_path: Path
) -> None:
    rc, out = paired.cli_json("set", "-t", "2", env=no_timers(tmp_path))
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert out["handover"]["switch"]["failed"].startswith("no timer stops it"), out["handover"]
    assert any("holds the front instead" in w for w in out["warnings"]), out["warnings"]
    assert active(paired, second(paired)) == "inactive"
    assert serving(paired) == {SERVERS["a"]: "UP", SERVERS["b"]: "MAINT"}
    assert " -t 2 " in paired.env_file.read_text()


def test_a_rollback_across_a_kv_layout_change_saves_no_slot_before_it_switches(
    paired: Host,
) -> None:
    rc, out = paired.cli_json("set", "-c", "4096")  # another pool: another KV layout
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    rc, back = paired.cli_json("rollback")
    carried = back["handover"]["switch"]["slots"]
    assert (rc, back["handover"]["mode"]) == (0, "switch"), back
    assert carried["saved"] == [] and "KV layout changed" in carried["note"], carried


def completion_in(url: str, prompt: str, slot: int = -1, n_predict: int = 1) -> dict[str, Any]:
    """A ``/completion`` (in ``slot``, or where the server puts it); its answer."""
    body = {"prompt": prompt, "n_predict": n_predict, "cache_prompt": True, "id_slot": slot}
    r = httpx.post(url + "/completion", json={**body, "ignore_eos": True}, timeout=120)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def slot_busy(url: str, slot: int) -> bool:
    return bool(httpx.get(url + "/slots", timeout=10).json()[slot]["is_processing"])


def test_a_conversation_begun_after_its_slot_was_carried_keeps_its_cache(
    paired: Host,
) -> None:
    """The carry into the second instance saves slot 0, then waits for slot 1 (a long
    answer); meanwhile a new conversation's first turn runs in slot 0 on the unit. Its next
    turn, after the deploy (switched there and back), is served from its cache."""
    completion_in(paired.url, HISTORY, slot=0)  # an older conversation in slot 0
    go = paired.root / "go"
    deploy = in_background(paired, f"bridge:wait:{go}", "set", "-t", "2")
    try:
        sb = standby.Standby.of(paired.state_dir, paired.unit, "user", front_of(paired).spec())
        assert sb is not None
        until(sb.healthy, 120)  # started and gated: the deployer waits at "bridge"
        long = threading.Thread(
            target=completion_in, args=(paired.url, "Tell a long story.", 1, 3000), daemon=True
        )
        long.start()
        until(lambda: slot_busy(paired.url, 1))
        go.touch()
        until((paired.state_dir / "slots" / slotsave.FILENAME.format(slot=0)).exists)
        first = completion_in(paired.url, CONVERSATION, slot=0)  # on the unit, after the save
        assert slot_busy(paired.url, 1), "the long answer ended before the new conversation"
    finally:
        go.touch()
    rc, out = result_of(deploy)
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    again = completion_in(paired.url, CONVERSATION + " and one more turn")
    assert again["timings"]["cache_n"] >= first["timings"]["prompt_n"] - 1, again["timings"]
    topped = out["handover"]["switch"]["slots"]["after_switch"]  # right after the switch
    assert [r["slot"] for r in topped["restored"]] == [0], topped


def test_a_new_config_that_fails_its_gate_never_stops_the_old_one_serving(
    paired: Host, tmp_path: Path
) -> None:
    template = tmp_path / "bad.jinja"
    template.write_text(BAD_TEMPLATE)
    with Agents(paired.url) as agents:
        time.sleep(1)
        rc, out = paired.cli_json("set", "--chat-template-file", str(template))
        time.sleep(1)
    assert (rc, out["outcome"]) == (3, "rolled_back"), out
    assert out["handover"]["mode"] == "switch"
    assert not failed(agents), failed(agents)[:3]
    assert active(paired, second(paired)) == "inactive"
    assert serving(paired) == {SERVERS["a"]: "UP", SERVERS["b"]: "MAINT"}


@dataclass(frozen=True)
class Limit:
    """A memory limit the kernel's OOM killer enforces on the unit's process (the unit's, not
    its second instance's): a fault passed in, one of two mechanisms, whichever the host has."""

    hierarchy: str  # "cgroup v2" or "cgroup v1"
    #: how many processes under the limit the kernel's OOM killer has ended so far
    kills: Callable[[], int]
    #: what the gate's failure says of such a kill here (``launcher.deploy.gate.ended``)
    says: tuple[str, ...]


@contextmanager
def memory_limit(host: Host, limit: int) -> Iterator[Limit]:
    """The unit restarted under a limit of ``limit`` bytes, by cgroup v2 where the sandbox's
    manager has the memory controller (``MemoryMax=``), else by a cgroup-v1 memory cgroup of
    the test's own; the test is skipped, saying why, where neither hierarchy can be had."""
    v2, v1 = _v2_lacks(host), _v1_lacks()
    if v2 is None:
        mechanism = _v2_limit(host, limit)
    elif v1 is None:
        mechanism = _v1_limit(host, limit)
    else:
        pytest.skip(f"no memory controller to limit the unit by: {v2}; {v1}")
    with mechanism as lim:
        yield lim


def _unified() -> Path:
    """Where the cgroup-v2 hierarchy is mounted: alone, or beside the v1 ones (hybrid)."""
    root = Path("/sys/fs/cgroup")
    return root if (root / "cgroup.controllers").exists() else root / "unified"


def _v2_lacks(host: Host) -> str | None:
    """Why ``MemoryMax=`` cannot limit the unit here (None: it can): systemd enforces it only
    with the memory controller in its manager's cgroup on the v2 hierarchy."""
    group = host.sandbox.systemctl("show", "-p", "ControlGroup", "--value").stdout.strip()
    controllers = _unified() / group.lstrip("/") / "cgroup.controllers"
    try:
        found = controllers.read_text().split()
    except OSError as e:
        return f"cgroup v2: no {controllers} ({e.strerror})"
    if "memory" not in found:  # a hybrid host's memory controller is v1's
        return f"cgroup v2: the manager's cgroup has no memory controller ({controllers})"
    return None


def _v1_lacks() -> str | None:
    if not any(":memory:" in x for x in Path("/proc/self/cgroup").read_text().splitlines()):
        return "cgroup v1: no memory hierarchy (/proc/self/cgroup)"
    return None


@contextmanager
def _restarted_with(host: Host, service: str) -> Iterator[None]:
    """The unit restarted with a drop-in of ``[Service]`` lines ``service``, serving; the
    drop-in gone after. A restart of the unit's own waits 30 s, so the gate reads how the
    killed process ended, not a process systemd started again."""
    dropin = host.sandbox.unit_dir / f"{host.unit}.d" / "memory-limit.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(f"[Service]\nRestartSec=30\n{service}")
    try:
        host.sandbox.systemctl("daemon-reload")
        host.sandbox.systemctl("reset-failed", host.unit, check=False)
        host.sandbox.systemctl("restart", host.unit)
        until(lambda: answers(host))  # serving again, now inside the limit
        yield
    finally:
        dropin.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            dropin.parent.rmdir()  # when the test made it
        host.sandbox.systemctl("daemon-reload", check=False)


@contextmanager
def _v2_limit(host: Host, limit: int) -> Iterator[Limit]:
    """``MemoryMax=`` on the unit. The unit's cgroup is made again at each start, so the
    kills are counted in its parent's ``memory.events`` (hierarchical on v2): this sandbox's
    units restart one at a time, and only the unit's runs under a limit."""
    with _restarted_with(host, f"MemoryMax={limit}\nMemorySwapMax=0\n"):
        group = host.sandbox.show(host.unit, "ControlGroup")["ControlGroup"]
        cgroup = _unified() / group.lstrip("/")
        applied = (cgroup / "memory.max").read_text().strip()
        assert applied == str(limit), f"the manager has the memory controller; {cgroup}: {applied}"
        events = cgroup.parent / "memory.events"
        before = _oom_kill(events)
        yield Limit("cgroup v2", lambda: _oom_kill(events) - before, ("Result=oom-kill",))


def _oom_kill(events: Path) -> int:
    fields = dict(x.split() for x in events.read_text().splitlines())
    return int(fields["oom_kill"])


@contextmanager
def _v1_limit(host: Host, limit: int) -> Iterator[Limit]:
    """The unit's process in a cgroup-v1 memory cgroup of its own that allows ``limit``
    bytes: a hybrid host's user manager enforces no ``MemoryMax=`` (the v1 memory controller
    is not delegated to it), and a process moved out of its unit's cgroup stays the unit's
    only there (on cgroup v2 alone, the unit loses it)."""
    line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in x)
    parent = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")
    cgroup = parent / f"oom-{os.getpid()}-{host.unit}"
    unit_file = host.sandbox.unit_dir / host.unit
    exec_start = next(x for x in unit_file.read_text().splitlines() if x.startswith("ExecStart="))
    command = exec_start.removeprefix("ExecStart=")
    # the path as systemd reads it: `\`, `%` and `$` written out
    where = str(cgroup).replace("\\", "\\\\").replace("%", "%%").replace("$", "$$")
    cgroup.mkdir()
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(limit))
        # `$$` is a `$` to systemd: the shell joins the cgroup, then execs
        service = (
            f"ExecStart=\nExecStart=/bin/sh -c "
            f"'echo $$$$ > {where}/cgroup.procs && exec \"$$@\"' sh {command}\n"
        )
        with _restarted_with(host, service):
            yield Limit("cgroup v1", lambda: oom_kills(cgroup), ("killed by SIGKILL", "OOM"))
    finally:
        _remove(cgroup, parent)


def _remove(cgroup: Path, parent: Path) -> None:
    """``cgroup`` gone, its processes moved to ``parent`` (one that starts meanwhile too)."""
    for _ in range(50):
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                (parent / "cgroup.procs").write_text(pid)
        try:
            cgroup.rmdir()
            return
        except OSError:  # EBUSY: a process came in
            time.sleep(0.1)
    cgroup.rmdir()


def answers(host: Host) -> bool:
    try:
        return host.chat()["usage"]["completion_tokens"] > 0
    except httpx.HTTPError:
        return False


def oom_kills(cgroup: Path) -> int:
    """How many processes of the v1 memory cgroup ``cgroup`` the kernel's OOM killer ended."""
    fields = dict(x.split() for x in (cgroup / "memory.oom_control").read_text().splitlines())
    return int(fields["oom_kill"])


def test_a_new_config_the_kernel_kills_for_its_memory_never_stops_the_old_one_serving(
    paired: Host,
) -> None:
    # the guard finds room for a pool of 1 GiB on this host; the unit may use 300 MiB
    with memory_limit(paired, 300 << 20) as limit:
        with Agents(paired.url) as agents:
            time.sleep(1)
            rc, out = paired.cli_json("set", "-c", str(1 << 21))
            time.sleep(1)
        killed = limit.kills()
        assert paired.state()["ActiveState"] == "active"  # the old config, within the limit
    assert (rc, out["outcome"], out["handover"]["mode"]) == (3, "rolled_back", "switch"), out
    assert killed == 1, limit.hierarchy
    message = out["failure"]["message"]
    assert all(w in message for w in limit.says), (limit.hierarchy, message)
    assert not failed(agents), failed(agents)[:3]
    assert serving(paired) == {SERVERS["a"]: "UP", SERVERS["b"]: "MAINT"}
    assert "-c 8192" in paired.env_file.read_text()


def test_the_warm_period_ends_with_the_second_instance_stopped(paired: Host) -> None:
    rc, out = paired.cli_json("set", "-t", "2", env={"LLAMA_LAUNCHER_KEEP_WARM": "2"})
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    deadline = time.monotonic() + 60
    while active(paired, second(paired)) != "inactive":
        assert time.monotonic() < deadline, "the warm period did not end"
        time.sleep(0.5)
    assert not standby.Standby(paired.unit, "user", paired.state_dir, "", 0).warm_path.exists()
    # outside the warm period a rollback holds, as a unit without a second instance does
    rc, back = paired.cli_json("rollback")
    assert rc == 0 and back["handover"]["mode"] == "hold", back
    assert "does not keep generation" in back["handover"]["hold_because"]


def test_handover_hold_never_starts_the_second_instance(paired: Host) -> None:
    rc, out = paired.cli_json("set", "-t", "2", env={"LLAMA_LAUNCHER_HANDOVER": "hold"})
    assert (rc, out["handover"]["mode"]) == (0, "hold"), out
    assert "handover is hold" in out["handover"]["hold_because"]
    assert out["handover"]["front"]["held"] is True
    assert active(paired, second(paired)) == "inactive"


def past_memory() -> str:
    """A prompt cache (``-cram`` MiB) twice the host's memory: llama-server fills it only as
    prompts come, but the memory estimate counts all of it, so a second instance with it can
    never fit beside the running one. The guard, which counts what the restart frees, is told
    to let it through (``--force-memory``): what is tested is the handover's own choice."""
    return str(2 * memory.mem_total() // memory.MiB)


def test_auto_holds_a_restart_whose_new_config_would_not_fit_beside_the_running_one(
    paired: Host,
) -> None:
    with Agents(paired.url) as agents:
        time.sleep(1)
        rc, out = paired.cli_json("set", "-cram", past_memory(), "--force-memory")
        time.sleep(1)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    beside, h = out["memory"]["beside"], out["handover"]
    assert beside["fits"] is False, beside
    assert h["mode"] == "hold", h
    assert (
        h["hold_because"] == f"{second(paired)}: the second instance may not fit: {beside['why']}"
    )
    assert h["front"]["held"] is True
    assert not failed(agents), failed(agents)[:3]  # held, then served by the new config
    assert active(paired, second(paired)) == "inactive"  # never started
    assert f"-cram {past_memory()}" in paired.env_file.read_text()


def test_handover_switch_bridges_a_restart_that_auto_would_hold(paired: Host) -> None:
    env = {"LLAMA_LAUNCHER_HANDOVER": "switch"}
    with Agents(paired.url) as agents:
        time.sleep(1)
        rc, out = paired.cli_json("set", "-cram", past_memory(), "--force-memory", env=env)
        time.sleep(1)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    h = out["handover"]
    assert out["memory"]["beside"]["fits"] is False, out["memory"]
    assert (h["mode"], h["switch"]["why"]) == ("switch", "handover = switch"), h
    assert "hold_because" not in h
    assert h["front"]["held"] is False
    assert not failed(agents), failed(agents)[:3]
    # the unit serves the new config; the second instance keeps the old one warm
    assert serving(paired) == {SERVERS["a"]: "UP", SERVERS["b"]: "MAINT"}
    assert active(paired, second(paired)) == "active"
    assert "-cram" not in standby.env_path(paired.state_dir).read_text()
    assert f"-cram {past_memory()}" in paired.env_file.read_text()


#: The phases a bridged deploy records, in order (``bridge``: the second instance serves the
#: old config, gated; ``bridged``: the front sends requests to it).
PHASES = ["bridge", "bridged", "swap", "swapped", "restart", "gate", "gated", "restore", "released"]


@pytest.mark.parametrize("phase", PHASES)
def test_a_deployer_killed_at_any_phase_of_a_switch_cuts_no_request(
    paired: Host, phase: str
) -> None:
    with Agents(paired.url) as agents:
        time.sleep(0.5)
        p = with_fault(paired, f"{phase}:kill", "set", "-t", "2")
        assert p.returncode == -9, p.stderr
        time.sleep(1)
        rc, out = paired.cli_json("recover")
        time.sleep(0.5)
    assert rc == 0 and out["recovered"]["interrupted_phase"] == phase, out
    assert not failed(agents), failed(agents)[:3]
    assert " -t 2 " not in paired.env_file.read_text()
    assert serving(paired) == {SERVERS["a"]: "UP", SERVERS["b"]: "MAINT"}
    assert active(paired, second(paired)) == "inactive"


def test_the_timer_of_a_killed_switch_recovers_it_and_stops_the_second_instance(
    paired: Host,
) -> None:
    p = with_fault(paired, "gate:kill", "set", "-t", "2")
    assert p.returncode == -9, p.stderr
    timer = second(paired).removesuffix(".service") + "-stop.timer"
    assert active(paired, timer) == "active"  # it would fire after two deploys' budgets
    rc, out = paired.cli_json("stop-warm")  # what the timer runs
    assert rc == 0 and out["recovered"]["interrupted_phase"] == "gate", out
    assert "not held" in out["recovered"]["front_hold"]  # the second instance served
    assert out["stopped"] is True
    assert " -t 2 " not in paired.env_file.read_text()
    assert active(paired, second(paired)) == "inactive"
    assert paired.chat()["usage"]["completion_tokens"] > 0


def test_a_restored_config_that_fails_leaves_the_second_instance_serving_it(
    paired: Host,
) -> None:
    p = with_fault(paired, "gate:kill", "set", "-t", "2")
    assert p.returncode == -9, p.stderr
    aside = paired.model.with_name(paired.model.name + ".aside")
    paired.model.rename(aside)  # the unit cannot start the restored config: no model file
    try:
        with Agents(paired.url) as agents:
            time.sleep(0.5)
            rc, out = paired.cli_json("recover")
            time.sleep(0.5)
    finally:
        aside.rename(paired.model)
    assert rc == 4, out
    assert not failed(agents), failed(agents)[:3]  # the second instance served them
    assert serving(paired)[SERVERS["b"]] == "UP"
    assert front_of(paired).spec().serving == "b"  # type: ignore[union-attr]
    # the next deploy is bridged by it as it stands, and ends with the unit serving
    with Agents(paired.url) as agents:
        rc, out = paired.cli_json("set", "-t", "2")
        time.sleep(0.5)
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    assert out["handover"]["switch"]["started"] == "already serving"
    assert not failed(agents), failed(agents)[:3]
    assert serving(paired) == {SERVERS["a"]: "UP", SERVERS["b"]: "MAINT"}


def test_a_warm_instance_that_crashed_is_started_again_before_a_rollback_switches(
    paired: Host,
) -> None:
    rc, out = paired.cli_json("set", "-t", "2")
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    pid = int(paired.sandbox.show(second(paired), "MainPID")["MainPID"])
    os.kill(pid, signal.SIGKILL)
    with Agents(paired.url) as agents:
        rc, back = paired.cli_json("rollback")
        time.sleep(0.5)
    assert (rc, back["outcome"], back["handover"]["mode"]) == (0, "deployed", "switch"), back
    assert not failed(agents), failed(agents)[:3]
    assert " -t 2 " not in paired.env_file.read_text()


def test_a_bakes_revert_is_a_switch_to_the_instance_kept_warm(paired: Host) -> None:
    env = {"LLAMA_LAUNCHER_BAKE_INTERVAL": "2", "LLAMA_LAUNCHER_BAKE_WARMUP": "0"}
    rc, out = paired.cli_json("set", "-t", "2", "--bake", "10m", env=env)
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    assert out["handover"]["switch"]["warm"]["warm_until"] > time.time() + 500  # the bake's
    os.kill(int(paired.state()["MainPID"]), signal.SIGKILL)  # a hard failure: a restart
    baked = store.Store(paired.state_dir).get(out["generation"])
    deadline = time.monotonic() + 120
    while (record := bake.load(baked.path)) is None or record.state == "baking":
        assert time.monotonic() < deadline, "the bake did not end"
        take(paired, env=env)
        time.sleep(1)
    assert record.state == "reverted", record
    assert (record.revert or {})["handover"]["mode"] == "switch", record.revert["handover"]
    assert " -t 2 " not in paired.env_file.read_text()
    assert active(paired, second(paired)) == "inactive"


def test_an_early_hold_ends_as_soon_as_a_bakes_revert_switches_to_the_warm_instance(
    paired: Host,
) -> None:
    rc, out = paired.cli_json("set", "-t", "2", "--bake", "10m")
    assert (rc, out["handover"]["mode"]) == (0, "switch"), out
    b = bake.load(store.Store(paired.state_dir).get(out["generation"]).path)
    assert b is not None
    early = revert.EarlyHold.of(b)
    assert early is not None
    why = verdict.Verdict("revert", "context_exceeded", "the test's", hard=True)
    with early(b) as rev:
        assert rev is not None
        done = rev(b, why)
        still = early.front.holding()
    switch = done["handover"]["switch"]
    assert (done["outcome"], done["handover"]["mode"]) == ("reverted", "switch"), done
    assert still is None  # ended by the switch, not by the early hold's own end
    assert "early_hold_ended_at" in switch, done["handover"]
    assert switch["early_hold_ended_at"] <= switch["switched_at"], switch  # before the drain
    assert " -t 2 " not in paired.env_file.read_text()


def test_uninstall_removes_the_second_instance(host: Host) -> None:
    installed(host, "-c", "4096", "-np", "2", "--front", "haproxy", "--second-instance")
    rc, out = host.cli_json("set", "-t", "2")
    assert rc == 0, out
    host.cli("uninstall")
    assert not (host.sandbox.unit_dir / second(host)).exists()
    assert not standby.env_path(host.state_dir).exists()
    assert active(host, second(host)) == "inactive"
