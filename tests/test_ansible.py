"""The Ansible deploy step: ansible-core runs scripts/ansible against three sandboxed units.

Three instances of the template unit ``llama-server@.service`` (a, b, c), each with its own
port, env file and state dir, are installed through the real CLI; an inventory of three
``ansible_connection=local`` hosts points at them. ``ansible-playbook`` runs as a subprocess
with the venv's python as the module interpreter, so the module finds ``llama-launcher`` in
PATH and ``systemctl --user`` reaches the sandbox.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, Host, Sandbox
from test_deploy import BAD_TEMPLATE

ANSIBLE_DIR = REPO / "scripts" / "ansible"
VENV_BIN = Path(sys.executable).parent


def ansible_env(root: Path, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What ansible-playbook and ansible need here: the repository's ansible.cfg, its
    temporary and home folders under ``root`` (remote temp made 0700), no colour, the venv's
    tools first on PATH."""
    (root / "ansible-remote").mkdir(mode=0o700, exist_ok=True)
    return dict(
        base,
        ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"),
        ANSIBLE_LOCAL_TEMP=str(root / "ansible-local"),
        ANSIBLE_REMOTE_TEMP=str(root / "ansible-remote"),
        ANSIBLE_HOME=str(root / "ansible-home"),
        ANSIBLE_NOCOLOR="1",
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )


NAMES = ("a", "b", "c")


class Instance(Host):
    """``llama-server@NAME.service``: env files side by side (the template reads %i.env)."""

    def __init__(self, sandbox: Sandbox, root: Path, name: str, model: Path, server: str) -> None:
        super().__init__(sandbox, root, f"llama-server@{name}", model, server)
        self.name = name
        self.env_file = root / "etc" / f"{name}.env"
        self.state_dir = root / "state" / name
        self.env.update(
            LLAMA_LAUNCHER_ENV_FILE=str(self.env_file),
            LLAMA_LAUNCHER_STATE_DIR=str(self.state_dir),
        )

    def install(self, *flags: str) -> tuple[int, dict[str, Any]]:
        return self.cli_json("install", "--instance", self.name, *self.base_flags(), *flags)

    def host_line(self) -> str:
        return (
            f"{self.name} llama_unit={self.unit} llama_env_file={self.env_file} "
            f"llama_state_dir={self.state_dir} llama_port={self.port}"
        )

    def pid(self) -> str:
        return self.state()["MainPID"]

    def live(self) -> dict[str, Any]:
        rc, out = self.cli_json("status")
        assert rc == 0, out
        return out


