"""The system-scope test bed (scripts/sysbed) from the tests' side.

``Bed`` boots a throwaway systemd as PID 1 of an nspawn container and runs commands in it as
its root: the real ``llama-launcher`` CLI, ``systemctl``, ``journalctl``, ``systemd-analyze``.
Files the tests write into ``Bed.share`` on the host are seen read-only at ``/srv/sysbed``
inside. ``bed()`` always stops it, also when a test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "sysbed"
INSIDE_SHARE = Path("/srv/sysbed")
VENV_BIN = Path(sys.executable).parent


class Bed:
    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.share = root / "share"
        self.env = dict(
            os.environ, LLAMA_LAUNCHER_SYSBED=str(root), LLAMA_LAUNCHER_SYSBED_NAME=name
        )

    def _script(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(SCRIPT), *args], capture_output=True, text=True, env=self.env, timeout=timeout
        )

    def start(self) -> str:
        p = self._script("start")
        if p.returncode != 0:
            raise RuntimeError(f"scripts/sysbed start failed: {p.stderr}{p.stdout}")
        return p.stdout

    def stop(self) -> str:
        return self._script("stop").stdout

    def reboot(self) -> str:
        p = self._script("reboot")
        if p.returncode != 0:
            raise RuntimeError(f"scripts/sysbed reboot failed: {p.stderr}{p.stdout}")
        return p.stdout

    def inside(self, path: Path) -> str:
        """The path inside the bed of a file under ``share``."""
        return str(INSIDE_SHARE / path.relative_to(self.share))

    def run(
        self, *argv: str, env: dict[str, str] | None = None, timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        pairs = [f"{k}={v}" for k, v in (env or {}).items()]
        return self._script("run", "--", "env", *pairs, *argv, timeout=timeout)

    def cli(
        self, *args: str, env: dict[str, str] | None = None, exe: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The real CLI inside the bed, as root, in system scope (the default there): the
        test venv's, or ``exe`` (one installed in the bed)."""
        return self.run(exe or str(VENV_BIN / "llama-launcher"), *args, env=env)

    def cli_json(
        self, *args: str, env: dict[str, str] | None = None, exe: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        p = self.cli(*args, "--json", env=env, exe=exe)
        try:
            return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise AssertionError(
                f"no JSON from {args}: rc={p.returncode}\n{p.stdout}\n{p.stderr}"
            ) from None

    def systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", *args)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", "-p", ",".join(props), unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-o", "cat", "-u", unit).stdout

    def read(self, path: str) -> str:
        p = self.run("cat", path)
        if p.returncode != 0:
            raise FileNotFoundError(f"{path} inside the bed: {p.stderr.strip()}")
        return p.stdout

    def tree(self) -> dict[str, Any]:
        """What llama-launcher and systemd keep for the units, inside the bed, as data to
        compare byte for byte: every file and link under ``HOST_TREES`` (type, mode, owner,
        sha256 or link target) and systemd's list of the llama-server unit files."""
        p = self.run("/usr/bin/python3", "-c", _TREE, *HOST_TREES)
        if p.returncode != 0:
            raise RuntimeError(f"the tree of the bed: {p.stderr}")
        files = json.loads(p.stdout)
        units = self.systemctl(
            "list-unit-files", "--no-legend", "--no-pager", "llama-server*"
        ).stdout
        return {"files": files, "unit_files": sorted(units.split("\n"))}

    def chat(
        self, port: int, key: str | None = None, content: str = "hi"
    ) -> tuple[int, dict[str, Any]]:
        """A real chat completion of ``content`` from inside the bed's network (HTTP
        status, body)."""
        p = self.run(str(VENV_BIN / "python"), "-c", _CHAT, str(port), key or "", content)
        code, _, body = p.stdout.partition("\n")
        try:
            data = json.loads(body)
        except ValueError:
            data = {"raw": body, "stderr": p.stderr}
        return int(code or 0), data


#: Where install, a deploy and systemd put what they keep for a unit (the units and their
#: wants links, the env files and records, the generations, the service's own state and its
#: /var/lib link, the locks).
HOST_TREES = (
    "/etc/systemd/system",
    "/etc/llama-launcher",
    "/var/lib/llama-launcher",
    "/var/lib/private",
    "/var/lib/llama-server*",
    "/run/lock/llama-launcher",
)

# The tree of some folders as JSON, run inside the bed. A lock file's bytes are the pid of
# its last holder (deploy/store.py), not state: only its mode and owner are compared.
_TREE = """
import glob, hashlib, json, os, stat, sys
out = {}
def entry(p):
    st = os.lstat(p)
    kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"
    what = None
    if kind == "link":
        what = os.readlink(p)
    elif kind == "file" and not p.endswith(".lock"):
        with open(p, "rb") as f:
            what = hashlib.sha256(f.read()).hexdigest()
    out[p] = [kind, oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid, what]
for pattern in sys.argv[1:]:
    for root in sorted(glob.glob(pattern)):
        entry(root)
        if os.path.isdir(root) and not os.path.islink(root):
            for d, dirs, files in os.walk(root):
                for name in sorted(dirs + files):
                    entry(os.path.join(d, name))
print(json.dumps(out, sort_keys=True))
"""

# A chat completion with the standard library, run inside the bed (its own network).
_CHAT = """
import json, sys, urllib.error, urllib.request
port, key, content = sys.argv[1], sys.argv[2], sys.argv[3]
body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
    json.dumps(body).encode(), {"Content-Type": "application/json"})
if key:
    req.add_header("Authorization", f"Bearer {key}")
try:
    with urllib.request.urlopen(req, timeout=30) as r:
        print(r.status); print(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); print(e.read().decode())
"""


def share_model(b: Bed, model: Path) -> str:
    """``model`` copied into the bed's share, readable by the service's own user; its path
    inside the bed."""
    (b.share / "models").mkdir(mode=0o755, exist_ok=True)
    shared = b.share / "models" / model.name
    shutil.copy(model, shared)
    os.chmod(shared, 0o644)
    return b.inside(shared)


def state_folder(tmp_path_factory: Any, name: str) -> Path:
    """Where a bed keeps its state: under scripts/test's sandbox folder when there is one
    (its exit trap stops every bed left there, should pytest itself be killed)."""
    sandbox = os.environ.get("LLAMA_LAUNCHER_SANDBOX")
    if sandbox and Path(sandbox).is_dir():
        folder = Path(sandbox) / "sysbeds" / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return Path(tmp_path_factory.mktemp(name))


@contextmanager
def bed(root: Path, name: str) -> Iterator[Bed]:
    """A booted bed in ``root`` (its state folder), stopped whatever happens."""
    if os.geteuid() != 0:
        raise RuntimeError("the system-scope bed needs root (it boots systemd-nspawn)")
    if not shutil.which("systemd-nspawn"):
        raise RuntimeError("systemd-nspawn is missing: scripts/setup installs systemd-container")
    b = Bed(root, name)
    b.share.mkdir(parents=True, exist_ok=True)
    os.chmod(b.share, 0o755)
    try:
        b.start()
        yield b
    finally:
        b.stop()
