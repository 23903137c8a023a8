"""The front held to the standard of the transaction (launcher/deploy/restart/front.py, handover.py,
fronthold.py, release.py): a hold ends by itself, every restart of a fronted unit holds,
HAProxy killed during a hold is noticed, the front's config is part of the transaction, what a
killed deploy leaves is swept. Real parts: the sandboxed systemd, llama-server b11434, Debian's
HAProxy 2.6."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import realserver
from conftest import Host, Sandbox
from test_handover import HISTORY, completion, front_stat, installed, result_of

from launcher.deploy import store
from launcher.deploy.restart import frontunits
from launcher.deploy.restart.front import Front, FrontError, FrontSpec, Hold
from launcher.host import units

FAULTS = str(Path(__file__).with_name("faults.py"))

#: The phases a front deploy records (``Deployer._phase`` and the handover's), in order.
PHASES = ["stored", "swap", "swapped", "restart", "gate", "gated", "restore", "released"]
#: The phases during which the front is held (the hold comes after ``stored`` is recorded).
HELD = PHASES[1:-1]


@pytest.fixture
def fronted(host: Host) -> Iterator[Host]:
    """A host with a front, its slots holding a conversation (a deploy saves and restores
    them); its front units are removed after the test."""
    installed(host, "-c", "8192", "-np", "2", "--front", "haproxy")
    assert completion(host.url, HISTORY)["timings"]["prompt_n"] > 1000
    yield host  # the host fixture removes its units


def with_fault(host: Host, fault: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, FAULTS, fault, *args, "--json"],
        capture_output=True,
        text=True,
        env=host.env,
        timeout=240,
    )


def in_background(host: Host, fault: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, FAULTS, fault, *args, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=host.env,
    )


def front_of(host: Host) -> Front:
    return Front(host.state_dir, host.unit, "user")


def chat_status(url: str, timeout: float) -> tuple[int, str]:
    """A chat completion's status (0 and the error when it got no answer) and model."""
    try:
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=timeout,
        )
    except httpx.HTTPError as e:
        return 0, f"{type(e).__name__}: {e}"
    return r.status_code, str(r.json().get("model", "")) if r.status_code == 200 else r.text


def server_port(host: Host) -> int:
    """The port the running HAProxy sends requests to (``show servers state``)."""
    lines = front_of(host).command("show servers state llama").splitlines()
    head = lines[1].removeprefix("# ").split()
    return int(dict(zip(head, lines[2].split(), strict=False))["srv_port"])


def settled(host: Host, timeout: float = 120) -> None:
    """Wait until no hold is recorded and the release watcher has ended."""
    deadline = time.monotonic() + timeout
    watcher = front_of(host).release_service
    while True:
        active = host.sandbox.show(watcher, "ActiveState")["ActiveState"]
        if not front_of(host).hold_path.exists() and active in ("inactive", "failed"):
            return
        assert time.monotonic() < deadline, f"the hold did not end: {watcher} {active}"
        time.sleep(0.1)


def slot_files(host: Host) -> list[Path]:
    return sorted((host.state_dir / "slots").glob("*.bin"))


