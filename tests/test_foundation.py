"""The foundation: unit files, the shipped examples, and the launcher under real systemd."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, Host, Sandbox

from launcher import config
from launcher.host import launch, units
from launcher.host.systemd import Systemd


def test_units_folder_is_the_rendered_template() -> None:
    for name, text in units.default_files().items():
        assert (REPO / "units" / name).read_text() == text


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    here = units.this_python()
    (tmp_path / "llama-server.service").write_text(units.render(*here, str(tmp_path / "x.env")))
    (tmp_path / "llama-server@.service").write_text(
        units.render(*here, str(tmp_path / "%i.env"), template=True)
    )
    for unit in ("llama-server.service", "llama-server@demo.service"):
        p = subprocess.run(
            ["systemd-analyze", "verify", str(tmp_path / unit)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert p.returncode == 0, p.stderr
        assert "llama-server" not in p.stderr, p.stderr


def test_units_never_use_variables_outside_exec_lines() -> None:
    for text in units.default_files().values():
        for line in text.splitlines():
            if "$" in line:
                assert line.startswith("Exec"), line


def test_example_env_file_is_what_the_example_config_renders() -> None:
    import tomllib

    data = tomllib.loads((REPO / "env/llama-server.toml").read_text())
    assert config.render_env(config.build(data)) == (REPO / "env/llama-server.env").read_text()
    argv = launch.read_argv(str(REPO / "env/llama-server.env"))
    assert argv[argv.index("--kv-unified-per-slot") + 1] == "262144"


def test_launcher_config_error_exits_78_and_is_not_restarted(sandbox: Sandbox, host: Host) -> None:
    host.env_file.parent.mkdir(parents=True)
    # seed 000's line, unquoted: bash would run `262144` as a command
    host.env_file.write_text(
        f'LLAMA_SERVER="{host.server}"\n'
        "EXTRA_ARGS=--kv-unified-per-slot 262144 -ctk q8_0 -ctv q8_0\n"
    )
    (sandbox.unit_dir / host.unit).write_text(
        units.render(*units.this_python(), str(host.env_file), scope="user")
    )
    sandbox.systemctl("daemon-reload")
    sandbox.systemctl("start", host.unit, check=False)
    deadline = time.monotonic() + 10
    while host.state()["ActiveState"] not in ("failed", "inactive") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2.5)  # longer than RestartSec: a restart would have happened by now
    state = host.state()
    assert state["ExecMainStatus"] == "78"
    assert state["NRestarts"] == "0"
    assert state["ActiveState"] == "failed"
    last = "\n".join(Systemd(host.unit, "user").tail(2))
    assert f"{host.env_file}:2: unquoted space" in last
    assert "run '262144' as a command" in last


def test_unit_runs_llama_server_itself_not_a_wrapper(host: Host) -> None:
    rc, out = host.install("-c", "4096", "-np", "2")
    assert rc == 0, out
    pid = host.state()["MainPID"]
    exe = Path(f"/proc/{pid}/exe").resolve()
    assert exe.name == "llama-server"
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"--log-colors" in cmdline


def test_a_killed_reader_is_reaped_later_not_waited_for() -> None:
    from launcher.host import proc

    p = proc.spawn(["sleep", "60"])
    proc.end(p)  # returns at once; the kernel tears the process down meanwhile
    assert p.stdout is not None and p.stdout.closed
    proc.reap()
    assert p.returncode == -9 and proc._ending == []


def test_cli_output_is_whole_when_piped_and_a_closed_pipe_is_no_error() -> None:
    """The CLI ends with os._exit (no interpreter teardown): its output must be flushed, and
    a reader that is gone (`| head`) ends it quietly, with SIGPIPE's status."""
    argv = [sys.executable, "-m", "launcher", "plan", "--slots", "4", "--window", "2048"]
    out = subprocess.run([*argv, "--json"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["slots"] == 4
    gone = subprocess.run(
        ["bash", "-c", " ".join(argv) + ' | true; echo "${PIPESTATUS[0]}"'],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert gone.stdout.strip() == "141" and gone.stderr == "", gone.stderr
