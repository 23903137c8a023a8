"""llama-server's ``GET /slots``: what each slot holds now, and how full the KV pool is.

Read from b9093, b10405 and b11434 (``server_slot::to_json`` in
tools/server/server-context.cpp) and confirmed against each real server by the tests. Every
build gives each slot ``id``, ``n_ctx`` (the slot's cap: after ``--kv-unified-per-slot``),
``is_processing``, and, once the slot has had a task, ``id_task``, ``params`` and
``next_token`` (``n_decoded``: the tokens generated for its task; ``n_remain``: the tokens
its task may still generate, -1 without a limit; a list of one object on b11434, one object
or a list before). The tokens a slot holds, prompt plus generated
(``prompt.tokens.size()``), are ``n_prompt_tokens`` from b10405 on; **b9093 has no such
field**, so its pool use cannot be read from ``/slots`` (the reader says so).

The endpoint is on by default (``--no-slots`` turns it off: 501), needs the API key when one
is set, and is a high-priority task that does not queue behind generation. It is never
polled with ``LLAMA_SERVER_SLOTS_DEBUG`` set: that makes it detokenize whole prompts.

Pool use = the tokens all slots hold ÷ the planned pool cells (``launcher.server.kvlayout``);
per-slot fill = tokens ÷ the slot's cap. Busy (processing) and idle slots are told apart: in
a unified pool the idle slots' cached cells are purged first when a batch finds no room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from launcher.errors import Unreadable
from launcher.server import httpclient

#: The build that added ``n_prompt_tokens`` to ``/slots`` (b9093 lacks it).
TOKENS_FIELD = "n_prompt_tokens"
TOKENS_SINCE = 10405


@dataclass(frozen=True)
class Slot:
    """One slot as ``/slots`` shows it. ``tokens`` None: the build does not say."""

    id: int
    n_ctx: int
    busy: bool
    tokens: int | None
    decoded: int | None
    #: the tokens its task may still generate (``n_remain``); None: no limit, or not said
    remain: int | None = None
    #: the id of the last task it ran (``id_task``; None: none yet): a task of its own is
    #: what puts new tokens into a slot (a restore keeps the id)
    task: int | None = None

    @property
    def fill(self) -> float | None:
        """The share of its cap the slot holds."""
        if self.tokens is None or self.n_ctx <= 0:
            return None
        return self.tokens / self.n_ctx

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "fill": self.fill}


def parse(data: object) -> list[Slot]:
    """The slots of a ``/slots`` answer; ``Unreadable`` when it is not one."""
    if not isinstance(data, list):
        raise Unreadable("slots", f"/slots returned {type(data).__name__}, not a list of slots")
    slots = []
    for item in data:
        try:
            slots.append(_slot(item))
        except (KeyError, TypeError, ValueError) as e:
            raise Unreadable("slots", f"/slots has a slot this reader does not know: {e}") from e
    return sorted(slots, key=lambda s: s.id)


def _slot(item: Any) -> Slot:
    tokens = item.get(TOKENS_FIELD)
    nxt = item.get("next_token")
    first = nxt[0] if isinstance(nxt, list) and nxt else nxt
    decoded = first.get("n_decoded") if isinstance(first, dict) else None
    remain = first.get("n_remain") if isinstance(first, dict) else None
    return Slot(
        id=int(item["id"]),
        n_ctx=int(item["n_ctx"]),
        busy=bool(item["is_processing"]),
        # a slot that never had a task holds nothing; on b9093 no slot says what it holds
        tokens=int(tokens) if tokens is not None else (0 if "id_task" not in item else None),
        decoded=int(decoded) if decoded is not None else None,
        remain=int(remain) if remain is not None and int(remain) >= 0 else None,
        task=int(item["id_task"]) if item.get("id_task") is not None else None,
    )


def read(client: httpx.Client) -> list[Slot]:
    """``GET /slots`` through ``client`` (``httpclient.client``)."""
    try:
        resp = client.get("/slots")
    except httpx.TransportError as e:
        raise Unreadable("slots", f"the server does not answer: {type(e).__name__}") from e
    if resp.status_code != 200:
        raise Unreadable("slots", _refusal(resp), resp.status_code)
    try:
        return parse(resp.json())
    except ValueError as e:
        raise Unreadable("slots", f"/slots is not JSON: {resp.text[:200]}") from e


def _refusal(resp: httpx.Response) -> str:
    why = httpclient.error_text(resp)
    if resp.status_code == 503:
        return f"the server is loading (503: {why})"
    if resp.status_code == 501:
        return f"/slots is off (501: {why}): the config has --no-slots"
    if resp.status_code == 401:
        return "/slots wants the API key (401); the live env file names none that works"
    return f"/slots answered {resp.status_code}: {why}"


@dataclass(frozen=True)
class Pressure:
    """How full the KV pool and each slot are, now."""

    slots: list[Slot]
    #: the planned pool cells (None: the generation has no plan, e.g. an adopted hand edit)
    pool_cells: int | None

    @property
    def known(self) -> bool:
        """Whether every slot says what it holds (b9093 does not)."""
        return all(s.tokens is not None for s in self.slots)

    def held(self, busy: bool | None = None) -> int | None:
        """Tokens the slots hold (``busy``: only busy or only idle slots)."""
        if not self.known:
            return None
        return sum(s.tokens or 0 for s in self.slots if busy is None or s.busy == busy)

    @property
    def use(self) -> float | None:
        """The share of the pool the slots hold (can pass 1 while a batch is placed)."""
        held = self.held()
        if held is None or not self.pool_cells:
            return None
        return held / self.pool_cells

    @property
    def need(self) -> float | None:
        """The share of the pool the slots' sessions need when they are busy at once: the
        cells every slot holds (an idle slot's cells are purged first when a batch finds
        no room, but its session comes back with that history) plus what each busy task
        may still generate (``n_remain``, up to its slot's cap: a task stops there; a task
        without a limit counts what it holds). Past 1, the next turns that overlap
        overflow a shared pool."""
        if not self.known or not self.pool_cells:
            return None
        total = 0
        for s in self.slots:
            held = s.tokens or 0
            total += max(held, min(held + (s.remain or 0), s.n_ctx)) if s.busy else held
        return total / self.pool_cells

    @property
    def max_fill(self) -> float | None:
        fills = [s.fill for s in self.slots if s.fill is not None]
        return max(fills) if fills and self.known else None

    @property
    def busy_slots(self) -> int:
        return sum(s.busy for s in self.slots)

    def share(self, slot: Slot) -> float | None:
        """The share of the pool one slot holds."""
        if slot.tokens is None or not self.pool_cells:
            return None
        return slot.tokens / self.pool_cells

    def over(self, threshold: float) -> dict[str, str]:
        """What passes ``threshold`` (a share): the pool, and every slot over that share of
        its cap; ``{"pool": "pool 93%", "slot 2": "slot 2 91% of its 256"}``."""
        out = {}
        if self.use is not None and self.use >= threshold:
            out["pool"] = f"pool {self.use:.0%}"
        for s in self.slots:
            if s.fill is not None and s.fill >= threshold:
                out[f"slot {s.id}"] = f"slot {s.id} {s.fill:.0%} of its {s.n_ctx}"
        return out

    def describe(self) -> str:
        """One line: the pool, busy and idle, and each slot (tokens / cap)."""
        if not self.known:
            return (
                f"{len(self.slots)} slots, {self.busy_slots} busy; this build's /slots does "
                f"not say what each holds ({TOKENS_FIELD} came with b{TOKENS_SINCE})"
            )
        pool = f"{self.pool_cells:,}" if self.pool_cells else "?"
        use = f" ({self.use:.1%})" if self.use is not None else ""
        slots = ", ".join(
            f"{s.id}: {s.tokens:,}/{s.n_ctx:,} {'busy' if s.busy else 'idle'}" for s in self.slots
        )
        return (
            f"pool {self.held():,} of {pool} cells{use}, busy {self.held(True):,}, idle "
            f"{self.held(False):,}; slots {slots}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool_cells": self.pool_cells,
            "used": self.held(),
            "busy": self.held(True),
            "idle": self.held(False),
            "use": self.use,
            "max_slot_fill": self.max_fill,
            "busy_slots": self.busy_slots,
            "slots": [{**s.to_dict(), "share": self.share(s)} for s in self.slots],
        }