class Clients(threading.Thread):
    """Requests sent one after another through the front until stopped: what came back."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.seen = url, threading.Event(), []  # type: list[int]

    def run(self) -> None:
        while not self.stop.is_set():
            self.seen.append(chat_status(self.url, 120)[0])

    def done(self) -> list[int]:
        self.stop.set()
        self.join(150)
        return self.seen


# -- 1. a hold ends by itself ----------------------------------------------------------------


@pytest.mark.parametrize("phase", PHASES)
def test_a_deployer_killed_at_any_phase_leaves_no_request_unanswered(
    fronted: Host, phase: str
) -> None:
    host = fronted
    old_env, old_front = host.env_file.read_text(), front_of(host).live_text()
    old_port = server_port(host)
    new_port = realserver.free_port()
    p = with_fault(host, f"{phase}:kill", "set", "--port", str(new_port), "-a", "the-new-one")
    assert p.returncode == -9, p.stderr
    # nothing but the installed units runs from here: the request is answered within one
    # deploy's budget (275 s with the test's timeouts; 120 s is the client's own)
    t0 = time.monotonic()
    status, model = chat_status(host.url, 120)
    assert status == 200, model
    print(f"{phase}: answered after {time.monotonic() - t0:.2f}s by {model}")
    settled(host)
    assert front_stat(host)["status"] == "OPEN"
    assert slot_files(host) == [] or phase == "stored"
    if phase == "released":  # gated and released: the new config serves, uncommitted
        assert (model, server_port(host)) == ("the-new-one", new_port)
        return
    # the transaction was recovered (or, at "stored", nothing live was touched)
    assert host.env_file.read_text() == old_env
    assert front_of(host).live_text() == old_front
    assert server_port(host) == old_port
    assert (host.state_dir / "txn.json").exists() == (phase == "stored")
    assert chat_status(host.url, 60)[0] == 200


def test_a_hold_outliving_its_budget_is_released_and_status_says_who_held(
    fronted: Host,
) -> None:
    host = fronted
    # one deploy's budget here: no drain + the stop (TimeoutStopSec 10 + 5) + 2 + 2 + 2 s;
    # the deployer waits at "swap", holding, alive, until the test lets it go on
    go = host.root / "go"
    short = ["--no-drain", "--start-timeout", "2", "--health-timeout", "2"]
    deploy = in_background(
        host, f"swap:wait:{go}", "set", "-t", "2", *short, "--probe-timeout", "2"
    )
    try:
        deadline = time.monotonic() + 60
        while not front_of(host).hold_path.exists():
            assert time.monotonic() < deadline and deploy.poll() is None
            time.sleep(0.05)
        rc, out = host.cli_json("status")
        assert rc == 0, out
        front = out["front"]
        assert (front["state"], front["held_by_pid"], front["holder_alive"]) == (
            "held",
            deploy.pid,
            True,
        )
        assert front["release_deadline"] > front["held_since"], front
        # answered while the deployer still waits, holding the lock: the watcher released
        # the front first, at the hold's deadline (it cannot take the lock to recover)
        status, _ = chat_status(host.url, 120)
        assert status == 200 and deploy.poll() is None
        assert not front_of(host).hold_path.exists()
    finally:
        go.touch()
    rc, result = result_of(deploy)
    assert (rc, result["outcome"]) == (0, "deployed"), result
    assert result["handover"]["front"]["released_by_watcher"] is True
    assert any("release watcher released" in w for w in result["warnings"])
    rc, out = host.cli_json("status")
    assert out["front"]["state"] == "open", out["front"]


def test_status_says_the_front_is_open(fronted: Host) -> None:
    rc, out = fronted.cli_json("status")
    assert rc == 0, out
    assert out["front"]["state"] == "open"
    assert out["front"]["public"] == f"127.0.0.1:{fronted.port}"
    text = fronted.cli("status").stdout
    assert f"front: open (127.0.0.1:{fronted.port} -> 127.0.0.1:" in text


def test_a_front_without_its_release_watcher_is_not_held(fronted: Host) -> None:
    host = fronted
    host.sandbox.systemctl("stop", front_of(host).release_path)
    rc, out = host.cli_json("set", "-t", "2")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert out["handover"]["front"]["held"] is False
    assert any("release watcher" in w and "install --front haproxy" in w for w in out["warnings"])


class RefusingAPI(threading.Thread):
    """A runtime API at the front's socket path that refuses every command, as HAProxy
    answers a command it will not run; it counts the connections it answered."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        self.stop, self.answered = threading.Event(), 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(4096)
                conn.sendall(b"Permission denied.\n")
            self.answered += 1

    def close(self) -> None:
        self.stop.set()
        self.join(10)
        self.sock.close()


