"""The startup read as a promise: the boot facts printed while the model loaded, and the
``Config`` they and the startup line give (n_slots x n_ctx_slot against a pool whose size
comes from the most direct evidence in the log, via ``launcher.server.kvlayout``)."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.reports.diagnose.report import Config
from launcher.server import kvlayout


@dataclass
class Boot:
    """Facts gathered since the last ``llama_server: initializing ...``."""

    pool_sizing: tuple[int, int, int] | None = None  # (np, per_slot, n_ctx)
    n_ctx: int | None = None  # llama_context: n_ctx (-lv 4)
    kv_cells: int | None = None  # llama_kv_cache: size = ... cells (-lv 4)
    n_ctx_seq_over_train: tuple[int, int] | None = None
    capped: tuple[int, int] | None = None  # (per-slot pool capacity, cap)
    fit_reduced: tuple[int, int] | None = None
    kv_unified: bool | None = None  # llama_context: kv_unified (b9093 prints it at INFO)
    slots: int | None = None  # b9093: ``initializing slots, n_slots`` until its ``new slot``


def startup_config(
    line: int,
    n_slots: int,
    n_ctx_slot: int,
    unified: bool,
    boot: Boot,
    hint: int | None,
    hint_source: str,
) -> Config:
    """What the startup line at ``line`` promised, read with the boot facts before it;
    ``hint`` is the pool size from outside the log (``hint_source`` names it), used when
    the log does not state it."""
    cells, source = _pool_cells(n_slots, n_ctx_slot, unified, boot, hint, hint_source)
    cap = boot.pool_sizing[1] if boot.pool_sizing else (boot.capped[1] if boot.capped else 0)
    train = boot.n_ctx_seq_over_train[1] if boot.n_ctx_seq_over_train else None
    plan = None
    if cells is not None:
        n_ctx_seq = cells if unified else cells // n_slots
        plan = kvlayout.PoolPlan(
            n_slots=n_slots,
            kv_unified=unified,
            n_ctx=cells,
            n_ctx_seq=n_ctx_seq,
            n_ctx_slot=n_ctx_slot,
            per_slot_cap=cap,
            pool_sized_by_per_slot=boot.pool_sizing is not None,
            n_ctx_train=train,
        )
    promise = (
        plan.describe()
        if plan
        else (
            f"{n_slots} slots x {n_ctx_slot} cells each, "
            f"{'one shared pool' if unified else 'split pools'} of unknown size (give --pool N)"
        )
    )
    return Config(
        line,
        n_slots,
        n_ctx_slot,
        unified,
        cells,
        source,
        cap,
        boot.fit_reduced,
        train,
        plan,
        promise,
    )


def _pool_cells(
    n_slots: int,
    n_ctx_slot: int,
    unified: bool,
    boot: Boot,
    hint: int | None,
    hint_source: str,
) -> tuple[int | None, str]:
    """The pool size and where it came from, most direct evidence first."""
    if boot.pool_sizing:
        # the line prints n_parallel * N; llama.cpp pads the pool to 256 cells (per stream
        # when split)
        cells = kvlayout.padded(boot.pool_sizing[2], n_slots, unified)[0]
        return cells, "startup: --kv-unified-per-slot sizing KV pool line"
    if boot.n_ctx is not None:
        return boot.n_ctx, "startup: llama_context: n_ctx (-lv 4)"
    if boot.kv_cells is not None:
        return boot.kv_cells, "startup: llama_kv_cache cells (-lv 4)"
    if unified:
        if boot.n_ctx_seq_over_train:
            return boot.n_ctx_seq_over_train[0], "startup: n_ctx_seq > n_ctx_train warning"
        if boot.capped:
            return boot.capped[0], "startup: capping per-slot context line"
        return n_ctx_slot, "startup: unified pool without a per-slot cap, n_ctx_slot is the pool"
    if hint is None:
        # each slot owns a stream of n_ctx_seq cells; n_ctx_slot is n_ctx_seq unless the
        # training context capped it, which the slot_over_train warning would have said
        return n_slots * n_ctx_slot, "startup: split pools, n_slots x n_ctx_slot"
    return hint, hint_source
