"""How long one restart may take: budgets sized by what this server took last time.

A restart has three phases, each with its own budget::

    stop     the restart -> the replaced process gone: the unit's TimeoutStopSec (systemd
             ends it with SIGKILL then) and a grace (``Waits.stop_grace``)
    start    the replaced process gone -> the startup line (printed once the weights are
             loaded: the bulk of a load)
    health   the startup line -> /health 200

Every gated start records what its phases took (``Load``, a generation's ``load`` in its
meta). The start and health budgets of the next restart are ``max(floor, factor x measured)``
(``Waits.floors``, ``Waits.load_factor``): a 20 ms tiny model keeps the floors, a 60 GB model
that took 200 s to load gets 800 s. A setting (``start_timeout``/``health_timeout``, or
``--start-timeout``/``--health-timeout``) replaces the sized value for a deploy; a rollback
gets the budget its own generation needed, never less than the setting. The default lock
wait (``lock_timeout`` unset) is one deploy's budget: drain + stop + start + health + probe +
settle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from launcher.errors import StoreError

if TYPE_CHECKING:
    from launcher.config import ToolSettings
    from launcher.deploy.store import Generation, Store
    from launcher.host.systemd import UnitState
    from launcher.waits import Waits

#: systemd's DefaultTimeoutStopSec, for a unit that says ``infinity`` (or nothing): a stop
#: that never ends must not hold the gate for ever.
DEFAULT_STOP = 90.0


@dataclass(frozen=True)
class Load:
    """What one gated start took, in seconds (``stop_budget``: the stop phase's budget)."""

    stop: float  # the restart -> the replaced process gone
    start: float  # the replaced process gone -> the startup line
    health: float  # the startup line -> /health 200
    stop_budget: float | None = None

    @property
    def total(self) -> float:
        """The load itself (start + health), without the stop."""
        return self.start + self.health

    def to_dict(self) -> dict[str, float | None]:
        return {k: round(v, 3) if v is not None else None for k, v in self.__dict__.items()}

    @classmethod
    def from_timings(cls, timings: dict[str, Any], stop_budget: float | None = None) -> Load:
        """From the gate's timings (each in seconds since the restart)."""
        stopped = float(timings.get("stopped", 0.0))
        healthy = float(timings["healthy"])
        line = float(timings.get("startup_line", healthy))
        return cls(stopped, max(line - stopped, 0.0), max(healthy - line, 0.0), stop_budget)

    @classmethod
    def of_meta(cls, meta: dict[str, Any] | None) -> Load | None:
        """A generation's last measured load; None when it never passed a gate. A generation
        stored before loads were recorded has only the gate's ``timings``."""
        meta = meta or {}
        load = meta.get("load")
        try:
            if isinstance(load, dict):
                return cls(
                    float(load["stop"]),
                    float(load["start"]),
                    float(load["health"]),
                    None if load.get("stop_budget") is None else float(load["stop_budget"]),
                )
            timings = meta.get("timings")
            if isinstance(timings, dict) and "healthy" in timings:
                return cls.from_timings(timings)
        except (KeyError, TypeError, ValueError):
            return None
        return None


@dataclass(frozen=True)
class Budget:
    """The budgets of one restart (seconds); ``stop`` None: from the unit's TimeoutStopSec."""

    start: float
    health: float
    stop: float | None = None
    #: the measured load of the config (start + health), which progress shows elapsed against
    expected: float | None = None

    def stop_for(self, before: UnitState, grace: float) -> float:
        if self.stop is not None:
            return self.stop
        return stop_budget(before.timeout_stop, grace)


def stop_budget(timeout_stop: float | None, grace: float) -> float:
    """The stop phase's budget for a unit with ``TimeoutStopSec`` ``timeout_stop`` (None:
    ``infinity`` or not known)."""
    return (timeout_stop if timeout_stop else DEFAULT_STOP) + grace


def sized(floor: float, factor: float, measured: float | None) -> float:
    """``max(floor, factor x measured)``: the floor when nothing was measured."""
    return max(floor, factor * measured) if measured is not None else floor


def for_deploy(w: Waits, last: Load | None) -> Budget:
    """A deploy's budgets: the settings' where given, else sized by the unit's last load."""
    start = w.start if w.start is not None else sized(w.floors[0], w.load_factor, _of(last, 0))
    health = w.health if w.health is not None else sized(w.floors[1], w.load_factor, _of(last, 1))
    return Budget(start, health, w.stop, last.total if last else None)


def for_rollback(w: Waits, own: Load | None) -> Budget:
    """A rollback's budgets: what its own generation needed (sized by its measured load),
    never less than the settings'. A restore must land even when the new config was
    deployed with short budgets."""
    start = max(w.start or 0.0, sized(w.floors[0], w.load_factor, _of(own, 0)))
    health = max(w.health or 0.0, sized(w.floors[1], w.load_factor, _of(own, 1)))
    return Budget(start, health, w.stop, own.total if own else None)


def lock_wait(settings: ToolSettings, w: Waits, last: Load | None) -> float:
    """How long to wait for another deploy's lock: ``lock_timeout``, else one deploy's budget
    (``deploy_total``)."""
    if settings.lock_timeout is not None:
        return settings.lock_timeout
    return deploy_total(settings.drain_timeout, w, last)


def deploy_total(drain: float, w: Waits, last: Load | None) -> float:
    """One deploy's budget: drain + stop + start + health + probe + settle, sized by the
    unit's last load (also how long a deploy may hold the front)."""
    b = for_deploy(w, last)
    stop = last.stop_budget if last and last.stop_budget else stop_budget(None, w.stop_grace)
    return drain + stop + b.start + b.health + w.probe + w.settle


def restart_total(w: Waits, b: Budget, before: UnitState) -> float:
    """One gated restart's budget: stop + start + health + probe + settle (how long a
    rollback or a recovery may hold the front)."""
    return b.stop_for(before, w.stop_grace) + b.start + b.health + w.probe + w.settle


def last_load(st: Store) -> Load | None:
    """The unit's last measured load: the live generation's (None: never measured, or the
    store cannot say; the floors then)."""
    try:
        live = st.live()
        return Load.of_meta(live.meta if live else None)
    except (OSError, StoreError):
        return None


def for_gate(w: Waits, st: Store, restoring: Generation | None) -> Budget:
    """The gate's budget: a rollback's is what the generation it puts back needed, a
    deploy's what the unit's last load needed."""
    if restoring is not None:
        return for_rollback(w, Load.of_meta(restoring.meta))
    return for_deploy(w, last_load(st))


def _of(load: Load | None, phase: int) -> float | None:
    if load is None:
        return None
    return load.start if phase == 0 else load.health
