"""Shared fixtures: the real llama-server, tiny models and the sandboxed systemd manager.

Nothing here skips: if a real part is missing, the test that needs it fails with the reason.
``scripts/test`` runs pytest inside ``scripts/sandbox run --`` so ``systemctl --user`` and
``journalctl`` reach the private manager.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import realserver  # noqa: E402
import tinymodel  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


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
        return subprocess.run(["systemctl", "--user", *args], capture_output=True, text=True,
                              check=check, timeout=60)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", "-p", ",".join(props), unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        return subprocess.run(
            ["journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_UNIT={unit}", "+",
             f"_SYSTEMD_USER_UNIT={unit}"], capture_output=True, text=True, timeout=60).stdout


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    root = os.environ.get("LLAMA_LAUNCHER_SANDBOX")
    if not root or not os.environ.get("XDG_RUNTIME_DIR"):
        pytest.fail("not inside the sandboxed systemd: run scripts/test, or "
                    "scripts/sandbox start && scripts/sandbox run -- python -m pytest")
    sb = Sandbox(Path(root))
    state = sb.systemctl("is-system-running", check=False)
    if state.stdout.strip() not in ("running", "degraded"):
        pytest.fail(f"the sandbox manager is not running: {state.stdout}{state.stderr}")
    return sb
