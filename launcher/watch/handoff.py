"""The hand-off from a deploy to its bake (``launcher.watch.bake``).

The verbs that change the live generation (deploy, set, unset, rollback) end the bake of the
generation they replaced; deploy, set and unset begin the new one's (a rollback never: a
revert is never reverted). The bake is watched from the deploy on: its carrier is the
sampler's service (``NAME-sample.service``, ``launcher.host.timer``), which the deploy
starts as soon as the bake is recorded, not at its timer's next tick. A bad config fails in
its first seconds (seed 000's pool overflowed 3.5 s after the restart, while its clients'
requests were just released to it) and the timer ticks once a minute. So the carrier is
started at the deploy's gate, while the new process loads: the deploy announces its bake
in its transaction record, and the carrier, its modules imported, waits for the deploy to
end and the bake to begin (``launcher.watch.bake.awaited``), then carries it at once. The
service is restarted when it runs then: what runs is a sample, or the carry of the bake
this deploy replaces, and a sample may be cut at any point (``launcher.watch.sample``). Its
carry follows the new process's journal from its first line and watches its pool
(``launcher.watch.sample.carry``), so a failure in the moments between the front's release
and the bake's start is the first thing it reads.

A bake needs its carrier: ``require_carrier`` refuses ``--bake`` on a unit whose sampler
units are not installed (exit 2, nothing changed), before the deploy.

``--wait`` (and the Ansible module's ``bake``) waits for the verdict that same carrier
records, by reading the bake's record, so a person's ``set --bake`` and a playbook's task
are watched the same way. A carrier found stopped while the bake runs (killed) is started
again; one killed during its revert is recovered and the bake settled, as ``recover`` does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from launcher.config import ToolSettings
from launcher.deploy.result import Result
from launcher.deploy.transaction import Deployer
from launcher.errors import ConfigInvalid, LauncherError, StoreError
from launcher.host import timer
from launcher.host.systemd import Systemd
from launcher.watch import bake

#: How often ``--wait`` reads the bake's record, and checks that its carrier runs.
POLL = 0.2
CARRIER_CHECK = 5.0


def carrier(settings: ToolSettings) -> Systemd:
    """The sampler's service of the unit: the bake's carrier."""
    return Systemd(timer.names(settings.unit_name)[0], settings.scope)


def require_carrier(settings: ToolSettings) -> None:
    """Refuse a bake (``settings.bake`` > 0) whose carrier is not installed: the sampler's
    service and timer (``install`` writes them), before anything changes."""
    if settings.bake <= 0:
        return
    missing = []
    for name in timer.names(settings.unit_name):
        shown = Systemd(name, settings.scope).show("LoadState").get("LoadState", "")
        if shown != "loaded":
            missing.append(name)
    if not missing:
        return
    scope = settings.scope
    raise ConfigInvalid(
        f"--bake {settings.bake:g}s needs the sampler's units, which watch the bake: "
        f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed in "
        f"{scope} scope. Run `llama-launcher install` for {settings.unit_name} again (it "
        "writes them, and a config equal to the live one restarts nothing), or give "
        "--bake 0; nothing was changed"
    )


def start_carrier(settings: ToolSettings) -> dict[str, Any]:
    """Start (or restart) the bake's carrier now, without waiting for its first sample
    (``systemctl restart --no-block``; its start limit reset first: deploys in a row count
    toward it). What was done, with ``error`` when systemd refused."""
    sd = carrier(settings)
    try:
        sd.reset_failed()
        sd.restart()
    except LauncherError as e:
        return {"unit": sd.unit, "started": False, "error": str(e)}
    return {"unit": sd.unit, "started": True}


def baked(d: Deployer, verb: str, run: Callable[[], Result], wait: bool = False) -> Result:
    """Run ``run`` (a deploy, set or unset through ``d``) with its bake's hand-off: with the
    setting ``bake``, the carrier started at the deploy's gate and the bake begun after it
    (``after``)."""
    started: list[dict[str, Any]] = []
    if d.settings.bake > 0:
        chained = d.on_phase

        def on_phase(phase: str) -> None:
            if phase == "gate" and not started:
                d.store.mark(bake=d.settings.bake)  # the carrier waits for it (bake.awaited)
                started.append(start_carrier(d.settings))
            if chained is not None:
                chained(phase)

        d.on_phase = on_phase
    return after(d, run(), verb, True, wait, started[0] if started else None)


def _carried(settings: ToolSettings, at_gate: dict[str, Any] | None) -> dict[str, Any]:
    """The carrier of a bake just begun: the one the gate started, waiting for it (a start
    of an active unit does nothing), started anew if it is gone; else started now."""
    if at_gate is None or not at_gate.get("started"):
        return start_carrier(settings)
    try:
        carrier(settings).start(block=False)
    except LauncherError as e:
        return {**at_gate, "started": False, "error": str(e)}
    return {**at_gate, "at": "gate"}


def after(
    d: Deployer,
    result: Result,
    verb: str,
    bakes: bool = True,
    wait: bool = False,
    at_gate: dict[str, Any] | None = None,
) -> Result:
    """After a verb that changed the live generation: the bake it replaced ends (said in the
    result); with ``bakes`` and the setting ``bake``, the new generation's begins and its
    carrier runs (``at_gate``: the one started at the deploy's gate, which waits for it;
    started again if it is gone); ``wait``: the result carries the bake's verdict
    (``wait_for``)."""
    if result.outcome != "deployed" or result.generation is None:
        return result
    prev = result.previous_generation
    data: dict[str, Any] = {}
    ended = bake.end(d.store, prev, f"generation {result.generation} replaced it ({verb})")
    if ended is not None:
        data["ended"] = ended
        result.warnings.append(
            f"the bake of generation {prev} ended before its verdict: generation "
            f"{result.generation} replaced it"
        )
    if bakes and d.settings.bake > 0:
        started = bake.begin(d.settings, d.store, result.generation, prev)
        data["started"] = started.view()
        data["carrier"] = _carried(d.settings, at_gate)
        if not data["carrier"]["started"]:
            result.warnings.append(
                f"the bake is not watched until the sampler's timer starts "
                f"{data['carrier']['unit']} (within sample_interval): "
                f"{data['carrier']['error']}"
            )
        if wait:
            data["verdict"] = wait_for(d, result.generation)
            _outcome(result, data["verdict"])
    result.bake = data or None
    return result


def wait_for(
    d: Deployer,
    generation: int,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Wait for the verdict of ``generation``'s bake, as its carrier records it; the bake's
    view as it ended (``state`` still ``baking`` or ``reverting``, with a ``note``, when no
    verdict came within the bake's deadline and its carrier's patience)."""
    path = d.store.get(generation).path
    b = bake.load(path)
    checked = clock()
    while b is not None and b.state in (bake.RUNNING, bake.REVERTING):
        if time.time() > b.deadline + _patience(b):
            view = {**b.view(), "line": None}
            view["note"] = (
                f"no verdict was recorded by the bake's deadline and its carrier's patience; "
                f"see `llama-launcher status --unit {d.settings.unit_name}` and "
                f"`journalctl -u {carrier(d.settings).unit}`"
            )
            return view
        if clock() - checked >= CARRIER_CHECK:
            checked = clock()
            b = _keep_carried(d, b) or b
            if not (b.running or b.state == bake.REVERTING):
                break
        sleep(POLL)
        b = bake.load(path) or b
    if b is None:
        return {"generation": generation, "state": "unknown", "note": "no bake record"}
    return {**b.view(), "line": bake.say(b)}


