"""One unit, one state (launcher.deploy.home), without systemd: the unit's lock, the record of its
state folder beside the env file, and the refusal of a second state folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher import config
from launcher.deploy import home, store
from launcher.errors import LockTimeout, StateDirMismatch


@pytest.fixture(autouse=True)
def private_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Defaults (~/.config, ~/.local/state) and locks ($XDG_RUNTIME_DIR) inside tmp_path."""
    for key in ("UNIT", "SCOPE", "ENV_FILE", "STATE_DIR", "UNIT_DIR", "SETTINGS"):
        monkeypatch.delenv(f"LLAMA_LAUNCHER_{key}", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LLAMA_LAUNCHER_SETTINGS", str(tmp_path / "no-settings.toml"))
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return tmp_path


def settings(**values: Any) -> config.ToolSettings:
    return config.load_settings(**{"unit": "llama-server@chat", "scope": "user", **values})


def test_the_lock_is_the_units_whatever_state_folder_a_command_names(tmp_path: Path) -> None:
    lock = home.lock_path("user", "llama-server@chat.service")
    first = store.Store(tmp_path / "one", lock)
    second = store.Store(tmp_path / "two", lock)
    with first.lock(timeout=0), pytest.raises(LockTimeout) as e, second.lock(timeout=0):
        pass
    assert str(lock) in str(e.value)
    assert f"(pid {os.getpid()})" in str(e.value)


@pytest.mark.parametrize(
    ("scope", "unit", "expected"),
    [
        ("system", "llama-server.service", "/run/lock/llama-launcher/llama-server.service.lock"),
        (
            "system",
            "llama-server@chat.service",
            "/run/lock/llama-launcher/llama-server@chat.service.lock",
        ),
        (
            "user",
            "llama-server@chat.service",
            "{run}/llama-launcher/llama-server@chat.service.lock",
        ),
        ("user", "../../etc/x.service", "{run}/llama-launcher/..%2F..%2Fetc%2Fx.service.lock"),
    ],
)
def test_the_lock_is_keyed_by_scope_and_unit_name(
    tmp_path: Path, scope: str, unit: str, expected: str
) -> None:
    assert str(home.lock_path(scope, unit)) == expected.format(run=tmp_path / "run")


def test_without_a_record_the_default_folder_is_the_home(private_home: Path) -> None:
    s = settings()
    expected = private_home / "home/.local/state/llama-launcher/llama-server@chat"
    assert home.state_dir(s) == expected
    assert s.resolved_env_file() == private_home / "home/.config/llama-launcher/chat.env"


def test_the_first_command_records_the_folder_it_uses(tmp_path: Path) -> None:
    s = settings(state_dir=tmp_path / "chosen")
    home.claim(s, home.state_dir(s))
    record = json.loads(home.record_path(s.resolved_env_file()).read_text())
    assert record["state_dir"] == str(tmp_path / "chosen")
    assert (record["unit"], record["scope"]) == ("llama-server@chat.service", "user")
    # a later command that names no folder finds the recorded one
    assert home.state_dir(settings()) == tmp_path / "chosen"


def test_a_state_folder_other_than_the_recorded_one_is_refused(tmp_path: Path) -> None:
    default = settings()
    home.claim(default, home.state_dir(default))
    with pytest.raises(StateDirMismatch) as e:
        home.state_dir(settings(state_dir=tmp_path / "other"))
    message = str(e.value)
    assert str(tmp_path / "other") in message
    assert str(home.state_dir(default)) in message
    assert f"--state-dir {home.state_dir(default)}" in message
    assert e.value.exit_code == 2
    assert not (tmp_path / "other").exists()


def test_the_recorded_folder_named_again_is_accepted(tmp_path: Path) -> None:
    default = settings()
    home.claim(default, home.state_dir(default))
    again = settings(state_dir=home.state_dir(default))
    assert home.state_dir(again) == home.state_dir(default)


def test_another_unit_with_the_same_env_file_is_refused(tmp_path: Path) -> None:
    env = tmp_path / "etc/chat.env"
    chat = settings(env_file=env)
    home.claim(chat, home.state_dir(chat))
    with pytest.raises(StateDirMismatch, match=r"is the env file of llama-server@chat\.service"):
        home.state_dir(settings(unit="chat", env_file=env))


def test_an_install_from_before_the_record_keeps_its_folder(tmp_path: Path) -> None:
    """No record yet, and the default folder's live generation is the live env file: a second
    folder named now would adopt it into a second history."""
    old = settings()
    s = store.Store(home.state_dir(old))
    gen = s.new("LLAMA_ARG_X=1\n", {"origin": "install"})
    s.set_live(gen.number)
    old.resolved_env_file().parent.mkdir(parents=True)
    old.resolved_env_file().write_text("LLAMA_ARG_X=1\n")
    with pytest.raises(StateDirMismatch) as e:
        home.state_dir(settings(state_dir=tmp_path / "other"))
    assert f"is generation 1 of {home.state_dir(old)}" in str(e.value)
    assert home.state_dir(old) == s.root  # the old folder itself is fine, unrecorded


def test_the_cli_refuses_a_mismatched_state_dir_with_json(tmp_path: Path) -> None:
    default = settings()
    home.claim(default, home.state_dir(default))
    where = [
        "--unit",
        "llama-server@chat",
        "--scope",
        "user",
        "--state-dir",
        str(tmp_path / "other"),
    ]
    p = subprocess.run(
        [sys.executable, "-m", "launcher", "status", *where, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    out = json.loads(p.stdout)
    assert out["error"] == "StateDirMismatch"
    assert out["state_dir"] == str(tmp_path / "other")
    assert out["recorded_state_dir"] == str(home.state_dir(default))
    assert out["record"] == str(home.record_path(default.resolved_env_file()))
