"""Pool pressure, live: the KV pool and every slot now (``status``, ``top``), the peak of the
last hour and each generation's headline figures from the live records (``history``), and
what the records say about the pool at each failure (``diagnose --unit``).

"Now" is read from the server itself (``GET /slots``, ``launcher.watch.reads.read_server``)
at the moment of the view, so ``status`` and ``top`` show what ``/slots`` says; the peaks
come from the samples the sampler recorded.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from launcher.deploy import store
from launcher.deploy.restart import admission
from launcher.deploy.restart.front import Front, FrontError
from launcher.errors import LauncherError, StoreError
from launcher.host.systemd import Systemd
from launcher.server import metrics
from launcher.watch import record, sampler
from launcher.watch.reads import pressure_of, read_server

if TYPE_CHECKING:  # a sample prints its pool with pool_lines, without the typed config
    from launcher import config

HOUR = 3600


def snapshot(
    target: sampler.Target,
    systemd: Systemd,
    st: store.Store,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The pool and the slots now, the server's counters (rates since ``previous``, an
    earlier snapshot of the same process), the last hour's peaks, the sampler's last run."""
    live = st.live()
    data: dict[str, Any] = {"unit": target.unit, "generation": live.number if live else None}
    if live is None:
        return data
    reads = read_server(target, systemd, live)
    p = pressure_of(live, reads)
    data.update(
        {
            "time": time.time(),
            "state": f"{reads.unit.active}/{reads.unit.sub}",
            "pool": p.to_dict() if p else None,
            "pool_line": p.describe() if p else None,
            "unread": reads.unread,
            "memory": reads.memory.to_dict() if reads.memory else None,
            "deferred": (reads.metrics.gauges if reads.metrics else {}).get("requests_deferred"),
            "counters": reads.metrics.counters if reads.metrics else None,
            "process": reads.metrics.process_start if reads.metrics else None,
            "last_hour": last_hour(live),
            "last_sample": sampler.last_run(target),
        }
    )
    if store.runs_vllm(live.meta) and reads.metrics is not None:
        g, c = reads.metrics.gauges, reads.metrics.counters
        data["vllm"] = {
            "running": g.get("requests_processing"),
            "waiting": g.get("requests_deferred"),
            "kv_usage": g.get("kv_cache_usage"),
            "preemptions": c.get("preemptions_total"),
        }
    the_front = Front(target.state_dir, target.unit, systemd.scope)
    if (admitted := admission_status(the_front)) is not None:
        data["admission"] = admitted
    data["rates"] = _rates(previous, data)
    return data


def _rates(previous: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, float | None]:
    """Decode and prefill tok/s between two snapshots of one process (its own counters)."""
    a, b = (previous or {}).get("counters"), now.get("counters")
    if not a or not b or previous is None or previous.get("process") != now.get("process"):
        return {}

    def d(name: str) -> float:
        return float(b.get(name, 0) - a.get(name, 0))

    return {
        "decode_tps": metrics.rate(
            d("tokens_predicted_total"), d("tokens_predicted_seconds_total")
        ),
        "prompt_tps": metrics.rate(d("prompt_tokens_total"), d("prompt_seconds_total")),
    }


def last_hour(gen: store.Generation, now: float | None = None) -> dict[str, Any]:
    """The peaks the samples of the last hour recorded."""
    rec = record.load(gen.path, gen.number)
    since = (now or time.time()) - HOUR
    s = record.summarize(gen.number, rec.rows(since=since))
    return {"pool_peak": s.pool_peak, "slot_fill_peak": s.slot_fill_peak, "samples": s.samples}


def status_of(settings: config.ToolSettings, systemd: Systemd) -> dict[str, Any]:
    """``status``'s live pool section."""
    target = sampler.target_for(settings)
    return snapshot(target, systemd, store.Store(target.state_dir))


class Top:
    """``top``'s frames: each a snapshot, with the rates since the one before."""

    def __init__(self, settings: config.ToolSettings, systemd: Systemd) -> None:
        self.target = sampler.target_for(settings)
        self.systemd = systemd
        self.store = store.Store(self.target.state_dir)
        self.previous: dict[str, Any] | None = None

    def frame(self) -> dict[str, Any]:
        data = snapshot(self.target, self.systemd, self.store, self.previous)
        self.previous = data
        return data


def admission_status(the_front: Front) -> dict[str, Any] | None:
    """The front's admission against the pool (``launcher.deploy.restart.admission``): its
    ledger, or why it cannot be read; None when the front does not admit."""
    with contextlib.suppress(FrontError):
        spec = the_front.spec()
        if spec is None or not spec.admission:
            return None
    try:
        ledger = admission.ledger(the_front)
    except LauncherError as e:
        return {"state": "unknown", "note": str(e)}
    if ledger is None:
        return {"state": "off", "note": "the running HAProxy loads no admission.lua"}
    return {"state": "on" if ledger.pool > 0 else "open (no shared pool)", **ledger.to_dict()}


def admission_line(a: dict[str, Any]) -> str:
    if "pool" not in a:
        return f"  admission: {a['state']} ({a.get('note')})"
    waits = a["wait_count"]
    mean = f", mean wait {a['wait_sum'] / waits:.2f}s" if waits else ""
    unseen = f", {a['unseen']} busy slots it did not admit" if a.get("unseen") else ""
    unread = "" if a.get("pool_read", True) else " (/slots unread: its own ledger only)"
    return (
        f"  admission: {a['state']}: pool {a['pool']} cells, {a['reserved']} reserved by "
        f"{a['running']} running{unseen}, {a['free']} free{unread}; {a['waiting']} waiting; "
        f"{a['admitted']} admitted ({a['waited']} waited{mean}), {a['refused']} refused"
    )


