"""What the failures mean and what fixes them: the class of a failure (several slots filled
the shared pool, one request was longer than its slot, fit shrank the context), the fixes
sized from the startup's promise (``launcher.server.kvlayout``) as exact
``llama-launcher set`` lines, and one verdict per class and for the requests refused up front.
"""

from __future__ import annotations

import dataclasses

from launcher.reports.diagnose.report import (
    Config,
    FailureClass,
    Fix,
    MemoryCost,
    Outcome,
    SlotShare,
    Verdict,
)
from launcher.server import kvlayout, serverlog


def classify(error: str, config: Config | None, slots: tuple[SlotShare, ...]) -> FailureClass:
    """The class of a failure with ``error``, under the startup ``config``, whose release
    lines gave ``slots``."""
    if not error.startswith(serverlog.CONTEXT_EXCEEDED) or not slots:
        return FailureClass.UNKNOWN
    if config is not None and config.fit_reduced is not None:
        return FailureClass.FIT_REDUCED
    if config is not None and not config.kv_unified:
        return FailureClass.UNKNOWN  # split pools reject up front; exhaustion is not expected
    busy = [s for s in slots if s.n_tokens > 0]
    return FailureClass.SHARED_POOL if len(busy) >= 2 else FailureClass.TOO_LONG


def _fix(
    plan: kvlayout.PoolPlan,
    flags: list[str],
    note: str,
    memory: MemoryCost | None,
    type_kv: str = "f16",
) -> Fix:
    mem = memory(plan, type_kv, type_kv) if memory is not None else None
    return Fix(
        "llama-launcher set " + " ".join(flags), plan.guaranteed_window, plan.n_ctx, mem, note
    )


def _and_at_8_bit(
    plan: kvlayout.PoolPlan, flags: list[str], note: str, note_q8: str, memory: MemoryCost | None
) -> tuple[Fix, Fix]:
    """The fix of ``flags``, then the same with an 8-bit KV cache."""
    return (
        _fix(plan, flags, note, memory),
        _fix(plan, [*flags, "-ctk", "q8_0", "-ctv", "q8_0"], note_q8, memory, "q8_0"),
    )


def _keeping(
    keep: kvlayout.PoolPlan,
    flags: list[str],
    note: str,
    cfg: Config,
    cells: int,
    memory: MemoryCost | None,
) -> tuple[Fix, Fix]:
    """The fixes that keep the promised window in a pool grown from ``cells`` to ``keep``'s."""
    grow = f"pool x{keep.n_ctx / cells:.3g}" if cells else "larger pool"
    w = cfg.n_ctx_slot
    note_q8 = f"keeps {w}; {grow} at 8 bit, about half the memory of f16"
    return _and_at_8_bit(keep, flags, f"{note}; {grow}", note_q8, memory)


def _split_fix(cfg: Config, cells: int, memory: MemoryCost | None) -> Fix:
    """Split pools in the same memory: each slot owns a stream of its share of ``cells``."""
    split = kvlayout.resolve(cells, cfg.n_slots, False, 0, cfg.n_ctx_train)
    return _fix(
        split,
        ["-c", str(cells), "-no-kvu"],
        f"same memory, split pools of {split.n_ctx_seq}; long sessions fail early and alone",
        memory,
    )


