"""scripts/ansible/inventory.example.ini as shipped, end to end: each unit installed with the
command in the inventory's comment (install's defaults: no env file and no state dir named),
then rollout.yml and rollback.yml with that inventory.

The example's hosts are real boxes reached over SSH as root (system scope). Here they all live
in one systemd manager, the ``Box``: the sandboxed user manager by default. Only what cannot be
the same on a test box is changed, by a second inventory source laid over the shipped one
(``ansible-playbook -i inventory.example.ini -i overlay.yml``; its host values win): the
connection (local, no become), the scope, the binary, the models (tiny copies under the same
names) and free ports. gpu-02 is left out (``--limit``): it stands for a second box with the
same unit as gpu-01. A ``Box`` for the system scope (an nspawn bed, root) needs only its scope,
unit folder and environment.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import tinymodel
from conftest import REPO, Sandbox
from realserver import free_port
from test_ansible import ansible_env, recap

from launcher.deploy import home

ANSIBLE_DIR = REPO / "scripts" / "ansible"
EXAMPLE = ANSIBLE_DIR / "inventory.example.ini"
VENV_BIN = Path(sys.executable).parent
#: gpu-02 is gpu-01's twin on another box: on one box it would be gpu-01's unit again
ONE_BOX = "all:!gpu-02.example.net"


@dataclass
class Box:
    """One systemd manager and the folders the example's commands use on it."""

    scope: str  # "user": the sandbox's manager; "system": a system manager (as root)
    unit_dir: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of os.environ, every command

    def systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        scope = ["--user"] if self.scope == "user" else []
        return subprocess.run(
            ["systemctl", *scope, *args], capture_output=True, text=True, timeout=60, check=False
        )

    def environ(self) -> dict[str, str]:
        env = dict(os.environ, **self.env)
        for key in ("UNIT", "ENV_FILE", "STATE_DIR"):  # the example's commands name no paths
            env.pop(f"LLAMA_LAUNCHER_{key}", None)
        return env


def install_commands(text: str) -> list[tuple[list[str], list[str]]]:
    """The install commands in the inventory's comment: [(host names, install args)]."""
    found = re.findall(r"^#\s+(\S[^:]*):\s+llama-launcher install (.*)$", text, re.MULTILINE)
    return [([h.strip() for h in hosts.split(",")], shlex.split(args)) for hosts, args in found]


def inventory_hosts(text: str) -> dict[str, dict[str, str]]:
    """[llama_servers] host lines -> {host: {var: value}} (inline values only)."""
    section = text.split("[llama_servers]", 1)[1].split("\n[", 1)[0]
    hosts: dict[str, dict[str, str]] = {}
    for line in section.splitlines():
        if line.strip() and not line.startswith("#"):
            name, *pairs = line.split()
            hosts[name] = dict(p.split("=", 1) for p in pairs)
    return hosts


