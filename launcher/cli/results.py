"""A verb's result as the text a person reads (``--json`` prints ``Result.to_dict()``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launcher.deploy.outcome import Result


def human(result: Result, show_diff: bool = True) -> str:
    lines = [f"{result.outcome}: {result.message}".rstrip(": ")]
    if result.planned:
        p = result.planned
        lines.append(
            f"  plan: n_slots = {p['n_slots']}, n_ctx_slot = {p['n_ctx_slot']}, "
            f"kv_unified = {str(p['kv_unified']).lower()}, pool = {p['pool_cells']} "
            f"cells; guaranteed per-slot window {p['guaranteed_window']}"
        )
        if front := p.get("front"):
            lines.append(
                f"  address: clients use {front['public']} (the front); llama-server "
                f"listens on {front['server']}"
            )
    if result.startup:
        s = result.startup
        lines.append(
            f"  startup line: n_slots = {s['n_slots']}, n_ctx_slot = {s['n_ctx_slot']}, "
            f"kv_unified = '{str(s['kv_unified']).lower()}'"
        )
    if result.probe:
        lines.append(
            f"  completion: {result.probe['completion_tokens']} tokens in {result.probe['ms']} ms"
        )
    lines += handover_lines(result.handover)
    for w in result.warnings:
        lines.append(f"  warning: {w}")
    if result.memory.get("after"):
        before = result.memory.get("before")
        lines.append(f"  memory of the service: {_mib(before)} -> {_mib(result.memory['after'])}")
        from launcher.reports.status import sides_line

        if sides := sides_line(result.memory, result.memory.get("estimate")):
            lines.append(f"  memory per side: {sides}")
    if beside := result.memory.get("beside"):
        verdict = {True: "fits", False: "does not fit", None: "unknown"}[beside["fits"]]
        lines.append(f"  a second instance beside the running one: {verdict}: {beside['why']}")
    if show_diff and result.diff:
        lines.append("  argv diff:")
        lines += [f"    {d}" for d in result.diff]
    if result.failure:
        lines.append(f"  failure ({result.failure['phase']}): {result.failure['message']}")
        for line in result.failure.get("log_tail", [])[-8:]:
            lines.append(f"    | {line}")
    if result.recovered:
        lines.append(f"  recovered an interrupted deploy first: {result.recovered}")
    lines += bake_lines(result.bake)
    return "\n".join(lines)


def bake_lines(data: dict[str, Any] | None) -> list[str]:
    """The bake this verb began (its length, its baseline, what watches it)."""
    data = data or {}
    started = data.get("started")
    if not started:
        return []
    if line := (data.get("verdict") or {}).get("line"):
        return [f"  {line}"]
    base = started.get("baseline")
    against = f"against generation {base}" if base is not None else "hard signals only"
    left = started.get("seconds_left")
    length = f" for {left:.0f}s" if isinstance(left, (int, float)) else ""
    by = (data.get("carrier") or {}).get("unit", "the sampler")
    return [f"  bake: generation {started['generation']} watched{length} ({against}) by {by}"]


def handover_lines(data: dict[str, Any] | None) -> list[str]:
    """The drain, the slots carried and the front, one line each."""
    if not data:
        return []
    lines = []
    drained = data.get("drain") or {}
    if drained:
        lines.append(
            "  drain: " + str(drained.get("message") or f"no drain: {drained.get('skipped')}")
        )
    carried = data.get("slots") or {}
    if carried.get("saved") or carried.get("skipped"):
        restored = carried.get("restored", [])
        tokens = sum(int(r.get("tokens", 0)) for r in restored)
        lines.append(
            f"  slots: {len(carried.get('saved', []))} saved, {len(restored)} restored "
            f"({tokens} tokens), {len(carried.get('skipped', []))} skipped"
        )
        for s in carried.get("skipped", [])[:4]:
            lines.append(f"    skipped slot {s.get('slot')}: {s.get('reason')}")
    elif carried.get("note"):
        lines.append(f"  slots: {carried['note']}")
    held = (data.get("front") or {}).get("held_seconds")
    if held is not None:
        lines.append(f"  front: new requests were held for {held:.2f}s, then released")
    stop = data.get("stop") or {}
    if stop.get("exited_after") is not None:
        lines.append(f"  old process: exited {stop['exited_after']:.2f}s after the restart began")
    return lines


def _mib(value: Any) -> str:
    return f"{value / 2**20:.1f} MiB" if isinstance(value, int) else "?"
