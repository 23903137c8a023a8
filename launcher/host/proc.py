"""The one chokepoint for subprocesses.

argv lists only (never a shell string), an explicit environment, a timeout, and every
failure turned into ``CommandError`` naming the command and the tail of its stderr.
``run`` goes through ``sh``; the two long-running readers (``spawn``: ``journalctl -f``, the
journal's follower where it cannot be read in place; ``stream``: a journal read in
constant memory) stay on ``subprocess``: they
are killed or read while they run, which sh's buffered, thread-fed output does not allow
without holding all of it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from launcher.errors import CommandError, CommandTimeout

DEFAULT_TIMEOUT = 60.0


@dataclass(frozen=True)
class Result:
    argv: list[str]
    status: int
    stdout: str
    stderr: str


def run(
    argv: Sequence[str],
    *,
    check: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    cwd: str | None = None,
) -> Result:
    """Run ``argv`` (through ``sh``) and return its output; raise ``CommandError`` on failure
    when ``check``, ``CommandTimeout`` when it runs past ``timeout`` (it is killed).

    ``env`` replaces the environment when given (pass ``dict(os.environ, ...)`` to extend it);
    the command is looked up in its ``PATH``. Output is text, newlines translated as
    ``subprocess`` does in text mode.
    """
    import sh

    args = [str(a) for a in argv]
    environ = dict(env) if env is not None else dict(os.environ)
    exe = shutil.which(args[0], path=environ.get("PATH")) if "/" not in args[0] else args[0]
    try:
        if exe is None:
            raise FileNotFoundError(2, "No such file or directory", args[0])
        cmd = sh.Command(exe)
        # sh's own _timeout waits in steps of 0.1 s (+100 ms on every call, measured): a
        # timer kills the command instead
        p = cmd(*args[1:], _env=environ, _in=input, _cwd=cwd, **_SH_OPTIONS)
    except (OSError, sh.CommandNotFound) as e:
        strerror = getattr(e, "strerror", None) or "not found"
        raise CommandError(args, None, str(e), strerror) from e
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        with contextlib.suppress(OSError):  # it may have ended meanwhile
            p.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        p.wait()
    finally:
        timer.cancel()
    stdout, stderr = _text(p.stdout), _text(p.stderr)
    if timed_out.is_set():
        raise CommandTimeout(args, None, stderr, f"timed out after {timeout:g}s")
    if check and p.exit_code != 0:
        raise CommandError(args, p.exit_code, stderr or stdout)
    return Result(args, p.exit_code, stdout, stderr)


#: How ``run`` uses sh: in the background (the timer waits), pipes and not a terminal, and
#: every exit status or signal the caller's to judge (``check``), never sh's exception.
_SH_OPTIONS: dict[str, Any] = {
    "_bg": True,
    "_bg_exc": False,
    "_return_cmd": True,
    "_tty_out": False,
    "_ok_code": tuple(range(-64, 256)),
}


def _text(data: bytes) -> str:
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def base_env(**extra: str) -> dict[str, str]:
    """The current environment with a C locale for stable output, plus ``extra``."""
    env = dict(os.environ)
    env.update({"LC_ALL": "C.UTF-8", "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "", **extra})
    return env


def spawn(argv: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a long-running reader (``journalctl -f``): its stdout is a pipe, stderr dropped.
    The caller ends it with ``end``."""
    args = [str(a) for a in argv]
    try:
        return subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
        )
    except OSError as e:
        raise CommandError(args, None, str(e), e.strerror or "") from e


#: Readers killed by ``end`` and not reaped yet.
_ending: list[subprocess.Popen[bytes]] = []


def end(p: subprocess.Popen[bytes]) -> None:
    """Kill a spawned reader without waiting for the kernel to tear it down (10-20 ms for a
    ``journalctl`` with journal files mapped, on a busy box: time a rollback cannot spare).
    It is reaped by a later ``end`` or at exit."""
    p.kill()
    if p.stdout is not None:
        p.stdout.close()
    _ending.append(p)
    _ending[:] = [q for q in _ending if q.poll() is None]


@atexit.register
def reap() -> None:
    """Wait for the readers ``end`` killed (at exit)."""
    for p in _ending:
        p.wait()
    _ending.clear()


@contextlib.contextmanager
def stream(
    argv: Sequence[str], note: str = "", env: Mapping[str, str] | None = None
) -> Iterator[IO[bytes]]:
    """Yield a command's stdout to read in constant memory; raise ``CommandError`` (with
    ``note`` as the hint) when it exits non-zero."""
    args = [str(a) for a in argv]
    with tempfile.TemporaryFile() as err:
        try:
            p = subprocess.Popen(
                args,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
            )
        except OSError as e:
            raise CommandError(args, None, str(e), note or e.strerror or "") from e
        assert p.stdout is not None
        try:
            yield p.stdout
        finally:
            p.stdout.close()
            status = p.wait()
        if status != 0:
            err.seek(0)
            raise CommandError(args, status, err.read().decode(errors="replace"), note)