class Example:
    """The shipped inventory on one ``Box``: installs, the overlay, ansible-playbook."""

    def __init__(self, box: Box, root: Path, server: str) -> None:
        self.box, self.root, self.server = box, root, server
        text = EXAMPLE.read_text()
        self.hosts = inventory_hosts(text)
        self.installs = install_commands(text)
        self.ports = {h: free_port() for h in self.hosts}
        self.models: dict[str, Path] = {}
        for _, args in self.installs:  # the example's model names, as tiny models that
            name = Path(args[args.index("-m") + 1]).name  # were trained on its -c 32768
            self.models[name] = root / "models" / name
            self.models[name].parent.mkdir(parents=True, exist_ok=True)
            tinymodel.write(self.models[name], tinymodel.Shape(ctx_train=32768))
        self.installed: list[str] = []
        self.overlay = root / "overlay.yml"
        self.overlay.write_text(json.dumps({"llama_servers": {"hosts": self._overlay()}}))

    def _model_of(self, host: str) -> str:
        name = self.hosts[host].get("llama_model") or _group_var("llama_model")
        return str(self.models[Path(name).name])

    def _overlay(self) -> dict[str, dict[str, Any]]:
        return {
            h: {
                "ansible_connection": "local",
                "ansible_become": False,
                "ansible_python_interpreter": sys.executable,
                "llama_scope": self.box.scope,
                "llama_server_bin": self.server,
                "llama_model": self._model_of(h),
                "llama_port": self.ports[h],
                "llama_start_timeout": 60,
                "llama_health_timeout": 60,
            }
            for h in self.hosts
        }

    def unit(self, host: str) -> str:
        return self.hosts[host].get("llama_unit", "llama-server.service")

    def install(self, *hosts: str) -> None:
        """Run the comment's install command for ``hosts`` (the first host of each line)."""
        for names, args in self.installs:
            host = next(h for h in self.hosts if h.split(".")[0] == names[0].split(".")[0])
            if host not in hosts:
                continue
            args = list(args)
            args[args.index("--llama-server") + 1] = self.server
            args[args.index("-m") + 1] = self._model_of(host)
            args[args.index("--port") + 1] = str(self.ports[host])
            rc, out = self.cli("install", *args)
            self.installed.append(host)
            assert (rc, out.get("outcome")) == (0, "deployed"), out

    def cli(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        p = subprocess.run(
            [sys.executable, "-m", "launcher", *args, "--json"],
            capture_output=True,
            text=True,
            env={**self.box.environ(), **(env or {})},
            timeout=300,
        )
        try:
            return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            msg = f"no JSON from {args}: {p.returncode}\n{p.stdout}\n{p.stderr}"
            raise AssertionError(msg) from None

    def status(self, host: str) -> dict[str, Any]:
        rc, out = self.cli("status", "--unit", self.unit(host))
        assert rc == 0, out
        return out

    def env_file(self, host: str) -> Path:
        return Path(self.status(host)["env_file"])

    def playbook_argv(self, name: str, *args: str) -> tuple[list[str], dict[str, str]]:
        (self.root / "ansible-local").mkdir(mode=0o700, exist_ok=True)
        env = ansible_env(self.root, self.box.environ())
        inventories = ["-i", str(EXAMPLE), "-i", str(self.overlay)]
        playbook = [str(VENV_BIN / "ansible-playbook"), *inventories, str(ANSIBLE_DIR / name)]
        return [*playbook, *args], env

    def playbook(self, name: str, *args: str) -> subprocess.CompletedProcess[str]:
        argv, env = self.playbook_argv(name, *args)
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        print(p.stdout, p.stderr, sep="\n")  # the recap, shown by pytest when a test fails
        return p

    def remove(self) -> None:
        for host in self.installed:
            self.box.systemctl("stop", self.unit(host))
            self.box.systemctl("reset-failed", self.unit(host))
        for unit in ("llama-server.service", "llama-server@.service"):
            (self.box.unit_dir / unit).unlink(missing_ok=True)
        self.box.systemctl("daemon-reload")


def _group_var(name: str) -> str:
    section = EXAMPLE.read_text().split("[llama_servers:vars]", 1)[1]
    return re.findall(rf"^{name}=(.*)$", section, re.MULTILINE)[0]


@pytest.fixture
def box(sandbox: Sandbox, tmp_path: Path) -> Box:
    """The sandbox's user manager, with a HOME of the test's own for the default folders."""
    return Box(
        scope="user",
        unit_dir=sandbox.unit_dir,
        env={
            "HOME": str(tmp_path / "home"),
            "LLAMA_LAUNCHER_SCOPE": "user",
            "LLAMA_LAUNCHER_UNIT_DIR": str(sandbox.unit_dir),
            "LLAMA_LAUNCHER_SETTINGS": str(tmp_path / "no-settings.toml"),
        },
    )


@pytest.fixture
def example(box: Box, tmp_path: Path, llama_server_bin: str) -> Iterator[Example]:
    e = Example(box, tmp_path, llama_server_bin)
    try:
        yield e
    finally:
        e.remove()


CHAT = "gpu-03-chat"


def test_the_comment_installs_every_unit_with_installs_defaults(example: Example) -> None:
    assert [names for names, _ in example.installs] == [
        ["gpu-01", "gpu-02"],
        ["gpu-03-chat"],
        ["gpu-03-code"],
    ]
    for names, args in example.installs:
        assert "--env-file" not in args and "--state-dir" not in args, names
    for host, values in example.hosts.items():
        assert "llama_env_file" not in values and "llama_state_dir" not in values, host


def test_install_rollout_rollback_as_the_example_says(example: Example, box: Box) -> None:
    example.install("gpu-01.example.net", CHAT, "gpu-03-code")
    installed = {h: example.env_file(h).read_text() for h in example.installed}
    p = example.playbook("rollout.yml", "--limit", ONE_BOX)
    assert p.returncode == 0
    r = recap(p.stdout)
    assert {h: (r[h]["changed"], r[h]["failed"]) for h in installed} == dict.fromkeys(
        installed, (1, 0)
    )
    states = Path(box.env["HOME"]) / ".local/state/llama-launcher"
    for host in installed:
        status = example.status(host)  # the CLI, naming no folder, sees what Ansible deployed
        assert status["live_generation"] == 2
        assert status["state_dir"] == str(states / example.unit(host).removesuffix(".service"))
        assert "-c 32768" in example.env_file(host).read_text()
        slots = int(example.hosts[host].get("llama_parallel", _group_var("llama_parallel")))
        assert status["startup"]["n_ctx_slot"] == 32768 // slots
    # one state folder per unit, the ones install made: no second history
    assert sorted(p.name for p in states.iterdir() if p.is_dir()) == sorted(
        example.unit(h).removesuffix(".service") for h in installed
    )

    p = example.playbook("rollback.yml", "--limit", CHAT)
    assert p.returncode == 0
    assert (recap(p.stdout)[CHAT]["changed"], recap(p.stdout)[CHAT]["failed"]) == (1, 0)
    assert example.env_file(CHAT).read_text() == installed[CHAT]
    assert example.status(CHAT)["live_generation"] == 3
    for host in ("gpu-01.example.net", "gpu-03-code"):
        assert example.status(host)["live_generation"] == 2


@pytest.mark.parametrize("record", ["recorded", "installed before the record"])
def test_a_mismatched_state_dir_is_refused_and_nothing_is_adopted(
    example: Example, tmp_path: Path, record: str
) -> None:
    example.install(CHAT)
    env_file = example.env_file(CHAT)
    before = env_file.read_text()
    home_dir = example.status(CHAT)["state_dir"]
    assert json.loads(home.record_path(env_file).read_text())["state_dir"] == home_dir
    if record != "recorded":
        home.record_path(env_file).unlink()  # what an install of an older version leaves
    other = tmp_path / "var/lib/llama-launcher/chat"  # the llama_state_dir
    p = example.playbook("rollout.yml", "--limit", CHAT, "-e", f"llama_state_dir={other}")
    assert p.returncode == 2
    assert recap(p.stdout)[CHAT]["failed"] == 1
    assert "invalid input; nothing was changed" in p.stdout
    assert f"state dir {other} does not manage llama-server@chat.service" in p.stdout
    assert f"pass --state-dir {home_dir}" in p.stdout
    assert not other.exists()
    assert env_file.read_text() == before
    rc, out = example.cli("rollback", "--unit", example.unit(CHAT), "--state-dir", str(other))
    assert (rc, out["error"], out["recorded_state_dir"]) == (2, "StateDirMismatch", home_dir)


def test_an_install_from_before_the_record_is_recorded_by_the_next_deploy(
    example: Example,
) -> None:
    example.install(CHAT)
    env_file = example.env_file(CHAT)
    home_dir = example.status(CHAT)["state_dir"]
    home.record_path(env_file).unlink()  # what an install of an older version leaves
    p = example.playbook("rollout.yml", "--limit", CHAT)
    assert p.returncode == 0
    assert recap(p.stdout)[CHAT]["changed"] == 1
    assert json.loads(home.record_path(env_file).read_text())["state_dir"] == home_dir
    assert example.status(CHAT)["live_generation"] == 2


def _openers(path: Path) -> set[int]:
    """Processes (not this one) with ``path`` open."""
    pids = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        pid = int(fd_dir.parent.name)
        if pid == os.getpid():
            continue
        try:
            if any(os.readlink(fd) == str(path) for fd in fd_dir.iterdir()):
                pids.add(pid)
        except OSError:
            continue  # gone, or not ours to read
    return pids


def test_a_cli_deploy_and_a_module_deploy_of_one_unit_serialize(example: Example) -> None:
    example.install(CHAT)
    unit = example.unit(CHAT)
    lock = home.lock_path(example.box.scope, unit)
    env = {"LLAMA_LAUNCHER_LOCK_TIMEOUT": "300"}
    with open(lock, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # this test holds the unit's lock: both must wait
        cli = subprocess.Popen(
            [sys.executable, "-m", "launcher", "set", "--unit", unit, "-c", "8192", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**example.box.environ(), **env},
        )
        argv, penv = example.playbook_argv(
            "rollout.yml", "--limit", CHAT, "-e", "llama_lock_timeout=300"
        )
        module = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=penv
        )
        try:
            deadline = time.monotonic() + 240
            while len(_openers(lock)) < 2 and time.monotonic() < deadline:
                assert cli.poll() is None and module.poll() is None, "one did not wait"
                time.sleep(0.2)
            waiting = _openers(lock)
            assert cli.pid in waiting and len(waiting) == 2, waiting  # both at the unit's lock
            assert example.status(CHAT)["live_generation"] == 1  # neither got past it
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        cli_out, cli_err = cli.communicate(timeout=300)
        module_out, _ = module.communicate(timeout=300)
    print(module_out)
    assert cli.returncode == 0, cli_err
    assert module.returncode == 0
    _, history = example.cli("history", "--unit", unit)
    chain = [(g["generation"], g["previous"], g["outcome"]) for g in history["generations"]]
    # one after the other: each built on the one before (side by side, both would build on 1)
    assert chain == [(1, None, "deployed"), (2, 1, "deployed"), (3, 2, "deployed")]
    origins = sorted(g["origin"] for g in history["generations"][1:])
    assert origins == ["deploy", "set -c 8192"]
    assert json.loads(cli_out.strip().splitlines()[-1])["generation"] in (2, 3)
