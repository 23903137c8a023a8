"""``python tests/faults.py PHASE:ACTION ARGS...``: the CLI with a fault at one phase of the
deploy transaction, for the crash-safety tests (passed in as the deployer's ``on_phase``).

``PHASE:kill`` kills the process with SIGKILL when the transaction records PHASE;
``PHASE:pause`` sleeps there (60 s), so a test can signal it at a known point;
``PHASE:stop`` stops it there (SIGSTOP), so a test can do something at that point and then
let it go on (SIGCONT) at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

from launcher.cli import main


def hook(fault: str) -> Callable[[str], None]:
    at, _, action = fault.partition(":")
    if action not in ("kill", "pause", "stop"):
        raise SystemExit(f"faults.py: {fault!r} is not PHASE:kill, PHASE:pause or PHASE:stop")

    def on_phase(phase: str) -> None:
        if phase == at and action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif phase == at and action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif phase == at:
            time.sleep(60)

    return on_phase


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:], on_phase=hook(sys.argv[1])))
