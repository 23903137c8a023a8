"""The reader: a log stream read to its end in blocks (``blocks``), the windows of each
block fed to the scanner (``scanner.Scanner``), and the report made of what it found.

One reader, in Python, streaming in constant memory. Within a window the lines holding an
event keyword are fed one by one and the batch-halving cascade lines between them per run;
the rest of a block (slot selection, timings, the release lines of requests that went well)
is only counted, for the line numbers. A window at the start of a block reaches back into
the previous block's end (``Scanner.tail``), and after a window that leaves a cascade or a
failure open the lines are read on to the next release line.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import IO

from launcher.errors import ConfigInvalid
from launcher.reports.diagnose.blocks import (
    BEFORE,
    BLOCK,
    BOOT_BEFORE,
    BOOT_KEYWORDS,
    Lines,
    event_starts,
    line_starts,
    windows,
)
from launcher.reports.diagnose.report import KEEP, MemoryCost, Outcome, Report
from launcher.reports.diagnose.scanner import MS_KW, RT_KW, Scanner
from launcher.reports.diagnose.verdicts import verdicts
from launcher.server import serverlog


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
    scanner = Scanner(pool_hint, pool_hint_source, keep)
    for chunk, size in Lines(stream, block):
        _scan(scanner, chunk, size)
    outcome = scanner.outcome()
    return _report(outcome, source, scanner.lines, pool_hint, pool_hint_source, memory, lacks_cap)


def _report(
    o: Outcome,
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
        verdicts=verdicts(o, memory, lacks_cap),
        drift_lines=o.drift,
        drift_samples=o.drift_samples,
        unplaced_lines=o.unplaced,
        unplaced_samples=o.unplaced_samples,
    )


def _scan(scanner: Scanner, chunk: bytes, size: int) -> None:
    """Feed chunk[:size] (whole lines): the windows around its anchors, and after a window
    that leaves a cascade or a failure open, up to the next release line (it says how the
    cascade ended). A window at the start of the chunk reaches back into the previous
    chunks' tail (``Scanner.tail``)."""
    count, find = chunk.count, chunk.find
    line, pos = scanner.lines, 0  # lines before pos
    spans, boots = windows(chunk, size)
    if spans and spans[0][0] == 0 and scanner.tail:
        _tail_window(scanner)
    queue = deque(spans)
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


def _keep_tail(scanner: Scanner, chunk: bytes, size: int, done: int, lines: int) -> None:
    """Keep the last BOOT_BEFORE bytes read (whole lines), and how far they were fed."""
    if size >= BOOT_BEFORE:
        keep = chunk.find(b"\n", size - BOOT_BEFORE, size) + 1
        scanner.keep_tail(chunk, keep, size)
        scanner.tail_done = max(0, done - keep)
    else:
        old = scanner.tail
        joined = old + chunk[:size]
        cut = 0
        if len(joined) > BOOT_BEFORE:
            cut = joined.find(b"\n", len(joined) - BOOT_BEFORE) + 1
        scanner.tail = joined[cut:]
        scanner.tail_done = max(0, (len(old) + done if done else scanner.tail_done) - cut)
    scanner.tail_end = lines  # tail_base is counted only when a window needs it


def _tail_window(scanner: Scanner) -> None:
    """The lines of the previous chunks' tail within BEFORE of this chunk that no window fed
    yet (a memory-slot line before a retry line that starts this chunk)."""
    tail = scanner.tail
    lo = max(scanner.tail_done, tail.rfind(b"\n", 0, max(0, len(tail) - BEFORE)) + 1)
    if lo >= len(tail):
        return
    base = scanner.tail_end - tail.count(b"\n", lo)
    _scan_region(scanner, tail, lo, len(tail), base)
    scanner.tail_done = len(tail)


def _boot_lines(scanner: Scanner, data: bytes, lo: int, hi: int | None = None) -> None:
    """The boot facts in data[lo:hi] (a startup line follows): their setters are idempotent,
    so lines a window fed already change nothing."""
    hi = len(data) if hi is None else hi
    for start in line_starts(data, BOOT_KEYWORDS, lo, hi):
        end = data.find(b"\n", start, hi)
        text = data[start : end if end >= 0 else hi].decode("utf-8", "replace")
        if text.startswith("{"):
            text = serverlog.normalize(text)
        scanner.boot_fact(text)


def _scan_region(scanner: Scanner, chunk: bytes, lo: int, hi: int, base: int) -> None:
    """Feed chunk[lo:hi] (whole lines; ``base`` lines precede ``lo``): event lines one by
    one, the cascade lines between them per run."""
    find, count = chunk.find, chunk.count
    next_ms, next_rt = find(MS_KW, lo, hi), find(RT_KW, lo, hi)
    pos, line = lo, base  # line: lines before pos
    for start in [*event_starts(chunk, lo, hi), hi]:
        cascade = 0 <= next_ms < start or 0 <= next_rt < start
        if cascade and not scanner.cascade(chunk, pos, start):
            _scan_slow(scanner, chunk, pos, start, line)
        if start == hi:
            break
        line += count(b"\n", pos, start) + 1
        pos = find(b"\n", start) + 1
        scanner.feed(line, chunk[start : pos - 1])
        if 0 <= next_ms < pos:
            next_ms = find(MS_KW, pos, hi)
        if 0 <= next_rt < pos:
            next_rt = find(RT_KW, pos, hi)


def _scan_slow(scanner: Scanner, chunk: bytes, lo: int, hi: int, line: int) -> None:
    """The cascade lines of chunk[lo:hi] one by one (``line`` lines precede ``lo``)."""
    prev = lo
    for start in line_starts(chunk, (MS_KW, RT_KW), lo, hi):
        line += chunk.count(b"\n", prev, start) + 1
        prev = chunk.find(b"\n", start) + 1
        scanner.feed(line, chunk[start : prev - 1])


def journal(unit: str, since: str | None = None) -> contextlib.AbstractContextManager[IO[bytes]]:
    """Stream the unit's journal (``launcher.host.systemd.journal``)."""
    from launcher.host import systemd

    return systemd.journal(unit, since)
