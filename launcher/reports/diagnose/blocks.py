"""The log as blocks of whole lines, and where in a block the few lines that matter lie.

A block is read whole (``BLOCK`` bytes; the cut line is read again or carried over:
``Lines``), and only the neighbourhood of the few phrases that matter is parsed
(``_BLOCK_ANCHORS``: the context error, the retry line, the request-time rejections, the
startup line). They all hold a byte that a server's request traffic does not, so one memchr
pass per block (``bytes.find``) finds them (``_anchor_hits``); where that byte is common the
phrases are searched for themselves. ``windows`` gives the byte ranges around them (the
cascade before a failure, its releases after, the boot facts before a startup) that the
reader (``reader``) feeds to the scanner. Pure: bytes in, offsets out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import IO

from launcher.server import serverlog

#: Bytes read per block. Large blocks keep the per-block overhead of the fast path small; a
#: block that stays in the CPU's last-level cache between the read and the passes over it (the
#: anchor byte, the line count) is faster: 4 MiB read a 300 MB log ~10 % faster than 8 MiB and
#: 16 MiB on a 2-core VM (32 MiB L3). Under BOOT_BEFORE each block's end would be copied.
BLOCK = 4 << 20

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


class Lines:
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


def line_starts(chunk: bytes, keywords: tuple[bytes, ...], lo: int, hi: int) -> list[int]:
    """Sorted starts of the lines in chunk[lo:hi] holding any keyword."""
    starts: set[int] = set()
    find, rfind = chunk.find, chunk.rfind
    for kw in keywords:
        i = find(kw, lo, hi)
        while i >= 0:
            starts.add(rfind(b"\n", 0, i) + 1)
            i = find(kw, find(b"\n", i) + 1, hi)
    return sorted(starts)


def event_starts(chunk: bytes, lo: int, hi: int) -> list[int]:
    """Sorted starts of the lines of chunk[lo:hi] (whole lines) holding an event keyword."""
    starts = set(line_starts(chunk, _PLAIN, lo, hi))
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
BEFORE, AFTER = 4 << 10, 64 << 10
#: Before a startup line: the boot facts printed while the model loaded (pool sizing, the
#: context lines, fit); after it, b9093's ``new slot`` lines.
BOOT_BEFORE, BOOT_AFTER = 2 << 20, 16 << 10
#: Keywords of the boot facts, searched in the previous block's tail when a startup line
#: lies near the start of a block.
BOOT_KEYWORDS = tuple(serverlog.KEYWORDS["startup"])


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


def windows(chunk: bytes, size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The merged byte ranges of chunk[:size] (whole lines) around its anchors, and the ranges
    before each startup line where its boot facts are looked for (from the previous
    ``initializing`` line, at most BOOT_BEFORE back)."""
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
                lo, hi = max(0, i - BEFORE), min(size, end + AFTER)
            elif kind == "startup":
                lo, hi = max(0, i - BEFORE), min(size, end + BOOT_AFTER)
                if b"n_slots" in chunk[start:end]:
                    boots.append((max(last, start - BOOT_BEFORE), start))
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
