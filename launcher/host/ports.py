"""Who listens on a TCP address, read from ``/proc``: the LISTEN sockets of
``/proc/net/tcp`` and ``/proc/net/tcp6``, and the processes that have those sockets open
(``/proc/PID/fd/*`` links read ``socket:[INODE]``), each named by its ``comm`` and the
systemd unit of its cgroup (``/proc/PID/cgroup``).

A deploy refuses a port another process holds before it stops the serving server
(``launcher.config.validate.check_port``), and the gate takes a ``/health`` answer only from
the process the restart started (``launcher.deploy.gate``). ``ss -ltnp`` prints the same
from the same tables, as text for people; these are its machine-readable source. The tables
are the network namespace of the reader's, which is the units' (they have no
``PrivateNetwork=``). A process of another user hides its open files from a reader that is
not root: such a socket is a listener with no holder named.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

#: ``st`` of a listening socket in /proc/net/tcp (TCP_LISTEN, include/net/tcp_states.h)
LISTEN = "0A"
#: the cgroup leaf of a process names its unit (a service, or a scope systemd made)
UNIT_SUFFIXES = (".service", ".scope")


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket: its local address and the inode that names it."""

    host: str
    port: int
    inode: int


@dataclass(frozen=True)
class Holder:
    """A process that has a listening socket open."""

    pid: int
    comm: str
    #: the systemd unit its cgroup names (None: not read, or in none)
    unit: str | None = None

    def describe(self) -> str:
        where = f", {self.unit}" if self.unit else ""
        return f"{self.comm} (pid {self.pid}{where})"


def _address(hexed: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words in the host's byte order, in hex."""
    words = [int(hexed[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hexed), 8)]
    family = socket.AF_INET if len(words) == 1 else socket.AF_INET6
    return socket.inet_ntop(family, b"".join(words))


def parse_table(text: str) -> list[Listener]:
    """The listening sockets of a ``/proc/net/tcp`` or ``tcp6`` text."""
    found = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != LISTEN:
            continue
        host, _, port = fields[1].partition(":")
        found.append(Listener(_address(host), int(port, 16), int(fields[9])))
    return found


def listeners(proc: Path = Path("/proc")) -> list[Listener]:
    """Every listening TCP socket of this network namespace (a host without IPv6 has no
    ``tcp6``)."""
    found = []
    for name in ("tcp", "tcp6"):
        try:
            found += parse_table((proc / "net" / name).read_text())
        except FileNotFoundError:
            continue
    return found


IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(host: str) -> IP | None:
    """The address ``host`` names, an IPv4-mapped IPv6 one as its IPv4 address; None for a
    name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def clashes(held: str, wanted: str) -> bool:
    """Whether a socket listening on ``held`` keeps a bind of ``wanted`` (the same port)
    from succeeding: the same address, or a wildcard on either side. An IPv6 wildcard
    socket takes IPv4 too (``bindv6only`` is 0 by default; the option of a socket is not
    in the table, so this assumes it), and an IPv4 address is also its mapped IPv6 one."""
    a, b = _ip(held), _ip(wanted)
    if a is None or b is None:
        return False
    if a.version == b.version:
        return a == b or a.is_unspecified or b.is_unspecified
    v6 = a if a.version == 6 else b
    return v6.is_unspecified


def on(host: str, port: int, proc: Path = Path("/proc")) -> list[Listener]:
    """The listening sockets a bind of ``host:port`` would collide with (``clashes``); none
    for a host that is no IP address (a name, a unix socket path)."""
    if _ip(host) is None:
        return []
    return [s for s in listeners(proc) if s.port == port and clashes(s.host, host)]


def socket_inodes(pid: int, proc: Path = Path("/proc")) -> set[int] | None:
    """The inodes of the sockets process ``pid`` has open; None when its open files cannot
    be read (it is gone, or another user's)."""
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    inodes = set()
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def unit_of(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The systemd unit whose cgroup process ``pid`` is in (cgroup v2's ``0::`` line, or
    v1's ``name=systemd`` hierarchy): the innermost service or scope of its path."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers not in ("", "name=systemd"):
            continue
        units = [part for part in path.split("/") if part.endswith(UNIT_SUFFIXES)]
        if units:
            return units[-1]
    return None


def holders(inodes: set[int], proc: Path = Path("/proc")) -> list[Holder]:
    """The processes that have any of the sockets ``inodes`` open (those whose open files
    this reader can see), by pid."""
    found = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        mine = socket_inodes(pid, proc)
        if not mine or not mine & inodes:
            continue
        try:
            comm = (proc / entry.name / "comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile
        found.append(Holder(pid, comm, unit_of(pid, proc)))
    return sorted(found, key=lambda h: h.pid)
