"""The one chokepoint for subprocesses.

argv lists only (never a shell string), an explicit environment, a timeout, and every
failure turned into ``CommandError`` naming the command and the tail of its stderr.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

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
    """Run ``argv`` and return its output; raise ``CommandError`` on failure when ``check``.

    ``env`` replaces the environment when given (pass ``dict(os.environ, ...)`` to extend it).
    """
    args = [str(a) for a in argv]
    try:
        p = subprocess.run(
            args,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=dict(env) if env is not None else None,
            input=input,
            cwd=cwd,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise CommandTimeout(args, None, err, f"timed out after {timeout:g}s") from e
    except OSError as e:
        raise CommandError(args, None, str(e), e.strerror or "") from e
    if check and p.returncode != 0:
        raise CommandError(args, p.returncode, p.stderr or p.stdout)
    return Result(args, p.returncode, p.stdout, p.stderr)


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
