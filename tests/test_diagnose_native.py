"""The C reader (``launcher._diagscan``) against its Python twin: the same report, always.

On the logs the real server wrote in this run, whole and cut into blocks of any size; on
those lines damaged in every way hypothesis finds; from a mapped file; split over threads.
The Python reader is the reference (``launcher/diagnose.py``), the C one is what makes
``diagnose`` fast enough (scripts/bench-diagnose).
"""

from __future__ import annotations

import gzip
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher import diagnose, serverlog
from launcher.errors import ConfigInvalid

pytestmark = pytest.mark.real


def both(data: bytes, **kw: Any) -> tuple[diagnose.Report, diagnose.Report]:
    native = diagnose.diagnose(io.BytesIO(data), "x", engine="native", **kw)
    python = diagnose.diagnose(io.BytesIO(data), "x", engine="python", **kw)
    return native, python


def test_the_native_reader_is_built() -> None:
    assert diagnose.native_available(), "scripts/setup builds launcher._diagscan with the package"


def test_the_native_reader_knows_the_keywords_and_digits_serverlog_does() -> None:
    """The C reader cannot import launcher.serverlog: its copies must not drift apart."""
    native = diagnose._native_module()
    python = {kw for kws in serverlog.KEYWORDS.values() for kw in kws}
    assert set(native.KEYWORDS) == python and len(native.KEYWORDS) == len(python)
    assert native.MAX_DIGITS == serverlog.MAX_DIGITS


def test_an_unknown_or_missing_engine_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigInvalid, match="'fast' is not one of native, python"):
        diagnose.diagnose(io.BytesIO(b""), "x", engine="fast")
    monkeypatch.setattr(diagnose, "_native_module", lambda: None)
    with pytest.raises(ConfigInvalid, match="was not built"):
        diagnose.diagnose(io.BytesIO(b""), "x", engine="native")
    # no engine named: the Python reader, same answer
    assert diagnose.diagnose(io.BytesIO(b"a\n"), "x").lines == 1


@pytest.mark.parametrize("name", ["overflow", "jsonl", "too_long", "healthy"])
@pytest.mark.parametrize("block", [1, 7, 100, 4096, diagnose.BLOCK])
def test_same_report_on_real_logs(logs: dict[str, Any], name: str, block: int) -> None:
    data = logs[name].log.read_bytes()
    native, python = both(data, block=block)
    assert native == python
    assert native.lines == len(data.splitlines())


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_same_report_keeping_few_failures(logs: dict[str, Any], keep: int) -> None:
    data = b"".join(logs[n].log.read_bytes() for n in ("overflow", "too_long", "jsonl")) * 3
    native, python = both(data, keep=keep, pool_hint=1024)
    assert native == python
    assert len(native.failures) == min(keep, native.failures_total)


@pytest.mark.parametrize(
    ("threads", "block", "copies"), [(1, 65536, 40), (2, 7, 5), (3, 777, 40), (8, 65536, 40)]
)
def test_a_file_is_read_from_where_it_stands(
    logs: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    threads: int,
    block: int,
    copies: int,
) -> None:
    """A regular file is read by the C reader's threads, each its own part (pread); a line
    belongs to the part it starts in. Reading starts where the stream stands."""
    one = logs["overflow"].log.read_bytes()
    data = one * copies + b"an unterminated last line with stop processing"
    path = tmp_path / "big.log"
    path.write_bytes(data)
    monkeypatch.setattr(diagnose, "PART_MIN", 1)  # split even a small file over the threads
    monkeypatch.setattr(diagnose, "_threads", lambda: threads)
    start = len(one) * 3 + one.index(b"\n", 5000) + 1  # inside the 4th copy, at a line start
    with open(path, "rb") as f:
        f.seek(start)
        read = diagnose.diagnose(f, "x", engine="native", block=block)
        assert f.tell() == len(data)
    streamed = diagnose.diagnose(io.BytesIO(data[start:]), "x", engine="python", block=65536)
    assert read == streamed
    assert read.lines == len(data[start:].splitlines()) and read.drift_lines == 1


