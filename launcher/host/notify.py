"""sd_notify(3) for a ``Type=notify`` unit: ``READY=1`` on ``$NOTIFY_SOCKET``.

The sampler's service says it is ready after its first sample. A sample that finds a bake
running goes on sampling through it (minutes to hours) as a service that runs, its start
job done: a oneshot's start job would last the whole bake, and at boot systemd counts the
boot as unfinished while any job runs (``systemctl is-system-running`` says ``starting``
for the rest of the bake).
"""

from __future__ import annotations

import os
import socket


def ready(environ: dict[str, str] | None = None) -> bool:
    """Tell the service manager this service is ready. False when not started by one as a
    ``Type=notify`` unit (no ``NOTIFY_SOCKET``), or when it could not be told."""
    address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(b"READY=1")
    except OSError:
        return False
    return True
