"""Where the blocks of ``launcher.reports.diagnose``'s reader end changes nothing in the report.

The reader looks for a few phrases over whole blocks and parses only the lines around them,
so every line that matters can be cut by a block's end, and a window around a phrase near a
block's start reaches back into the block before. These tests cut real logs at every byte of
a failure (b11434's lines from test_diagnose, b9093's from test_forms, seed 000's excerpt),
read them from a file and from a pipe (no seeking back: the cut line is carried over), and
hold each report to the one a single block gives. The journald forms wrap the same lines in
what ``journalctl`` printed for this project's sandbox units (systemd 252).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest
from test_diagnose import NEW_BATCH, SEED
from test_forms import B9093_FAILURE, B9093_STARTUP, DATA

from launcher.reports import diagnose
from launcher.reports.diagnose import blocks

#: A busy server's request traffic between failures (the real b11434 lines of NEW_BATCH's
#: last request), enough of it that the failure lies past the first window's reach back.
TRAFFIC = b"".join(line for line in NEW_BATCH.splitlines(keepends=True) if b"task 86" in line) * (
    2 * blocks.BEFORE // 150
)

#: The real logs, and the line each failure's sweep starts at (it ends after the last error).
LOGS = {
    "b11434": (TRAFFIC + SEED + TRAFFIC, b"initializing"),
    # the startup far before the cascade: no window of the block before reaches its first lines
    "b11434-busy": (
        SEED[: SEED.index(b"0.03.007")] + TRAFFIC * 3 + SEED[SEED.index(b"0.03.007") :] + TRAFFIC,
        b"failed to find a memory slot",
    ),
    "b9093": (TRAFFIC + (B9093_STARTUP + B9093_FAILURE).encode() + TRAFFIC, b"llama_context"),
    "excerpt": (TRAFFIC + (DATA / "seed000-excerpt.log").read_bytes() + TRAFFIC, b"failed"),
}


@contextmanager
def pipe(data: bytes) -> Iterator[IO[bytes]]:
    """A real pipe that ``data`` is written into, as ``journalctl | llama-launcher`` gives."""
    r, w = os.pipe()

    def write() -> None:
        with open(w, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        with open(r, "rb") as f:
            yield f
    finally:
        writer.join()


def read(data: bytes, block: int, tmp: Path | None = None) -> diagnose.Report:
    """The report of ``data`` read in blocks of ``block`` bytes from a file (``tmp``), else
    from a pipe."""
    if tmp is None:
        with pipe(data) as stream:
            return diagnose.diagnose(stream, "log", block=block, pool_hint=262144)
    tmp.write_bytes(data)
    with open(tmp, "rb") as f:
        return diagnose.diagnose(f, "log", block=block, pool_hint=262144)


KEYS = (b"Context size has been exceeded", b"n_slots")


def cuts(data: bytes, first: bytes, stride: int, keys: tuple[bytes, ...] = KEYS) -> list[int]:
    """Block sizes whose first end falls on every byte of the lines holding ``keys`` (the
    failure's error lines, the startup line) in ``data``, and on every ``stride``-th byte
    from the line holding ``first`` to the end of the last error line."""
    lo = data.rfind(b"\n", 0, data.index(first))
    hi = data.index(b"\n", data.rindex(b"Context size has been exceeded")) + 2
    ends = set(range(lo, hi, stride))
    for key in keys:
        i = data.find(key, lo, hi)
        while i >= 0:
            start, end = data.rfind(b"\n", 0, i) + 1, data.find(b"\n", i) + 2
            ends.update(range(start, end))
            i = data.find(key, end, hi)
    return sorted(ends)


@pytest.mark.parametrize("name", sorted(LOGS))
def test_a_block_ending_at_any_byte_of_a_failure_reads_the_same(name: str, tmp_path: Path) -> None:
    data, first = LOGS[name]
    whole = read(data, diagnose.BLOCK, tmp_path / "log")
    assert whole.failures_total == 1 and whole.drift_lines == 0
    for block in cuts(data, first, 5):
        assert read(data, block, tmp_path / "log") == whole, block


@pytest.mark.parametrize("name", sorted(LOGS))
def test_a_pipe_cut_anywhere_in_a_failure_reads_the_same(name: str) -> None:
    data, first = LOGS[name]
    whole = read(data, diagnose.BLOCK)
    assert whole.failures_total == 1
    for block in cuts(data, first, 11):
        assert read(data, block) == whole, block


def test_crlf_lines_read_as_lf_lines_wherever_a_block_ends(tmp_path: Path) -> None:
    """A log saved with CRLF endings (pasted, or copied through Windows): a block may end
    between the CR and the LF."""
    data, first = LOGS["b11434"]
    crlf = data.replace(b"\n", b"\r\n")
    whole = read(data, diagnose.BLOCK, tmp_path / "log")
    for block in cuts(crlf, first, 13):
        assert read(crlf, block, tmp_path / "log") == whole, block
    for cr in range(crlf.index(first), crlf.rindex(b"Context size"), 97):
        block = crlf.index(b"\r", cr) + 1  # the block ends after a CR, before its LF
        assert read(crlf, block, tmp_path / "log") == whole, block


#: One record as ``journalctl -o json`` printed it for a transient --user unit in this
#: project's sandbox (systemd 252); the message, cursor, pid and times are filled in.
JOURNAL_RECORD = {
    "_GID": "0",
    "_RUNTIME_SCOPE": "system",
    "_STREAM_ID": "ccb117b6866247f4b722c7c68270dd29",
    "_CAP_EFFECTIVE": "1fffeffffff",
    "SYSLOG_FACILITY": "3",
    "_MACHINE_ID": "3d1219c7c4c5404aaa1f6d2a48adfda4",
    "SYSLOG_IDENTIFIER": "llama-server",
    "_BOOT_ID": "c56d5207316f48828a5de1be9f42c32c",
    "_HOSTNAME": "vm",
    "_SYSTEMD_CGROUP": "/sandbox.sb/app.slice/llama-server.service",
    "PRIORITY": "6",
    "_SYSTEMD_SLICE": "-.slice",
    "_TRANSPORT": "stdout",
    "_COMM": "llama-server",
    "_UID": "0",
}


def journal_json(lines: list[bytes]) -> bytes:
    out = []
    for i, line in enumerate(lines):
        t = 1796130440546656 + 1000 * i
        record = {
            "__CURSOR": f"s=fd55a6cc819d4ed0ac164aecff89982d;i={i:x};b=c56d5207316f48828a5de1be9"
            f"f42c32c;m={12024366814 + i:x};t={t:x};x=a07ff96f0b122cad",
            "__REALTIME_TIMESTAMP": str(t),
            "__MONOTONIC_TIMESTAMP": str(12024366814 + i),
            **JOURNAL_RECORD,
            "_PID": "17959",
            "MESSAGE": line.decode(),
        }
        out.append(json.dumps(record, separators=(",", ":")).encode() + b"\n")
    return b"".join(out)


def journal_form(form: str, data: bytes, host: bytes = b"vm") -> bytes:
    """``data``'s lines as ``journalctl -o FORM`` prints them on ``host`` (``cat`` prints them
    as they are)."""
    lines = data.splitlines()
    if form == "json":
        return journal_json(lines)
    stamp = {
        "short": b"Dec 01 12:47:15",
        "short-precise": b"Dec 01 12:47:15.546656",
        "short-iso": b"2026-12-01T12:47:15+00:00",
    }[form]
    prefix = b"%s %s llama-server[17959]: " % (stamp, host)
    return b"".join(prefix + line + b"\n" for line in lines)


@pytest.mark.parametrize("form", ["short", "short-precise", "short-iso", "json"])
@pytest.mark.parametrize("name", ["b11434", "b9093"])
def test_journald_forms_read_the_same_wherever_a_block_ends(
    form: str, name: str, tmp_path: Path
) -> None:
    plain = read(LOGS[name][0], diagnose.BLOCK, tmp_path / "log")
    data = journal_form(form, LOGS[name][0])
    for block in [diagnose.BLOCK, *cuts(data, LOGS[name][1], 37, ())]:
        r = read(data, block, tmp_path / "log")
        assert (r.failures, r.config, r.verdicts, r.lines) == (
            plain.failures,
            plain.config,
            plain.verdicts,
            plain.lines,
        ), block
        assert (r.drift_lines, r.exceeded_lines) == (0, plain.exceeded_lines)


def test_a_failure_on_the_first_line_of_the_input(tmp_path: Path) -> None:
    """A journal cut by --since can begin in the middle of a cascade: its first line is the
    error, the releases follow."""
    data = SEED[SEED.index(b"0.03.842.933 E") :]
    for block in (diagnose.BLOCK, 5, len(data.splitlines(keepends=True)[0])):
        r = read(data, block, tmp_path / "log")
        assert (r.failures_total, r.requests_failed, r.lines) == (1, 3, 8)
        f = r.failures[0]
        assert (f.line, f.off, f.total, [s.slot for s in f.slots]) == (1, 580, 1324, [0, 1, 2])


def test_a_failure_on_the_last_line_without_a_newline(tmp_path: Path) -> None:
    """A log read while the server writes it ends in the middle of a failure."""
    data = TRAFFIC + SEED[: SEED.index(b"\n", SEED.index(b"E srv        decode"))]
    for block in (diagnose.BLOCK, 4096, len(data) - 1, len(data)):
        r = read(data, block, tmp_path / "log")
        assert (r.failures_total, r.exceeded_lines, r.lines) == (1, 1, len(data.splitlines()))
        f = r.failures[0]
        assert (f.line, f.off, f.slots, f.n_steps) == (r.lines, 580, (), 10)


#: A request refused up front, as b11434 prints it (the prompt sizes of test_diagnose's).
REJECTION = (
    b"0.05.311.020 E srv    send_error: task id = 90, error: request (5000 tokens) exceeds the "
    b"available context size (1024 tokens), try increasing it\n"
)


def test_a_log_where_the_anchor_byte_is_common_reads_the_same(tmp_path: Path) -> None:
    """The phrases are found by a byte rare in llama-server's output ('z'); on a host named
    zeus every line of a journal holds it, and a block that reaches its budget of hits is
    searched for the phrases themselves from there: every kind of anchor is still found (a
    failure, a rejection, a startup far from any failure), in small blocks and in one."""
    far = TRAFFIC * (blocks.AFTER // len(TRAFFIC) + 1)  # beyond a failure's window
    log = LOGS["b11434"][0] + far + REJECTION + far + LOGS["b11434-busy"][0]
    plain = read(far * 4 + log, diagnose.BLOCK, tmp_path / "log")
    assert (plain.failures_total, plain.rejections_total, plain.startups) == (2, 1, 2)
    zeus = journal_form("short", log, b"zeus")
    data = far * 4 + zeus  # a first block whose start holds no 'z'
    assert b"z" not in far
    assert zeus.count(b"z") > len(zeus) // blocks._ANCHOR_HITS_PER_BLOCK
    for block in [diagnose.BLOCK, *range(len(far * 4), len(data), 2999)]:
        assert read(data, block, tmp_path / "log") == plain, block
