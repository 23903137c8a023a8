"""The generation store: every deployed env file, its metadata, the transaction record, the
lock, and the atomic swap of the live env file.

Layout of the state dir::

    txn.json                the transaction record; exists only while a deploy runs
    generations/NNNN/env    the rendered env file of generation NNNN
    generations/NNNN/meta.json  argv, masked config, model identity, build, times, outcome, ...
    live                    the number of the generation in the live env file

The lock (flock(2): one deploy at a time) is the unit's, outside the state dir
(``launcher.deploy.home.lock_path``), so that two state dirs cannot deploy one unit at once; a Store
made without a lock path locks ``<state dir>/lock``.

At every instant the live env file is either the old or the new one, whole (write a temp
file, fsync, rename, fsync the directory), and the previous generation stays on disk.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from launcher.errors import ConfigInvalid, LockTimeout, StoreError, SwapFailed

_F = TypeVar("_F", bound=Callable[..., Any])

#: The temporary names ``atomic_write`` gives its files: ``.<name>.tmp-<pid>``.
TEMP_NAME = re.compile(r"^\..+\.tmp-(?P<pid>\d+)$")

#: What to do about a failed write, by errno (the flag that moves the folder is appended).
_FIXES = {
    errno.EROFS: "its file system is mounted read-only: remount it read-write, or",
    errno.EACCES: "this user may not write there: run as its owner (or root), fix its "
    "permissions, or",
    errno.EPERM: "this user may not write there: run as its owner (or root), fix its "
    "permissions, or",
    errno.ENOSPC: "the disk is full: free space, or",
    errno.EDQUOT: "the disk quota is used up: free space, or",
}


def write_failed(e: OSError, folder: Path, option: str) -> str:
    """``cannot write PATH: REASON; FIX`` for an OSError under ``folder``."""
    where = e.filename or folder
    fix = _FIXES.get(e.errno or 0, "fix the file system there, or")
    return f"cannot write {where}: {e.strerror or e}; {fix} point {option} at another folder"


def nothing_live_changed(e: OSError | StoreError, root: Path) -> StoreError:
    """A failure before the swap: the error says nothing live was changed."""
    if isinstance(e, StoreError):
        return StoreError(f"{e}; nothing live was changed")
    return StoreError(
        f"cannot write the new generation to {root}: {e}; nothing live was changed (free "
        "space or fix the permissions, then retry)"
    )


#: Outcomes that make a generation "known good".
GOOD = ("deployed",)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path, data: bytes, mode: int = 0o600, like: Path | None = None, durable: bool = True
) -> None:
    """Replace ``path`` with ``data`` atomically, keeping the owner and mode of ``like``
    (default: of ``path`` itself when it exists, else ``mode``).

    ``durable``: fsync the file and its folder, so the change survives a power loss too;
    without it the rename is still atomic for any crash of the process (kill -9).
    """
    ref = like if like is not None else path
    try:
        st = ref.stat()
        mode, uid, gid = st.st_mode & 0o7777, st.st_uid, st.st_gid
    except FileNotFoundError:
        uid, gid = -1, -1
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if uid != -1 and os.geteuid() == 0:
            os.chown(tmp, uid, gid)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if durable:
        _fsync_dir(path.parent)


def write_json(path: Path, data: dict[str, Any], durable: bool = True) -> None:
    atomic_write(
        path, (json.dumps(data, indent=2, default=str) + "\n").encode(), 0o600, durable=durable
    )


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise StoreError(f"cannot read {path}: {e}; move it aside to continue") from e
    if not isinstance(data, dict):
        raise StoreError(f"{path} is not a JSON object; move it aside to continue")
    return data


def runs_vllm(meta: dict[str, Any] | None) -> bool:
    """Whether a generation's ``meta`` runs vLLM (``install --backend vllm``, recorded in
    its config) rather than llama-server."""
    return ((meta or {}).get("config") or {}).get("backend") == "vllm"


@dataclass(frozen=True)
class Generation:
    number: int
    path: Path
    meta: dict[str, Any]

    @property
    def env_text(self) -> str:
        """The stored env file, as its bytes read (no newline translation: a rollback puts
        back exactly these bytes; bytes that are not UTF-8 read as U+FFFD, like the live
        file's, ``Reverter.live_text``)."""
        try:
            return (self.path / "env").read_bytes().decode("utf-8", "replace")
        except OSError as e:
            raise StoreError(
                f"cannot read generation {self.number}'s env file {e.filename}: {e.strerror}; "
                "fix its permissions, or see llama-launcher history for another generation"
            ) from e

    @property
    def outcome(self) -> str:
        return str(self.meta.get("outcome", "pending"))

    @property
    def good(self) -> bool:
        return self.outcome in GOOD


def _writes(method: _F) -> _F:
    """An OSError of a Store method that writes becomes a ``StoreError`` naming the path and
    the fix (a read-only or full state dir is a clear error, never a traceback)."""

    @functools.wraps(method)
    def wrapper(self: Store, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except OSError as e:
            raise StoreError(write_failed(e, self.root, "--state-dir")) from e

    return cast(_F, wrapper)


class Store:
    """The state dir of one unit, and the unit's lock at ``lock_path``."""

    def __init__(self, root: Path, lock_path: Path | None = None) -> None:
        self.root = root
        self.gen_dir = root / "generations"
        self.txn_path = root / "txn.json"
        self.lock_path = lock_path or root / "lock"

    @_writes
    def ensure(self) -> None:
        self.gen_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    # -- lock ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, timeout: float) -> Iterator[None]:
        """Hold the unit's exclusive lock; wait up to ``timeout`` seconds for it. The state
        dir is made only when the lock lives in it (the caller makes it otherwise)."""
        if self.lock_path.parent == self.root:
            self.ensure()
        try:
            self.lock_path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise StoreError(write_failed(e, self.lock_path.parent, "XDG_RUNTIME_DIR")) from e
        try:
            try:
                # imported here: the unit's prestart step uses this module under python -S
                from launcher import waits

                waits.lock(waits.Waits(lock=timeout))(_try_lock, fd)
            except BlockingIOError:
                raise LockTimeout(
                    f"another deploy holds {self.lock_path}{self._lock_holder()}; waited "
                    f"{timeout:g}s - retry later or raise --lock-timeout"
                ) from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            yield
        finally:
            os.close(fd)

    def _lock_holder(self) -> str:
        try:
            pid = self.lock_path.read_text().strip()
        except OSError:
            return ""
        return f" (pid {pid})" if pid else ""

    # -- generations -----------------------------------------------------------------------

    def numbers(self) -> list[int]:
        if not self.gen_dir.is_dir():
            return []
        return sorted(int(p.name) for p in self.gen_dir.iterdir() if p.name.isdigit())

    def get(self, number: int) -> Generation:
        path = self.gen_dir / f"{number:04d}"
        try:
            meta = read_json(path / "meta.json")
        except FileNotFoundError:
            have = ", ".join(str(n) for n in self.numbers()) or "none"
            raise StoreError(
                f"there is no generation {number} in {self.gen_dir}; generations: {have}"
            ) from None
        return Generation(number, path, meta)

    def all(self) -> list[Generation]:
        return [self.get(n) for n in self.numbers()]

    @_writes
    def new(self, env_text: str, meta: dict[str, Any]) -> Generation:
        """Store a new generation (pending) and return it."""
        self.ensure()
        number = (self.numbers() or [0])[-1] + 1
        path = self.gen_dir / f"{number:04d}"
        # built under a temporary name and renamed: a deployer killed halfway leaves no
        # generation without its meta.json (a leftover is replaced by the next one)
        tmp = self.gen_dir / f".new-{number:04d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        meta = {"generation": number, "outcome": "pending", **meta}
        atomic_write(tmp / "env", env_text.encode(), 0o600)
        write_json(tmp / "meta.json", meta)
        os.rename(tmp, path)
        _fsync_dir(self.gen_dir)
        return Generation(number, path, meta)

    def stage(self, env_text: str, meta: dict[str, Any], record: dict[str, Any]) -> Generation:
        """Write the transaction record (it names the old text: the rollback is registered
        before anything live is touched), then the new generation."""
        self.begin(record)
        gen = self.new(env_text, meta)
        self.mark(to=gen.number)
        return gen

    def commit(self, gen: Generation, **meta: Any) -> None:
        """The gate passed: ``gen`` is deployed and live, the transaction record goes."""
        self.update(gen, outcome="deployed", **meta)
        self.set_live(gen.number)
        self.end()

    @_writes
    def update(self, gen: Generation, **changes: Any) -> Generation:
        meta = {**gen.meta, **changes}
        write_json(gen.path / "meta.json", meta)
        return Generation(gen.number, gen.path, meta)

    def live_number(self) -> int | None:
        try:
            return int((self.root / "live").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def live_meta(self) -> dict[str, Any] | None:
        live = self.live()
        return live.meta if live else None

    def live_config(self, unit_name: str) -> dict[str, Any]:
        """The live generation's typed config (what ``set`` and ``unset`` build on)."""
        live = self.live()
        if live is None:
            raise ConfigInvalid(
                f"nothing deployed yet for {unit_name} (no live generation in {self.root}); "
                "run llama-launcher install or deploy --config FILE first"
            )
        return dict(live.meta["config"])

    @_writes
    def set_live(self, number: int) -> None:
        atomic_write(self.root / "live", f"{number}\n".encode(), 0o600)

    def live(self) -> Generation | None:
        n = self.live_number()
        return self.get(n) if n is not None else None

    # -- rollback targets ------------------------------------------------------------------

    def rollback_target(
        self, to: int | None, live_text: str | None, running: Callable[[], bool]
    ) -> Generation:
        """What ``rollback`` goes back to: generation ``to``; else the live generation when it
        is known-good and the live file is not its bytes (edited or deleted behind our back);
        else the newest known-good one before it with another config (``previous_good``) -
        also when the live config is failing (the unit down, or its restore failed its gate):
        a config that crash-loops for an outside reason is not "rolled back" to itself.
        Only when no other generation served is the failing live one started again."""
        live = self.live()
        if to is not None:
            return self.get(to)
        if live is not None and live.good and live_text != live.env_text:
            return live
        target = self.previous_good(live, live_text)
        failing = live is not None and (not running() or live.meta.get("gate_failed_at"))
        if target is None and failing and live is not None and live.good:
            return live
        if target is None:
            raise StoreError(
                f"no known-good generation other than the live one "
                f"({live.number if live else None}) in "
                f"{self.gen_dir}; see llama-launcher history"
            )
        return target

    def previous_good(self, live: Generation | None, text: str | None) -> Generation | None:
        """The newest known-good generation before the live one with a different config."""
        for n in reversed(self.numbers()):
            gen = self.get(n)
            if live is not None and n >= live.number:
                continue
            if gen.good and not gen.meta.get("rolled_back_from") and gen.env_text != text:
                return gen
        return None

    @_writes
    def back_out(self, gone: Generation) -> None:
        """A later rollback must not bring back the config a rollback backed out, in
        whichever generations it was deployed."""
        for gen in self.all():
            if gen.env_text == gone.env_text:
                self.update(gen, rolled_back_from=True)

    # -- transaction record ----------------------------------------------------------------

    @_writes
    def begin(self, record: dict[str, Any]) -> None:
        write_json(self.txn_path, {"pid": os.getpid(), "started": time.time(), **record})

    @_writes
    def mark(self, **changes: Any) -> None:
        """Record progress (the phase). Atomic but not fsynced: it guards against the
        deployer dying, and costs nothing on the path of every deploy."""
        write_json(self.txn_path, {**self.txn(), **changes}, durable=False)

    def txn(self) -> dict[str, Any]:
        try:
            return read_json(self.txn_path)
        except FileNotFoundError:
            return {}

    @_writes
    def end(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.txn_path.unlink()
        _fsync_dir(self.root)


def _try_lock(fd: int) -> None:
    """flock without waiting; ``BlockingIOError`` while another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise BlockingIOError(e.errno, e.strerror) from e
        raise


def swap_env(env_file: Path, text: str, backup: bool = True) -> None:
    """Install ``text`` as the live env file atomically, keeping a ``.bak`` of the old one.

    A new file gets mode 0600; an existing one keeps its owner and mode (0640 with a group
    is kept as is). ``SwapFailed`` when the folder cannot be written: the live file is
    then the old one, whole (the ``.bak`` is written first, in the same folder).
    """
    data = text.encode()
    try:
        if backup and env_file.exists():
            bak = env_file.with_name(env_file.name + ".bak")
            atomic_write(bak, env_file.read_bytes(), like=env_file)
        atomic_write(env_file, data, 0o600)
    except OSError as e:
        raise SwapFailed(write_failed(e, env_file.parent, "--env-file"), env_file) from e


def sweep_temp(folders: list[Path]) -> list[str]:
    """Remove the temporary files (``.<name>.tmp-<pid>``) a killed writer left in
    ``folders``: only those whose pid is gone (a live one may still be writing)."""

    def dead(name: str) -> bool:
        m = TEMP_NAME.match(name)
        return m is not None and not pid_alive(int(m["pid"]))

    return remove_left(folders, dead)


def remove_left(folders: list[Path], left: Callable[[str], bool]) -> list[str]:
    """Remove the files in ``folders`` whose names ``left`` says a killed process left;
    the paths removed."""
    removed = []
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if not left(name):
                continue
            with contextlib.suppress(OSError):  # gone meanwhile, or a read-only folder
                (folder / name).unlink()
                removed.append(str(folder / name))
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (this one counts; another user's counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: another user's live process
    return True