def test_a_log_that_shrinks_while_it_is_read_is_a_clear_error(
    logs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rotated (truncated) file ends before the size it had: an error that says so, not a
    report on part of it. (Fake: the size is reported larger than the file, as if it shrank
    between the fstat and the reads.)"""
    real = diagnose._file_span

    def grown(stream: Any) -> tuple[int, int, int] | None:
        span = real(stream)
        assert span is not None
        return span[0], span[1], span[2] + 4096

    monkeypatch.setattr(diagnose, "_file_span", grown)
    with (
        open(logs["overflow"].log, "rb") as f,
        pytest.raises(ConfigInvalid, match=r"shrank while it was read.*rotated"),
    ):
        diagnose.diagnose(f, "x", engine="native")


def test_an_unreadable_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "w.log"
    path.write_bytes(b"a\n")
    with (
        os.fdopen(os.open(path, os.O_WRONLY), "rb") as f,  # its descriptor is write-only
        pytest.raises(ConfigInvalid, match="cannot read the log: Bad file descriptor"),
    ):
        diagnose.diagnose(f, "x", engine="native")


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_threads_give_the_same_report(
    logs: dict[str, Any], threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block of 1 MiB or more is read in parts by several threads, then applied in order."""
    chunk = b"".join(logs[n].log.read_bytes() for n in ("overflow", "too_long", "healthy"))
    data = chunk * (3 * 2**20 // len(chunk) + 1) + b"a drifted line with stop processing\n"
    monkeypatch.setattr(diagnose, "_threads", lambda: threads)
    native = diagnose.diagnose(io.BytesIO(data), "x", engine="native", block=2 << 20)
    python = diagnose.diagnose(io.BytesIO(data), "x", engine="python", block=2 << 20)
    assert native == python
    assert native.drift_lines == 1 and native.lines == data.count(b"\n")


# ---------------------------------------------------------------------------------------------
# Damaged logs


#: Pieces to splice into a line: keywords, parts of the patterns, bytes that are not text.
PIECES = [
    b"memory slot",
    b", ret = ",
    b"purging slot 1 with 7 tokens",
    b"send_error",
    b"stop processing",
    b"decode() failed",
    b"Context size has been exceeded",
    b"Context size has been exceeded. off = 3, n_batch = 2, ret = 1",
    b"Invalid input batch. off = 9, n_batch = 2, ret = -1",
    b"exceed_context_size_error",
    b"request (900 tokens) exceeds the available context size (512 tokens)",
    b"input (90 tokens) is larger than the max context size (64 tokens)",
    b"initializing, n_slots = 2, n_ctx_slot = 512, kv_unified = 'false'",
    b"srv  llama_server: initializing ...",
    b"--kv-unified-per-slot: sizing KV pool to n_parallel * kv_unified_per_slot = 2 * 300 = 600",
    b"llama_context: n_ctx         = 2048",
    b"llama_kv_cache: size =   16.00 MiB (  2048 cells,   2 layers,  4/1 seqs)",
    b"n_ctx_seq (4096) > n_ctx_train (2048)",
    b"capping per-slot context (1024) to --kv-unified-per-slot (512)",
    b"context size reduced from 8192 to 4096",
    b"release: id  3 | task 7 | stop processing: n_tokens = 12, truncated = 00",
    b"update_slots: decode() failed: ",
    b"update_slots: post_decode() failed: ",
    b'"message":"Context size has been exceeded',
    b" cells",
    b"n_slots",
    b"12345678901",
    b"99999999999999999999",
    b"-",
    b"\r",
    b"\x1b[35m",
    b"\xff\xfe",
    "١٢".encode(),
    "\u00a0".encode(),
    b"\\n",
    b"\t",
    b" ",
]

_DIGITS = re.compile(rb"\d+")


@st.composite
def damaged_logs(draw: st.DrawFn, logs: dict[str, Any]) -> bytes:
    sources = [logs[n].log.read_bytes().split(b"\n") for n in sorted(logs)]
    lines: list[bytes] = []
    for _ in range(draw(st.integers(1, 3))):
        src = draw(st.sampled_from(sources))
        start = draw(st.integers(0, len(src) - 1))
        lines += src[start : start + draw(st.integers(1, 80))]
    for _ in range(draw(st.integers(0, 12))):
        i = draw(st.integers(0, len(lines) - 1))
        line = lines[i]
        op = draw(st.sampled_from(["number", "insert", "cut", "join", "wrap", "pieces"]))
        if op == "number" and (runs := list(_DIGITS.finditer(line))):
            m = draw(st.sampled_from(runs))
            n = draw(st.one_of(st.integers(0, 10**12), st.sampled_from([0, 1, 10**10, 10**11])))
            text = draw(st.sampled_from([str(n), "-" + str(n), "0" * draw(st.integers(1, 12))]))
            line = line[: m.start()] + text.encode() + line[m.end() :]
        elif op == "insert":
            at = draw(st.integers(0, len(line)))
            line = line[:at] + draw(st.sampled_from(PIECES)) + line[at:]
        elif op == "cut" and line:
            a = draw(st.integers(0, len(line) - 1))
            line = line[:a] + line[draw(st.integers(a, len(line))) :]
        elif op == "join" and i + 1 < len(lines):
            line = line + lines.pop(i + 1)
        elif op == "wrap":
            line = draw(
                st.sampled_from(
                    [
                        b'{"type":"log","level":"W","msg":"' + line + b'"}',
                        b"Nov 29 18:07:48 host llama-server[123]: " + line,
                        b"\x1b[34m" + line + b"\x1b[0m",
                    ]
                )
            )
        elif op == "pieces":
            line = b" ".join(draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=4)))
        lines[i] = line
    tail = draw(st.sampled_from([b"\n", b"", b"\r\n"]))
    return b"\n".join(lines) + tail


@settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_same_report_on_damaged_logs(logs: dict[str, Any], data: st.DataObject) -> None:
    log = data.draw(damaged_logs(logs))
    kw = dict(
        block=data.draw(st.sampled_from([1, 2, 5, 64, 700, 4096, 1 << 20])),
        keep=data.draw(st.integers(0, 4)),
        pool_hint=data.draw(st.sampled_from([None, 1, 700, 1024])),
    )
    native, python = both(log, **kw)
    assert native == python
    # and from a file, in small parts over 1 to 4 threads (a thread per part and round)
    threads = data.draw(st.integers(1, 4))
    kw["block"] = data.draw(st.sampled_from([333, 1500, 4096, 1 << 20]))
    with tempfile.NamedTemporaryFile() as f:
        f.write(log)
        f.flush()
        with open(f.name, "rb") as g:
            saved = diagnose.PART_MIN, diagnose._threads
            diagnose.PART_MIN, diagnose._threads = 1, lambda: threads
            try:
                from_file = diagnose.diagnose(g, "x", engine="native", **kw)
            finally:
                diagnose.PART_MIN, diagnose._threads = saved
    assert from_file == python


# ---------------------------------------------------------------------------------------------
# What reaches the native reader: only a plain file's own bytes are read with pread


def test_a_compressed_log_is_read_through_its_decompressor(
    logs: dict[str, Any], tmp_path: Path
) -> None:
    """gzip/bz2/lzma file objects have the compressed file's descriptor: not a plain file."""
    data = logs["overflow"].log.read_bytes()
    path = tmp_path / "log.gz"
    with gzip.open(path, "wb") as f:
        f.write(data)
    with gzip.open(path, "rb") as f:
        native = diagnose.diagnose(f, "x", engine="native")
    assert native == diagnose.diagnose(io.BytesIO(data), "x", engine="python")


def test_a_file_whose_size_says_zero_is_read_to_its_end() -> None:
    with open("/proc/self/status", "rb") as f:  # st_size 0, content all the same
        r = diagnose.diagnose(f, "x", engine="native")
    assert r.lines > 10


def test_a_file_read_past_its_end_is_an_empty_report(logs: dict[str, Any]) -> None:
    with open(logs["healthy"].log, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(f.tell() + 10)
        assert diagnose.diagnose(f, "x", engine="native").lines == 0


def test_a_stream_that_only_reads_is_read(logs: dict[str, Any]) -> None:
    data = logs["overflow"].log.read_bytes()

    class Raw(io.RawIOBase):  # read() only: the readinto it inherits raises
        def __init__(self) -> None:
            self.data = io.BytesIO(data)

        def readable(self) -> bool:
            return True

        def read(self, size: int = -1) -> bytes:
            return self.data.read(size)

    native = diagnose.diagnose(Raw(), "x", engine="native")  # type: ignore[arg-type]
    assert native == diagnose.diagnose(io.BytesIO(data), "x", engine="python")


def test_what_a_live_log_gains_while_it_is_read_is_read_too(
    logs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is read in parts up to the size it had; what was written after is read on as
    a stream, its first line finishing the last one. (Fake: the size reported is cut inside a
    line, as if the writer was in the middle of it.)"""
    path = logs["overflow"].log
    data = path.read_bytes()
    real = diagnose._file_span

    def earlier(stream: Any) -> tuple[int, int, int] | None:
        span = real(stream)
        assert span is not None
        return span[0], span[1], data.index(b"stop processing")

    monkeypatch.setattr(diagnose, "_file_span", earlier)
    with open(path, "rb") as f:
        native = diagnose.diagnose(f, "x", engine="native")
    assert native == diagnose.diagnose(io.BytesIO(data), "x", engine="python")


def test_a_block_must_be_positive() -> None:
    with pytest.raises(ConfigInvalid, match="block 0 is not a positive number of bytes"):
        diagnose.diagnose(io.BytesIO(b"a\n"), "x", block=0)


def test_a_native_scanner_is_set_up_once() -> None:
    native = diagnose._native_module()
    s = native.Scanner(None, 1, 64, 5, 256, 256)
    with pytest.raises(RuntimeError, match="set up once"):
        s.__init__(None, 1, 64, 5, 256, 256)
