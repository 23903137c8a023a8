"""Metrics for Prometheus through node_exporter's textfile collector.

node_exporter reads every ``*.prom`` file in ``--collector.textfile.directory`` at each
scrape (prometheus/node_exporter, collector/textfile.go). Its rules, kept here: one file per
unit (``llama_launcher_<unit>.prom``), written atomically (a temp file in the same folder,
renamed over the old one: a scrape never sees half a file), mode 0644; no client-side
timestamps and no duplicate series (either makes it skip the whole file); one HELP and TYPE
per metric. It exports ``node_textfile_mtime_seconds{file}``: a file whose bytes did not
change is not rewritten, only its mtime is refreshed, so that figure says the sampler runs.

Names follow Prometheus' guide (prometheus.io/docs/practices/naming): one prefix, base units
as suffixes, ``_total`` for counters, ``_timestamp_seconds`` for times. The format needs no
library: a few lines of text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from launcher.watch.record import Writer

#: name -> (type, help)
METRICS = {
    "llama_launcher_deploys_total": (
        "counter",
        "Generations llama-launcher wrote for the unit, by outcome (deployed, failed: "
        "rolled back, interrupted, adopted: a hand edit kept).",
    ),
    "llama_launcher_serving_generation": ("gauge", "The generation in the live env file."),
    "llama_launcher_last_deploy_timestamp_seconds": (
        "gauge",
        "When the newest generation's deploy began (Unix time).",
    ),
    "llama_launcher_last_deploy_duration_seconds": (
        "gauge",
        "How long the newest generation's deploy took, to serving or rolled back.",
    ),
    "llama_launcher_kv_pool_tokens": ("gauge", "KV cells of the pool, as planned."),
    "llama_launcher_kv_pool_used_tokens": (
        "gauge",
        "Tokens the slots hold in the pool, busy (processing) or idle (cached; purged first).",
    ),
    "llama_launcher_slot_tokens": ("gauge", "Tokens one slot holds (prompt and generated)."),
    "llama_launcher_slot_limit_tokens": ("gauge", "The tokens one slot may hold (its n_ctx)."),
    "llama_launcher_requests_total": ("counter", "Requests the unit's server started."),
    "llama_launcher_request_failures_total": (
        "counter",
        "Requests answered with an error, by kind (context_exceeded, too_long, decode_failed).",
    ),
    "llama_launcher_context_exceeded_total": (
        "counter",
        "Requests that failed with 'Context size has been exceeded' (the pool ran out).",
    ),
    "llama_launcher_decode_tokens_per_second": (
        "gauge",
        "Decode speed between the last two samples that decoded, from llama-server's counters.",
    ),
    "llama_launcher_requests_deferred": ("gauge", "Requests waiting for a free slot."),
    "llama_launcher_process_memory_bytes": (
        "gauge",
        "RssAnon + VmSwap of the server process (what a leak grows).",
    ),
    "llama_launcher_unit_restarts_total": ("counter", "systemd's NRestarts of the unit."),
    "llama_launcher_wedged_samples": (
        "gauge",
        "Samples in a row in which the server lived but did not answer (restarted at the "
        "setting wedged_samples).",
    ),
    "llama_launcher_wedged_restarts_total": (
        "counter",
        "Restarts of the unit by the sampler because its server lived but did not answer.",
    ),
    "llama_launcher_bake_state": (
        "gauge",
        "1 for the state of the unit's newest bake (the live generation's, or the one its "
        "revert ended), 0 for the others: baking, reverting, passed, inconclusive, reverted, "
        "revert_failed, ended.",
    ),
    "llama_launcher_bake_generation": ("gauge", "The generation the newest bake watches."),
    "llama_launcher_bake_deadline_timestamp_seconds": (
        "gauge",
        "When the newest bake's window ends (Unix time).",
    ),
    "llama_launcher_sample_source_up": (
        "gauge",
        "1 when the last sample could read the source (slots, metrics, proc, journal).",
    ),
}

_NAME = re.compile(r"[^A-Za-z0-9_]")


@dataclass
class Page:
    """The samples of one file, in ``METRICS`` order when rendered."""

    unit: str
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def add(self, name: str, value: float | None, **labels: str) -> None:
        """One series (``unit`` is added); a value of None leaves it out."""
        if name not in METRICS:
            raise KeyError(f"{name} is not a metric of this file")
        if value is None:
            return
        self.samples.setdefault(name, []).append(({"unit": self.unit, **labels}, float(value)))

    def render(self) -> str:
        out: list[str] = []
        for name, (kind, text) in METRICS.items():
            series = self.samples.get(name)
            if not series:
                continue
            out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            seen: set[str] = set()
            for labels, value in series:
                line = f"{name}{{{_labels(labels)}}} {_value(value)}"
                key = line.rsplit(" ", 1)[0]
                if key not in seen:  # a duplicate series makes the collector skip the file
                    seen.add(key)
                    out.append(line)
        return "\n".join(out) + "\n"


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(v: float) -> str:
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


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


def parse(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """The samples of a text page: (name, labels, value). For reading a page back (the
    tests parse node_exporter's /metrics with it)."""
    sample = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = sample.match(line)
        if m is None:
            continue
        labels = {
            k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
            for k, v in label.findall(m[2] or "")
        }
        try:
            yield m[1], labels, float(m[3])
        except ValueError:
            continue
