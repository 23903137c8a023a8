"""The sampler's own: the unit a sample watches and where its files are (``Target``), what
one sample did (``Outcome``), what the next sample needs of this one (``State``, in
``STATE_DIR/watch/sampler.json``, whose mtime is the time of the last sample), the
sampler's lock, and whether a deploy is in progress (a sample then skips).

The deploy and the sampler: the sampler never takes the unit's deploy lock, so a deploy
never waits for it. It takes a lock of its own (``STATE_DIR/watch/lock``, never waited
for: a second sampler at the same moment skips), and skips while a deploy is in progress
(``txn.json`` of a live deployer). One sample: ``launcher.watch.sample``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.deploy import home, store

if TYPE_CHECKING:
    from launcher.config import ToolSettings

#: The setting ``wedged_samples``' default (``launcher.config.ToolSettings``): the count a
#: sampler started without the option (an older install's unit) uses.
WEDGED_SAMPLES = 3


def default_writer(path: Path, data: bytes, mode: int) -> None:
    """Atomic replace (temp file in the same folder, rename), not fsynced: a killed sampler
    leaves the old file or the new one; a power loss may cost the last samples."""
    store.atomic_write(path, data, mode, durable=False)


@dataclass(frozen=True)
class Target:
    """The unit a sample watches, and where its files are."""

    unit: str
    state_dir: Path
    textfile_dir: Path | None = None
    base_url: str | None = None
    #: wedged samples in a row that restart the unit (``launcher.watch.wedge``; 0: off)
    wedged_samples: int = WEDGED_SAMPLES

    @property
    def folder(self) -> Path:
        return self.state_dir / "watch"


def target_for(settings: ToolSettings, textfile_dir: Path | None = None) -> Target:
    """The unit of ``settings``, its one state folder (``launcher.deploy.home``), and the
    metrics folder (``textfile_dir``, else the setting ``metrics_textfile_dir``)."""
    return Target(
        unit=settings.unit_name,
        state_dir=home.state_dir(settings),
        textfile_dir=textfile_dir or settings.metrics_textfile_dir,
        base_url=settings.base_url,
        wedged_samples=settings.wedged_samples,
    )


@dataclass
class Outcome:
    """What one sample did (``--json`` prints ``to_dict``)."""

    unit: str
    generation: int | None = None
    skipped: str | None = None
    unread: dict[str, str] = field(default_factory=dict)
    lost: str | None = None
    wrote: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    pressure: dict[str, Any] | None = None
    counts: dict[str, float] = field(default_factory=dict)
    decode_tps: float | None = None
    #: the live generation's bake after this sample (``launcher.watch.bake``)
    bake: dict[str, Any] | None = None
    #: a wedged sample (``launcher.watch.wedge``): samples in a row, the limit, why, and
    #: whether this sample restarted the unit
    wedged: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **self.__dict__}


@dataclass
class State:
    """What the next sample needs of this one (``sampler.json``)."""

    generation: int | None = None
    pid: int = 0
    process: str | None = None
    counters: dict[str, float] = field(default_factory=dict)
    cursor: str | None = None
    n_restarts: int | None = None
    #: the boot the pid and NRestarts were read in (``bake.boot_id``)
    boot: str | None = None
    #: the front's HAProxy as last read: [its identity, 5xx it sent, 5xx the server sent]
    front: list[Any] | None = None
    #: what was warned about and has not fallen under ``sample.CLEAR_AT`` since ("pool", "slot 2")
    warned: list[str] = field(default_factory=list)
    decode_tps: float | None = None
    unread: dict[str, str] = field(default_factory=dict)
    #: the counts of the generations before the live one (the metrics' totals)
    past: dict[str, float] | None = None
    #: generation number -> outcome, and the newest deploy's time and duration
    outcomes: dict[str, str] = field(default_factory=dict)
    last_deploy: list[float | None] = field(default_factory=lambda: [None, None])
    #: the wedged samples in a row: [the process's pid, how many] (empty: none)
    wedged: list[Any] = field(default_factory=list)
    #: the last process a sample saw answer /health 200 (past its load)
    answered: int = 0
    #: the unit's restarts by the wedge rules, since this state began (the metrics' counter)
    wedged_restarts: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True, separators=(",", ":")).encode()


def state_path(target: Target) -> Path:
    return target.folder / "sampler.json"


def load_state(target: Target) -> tuple[State, float | None]:
    """The state of the sample before, and when it ran (the file's mtime)."""
    path = state_path(target)
    try:
        data = json.loads(path.read_bytes())
        known = State.__dataclass_fields__
        state = State(**{k: v for k, v in data.items() if k in known})
        if not isinstance(state.warned, list):
            state.warned = []
        if not isinstance(state.wedged, list):
            state.wedged = []
        return state, path.stat().st_mtime
    except FileNotFoundError:
        return State(), None
    except (OSError, ValueError, TypeError):
        return State(), None  # damaged: counted afresh from the live generation's start


def last_run(target: Target) -> float | None:
    """When the last sample ran (None: never)."""
    try:
        return state_path(target).stat().st_mtime
    except OSError:
        return None


@contextlib.contextmanager
def own_lock(folder: Path) -> Iterator[bool]:
    """The sampler's own lock, never waited for: False when another sample holds it."""
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                yield False
                return
            raise
        yield True
    finally:
        os.close(fd)


def deploying(st: store.Store) -> bool:
    """A deploy is in progress: its transaction record is there and its deployer lives (a
    killed deployer's record waits for the next command; sampling goes on meanwhile)."""
    txn = st.txn()
    if not txn:
        return False
    try:
        pid = int(txn.get("pid") or 0)
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return True
    return True
