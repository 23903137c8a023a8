"""The state machine that groups a llama-server log's lines into failures, rejections and
startups: each batch-halving cascade with the failure it ends in, the ``slot release`` lines
that follow it added up against the pool, each failure classified (``verdicts.classify``).

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

The lines holding an event keyword (``serverlog.KEYWORDS``) are fed one by one (``feed``),
the batch-halving cascade lines between two such lines at once, from counts and one compiled
regex (``Scanner.cascade``), line by line when a line does not have the usual form. Only the
last ``keep`` failures are kept in detail (every failure is counted), and their steps are
made from the stored text of the first MAX_STEPS tries.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from launcher.reports.diagnose.blocks import line_starts
from launcher.reports.diagnose.report import (
    MAX_SAMPLES,
    MAX_STEPS,
    Config,
    Failure,
    FailureClass,
    Outcome,
    Rejection,
    SlotShare,
    Step,
)
from launcher.reports.diagnose.startup import Boot, startup_config
from launcher.reports.diagnose.verdicts import classify
from launcher.server import kvlayout, serverlog

#: The cascade's keywords (``serverlog.KEYWORDS``): its lines are summarised per run.
MS_KW, RT_KW = serverlog.KEYWORDS["memory_slot"][0], serverlog.KEYWORDS["retry"][0]
#: The fixed text of a memory-slot line and of a retry line, up to their numbers.
_MS = b"decode: failed to find a memory slot for batch of size "
_RT = serverlog.RETRY_TEXT.encode()
_MS_B = re.compile(serverlog.MEMORY_SLOT.pattern.encode())
_RT_B = re.compile(serverlog.DECODE_RETRY.pattern.encode())
assert _MS_B.match(_MS + b"1") and _RT_B.match(_RT + b"off = 1, n_batch = 1, ret = 1")
assert _RT_B.match(_RT + b"i = 1, n_batch = 1") and RT_KW in _RT
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
_KW_LINES = re.compile(b"^.*?(?:" + re.escape(MS_KW) + b"|" + re.escape(RT_KW) + b")", re.M)
#: A run of cascade lines longer than this is kept as parsed steps, not as text.
_RAW_MAX = 1 << 16


def _cascade_line(raw: bytes) -> tuple[Any, ...] | None:
    """A cascade line as the cascade is stored: ``("ms", size)``, ``("rt", off, n_batch)``,
    or None for another line (or one whose form changed)."""
    if MS_KW in raw:
        m = _MS_B.search(raw)
        return ("ms", int(m["size"])) if m else None
    if RT_KW in raw and (m := _RT_B.search(raw)):
        return ("rt", int(m["off"]), int(m["n_batch"]))
    return None


def _items(detail: list[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    """The stored cascade, its text read into lines."""
    for item in detail:
        if item[0] != "raw":
            yield item
            continue
        for raw in item[1].split(b"\n"):
            if (line := _cascade_line(raw)) is not None:
                yield line


def _steps(detail: list[tuple[Any, ...]], final: Step | None) -> tuple[Step, ...]:
    """The kept steps of a cascade, from its stored lines (see ``Scanner.cascade``)."""
    steps: list[Step] = []
    last: int | None = None
    for item in _items(detail):
        kind = item[0]
        if kind == "ms":
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


class Scanner:
    """The lines of one log, fed in order (``feed``, ``cascade``), grouped as they come;
    ``outcome`` ends the input and returns what was found."""

    def __init__(self, pool_hint: int | None, pool_hint_source: str, keep: int) -> None:
        self.pool_hint = pool_hint
        self.pool_hint_source = pool_hint_source
        self.boot = Boot()
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
        # the first try at an offset uses the full n_batch, now halved (or kept: purge)
        self._offset(off, capped=self.last_size in (n_batch, 2 * n_batch))
        if self.view_at_off is not None:
            self.expect = min(n_batch, self.view_at_off)
        self.n_steps += 1
        self.last_size = None

    def _offset(self, off: int, capped: bool) -> None:
        """A try at ``off``: a new offset is counted, and the view that failed last is its
        first (``capped``: as large as n_batch, so more of the batch may have followed)."""
        if self.last_off != off:
            self.n_offsets += 1
            self.last_off = off
            self.view_at_off, self.view_capped = self.last_size, capped

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
        n_rt = chunk.count(RT_KW, lo, hi)
        n_kw = chunk.count(MS_KW, lo, hi) + n_rt
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
        for start in line_starts(chunk, (MS_KW, RT_KW), lo, cut):
            if (line := _cascade_line(chunk[start : find(b"\n", start)])) is not None:
                self.detail.append(line)

    # -- failure ---------------------------------------------------------------------------

    def _decode_error(self, line: int, error: str, off: int) -> None:
        self._close()
        self._offset(off, capped=False)
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
        cls = classify(p.error, p.config, slots)
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
        self.config = startup_config(
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
            self.boot = Boot()
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

    def outcome(self) -> Outcome:
        """End the input: close the open failure and return what was found."""
        self._close()
        self.held = []
        if self.n_steps:
            self.recovered += 1
        self.failures = tuple(
            Failure(steps=_steps(detail, final), **fields) for fields, detail, final in self.kept
        )
        return Outcome(
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
