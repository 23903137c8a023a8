"""Read a llama-server log and say why requests failed with "Context size has been exceeded".

The troubleshooting checklist as code: count the error, read the last startup line as a
promise (n_slots x n_ctx_slot against the pool, via ``launcher.server.kvlayout``), group each
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

What the three eras print differs (``serverlog``): b9093 gives the offset as ``i =``, ends a
failure with ``srv update_slots: Context size has been exceeded. i = ...`` and per slot
``send_error`` + ``release``, and prints no ``decode() failed:`` line; b10405 and b11434 print
``srv decode: ... off = ...``, the same pairs, then ``update_slots: decode() failed: ...``.
People paste shortened excerpts: no timestamps or task ids, no ``, ret = N``,
the release lines placed *before* the final ``decode() failed`` line. All of these group into
failures: release lines that follow a cascade are held until the next line says whether the
cascade failed (a ``decode() failed`` line) or found room (anything else).

One reader, in Python, streaming in constant memory. It reads blocks of whole lines (8 MiB;
the cut line is read again or carried over) and parses only the neighbourhood of the few
phrases that matter (``_BLOCK_ANCHORS``: the context error, the retry line, the request-time
rejections, the startup line). They all hold a byte that a server's request traffic does
not, so one memchr pass per block (``bytes.find``) finds them (``_anchor_hits``); where that
byte is common the phrases are searched for themselves. The windows around them (the
cascade before a failure, its releases after, the boot facts before a startup) are parsed:
the lines holding an event keyword (``serverlog.KEYWORDS``) one by one, the batch-halving
cascade lines between two such lines at once from counts and one compiled regex
(``_Scanner.cascade``), line by line when a line does not have the usual form. The rest of a
block (slot selection, timings, the release lines of requests that went well) is only
counted, for the line numbers. Only the last ``keep`` failures are kept in detail (every
failure is counted), and their steps are made from the stored text of the first MAX_STEPS
tries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import IO, Any

from launcher.errors import ConfigInvalid
from launcher.server import kvlayout, serverlog

#: Bytes read per block. Large blocks keep the per-block overhead of the fast path small; a
#: block that stays in the CPU's last-level cache between the read and the passes over it (the
#: anchor byte, the line count) is faster: 4 MiB read a 300 MB log ~10 % faster than 8 MiB and
#: 16 MiB on a 2-core VM (32 MiB L3). Under _BOOT_BEFORE each block's end would be copied.
BLOCK = 4 << 20
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
#: The fixed text of a memory-slot line and of a retry line, up to their numbers.
_MS = b"decode: failed to find a memory slot for batch of size "
_RT = serverlog.RETRY_TEXT.encode()
_MS_B = re.compile(serverlog.MEMORY_SLOT.pattern.encode())
_RT_B = re.compile(serverlog.DECODE_RETRY.pattern.encode())
assert _MS_B.match(_MS + b"1") and _RT_B.match(_RT + b"off = 1, n_batch = 1, ret = 1")
assert _RT_B.match(_RT + b"i = 1, n_batch = 1") and _RT_KW in _RT
#: The numbers of the cascade lines, in order: a memory-slot size, or a retry's off, n_batch.
_N = rb"(\d{1,%d})(?!\d)" % serverlog.MAX_DIGITS
_SIZES = re.compile(
    re.escape(_MS)
    + _N
    + b"|"
    + re.escape(_RT)
    + b"(?:off|i) = "
    + _N
    + b", n_batch = "
    + _N
    + rb"(?:, ret = -?\d{1,%d}(?!\d))?(?![\d,])" % serverlog.MAX_DIGITS
)
#: One match per line holding a cascade keyword.
_KW_LINES = re.compile(b"^.*?(?:" + re.escape(_MS_KW) + b"|" + re.escape(_RT_KW) + b")", re.M)
#: A run of cascade lines longer than this is kept as parsed steps, not as text.
_RAW_MAX = 1 << 16


class _Lines:
    """Whole-line chunks of a binary stream, read in blocks, as (block, end): the lines are
    block[:end]. A seekable stream is read again from the cut line, so no block is copied;
    another one carries the cut line over into the next block."""

    def __init__(self, stream: IO[bytes], block: int = BLOCK) -> None:
        self.stream = stream
        self.block = block
        try:
            self.seekable = stream.seekable()
        except (AttributeError, OSError, ValueError):
            self.seekable = False

    def __iter__(self) -> Iterator[tuple[bytes, int]]:
        rest = b""
        while True:
            data = self.stream.read(self.block)
            if not data:
                break
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest += data
                continue
            if rest:
                data, cut = rest + data, cut + len(rest)
                rest = b""
            if cut < len(data):
                if self.seekable and cut > 0:
                    self.stream.seek(cut - len(data), os.SEEK_CUR)
                else:
                    rest = data[cut:]
            yield data, cut
        if rest:
            yield rest + b"\n", len(rest) + 1


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


def _event_starts(chunk: bytes, lo: int, hi: int) -> list[int]:
    """Sorted starts of the lines of chunk[lo:hi] (whole lines) holding an event keyword."""
    starts = set(_line_starts(chunk, _PLAIN, lo, hi))
    find, rfind = chunk.find, chunk.rfind
    for anchor, keywords in _ANCHORED:
        i = find(anchor, lo, hi)
        while i >= 0:
            start = rfind(b"\n", 0, i) + 1
            end = find(b"\n", i)
            line = chunk[start:end]
            for kw in keywords:
                if kw in line:
                    starts.add(start)
                    break
            i = find(anchor, end + 1, hi)
    return sorted(starts)


#: The phrases looked for over whole blocks. Every line the report needs holds one of them or
#: lies in a window around one, so the rest of a busy server's log (slot selection, timings, the
#: release lines of requests that went well) is never parsed.
_BLOCK_ANCHORS: tuple[tuple[bytes, str], ...] = (
    (serverlog.CONTEXT_EXCEEDED.encode(), "failure"),  # error, send_error, decode() failed
    (b"retrying with smaller batch size", "failure"),  # every retry line, all builds
    (b"exceeds the available context size (", "line"),  # request-time rejections
    (b"is larger than the max context size (", "line"),
    (b"initializing", "startup"),  # the startup line (both forms), a server's first line
)
#: The byte the phrases are found by, and its offset in each. A search for one byte is memchr,
#: several times as fast as a phrase search, and 'z' (of "size" and "initializing") is rare in
#: what a server prints between failures: lower-case words, digits and punctuation without it
#: make up the request traffic. One byte for all phrases: one pass over the block.
_ANCHOR_BYTE = b"z"
_ANCHOR_OFFSETS = tuple((p, p.index(_ANCHOR_BYTE)) for p, _ in _BLOCK_ANCHORS)
#: Hits of the byte checked per block before the phrases are searched instead: checking one
#: costs about what searching 4 KiB for the phrases costs, so a log where the byte is common
#: (another program's output in the same file, a host name) is read at the phrase searches'
#: speed, and the hits checked before cost a few percent of it.
_ANCHOR_HITS_PER_BLOCK, _ANCHOR_HITS_MIN = 4 << 10, 64
#: Around a failure anchor: the memory-slot line before a retry, and after the last one the
#: purges, send_error/release pairs and the ``decode() failed`` line.
_BEFORE, _AFTER = 4 << 10, 64 << 10
#: Before a startup line: the boot facts printed while the model loaded (pool sizing, the
#: context lines, fit); after it, b9093's ``new slot`` lines.
_BOOT_BEFORE, _BOOT_AFTER = 2 << 20, 16 << 10
#: Keywords of the boot facts, searched in the previous block's tail when a startup line
#: lies near the start of a block.
_BOOT_KEYWORDS = tuple(serverlog.KEYWORDS["startup"])


def _anchor_hits(chunk: bytes, size: int) -> dict[bytes, list[int]]:
    """Where each phrase of _BLOCK_ANCHORS starts in chunk[:size], in order: the hits of
    _ANCHOR_BYTE whose surroundings are a phrase, or, past the hits' budget, the phrases' own
    searches from there on."""
    hits: dict[bytes, list[int]] = {phrase: [] for phrase, _ in _BLOCK_ANCHORS}
    find, startswith = chunk.find, chunk.startswith
    budget = max(_ANCHOR_HITS_MIN, size // _ANCHOR_HITS_PER_BLOCK)
    i = find(_ANCHOR_BYTE, 0, size)
    while i >= 0:
        budget -= 1
        if budget < 0:
            # a phrase starting at or after i - off has its byte at or after i, none of
            # which was looked at yet
            for phrase, off in _ANCHOR_OFFSETS:
                found = hits[phrase]
                j = find(phrase, max(0, i - off), size)
                while j >= 0:
                    found.append(j)
                    j = find(phrase, j + 1, size)
            break
        for phrase, off in _ANCHOR_OFFSETS:
            if i >= off and startswith(phrase, i - off, size):
                hits[phrase].append(i - off)
        i = find(_ANCHOR_BYTE, i + 1, size)
    return hits


def _windows(chunk: bytes, size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The merged byte ranges of chunk[:size] (whole lines) around its anchors, and the ranges
    before each startup line where its boot facts are looked for (from the previous
    ``initializing`` line, at most _BOOT_BEFORE back)."""
    find, rfind = chunk.find, chunk.rfind
    spans: list[tuple[int, int]] = []
    boots: list[tuple[int, int]] = []
    hits = _anchor_hits(chunk, size)
    for phrase, kind in _BLOCK_ANCHORS:
        last = end = 0  # the end of the previous anchor of this kind
        for i in hits[phrase]:
            if i < end:
                continue  # the same line again
            start = rfind(b"\n", 0, i) + 1
            end = find(b"\n", i, size) + 1 or size
            if kind == "failure":
                lo, hi = max(0, i - _BEFORE), min(size, end + _AFTER)
            elif kind == "startup":
                lo, hi = max(0, i - _BEFORE), min(size, end + _BOOT_AFTER)
                if b"n_slots" in chunk[start:end]:
                    boots.append((max(last, start - _BOOT_BEFORE), start))
            else:
                lo, hi = start, end
            lo = rfind(b"\n", 0, lo) + 1
            hi = find(b"\n", hi - 1, size) + 1 if hi < size else size
            spans.append((lo, hi or size))
            last = end
    spans.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            if hi > merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged, boots


