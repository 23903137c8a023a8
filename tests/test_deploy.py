"""The deploy transaction: sandboxed systemd, the real llama-server and the tiny model."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Host, taken_at_restart

from launcher.deploy import home

BAD_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] == 'Say OK.' %}"
    "{{ raise_exception('this template refuses the probe') }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def installed(host: Host, *flags: str) -> dict:  # type: ignore[type-arg]
    rc, out = host.install("-c", "4096", "-np", "2", *flags)
    assert rc == 0, out
    assert out["outcome"] == "deployed"
    return out


def test_install_serves_a_real_completion(host: Host) -> None:
    out = installed(host)
    assert out["startup"]["n_slots"] == 2
    assert out["startup"]["n_ctx_slot"] == 2048
    assert out["startup"]["kv_unified"] is False
    assert out["probe"]["completion_tokens"] > 0
    assert host.state()["ActiveState"] == "active"
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_good_change_is_deployed_as_a_new_generation(host: Host) -> None:
    installed(host)
    rc, out = host.cli_json("set", "-ctk", "q8_0", "-ctv", "q8_0")
    assert (rc, out["outcome"], out["changed"]) == (0, "deployed", True)
    assert (out["generation"], out["previous_generation"]) == (2, 1)
    assert "-ctk q8_0" in host.env_file.read_text()
    assert "+-ctk q8_0" in out["diff"]


def test_identical_change_restarts_nothing(host: Host) -> None:
    installed(host, "-ctk", "q8_0")
    pid = host.state()["MainPID"]
    rc, out = host.cli_json("set", "--cache-type-k", "q8_0")
    assert (rc, out["outcome"], out["changed"]) == (0, "unchanged", False)
    assert host.state()["MainPID"] == pid


def test_unknown_flag_is_refused_before_anything_changes(host: Host) -> None:
    installed(host)
    before, pid = host.env_file.read_text(), host.state()["MainPID"]
    rc, out = host.cli_json("set", "--kv-unified-per-slots", "1024")
    assert rc == 2
    assert "--kv-unified-per-slots is not a flag" in out["message"]
    assert "did you mean --kv-unified-per-slot" in out["message"]
    assert host.env_file.read_text() == before
    assert host.state()["MainPID"] == pid


def test_removed_flag_names_its_replacement(host: Host) -> None:
    installed(host)
    rc, out = host.cli_json("set", "--no-mmap")
    assert rc == 2
    assert "-lm none" in out["message"]


def test_missing_model_is_refused(host: Host) -> None:
    installed(host)
    rc, out = host.cli_json("set", "-m", str(host.root / "nope.gguf"))
    assert rc == 2
    assert "model" in out["message"] and "nope.gguf" in out["message"]


def test_crash_at_start_rolls_back_after_one_start(host: Host) -> None:
    installed(host)
    p, port = taken_at_restart(host)  # another process takes the port the new config wants
    rc, out = p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
    assert rc == 3
    assert out["outcome"] == "rolled_back"
    assert out["failure"]["class"] == "port_in_use"
    assert f"the port {port} on 127.0.0.1 is already in use" in out["failure"]["message"]
    assert out["rollback"]["ok"] is True
    journal = host.journal()
    assert journal.count("couldn't bind HTTP server socket") == 1  # the bad config started once
    assert f"--port {host.port}" in host.env_file.read_text()
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_a_port_another_process_holds_is_refused_before_anything_stops(host: Host) -> None:
    installed(host)
    before, pid = host.env_file.read_text(), host.state()["MainPID"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        whole = ["-m", str(host.model), "--llama-server", host.server, "-c", "4096", "-np", "2"]
        rc, out = host.cli_json("deploy", *whole, "--port", str(port))
    assert rc == 2, out
    assert out.get("step") == "port", out
    assert f"the port {port} on 127.0.0.1 is held by" in out["message"]
    assert f"pid {os.getpid()}" in out["message"]  # this test's process, named
    assert "Give another --port" in out["message"]
    assert host.env_file.read_text() == before
    assert host.state()["MainPID"] == pid
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_a_deploy_onto_a_crashed_unit_cancels_systemds_own_restart(
    host: Host, tmp_path: Path
) -> None:
    """A server that died waits RestartSec (2 s) in auto-restart. A deploy then (a bake's
    revert of a crashing config) stops it first: systemd's timer must not start the unit
    between the deploy's reads and its restart, or the gate takes the timer's start (NRestarts
    up) for the new process dying (CI: such a revert was reported as failed)."""
    installed(host)
    host.sandbox.systemctl("kill", "--signal=SIGKILL", host.unit)
    deadline = time.monotonic() + 10
    while host.state()["SubState"] != "auto-restart":
        assert time.monotonic() < deadline, host.state()
        time.sleep(0.01)
    go = tmp_path / "go"
    p = _popen(host, "set", "-c", "8192", fault=f"restart:wait:{go}")
    try:
        _wait_phase(host, "restart")
        time.sleep(3)  # past RestartSec: the timer would have started the unit by now
        waiting = host.state()
    finally:
        go.touch()
        stdout, _ = p.communicate(timeout=120)
    assert (waiting["NRestarts"], waiting["ActiveState"]) == ("0", "inactive"), waiting
    out = json.loads(stdout.strip().splitlines()[-1])
    assert (p.returncode, out["outcome"]) == (0, "deployed"), out
    assert "-c 8192" in host.env_file.read_text()
    assert host.state()["NRestarts"] == "0"
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_quantized_v_without_flash_attention_is_refused_before_restart(host: Host) -> None:
    installed(host, "-ctk", "q8_0", "-ctv", "q8_0")
    pid = host.state()["MainPID"]
    rc, out = host.cli_json("set", "-fa", "off")
    assert rc == 2
    assert "flash" in out["message"].lower()
    assert host.state()["MainPID"] == pid


def test_startup_line_different_from_plan_rolls_back(host: Host, tmp_path: Path) -> None:
    installed(host)
    ini = tmp_path / "xdg" / "llama.cpp" / "config.ini"
    ini.parent.mkdir(parents=True)
    # Caps 4096-cell slots to 3000 but leaves the old 2048-cell slots alone.
    ini.write_text("kv-unified-per-slot = 3000\n")
    host.sandbox.systemctl("set-environment", f"XDG_CONFIG_HOME={ini.parent.parent}")
    try:
        rc, out = host.cli_json("set", "-c", "8192")
    finally:
        host.sandbox.systemctl("unset-environment", "XDG_CONFIG_HOME")
    assert (rc, out["outcome"]) == (3, "rolled_back"), out
    assert out["failure"]["class"] == "gate_mismatch"
    assert "n_ctx_slot = 3000 (planned 4096)" in out["failure"]["message"]
    assert str(ini) in out["failure"]["message"]


def test_completion_failure_rolls_back(host: Host, tmp_path: Path) -> None:
    installed(host)
    template = tmp_path / "bad.jinja"
    template.write_text(BAD_TEMPLATE)
    rc, out = host.cli_json("set", "--chat-template-file", str(template))
    assert (rc, out["outcome"]) == (3, "rolled_back")
    assert out["failure"]["phase"] == "probe"
    assert "refuses the probe" in out["failure"]["message"]
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_both_configs_failing_is_rollback_failed_and_keeps_everything(
    host: Host, tmp_path: Path
) -> None:
    installed(host)
    good = host.env_file.read_text()
    ini = tmp_path / "xdg" / "llama.cpp" / "config.ini"
    ini.parent.mkdir(parents=True)
    ini.write_text("api-key = a-key-the-probe-does-not-have\n")
    host.sandbox.systemctl("set-environment", f"XDG_CONFIG_HOME={ini.parent.parent}")
    try:
        rc, out = host.cli_json("set", "-c", "8192")
    finally:
        host.sandbox.systemctl("unset-environment", "XDG_CONFIG_HOME")
    assert (rc, out["outcome"]) == (4, "rollback_failed")
    assert "401" in out["failure"]["message"]
    assert "Nothing was deleted" in out["message"]
    assert host.env_file.read_text() == good
    assert len(list((host.state_dir / "generations").iterdir())) == 2
    rc, out = host.cli_json("rollback")
    assert (rc, out.get("outcome")) == (0, "deployed"), out


def test_rollback_to_a_generation(host: Host) -> None:
    installed(host)
    first = host.env_file.read_text()
    assert host.cli_json("set", "-c", "8192")[0] == 0
    rc, out = host.cli_json("rollback", "--to", "1")
    assert (rc, out["outcome"], out["generation"]) == (0, "deployed", 3)
    assert host.env_file.read_text() == first
    assert out["startup"]["n_ctx_slot"] == 2048


def test_rollbacks_walk_back_and_never_bring_back_a_backed_out_config(host: Host) -> None:
    installed(host)  # A: -c 4096
    assert host.cli_json("set", "-c", "8192")[0] == 0  # B
    assert host.cli_json("set", "-c", "6144")[0] == 0  # C
    rc, out = host.cli_json("rollback")
    assert (rc, out["startup"]["n_ctx_slot"]) == (0, 4096), out  # back to B
    rc, out = host.cli_json("rollback")
    assert (rc, out["startup"]["n_ctx_slot"]) == (0, 2048), out  # back to A, not to C
    rc, out = host.cli_json("rollback")
    assert rc == 1 and "no known-good generation" in out["message"]
    assert "-c 4096" in host.env_file.read_text()


def test_rollback_after_start_limit_hit(host: Host) -> None:
    installed(host)
    good = host.env_file.read_text()
    host.env_file.write_text(good.replace("-np 2", "-np 2 --no-such-flag"))
    said: list[str] = []
    deadline = time.monotonic() + 120  # manual restarts count toward StartLimitBurst=5
    while time.monotonic() < deadline and not (said and "too often" in said[-1]):
        said.append(host.sandbox.systemctl("restart", host.unit, check=False).stderr.strip())
    assert "start of the service was attempted too often" in said[-1], (len(said), said[-6:])
    assert "too often" in host.sandbox.systemctl("start", host.unit, check=False).stderr
    rc, out = host.cli_json("rollback")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert host.env_file.read_text() == good
    assert host.chat()["usage"]["completion_tokens"] > 0


def _popen(host: Host, *args: str, fault: str) -> subprocess.Popen[str]:
    """The CLI with ``fault`` injected at a phase of the transaction (tests/faults.py)."""
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("faults.py")), fault, *args, "--json"],
        env=host.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_phase(host: Host, phase: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    txn = host.state_dir / "txn.json"
    while time.monotonic() < deadline:
        try:
            if json.loads(txn.read_text()).get("phase") == phase:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"the deploy never reached phase {phase}")


def test_sigterm_during_the_gate_rolls_back(host: Host) -> None:
    installed(host)
    good = host.env_file.read_text()
    p = _popen(host, "set", "-c", "8192", fault="gate:pause")
    _wait_phase(host, "gate")
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=60)
    out = json.loads(stdout.strip().splitlines()[-1])
    assert (p.returncode, out["outcome"]) == (3, "rolled_back")
    assert out["failure"]["class"] == "interrupted"
    assert host.env_file.read_text() == good
    assert not (host.state_dir / "txn.json").exists()
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_sighup_during_the_gate_rolls_back(host: Host) -> None:
    installed(host)
    good = host.env_file.read_text()
    p = _popen(host, "set", "-c", "8192", fault="gate:pause")
    _wait_phase(host, "gate")
    p.send_signal(signal.SIGHUP)  # the terminal of the one who ran it was closed
    stdout, _ = p.communicate(timeout=60)
    out = json.loads(stdout.strip().splitlines()[-1])
    assert (p.returncode, out["outcome"]) == (3, "rolled_back")
    assert out["failure"]["class"] == "interrupted"
    assert host.env_file.read_text() == good
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_uninstall_waits_for_the_units_lock(host: Host) -> None:
    """A deploy (or the front's release watcher) holding the lock is not taken apart under:
    uninstall waits for the lock like another deploy, and gives up the same way."""
    installed(host)
    fd = os.open(home.lock_path("user", host.unit), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        rc, out = host.cli_json("uninstall", env={"LLAMA_LAUNCHER_LOCK_TIMEOUT": "0.5"})
    finally:
        os.close(fd)
    assert (rc, out.get("error")) == (5, "LockTimeout"), out
    assert (host.sandbox.unit_dir / host.unit).exists()
    assert host.state()["ActiveState"] == "active"


def test_second_deploy_waits_for_the_lock_then_gives_up(host: Host) -> None:
    installed(host)
    first = _popen(host, "set", "-c", "8192", fault="gate:pause")
    _wait_phase(host, "gate")
    try:
        rc, out = host.cli_json("set", "-c", "6144", env={"LLAMA_LAUNCHER_LOCK_TIMEOUT": "0.5"})
        assert rc == 5
        assert out["error"] == "LockTimeout"
        assert f"pid {first.pid}" in out["message"]
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)


@pytest.mark.parametrize("phase", ["stored", "swap", "swapped", "restart", "gate"])
def test_kill_9_at_a_step_boundary_is_recovered(host: Host, phase: str) -> None:
    installed(host)
    good = host.env_file.read_text()
    p = _popen(host, "set", "-c", "8192", fault=f"{phase}:kill")
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    text = host.env_file.read_text()
    assert text == good or "-c 8192" in text  # whole: the old file or the new one
    assert (host.state_dir / "txn.json").exists()
    rc, out = host.cli_json("status")
    assert out["pending_transaction"] is True
    rc, out = host.cli_json("recover")
    assert rc == 0
    assert out["recovered"]["interrupted_phase"] == phase
    assert host.env_file.read_text() == good
    assert not (host.state_dir / "txn.json").exists()
    assert (
        json.loads((host.state_dir / "generations/0002/meta.json").read_text())["outcome"]
        == "interrupted"
    )
    assert host.chat()["usage"]["completion_tokens"] > 0
    rc, out = host.cli_json("set", "-c", "8192")
    assert (rc, out["outcome"]) == (0, "deployed")


def test_check_mode_changes_nothing_and_shows_the_diff(host: Host) -> None:
    installed(host)
    before, pid = host.env_file.read_text(), host.state()["MainPID"]
    rc, out = host.cli_json("set", "--check", "-ctk", "q8_0")
    assert (rc, out["outcome"], out["changed"]) == (0, "checked", True)
    assert out["diff"] == ["--- live", "+++ new", "+-ctk q8_0"]
    assert host.env_file.read_text() == before
    assert host.state()["MainPID"] == pid


def test_status_and_history_report_the_live_generation(host: Host) -> None:
    installed(host)
    host.cli_json("set", "-c", "8192")
    rc, status = host.cli_json("status")
    assert rc == 0
    assert status["live_generation"] == 2
    assert status["client_window"] == 4096
    assert status["startup"]["n_ctx_slot"] == 4096
    assert status["memory"] > 0
    window = json.loads(
        (host.state_dir.parent / f"{host.env_file.stem}.client-window.json").read_text()
    )
    assert window["per_slot_window"] == 4096 and window["generation"] == 2
    rc, hist = host.cli_json("history")
    assert [g["outcome"] for g in hist["generations"]] == ["deployed", "deployed"]
    assert "+-c 8192" in hist["generations"][1]["diff"]


def test_overcommitted_shared_pool_is_refused_with_its_numbers(host: Host) -> None:
    installed(host)
    rc, out = host.cli_json("set", "-c", "4096", "-np", "4", "-kvu")
    assert rc == 2
    assert "4 slots x n_ctx_slot 4096 = 16384 cells promised" in out["message"]
    assert "unified pool holds 4096" in out["message"]
    assert "--kv-unified-per-slot 4096 -c 16384" in out["message"]


def test_api_key_reaches_the_server_through_a_file_never_argv(host: Host) -> None:
    import httpx

    installed(host)
    rc, out = host.cli_json("deploy", "--config", _toml(host, api_key="s3cret-key"))
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert "s3cret-key" not in host.env_file.read_text()
    pid = host.state()["MainPID"]
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    assert "s3cret-key" not in cmdline and "--api-key-file" in cmdline
    assert httpx.get(host.url + "/props").status_code == 401
    ok = httpx.get(host.url + "/props", headers={"Authorization": "Bearer s3cret-key"})
    assert ok.status_code == 200
    meta = (host.state_dir / "generations/0002/meta.json").read_text()
    assert "s3cret-key" not in meta


def _toml(host: Host, **extra: str) -> str:
    path = host.root / "desired.toml"
    lines = [
        f'llama_server = "{host.server}"',
        f'model = "{host.model}"',
        f"port = {host.port}",
        "ctx_size = 4096",
        "parallel = 2",
    ]
    lines += [f'{k} = "{v}"' for k, v in extra.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_first_deploy_that_fails_leaves_the_unit_stopped(host: Host, tmp_path: Path) -> None:
    template = tmp_path / "bad.jinja"
    template.write_text(BAD_TEMPLATE)
    rc, out = host.install("-c", "4096", "-np", "2", "--chat-template-file", str(template))
    assert (rc, out["outcome"]) == (3, "rolled_back")
    assert host.state()["ActiveState"] in ("inactive", "failed")
    assert not host.env_file.exists()


def test_env_file_is_private_and_keeps_its_mode(host: Host) -> None:
    installed(host)
    assert oct(host.env_file.stat().st_mode & 0o777) == "0o600"
    os.chmod(host.env_file, 0o640)
    assert host.cli_json("set", "-c", "8192")[0] == 0
    assert oct(host.env_file.stat().st_mode & 0o777) == "0o640"
    assert (host.env_file.parent / (host.env_file.name + ".bak")).exists()


def test_sigterm_while_storing_the_generation_changes_nothing_live(host: Host) -> None:
    installed(host)
    good, pid = host.env_file.read_text(), host.state()["MainPID"]
    p = _popen(host, "set", "-c", "8192", fault="stored:pause")
    _wait_phase(host, "stored")
    p.send_signal(signal.SIGTERM)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM
    assert "interrupted by SIGTERM before the change went live" in stderr
    assert "Traceback" not in stderr
    assert host.env_file.read_text() == good
    assert not (host.state_dir / "txn.json").exists()
    meta = json.loads((host.state_dir / "generations/0002/meta.json").read_text())
    assert meta["outcome"] == "interrupted"
    assert host.state()["MainPID"] == pid


def test_recovery_does_not_trust_a_recorded_pid_that_is_alive_again(host: Host) -> None:
    installed(host)
    good = host.env_file.read_text()
    p = _popen(host, "set", "-c", "8192", fault="gate:kill")
    p.communicate(timeout=60)
    txn_path = host.state_dir / "txn.json"
    txn = json.loads(txn_path.read_text())
    txn["pid"] = os.getpid()  # after a reboot the dead deployer's pid is some live process
    txn_path.write_text(json.dumps(txn))
    rc, out = host.cli_json("recover")
    assert (rc, out["recovered"]["interrupted_phase"]) == (0, "gate"), out["message"]
    assert host.env_file.read_text() == good
    assert not txn_path.exists()


def test_recovery_restores_a_swap_that_reached_the_disk_before_its_record(host: Host) -> None:
    installed(host)
    good = host.env_file.read_text()
    p = _popen(host, "set", "-c", "8192", fault="stored:kill")
    p.communicate(timeout=60)
    # a power loss: the fsynced swap is on disk, the record's phase (not fsynced) is not
    host.env_file.write_text((host.state_dir / "generations/0002/env").read_text())
    rc, out = host.cli_json("recover")
    assert rc == 0, out
    assert out["recovered"]["interrupted_phase"] == "stored (the new file was live)"
    assert out["recovered"]["gate"]["ok"] is True
    assert host.env_file.read_text() == good
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_recover_whose_restored_config_fails_its_gate_exits_4(host: Host, tmp_path: Path) -> None:
    installed(host)
    good = host.env_file.read_text()
    p = _popen(host, "set", "-c", "8192", fault="gate:kill")
    p.communicate(timeout=60)
    ini = tmp_path / "xdg" / "llama.cpp" / "config.ini"
    ini.parent.mkdir(parents=True)
    ini.write_text("api-key = a-key-the-probe-does-not-have\n")
    host.sandbox.systemctl("set-environment", f"XDG_CONFIG_HOME={ini.parent.parent}")
    try:
        rc, out = host.cli_json("recover")
    finally:
        host.sandbox.systemctl("unset-environment", "XDG_CONFIG_HOME")
    assert (rc, out["error"]) == (4, "RollbackFailed")
    assert out["recovered"]["gate"]["ok"] is False
    assert "401" in out["message"]
    assert host.env_file.read_text() == good
    assert not (host.state_dir / "txn.json").exists()
    rc, out = host.cli_json("rollback")
    assert (rc, out.get("outcome")) == (0, "deployed"), out


def test_unparseable_hand_edit_then_a_failed_deploy_is_rollback_failed(host: Host) -> None:
    installed(host)
    broken = host.env_file.read_text() + "NOTE=an unquoted hand edit\n"
    host.env_file.write_text(broken)
    p, _ = taken_at_restart(host)
    assert p.returncode == 4, p.stderr
    assert "Traceback" not in p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["outcome"] == "rollback_failed"
    assert host.env_file.read_text() == broken  # the hand edit is back, and kept
    assert not (host.state_dir / "txn.json").exists()


def test_check_mode_leaves_an_interrupted_deploy_for_a_real_run(host: Host) -> None:
    installed(host)
    p = _popen(host, "set", "-c", "8192", fault="gate:kill")
    p.communicate(timeout=60)
    live, pid = host.env_file.read_text(), host.settled()["MainPID"]
    rc, out = host.cli_json("set", "--check", "-c", "4096")
    assert (rc, out["outcome"], out["changed"], out["recovered"]) == (0, "checked", True, None)
    assert any("a deploy was interrupted" in w for w in out["warnings"])
    assert host.env_file.read_text() == live  # nothing reverted, nothing restarted
    assert host.state()["MainPID"] == pid
    assert (host.state_dir / "txn.json").exists()


def test_identical_config_on_a_stopped_unit_is_started_through_the_gate(host: Host) -> None:
    installed(host)
    host.sandbox.systemctl("stop", host.unit)
    rc, out = host.cli_json("set", "-c", "4096")
    assert (rc, out["outcome"], out["changed"]) == (0, "deployed", True)
    assert any("is not running (inactive/dead)" in w for w in out["warnings"])
    assert host.state()["ActiveState"] == "active"
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_a_live_file_with_crlf_endings_is_not_taken_for_the_rendered_one(host: Host) -> None:
    installed(host)
    lf = host.env_file.read_bytes()
    host.env_file.write_bytes(lf.replace(b"\n", b"\r\n"))  # the launcher refuses a CR
    rc, out = host.cli_json("set", "-c", "4096")
    assert (rc, out["outcome"], out["changed"]) == (0, "deployed", True)
    assert host.env_file.read_bytes() == lf


def test_install_again_with_a_failing_config_leaves_the_old_one_serving(
    host: Host, tmp_path: Path
) -> None:
    installed(host)
    good = host.env_file.read_text()
    template = tmp_path / "bad.jinja"
    template.write_text(BAD_TEMPLATE)
    rc, out = host.install("-c", "4096", "-np", "2", "--chat-template-file", str(template))
    assert (rc, out["outcome"]) == (3, "rolled_back")
    assert host.env_file.read_text() == good
    assert host.state()["ActiveState"] == "active"
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_a_template_instance_needs_its_env_file_named_after_it(host: Host, tmp_path: Path) -> None:
    p = host.cli(
        "install",
        "--instance",
        "chat",
        "--env-file",
        str(tmp_path / "srv.env"),
        *host.base_flags(),
        "--json",
    )
    assert p.returncode == 2, p.stderr
    assert "llama-server@chat.service reads" in p.stdout and "%i.env" in p.stdout
    assert not (tmp_path / "srv.env").exists()
