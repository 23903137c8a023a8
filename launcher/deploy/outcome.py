"""What a verb of the config life cycle did: the one JSON object of ``--json``.

``outcome`` is one of ``deployed``, ``unchanged``, ``checked`` (the success outcomes, ``ok``),
``rolled_back`` (the new config failed, the old one serves again), ``rollback_failed``, and
``reverted`` (the new config passed its gate but its bake found it worse under load: the
previous one serves again; ``launcher.watch.revert``), and ``revert_failed`` (its bake's
revert did not put the previous one back: the new config serves still;
``launcher.watch.handoff``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Result:
    """What a verb did: the one JSON object of ``--json``."""

    outcome: str
    changed: bool
    generation: int | None = None
    previous_generation: int | None = None
    message: str = ""
    startup: dict[str, Any] | None = None
    planned: dict[str, Any] | None = None
    probe: dict[str, Any] | None = None
    client_window: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    diff: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    failure: dict[str, Any] | None = None
    rollback: dict[str, Any] | None = None
    recovered: dict[str, Any] | None = None
    handover: dict[str, Any] | None = (
        None  # drain, slots, front, stop (launcher/deploy/restart/handover.py)
    )
    #: the argv and the env file the deploy writes (wrote, would write: --check), defaults
    #: included (launcher/deploy/defaults.py): what every preview prints
    argv: list[str] | None = None
    env: str | None = None
    #: the bake (launcher/watch/bake.py): the one this verb started, and the one it ended
    bake: dict[str, Any] | None = None
    #: the front's public port did not answer when the transaction ended, nor after it was
    #: started again: why, and what to run (``fronthold.front_up``); None: it answers
    front_down: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome in ("deployed", "unchanged", "checked")

    def unchanged(
        self, startup: dict[str, Any] | None, client_window: dict[str, Any] | None
    ) -> Result:
        """Nothing to do: the rendered env file is byte-identical to the live one."""
        self.outcome, self.changed, self.diff = "unchanged", False, []
        self.generation = self.previous_generation
        self.message = "the rendered env file is byte-identical to the live one; nothing restarted"
        self.startup, self.client_window = startup, client_window
        return self

    def say_front_down(self) -> Result:
        """A front the transaction's end left down (the handover's ``front_down``): said at
        the start of the message, the first line a person reads, whatever the outcome, and
        kept as ``front_down``. Called again after the message is rewritten (a revert)."""
        down = self.front_down or (self.handover or {}).get("front_down")
        if down:
            self.front_down = down
            if not self.message.startswith(down):
                self.message = f"{down}; {self.message}" if self.message else down
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **self.__dict__}
