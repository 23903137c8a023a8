"""The second instance's parts that need no server (launcher/deploy/restart/standby.py, the exec
``--port`` and the unit it runs under)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from payloads import REPO

from launcher import config
from launcher.deploy.restart import standby
from launcher.deploy.restart.front import FrontSpec
from launcher.errors import ConfigInvalid
from launcher.host import launch, units
from launcher.install import install


def test_exec_port_replaces_the_env_files_port() -> None:
    argv = ["/bin/llama-server", "-m", "m.gguf", "--port", "8080", "--api-key-file", "k"]
    assert launch.with_port(argv, "9090") == [*argv[:4], "9090", *argv[5:]]


def test_exec_port_is_added_when_the_env_file_names_none() -> None:
    assert launch.with_port(["/bin/llama-server", "-m", "m"], "9090")[-2:] == ["--port", "9090"]


@pytest.mark.parametrize("bad", ["0", "65536", "80a", ""])
def test_exec_port_that_is_no_port_is_a_config_error(bad: str) -> None:
    with pytest.raises(launch.LaunchError, match="no TCP port"):
        launch.with_port(["/bin/llama-server"], bad)


def test_exec_port_reaches_the_printed_argv(tmp_path: Path) -> None:
    env = tmp_path / "x.env"
    env.write_text('LLAMA_SERVER="/bin/llama-server"\nEXTRA_ARGS="-m m.gguf --port 8080"\n')
    p = subprocess.run(
        [sys.executable, "-S", "-m", "launcher", "exec", "--env-file", str(env), "--port",
         "9191", "--print-argv"],
        capture_output=True, text=True, cwd=REPO, check=True,
    )  # fmt: skip
    argv = json.loads(p.stdout)
    assert argv[argv.index("--port") + 1] == "9191" and "8080" not in argv


def test_the_second_instance_is_named_outside_the_template() -> None:
    assert standby.unit_name("llama-server.service") == "llama-server-b.service"
    assert standby.unit_name("llama-server@chat.service") == "llama-server-chat-b.service"


def test_the_second_instances_unit_is_never_enabled_and_runs_on_its_port() -> None:
    text = units.render_standby("llama-server.service", 8089)
    assert "[Install]" not in text and "WantedBy" not in text
    assert "ExecStartPre" not in text
    assert "exec --env-file /var/lib/llama-launcher/llama-server/standby.env --port 8089" in text


def test_the_second_instance_shares_the_units_user_and_state_directory() -> None:
    lines = units.render_standby("llama-server.service", 8089).splitlines()
    assert "User=llama-server" in lines
    assert "StateDirectory=llama-server" in lines
    assert "DynamicUser=yes" in lines


def test_a_second_instance_of_a_unit_of_another_name_shares_its_state_directory() -> None:
    lines = units.render_standby("chat.service", 8089).splitlines()
    assert "User=chat" in lines
    assert "StateDirectory=llama-server" in lines  # the unit's own, whatever its name
    assert "LoadCredential=api-key:/var/lib/llama-launcher/chat/standby-api-key" in lines


def test_a_second_instance_of_a_template_instance_runs_as_the_templates_dynamic_user() -> None:
    lines = units.render_standby("llama-server@chat.service", 8089).splitlines()
    assert "User=llama-server" in lines  # systemd names it after the unit up to its @
    assert "StateDirectory=llama-server@chat" in lines  # that instance's, %i written out


@pytest.mark.parametrize("unit", ["9lives.service", "chat.v2.service", "a" * 32 + ".service"])
def test_a_unit_whose_dynamic_user_systemd_hashes_has_no_name(unit: str) -> None:
    assert units.dynamic_user(unit) is None


def test_second_instance_is_refused_in_system_scope_for_a_hashed_dynamic_user() -> None:
    settings = config.ToolSettings(scope="system", unit="chat.v2.service")
    with pytest.raises(ConfigInvalid, match=r"'chat\.v2' is no valid user name"):
        install.require_second_instance(settings, "haproxy", False)


def test_second_instance_is_refused_for_an_at_name_installed_as_a_unit_of_its_own() -> None:
    settings = config.ToolSettings(scope="system", unit="llama-server@x.service")
    with pytest.raises(ConfigInvalid, match="install the instance with --instance NAME"):
        install.require_second_instance(settings, "haproxy", False)
    install.require_second_instance(settings, "haproxy", True)  # the template's instance


def test_install_refuses_a_hashed_second_instance_under_json_and_writes_nothing(
    tmp_path: Path,
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "LLAMA_LAUNCHER_STATE_DIR": str(tmp_path / "state"),
        "LLAMA_LAUNCHER_ENV_FILE": str(tmp_path / "etc" / "chat.env"),
        "LLAMA_LAUNCHER_UNIT_DIR": str(tmp_path / "units"),
    }
    p = subprocess.run(
        [sys.executable, "-m", "launcher", "install", "--scope", "system", "--unit",
         "chat.v2.service", "-m", str(model), "--front", "haproxy", "--second-instance",
         "--json"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2, (p.stdout, p.stderr)
    out = json.loads(p.stdout)
    assert out["ok"] is False and "'chat.v2' is no valid user name" in out["message"], out
    assert "--unit NAME.service" in out["message"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m.gguf"]


def spec(serving: str = "a") -> FrontSpec:
    return FrontSpec("127.0.0.1", 8080, "127.0.0.1", 8081, standby_port=8082, serving=serving)


def test_a_front_without_a_standby_port_has_no_second_instance(tmp_path: Path) -> None:
    plain = FrontSpec("127.0.0.1", 8080, "127.0.0.1", 8081)
    assert standby.Standby.of(tmp_path, "u.service", "user", plain) is None
    sb = standby.Standby.of(tmp_path, "u.service", "user", spec())
    assert sb is not None and (sb.port, sb.url) == (8082, "http://127.0.0.1:8082")


def test_stop_warm_keeps_a_second_instance_that_serves(tmp_path: Path) -> None:
    sb = standby.Standby("u.service", "user", tmp_path, "127.0.0.1", 8082)
    out = standby.stop_due(sb, spec("b"))
    assert out["stopped"] is False and "serves" in out["why"]


def test_stop_warm_keeps_it_until_its_warm_period_is_over(tmp_path: Path) -> None:
    sb = standby.Standby("u.service", "user", tmp_path, "127.0.0.1", 8082)
    sb.warm_path.parent.mkdir()
    sb.warm_path.write_text(json.dumps({"until": time.time() + 100, "generation": 3}))
    out = standby.stop_due(sb, spec())
    assert out["stopped"] is False and "warm for" in out["why"]
