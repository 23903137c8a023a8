"""KV pool arithmetic: how llama-server b11434 turns -c, -np, -kvu and --kv-unified-per-slot
into slots, streams and cells, and which per-slot window is really guaranteed.

Pure functions. The rules follow llama.cpp b11434 (tools/server/server.cpp:168-186,
src/llama-context.cpp:292-307, tools/server/server-context.cpp:4377-4385); the tests check
them against the real server's startup line.
"""

from __future__ import annotations

from dataclasses import dataclass

#: n_ctx and n_ctx_seq are padded to a multiple of 256 cells (GGML_PAD, llama-context.cpp:292).
CELL_PAD = 256
#: -np -1 (auto) resolves to 4 slots with a forced unified pool (server.cpp:168-173).
AUTO_SLOTS = 4
#: LLAMA_MAX_SEQ (src/llama-cparams.h:8).
MAX_SLOTS = 256


def pad(x: int, n: int = CELL_PAD) -> int:
    """Round up to a multiple of ``n`` (GGML_PAD)."""
    return (x + n - 1) // n * n


def padded(n_ctx: int, n_slots: int, unified: bool) -> tuple[int, int]:
    """The cells of the whole pool and of one stream that a context of ``n_ctx`` cells
    becomes: padded, and when split, padded per stream (llama-context.cpp:292-307)."""
    n_ctx = pad(n_ctx)
    if unified:
        return n_ctx, n_ctx
    n_ctx_seq = pad(n_ctx // n_slots)
    return n_ctx_seq * n_slots, n_ctx_seq


@dataclass(frozen=True)
class PoolPlan:
    """What llama-server will make of the context flags."""

    n_slots: int
    kv_unified: bool
    n_ctx: int  # cells in the whole pool (all streams)
    n_ctx_seq: int  # cells one stream holds
    n_ctx_slot: int  # the per-slot limit the server announces
    per_slot_cap: int  # --kv-unified-per-slot, 0 when unset
    pool_sized_by_per_slot: bool  # the server sized the pool as n_slots * cap
    n_ctx_train: int | None
    #: the pool's size is this plan's own arithmetic (False: a vLLM pool the server sizes,
    #: on a GPU or by --gpu-memory-utilization; its startup line says it)
    exact: bool = True

    @property
    def streams(self) -> int:
        return 1 if self.kv_unified else self.n_slots

    @property
    def promised(self) -> int:
        """Cells all slots may use at once: n_slots x n_ctx_slot."""
        return self.n_slots * self.n_ctx_slot

    @property
    def overcommitted(self) -> bool:
        """A shared pool smaller than what its slots are promised."""
        return self.kv_unified and self.promised > self.n_ctx

    @property
    def guaranteed_window(self) -> int:
        """The per-slot window a client can rely on while every slot is busy.

        Split pools: each slot owns its stream, so n_ctx_slot. Shared pools: n_ctx_slot only
        if the pool holds every slot's worst case, else an even share of the pool.
        """
        if not self.kv_unified or not self.overcommitted:
            return self.n_ctx_slot
        return min(self.n_ctx_slot, self.n_ctx // self.n_slots)

    def describe(self, admitted: bool = False) -> str:
        """The startup line read as a sentence; ``admitted``: the front admits requests
        against the pool (``launcher.deploy.restart.admission``), so an over-commit is a
        wait, not a failure."""
        if admitted and self.overcommitted:
            return (
                f"{self.n_slots} slots x {self.n_ctx_slot} promised, one pool of {self.n_ctx}: "
                "the front admits against it; no request is killed by another's; a request "
                "may wait"
            )
        kind = "one shared pool" if self.kv_unified else "split pools"
        text = f"{self.n_slots} slots x {self.n_ctx_slot} cells each, {kind} of {self.n_ctx} cells"
        if self.overcommitted:
            text += (
                f": over-committed by {self.promised - self.n_ctx} cells - every slot is promised "
                f"{self.n_ctx_slot} but only {self.guaranteed_window} is guaranteed "
                "when all are busy"
            )
        else:
            text += f": every slot is guaranteed {self.guaranteed_window}"
        return text


def resolve(
    ctx_size: int | None,
    parallel: int = -1,
    kv_unified: bool | None = None,
    per_slot: int = 0,
    n_ctx_train: int | None = None,
) -> PoolPlan:
    """Resolve the context flags the way llama-server b11434 does.

    ``ctx_size`` None means ``-c`` not given (llama-server's 0: from the model, and fit may
    shrink it); an explicit 0 is the same "from the model" without pool sizing by
    ``--kv-unified-per-slot``. ``kv_unified`` None means neither ``-kvu`` nor ``-no-kvu``.
    Raises ``ValueError`` when the pool size depends on the model and ``n_ctx_train`` is unknown.
    """
    if parallel == 0 or parallel < -1 or parallel > MAX_SLOTS:
        raise ValueError(f"-np {parallel} is out of range; use 1..{MAX_SLOTS} or -1 (auto)")
    if parallel == -1:
        n_slots, unified = AUTO_SLOTS, True
    else:
        n_slots, unified = parallel, bool(kv_unified)
    c = ctx_size or 0
    sized = False
    if per_slot > 0 and ctx_size is None:
        c, sized = n_slots * per_slot, True
    if c == 0:
        if n_ctx_train is None:
            raise ValueError(
                "-c is not set, so the pool size comes from the model's training context; "
                "give the model (GGUF) or set -c"
            )
        # fit (on by default) asks for n_ctx_train per stream; it may shrink it when memory
        # is short, which the deploy gate detects in the startup line.
        c = n_ctx_train * (1 if unified else n_slots)
    n_ctx, n_ctx_seq = padded(c, n_slots, unified)
    n_ctx_slot = n_ctx_seq
    if per_slot > 0:
        n_ctx_slot = min(n_ctx_slot, per_slot)
    if n_ctx_train:
        n_ctx_slot = min(n_ctx_slot, n_ctx_train)
    return PoolPlan(
        n_slots=n_slots,
        kv_unified=unified,
        n_ctx=n_ctx,
        n_ctx_seq=n_ctx_seq,
        n_ctx_slot=n_ctx_slot,
        per_slot_cap=per_slot,
        pool_sized_by_per_slot=sized,
        n_ctx_train=n_ctx_train,
    )
