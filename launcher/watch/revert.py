"""The bake's revert: the generation that served before put back, through the deploy's own
rollback (the same handover: the slot carry, the front's hold), with the drain bounded to
``bake_drain`` seconds on a hard failure (the failing config cuts requests anyway).

One function, ``revert``, so that a later way back (a switch to an old instance kept warm
behind the front) takes its place without the bake knowing.

Its outcome is ``reverted`` (exit 6), apart from ``rolled_back`` and ``deployed``; the new
generation it makes records ``reverted_from`` and the verdict that decided it. A revert that
fails is the rollback's own failure: ``rolled_back`` (the old config failed its gate; the
baked one serves again) or ``rollback_failed`` (the double fault: neither serves).
"""

from __future__ import annotations

from typing import Any

from launcher import config
from launcher.deploy.result import Result
from launcher.deploy.transaction import Deployer
from launcher.errors import DeployFailed, LauncherError, RollbackFailed
from launcher.watch.verdict import Verdict

#: What the bake record keeps of the revert's result.
KEPT = ("outcome", "ok", "generation", "previous_generation", "message", "timings", "failure")


def revert(
    generation: int, previous: int, tool: dict[str, Any], drain: float, why: Verdict
) -> dict[str, Any]:
    """Put ``previous`` back in the place of ``generation`` after ``why``, with the tool
    settings ``tool`` (the deploy's) and, on a hard failure, a drain of ``drain`` seconds
    at most. Returns the result's essentials (``outcome``: ``reverted``, else what the
    rollback ended in, with ``message``)."""
    settings = config.load_settings(**tool)
    if why.hard:
        drain = min(settings.drain_timeout, drain)
        settings = settings.model_copy(update={"drain_timeout": drain})
    deployer = Deployer(settings)
    try:
        result = deployer.rollback(to=previous)
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