def shared_pool_fixes(
    cfg: Config, memory: MemoryCost | None = None, lacks_cap: str | None = None
) -> tuple[Fix, ...]:
    """The fixes (cap each slot, grow the pool, fewer slots) and no -kvu, sized for this
    config. ``lacks_cap``: the installed binary has no --kv-unified-per-slot (and why): split
    pools and fewer slots."""
    n, w = cfg.n_slots, cfg.n_ctx_slot
    cells = cfg.pool_cells or w
    if lacks_cap:
        return _uncapped_fixes(cfg, memory)
    keep = kvlayout.resolve(n * w, n, True, w, cfg.n_ctx_train)
    c_keep = ["-c", str(keep.n_ctx), "--kv-unified-per-slot", str(w)]
    share = max(kvlayout.CELL_PAD, cells // n // kvlayout.CELL_PAD * kvlayout.CELL_PAD)
    same = kvlayout.resolve(cells, n, True, share, cfg.n_ctx_train)
    return (
        *_keeping(keep, c_keep, f"keeps the promised {w}", cfg, cells, memory),
        _fix(
            same,
            ["-c", str(cells), "--kv-unified-per-slot", str(share)],
            f"same memory; clients must be told {share}",
            memory,
        ),
        _split_fix(cfg, cells, memory),
    )


def _uncapped_fixes(cfg: Config, memory: MemoryCost | None) -> tuple[Fix, ...]:
    """Guarantees a build without --kv-unified-per-slot can give: split pools (keeping the
    promised window, or in the same memory) and one slot that owns the pool."""
    n, w = cfg.n_slots, cfg.n_ctx_slot
    cells = cfg.pool_cells or w
    keep = kvlayout.resolve(n * w, n, False, 0, cfg.n_ctx_train)
    one = kvlayout.resolve(cells, 1, True, 0, cfg.n_ctx_train)
    c_keep = ["-c", str(keep.n_ctx), "-no-kvu"]
    return (
        *_keeping(keep, c_keep, f"keeps {w} per slot", cfg, cells, memory),
        _split_fix(cfg, cells, memory),
        _fix(one, ["-c", str(cells), "-np", "1"], "same memory, one client at a time", memory),
    )


def too_long_fixes(
    cfg: Config, needed: int, memory: MemoryCost | None = None, lacks_cap: str | None = None
) -> tuple[Fix, ...]:
    """A per-slot window that holds a prompt of ``needed`` tokens (the server rejects >=)."""
    n = cfg.n_slots
    w = kvlayout.pad(needed + 1)
    if cfg.n_ctx_train is not None and w > cfg.n_ctx_train:
        if needed >= cfg.n_ctx_train:
            return ()  # the model's training context caps every slot below the request
        w = cfg.n_ctx_train
    if cfg.kv_unified and not lacks_cap:
        plan = kvlayout.resolve(n * w, n, True, w, cfg.n_ctx_train)
        flags = ["-c", str(plan.n_ctx), "--kv-unified-per-slot", str(w)]
    else:
        plan = kvlayout.resolve(n * w, n, False, 0, cfg.n_ctx_train)
        flags = ["-c", str(plan.n_ctx), *(["-no-kvu"] if cfg.kv_unified else [])]
    return _and_at_8_bit(
        plan, flags, f"every slot holds {needed} tokens", "the same at 8 bit", memory
    )


def _since(cfg: Config | None, last: Config | None) -> str:
    """A note when the server restarted with another config after these failures."""
    if cfg is None or last is None or cfg.line == last.line:
        return ""
    same = (cfg.n_slots, cfg.n_ctx_slot, cfg.kv_unified, cfg.pool_cells) == (
        last.n_slots,
        last.n_ctx_slot,
        last.kv_unified,
        last.pool_cells,
    )
    now = "with the same config" if same else f"now: {last.promise}"
    return (
        f" (these ran under the startup at line {cfg.line}; the server started again at line "
        f"{last.line}, {now})"
    )


def _too_long_reason(cfg: Config, needed: int) -> str:
    if cfg.n_ctx_train is not None and needed >= cfg.n_ctx_train:
        return (
            f"; no context setting holds {needed} tokens on this model (trained for "
            f"{cfg.n_ctx_train}): the client must send less"
        )
    return ""


def verdicts(
    s: Outcome, memory: MemoryCost | None, lacks_cap: str | None = None
) -> tuple[Verdict, ...]:
    """One verdict per class of failure (the fixes sized for the startup its last failure
    ran under), one for the requests refused up front, and one when the error is in the
    input but no failure could be made of it."""
    out: list[Verdict] = []
    if s.exceeded_lines and not s.failures_total:
        # the error is in the input, but nothing could be grouped: say so, never "no failures"
        out.append(
            Verdict(
                FailureClass.UNKNOWN,
                s.exceeded_lines,
                f"'{serverlog.CONTEXT_EXCEEDED}' is in {s.exceeded_lines} line(s), but none could "
                f"be grouped into a failure ({s.unplaced} placed nowhere, listed below); give "
                "more of the log around them (the batch-halving lines and the slot release "
                "lines), or the whole journal with --unit",
                (),
            )
        )
    for cls, count in s.by_class.most_common():
        cfg = s.class_config.get(cls)
        try:
            v = _verdict(cls, count, cfg, s, memory, lacks_cap)
        except ValueError as e:  # startup values no server prints (a damaged log)
            v = Verdict(cls, count, f"no fix can be sized from this log's startup values: {e}", ())
        out.append(dataclasses.replace(v, reason=v.reason + _since(cfg, s.config)))
    cfg = s.rejection_config
    if s.rejections_total and cfg is not None:
        needed = s.max_rejected or cfg.n_ctx_slot
        cls = FailureClass.FIT_REDUCED if cfg.fit_reduced else FailureClass.TOO_LONG
        out.append(
            Verdict(
                cls,
                s.rejections_total,
                f"{s.rejections_total} request(s) were refused up front (HTTP 400): the "
                f"largest needed {needed} tokens, a slot holds {cfg.n_ctx_slot}"
                + _too_long_reason(cfg, needed)
                + _since(cfg, s.config),
                too_long_fixes(cfg, needed, memory, lacks_cap) if cfg.n_slots else (),
            )
        )
    return tuple(out)


def _verdict(
    cls: FailureClass,
    count: int,
    cfg: Config | None,
    s: Outcome,
    memory: MemoryCost | None,
    lacks_cap: str | None = None,
) -> Verdict:
    v = _verdict_of(cls, count, cfg, s, memory, lacks_cap)
    if lacks_cap and v.fixes:
        v = dataclasses.replace(v, reason=f"{v.reason} (no per-slot cap offered: {lacks_cap})")
    return v


def _verdict_of(
    cls: FailureClass,
    count: int,
    cfg: Config | None,
    s: Outcome,
    memory: MemoryCost | None,
    lacks_cap: str | None,
) -> Verdict:
    if cls is FailureClass.SHARED_POOL:
        reason = (
            "several slots together filled the shared pool; the request that hit the wall "
            "may have been small"
        )
        fixes = shared_pool_fixes(cfg, memory, lacks_cap) if cfg else ()
        return Verdict(cls, count, reason, fixes)
    if cls is FailureClass.TOO_LONG:
        needed = max((f.total for f in s.failures if f.cls is cls), default=0)
        reason = "one slot alone filled the pool" + (_too_long_reason(cfg, needed) if cfg else "")
        fixes = too_long_fixes(cfg, needed, memory, lacks_cap) if cfg else ()
        return Verdict(cls, count, reason, fixes)
    if cls is FailureClass.FIT_REDUCED and cfg is not None and cfg.fit_reduced is not None:
        wanted, got = cfg.fit_reduced
        reason = (
            f"--fit shrank the context from {wanted} to {got} to fit free memory; "
            "an explicit -c stops that (the server then fails to start if it does not fit)"
        )
        plan = kvlayout.resolve(
            wanted, cfg.n_slots, cfg.kv_unified, cfg.per_slot_cap, cfg.n_ctx_train
        )
        return Verdict(
            cls, count, reason, (_fix(plan, ["-c", str(wanted)], "pins the pool", memory),)
        )
    return Verdict(
        cls,
        count,
        "no slot release lines followed, the error was not KV exhaustion, or the pools are "
        "split; read the lines around the failure",
        (),
    )
