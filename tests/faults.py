"""``python tests/faults.py PHASE:ACTION[,PHASE:ACTION...] ARGS...``: the CLI with a fault at
a phase of the deploy transaction (or several, each at its own), for the crash-safety tests
(passed in as the deployer's ``on_phase``).

``PHASE:kill`` kills the process with SIGKILL when the transaction records PHASE;
``PHASE:pause`` sleeps there until a signal comes (at most 60 s), so a test can signal it at
a known point (a phase whose signals the deployer defers goes on at once, not after 60 s);
``PHASE:wait:FILE`` waits there until FILE exists (at most 600 s), holding what it holds, so
a test decides when it goes on;
``PHASE:stop`` stops it there (SIGSTOP), so a test can do something at that point and then
let it go on (SIGCONT) at once; ``PHASE:kill-front`` kills the front's HAProxy (its
service's main process) with SIGKILL there and goes on once it is gone;
``PHASE:truncate-slots`` cuts every slot file the deploy saved to half its size there and
goes on (a file damaged between save and restore).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launcher.cli import main
from launcher.deploy.restart.front import Front

ACTIONS = ("kill", "pause", "wait", "stop", "kill-front", "truncate-slots")


def kill_front() -> None:
    unit = Front(Path("."), os.environ["LLAMA_LAUNCHER_UNIT"]).service
    scope = ["--user"] if os.environ.get("LLAMA_LAUNCHER_SCOPE", "user") == "user" else []
    out = subprocess.run(
        ["systemctl", *scope, "show", "-p", "MainPID", "--value", unit],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    pid = int(out)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.005)  # killed means gone (reaped) when the deploy goes on


def truncate_slots() -> None:
    for f in (Path(os.environ["LLAMA_LAUNCHER_STATE_DIR"]) / "slots").glob("*.bin"):
        os.truncate(f, f.stat().st_size // 2)


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 600
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"faults.py: {path} did not appear")
        time.sleep(0.05)


def hook(fault: str) -> Callable[[str], None]:
    at, _, action = fault.partition(":")
    action, _, arg = action.partition(":")
    if action not in ACTIONS or (action == "wait") != bool(arg):
        raise SystemExit(f"faults.py: {fault!r} is not PHASE:{'|'.join(ACTIONS)} (wait:FILE)")

    woken = -1
    if action == "pause":  # here, in the main thread: the wakeup fd is set only there
        woken, wake = os.pipe()
        os.set_blocking(wake, False)
        signal.set_wakeup_fd(wake)

    def on_phase(phase: str) -> None:
        if phase != at:
            return
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "pause":
            pause(60, woken)
        elif action == "wait":
            wait_for(Path(arg))
        elif action == "kill-front":
            kill_front()
        else:
            truncate_slots()

    return on_phase


def pause(seconds: float, woken: int) -> None:
    """Sleep until a signal comes (``woken``: the read end of the wakeup fd, which the
    interpreter writes to on every handled signal, whatever handler the deployer installed
    and in whichever thread the phase runs), at most ``seconds``."""
    select.select([woken], [], [], seconds)


def hooks(faults: str) -> Callable[[str], None]:
    """``PHASE:ACTION[,PHASE:ACTION...]``: each fault at its phase, in the order given."""
    each = [hook(f) for f in faults.split(",")]

    def on_phase(phase: str) -> None:
        for h in each:
            h(phase)

    return on_phase


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:], on_phase=hooks(sys.argv[1])))
