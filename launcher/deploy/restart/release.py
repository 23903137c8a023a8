"""The front's release watcher: ``llama-launcher front-release``, which
``NAME-front-release.service`` runs while a hold on the front is recorded
(``front/hold.json``; the path unit ``NAME-front-release.path`` starts it).

A hold must end by itself, whatever happens to its holder. The watcher waits for the unit's
deploy lock in short rounds. A holder that dies (kill -9, the OOM killer, a lost SSH
session) lets go of the lock, and the watcher recovers the transaction it left
(``Deployer.recover_only``: the previous env file and front config back, restarted under
the hold and gated), then releases the front: the held requests reach a gated config. A
holder that still holds at the hold's deadline (one deploy's budget after it held) is
released without the lock (the deadline read again under the record's lock,
``Front.release_due``). Between two rounds it pauses again a HAProxy that its socket unit
started during the hold (``Front.recheck``). It ends only when no hold is recorded: its
holder released it (a deploy that finished), or the watcher did. A round whose release
failed (HAProxy's runtime API not answering) is followed by another; a release at the
deadline that fails ends the watcher with an error, and its unit starts it again
(``Restart=on-failure``, no start limit: the path unit must never give up on a hold).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from launcher import config
from launcher.deploy import home, store
from launcher.deploy.restart.front import Front, FrontError, Hold
from launcher.deploy.transaction import Deployer
from launcher.errors import LockTimeout

#: How long one round waits for the lock (a dead holder's requests wait about this much
#: longer than its death; each round also asks HAProxy's runtime API for its process), and
#: the pause between two rounds that took it.
ROUND = 0.25


def watch(settings: config.ToolSettings, round_seconds: float = ROUND) -> dict[str, Any]:
    """Watch the recorded hold until it ends; what ended it."""
    front = Front(home.state_dir(settings), settings.unit_name, settings.scope)
    deployer = Deployer(settings.model_copy(update={"lock_timeout": round_seconds}))
    seen: Hold | None = None
    recovered: dict[str, Any] | None = None
    while (hold := front.holding()) is not None:
        seen = hold
        with contextlib.suppress(FrontError):  # no answer: the next round asks again
            hold = front.recheck(hold, "the release watcher")
        if time.time() >= hold.deadline:
            released = front.release_due()  # raises FrontError: the unit starts it again
            if released is not None:
                return _at_deadline(released, recovered)
            continue  # held again meanwhile (its deadline moved), or released
        try:
            done = deployer.recover_only(when=lambda: front.holding() is not None)
        except LockTimeout:
            continue
        recovered = done or recovered
        if front.holding() is not None:
            time.sleep(round_seconds)  # not released (yet): the next round tries again
    held = seen.to_dict() if seen else None
    if recovered is not None:
        return {"outcome": "recovered", "hold": held, "recovered": recovered}
    return {"outcome": "released by its holder", "hold": held}


def _at_deadline(hold: Hold, recovered: dict[str, Any] | None) -> dict[str, Any]:
    """The hold outlived one deploy's budget: released, without the lock (its holder may
    still run, e.g. stopped with SIGSTOP; its transaction stays for the next run)."""
    alive = store.pid_alive(hold.pid) if hold.pid else False
    out = {
        "outcome": "released at the hold's deadline",
        "hold": hold.to_dict(),
        "held_seconds": round(time.time() - hold.since, 3),
        "holder_alive": alive,
    }
    if recovered is not None:
        out["recovered"] = recovered
    return out
