"""The bake's revert: the generation that served before put back, through the deploy's own
rollback (the same handover: the slot carry, the front's hold), with the drain bounded to
``bake_drain`` seconds on a hard failure (the failing config cuts requests anyway).

One function, ``revert``, so that a later way back (a switch to an old instance kept warm
behind the front) takes its place without the bake knowing.

Its outcome is ``reverted`` (exit 6), apart from ``rolled_back`` and ``deployed``; the new
generation it makes records ``reverted_from`` and the verdict that decided it. A revert that
fails is the rollback's own failure: ``rolled_back`` (the old config failed its gate; the
baked one serves again) or ``rollback_failed`` (the double fault: neither serves).

The early hold (``EarlyHold``): when the journal's line of a hard failure wakes the bake
and that failure is certain to revert (``launcher.watch.carry.certain``), the front is held
at once, under the unit's deploy lock, before the sample that judges it reads anything: the
agents' next requests (a client sends again a moment after its stream failed) wait at the
front instead of reaching the failing config while the sample reads and the revert
validates. The revert
then runs under that lock (``Deployer.lock_held``) and its handover takes the hold over
(a hold) or ends it at its switch (a warm second instance); a sample that does not revert
after all releases it. A holder that dies lets go of the lock, and the release watcher
releases the front, as for any deploy.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from launcher import config, waits
from launcher.deploy import budgets, home, store
from launcher.deploy.outcome import Result
from launcher.deploy.restart import fronthold
from launcher.deploy.restart.front import Front
from launcher.deploy.transaction import Deployer
from launcher.errors import DeployFailed, LauncherError, RollbackFailed, Superseded
from launcher.watch.bake import note
from launcher.watch.verdict import Verdict

if TYPE_CHECKING:
    from launcher.watch.bake import Bake, Revert

#: What the bake record keeps of the revert's result.
KEPT = ("outcome", "ok", "generation", "previous_generation", "message", "timings", "failure")


def revert(
    generation: int,
    previous: int,
    tool: dict[str, Any],
    drain: float,
    why: Verdict,
    locked: bool = False,
) -> dict[str, Any]:
    """Put ``previous`` back in the place of ``generation`` after ``why``, with the tool
    settings ``tool`` (the deploy's) and, on a hard failure, a drain of ``drain`` seconds
    at most; ``locked``: the caller holds the unit's deploy lock (``EarlyHold``). Returns
    the result's essentials (``outcome``: ``reverted``, else what the rollback ended in,
    with ``message``)."""
    settings = config.load_settings(**tool)
    if why.hard:
        drain = min(settings.drain_timeout, drain)
        settings = settings.model_copy(update={"drain_timeout": drain})
    deployer = Deployer(settings)
    deployer.lock_held = locked
    try:
        if locked:  # under a hold already taken: a signal waits until the revert is done
            with deployer.signals.deferred():
                result = deployer.rollback(to=previous, only_if_live=generation)
        else:
            result = deployer.rollback(to=previous, only_if_live=generation)
    except Superseded as e:  # a deploy replaced the baked generation first: nothing to do
        return {"outcome": "ended", "ok": False, "message": str(e), "error": "Superseded"}
    except (DeployFailed, RollbackFailed) as e:
        failed = e.result if isinstance(e.result, Result) else None
        data = kept(failed) if failed else {"outcome": "rollback_failed", "ok": False}
        return {**data, "message": str(e), "error": type(e).__name__}
    except LauncherError as e:
        return {
            "outcome": "revert_failed",
            "ok": False,
            "message": str(e),
            "error": type(e).__name__,
        }
    result.outcome = "reverted"
    kind = "hard" if why.hard else "soft"
    result.message = (
        f"generation {generation} was reverted after its bake ({kind}: {why.reason}); "
        f"generation {previous}'s config serves again as generation {result.generation}"
    )
    if deployer.signals.pending is not None:
        result.message += " (a signal arrived during the revert; it waited until it was done)"
    result.say_front_down()
    if result.generation is not None:
        gen = deployer.store.get(result.generation)
        deployer.store.update(
            gen,
            origin=f"revert of {generation} after its bake ({why.signal})",
            reverted_from=generation,
            bake_verdict=why.to_dict(),
        )
    # the revert did what it was for: ok (Result.ok is a deploy's "deployed")
    return {**kept(result), "ok": True, "handover": result.handover}


def kept(result: Result) -> dict[str, Any]:
    data = result.to_dict()
    return {k: data.get(k) for k in KEPT}


class EarlyHold:
    """Around the sample a journal line of a hard failure woke (``launcher.watch.carry.carry``
    calls it) when that failure reverts the bake for sure (``carry.certain``): the unit's
    deploy lock taken (never waited for: a deploy under way has it) and the front held for
    one deploy's budget; it yields the revert to judge with (it runs under this lock), or
    None (nothing held: the sample judges as any other; the bake's notes say why). On the
    way out, a hold of this process still recorded (no revert came, or it failed before its
    handover) is released, then the lock. Made when the carry begins (the settings, the
    store and the front read then), so that the hold at the line costs a lock, a
    ``systemctl show`` of the release watcher and the runtime API's commands. None
    (``of``): the unit has no front."""

    def __init__(self, settings: config.ToolSettings, front: Front, st: store.Store) -> None:
        self.settings, self.front, self.store = settings, front, st

    @classmethod
    def of(cls, b: Bake) -> EarlyHold | None:
        try:
            settings = config.load_settings(**b.settings)
            scope, unit = settings.scope, settings.unit_name
            st = store.Store(home.state_dir(settings), home.lock_path(scope, unit))
            front = Front(st.root, unit, scope)
            return cls(settings, front, st) if front.spec() is not None else None
        except (LauncherError, OSError, ValueError):
            return None

    @contextlib.contextmanager
    def __call__(self, b: Bake) -> Iterator[Revert | None]:
        with contextlib.ExitStack() as stack:
            held = self._hold(b, stack)
            if held is None:
                yield None
                return
            yield lambda bake, why: {
                **revert(
                    bake.generation, _previous(bake), bake.settings, bake.policy.drain, why, True
                ),
                "early_hold": held,
            }

    def _hold(self, b: Bake, stack: contextlib.ExitStack) -> dict[str, Any] | None:
        """The lock and the hold (each let go by ``stack``); what was held, or None."""
        t0 = time.monotonic()
        try:
            if (missing := fronthold.watcher_missing(self.front)) is not None:
                # a hold nothing would release if this process died
                self._none(b, missing)
                return None
            stack.enter_context(self.store.lock(0))
            drain = min(self.settings.drain_timeout, b.policy.drain)
            w = waits.Waits.from_settings(self.settings)
            seconds = budgets.deploy_total(drain, w, budgets.last_load(self.store))
            stack.callback(self._let_go)  # registered before the hold: a hold is never left
            self.front.hold(seconds)
        except (LauncherError, OSError) as e:
            stack.close()  # what was taken, let go: the sample judges as any other
            self._none(b, str(e))
            return None
        return {"held": True, "at": time.time(), "took": round(time.monotonic() - t0, 3)}

    def _none(self, b: Bake, why: str) -> None:
        """Nothing held early, and why, in the bake's notes."""
        note(self.store, b.generation, f"nothing was held early at a hard failure: {why}")

    def _let_go(self) -> None:
        """The front released if the hold recorded is still this process's."""
        with contextlib.suppress(LauncherError, OSError):
            hold = self.front.holding()
            if hold is not None and hold.pid == os.getpid():
                self.front.release()


def _previous(b: Bake) -> int:
    assert b.previous is not None
    return b.previous
