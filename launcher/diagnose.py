"""Read a llama-server log and say why requests failed with "Context size has been exceeded".

The troubleshooting checklist as code: count the error, read the last startup line as a
promise (n_slots x n_ctx_slot against the pool, via ``launcher.kvlayout``), group each
batch-halving cascade with the failure it ends in, add up the ``slot release`` lines that
follow it, classify the failure and name the exact ``llama-launcher set`` line that fixes it.

What the real server (b11434) taught:

- A cascade is not one halving run. ``update_slots`` decodes its batch in views of n_batch
  tokens from offset ``off``; a smaller view that fits is placed, ``off`` advances and n_batch
  is reset to ``llama_n_batch`` (min(-b, -c)), so the next view fails again at full size and
  halves again. One failure can follow many memory-slot/retry pairs at rising offsets.
- Free cells are not enough: a view of 323 tokens can fail with 512 cells free, and a view of
  64 then fits (ubatch placement). Only the last view (n_batch = 1) proves the pool is full.
- The release lines count every token a slot has queued, including the part of the batch not
  yet placed. Hence, on the real server: ``sum(n_tokens) = pool + overflow`` where overflow is
  the size of the first view that failed at the final offset (``batch.size() - off``; 719 in
  the log of scripts/repro-overflow). When that view was capped by n_batch the overflow is not
  in the log; then it is inferred as ``sum - pool``.
- A retry can succeed without a line saying so; the next batch may then fail at the same
  offset. Within one batch the view after a retry announcing n_batch is min(n_batch, the
  first view at that offset); a memory-slot line of another size starts a new batch, whose
  first view is the one that counts.

Two readers give the same report. The native one (``launcher._diagscan``, C, built with the
package) is used when it was built: it reads a 1 GiB log in well under a second. The Python
one below (``_Scanner``) is its reference and the fallback; ``diagnose(engine=...)`` picks
one. Both read numbers as 1..10 ASCII digits (``serverlog._compile``).

Both stream in constant memory. The Python reader reads binary blocks of whole lines; lines
holding an event keyword (``serverlog.KEYWORDS``: startup, release, send_error, decode
errors...) are found with C-level searches over the block and parsed one by one; the
batch-halving cascade lines between two such lines (most of a failing server's log) are taken
at once from counts and a few searches (``_Scanner.cascade``), falling back to line by line
when a line does not have the usual form. Only the last ``keep`` failures are kept in detail
(every failure is counted), and their steps are made from the stored text of the first
MAX_STEPS tries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import stat
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import IO, Any

from launcher import kvlayout, serverlog
from launcher.errors import ConfigInvalid

#: Bytes read per block. Large blocks keep the per-block overhead of the fast path small.
BLOCK = 8 << 20
#: Failures kept in detail (the rest are counted).
KEEP = 10
#: Cascade steps kept per failure (the rest are counted).
MAX_STEPS = 64
#: Drift samples kept.
MAX_SAMPLES = 5

#: Memory hook: (plan, type_k, type_v) -> bytes of KV cache, or None when unknown.
#: ``launcher.kvbytes`` will supply one; until then the fixes carry ``memory_bytes=None``.
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
    memory_bytes: int | None  # None: no model known, or no memory hook yet (launcher.kvbytes)
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------
# Reading: binary blocks, keyword prefilter


#: Keywords of the lines read one by one: everything but the batch-halving cascade.
_EVENT_KEYWORDS: tuple[bytes, ...] = tuple(
    dict.fromkeys(
        kw
        for kind, kws in serverlog.KEYWORDS.items()
        if kind not in ("memory_slot", "retry")
        for kw in kws
    )
)
#: Bytes rare in llama-server logs: the lines holding them are found with memchr and checked
#: for the keywords that contain them, instead of one full search per keyword.
_ANCHORS = (b"x", b"(")
_ANCHORED: tuple[tuple[bytes, tuple[bytes, ...]], ...] = tuple(
    (a, tuple(kw for kw in _EVENT_KEYWORDS if a in kw and not any(b in kw for b in _ANCHORS[:n])))
    for n, a in enumerate(_ANCHORS)
)
_PLAIN = tuple(kw for kw in _EVENT_KEYWORDS if not any(a in kw for a in _ANCHORS))
#: The cascade's keywords (``serverlog.KEYWORDS``): its lines are summarised per run.
_MS_KW, _RT_KW = serverlog.KEYWORDS["memory_slot"][0], serverlog.KEYWORDS["retry"][0]
#: The fixed text of a memory-slot line and of a retry line, up to the first number.
_MS = b"decode: failed to find a memory slot for batch of size "
_RT = b"failed to find free space in the KV cache, retrying with smaller batch size, off = "
_MS_B = re.compile(serverlog.MEMORY_SLOT.pattern.encode())
_RT_B = re.compile(serverlog.DECODE_RETRY.pattern.encode())
assert _MS_B.match(_MS + b"1") and _RT_B.match(_RT + b"1, n_batch = 1, ret = 1")
#: The numbers of the cascade lines, in order: a memory-slot size, or a retry's off, n_batch.
_N = rb"(\d{1,%d})(?!\d)" % serverlog.MAX_DIGITS
_SIZES = re.compile(
    re.escape(_MS)
    + _N
    + b"|"
    + re.escape(_RT)
    + _N
    + b", n_batch = "
    + _N
    + rb", ret = -?\d{1,%d}(?!\d)" % serverlog.MAX_DIGITS
)
#: One match per line holding a cascade keyword.
_KW_LINES = re.compile(b"^.*?(?:" + re.escape(_MS_KW) + b"|" + re.escape(_RT_KW) + b")", re.M)
#: A run of cascade lines longer than this is kept as parsed steps, not as text.
_RAW_MAX = 1 << 16


class _Lines:
    """Whole-line chunks of a binary stream, read in blocks; counts all lines."""

    def __init__(self, stream: IO[bytes], block: int = BLOCK) -> None:
        self.stream = stream
        self.block = block
        self.count = 0

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        """(lines before the chunk, chunk ending in a newline)."""
        rest = b""
        while True:
            data = self.stream.read(self.block)
            if not data:
                break
            cut = data.rfind(b"\n")
            if cut < 0:
                rest += data
                continue
            chunk = rest + data[: cut + 1] if rest else data[: cut + 1]
            rest = data[cut + 1 :]
            base = self.count
            self.count += chunk.count(b"\n")
            yield base, chunk
        if rest:
            base = self.count
            self.count += 1
            yield base, rest + b"\n"


def _line_starts(chunk: bytes, keywords: tuple[bytes, ...], lo: int, hi: int) -> list[int]:
    """Sorted starts of the lines in chunk[lo:hi] holding any keyword."""
    starts: set[int] = set()
    find, rfind = chunk.find, chunk.rfind
    for kw in keywords:
        i = find(kw, lo, hi)
        while i >= 0:
            starts.add(rfind(b"\n", 0, i) + 1)
            i = find(kw, find(b"\n", i) + 1, hi)
    return sorted(starts)


def _event_starts(chunk: bytes) -> list[int]:
    """Sorted starts of the lines of ``chunk`` holding an event keyword."""
    starts = set(_line_starts(chunk, _PLAIN, 0, len(chunk)))
    find, rfind = chunk.find, chunk.rfind
    for anchor, keywords in _ANCHORED:
        i = find(anchor)
        while i >= 0:
            start = rfind(b"\n", 0, i) + 1
            end = find(b"\n", i)
            line = chunk[start:end]
            for kw in keywords:
                if kw in line:
                    starts.add(start)
                    break
            i = find(anchor, end + 1)
    return sorted(starts)


def _scan(scanner: _Scanner, base: int, chunk: bytes) -> None:
    """Feed one chunk: event lines one by one, the cascade lines between them per run."""
    find, count = chunk.find, chunk.count
    size = len(chunk)
    next_ms, next_rt = find(_MS_KW), find(_RT_KW)
    pos, line = 0, base  # line: lines before pos
    for start in [*_event_starts(chunk), size]:
        cascade = 0 <= next_ms < start or 0 <= next_rt < start
        if cascade and not scanner.cascade(chunk, pos, start):
            _scan_slow(scanner, chunk, pos, start, line)
        if start == size:
            break
        line += count(b"\n", pos, start) + 1
        pos = find(b"\n", start) + 1
        scanner.feed(line, chunk[start : pos - 1])
        if 0 <= next_ms < pos:
            next_ms = find(_MS_KW, pos)
        if 0 <= next_rt < pos:
            next_rt = find(_RT_KW, pos)


def _scan_slow(scanner: _Scanner, chunk: bytes, lo: int, hi: int, line: int) -> None:
    """The cascade lines of chunk[lo:hi] one by one (``line`` lines precede ``lo``)."""
    prev = lo
    for start in _line_starts(chunk, (_MS_KW, _RT_KW), lo, hi):
        line += chunk.count(b"\n", prev, start) + 1
        prev = chunk.find(b"\n", start) + 1
        scanner.feed(line, chunk[start : prev - 1])


def _steps(detail: list[tuple[Any, ...]], final: Step | None) -> tuple[Step, ...]:
    """The kept steps of a cascade, from its stored lines (see ``_Scanner.cascade``)."""
    steps: list[Step] = []
    last: int | None = None
    for item in detail:
        kind = item[0]
        if kind == "raw":
            for raw in item[1].split(b"\n"):
                if _MS_KW in raw:
                    if m := _MS_B.search(raw):
                        last = int(m["size"])
                elif _RT_KW in raw and (m := _RT_B.search(raw)):
                    if len(steps) < MAX_STEPS:
                        steps.append(Step(int(m["off"]), last, int(m["n_batch"])))
                    last = None
        elif kind == "ms":
            last = item[1]
        elif kind == "rt":
            if len(steps) < MAX_STEPS:
                steps.append(Step(item[1], last, item[2]))
            last = None
        elif steps and steps[-1].purged is None:  # purge
            s = steps[-1]
            steps[-1] = Step(s.off, s.size, s.next_n_batch, (item[1], item[2]))
    if final is not None and len(steps) < MAX_STEPS:
        steps.append(final)
    return tuple(steps)


# ------------------------------------------------------------------------------------------
# The state machine


@dataclass
class _Boot:
    """Facts gathered since the last ``llama_server: initializing ...``."""

    pool_sizing: tuple[int, int, int] | None = None  # (np, per_slot, n_ctx)
    n_ctx: int | None = None  # llama_context: n_ctx (-lv 4)
    kv_cells: int | None = None  # llama_kv_cache: size = ... cells (-lv 4)
    n_ctx_seq_over_train: tuple[int, int] | None = None
    capped: tuple[int, int] | None = None  # (per-slot pool capacity, cap)
    fit_reduced: tuple[int, int] | None = None


@dataclass
class _Pending:
    line: int
    error: str
    off: int
    detail: list[tuple[Any, ...]]  # the cascade as stored (``_steps`` makes the steps)
    final: Step | None
    n_steps: int
    offsets: int
    first_view: int | None
    final_view: int | None
    purges: int
    config: Config | None
    slots: list[SlotShare] = field(default_factory=list)
    requests_failed: int = 0


class _Scanner:
    def __init__(self, pool_hint: int | None, pool_hint_source: str, keep: int) -> None:
        self.pool_hint = pool_hint
        self.pool_hint_source = pool_hint_source
        self.boot = _Boot()
        self.config: Config | None = None
        self.startups = 0
        self.exceeded_lines = 0
        self.requests_failed = 0
        self.rejections: deque[Rejection] = deque(maxlen=keep)
        self.rejections_total = 0
        self.max_rejected: int | None = None
        # the startup each verdict is about: the one in force at its last failure/rejection
        self.class_config: dict[FailureClass, Config | None] = {}
        self.rejection_config: Config | None = None
        # the last ``keep`` failures, their steps still to be made (``_steps``)
        self.kept: deque[tuple[dict[str, Any], list[tuple[Any, ...]], Step | None]] = deque(
            maxlen=keep
        )
        self.failures: tuple[Failure, ...] = ()
        self.failures_total = 0
        self.by_class: Counter[FailureClass] = Counter()
        self.adds_up = 0
        self.checked = 0
        self.recovered = 0
        self.drift = 0
        self.drift_samples: list[str] = []
        self._cascade_reset()
        self.pending: _Pending | None = None

    # -- cascade ---------------------------------------------------------------------------

    def _cascade_reset(self) -> None:
        # the steps are made only for the failures kept in detail: until then the cascade is
        # stored as its text (``detail``, see ``_steps``), up to MAX_STEPS tries
        self.detail: list[tuple[Any, ...]] = []
        self.late_purge = False  # a purge after MAX_STEPS tries was stored
        self.n_steps = 0
        self.n_offsets = 0
        self.last_off: int | None = None
        self.first_view: int | None = None
        self.view_at_off: int | None = None  # first failed view at the current offset
        self.view_capped = False  # that view was as large as n_batch: more may have followed
        self.last_size: int | None = None
        self.expect: int | None = None  # the next view, if the batch at last_off goes on
        self.purges = 0

    def _memory_slot(self, size: int) -> None:
        self._view(size)
        if self.n_steps < MAX_STEPS:
            if self.detail and self.detail[-1][0] == "ms":
                self.detail[-1] = ("ms", size)
            else:
                self.detail.append(("ms", size))

    def _retry(self, off: int, n_batch: int) -> None:
        if self.n_steps < MAX_STEPS:
            self.detail.append(("rt", off, n_batch))
        self._try(off, n_batch)

    def _view(self, size: int) -> None:
        """A memory-slot line: the view of ``size`` tokens did not fit."""
        if self.expect is not None and size != self.expect:
            self.last_off = None  # the retry succeeded: a new batch failed, maybe at that offset
        self.expect = None
        self.last_size = size
        if self.first_view is None:
            self.first_view = size

    def _try(self, off: int, n_batch: int) -> None:
        """A retry line: the next try at ``off`` uses ``n_batch``."""
        if self.last_off != off:
            self.n_offsets += 1
            self.last_off = off
            self.view_at_off = self.last_size
            # the first try at an offset uses the full n_batch, now halved (or kept: purge)
            self.view_capped = self.last_size in (n_batch, 2 * n_batch)
        if self.view_at_off is not None:
            self.expect = min(n_batch, self.view_at_off)
        self.n_steps += 1
        self.last_size = None

    def _purge(self, slot: int, tokens: int) -> None:
        self.purges += 1
        # a purge marks the last step kept; past MAX_STEPS only the first one can
        if self.n_steps < MAX_STEPS or not self.late_purge:
            self.late_purge = self.n_steps >= MAX_STEPS
            self.detail.append(("purge", slot, tokens))

    def cascade(self, chunk: bytes, lo: int, hi: int) -> bool:
        """Take the cascade lines of chunk[lo:hi] (whole lines, no other keyword) at once.

        Does what ``feed`` would do line by line, from one C-level search for their numbers;
        their text is stored for the steps. Returns False, changing nothing, when a line does
        not have the usual form; the caller then feeds the lines one by one.
        """
        found = _SIZES.findall(chunk, lo, hi)
        n_rt = chunk.count(_RT_KW, lo, hi)
        n_kw = chunk.count(_MS_KW, lo, hi) + n_rt
        if len(found) != n_kw:
            return False  # another ", ret = " line (a decode error) or a changed format
        if len(_KW_LINES.findall(chunk, lo, hi)) != n_kw:
            return False  # a line holding two keywords: only its first kind counts (``_dispatch``)
        if self.n_steps < MAX_STEPS:
            self._store(
                chunk, lo, hi, MAX_STEPS - self.n_steps if n_rt > MAX_STEPS - self.n_steps else 0
            )
        view, try_ = self._view, self._try
        for size, off, n_batch in found:
            if size:
                view(int(size))
            else:
                try_(int(off), int(n_batch))
        return True

    def _store(self, chunk: bytes, lo: int, hi: int, tries: int) -> None:
        """Keep the text of chunk[lo:hi] up to its ``tries``-th retry line (0: all of it)."""
        find = chunk.find
        i, cut = lo, hi
        for _ in range(tries):
            i = find(_RT, i, hi)
            if i < 0:
                break
            i = find(b"\n", i, hi) + 1
        else:
            cut = i if tries else hi
        if cut - lo <= _RAW_MAX:
            self.detail.append(("raw", chunk[lo:cut]))
            return
        for start in _line_starts(chunk, (_MS_KW, _RT_KW), lo, cut):
            raw = chunk[start : find(b"\n", start)]
            if _MS_KW in raw:
                if m := _MS_B.search(raw):
                    self.detail.append(("ms", int(m["size"])))
            elif m := _RT_B.search(raw):
                self.detail.append(("rt", int(m["off"]), int(m["n_batch"])))

    # -- failure ---------------------------------------------------------------------------

    def _decode_error(self, line: int, error: str, off: int) -> None:
        self._close()
        if self.last_off != off:
            self.n_offsets += 1
            self.last_off = off
            self.view_at_off, self.view_capped = self.last_size, False
        final = Step(off, self.last_size, None) if self.n_steps < MAX_STEPS else None
        self.n_steps += 1
        self.pending = _Pending(
            line=line,
            error=error,
            off=off,
            detail=self.detail,
            final=final,
            n_steps=self.n_steps,
            offsets=self.n_offsets,
            first_view=self.first_view,
            final_view=None if self.view_capped else self.view_at_off,
            purges=self.purges,
            config=self.config,
        )
        self._cascade_reset()

    def _close(self) -> None:
        p = self.pending
        if p is None:
            return
        self.pending = None
        self.failures_total += 1
        cells = p.config.pool_cells if p.config else self.pool_hint
        total = sum(s.n_tokens for s in p.slots)
        # a view capped by n_batch does not say how much of the batch was left: infer it
        overflow, source = p.final_view, "log"
        if overflow is None:
            if cells is not None and p.slots:
                overflow, source = total - cells, "inferred (sum - pool)"
            else:
                source = "unknown"
        adds_up: bool | None = None
        if cells is not None and overflow is not None and p.slots and source == "log":
            adds_up = total == cells + overflow
            self.checked += 1
            self.adds_up += adds_up
        slots = tuple(
            SlotShare(
                s.slot, s.task, s.n_tokens, s.truncated, s.n_tokens / cells if cells else None
            )
            for s in p.slots
        )
        cls = _classify(p, slots)
        self.by_class[cls] += 1
        self.class_config[cls] = p.config
        self.kept.append(
            (
                dict(
                    number=self.failures_total,
                    line=p.line,
                    error=p.error,
                    off=p.off,
                    n_steps=p.n_steps,
                    offsets=p.offsets,
                    first_view=p.first_view,
                    purges=p.purges,
                    slots=slots,
                    requests_failed=p.requests_failed,
                    total=total,
                    pool_cells=cells,
                    overflow=overflow,
                    overflow_source=source,
                    adds_up=adds_up,
                    cls=cls,
                    config_line=p.config.line if p.config else None,
                ),
                p.detail,
                p.final,
            )
        )

    # -- startup ---------------------------------------------------------------------------

    def _startup(self, line: int, n_slots: int, n_ctx_slot: int, unified: bool) -> None:
        self.startups += 1
        self.config = _config(
            line, n_slots, n_ctx_slot, unified, self.boot, self.pool_hint, self.pool_hint_source
        )
        self._cascade_reset()

    # -- dispatch --------------------------------------------------------------------------

    def feed(self, line_no: int, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace")
        if serverlog.CONTEXT_EXCEEDED in text:
            self.exceeded_lines += 1
        if not self._dispatch(line_no, text):
            self.drift += 1
            if len(self.drift_samples) < MAX_SAMPLES:
                self.drift_samples.append(f"{line_no}: {serverlog.normalize(text)}")

    def _dispatch(self, n: int, t: str) -> bool:
        if "memory slot" in t:
            if m := serverlog.MEMORY_SLOT.search(t):
                self._memory_slot(int(m["size"]))
                return True
            return False
        if ", ret = " in t:
            if m := serverlog.DECODE_RETRY.search(t):
                self._retry(int(m["off"]), int(m["n_batch"]))
                return True
            if m := serverlog.DECODE_ERROR.search(t):
                self._decode_error(n, m["error"], int(m["off"]))
                return True
            return False
        if "stop processing" in t:
            if m := serverlog.SLOT_RELEASE.search(t):
                self._release(int(m["slot"]), int(m["task"]), int(m["n_tokens"]), m["truncated"])
                return True
            return False
        if "send_error" in t:
            if m := serverlog.SEND_ERROR.search(t):
                self._send_error(n, m["error"])
                return True
            return False
        if "purging slot" in t:
            if m := serverlog.PURGE.search(t):
                self._purge(int(m["slot"]), int(m["tokens"]))
                return True
            return False
        if "decode() failed" in t:
            if serverlog.DECODE_FAILED.search(t):
                self._close()
                return True
            # pre_decode()/post_decode() failed: other faults in the same wording, no cascade
            return serverlog.OTHER_DECODE_FAILED.search(t) is not None
        if serverlog.CONTEXT_EXCEEDED_BODY in t:
            return True  # a logged 500 body: its send_error line counted the request
        if self._too_long(n, t):
            return True
        return self._startup_line(n, t)

    def _release(self, slot: int, task: int, n_tokens: int, truncated: str) -> None:
        if self.pending is not None:
            self.pending.slots.append(SlotShare(slot, task, n_tokens, truncated != "0", None))
        elif self.n_steps:
            # a release outside an error means the loop moved on: the cascade found room
            self.recovered += 1
            self._cascade_reset()

    def _send_error(self, n: int, error: str) -> None:
        if error.startswith(serverlog.CONTEXT_EXCEEDED):
            self.requests_failed += 1
            if self.pending is not None:
                self.pending.requests_failed += 1
            return
        self._too_long(n, error)

    def _too_long(self, n: int, t: str) -> bool:
        if serverlog.EXCEED_CONTEXT_TYPE in t:
            return True  # a logged 400 body (-v, a proxy): its send_error line counted it
        m = serverlog.REQUEST_TOO_LONG.search(t) or serverlog.INPUT_TOO_LARGE.search(t)
        if m is None:
            return False
        n_prompt = int(m["n_prompt"])
        self.rejections_total += 1
        self.rejection_config = self.config
        self.rejections.append(Rejection(n, n_prompt, int(m["n_ctx"])))
        self.max_rejected = max(self.max_rejected or 0, n_prompt)
        return True

    def _startup_line(self, n: int, t: str) -> bool:
        if m := serverlog.STARTUP.search(t):
            n_slots, n_ctx_slot = int(m["n_slots"]), int(m["n_ctx_slot"])
            if not (1 <= n_slots <= kvlayout.MAX_SLOTS and n_ctx_slot >= 1):
                return False  # values no server prints: a damaged line, shown as drift
            self._startup(n, n_slots, n_ctx_slot, m["kv_unified"] == "true")
        elif m := serverlog.POOL_SIZING.search(t):
            self.boot.pool_sizing = (int(m["np"]), int(m["per_slot"]), int(m["n_ctx"]))
        elif m := serverlog.LLAMA_CONTEXT_N_CTX.search(t):
            self.boot.n_ctx = int(m["n_ctx"])
        elif m := serverlog.KV_CACHE_CELLS.search(t):
            self.boot.kv_cells = int(m["cells"])
        elif m := serverlog.CONTEXT_WARNINGS["ctx_over_train"].search(t):
            self.boot.n_ctx_seq_over_train = (int(m["n_ctx_seq"]), int(m["n_ctx_train"]))
        elif m := serverlog.CONTEXT_WARNINGS["slot_capped"].search(t):
            self.boot.capped = (int(m["from"]), int(m["to"]))
        elif m := serverlog.FIT_REDUCED.search(t):
            self.boot.fit_reduced = (int(m["from"]), int(m["to"]))
        elif serverlog.SERVER_INIT.search(t):
            self._close()
            self.boot = _Boot()
            self._cascade_reset()
        else:
            # lines that merely mention a startup keyword (n_ctx_seq < n_ctx_train, a cap
            # without effect, other "initializing" lines) are known and harmless; a line that
            # looks like the startup line but did not match it is format drift
            if "n_slots" in t:
                return False
            return any(
                s in t
                for s in ("n_ctx_seq (", "exceeds the per-slot pool", "initializing", " cells")
            )
        return True

    def outcome(self) -> _Outcome:
        """End the input: close the open failure and return what was found."""
        self._close()
        if self.n_steps:
            self.recovered += 1
        self.failures = tuple(
            Failure(steps=_steps(detail, final), **fields) for fields, detail, final in self.kept
        )
        return _Outcome(
            exceeded_lines=self.exceeded_lines,
            failures_total=self.failures_total,
            requests_failed=self.requests_failed,
            rejections_total=self.rejections_total,
            rejections=tuple(self.rejections),
            max_rejected=self.max_rejected,
            recovered=self.recovered,
            startups=self.startups,
            config=self.config,
            failures=self.failures,
            by_class=self.by_class,
            class_config=self.class_config,
            rejection_config=self.rejection_config,
            adds_up=self.adds_up,
            checked=self.checked,
            drift=self.drift,
            drift_samples=tuple(self.drift_samples),
        )


@dataclass(frozen=True)
class _Outcome:
    """What a reader found (the Python ``_Scanner`` or the native one), before the verdicts."""

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


def _report(
    o: _Outcome,
    source: str,
    lines: int,
    pool_hint: int | None,
    pool_hint_source: str,
    memory: MemoryCost | None,
) -> Report:
    return Report(
        source=source,
        lines=lines,
        exceeded_lines=o.exceeded_lines,
        failures_total=o.failures_total,
        requests_failed=o.requests_failed,
        rejections_total=o.rejections_total,
        rejections=o.rejections,
        max_rejected_prompt=o.max_rejected,
        recovered_cascades=o.recovered,
        startups=o.startups,
        config=o.config,
        pool_cells=o.config.pool_cells if o.config else pool_hint,
        pool_source=(
            o.config.pool_source
            if o.config
            else (pool_hint_source if pool_hint else "unknown: no startup line")
        ),
        failures=o.failures,
        by_class={c.value: k for c, k in o.by_class.most_common()},
        adds_up=o.adds_up,
        checked=o.checked,
        verdicts=_verdicts(o, memory),
        drift_lines=o.drift,
        drift_samples=o.drift_samples,
    )


# ------------------------------------------------------------------------------------------
# Config, classification, fixes


def _config(
    line: int,
    n_slots: int,
    n_ctx_slot: int,
    unified: bool,
    boot: _Boot,
    hint: int | None,
    hint_source: str,
) -> Config:
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
    boot: _Boot,
    hint: int | None,
    hint_source: str,
) -> tuple[int | None, str]:
    """The pool size and where it came from, most direct evidence first."""
    if boot.pool_sizing:
        # the line prints n_parallel * N; llama.cpp pads the pool to 256 cells (per stream
        # when split)
        c = kvlayout.pad(boot.pool_sizing[2])
        cells = c if unified else kvlayout.pad(c // n_slots) * n_slots
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


def _classify(p: _Pending, slots: tuple[SlotShare, ...]) -> FailureClass:
    if not p.error.startswith(serverlog.CONTEXT_EXCEEDED) or not slots:
        return FailureClass.UNKNOWN
    if p.config is not None and p.config.fit_reduced is not None:
        return FailureClass.FIT_REDUCED
    if p.config is not None and not p.config.kv_unified:
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


def shared_pool_fixes(cfg: Config, memory: MemoryCost | None = None) -> tuple[Fix, ...]:
    """The fixes (cap each slot, grow the pool, fewer slots) and no -kvu, sized for this config."""
    n, w = cfg.n_slots, cfg.n_ctx_slot
    cells = cfg.pool_cells or w
    keep = kvlayout.resolve(n * w, n, True, w, cfg.n_ctx_train)
    c_keep = ["-c", str(keep.n_ctx), "--kv-unified-per-slot", str(w)]
    share = max(kvlayout.CELL_PAD, cells // n // kvlayout.CELL_PAD * kvlayout.CELL_PAD)
    same = kvlayout.resolve(cells, n, True, share, cfg.n_ctx_train)
    split = kvlayout.resolve(cells, n, False, 0, cfg.n_ctx_train)
    grow = f"pool x{keep.n_ctx / cells:.3g}" if cells else "larger pool"
    return (
        _fix(keep, c_keep, f"keeps the promised {w}; {grow}", memory),
        _fix(
            keep,
            [*c_keep, "-ctk", "q8_0", "-ctv", "q8_0"],
            f"keeps {w}; {grow} at 8 bit, about half the memory of f16",
            memory,
            "q8_0",
        ),
        _fix(
            same,
            ["-c", str(cells), "--kv-unified-per-slot", str(share)],
            f"same memory; clients must be told {share}",
            memory,
        ),
        _fix(
            split,
            ["-c", str(cells), "-no-kvu"],
            f"same memory, split pools of {split.n_ctx_seq}; long sessions fail early and alone",
            memory,
        ),
    )


def too_long_fixes(cfg: Config, needed: int, memory: MemoryCost | None = None) -> tuple[Fix, ...]:
    """A per-slot window that holds a prompt of ``needed`` tokens (the server rejects >=)."""
    n = cfg.n_slots
    w = kvlayout.pad(needed + 1)
    if cfg.n_ctx_train is not None and w > cfg.n_ctx_train:
        if needed >= cfg.n_ctx_train:
            return ()  # the model's training context caps every slot below the request
        w = cfg.n_ctx_train
    if cfg.kv_unified:
        plan = kvlayout.resolve(n * w, n, True, w, cfg.n_ctx_train)
        flags = ["-c", str(plan.n_ctx), "--kv-unified-per-slot", str(w)]
    else:
        plan = kvlayout.resolve(n * w, n, False, 0, cfg.n_ctx_train)
        flags = ["-c", str(plan.n_ctx)]
    return (
        _fix(plan, flags, f"every slot holds {needed} tokens", memory),
        _fix(plan, [*flags, "-ctk", "q8_0", "-ctv", "q8_0"], "the same at 8 bit", memory, "q8_0"),
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


def _verdicts(s: _Outcome, memory: MemoryCost | None) -> tuple[Verdict, ...]:
    out: list[Verdict] = []
    for cls, count in s.by_class.most_common():
        cfg = s.class_config.get(cls)
        try:
            v = _verdict(cls, count, cfg, s, memory)
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
                too_long_fixes(cfg, needed, memory) if cfg.n_slots else (),
            )
        )
    return tuple(out)


def _verdict(
    cls: FailureClass, count: int, cfg: Config | None, s: _Outcome, memory: MemoryCost | None
) -> Verdict:
    if cls is FailureClass.SHARED_POOL:
        reason = (
            "several slots together filled the shared pool; the request that hit the wall "
            "may have been small"
        )
        return Verdict(cls, count, reason, shared_pool_fixes(cfg, memory) if cfg else ())
    if cls is FailureClass.TOO_LONG:
        needed = max((f.total for f in s.failures if f.cls is cls), default=0)
        reason = "one slot alone filled the pool" + (_too_long_reason(cfg, needed) if cfg else "")
        return Verdict(cls, count, reason, too_long_fixes(cfg, needed, memory) if cfg else ())
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


# ------------------------------------------------------------------------------------------
# Entry points


#: The readers ``diagnose`` can use: the C one (``launcher._diagscan``, built with the package
#: when a C compiler was there) and the Python one it mirrors.
ENGINES = ("native", "python")


def native_available() -> bool:
    """True when the C reader was built and imports."""
    return _native_module() is not None


def _native_module() -> Any:
    try:
        from launcher import _diagscan  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _diagscan


def diagnose(
    stream: IO[bytes],
    source: str,
    *,
    pool_hint: int | None = None,
    pool_hint_source: str = "--pool",
    keep: int = KEEP,
    memory: MemoryCost | None = None,
    block: int = BLOCK,
    engine: str | None = None,
) -> Report:
    """Read a binary log stream to its end and return the report.

    ``pool_hint`` is the pool size from outside the log (``--pool N``, or the live
    generation's config), used when the startup lines do not state it; ``pool_hint_source``
    names it in the report. ``memory`` prices each fix (see ``MemoryCost``). ``engine`` picks
    the reader: "native" (the C one; ConfigInvalid when it was not built), "python", or None:
    the C one when it was built, else Python. Both give the same report.
    """
    if pool_hint is not None and pool_hint <= 0:
        raise ConfigInvalid(
            f"pool size {pool_hint} is not a positive number of cells; "
            "give the -c the server runs with"
        )
    if block < 1:
        raise ConfigInvalid(f"block {block} is not a positive number of bytes; give 1 or more")
    if engine not in (None, *ENGINES):
        raise ConfigInvalid(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    native = _native_module() if engine != "python" else None
    if engine == "native" and native is None:
        raise ConfigInvalid(
            "the native reader (launcher._diagscan) was not built; reinstall llama-launcher "
            "with a C compiler present, or use the python engine"
        )
    if native is not None:
        outcome, count = _read_native(
            native, stream, source, pool_hint, pool_hint_source, keep, block
        )
    else:
        scanner = _Scanner(pool_hint, pool_hint_source, keep)
        lines = _Lines(stream, block)
        for base, chunk in lines:
            _scan(scanner, base, chunk)
        outcome, count = scanner.outcome(), lines.count
    return _report(outcome, source, count, pool_hint, pool_hint_source, memory)


#: The native reader's codes, in its order (launcher/_diagscan.c).
_ERRORS = ("Context size has been exceeded.", "Invalid input batch.", "Compute error.")
_SOURCES = ("log", "inferred (sum - pool)", "unknown")
_CLASSES = (
    FailureClass.SHARED_POOL,
    FailureClass.TOO_LONG,
    FailureClass.FIT_REDUCED,
    FailureClass.UNKNOWN,
)


def _threads() -> int:
    """Threads the native reader splits a block over: the CPUs this process may use, up to 8."""
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        return max(1, min(8, os.cpu_count() or 1))


#: The smallest block (or round of a file) the native reader splits over threads.
PART_MIN = 1 << 20


def _file_span(stream: IO[bytes]) -> tuple[int, int, int] | None:
    """(fd, where the stream stands, the file's size) when the stream reads a regular file's
    bytes as they are (not through gzip, bz2...), and there is something left to read."""
    raw = stream.raw if isinstance(stream, io.BufferedReader) else stream
    if not isinstance(raw, io.FileIO):
        return None
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and stream.seekable()):
            return None
        start = stream.tell()
    except (OSError, ValueError):
        return None
    # a size of 0 may not be the truth (/proc files); a position past the end reads nothing
    return (fd, start, st.st_size) if start < st.st_size else None


def _blocks(stream: IO[bytes], block: int) -> Iterator[memoryview | bytes]:
    """The stream in blocks, read into two buffers in turn: the native reader goes on reading
    a block after ``feed`` returns, while the next one is read into the other buffer. A stream
    that cannot ``readinto`` is read with ``read``."""
    bufs = (bytearray(block), bytearray(block))
    turn = 0
    readinto = getattr(stream, "readinto", None)
    while True:
        if readinto is not None:
            buf = bufs[turn]
            try:
                n = readinto(buf)
            except (NotImplementedError, io.UnsupportedOperation):
                readinto = None  # a raw stream that implements read() only
            else:
                if not n:
                    return
                turn ^= 1
                with memoryview(buf) as view:
                    yield view[:n]
                continue
        data = stream.read(block)
        if not data:
            return
        yield data


def _read_native(
    native: Any,
    stream: IO[bytes],
    source: str,
    pool_hint: int | None,
    pool_hint_source: str,
    keep: int,
    block: int,
) -> tuple[_Outcome, int]:
    """Read with the C reader and turn its records into what ``_Scanner.outcome`` returns."""
    scanner = native.Scanner(
        pool_hint,
        keep,
        MAX_STEPS,
        MAX_SAMPLES,
        kvlayout.MAX_SLOTS,
        kvlayout.CELL_PAD,
        _threads(),
        PART_MIN,
    )
    span = _file_span(stream)
    if span is None:
        for data in _blocks(stream, block):
            scanner.feed(data)
    else:
        # a file: the C reader's threads read their own parts of it (pread), from where the
        # stream stands to the size it has now
        fd, start, end = span
        try:
            scanner.feed_file(fd, start, end, block)
        except EOFError as e:
            raise ConfigInvalid(
                f"the log {source} shrank while it was read ({e}): was it rotated? "
                "read it again, or the rotated file"
            ) from e
        except OSError as e:
            raise ConfigInvalid(
                f"cannot read the log: {e.strerror or e} ({source}); "
                "give a readable file, '-' or --unit"
            ) from e
        # what a live log gained meanwhile, read on as a stream (its first line may finish
        # the last one read)
        stream.seek(end)
        if os.fstat(fd).st_size > end:
            for data in _blocks(stream, block):
                scanner.feed(data)
    raw = scanner.finish()
    configs: dict[tuple[Any, ...], Config] = {}

    def config(rec: tuple[Any, ...] | None) -> Config | None:
        if rec is None:
            return None
        if rec not in configs:
            line, n_slots, n_ctx_slot, unified, *boot = rec
            configs[rec] = _config(
                line, n_slots, n_ctx_slot, unified, _Boot(*boot), pool_hint, pool_hint_source
            )
        return configs[rec]

    failures = []
    for f in raw["failures"]:
        cells = f["pool_cells"]
        cfg = config(f["config"])
        failures.append(
            Failure(
                number=f["number"],
                line=f["line"],
                error=_ERRORS[f["error"]],
                off=f["off"],
                steps=tuple(Step(*step) for step in f["steps"]),
                n_steps=f["n_steps"],
                offsets=f["offsets"],
                first_view=f["first_view"],
                purges=f["purges"],
                slots=tuple(
                    SlotShare(slot, task, n, truncated, n / cells if cells else None)
                    for slot, task, n, truncated in f["slots"]
                ),
                requests_failed=f["requests_failed"],
                total=f["total"],
                pool_cells=cells,
                overflow=f["overflow"],
                overflow_source=_SOURCES[f["overflow_source"]],
                adds_up=f["adds_up"],
                cls=_CLASSES[f["cls"]],
                config_line=cfg.line if cfg else None,
            )
        )
    by_class: Counter[FailureClass] = Counter()
    class_config: dict[FailureClass, Config | None] = {}
    for code, count, rec in raw["by_class"]:
        by_class[_CLASSES[code]] = count
        class_config[_CLASSES[code]] = config(rec)
    outcome = _Outcome(
        exceeded_lines=raw["exceeded_lines"],
        failures_total=raw["failures_total"],
        requests_failed=raw["requests_failed"],
        rejections_total=raw["rejections_total"],
        rejections=tuple(Rejection(*r) for r in raw["rejections"]),
        max_rejected=raw["max_rejected"],
        recovered=raw["recovered"],
        startups=raw["startups"],
        config=config(raw["config"]),
        failures=tuple(failures),
        by_class=by_class,
        class_config=class_config,
        rejection_config=config(raw["rejection_config"]),
        adds_up=raw["adds_up"],
        checked=raw["checked"],
        drift=raw["drift"],
        drift_samples=tuple(
            f"{n}: {serverlog.normalize(text.decode('utf-8', 'replace'))}"
            for n, text in raw["drift_samples"]
        ),
    )
    return outcome, raw["lines"]


def journal(unit: str, since: str | None = None) -> contextlib.AbstractContextManager[IO[bytes]]:
    """Stream the unit's journal (``launcher.systemd.journal``)."""
    from launcher import systemd

    return systemd.journal(unit, since)