def _scan(scanner: _Scanner, chunk: bytes, size: int) -> None:
    """Feed chunk[:size] (whole lines): the windows around its anchors, and after a window
    that leaves a cascade or a failure open, up to the next release line (it says how the
    cascade ended). A window at the start of the chunk reaches back into the previous
    chunks' tail (``_Scanner.tail``)."""
    count, find = chunk.count, chunk.find
    line, pos = scanner.lines, 0  # lines before pos
    windows, boots = _windows(chunk, size)
    if windows and windows[0][0] == 0 and scanner.tail:
        _tail_window(scanner)
    queue = deque(windows)
    while queue or (scanner.open() and pos < size):
        if queue and (not scanner.open() or queue[0][0] <= pos):
            lo, hi = queue.popleft()
            lo = max(lo, pos)
        else:
            # an open cascade or failure: read on to the next release line
            nxt = find(b"stop processing", pos, size)
            lo = pos
            hi = size if nxt < 0 else find(b"\n", nxt, size) + 1
            if queue and queue[0][0] < hi:
                hi = queue[0][0]
        while boots and boots[0][1] <= hi:
            blo, bhi = boots.pop(0)
            if blo == 0:
                _boot_lines(scanner, scanner.tail, scanner.tail.rfind(b"initializing") + 1)
            _boot_lines(scanner, chunk, blo, bhi)
        if hi <= lo:
            continue
        line += count(b"\n", pos, lo)
        _scan_region(scanner, chunk, lo, hi, line)
        line += count(b"\n", lo, hi)
        pos = hi
    line += count(b"\n", pos, size)
    _keep_tail(scanner, chunk, size, pos, line)
    scanner.lines = line