def lock_waiters(pid: int) -> list[str]:
    """The flock requests process ``pid`` waits on (/proc/locks' blocked lines, ``->``)."""
    lines = Path("/proc/locks").read_text().splitlines()
    return [line for line in lines if "->" in line and f" {pid} " in line]


def test_a_recheck_after_the_release_leaves_no_record_behind(fronted: Host) -> None:
    host = fronted
    the_front = front_of(host)
    host.sandbox.systemctl("stop", the_front.release_path)  # only the test changes the record
    hold = the_front.hold(600)
    # what a process that read the record before HAProxy restarted and before the release
    # holds: it sees a new HAProxy, and must not pause it nor write the record back
    stale = replace(hold, front="1:1")
    the_front.release()
    assert the_front.recheck(stale, "a late recheck") == stale
    assert not the_front.hold_path.exists()
    assert front_stat(host)["status"] == "OPEN"


def test_a_recheck_waits_for_the_record_lock_and_keeps_a_deadline_moved_meanwhile(
    fronted: Host,
) -> None:
    host = fronted
    the_front = front_of(host)
    host.sandbox.systemctl("stop", the_front.release_path)  # only the test changes the record
    now = time.time()
    hold = Hold(os.getpid(), now, now + 600, front="1:1")  # paused before a HAProxy restart
    store.write_json(the_front.hold_path, hold.to_dict())
    recheck = (
        "import sys; from pathlib import Path; "
        "from launcher.deploy.restart.front import Front, Hold; "
        f"f = Front(Path({str(host.state_dir)!r}), {host.unit!r}); "
        f"f.recheck(Hold.from_dict({hold.to_dict()!r}), 'another process')"
    )
    fd = os.open(the_front.hold_lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        child = subprocess.Popen([sys.executable, "-c", recheck], env=host.env)
        deadline = time.monotonic() + 60
        while not lock_waiters(child.pid):
            assert child.poll() is None, "the recheck wrote the record without the lock"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        moved = replace(hold, deadline=hold.deadline + 300)  # held again meanwhile
        store.write_json(the_front.hold_path, moved.to_dict())
    finally:
        os.close(fd)
    assert child.wait(60) == 0
    latest = the_front.holding()
    assert latest is not None
    assert latest.deadline == moved.deadline, "a deadline moved meanwhile was written back"
    assert [e["noticed_by"] for e in latest.restarts] == ["another process"]
    the_front.release()


def test_the_watcher_tries_again_a_release_that_failed(fronted: Host) -> None:
    host = fronted
    the_front = front_of(host)
    host.sandbox.systemctl("stop", the_front.release_path)  # the test runs the watcher
    the_front.hold(600)  # a holder gone without its lock (this test takes none)
    real = the_front.admin_socket.with_name("admin.sock.real")
    the_front.admin_socket.rename(real)
    api = RefusingAPI(the_front.admin_socket)
    api.start()
    try:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "launcher", "front-release", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=host.env,
        )
        # a round asks four times (the watcher's recheck, the recovery's): two rounds of
        # refusals, or a watcher that stopped trying
        deadline = time.monotonic() + 60
        while api.answered < 8 and watcher.poll() is None:
            assert time.monotonic() < deadline, api.answered
            time.sleep(0.05)
    finally:
        api.close()
        the_front.admin_socket.unlink(missing_ok=True)
        real.rename(the_front.admin_socket)
    rc, out = result_of(watcher)
    assert (rc, out["outcome"]) == (0, "recovered"), out
    assert not the_front.hold_path.exists(), "the watcher ended with the front still held"
    assert front_stat(host)["status"] == "OPEN"


