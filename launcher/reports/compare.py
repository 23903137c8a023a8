"""``compare A B``: two generations side by side, from their live records.

The figures the seed's open questions ask for (does the error count stay at zero; does the
q8_0 cache change decoding speed): decode and prefill tok/s from llama-server's own counters
(Σ tokens ÷ Σ the server's seconds for them, and the median of the minutes), errors per
1,000 requests, the pool's peak and p95, the fullest slot, the memory and its slope. A side
with too little data (fewer than ``MIN_REQUESTS`` requests, fewer than ``MIN_SAMPLES``
recorded samples, or no decode measured) is named with what it lacks, and no verdict is
drawn from it.
"""

from __future__ import annotations

from typing import Any

from launcher import config
from launcher.config import argv_diff
from launcher.deploy import home, store
from launcher.watch import record, sampler

MIN_REQUESTS = 20
MIN_SAMPLES = 5

#: (figure, summary field, which way is better: +1 higher, -1 lower, 0 neither)
FIGURES = (
    ("decode tok/s", "decode_tps", 1),
    ("decode tok/s, median of minutes", "decode_tps_median", 1),
    ("prefill tok/s", "prompt_tps", 1),
    ("errors per 1,000 requests", "errors_per_1k", -1),
    ("context exceeded", "context_exceeded", -1),
    ("pool peak", "pool_peak", -1),
    ("pool p95", "pool_p95", -1),
    ("fullest slot", "slot_fill_peak", -1),
    ("requests waiting (peak)", "deferred_peak", -1),
    ("memory MiB", "memory", -1),
    ("memory slope MiB/h", "memory_slope", -1),
    ("requests", "requests", 0),
    ("hours served", "served_hours", 0),
    ("recorded samples", "samples", 0),
)


def lacks(s: dict[str, Any]) -> list[str]:
    """What a side lacks to be compared (empty: enough)."""
    out = []
    if s["requests"] < MIN_REQUESTS:
        out.append(f"{s['requests']} requests (fewer than {MIN_REQUESTS})")
    if s["samples"] < MIN_SAMPLES:
        out.append(f"{s['samples']} recorded samples (fewer than {MIN_SAMPLES})")
    if s["decode_tps"] is None:
        out.append("no decode measured (/metrics off, or nothing generated)")
    return out


def compare(settings: config.ToolSettings, a: int, b: int) -> dict[str, Any]:
    st = store.Store(home.state_dir(settings))
    tail = sampler.last_run(sampler.target_for(settings))
    live = st.live_number()
    sides: dict[int, dict[str, Any]] = {}
    for n in (a, b):
        gen = st.get(n)
        rec = record.load(gen.path, n)
        summary = rec.summary(tail if n == live else None).to_dict()
        sides[n] = {
            "generation": n,
            "outcome": gen.outcome,
            "argv": list(gen.meta.get("argv") or []),
            "summary": summary,
            "lacks": lacks(summary) if rec.first is not None else ["never sampled"],
        }
    return side_by_side(settings.unit_name, sides[a], sides[b])


def side_by_side(unit: str, side_a: dict[str, Any], side_b: dict[str, Any]) -> dict[str, Any]:
    """``compare``'s answer from its two sides (each: ``generation``, ``outcome``,
    ``argv``, ``summary`` and what it ``lacks``): the figures, the ratios and the verdict."""
    a, b = side_a["generation"], side_b["generation"]
    rows = [
        _row(name, field, better, side_a["summary"], side_b["summary"])
        for name, field, better in FIGURES
    ]
    short = {s["generation"]: s["lacks"] for s in (side_a, side_b) if s["lacks"]}
    return {
        "unit": unit,
        "a": side_a,
        "b": side_b,
        "diff": argv_diff(side_a["argv"], side_b["argv"]),
        "figures": rows,
        "enough": not short,
        "verdict": _verdict(a, b, rows, short),
    }


def _row(
    name: str, field: str, better: int, a: dict[str, Any], b: dict[str, Any]
) -> dict[str, Any]:
    va, vb = a.get(field), b.get(field)
    ratio = (
        vb / va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else None
    )
    return {"figure": name, "field": field, "a": va, "b": vb, "ratio": ratio, "better": better}


def _verdict(a: int, b: int, rows: list[dict[str, Any]], short: dict[int, list[str]]) -> str:
    if short:
        parts = "; ".join(f"generation {n}: {', '.join(why)}" for n, why in short.items())
        return f"too little data to compare: {parts}"
    decode = next(r for r in rows if r["field"] == "decode_tps")
    errors = next(r for r in rows if r["field"] == "errors_per_1k")
    # no ratio when A decoded nothing (0 tok/s over the seconds its counters say it spent)
    words = [
        f"decode {decode['ratio']:.2f}x of generation {a}'s"
        if decode["ratio"] is not None
        else f"decode {_fmt('decode_tps', decode['b'])} tok/s, generation {a} decoded nothing"
    ]
    words.append(
        f"errors per 1,000 requests {errors['a']:.1f} -> {errors['b']:.1f}"
        if errors["a"] is not None and errors["b"] is not None
        else "errors per 1,000 requests unknown"
    )
    return f"generation {b} against {a}: " + ", ".join(words)


def _fmt(field: str, v: Any) -> str:
    if v is None:
        return "?"
    if field in ("pool_peak", "pool_p95", "slot_fill_peak"):
        return f"{100 * v:.1f} %"
    if field == "memory":
        return f"{v / 2**20:,.1f}"
    if field == "memory_slope":
        return f"{v / 2**20:+,.2f}"
    if isinstance(v, float):
        return f"{v:,.2f}" if field in ("served_hours", "errors_per_1k") else f"{v:,.1f}"
    return f"{v:,}"


def compare_text(d: dict[str, Any]) -> str:
    a, b = d["a"]["generation"], d["b"]["generation"]
    lines = [f"{d['unit']}: generation {a} ({d['a']['outcome']}) against {b} ({d['b']['outcome']})"]
    if d["diff"]:
        lines.append("  argv diff:")
        lines += [f"    {x}" for x in d["diff"]]
    width = max(len(r["figure"]) for r in d["figures"])
    lines.append(f"  {'':<{width}}  {'gen ' + str(a):>14}  {'gen ' + str(b):>14}  {'B/A':>6}")
    for r in d["figures"]:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else ""
        lines.append(
            f"  {r['figure']:<{width}}  {_fmt(r['field'], r['a']):>14}  "
            f"{_fmt(r['field'], r['b']):>14}  {ratio:>6}"
        )
    lines.append(f"  {d['verdict']}")
    return "\n".join(lines)