def _keep_tail(scanner: _Scanner, chunk: bytes, size: int, done: int, lines: int) -> None:
    """Keep the last _BOOT_BEFORE bytes read (whole lines), and how far they were fed."""
    if size >= _BOOT_BEFORE:
        keep = chunk.find(b"\n", size - _BOOT_BEFORE, size) + 1
        scanner.keep_tail(chunk, keep, size)
        scanner.tail_done = max(0, done - keep)
    else:
        old = scanner.tail
        joined = old + chunk[:size]
        cut = 0
        if len(joined) > _BOOT_BEFORE:
            cut = joined.find(b"\n", len(joined) - _BOOT_BEFORE) + 1
        scanner.tail = joined[cut:]
        scanner.tail_done = max(0, (len(old) + done if done else scanner.tail_done) - cut)
    scanner.tail_end = lines  # tail_base is counted only when a window needs it


def _tail_window(scanner: _Scanner) -> None:
    """The lines of the previous chunks' tail within _BEFORE of this chunk that no window fed
    yet (a memory-slot line before a retry line that starts this chunk)."""
    tail = scanner.tail
    lo = max(scanner.tail_done, tail.rfind(b"\n", 0, max(0, len(tail) - _BEFORE)) + 1)
    if lo >= len(tail):
        return
    base = scanner.tail_end - tail.count(b"\n", lo)
    _scan_region(scanner, tail, lo, len(tail), base)
    scanner.tail_done = len(tail)


