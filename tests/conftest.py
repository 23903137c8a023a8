"""Shared fixtures: the real llama-server, tiny models and the sandboxed systemd manager.

A real part that is missing fails the test that needs it, with the reason: nothing here skips.
Tests elsewhere skip in three places, where the host cannot give what they test, each saying why
(``-ra`` lists them): tests/test_slot_files.py's moves across filesystems where /dev/shm is not a
filesystem of its own, and its moves that keep an owner where the run is not root (``chown``);
tests/test_second_instance.py's OOM kill where the sandbox's manager has the memory controller on
neither cgroup hierarchy (v2 for ``MemoryMax=``, or v1 as a hybrid host has it).

``scripts/test`` runs pytest inside ``scripts/sandbox run --`` so ``systemctl --user`` and
``journalctl`` reach the private manager.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from launcher import config

sys.path.insert(0, str(Path(__file__).parent))

import realserver
import tinymodel

REPO = Path(__file__).resolve().parent.parent


#: Llama-3.1-8B's layout at Q8_0 (7.9 GiB of tensors, no weights: a sparse file)
LLAMA_8B = tinymodel.Shape(layers=32, n_embd=4096, heads=32, kv_heads=8, ff=14336, ctx_train=131072)


def one_slot_config(server: str, model: Path, **fields: Any) -> config.ServerConfig:
    """A one-slot config of ``model``, 32k by default (the memory guard's usual case)."""
    from launcher import config

    return config.build(
        {"llama_server": server, "model": str(model), "ctx_size": 32768, "parallel": 1, **fields}
    )


@pytest.fixture(scope="module")
def model_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sparse GGUF with Llama-3.1-8B's layout, for the memory guard on boxes with devices."""
    path = tmp_path_factory.mktemp("sparse") / "llama-8b-q8_0.gguf"
    return tinymodel.write_layout(path, LLAMA_8B, n_vocab=32000, merges=0)


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    """Logs the real llama-server writes in this run (scripts/repro.py): the seed's shared-pool
    overflow (as text, and as --log-jsonl at -lv 4), a single request too long for its slot,
    and a healthy run. Values are ``repro.Run``."""
    sys.path.insert(0, str(REPO / "scripts"))
    import repro

    d = tmp_path_factory.mktemp("repro")
    return {
        "overflow": repro.overflow(tiny_model, d / "overflow.log"),
        "jsonl": repro.overflow(tiny_model, d / "jsonl.log", ("--log-jsonl", "-lv", "4")),
        "too_long": repro.too_long(tiny_model, d / "too_long.log"),
        "healthy": repro.healthy(tiny_model, d / "healthy.log"),
    }


@pytest.fixture(scope="session")
def llama_server_bin() -> str:
    path = realserver.server_binary()
    if not os.access(path, os.X_OK):
        pytest.fail(f"llama-server at {path} is not executable")
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tinymodel.write(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture
def make_model(tmp_path: Path) -> Callable[..., Path]:
    def make(name: str = "m.gguf", **shape: object) -> Path:
        return tinymodel.write(tmp_path / name, tinymodel.Shape(**shape))  # type: ignore[arg-type]

    return make


class Sandbox:
    """The private systemd user manager started by scripts/sandbox."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.unit_dir = root / "units"

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["systemctl", "--user", *args], capture_output=True, text=True, check=check, timeout=60
        )

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", "-p", ",".join(props), unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def cursor(self) -> str:
        import json

        out = subprocess.run(
            ["journalctl", "--no-pager", "-n", "1", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        return str(json.loads(out.splitlines()[-1])["__CURSOR"]) if out.strip() else ""

    def log_as(self, unit: str, *lines: str) -> None:
        """``lines`` in the journal as unit ``unit`` logs them, then ``pid N`` (its pid): a
        transient oneshot prints them and waits (10 s at most) until journald has its last
        line under the unit's name. journald reads a process's unit from its cgroup as it
        takes its lines in, so the lines of a process already gone would have none."""
        match = f"_SYSTEMD_UNIT={unit} + _SYSTEMD_USER_UNIT={unit}"
        script = (
            f"printf '%s\\n' {' '.join(shlex.quote(line) for line in lines)}; echo \"pid $$\"; "
            f'n=0; until journalctl -q --no-pager -o cat {match} | grep -qx "pid $$" '
            "|| [ $n -ge 200 ]; do n=$((n + 1)); sleep 0.05; done"
        )
        subprocess.run(
            ["systemd-run", "--user", "--quiet", "--collect", f"--unit={unit}",
             "-p", "Type=oneshot", "/bin/sh", "-c", script.replace("$", "$$")],
            check=True, timeout=60, capture_output=True,
        )  # fmt: skip

    def journal(self, unit: str, after: str = "") -> str:
        """The unit's messages (after the cursor ``after``: unit names recur across runs)."""
        args = ["--after-cursor", after] if after else []
        return subprocess.run(
            [
                "journalctl",
                "--no-pager",
                "-o",
                "cat",
                *args,
                f"_SYSTEMD_UNIT={unit}",
                "+",
                f"_SYSTEMD_USER_UNIT={unit}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    root = os.environ.get("LLAMA_LAUNCHER_SANDBOX")
    if not root or not os.environ.get("XDG_RUNTIME_DIR"):
        pytest.fail(
            "not inside the sandboxed systemd: run scripts/test, or "
            "scripts/sandbox start && scripts/sandbox run -- python -m pytest"
        )
    sb = Sandbox(Path(root))
    state = sb.systemctl("is-system-running", check=False)
    if state.stdout.strip() not in ("running", "degraded"):
        pytest.fail(f"the sandbox manager is not running: {state.stdout}{state.stderr}")
    return sb


class Host:
    """One llama-server unit in the sandbox, driven through the real CLI."""

    def __init__(self, sandbox: Sandbox, root: Path, name: str, model: Path, server: str) -> None:
        self.sandbox, self.root, self.model, self.server = sandbox, root, model, server
        self.unit = f"{name}.service"
        self.port = realserver.free_port()
        self.env_file = root / "etc" / f"{name}.env"
        self.state_dir = root / "state"
        self.url = f"http://127.0.0.1:{self.port}"
        self.cursor = sandbox.cursor()
        self.env = dict(
            os.environ,
            LLAMA_LAUNCHER_UNIT=self.unit,
            LLAMA_LAUNCHER_SCOPE="user",
            LLAMA_LAUNCHER_ENV_FILE=str(self.env_file),
            LLAMA_LAUNCHER_STATE_DIR=str(self.state_dir),
            LLAMA_LAUNCHER_UNIT_DIR=str(sandbox.unit_dir),
            LLAMA_LAUNCHER_START_TIMEOUT="30",
            LLAMA_LAUNCHER_HEALTH_TIMEOUT="30",
            LLAMA_LAUNCHER_LOCK_TIMEOUT="5",
            LLAMA_SERVER_BIN=server,
        )

    def base_flags(self) -> list[str]:
        return ["-m", str(self.model), "--port", str(self.port), "--llama-server", self.server]

    def cli(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "launcher", *args],
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            timeout=timeout,
        )

    def cli_json(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        import json

        p = self.cli(*args, "--json", env=env)
        try:
            return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            msg = f"no JSON from {args}: rc={p.returncode}\n{p.stdout}\n{p.stderr}"
            raise AssertionError(msg) from None

    def install(self, *flags: str) -> tuple[int, dict[str, Any]]:
        return self.cli_json("install", *self.base_flags(), *flags)

    def state(self) -> dict[str, str]:
        return self.sandbox.show(
            self.unit, "ActiveState", "SubState", "MainPID", "NRestarts", "ExecMainStatus", "Result"
        )

    def settled(self, timeout: float = 120) -> dict[str, str]:
        """The unit's state once systemd has no job queued or running for it (a restart a
        killed deploy asked for with --no-block runs on without the deploy)."""
        deadline = time.monotonic() + timeout
        while self.unit in self.sandbox.systemctl("list-jobs", "--no-legend").stdout:
            assert time.monotonic() < deadline, f"{self.unit} still has a job after {timeout}s"
            time.sleep(0.1)
        return self.state()

    def chat(self) -> dict[str, Any]:
        import httpx

        r = httpx.post(
            self.url + "/v1/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def journal(self) -> str:
        return self.sandbox.journal(self.unit, self.cursor)

    def remove(self) -> None:
        """The test's teardown: every unit of this host stopped and its files removed, the
        unit, its sampler, and each one named after it (``NAME-*``, an instance's with ``@``
        as ``-``: its front, release watcher, second instance and its timer, lanes) in two
        systemctl calls. What ``uninstall`` does, without its steps (tests/test_*.py test
        those); the hosts of a run have names no other one's begins with and end before the
        next one begins."""
        import shutil

        from launcher.host import timer

        stem = self.unit.removesuffix(".service")
        stems = {stem, stem.replace("@", "-", 1)}
        sampler = timer.names(self.unit)
        names = [self.unit, *sampler, *(f"{s}-*" for s in sorted(stems))]
        self.sandbox.systemctl("stop", *names, check=False)
        self.sandbox.systemctl("reset-failed", *names, check=False)
        unit_dir = self.sandbox.unit_dir
        files = [unit_dir / self.unit, unit_dir / f"{self.unit}.d"]
        files += [unit_dir / n for n in sampler]
        files += [f for s in stems for f in unit_dir.glob(f"{s}-*")]
        for f in files:
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)


def taken_at_restart(host: Host, *args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """``set --port N ARGS --json`` whose new server cannot bind N: another process takes N
    after the validation (which refuses a port held before it, step ``port``) and before the
    restart (tests/faults.py waits there). The finished CLI, and N."""
    import json
    import socket

    port = realserver.free_port()
    go = host.root / f"go-{port}"
    faults = str(Path(__file__).with_name("faults.py"))
    argv = [sys.executable, faults, f"restart:wait:{go}", "set", "--port", str(port), *args]
    with subprocess.Popen(
        [*argv, "--json"], env=host.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as p:
        deadline = time.monotonic() + 60
        while True:
            try:
                txn = json.loads((host.state_dir / "txn.json").read_text())
            except (OSError, ValueError):
                txn = {}
            if txn.get("phase") == "restart":
                break
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the deploy never reached its restart"
            time.sleep(0.02)
        with socket.socket() as taken:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("127.0.0.1", port))
            taken.listen()
            go.touch()
            stdout, stderr = p.communicate(timeout=180)
    return subprocess.CompletedProcess(argv, p.returncode, stdout, stderr), port


@pytest.fixture
def host(
    sandbox: Sandbox,
    tmp_path: Path,
    tiny_model: Path,
    llama_server_bin: str,
    request: pytest.FixtureRequest,
) -> Iterator[Host]:
    """A fresh unit (its own name, port, env file and state dir) for one test."""
    import hashlib
    import re
    import shutil

    words = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")
    if len(words) > 40:  # cut short, and told apart from a test whose name begins the same
        words = words[:33].strip("-") + "-" + hashlib.sha1(words.encode()).hexdigest()[:6]
    name = "ll-" + words
    model = tmp_path / "model.gguf"
    shutil.copy(tiny_model, model)
    h = Host(sandbox, tmp_path, name, model, llama_server_bin)
    yield h
    h.remove()