def test_recover_releases_a_front_paused_with_no_hold_recorded(fronted: Host) -> None:
    host = fronted
    the_front = front_of(host)
    assert the_front.command("disable frontend public").strip() == ""
    assert not the_front.hold_path.exists()
    rc, out = host.cli_json("status")
    assert out["front"]["state"] == "held", out["front"]
    rc, out = host.cli_json("recover")
    assert rc == 0, out
    assert front_stat(host)["status"] == "OPEN", out
    assert "released" in out["recovered"]["front"], out


def test_install_with_another_public_address_is_refused_naming_the_reinstall(
    fronted: Host,
) -> None:
    host = fronted
    spec = front_of(host).spec()
    rc, out = host.install("-c", "8192", "-np", "2", "--front", "haproxy", "--port", "1")
    assert rc == 2, out
    assert "uninstall" in out["message"] and f"127.0.0.1:{host.port}" in out["message"], out
    assert front_of(host).spec() == spec
    assert chat_status(host.url, 30)[0] == 200


def test_an_instances_front_is_no_instance_of_the_template(tmp_path: Path) -> None:
    the_front = Front(tmp_path, "llama-server@chat.service", "system")
    names = [the_front.service, the_front.socket_unit, the_front.release_path]
    names.append(the_front.release_service)
    assert names == [
        "llama-server-chat-front.service",
        "llama-server-chat-front.socket",
        "llama-server-chat-front-release.path",
        "llama-server-chat-front-release.service",
    ]
    assert the_front.admin_socket == Path("/run/llama-server-chat-front/admin.sock")
    assert Front(tmp_path, "llama-server.service").service == "llama-server-front.service"


def test_a_front_spec_with_an_unknown_key_is_a_front_error(tmp_path: Path) -> None:
    the_front = Front(tmp_path, "llama-server.service")
    spec = FrontSpec("127.0.0.1", 8080, "127.0.0.1", 18080)
    the_front.save_spec(spec)
    assert the_front.spec() == spec
    store.write_json(the_front.spec_path, {**spec.to_dict(), "public": "x"})
    with pytest.raises(FrontError, match="no front spec"):
        the_front.spec()


