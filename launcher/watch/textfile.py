"""Metrics for Prometheus through node_exporter's textfile collector: the page of one unit,
assembled from the store and one sample's reads, rendered and written.

node_exporter reads every ``*.prom`` file in ``--collector.textfile.directory`` at each
scrape (prometheus/node_exporter, collector/textfile.go). Its rules, kept here: one file per
unit (``llama_launcher_<unit>.prom``), written atomically (a temp file in the same folder,
renamed over the old one: a scrape never sees half a file), mode 0644; no client-side
timestamps and no duplicate series (either makes it skip the whole file); one HELP and TYPE
per metric. It exports ``node_textfile_mtime_seconds{file}``: a file whose bytes did not
change is not rewritten, only its mtime is refreshed, so that figure says the sampler runs.

Names follow Prometheus' guide (prometheus.io/docs/practices/naming): one prefix, base units
as suffixes, ``_total`` for counters, ``_timestamp_seconds`` for times. The page is a
``prometheus_client`` collector and its text is ``generate_latest``'s (escaping, HELP and
TYPE as every exporter writes them). The file is not written by ``write_to_textfile``: that
rewrites it every time (an unchanged page only gets a new mtime here), gives its temp file
the umask's mode and a name ``store.sweep_temp`` does not know, and cannot be handed the
sampler's writer (a full disk, in the tests).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from launcher.deploy import store
from launcher.deploy.restart.admission import WAIT_BOUNDS, Ledger
from launcher.errors import StoreError
from launcher.host.systemd import UnitState
from launcher.server.metrics import Metrics
from launcher.server.slots import Pressure
from launcher.watch import bake, record
from launcher.watch.record import Writer


class Declared(NamedTuple):
    """One metric of the file: its type, its labels besides ``unit``, and what it means."""

    kind: str
    labels: tuple[str, ...]
    help: str


#: Every metric of the file (the metrics reference is generated from it)
METRICS: dict[str, Declared] = {
    "llama_launcher_deploys_total": Declared(
        "counter",
        ("outcome",),
        "Generations llama-launcher wrote for the unit, by outcome (deployed, failed: "
        "rolled back, interrupted, adopted: a hand edit kept, reverted: a bake's revert).",
    ),
    "llama_launcher_serving_generation": Declared(
        "gauge",
        (),
        "The generation in the live env file.",
    ),
    "llama_launcher_last_deploy_timestamp_seconds": Declared(
        "gauge",
        (),
        "When the newest generation's deploy began (Unix time).",
    ),
    "llama_launcher_last_deploy_duration_seconds": Declared(
        "gauge",
        (),
        "How long the newest generation's deploy took, to serving or rolled back.",
    ),
    "llama_launcher_kv_pool_tokens": Declared(
        "gauge",
        (),
        "KV cells of the pool, as planned.",
    ),
    "llama_launcher_kv_pool_used_tokens": Declared(
        "gauge",
        ("state",),
        "Tokens the slots hold in the pool, busy (processing) or idle (cached; purged first).",
    ),
    "llama_launcher_slot_tokens": Declared(
        "gauge",
        ("slot",),
        "Tokens one slot holds (prompt and generated).",
    ),
    "llama_launcher_slot_limit_tokens": Declared(
        "gauge",
        ("slot",),
        "The tokens one slot may hold (its n_ctx).",
    ),
    "llama_launcher_requests_total": Declared(
        "counter",
        (),
        "Requests the unit's server started.",
    ),
    "llama_launcher_request_failures_total": Declared(
        "counter",
        ("kind",),
        "Requests answered with an error, by kind (context_exceeded, too_long, decode_failed).",
    ),
    "llama_launcher_context_exceeded_total": Declared(
        "counter",
        (),
        "Requests that failed with 'Context size has been exceeded' (the pool ran out).",
    ),
    "llama_launcher_decode_tokens_per_second": Declared(
        "gauge",
        (),
        "Decode speed between the last two samples that decoded, from llama-server's counters.",
    ),
    "llama_launcher_requests_deferred": Declared(
        "gauge",
        (),
        "Requests waiting for a free slot.",
    ),
    "llama_launcher_process_memory_bytes": Declared(
        "gauge",
        (),
        "RssAnon + VmSwap of the server process (what a leak grows).",
    ),
    "llama_launcher_unit_restarts_total": Declared(
        "counter",
        (),
        "systemd's NRestarts of the unit.",
    ),
    "llama_launcher_wedged_samples": Declared(
        "gauge",
        (),
        "Samples in a row in which the server lived but did not answer (restarted at the "
        "setting wedged_samples).",
    ),
    "llama_launcher_wedged_restarts_total": Declared(
        "counter",
        (),
        "Restarts of the unit by the sampler because its server lived but did not answer.",
    ),
    "llama_launcher_bake_state": Declared(
        "gauge",
        ("state",),
        "1 for the state of the unit's newest bake (the live generation's, or the one its "
        "revert ended), 0 for the others: baking, reverting, passed, inconclusive, reverted, "
        "revert_failed, ended.",
    ),
    "llama_launcher_bake_generation": Declared(
        "gauge",
        (),
        "The generation the newest bake watches.",
    ),
    "llama_launcher_bake_deadline_timestamp_seconds": Declared(
        "gauge",
        (),
        "When the newest bake's window ends (Unix time).",
    ),
    "llama_launcher_admission_requests_total": Declared(
        "counter",
        ("outcome",),
        "Generations the front's admission took in (admitted, of them waited: let in after a "
        "wait) or answered itself (refused_queue, refused_wait: 503 with Retry-After; "
        "refused_large: the server's 400 for a prompt no slot holds; refused_server: the "
        "server refused to count it, malformed or without a valid key, and the client got "
        "that answer; left: the client went away while it waited). From HAProxy's start.",
    ),
    "llama_launcher_admission_waiting": Declared(
        "gauge", (), "Generations waiting at the front for room in the KV pool."
    ),
    "llama_launcher_admission_pool_tokens": Declared(
        "gauge",
        ("state",),
        "The shared KV pool as the front's admission counts it: reserved (the worst cases of "
        "the generations it let in and that still run), unseen (busy slots it did not let "
        "in, a whole window each) and free.",
    ),
    "llama_launcher_admission_wait_seconds": Declared(
        "histogram",
        (),
        "How long admitted generations waited at the front for room in the KV pool.",
    ),
    "llama_launcher_sample_source_up": Declared(
        "gauge",
        ("source",),
        "1 when the last sample could read the source (slots, metrics, proc, journal).",
    ),
}

#: The sources of ``llama_launcher_sample_source_up`` (what ``Read.unread`` names)
SOURCES = ("slots", "metrics", "proc", "journal")

_NAME = re.compile(r"[^A-Za-z0-9_]")
_FAMILY = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
#: a histogram's series: its cumulative buckets (upper bound, count; the last +Inf: all of
#: them) and the sum of values
Histogram = tuple[tuple[tuple[float, int], ...], float]


@dataclass
class Page:
    """The samples of one file, in ``METRICS`` order when rendered: a ``prometheus_client``
    collector of one unit."""

    unit: str
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def add(self, name: str, value: float | None, **labels: str) -> None:
        """One series (``unit`` is added); a value of None leaves it out."""
        self._declared(name, labels, "histogram", False)
        if value is None:
            return
        self.samples.setdefault(name, []).append(({"unit": self.unit, **labels}, float(value)))

    def add_histogram(self, name: str, value: Histogram) -> None:
        """A histogram's one series (``unit`` is its label): buckets <= each bound and sum."""
        self._declared(name, {}, "histogram", True)
        self.histograms[name] = value

    @staticmethod
    def _declared(name: str, labels: dict[str, str], kind: str, is_kind: bool) -> None:
        if name not in METRICS:
            raise KeyError(f"{name} is not a metric of this file")
        if (METRICS[name].kind == kind) is not is_kind:
            raise KeyError(f"{name} is a {METRICS[name].kind}")
        if tuple(labels) != METRICS[name].labels:
            raise KeyError(f"{name} has the labels {METRICS[name].labels}, not {tuple(labels)}")

    def collect(self) -> Iterator[Metric]:
        """One family per metric that has a series, each series once."""
        for name, (kind, _, text) in METRICS.items():
            if kind == "histogram":
                if name in self.histograms:
                    buckets, total = self.histograms[name]
                    family = HistogramMetricFamily(name, text, labels=["unit"])
                    family.add_metric(
                        [self.unit],
                        [("+Inf" if math.isinf(le) else f"{le:g}", n) for le, n in buckets],
                        total,
                    )
                    yield family
                continue
            series = self.samples.get(name)
            if not series:
                continue
            names = list(series[0][0])
            family = _FAMILY[kind](name, text, labels=names)
            seen: set[tuple[str, ...]] = set()
            for labels, value in series:
                values = tuple(labels[k] for k in names)
                if values not in seen:  # a duplicate series makes the collector skip the file
                    seen.add(values)
                    family.add_metric(values, value)
            yield family

    def render(self) -> str:
        return generate_latest(self).decode()