class Fleet:
    """Three installed instances, an inventory, and ansible-playbook."""

    def __init__(self, sandbox: Sandbox, root: Path, model: Path, server: str) -> None:
        self.root, self.sandbox = root, sandbox
        self.hosts = {n: Instance(sandbox, root, n, model, server) for n in NAMES}
        self.inventory = root / "inventory" / "hosts.ini"
        self.inventory.parent.mkdir(parents=True)
        lines = ["[llama_servers]", *(h.host_line() for h in self.hosts.values())]
        lines += [
            "",
            "[llama_servers:vars]",
            "ansible_connection=local",
            f"ansible_python_interpreter={sys.executable}",
            "llama_scope=user",
            f"llama_server_bin={server}",
            f"llama_model={model}",
            "llama_ctx_size=4096",
            "llama_parallel=2",
            "llama_start_timeout=30",
            "llama_health_timeout=30",
            "llama_lock_timeout=5",
        ]
        self.inventory.write_text("\n".join(lines) + "\n")

    def host_vars(self, name: str, **values: object) -> None:
        folder = self.inventory.parent / "host_vars"
        folder.mkdir(exist_ok=True)
        (folder / f"{name}.yml").write_text(json.dumps(values) + "\n")  # JSON is YAML

    def playbook(
        self, name: str, *args: str, env_update: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {**ansible_env(self.root), **(env_update or {})}
        for key in ("UNIT", "ENV_FILE", "STATE_DIR"):  # settings come from the inventory only
            env.pop(f"LLAMA_LAUNCHER_{key}", None)
        command = [str(VENV_BIN / "ansible-playbook"), "-i", str(self.inventory)]
        p = subprocess.run(
            [*command, str(ANSIBLE_DIR / name), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        print(p.stdout, p.stderr, sep="\n")  # the recap, shown by pytest when a test fails
        return p

    def remove(self) -> None:
        for h in self.hosts.values():
            h.remove()
        (self.sandbox.unit_dir / "llama-server@.service").unlink(missing_ok=True)
        self.sandbox.systemctl("daemon-reload", check=False)


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP lines -> {host: {ok: n, changed: n, failed: n, ...}}."""
    out: dict[str, dict[str, int]] = {}
    for host, counts in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", output, re.MULTILINE):
        out[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counts)}
    return out


@pytest.fixture
def fleet(
    sandbox: Sandbox, tmp_path: Path, tiny_model: Path, llama_server_bin: str
) -> Iterator[Fleet]:
    """Three instances installed with -c 4096 -np 2 (generation 1 each), serving."""
    from concurrent.futures import ThreadPoolExecutor

    f = Fleet(sandbox, tmp_path, tiny_model, llama_server_bin)
    first, *rest = f.hosts.values()
    try:
        # the first install writes the template unit; the others find it in place
        results = [first.install("-c", "4096", "-np", "2")]
        with ThreadPoolExecutor(len(rest)) as pool:
            results += pool.map(lambda h: h.install("-c", "4096", "-np", "2"), rest)
        for rc, out in results:
            assert (rc, out["outcome"]) == (0, "deployed"), out
        yield f
    finally:
        f.remove()


def test_rollout_updates_every_host_canary_first(fleet: Fleet) -> None:
    p = fleet.playbook("rollout.yml", "-e", "llama_ctx_size=8192")
    assert p.returncode == 0
    r = recap(p.stdout)
    assert {n: (r[n]["changed"], r[n]["failed"]) for n in NAMES} == dict.fromkeys(NAMES, (1, 0))
    # serial [1, 10%, 25%, 100%] on 3 hosts: a alone first (the canary), then b, then c
    assert p.stdout.count("PLAY [Roll out the llama-server config, canary first]") == 3
    for h in fleet.hosts.values():
        live = h.live()
        assert live["live_generation"] == 2
        assert live["startup"]["n_ctx_slot"] == 4096
        assert "-c 8192" in h.env_file.read_text()
        assert h.chat()["usage"]["completion_tokens"] > 0


def test_same_rollout_again_changes_and_restarts_nothing(fleet: Fleet) -> None:
    assert fleet.playbook("rollout.yml", "-e", "llama_ctx_size=8192").returncode == 0
    pids = {n: h.pid() for n, h in fleet.hosts.items()}
    p = fleet.playbook("rollout.yml", "-e", "llama_ctx_size=8192")
    assert p.returncode == 0
    assert all(r["changed"] == 0 and r["failed"] == 0 for r in recap(p.stdout).values())
    assert len(recap(p.stdout)) == 3
    assert {n: h.pid() for n, h in fleet.hosts.items()} == pids
    assert p.stdout.count("unchanged: generation 2, 2 slots x n_ctx_slot 4096") == 3


def test_failing_host_stops_the_rollout_and_is_back_on_its_old_config(fleet: Fleet) -> None:
    a, b, c = fleet.hosts.values()
    old_b, old_c, pid_c = b.env_file.read_text(), c.env_file.read_text(), c.pid()
    template = fleet.root / "bad.jinja"
    template.write_text(BAD_TEMPLATE)
    fleet.host_vars("b", llama_chat_template_file=str(template))
    p = fleet.playbook("rollout.yml", "-e", "llama_ctx_size=8192")
    assert p.returncode == 2  # a host failed
    r = recap(p.stdout)
    assert (r["a"]["changed"], r["a"]["failed"]) == (1, 0)
    assert r["b"]["failed"] == 1
    assert "c" not in r  # the play stopped before c's batch
    assert "fatal: [b]: FAILED!" in p.stdout
    assert "the previous config was restored and serves again" in p.stdout
    assert "refuses the probe" in p.stdout
    # a: the new config, serving
    assert a.live()["startup"]["n_ctx_slot"] == 4096
    assert a.chat()["usage"]["completion_tokens"] > 0
    # b: its old generation again, serving
    assert b.env_file.read_text() == old_b
    assert b.live()["live_generation"] == 1
    assert b.chat()["usage"]["completion_tokens"] > 0
    # c: untouched
    assert (c.env_file.read_text(), c.pid()) == (old_c, pid_c)
    assert c.live()["live_generation"] == 1


def crash_once_baking(h: Instance, generation: int, done: threading.Event) -> None:
    """SIGKILL ``h``'s server once ``generation`` bakes (a config that crashes under load:
    Restart=on-failure starts it again, a hard signal for the bake)."""
    path = h.state_dir / "generations" / f"{generation:04d}" / "bake.json"
    deadline = time.monotonic() + 240
    while not done.is_set() and time.monotonic() < deadline:
        try:
            if json.loads(path.read_text())["state"] == "baking":
                h.sandbox.systemctl("kill", "--signal=SIGKILL", h.unit)
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)


def test_a_canary_whose_bake_reverts_stops_the_play_and_the_others_keep_theirs(
    fleet: Fleet,
) -> None:
    a = fleet.hosts["a"]
    old_a = a.env_file.read_text()
    others = {n: (h.env_file.read_text(), h.pid()) for n, h in fleet.hosts.items() if n != "a"}
    done = threading.Event()
    crash = threading.Thread(target=crash_once_baking, args=(a, 2, done))
    crash.start()
    try:
        p = fleet.playbook(
            "rollout.yml",
            "-e",
            "llama_ctx_size=8192",
            "-e",
            "llama_canary_bake=10m",
            env_update={"LLAMA_LAUNCHER_BAKE_INTERVAL": "2"},
        )
    finally:
        done.set()
        crash.join()
    assert p.returncode == 2  # the canary failed
    r = recap(p.stdout)
    assert r["a"]["failed"] == 1
    assert "b" not in r and "c" not in r  # the play stopped before their batches
    assert "fatal: [a]: FAILED!" in p.stdout
    assert "its bake found it worse under load" in p.stdout
    assert "bake of generation 2: reverted (hard" in p.stdout
    # a: its old config again, as a revert (generation 3), serving
    assert a.env_file.read_text() == old_a
    live = a.live()
    assert live["live_generation"] == 3
    assert a.chat()["usage"]["completion_tokens"] > 0
    # b and c: untouched
    assert {n: (h.env_file.read_text(), h.pid()) for n, h in fleet.hosts.items() if n != "a"} == (
        others
    )


def test_check_mode_shows_the_argv_diff_and_changes_nothing(fleet: Fleet) -> None:
    before = {n: (h.env_file.read_text(), h.pid()) for n, h in fleet.hosts.items()}
    p = fleet.playbook("rollout.yml", "--check", "--diff", "-e", "llama_ctx_size=8192")
    assert p.returncode == 0
    assert all(r["changed"] == 1 for r in recap(p.stdout).values())
    assert p.stdout.count("--- before: llama-server@") == 3
    assert p.stdout.count("\n--c 4096\n") == 3
    assert p.stdout.count("\n+-c 8192\n") == 3
    assert "-# KV pool: 2 slots x n_ctx_slot 2048" in p.stdout
    assert "+# KV pool: 2 slots x n_ctx_slot 4096" in p.stdout
    assert "+# guaranteed per-slot window: 4096 tokens" in p.stdout
    assert p.stdout.count("checked: generation -, 2 slots x n_ctx_slot 4096") == 3
    # the desired argv is the one the deploy writes: the slot carry's folder stays
    assert "\n---slot-save-path" not in p.stdout and "\n+--slot-save-path" not in p.stdout
    assert {n: (h.env_file.read_text(), h.pid()) for n, h in fleet.hosts.items()} == before
    assert all(h.live()["live_generation"] == 1 for h in fleet.hosts.values())


def test_invalid_config_stops_at_the_canary_before_anything_changes(fleet: Fleet) -> None:
    before = {n: (h.env_file.read_text(), h.pid()) for n, h in fleet.hosts.items()}
    p = fleet.playbook("rollout.yml", "-e", "llama_parallel=0")
    assert p.returncode == 2
    assert list(recap(p.stdout)) == ["a"]  # the canary failed: b and c were never tried
    assert "invalid input; nothing was changed" in p.stdout
    assert "-np 0 is out of range" in p.stdout
    assert {n: (h.env_file.read_text(), h.pid()) for n, h in fleet.hosts.items()} == before


def test_fleet_rollback_needs_the_hosts_named(fleet: Fleet) -> None:
    before = {n: h.env_file.read_text() for n, h in fleet.hosts.items()}
    p = fleet.playbook("rollback.yml")
    assert p.returncode != 0
    assert "name the hosts to roll back with --limit" in p.stdout
    assert {n: h.env_file.read_text() for n, h in fleet.hosts.items()} == before


def test_fleet_rollback_in_check_mode_reports_and_changes_nothing(fleet: Fleet) -> None:
    pids = {n: h.pid() for n, h in fleet.hosts.items()}
    p = fleet.playbook("rollback.yml", "--check", "-e", "llama_rollback_all=true")
    assert p.returncode == 0, p.stdout
    assert p.stdout.count("checked: generation -") == 3
    assert {n: h.pid() for n, h in fleet.hosts.items()} == pids


def test_fleet_rollback_restores_the_previous_config_everywhere(fleet: Fleet) -> None:
    first = {n: h.env_file.read_text() for n, h in fleet.hosts.items()}
    assert fleet.playbook("rollout.yml", "-e", "llama_ctx_size=8192").returncode == 0
    p = fleet.playbook("rollback.yml", "-e", "llama_rollback_all=true")
    assert p.returncode == 0
    assert all(r["changed"] == 1 and r["failed"] == 0 for r in recap(p.stdout).values())
    for n, h in fleet.hosts.items():
        assert h.env_file.read_text() == first[n]
        live = h.live()
        assert (live["live_generation"], live["startup"]["n_ctx_slot"]) == (3, 2048)
        assert h.chat()["usage"]["completion_tokens"] > 0


def test_api_key_never_appears_in_ansible_output(fleet: Fleet) -> None:
    import httpx

    fleet.host_vars("a", llama_api_key="s3cret-ansible-key")
    p = fleet.playbook("rollout.yml", "--diff", "-v", "--limit", "a")
    assert p.returncode == 0
    assert "s3cret-ansible-key" not in p.stdout + p.stderr
    a = fleet.hosts["a"]
    assert "API_KEY_FILE=" in a.env_file.read_text()
    ok = httpx.get(a.url + "/props", headers={"Authorization": "Bearer s3cret-ansible-key"})
    assert ok.status_code == 200
    # the temporary TOML is gone: the key is only in the launcher's 0600 key file
    holders = [
        f.relative_to(fleet.root)
        for f in fleet.root.rglob("*")
        if f.is_file() and b"s3cret-ansible-key" in f.read_bytes()
    ]
    assert [str(h) for h in holders if h.parts[0] != "inventory"] == [
        str(next((a.state_dir / "keys").iterdir()).relative_to(fleet.root))
    ]


def _module() -> Any:
    import importlib.util

    path = ANSIBLE_DIR / "library" / "llama_launcher.py"
    spec = importlib.util.spec_from_file_location("ansible_llama_launcher", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_module_options_are_the_launcher_config_and_settings() -> None:
    from launcher.config import ServerConfig, ToolSettings, VllmConfig

    m = _module()
    assert set(m.CONFIG_SPEC) == set(ServerConfig.model_fields) | set(VllmConfig.model_fields)
    assert set(m.SETTINGS_SPEC) <= set(ToolSettings.model_fields)
    assert m.argument_spec()["api_key"]["no_log"] is True


def test_module_documentation_matches_its_argument_spec() -> None:
    import yaml

    m = _module()
    docs = yaml.safe_load(m.DOCUMENTATION)["options"]
    spec = m.argument_spec()
    assert set(docs) == set(spec)
    for name, option in spec.items():
        assert docs[name]["type"] == option["type"], name
        assert docs[name].get("choices") == option.get("choices"), name
        assert docs[name].get("default") == option.get("default"), name
    yaml.safe_load(m.EXAMPLES)
    assert "outcome" in yaml.safe_load(m.RETURN)


@pytest.mark.parametrize(
    "data",
    [
        {"model": "/srv/models/m.gguf", "port": 8081, "ctx_size": 8192, "kv_unified": False},
        {"alias": 'a "quoted" name \\ with backslash', "api_key": "k\u00e9y-\t-tab"},
        {"extra_args": ["--temp", "0.7", "--spm-infill"], "flash_attn": "on"},
        {"alias": "llama \U0001f999 beyond the BMP", "api_key": "del\x7f-and-\x1f"},
    ],
)
def test_desired_config_survives_the_toml_file(data: dict[str, Any]) -> None:
    import tomllib

    m = _module()
    assert tomllib.loads(m.render_toml(data)) == data


def test_the_diff_says_where_clients_reach_a_server_behind_a_front() -> None:
    planned = {"n_slots": 2, "front": {"public": "0.0.0.0:8080", "server": "127.0.0.1:41000"}}
    lines = _module().plan_lines(planned)
    assert lines[-1] == (
        "# address: clients use 0.0.0.0:8080 (the front); llama-server listens on 127.0.0.1:41000"
    )
    assert not any("address" in line for line in _module().plan_lines({"n_slots": 2}))


@pytest.mark.parametrize(("given", "passed"), [(True, "on"), (False, "off"), ("auto", "auto")])
def test_yaml_booleans_for_flash_attn_become_on_off(given: object, passed: str) -> None:
    params = dict.fromkeys(_module().CONFIG_SPEC) | {"flash_attn": given}
    assert _module().desired_config(params) == {"flash_attn": passed}


@pytest.mark.parametrize(
    "word", ["-c", "--port", "--port=8080", "-1", "-0.5", "-1.2.3", "-x1", "--", "8080", "q8_0", ""]
)
def test_the_module_tells_flags_from_values_as_the_launcher_does(word: str) -> None:
    from launcher.host import envfile

    assert _module().is_flag(word) == envfile.is_flag(word)


def test_playbooks_pass_ansible_lint(tmp_path: Path) -> None:
    # --offline: no Galaxy lookups; the playbooks use ansible.builtin and the local module only
    lint = [str(VENV_BIN / "ansible-lint"), "--offline", "--nocolor", "--profile", "production"]
    p = subprocess.run(
        [*lint, "rollout.yml", "rollback.yml"],
        cwd=ANSIBLE_DIR,
        capture_output=True,
        text=True,
        env=dict(
            os.environ,
            HOME=str(tmp_path),
            XDG_CACHE_HOME=str(tmp_path / "cache"),
            ANSIBLE_HOME=str(tmp_path / "ansible-home"),
            ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-local"),
            PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        ),
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 failure(s), 0 warning(s)" in p.stdout + p.stderr


def _adhoc(host: Host, args: dict[str, Any], *flags: str) -> subprocess.CompletedProcess[str]:
    """The module alone, as an ad-hoc task on localhost (no playbook, no fleet)."""
    env = ansible_env(host.root)
    task = {
        "unit": host.unit,
        "scope": "user",
        "env_file": str(host.env_file),
        "state_dir": str(host.state_dir),
        "llama_server": host.server,
        "model": str(host.model),
        "port": host.port,
        **args,
    }
    return subprocess.run(
        [
            str(VENV_BIN / "ansible"),
            "localhost",
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            "-m",
            "llama_launcher",
            "-a",
            json.dumps(task),
            *flags,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_module_force_memory_passes_the_memory_guard(host: Host) -> None:
    rc, out = host.install("-c", "4096", "-np", "2")
    assert rc == 0, out
    huge = {"ctx_size": 64 << 20, "parallel": 1}  # 32 GiB of f16 KV on the tiny model
    refused = _adhoc(host, huge, "--check")
    assert refused.returncode != 0
    assert "MemoryGuardError" in refused.stdout and "--force-memory" in refused.stdout
    forced = _adhoc(host, {**huge, "force_memory": True, "unified_memory": "no"}, "--check")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert '"outcome": "checked"' in forced.stdout


def test_module_checks_a_vllm_config_in_vllms_own_spellings(host: Host) -> None:
    import realvllm

    vllm = {
        "llama_server": None,
        "backend": "vllm",
        "vllm_python": realvllm.vllm_python(),
        "model": str(realvllm.tiny_model()),
        "max_model_len": 2048,
        "max_num_seqs": 2,
        "kv_cache_memory_bytes": "128M",
    }
    p = _adhoc(host, vllm, "--check", "--diff")
    assert p.returncode == 0, p.stdout + p.stderr
    assert '"outcome": "checked"' in p.stdout and "+--max-num-seqs 2" in p.stdout, p.stdout
    refused = _adhoc(host, {**vllm, "kv_cache_memory_bytes": "512K"}, "--check")
    assert refused.returncode != 0 and "less than one sequence" in refused.stdout


def test_module_routes_long_prompts_to_a_lane_address(host: Host) -> None:
    """An inventory's lane address on another host: the task's front routes there, once."""
    from launcher.deploy.restart.front import Front

    rc, out = host.install("-c", "2048", "-np", "2", "--front", "haproxy")
    assert rc == 0, out
    try:
        lane = {"ctx_size": 2048, "parallel": 2, "lane": "far", "lane_address": "10.0.0.9:8081"}
        lane["lane_threshold"] = 4096
        first = _adhoc(host, lane)
        assert first.returncode == 0, first.stdout + first.stderr
        assert '"changed": true' in first.stdout
        spec = Front(host.state_dir, host.unit, "user").spec()
        assert spec is not None
        assert (spec.lane, spec.lane_host, spec.lane_port, spec.lane_threshold) == (
            "far",
            "10.0.0.9",
            8081,
            4096,
        )
        again = _adhoc(host, lane)
        assert again.returncode == 0, again.stdout + again.stderr
        assert '"changed": false' in again.stdout
    finally:
        host.remove()
