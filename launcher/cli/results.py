"""What a verb prints: one JSON object with ``--json`` (``emit``, ``fail``), else the text a
person reads. A deploy's text says the outcome first, then only the lines that carry news;
``-v`` adds the rest (the gate's figures, each slot skipped, whether a second instance
would fit beside the running one on a unit that has none)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launcher.deploy.outcome import Result


def emit(data: dict[str, Any], as_json: bool, human: Callable[[], str]) -> None:
    """Print ``data`` as one JSON object, or the human text."""
    if as_json:
        print(json.dumps(data, indent=None, sort_keys=False, default=str))
    else:
        text = human()
        if text:
            print(text)


def fail(error: Exception, as_json: bool, verbose: bool = False) -> int:
    """Report a ``LauncherError`` and return its exit code."""
    from launcher.errors import LauncherError

    code = error.exit_code if isinstance(error, LauncherError) else 1
    result = getattr(error, "result", None)
    if as_json:
        data: dict[str, Any] = {"ok": False, "error": type(error).__name__, "message": str(error)}
        if isinstance(error, LauncherError):
            data.update(error.details())
        if result is not None and hasattr(result, "to_dict"):
            data.update(result.to_dict())
        print(json.dumps(data, default=str))
    else:
        if result is not None:
            print(human(result, verbose=verbose))
        print(f"llama-launcher: {error}", file=sys.stderr)
    return code


def human(
    result: Result, show_diff: bool = True, verbose: bool = False, second_instance: bool = False
) -> str:
    """``result`` for a person: the outcome, then what carries news (``verbose``: all).
    ``second_instance``: the unit has one, so whether one fits beside is news."""
    lines = [f"{result.outcome}: {result.message}".rstrip(": ")]
    lines += _plan_lines(result, verbose)
    lines += handover_lines(result.handover, verbose)
    for w in result.warnings:
        lines.append(f"  warning: {w}")
    lines += _memory_lines(result.memory, verbose or second_instance)
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


def _plan_lines(result: Result, verbose: bool) -> list[str]:
    """The plan, where clients reach the server, and what the gate saw of it: the startup
    line and the probe, news only with ``verbose`` or where they differ from the plan."""
    lines = []
    p = result.planned
    if p:
        lines.append(
            f"  plan: n_slots = {p['n_slots']}, n_ctx_slot = {p['n_ctx_slot']}, "
            f"kv_unified = {str(p['kv_unified']).lower()}, pool = {p['pool_cells']} "
            f"cells; guaranteed per-slot window {p['guaranteed_window']}"
        )
        if front := p.get("front"):
            lines.append(
                f"  address: clients use {front['public']} (the front); the server "
                f"listens on {front['server']}"
            )
            if front.get("routing"):
                lines.append(f"  routing: {front['routing']}")
    s = result.startup
    if s and (verbose or not p or not _as_planned(s, p)):
        lines.append(
            f"  startup line: n_slots = {s['n_slots']}, n_ctx_slot = {s['n_ctx_slot']}, "
            f"kv_unified = '{str(s['kv_unified']).lower()}'"
        )
    if result.probe and verbose:
        lines.append(
            f"  completion: {result.probe['completion_tokens']} tokens in {result.probe['ms']} ms"
        )
    return lines


def _as_planned(startup: dict[str, Any], planned: dict[str, Any]) -> bool:
    keys = ("n_slots", "n_ctx_slot", "kv_unified")
    return all(startup.get(k) == planned.get(k) for k in keys)


def _memory_lines(memory: dict[str, Any], beside_is_news: bool) -> list[str]:
    """The service's memory before -> after (after alone on a first start), per side, and
    whether a second instance fits beside the running one."""
    lines = []
    if memory.get("after"):
        before, after = memory.get("before"), _mib(memory["after"])
        shown = f"{_mib(before)} -> {after}" if isinstance(before, int) else after
        lines.append(f"  memory of the service: {shown}")
        from launcher.reports.status import sides_line

        if sides := sides_line(memory, memory.get("estimate")):
            lines.append(f"  memory per side: {sides}")
    if (beside := memory.get("beside")) and beside_is_news:
        verdict = {True: "fits", False: "does not fit", None: "unknown"}[beside["fits"]]
        lines.append(f"  a second instance beside the running one: {verdict}: {beside['why']}")
    return lines


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


def handover_lines(data: dict[str, Any] | None, verbose: bool = False) -> list[str]:
    """The drain, the slots carried (the slots skipped: one line, each with ``verbose``),
    the front, and how soon the old process exited (``verbose``)."""
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
        lines += _skipped_lines(carried.get("skipped", []), verbose)
    elif carried.get("note"):
        lines.append(f"  slots: {carried['note']}")
    held = (data.get("front") or {}).get("held_seconds")
    if held is not None:
        lines.append(f"  front: new requests were held for {held:.2f}s, then released")
    stop = data.get("stop") or {}
    if stop.get("exited_after") is not None and verbose:
        lines.append(f"  old process: exited {stop['exited_after']:.2f}s after the restart began")
    return lines


def _skipped_lines(skipped: list[dict[str, Any]], verbose: bool) -> list[str]:
    """Each slot skipped (``verbose``: the first four, as ever), else one line: the slots
    and the first reason (a rollback skips every slot for one reason)."""
    if verbose:
        return [f"    skipped slot {s.get('slot')}: {s.get('reason')}" for s in skipped[:4]]
    if not skipped:
        return []
    ids = [str(s["slot"]) for s in skipped if s.get("slot") is not None]
    which = f"slot {ids[0]}" if len(ids) == 1 else f"slots {', '.join(ids)}" if ids else "slots"
    reasons = list(dict.fromkeys(str(s.get("reason")) for s in skipped))
    more = f" (and {len(reasons) - 1} other reasons; -v shows each)" if len(reasons) > 1 else ""
    return [f"    skipped {which}: {reasons[0]}{more}"]


def _mib(value: Any) -> str:
    return f"{value / 2**20:.1f} MiB" if isinstance(value, int) else "?"