def file_name(unit: str) -> str:
    """``llama_launcher_<unit>.prom``: the unit's name with every other character as ``_``."""
    return f"llama_launcher_{_NAME.sub('_', unit.removesuffix('.service'))}.prom"


def publish(folder: Path, unit: str, text: str, write: Writer) -> bool:
    """Put ``text`` in the unit's file in ``folder`` (through ``write``, atomically, 0644).
    Returns whether the bytes changed; an unchanged file only gets a new mtime."""
    path = folder / file_name(unit)
    data = text.encode()
    try:
        if path.read_bytes() == data:
            os.utime(path)
            return False
    except FileNotFoundError:
        pass
    write(path, data, 0o644)
    return True


# -- the page of one sample ------------------------------------------------------------------


class Kept(Protocol):
    """What the page keeps between samples, in the sampler's state
    (``launcher.watch.sampler.State``)."""

    #: generation number -> outcome, and the newest deploy's time and duration
    outcomes: dict[str, str]
    last_deploy: list[float | None]
    #: the counts of the generations before the live one
    past: dict[str, float] | None
    decode_tps: float | None


class Read(Protocol):
    """What the page shows of one read of the unit (``launcher.watch.reads.Reads``)."""

    @property
    def unit(self) -> UnitState: ...
    @property
    def metrics(self) -> Metrics | None: ...
    @property
    def unread(self) -> dict[str, str]: ...
    @property
    def admission(self) -> Ledger | None: ...