# -- text ------------------------------------------------------------------------------------


def _n(x: float | None) -> str:
    return "?" if x is None else f"{x:,.0f}"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f} %"


def pool_lines(p: dict[str, Any]) -> list[str]:
    """The pool and one line per slot (tokens / cap, busy or idle, share of the pool)."""
    if p.get("used") is None:
        return [
            f"pool: {p.get('pool_cells') or '?'} cells; this build's /slots does not say what "
            f"each slot holds ({p.get('busy_slots')} busy)"
        ]
    cells = p.get("pool_cells")
    lines = [
        f"pool: {p['used']:,} of {cells:,} cells ({_pct(p['use'])}): busy {p['busy']:,}, "
        f"idle {p['idle']:,}"
        if cells
        else f"pool: {p['used']:,} tokens held (the planned pool is unknown)"
    ]
    for s in p["slots"]:
        state = "busy" if s["busy"] else "idle"
        lines.append(
            f"  slot {s['id']}: {s['tokens']:>9,} / {s['n_ctx']:<9,} {_pct(s['fill']):>8} "
            f"of its cap  {state}  {_pct(s['share']):>8} of the pool"
        )
    return lines


def status_lines(d: dict[str, Any] | None) -> list[str]:
    """``status``'s lines for the live pool section."""
    if not d or d.get("generation") is None:
        return []
    lines = [f"  {x}" for x in pool_lines(d["pool"])] if d.get("pool") else []
    if v := d.get("vllm"):
        lines.append(
            f"  vLLM now: {_n(v['running'])} running, {_n(v['waiting'])} waiting (preempted "
            f"ones wait), KV cache {_pct(v['kv_usage'])} used, {_n(v['preemptions'])} "
            "preemptions since it started"
        )
    lines += [f"  could not read {k}: {v}" for k, v in (d.get("unread") or {}).items()]
    hour = d.get("last_hour") or {}
    if hour.get("samples"):
        lines.append(
            f"  last hour: pool peak {_pct(hour['pool_peak'])}, fullest slot "
            f"{_pct(hour['slot_fill_peak'])} ({hour['samples']} recorded samples)"
        )
    last = d.get("last_sample")
    lines.append(
        f"  last live sample: {time.time() - last:.0f}s ago"
        if last
        else "  no live sample yet (the sampler's timer runs llama-launcher sample)"
    )
    return lines


def top_lines(d: dict[str, Any]) -> list[str]:
    """One frame of ``top``."""
    when = time.strftime("%H:%M:%S", time.localtime(d.get("time") or time.time()))
    head = f"{d['unit']}  generation {d.get('generation')}  {d.get('state', '')}  {when}"
    if d.get("generation") is None:
        return [head, "no generation deployed by llama-launcher yet"]
    lines = [head, *status_lines(d)]
    rates = d.get("rates") or {}
    if rates.get("decode_tps") is not None:
        lines.append(f"  decode {rates['decode_tps']:,.1f} tok/s since the last frame")
    if d.get("deferred"):
        lines.append(f"  requests waiting for a slot: {d['deferred']:g}")
    if d.get("admission"):
        lines.append(admission_line(d["admission"]))
    if d.get("memory"):
        lines.append(f"  memory (RssAnon + VmSwap): {d['memory']['growth'] / 2**20:,.1f} MiB")
    return lines


# -- the records' headline figures -----------------------------------------------------------


def headline(gen: store.Generation, tail_until: float | None) -> dict[str, Any] | None:
    """A generation's live figures (None: never sampled)."""
    rec = record.load(gen.path, gen.number)
    if rec.first is None:
        return None
    return rec.summary(tail_until).to_dict()


def headline_line(h: dict[str, Any]) -> str:
    def n(x: Any, fmt: str = ",.0f") -> str:
        return "?" if x is None else format(x, fmt)

    mem = h.get("memory")
    return (
        f"live: {h['served_hours']:.1f} h served, {h['requests']:,} requests, "
        f"{n(h.get('errors_per_1k'), '.1f')} errors/1k ({h['context_exceeded']} context "
        f"exceeded), decode {n(h.get('decode_tps'), ',.1f')} tok/s, pool peak "
        f"{_pct(h.get('pool_peak'))} (p95 {_pct(h.get('pool_p95'))}), memory "
        f"{'?' if mem is None else f'{mem / 2**20:,.1f} MiB'}"
    )


def failures_recorded(st: store.Store, limit: int = 20) -> list[dict[str, Any]]:
    """The failures the sampler found, newest last, each with the pool at the sample before
    it, over every generation's record."""
    out: list[dict[str, Any]] = []
    for n in st.numbers():
        try:
            gen = st.get(n)
        except StoreError:
            continue
        for f in record.load(gen.path, n).failures:
            out.append({"generation": n, **f})
    return sorted(out, key=lambda f: f.get("t") or 0)[-limit:]


def failure_lines(failures: list[dict[str, Any]]) -> list[str]:
    if not failures:
        return []
    lines = ["Recorded by the sampler (the pool at the sample before each failure):"]
    for f in failures:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f["t"]))
        pool = f.get("pool_before")
        fill = f.get("slot_fill_before")
        before = f.get("sampled_before")
        ago = f", {f['t'] - before:.0f}s before" if before else ""
        lines.append(
            f"  {when} generation {f['generation']}: {f['requests']} request(s) {f['kind']}; "
            f"pool {'?' if pool is None else f'{pool / 10:.1f} %'}, fullest slot "
            f"{'?' if fill is None else f'{fill / 10:.1f} %'}{ago}"
        )
    return lines