def _patience(b: bake.Bake) -> float:
    """How long past its deadline a bake may still get its verdict: the carrier's patience
    (``bake._Patience``, three times its grace when another sample holds the lock) and a
    revert's transaction."""
    grace = b.policy.unread_limit * b.policy.interval
    return 3 * grace + b.policy.interval + 600.0


def _keep_carried(d: Deployer, b: bake.Bake) -> bake.Bake | None:
    """A carrier found stopped: started again while the bake runs; when it died during the
    revert, the revert's transaction recovered and the bake settled (``recover``'s work).
    Returns the bake as it is now (None: nothing changed)."""
    sd = carrier(d.settings)
    try:
        if sd.state().active in ("active", "activating", "reloading"):
            return None
    except LauncherError:
        return None
    if b.running:
        start_carrier(d.settings)
        return None
    with contextlib.suppress(LauncherError, StoreError, OSError):
        d.recover_only()
        return bake.settle(d.store)
    return None


def _outcome(result: Result, verdict: dict[str, Any]) -> None:
    """The verb's outcome after the bake's verdict (``--wait``): ``reverted`` (the previous
    config serves again), ``revert_failed`` (a revert was due and did not happen, or was
    undone: the new config serves still), ``rollback_failed`` (the revert's rollback failed
    both ways: neither serves); a bake that passed or ended inconclusive leaves it
    ``deployed``. The message says the verdict either way."""
    state = verdict.get("state")
    line = verdict.get("line") or ""
    if state == "reverted":
        done = verdict.get("revert") or {}
        result.outcome = "reverted"
        result.generation = done.get("generation", result.generation)
    elif state == "revert_failed":
        done = verdict.get("revert") or {}
        both = done.get("outcome") == "rollback_failed"
        result.outcome = "rollback_failed" if both else "revert_failed"
    if state in ("reverted", "revert_failed"):
        result.message = line
    elif line:
        result.message += f"; {line}"
    elif verdict.get("note"):
        result.warnings.append(str(verdict["note"]))
