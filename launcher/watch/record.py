"""Every generation's live record: what the sampler saw while it served, compact and bounded.

One file per generation, beside its ``meta.json``: ``STATE_DIR/generations/NNNN/live.json``.
It holds rows, one per minute in which a sample recorded something (a sample that finds
nothing changed records nothing), each a list of numbers in the order of ``ROW``; minutes
older than a week before the newest row are folded into one row per hour, and hours older
than a year are dropped (the totals keep everything). A minute row is about 80 bytes, so a
week of one-minute rows is under a megabyte per unit: one generation is live at a time.

Time is weighted, not counted: a sample that records something first gives the time since
the last recorded sample to the state that held through it (nothing changed meanwhile, or
the samples in between would have recorded it): to the hours served when the server was up,
and to the pool-use histogram (seconds per percent), from which the p95 comes. A reader adds
the open end (``tail_until``: the sampler's last run, ``launcher.watch.sample``).

The file is replaced atomically (temp file in the same folder, rename): a sampler killed at
any point leaves the old record or the new one, whole, and a temporary file the next sample
sweeps. A record that cannot be parsed is moved aside (``live.json.bad``) and a new one is
started, with a note: a record is never half read.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.server.serverlog import TALLY_KEYS

VERSION = 1
NAME = "live.json"

#: The columns of a row: its start (Unix seconds, a minute's or an hour's), then the counts,
#: the counter deltas (seconds of the server's own time), then the peaks and the memory.
ROW = (
    "t",
    "samples",
    *TALLY_KEYS,  # what the sample counted in the journal
    "restarts",
    "prompt_tokens",
    "prompt_seconds",
    "decode_tokens",
    "decode_seconds",
    "pool_peak",  # permille of the pool, the highest sample in the row
    "slot_fill_peak",  # permille of a slot's cap, the fullest slot of the row
    "busy_peak",  # slots processing at once
    "deferred_peak",  # requests waiting for a slot (llamacpp:requests_deferred)
    "memory",  # RssAnon + VmSwap bytes at the row's last sample
)
COL = {name: i for i, name in enumerate(ROW)}
SUMS = ROW[1:14]
PEAKS = ("pool_peak", "slot_fill_peak", "busy_peak", "deferred_peak")
COUNTS = ROW[2:10]
TOKENS = ROW[10:14]

MINUTE, HOUR = 60, 3600
#: Minute rows kept before they are folded into hours; hour rows kept after that.
KEEP_MINUTES = 7 * 86400
KEEP_HOURS = 365 * 86400
#: Failures remembered with the pool as the sample before them saw it.
FAILURES_KEPT = 200
#: Pool-use histogram: one bin per percent, the last one for 100 % and more.
BINS = 101
#: A memory change smaller than this since the last recorded sample is no change.
MEMORY_STEP = 1 << 20

Row = list[float | None]
Writer = Callable[[Path, bytes, int], None]


@dataclass
class Now:
    """The state of the moment a sample saw (compared to tell a change)."""

    up: bool = True
    pool: int | None = None  # permille
    slot_fill: int | None = None  # permille
    busy: int | None = None
    deferred: int | None = None
    memory: int | None = None

    def same(self, other: Now) -> bool:
        def near(a: int | None, b: int | None) -> bool:
            return a == b or (a is not None and b is not None and abs(a - b) < MEMORY_STEP)

        return (self.up, self.pool, self.slot_fill, self.busy, self.deferred) == (
            other.up,
            other.pool,
            other.slot_fill,
            other.busy,
            other.deferred,
        ) and near(self.memory, other.memory)


@dataclass
class Delta:
    """What one sample adds: counts and counter deltas since the sample before, the state
    it saw, and the failures it found with the pool before them."""

    t: float
    now: Now
    counts: dict[str, float] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def adds(self) -> bool:
        return any(v for v in self.counts.values()) or bool(self.failures)


@dataclass
class Record:
    """One generation's live record (see the module docstring)."""

    generation: int
    minutes: list[Row] = field(default_factory=list)
    hours: list[Row] = field(default_factory=list)
    totals: dict[str, float] = field(default_factory=dict)
    served_seconds: float = 0.0
    pool_seconds: list[float] = field(default_factory=lambda: [0.0] * BINS)
    failures: list[dict[str, Any]] = field(default_factory=list)
    #: the first and the last recorded sample; the state the last one saw
    first: float | None = None
    last: float | None = None
    now: Now = field(default_factory=Now)
    notes: list[str] = field(default_factory=list)

    # -- adding ----------------------------------------------------------------------------

    def changed_by(self, delta: Delta) -> bool:
        """Whether ``delta`` is worth a write: it counts something, or the state moved."""
        return delta.adds or self.first is None or not self.now.same(delta.now)

    def elapse(self, until: float) -> None:
        """Give the time since the last recorded sample to the state that held through it."""
        if self.last is None or until <= self.last:
            return
        span = until - self.last
        if self.now.up:
            self.served_seconds += span
            if self.now.pool is not None:
                self.pool_seconds[min(self.now.pool // 10, BINS - 1)] += span
        self.last = until

    def begin(self, served_from: float) -> None:
        """A record of a generation no sample saw yet: it has served since ``served_from``
        (the gate passed then)."""
        if self.first is None and self.last is None:
            self.last = served_from

    def add(self, delta: Delta) -> None:
        """Record one sample."""
        self.elapse(delta.t)
        if self.first is None:
            self.first = delta.t
        self.last = delta.t
        row = self._row(delta.t)
        row[COL["samples"]] = (row[COL["samples"]] or 0) + 1
        for name, value in delta.counts.items():
            if name in COL:  # a count no column holds (vLLM's preemptions): its total only
                row[COL[name]] = (row[COL[name]] or 0) + value
            self.totals[name] = self.totals.get(name, 0) + value
        self.totals["samples"] = self.totals.get("samples", 0) + 1
        n = delta.now
        seen = (n.pool, n.slot_fill, n.busy, n.deferred)
        for name, peak in zip(PEAKS, seen, strict=True):
            row[COL[name]] = _max(row[COL[name]], peak)
        if n.memory is not None:
            row[COL["memory"]] = n.memory
        self.now = n
        self.failures = (self.failures + delta.failures)[-FAILURES_KEPT:]
        self.fold()

    def close(self, until: float) -> None:
        """The generation stopped serving at ``until`` (another one went live)."""
        self.elapse(until)
        self.now = Now(up=False)

    def _row(self, t: float) -> Row:
        start = float(int(t // MINUTE) * MINUTE)
        if not self.minutes or (self.minutes[-1][0] or 0) < start:
            self.minutes.append([start, *([0] * len(SUMS)), *([None] * (len(ROW) - 14))])
        return self.minutes[-1]

    def fold(self) -> None:
        """Minutes older than a week (before the newest row) into hours; old hours out."""
        if not self.minutes:
            return
        newest = self.minutes[-1][0] or 0.0
        if (self.minutes[0][0] or 0) > newest - KEEP_MINUTES:
            return  # nothing to fold
        keep = [r for r in self.minutes if (r[0] or 0) > newest - KEEP_MINUTES]
        old = self.minutes[: len(self.minutes) - len(keep)]
        self.minutes = keep
        for row in old:
            hour = float(int((row[0] or 0) // HOUR) * HOUR)
            if self.hours and self.hours[-1][0] == hour:
                self.hours[-1] = merge(self.hours[-1], row)
            else:
                self.hours.append([hour, *row[1:]])
        self.hours = [r for r in self.hours if (r[0] or 0) > newest - KEEP_HOURS]

    # -- reading ---------------------------------------------------------------------------

    def rows(self, since: float | None = None, until: float | None = None) -> list[Row]:
        """Hour rows, then minute rows, whose start lies in [since, until)."""
        return [
            r
            for r in (*self.hours, *self.minutes)
            if (since is None or (r[0] or 0) >= since) and (until is None or (r[0] or 0) < until)
        ]

    def summary(self, tail_until: float | None = None) -> Summary:
        """The headline figures; ``tail_until``: the sampler's last run (the open end, which
        adds to the hours served when the server was up at the last recorded sample)."""
        served, pool_seconds = self.served_seconds, list(self.pool_seconds)
        tail = tail_until - self.last if tail_until is not None and self.last is not None else 0
        if tail > 0 and self.now.up:
            served += tail
            if self.now.pool is not None:
                pool_seconds[min(self.now.pool // 10, BINS - 1)] += tail
        return summarize(self.generation, self.rows(), self.totals, served, pool_seconds)

    # -- the file --------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "generation": self.generation,
            "columns": list(ROW),
            "first": self.first,
            "last": self.last,
            "now": self.now.__dict__,
            "served_seconds": round(self.served_seconds, 3),
            "totals": self.totals,
            "pool_seconds": [round(x, 3) for x in self.pool_seconds],
            "failures": self.failures,
            "notes": self.notes[-20:],
            "hours": [_compact(r) for r in self.hours],
            "minutes": [_compact(r) for r in self.minutes],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        if data.get("version") != VERSION or list(data.get("columns") or []) != list(ROW):
            raise ValueError(f"not a version {VERSION} live record")
        pool = [float(x) for x in data["pool_seconds"]]
        if len(pool) != BINS:
            raise ValueError("the pool histogram has the wrong length")
        return cls(
            generation=int(data["generation"]),
            minutes=[_row(r) for r in data["minutes"]],
            hours=[_row(r) for r in data["hours"]],
            totals={str(k): float(v) for k, v in data["totals"].items()},
            served_seconds=float(data["served_seconds"]),
            pool_seconds=pool,
            failures=list(data["failures"]),
            first=data["first"],
            last=data["last"],
            now=Now(**data["now"]),
            notes=[str(x) for x in data.get("notes", [])],
        )


def path_of(generation_dir: Path) -> Path:
    return generation_dir / NAME


def load(generation_dir: Path, number: int, repair: bool = False) -> Record:
    """The generation's record; a new one when there is none. One that cannot be read gives
    a new one that says so; ``repair`` (the sampler, which then writes the new one) moves
    the unreadable file aside to ``live.json.bad`` first."""
    path = path_of(generation_dir)
    try:
        data = json.loads(path.read_bytes())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return Record.from_json(data)
    except FileNotFoundError:
        return Record(number)
    except (OSError, ValueError, KeyError, TypeError) as e:
        where = "left as it is"
        if repair:
            aside = path.with_name(NAME + ".bad")
            try:
                path.replace(aside)
                where = f"moved aside to {aside}"
            except OSError as moved:
                where = f"could not be moved aside ({moved.strerror})"
        return Record(number, notes=[f"the live record {path} could not be read ({e}); {where}"])


def save(generation_dir: Path, record: Record, write: Writer) -> None:
    """Write the record atomically through ``write`` (``launcher.watch.sample``'s writer)."""
    data = json.dumps(record.to_json(), separators=(",", ":")).encode()
    write(path_of(generation_dir), data, 0o600)


def merge(a: Row, b: Row) -> Row:
    """Two rows as one (the first one's start): sums added, peaks the higher, the later
    memory."""
    out = list(a)
    for name in SUMS:
        out[COL[name]] = (a[COL[name]] or 0) + (b[COL[name]] or 0)
    for name in PEAKS:
        out[COL[name]] = _max(a[COL[name]], b[COL[name]])
    out[COL["memory"]] = b[COL["memory"]] if b[COL["memory"]] is not None else a[COL["memory"]]
    return out


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def _compact(row: Row) -> list[float | int | None]:
    return [int(x) if isinstance(x, float) and x.is_integer() else x for x in row]


def _row(raw: Iterable[Any]) -> Row:
    row = [None if x is None else float(x) for x in raw]
    if len(row) != len(ROW):
        raise ValueError(f"a row of {len(row)} columns, not {len(ROW)}")
    return row


# -- the figures a person (and the bake, #27) reads -----------------------------------------


@dataclass(frozen=True)
class Summary:
    """A generation's headline figures, over the rows given."""

    generation: int
    served_hours: float
    samples: int
    requests: int
    completions: int
    failures: int
    context_exceeded: int
    too_long: int
    decode_failed: int
    kv_retries: int
    restarts: int
    prompt_tokens: int
    decode_tokens: int
    #: Σ tokens ÷ Σ the server's own seconds for them (its counters), over the rows
    prompt_tps: float | None
    decode_tps: float | None
    #: the median of the rows' own rates (rows that decoded anything)
    decode_tps_median: float | None
    prompt_tps_median: float | None
    decode_rows: int
    pool_peak: float | None
    pool_p95: float | None
    pool_median: float | None
    slot_fill_peak: float | None
    busy_peak: int | None
    deferred_peak: int | None
    memory: int | None
    memory_median: int | None
    #: least squares over the rows' memory, bytes per hour
    memory_slope: float | None

    @property
    def errors_per_1k(self) -> float | None:
        return 1000 * self.failures / self.requests if self.requests else None

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "errors_per_1k": self.errors_per_1k}


def summarize(
    generation: int,
    rows: list[Row],
    totals: dict[str, float] | None = None,
    served_seconds: float = 0.0,
    pool_seconds: list[float] | None = None,
) -> Summary:
    """The figures of ``rows`` (with ``totals``: the whole life's counts, which outlive
    dropped hour rows; with ``pool_seconds``: the time-weighted pool use for the p95)."""
    sums = {name: sum(r[COL[name]] or 0 for r in rows) for name in SUMS}
    if totals is not None:
        sums.update({k: v for k, v in totals.items() if k in sums})

    def col(name: str) -> list[float]:
        return [v for r in rows if (v := r[COL[name]]) is not None]

    def rates(tok: str, sec: str) -> list[float]:
        return [(r[COL[tok]] or 0) / s for r in rows if (s := r[COL[sec]] or 0) > 0]

    decode_rates = rates("decode_tokens", "decode_seconds")
    prompt_rates = rates("prompt_tokens", "prompt_seconds")
    pools = col("pool_peak")
    mem_points = [(r[0] or 0.0, r[COL["memory"]]) for r in rows if r[COL["memory"]] is not None]
    return Summary(
        generation=generation,
        served_hours=served_seconds / 3600,
        samples=int(sums["samples"]),
        **{name: int(sums[name]) for name in COUNTS},
        prompt_tokens=int(sums["prompt_tokens"]),
        decode_tokens=int(sums["decode_tokens"]),
        prompt_tps=_ratio(sums["prompt_tokens"], sums["prompt_seconds"]),
        decode_tps=_ratio(sums["decode_tokens"], sums["decode_seconds"]),
        decode_tps_median=statistics.median(decode_rates) if decode_rates else None,
        prompt_tps_median=statistics.median(prompt_rates) if prompt_rates else None,
        decode_rows=len(decode_rates),
        pool_peak=max(pools) / 1000 if pools else None,
        pool_p95=_p95(pool_seconds) if pool_seconds else None,
        pool_median=statistics.median(pools) / 1000 if pools else None,
        slot_fill_peak=_peak(col("slot_fill_peak"), 1000),
        busy_peak=_int(_peak(col("busy_peak"), 1)),
        deferred_peak=_int(_peak(col("deferred_peak"), 1)),
        memory=_int(mem_points[-1][1]) if mem_points else None,
        memory_median=_int(statistics.median(m for _, m in mem_points if m is not None))
        if mem_points
        else None,
        memory_slope=slope(mem_points),
    )


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _peak(values: list[float], scale: float) -> float | None:
    return max(values) / scale if values else None


def _int(x: float | None) -> int | None:
    return None if x is None else int(x)


def _p95(seconds: list[float]) -> float | None:
    """The pool use (a share) that the pool stayed at or under 95 % of the served time."""
    total = sum(seconds)
    if total <= 0:
        return None
    run = 0.0
    for i, s in enumerate(seconds):
        run += s
        if run >= 0.95 * total:
            return (i + 1) / 100 if i < BINS - 1 else 1.0
    return 1.0


def slope(points: list[tuple[float, float | None]]) -> float | None:
    """Least-squares slope of (time, bytes), in bytes per hour; None under two points or a
    span of a minute."""
    pts = [(t, float(m)) for t, m in points if m is not None]
    if len(pts) < 2 or pts[-1][0] - pts[0][0] < MINUTE:
        return None
    mt = sum(t for t, _ in pts) / len(pts)
    mm = sum(m for _, m in pts) / len(pts)
    var = sum((t - mt) ** 2 for t, _ in pts)
    if var <= 0 or not math.isfinite(var):
        return None
    return sum((t - mt) * (m - mm) for t, m in pts) / var * 3600
