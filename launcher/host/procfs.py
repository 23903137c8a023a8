"""A process's memory as the kernel counts it, from ``/proc/PID/status``; its state and age
(``process``: whether it is a zombie, whether it may still be loading); and which boot this
is (``boot``).

Growth shows as ``RssAnon + VmSwap``, not as RSS: RSS also counts the mapped model file's
pages (``RssFile``), which the page cache brings and takes away, and misses what was swapped
out (leaks reported against llama-server, 3.2 MB per generated token in llama.cpp #25953,
were measured this way; ollama #18106 says the same). The fields are in kB (1024 bytes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import Unreadable

FIELDS = ("RssAnon", "VmSwap", "VmRSS")


@dataclass(frozen=True)
class Memory:
    """Bytes: anonymous resident memory, swapped-out memory, all resident memory."""

    rss_anon: int
    vm_swap: int
    rss: int

    @property
    def growth(self) -> int:
        """What a leak grows: ``RssAnon + VmSwap``."""
        return self.rss_anon + self.vm_swap

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "growth": self.growth}


def parse_status(text: str) -> dict[str, int]:
    """The ``kB`` fields of a ``/proc/PID/status`` text, in bytes."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        words = rest.split()
        if len(words) == 2 and words[1] == "kB" and words[0].isdigit():
            values[name] = int(words[0]) * 1024
    return values


def memory(pid: int, proc: Path = Path("/proc")) -> Memory:
    """The memory of process ``pid``; ``Unreadable`` when it is gone or hidden."""
    path = proc / str(pid) / "status"
    try:
        values = parse_status(path.read_text())
    except FileNotFoundError as e:
        raise Unreadable("proc", f"process {pid} is gone ({path} does not exist)") from e
    except OSError as e:
        raise Unreadable("proc", f"cannot read {path}: {e.strerror}") from e
    if "RssAnon" not in values:
        # a kernel thread, or a kernel older than 4.5 (RssAnon came with it)
        raise Unreadable("proc", f"{path} has no RssAnon: not a user process, or a kernel < 4.5")
    return Memory(values["RssAnon"], values.get("VmSwap", 0), values.get("VmRSS", 0))


def boot(proc: Path = Path("/proc")) -> str | None:
    """This boot, as every process of the host sees it alike: the kernel's boot time
    (``btime`` of ``/proc/stat``) and PID 1's start (field 22 of ``/proc/1/stat``, clock
    ticks after it), ``"BTIME:TICKS"``. Not the kernel's ``boot_id``: a container's manager
    (systemd-nspawn) puts a boot id of its own over ``/proc/sys/kernel/random/boot_id``,
    which a unit with ``ProtectKernelTunables=`` does not see (it reads the host's, which
    a reboot of the container keeps); a container's reboot starts a new PID 1, a host's
    has a new boot time. None: not readable."""
    try:
        stat = (proc / "stat").read_text()
        btime = next(line.split()[1] for line in stat.splitlines() if line.startswith("btime "))
        started = (proc / "1" / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, StopIteration, IndexError):
        return None
    return f"{btime}:{started}"


@dataclass(frozen=True)
class Process:
    """A process as ``/proc/PID/stat`` says: its state (``R``, ``S``, ``D``, ``T`` stopped,
    ``Z`` zombie, ...) and its age in seconds (``starttime``, field 22, against
    ``/proc/uptime``: both on the kernel's boot clock, so a wall-clock step moves neither)."""

    state: str
    age: float

    @property
    def zombie(self) -> bool:
        """Exited and not yet reaped (a main thread that ended while others run on shows so
        too): not a process that could answer."""
        return self.state in ("Z", "X")


def process(pid: int, proc: Path = Path("/proc")) -> Process:
    """The state and age of process ``pid``; ``Unreadable`` when it is gone or hidden."""
    path = proc / str(pid) / "stat"
    try:
        # the command name (field 2, in parentheses) may hold spaces and ")": split after it
        fields = path.read_text().rsplit(")", 1)[1].split()
        uptime = float((proc / "uptime").read_text().split()[0])
    except FileNotFoundError as e:
        raise Unreadable("proc", f"process {pid} is gone ({path} does not exist)") from e
    except OSError as e:
        raise Unreadable("proc", f"cannot read {path}: {e.strerror}") from e
    except (IndexError, ValueError) as e:
        raise Unreadable("proc", f"{path} is not a stat line this reader knows") from e
    try:
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError) as e:
        raise Unreadable("proc", f"{path} has no start time (field 22)") from e
    return Process(fields[0], max(0.0, uptime - started))