class Told(Protocol):
    """Where a sample says what it wrote and what failed (``launcher.watch.sampler.Outcome``)."""

    wrote: list[str]
    errors: list[str]


def publish_page(folder: Path | None, page: Page, write: Writer, out: Told) -> None:
    """The metrics file, when a folder is set (``metrics_textfile_dir``); a failed write
    leaves the old one and is named in ``out``."""
    if folder is None:
        return
    try:
        if publish(folder, page.unit, page.render(), write):
            out.wrote.append(str(folder / file_name(page.unit)))
    except OSError as e:
        why = store.write_failed(e, folder, "--textfile-dir")
        out.errors.append(f"the metrics file was not updated (the old one stays): {why}")


def page_of(
    unit: str,
    st: store.Store,
    state: Kept,
    rec: record.Record | None,
    pressure: Pressure | None,
    reads: Read | None,
) -> Page:
    """The unit's page: its deploys, the pool as ``pressure`` saw it, the counts of every
    generation and what ``reads`` found (the caches go in ``state``)."""
    page = Page(unit)
    _deploys(st, state, page)
    page.add("llama_launcher_serving_generation", st.live_number())
    if pressure is not None:
        page.add("llama_launcher_kv_pool_tokens", pressure.pool_cells)
        page.add("llama_launcher_kv_pool_used_tokens", pressure.held(True), state="busy")
        page.add("llama_launcher_kv_pool_used_tokens", pressure.held(False), state="idle")
        for s in pressure.slots:
            page.add("llama_launcher_slot_tokens", s.tokens, slot=str(s.id))
            page.add("llama_launcher_slot_limit_tokens", s.n_ctx, slot=str(s.id))
    totals = _totals(st, state, rec)
    page.add("llama_launcher_requests_total", totals.get("requests", 0))
    for kind in ("context_exceeded", "too_long", "decode_failed"):
        page.add("llama_launcher_request_failures_total", totals.get(kind, 0), kind=kind)
    page.add("llama_launcher_context_exceeded_total", totals.get("context_exceeded", 0))
    page.add("llama_launcher_decode_tokens_per_second", state.decode_tps)
    if reads is not None:
        gauges = reads.metrics.gauges if reads.metrics else {}
        page.add("llama_launcher_requests_deferred", gauges.get("requests_deferred"))
        # as recorded (within a MiB): a page of memory is no reason to rewrite the file
        page.add("llama_launcher_process_memory_bytes", rec.now.memory if rec else None)
        page.add("llama_launcher_unit_restarts_total", reads.unit.n_restarts)
        for source in SOURCES:
            page.add("llama_launcher_sample_source_up", source not in reads.unread, source=source)
        if reads.admission is not None:
            admission_lines(reads.admission, page)
    return page


