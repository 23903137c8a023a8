"""What a diagnosis finds: the report, its failures and their steps, the startup read as a
promise (``Config``), the verdicts and the fixes, and the limits on what is kept in detail.

Frozen results; ``Outcome`` is what the reader found before the verdicts are made.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from launcher.server import kvlayout

#: Failures kept in detail (the rest are counted).
KEEP = 10
#: Cascade steps kept per failure (the rest are counted).
MAX_STEPS = 64
#: Drift samples kept.
MAX_SAMPLES = 5

#: Memory hook: (plan, type_k, type_v) -> bytes of KV cache, or None when unknown.
#: ``launcher.server.kvbytes`` will supply one; until then the fixes carry ``memory_bytes=None``.
MemoryCost = Callable[[kvlayout.PoolPlan, str, str], int | None]


class FailureClass(StrEnum):
    SHARED_POOL = "shared-pool exhaustion"
    TOO_LONG = "a single request longer than its slot"
    FIT_REDUCED = "context reduced by fit"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Fix:
    """One way out: the exact command, and what it guarantees."""

    command: str
    guaranteed_window: int  # cells every slot can rely on while all are busy
    pool_cells: int
    memory_bytes: (
        int | None
    )  # None: no model known, or no memory hook yet (launcher.server.kvbytes)
    note: str


@dataclass(frozen=True)
class Verdict:
    cls: FailureClass
    count: int
    reason: str
    fixes: tuple[Fix, ...]  # first = the recommended one


@dataclass(frozen=True)
class Config:
    """What the last startup before a point in the log promised."""

    line: int
    n_slots: int
    n_ctx_slot: int
    kv_unified: bool
    pool_cells: int | None
    pool_source: str  # where pool_cells came from, in words
    per_slot_cap: int  # --kv-unified-per-slot, 0 when not seen
    fit_reduced: tuple[int, int] | None  # (from, to) when fit shrank the context
    n_ctx_train: int | None
    plan: kvlayout.PoolPlan | None
    promise: str  # the startup line read as a sentence


@dataclass(frozen=True)
class Step:
    """One try of a cascade: a view of ``size`` tokens at ``off`` did not fit."""

    off: int
    size: int | None  # from the memory-slot line
    next_n_batch: int | None  # from the retry line; None for the final try
    purged: tuple[int, int] | None = None  # (slot, tokens) purged instead of halving


@dataclass(frozen=True)
class SlotShare:
    slot: int
    task: int
    n_tokens: int
    truncated: bool
    share: float | None  # of the pool, 0..1


@dataclass(frozen=True)
class Failure:
    """One decode failure and the cascade and slot releases around it."""

    number: int  # 1-based among all failures in the input
    line: int
    error: str
    off: int
    steps: tuple[Step, ...]
    n_steps: int  # all tries, including those not kept
    offsets: int  # distinct offsets tried (restarts after part of the batch was placed)
    first_view: int | None  # size of the first view that failed
    purges: int
    slots: tuple[SlotShare, ...]
    requests_failed: int  # send_error lines
    total: int
    pool_cells: int | None
    overflow: int | None  # the view that could not be placed, from the log
    overflow_source: str  # "log" | "inferred (sum - pool)" | "unknown"
    adds_up: bool | None  # total == pool + overflow (None: pool or overflow unknown)
    cls: FailureClass
    config_line: int | None


@dataclass(frozen=True)
class Rejection:
    line: int
    n_prompt: int
    n_ctx: int


@dataclass(frozen=True)
class Report:
    source: str
    lines: int
    exceeded_lines: int  # what `grep -c 'Context size has been exceeded'` counts
    failures_total: int
    requests_failed: int  # HTTP 500 "Context size has been exceeded." answers
    rejections_total: int  # HTTP 400 exceed_context_size_error answers
    rejections: tuple[Rejection, ...]  # the last few
    max_rejected_prompt: int | None
    recovered_cascades: int  # cascades that found room after all
    startups: int
    config: Config | None  # the last startup
    pool_cells: int | None  # the last startup's pool, else the hint
    pool_source: str
    failures: tuple[Failure, ...]  # the last ``keep``
    by_class: dict[str, int]
    adds_up: int  # failures whose release lines add up to pool + overflow
    checked: int  # failures where that could be checked
    verdicts: tuple[Verdict, ...]
    drift_lines: int
    drift_samples: tuple[str, ...]
    #: lines holding "Context size has been exceeded" that no failure took, and why
    unplaced_lines: int = 0
    unplaced_samples: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Outcome:
    """What a reader found (``scanner.Scanner``), before the verdicts."""

    exceeded_lines: int
    failures_total: int
    requests_failed: int
    rejections_total: int
    rejections: tuple[Rejection, ...]
    max_rejected: int | None
    recovered: int
    startups: int
    config: Config | None  # the last startup
    failures: tuple[Failure, ...]  # the last ``keep``
    by_class: Counter[FailureClass]  # in the order each class was first seen
    class_config: dict[FailureClass, Config | None]  # the startup of each class's last failure
    rejection_config: Config | None  # the startup of the last rejection
    adds_up: int
    checked: int
    drift: int
    drift_samples: tuple[str, ...]
    unplaced: int
    unplaced_samples: tuple[str, ...]