def test_the_watchers_exec_line_keeps_each_path_one_word_as_systemd_reads_it(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    """install writes the watcher's --env-file and --state-dir into its ``ExecStart=``: a
    path with a space, a %, a $, a quote or a backslash is still one word to systemd."""
    words = [str(tmp_path / "state dir"), "100%i", "$HOME", 'say "hi"', "back\\slash", "plain"]
    out, script = tmp_path / "argv.json", tmp_path / "argv.py"
    script.write_text(
        f"import json, sys\nopen({str(out)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    text = frontunits.release_service_text(
        Front(tmp_path, "ll-words.service"),
        sys.executable,
        "/nonexistent",
        ["--state-dir", words[0]],
    )
    assert f"--state-dir {units.exec_word(words[0])} --json" in text
    unit = sandbox.unit_dir / "ll-exec-words.service"
    line = " ".join(units.exec_word(w) for w in [sys.executable, str(script), *words])
    unit.write_text(f"[Service]\nType=oneshot\nExecStart={line}\n")
    try:
        sandbox.systemctl("daemon-reload")
        sandbox.systemctl("start", unit.name)
        assert json.loads(out.read_text()) == words
    finally:
        unit.unlink()
        sandbox.systemctl("daemon-reload")


# -- 2. every restart of a fronted unit holds ----------------------------------------------


def test_recover_restarts_the_old_config_behind_a_held_front(fronted: Host) -> None:
    host = fronted
    p = with_fault(host, "released:kill", "set", "-a", "the-new-one")
    assert p.returncode == -9, p.stderr
    clients = Clients(host.url)
    clients.start()
    time.sleep(0.5)
    rc, out = host.cli_json("recover")
    time.sleep(0.5)
    seen = clients.done()
    assert rc == 0, out
    assert seen and set(seen) == {200}, seen
    assert out["recovered"]["gate"]["ok"] is True
    assert "held for the restart" in out["recovered"]["front_hold"]
    assert out["recovered"]["front_drain"].startswith("drained"), out["recovered"]
    assert chat_status(host.url, 30)[1] != "the-new-one"


# -- 3. HAProxy killed during a hold ---------------------------------------------------------


@pytest.mark.parametrize("phase", PHASES)
def test_haproxy_killed_at_any_phase_is_noticed_and_the_front_points_at_the_new_server(
    fronted: Host, phase: str
) -> None:
    host = fronted
    new_port = realserver.free_port()
    clients = Clients(host.url)
    clients.start()
    p = with_fault(host, f"{phase}:kill-front", "set", "--port", str(new_port), "-a", "new")
    seen = clients.done()
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert (p.returncode, result["outcome"]) == (0, "deployed"), result.get("failure")
    front = result["handover"]["front"]
    assert front["held"] is True, front
    assert chat_status(host.url, 60) == (200, "new")
    assert server_port(host) == new_port
    assert front_stat(host)["status"] == "OPEN"
    restarts = front.get("restarted", [])
    if phase in HELD:
        assert len(restarts) == 1, (front, result["warnings"])
        assert restarts[0]["pid_after"] != restarts[0]["pid_before"]
        assert any("HAProxy was restarted during the hold" in w for w in result["warnings"])
    # what the clients saw: every 5xx was one the report counts (a request the killed
    # HAProxy had in flight is cut, status 0)
    reported = sum(r.get("answered_5xx", 0) for r in restarts)
    assert len([s for s in seen if s >= 500]) <= reported, (seen, restarts)
    print(f"{phase}: clients saw {seen}; the report: {restarts}")


# -- 4. the front's config is part of the transaction -----------------------------------------


@pytest.mark.parametrize(
    "live", ['LLAMA_SERVER="/new"\n', 'LLAMA_SERVER="/old"\n'], ids=["reverted", "already-old"]
)
def test_the_record_names_the_fronts_old_config_and_prestart_puts_it_back(
    tmp_path: Path, live: str
) -> None:
    """prestart puts the front's old config back with the env file, and also when the env
    file is the old one already (an undo killed between the env file and the front's
    config: HAProxy must not start from the new config, pointing at a port nothing
    serves); it holds the front for the record's budget."""
    from launcher.install import prestart

    state, env = tmp_path / "state", tmp_path / "llama-server.env"
    the_front = Front(state, "llama-server.service", "system")
    old = FrontSpec("127.0.0.1", 8080, "127.0.0.1", 18080)
    new = FrontSpec("127.0.0.1", 8080, "127.0.0.1", 18081)
    the_front.swap(the_front.render(new, 2))
    the_front.save_spec(new)
    env.write_text(live)
    txn = {
        "phase": "gate",
        "from": 1,
        "to": 2,
        "old_text": 'LLAMA_SERVER="/old"\n',
        "budget": 300.0,
        "front": {
            "unit": "llama-server.service",
            "old_text": the_front.render(old, 2),
            "old_spec": old.to_dict(),
            "old_slots": 2,
        },
    }
    (state / "txn.json").write_text(json.dumps(txn))
    done = prestart.revert_pending(env, state, tmp_path / "lock")
    assert done and "front's previous config is back" in done, done
    assert env.read_text() == 'LLAMA_SERVER="/old"\n'
    assert the_front.live_text() == the_front.render(old, 2)
    assert the_front.spec() == old
    hold = the_front.holding()
    assert hold is not None and hold.pid == os.getpid()
    assert 299 <= hold.deadline - hold.since <= 301
    assert json.loads((state / "txn.json").read_text())["reverted_at_start"] is True


# -- 5. the files left behind ----------------------------------------------------------------


def test_a_haproxy_check_copy_left_by_a_killed_process_is_removed_by_the_next_run(
    host: Host, tmp_path: Path
) -> None:
    installed(host, "-c", "4096", "-np", "2")
    slow = tmp_path / "haproxy"
    slow.write_text("#!/bin/sh\nsleep 60\n")
    slow.chmod(0o755)
    check = (
        "import sys; from pathlib import Path; from launcher.deploy.restart.front import Front, "
        f"FrontSpec; s = FrontSpec('127.0.0.1', 1, '127.0.0.1', 2, haproxy={str(slow)!r}); "
        f"f = Front(Path({str(host.state_dir)!r}), {host.unit!r}); f.validate(f.render(s, 1), s)"
    )
    child = subprocess.Popen([sys.executable, "-c", check])
    left = host.state_dir / "front" / f".haproxy-check.cfg.tmp-{child.pid}"
    deadline = time.monotonic() + 30
    while not left.exists():
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert left.exists()
    rc, out = host.cli_json("recover")
    assert rc == 0, out
    assert str(left) in out["recovered"]["removed_temp_files"]
    assert not left.exists()


def test_the_slot_files_of_a_killed_deploy_are_removed_by_the_next_run(host: Host) -> None:
    installed(host, "-c", "8192", "-np", "2")
    completion(host.url, HISTORY)
    p = with_fault(host, "swap:kill", "set", "-t", "2")
    assert p.returncode == -9, p.stderr
    left = slot_files(host)
    assert left and any(f.stat().st_size > 100_000 for f in left)
    rc, out = host.cli_json("recover")
    assert rc == 0, out
    assert slot_files(host) == []
    assert {str(f) for f in left} <= set(out["recovered"]["removed_temp_files"])


# -- 6. a slot file damaged between save and restore ----------------------------------------


def test_a_truncated_slot_file_is_skipped_with_the_reason_and_the_server_stays_up(
    host: Host,
) -> None:
    installed(host, "-c", "8192", "-np", "2")
    n_prompt = completion(host.url, HISTORY)["timings"]["prompt_n"]
    p = with_fault(host, "swapped:truncate-slots", "set", "-t", "2")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "deployed", result
    carried = result["handover"]["slots"]
    assert carried["restored"] == [], carried
    reasons = [s["reason"] for s in carried["skipped"]]
    assert reasons and all("truncated" in r for r in reasons), reasons
    state = host.state()
    assert (state["ActiveState"], state["NRestarts"]) == ("active", "0"), state
    assert completion(host.url, HISTORY)["timings"]["prompt_n"] >= n_prompt - 1  # not cached


def test_a_restore_that_crashes_the_server_fails_the_gate_and_rolls_back(host: Host) -> None:
    installed(host, "-c", "8192", "-np", "2")
    completion(host.url, HISTORY)
    before = host.env_file.read_text()
    # cut after the check: the real llama-server aborts (SIGABRT) reading the short file
    p = with_fault(host, "restore:truncate-slots", "set", "-t", "2")
    assert p.returncode == 3, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "rolled_back", result
    assert result["failure"]["class"] == "slot_restore_crashed", result["failure"]
    assert "went down restoring slot" in result["failure"]["message"]
    assert result["handover"]["slots"]["restored"] == []  # none into the old config either
    assert host.env_file.read_text() == before
    assert host.chat()["usage"]["completion_tokens"] > 0
    assert slot_files(host) == []


# -- 7. install --front haproxy without HAProxy ------------------------------------------------


def test_install_front_haproxy_without_haproxy_is_refused_before_anything_is_written(
    host: Host,
) -> None:
    # HAProxy hidden: an empty /usr/sbin in a mount namespace of this command's own
    argv = [sys.executable, "-m", "launcher", "install", *host.base_flags(), "--front"]
    p = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs tmpfs /usr/sbin && exec "$@"',
            "sh",
            *argv,
            "haproxy",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=host.env,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    assert "apt-get install haproxy" in out["message"], out
    assert "/usr/sbin/haproxy" in out["message"]
    assert not host.env_file.exists()
    assert not host.state_dir.exists()
    assert not (host.sandbox.unit_dir / host.unit).exists()