def admission_lines(ledger: Ledger, page: Page) -> None:
    """The front's admission: what it took in and answered, what waits, the pool it counts."""
    outcomes = ("admitted", "waited", "refused_queue", "refused_wait", "refused_large", "left")
    for outcome in (*outcomes, "refused_server"):
        page.add(
            "llama_launcher_admission_requests_total", getattr(ledger, outcome), outcome=outcome
        )
    page.add("llama_launcher_admission_waiting", ledger.waiting)
    page.add("llama_launcher_admission_pool_tokens", ledger.reserved, state="reserved")
    page.add("llama_launcher_admission_pool_tokens", ledger.taken - ledger.reserved, state="unseen")
    page.add("llama_launcher_admission_pool_tokens", ledger.free, state="free")
    buckets = (*zip(WAIT_BOUNDS, ledger.wait_buckets, strict=True), (math.inf, ledger.wait_count))
    page.add_histogram("llama_launcher_admission_wait_seconds", (buckets, ledger.wait_sum))


def bake_lines(st: store.Store, page: Page) -> None:
    """The newest bake's state (one series per state, 1 for its own), generation and
    deadline; none when the unit never baked."""
    b = bake.newest(st)
    if b is None:
        return
    for state in bake.STATES:
        page.add("llama_launcher_bake_state", b.state == state, state=state)
    page.add("llama_launcher_bake_generation", b.generation)
    page.add("llama_launcher_bake_deadline_timestamp_seconds", round(b.deadline, 3))


def _deploys(st: store.Store, state: Kept, page: Page) -> None:
    """Generations by outcome: read once per generation (an outcome is final once a deploy
    is done), again when one was still pending."""
    numbers = st.numbers()
    cached = state.outcomes
    if [int(n) for n in cached] != numbers or "pending" in cached.values():
        cached = {}
        for n in numbers:
            with contextlib.suppress(StoreError):
                gen = st.get(n)
                # a bake's revert is a rollback that deployed: counted as what it was
                cached[str(n)] = "reverted" if gen.meta.get("reverted_from") else gen.outcome
        state.outcomes = cached
        newest = st.get(numbers[-1]).meta if numbers else {}
        total = (newest.get("timings") or {}).get("total")
        state.last_deploy = [newest.get("time"), total]
    by: dict[str, int] = {}
    for outcome in cached.values():
        if outcome != "pending":
            by[outcome] = by.get(outcome, 0) + 1
    for outcome, n in sorted(by.items()):
        page.add("llama_launcher_deploys_total", n, outcome=outcome)
    page.add("llama_launcher_last_deploy_timestamp_seconds", state.last_deploy[0])
    page.add("llama_launcher_last_deploy_duration_seconds", state.last_deploy[1])


def _totals(st: store.Store, state: Kept, rec: record.Record | None) -> dict[str, float]:
    """Counts over every generation's record: the ones before the live one, summed once and
    kept in the state; the live one's own."""
    if state.past is None:
        state.past = {}
        live = st.live_number()
        for n in st.numbers():
            if n == live:
                continue
            with contextlib.suppress(StoreError):
                for k, v in record.load(st.get(n).path, n).totals.items():  # read only
                    state.past[k] = state.past.get(k, 0) + v
    totals = dict(state.past)
    for k, v in (rec.totals if rec else {}).items():
        totals[k] = totals.get(k, 0) + v
    return totals