def _boot_lines(scanner: _Scanner, data: bytes, lo: int, hi: int | None = None) -> None:
    """The boot facts in data[lo:hi] (a startup line follows): their setters are idempotent,
    so lines a window fed already change nothing."""
    hi = len(data) if hi is None else hi
    for start in _line_starts(data, _BOOT_KEYWORDS, lo, hi):
        end = data.find(b"\n", start, hi)
        text = data[start : end if end >= 0 else hi].decode("utf-8", "replace")
        if text.startswith("{"):
            text = serverlog.normalize(text)
        scanner.boot_fact(text)


def _scan_region(scanner: _Scanner, chunk: bytes, lo: int, hi: int, base: int) -> None:
    """Feed chunk[lo:hi] (whole lines; ``base`` lines precede ``lo``): event lines one by
    one, the cascade lines between them per run."""
    find, count = chunk.find, chunk.count
    next_ms, next_rt = find(_MS_KW, lo, hi), find(_RT_KW, lo, hi)
    pos, line = lo, base  # line: lines before pos
    for start in [*_event_starts(chunk, lo, hi), hi]:
        cascade = 0 <= next_ms < start or 0 <= next_rt < start
        if cascade and not scanner.cascade(chunk, pos, start):
            _scan_slow(scanner, chunk, pos, start, line)
        if start == hi:
            break
        line += count(b"\n", pos, start) + 1
        pos = find(b"\n", start) + 1
        scanner.feed(line, chunk[start : pos - 1])
        if 0 <= next_ms < pos:
            next_ms = find(_MS_KW, pos, hi)
        if 0 <= next_rt < pos:
            next_rt = find(_RT_KW, pos, hi)


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
    kv_unified: bool | None = None  # llama_context: kv_unified (b9093 prints it at INFO)
    slots: int | None = None  # b9093: ``initializing slots, n_slots`` until its ``new slot``


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
    tasks: set[int] = field(default_factory=set)  # the send_error lines' task ids


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
        self.unplaced = 0
        self.unplaced_samples: list[str] = []
        self.held: list[SlotShare] = []  # release lines after a cascade, not yet placed
        self.lines = 0  # lines read so far
        self._tail = b""  # the end of the previous block (its boot facts, see ``tail``)
        self._tail_of: tuple[bytes, int, int] | None = None  # (block, start, end): not cut yet
        self.tail_end = 0  # lines up to the tail's end
        self.tail_done = 0  # the tail's bytes before this were fed by a window
        self._cascade_reset()
        self.pending: _Pending | None = None

    # -- the previous block's end --------------------------------------------------------

    @property
    def tail(self) -> bytes:
        """The end of the previous block, cut from it only when a window needs it (few do)."""
        if self._tail_of is not None:
            block, start, end = self._tail_of
            self._tail, self._tail_of = block[start:end], None
        return self._tail

    @tail.setter
    def tail(self, data: bytes) -> None:
        self._tail, self._tail_of = data, None

    def keep_tail(self, block: bytes, start: int, end: int) -> None:
        self._tail_of = (block, start, end)

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
        self._settle()
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

    def open(self) -> bool:
        """A cascade or failure whose end the next release line may tell."""
        return self.pending is not None or (self.n_steps > 0 and not self.held)

    def boot_fact(self, t: str) -> None:
        """A boot line from a block already read: only the facts, no other state."""
        if not any(k in t for k in ("n_slots", "initializing")):
            self._startup_line(0, t)

    def feed(self, line_no: int, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace")
        if serverlog.CONTEXT_EXCEEDED in text:
            self.exceeded_lines += 1
        if text.startswith("{"):
            text = serverlog.normalize(text)  # a JSON record: its message, unescaped
        if not self._dispatch(line_no, text):
            self.drift += 1
            if len(self.drift_samples) < MAX_SAMPLES:
                self.drift_samples.append(f"{line_no}: {serverlog.normalize(text)}")
            if serverlog.CONTEXT_EXCEEDED in text:
                self._unplaced(line_no, text, "its form is not one this reader knows")

    def _unplaced(self, n: int, text: str, why: str) -> None:
        self.unplaced += 1
        if len(self.unplaced_samples) < MAX_SAMPLES:
            self.unplaced_samples.append(f"{n}: {serverlog.normalize(text).strip()} ({why})")

    def _dispatch(self, n: int, t: str) -> bool:
        if "stop processing" in t:
            if m := serverlog.SLOT_RELEASE.search(t):
                task = int(m["task"]) if m["task"] is not None else None
                self._release(int(m["slot"]), task, int(m["n_tokens"]), m["truncated"] or "0")
                return True
            return False
        if "send_error" in t:
            if m := serverlog.SEND_ERROR.search(t):
                self._send_error(n, m["error"], int(m["task"]))
                return True
            return False
        # any other line ends a run of release lines held after a cascade
        if "decode() failed" in t:
            if m := serverlog.DECODE_FAILED.search(t):
                self._decode_failed(n, m["error"])
                return True
            # pre_decode()/post_decode() failed: other faults in the same wording, no cascade
            return serverlog.OTHER_DECODE_FAILED.search(t) is not None
        self._settle()
        if "memory slot" in t:
            if m := serverlog.MEMORY_SLOT.search(t):
                self._memory_slot(int(m["size"]))
                return True
            return False
        if serverlog.RETRY_TEXT in t:
            if m := serverlog.DECODE_RETRY.search(t):
                self._retry(int(m["off"]), int(m["n_batch"]))
                return True
            return False
        if m := serverlog.DECODE_ERROR.search(t):
            self._decode_error(n, m["error"], int(m["off"]))
            return True
        if "purging slot" in t:
            if m := serverlog.PURGE.search(t):
                self._purge(int(m["slot"]), int(m["tokens"]))
                return True
            return False
        if "Invalid input batch" in t or "Compute error" in t:
            return False  # the error wording without the offsets: a changed format
        if serverlog.CONTEXT_EXCEEDED_BODY in t:
            return True  # a logged 500 body: its send_error line counted the request
        if self._too_long(n, t):
            return True
        return self._startup_line(n, t)

    def _release(self, slot: int, task: int | None, n_tokens: int, truncated: str) -> None:
        share = SlotShare(slot, -1 if task is None else task, n_tokens, truncated != "0", None)
        p = self.pending
        if p is not None:
            # b9093 prints no line after the failure's releases: a release belongs to it when
            # its task got the error (send_error), or, without send_error lines (an excerpt),
            # while no slot repeats; any other release is later traffic and closes it
            mine = task in p.tasks if p.tasks else all(s.slot != slot for s in p.slots)
            if mine:
                p.slots.append(share)
                return
            self._close()
        if any(s.slot == slot for s in self.held):
            self._settle()  # a slot released twice: requests went on after the cascade
        if self.n_steps:
            # after a cascade: the loop found room, unless a ``decode() failed`` line follows
            # (a shortened excerpt may put the failure's release lines before it)
            self.held.append(share)

    def _settle(self) -> None:
        """A line that is not a release: release lines held after a cascade were the loop
        moving on, so the cascade found room."""
        if self.held:
            self.held = []
            self.recovered += 1
            self._cascade_reset()

    def _decode_failed(self, n: int, error: str) -> None:
        """``update_slots: decode() failed: ...``: ends the open failure; after a cascade whose
        final error line is missing (a shortened excerpt) it is the failure itself."""
        if self.pending is None and self.n_steps and error.startswith(serverlog.CONTEXT_EXCEEDED):
            held = self.held
            self.held = []
            off = self.last_off if self.last_off is not None else 0
            self._decode_error(n, error.rstrip(), off)
            assert self.pending is not None
            self.pending.slots.extend(held)
        elif self.pending is None and error.startswith(serverlog.CONTEXT_EXCEEDED):
            self._unplaced(
                n, f"decode() failed: {error}", "no batch-halving cascade or error line before it"
            )
        self._close()

    def _send_error(self, n: int, error: str, task: int) -> None:
        if error.startswith(serverlog.CONTEXT_EXCEEDED):
            self.requests_failed += 1
            if self.pending is not None:
                self.pending.requests_failed += 1
                self.pending.tasks.add(task)
            else:
                self._unplaced(n, error, "a request's error with no failure line before it")
            return
        self._settle()
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
        elif m := serverlog.STARTUP_SLOTS.search(t):
            if not 1 <= int(m["n_slots"]) <= kvlayout.MAX_SLOTS:
                return False
            self.boot.slots = int(m["n_slots"])
        elif m := serverlog.NEW_SLOT.search(t):
            # b9093: the first ``new slot`` line after ``initializing slots`` completes the
            # startup; a unified pool unless its context line said otherwise
            slots, n_ctx_slot = self.boot.slots, int(m["n_ctx_slot"])
            if slots is not None and n_ctx_slot >= 1:
                self.boot.slots = None
                unified = self.boot.kv_unified is not False
                self._startup(n, slots, n_ctx_slot, unified)
        elif m := serverlog.LLAMA_CONTEXT_KV_UNIFIED.search(t):
            self.boot.kv_unified = m["kv_unified"] == "true"
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
        self.held = []
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
            unplaced=self.unplaced,
            unplaced_samples=tuple(self.unplaced_samples),
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
    unplaced: int
    unplaced_samples: tuple[str, ...]


def _report(
    o: _Outcome,
    source: str,
    lines: int,
    pool_hint: int | None,
    pool_hint_source: str,
    memory: MemoryCost | None,
    lacks_cap: str | None = None,
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
        verdicts=_verdicts(o, memory, lacks_cap),
        drift_lines=o.drift,
        drift_samples=o.drift_samples,
        unplaced_lines=o.unplaced,
        unplaced_samples=o.unplaced_samples,
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


def _uncapped_fixes(cfg: Config, memory: MemoryCost | None) -> tuple[Fix, ...]:
    """Guarantees a build without --kv-unified-per-slot can give: split pools (keeping the
    promised window, or in the same memory) and one slot that owns the pool."""
    n, w = cfg.n_slots, cfg.n_ctx_slot
    cells = cfg.pool_cells or w
    keep = kvlayout.resolve(n * w, n, False, 0, cfg.n_ctx_train)
    split = kvlayout.resolve(cells, n, False, 0, cfg.n_ctx_train)
    one = kvlayout.resolve(cells, 1, True, 0, cfg.n_ctx_train)
    grow = f"pool x{keep.n_ctx / cells:.3g}" if cells else "larger pool"
    return (
        _fix(keep, ["-c", str(keep.n_ctx), "-no-kvu"], f"keeps {w} per slot; {grow}", memory),
        _fix(
            keep,
            ["-c", str(keep.n_ctx), "-no-kvu", "-ctk", "q8_0", "-ctv", "q8_0"],
            f"keeps {w}; {grow} at 8 bit, about half the memory of f16",
            memory,
            "q8_0",
        ),
        _fix(
            split,
            ["-c", str(cells), "-no-kvu"],
            f"same memory, split pools of {split.n_ctx_seq}; long sessions fail early and alone",
            memory,
        ),
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
    elif cfg.kv_unified:
        plan = kvlayout.resolve(n * w, n, False, 0, cfg.n_ctx_train)
        flags = ["-c", str(plan.n_ctx), "-no-kvu"]
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


def _verdicts(
    s: _Outcome, memory: MemoryCost | None, lacks_cap: str | None = None
) -> tuple[Verdict, ...]:
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
    s: _Outcome,
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
    s: _Outcome,
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


# ------------------------------------------------------------------------------------------
# Entry points


def diagnose(
    stream: IO[bytes],
    source: str,
    *,
    pool_hint: int | None = None,
    pool_hint_source: str = "--pool",
    keep: int = KEEP,
    memory: MemoryCost | None = None,
    block: int = BLOCK,
    lacks_cap: str | None = None,
) -> Report:
    """Read a binary log stream to its end and return the report.

    ``pool_hint`` is the pool size from outside the log (``--pool N``, or the live
    generation's config), used when the startup lines do not state it; ``pool_hint_source``
    names it in the report. ``memory`` prices each fix (see ``MemoryCost``). ``lacks_cap``:
    the installed llama-server has no --kv-unified-per-slot (``BinaryInfo.lacks``), so the
    fixes use split pools and fewer slots instead.
    """
    if pool_hint is not None and pool_hint <= 0:
        raise ConfigInvalid(
            f"pool size {pool_hint} is not a positive number of cells; "
            "give the -c the server runs with"
        )
    if block < 1:
        raise ConfigInvalid(f"block {block} is not a positive number of bytes; give 1 or more")
    scanner = _Scanner(pool_hint, pool_hint_source, keep)
    for chunk, size in _Lines(stream, block):
        _scan(scanner, chunk, size)
    outcome = scanner.outcome()
    return _report(outcome, source, scanner.lines, pool_hint, pool_hint_source, memory, lacks_cap)


def journal(unit: str, since: str | None = None) -> contextlib.AbstractContextManager[IO[bytes]]:
    """Stream the unit's journal (``launcher.host.systemd.journal``)."""
    from launcher.host import systemd

    return systemd.journal(unit, since)
