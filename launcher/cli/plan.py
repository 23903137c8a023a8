"""``llama-launcher plan``: the options for N slots x W tokens, their memory, a recommendation
(its options: ``launcher.cli.table``)."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launcher.reports.plan import Plan

GIB = 1024.0


def _count(flag: str, value: str, example: str) -> int:
    """A positive whole number, optionally with a k (x1024) suffix."""
    from launcher.errors import ConfigInvalid

    m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", value)
    if not m:
        raise ConfigInvalid(f"{flag} {value!r} is not a whole number; e.g. {flag} {example}")
    return int(m[1]) * (1024 if m[2] else 1)


def _whole(flag: str, value: str, example: str) -> int:
    from launcher.errors import ConfigInvalid

    if not re.fullmatch(r"\s*\d+\s*", value):
        raise ConfigInvalid(f"{flag} {value!r} is not a whole number of MiB; e.g. {flag} {example}")
    return int(value)


def handle(ns: argparse.Namespace) -> int:
    """Run the plan and print it."""
    from launcher.cli.results import emit
    from launcher.reports.plan import MIB, make_plan

    slots = _count("--slots", ns.slots, "4")
    window = _count("--window", ns.window, "262144")
    available = None
    if ns.mem_available is not None:
        available = _count("--mem-available", ns.mem_available, "131072") * MIB
    cram = None if ns.cache_ram is None else _whole("--cache-ram", ns.cache_ram, "0")
    ngl = None
    if ns.ngl is not None and ns.ngl != "all":
        ngl = _whole("--ngl", ns.ngl, "all")
    box = _box(ns)
    import os

    from launcher.server import binary

    path = ns.llama_server or os.environ.get("LLAMA_SERVER_BIN")
    server = binary.inspect(path) if path else None
    plan = make_plan(
        slots,
        window,
        ns.cache,
        ns.model,
        available,
        cache_ram_mib=cram,
        box=box,
        n_gpu_layers=ngl,
        server=server,
    )
    emit({"ok": True, **plan.to_dict()}, ns.json, lambda: render(plan))
    return 0


def _box(ns: argparse.Namespace) -> tuple[Any, ...]:
    """The devices to plan for: --devices FILE, else --llama-server's, else none."""
    from pathlib import Path

    from launcher.config.memory import mem_total
    from launcher.errors import ConfigInvalid
    from launcher.server import devices

    if ns.devices and ns.llama_server:
        raise ConfigInvalid("give --devices FILE or --llama-server BIN, not both")
    if ns.devices:
        found = devices.read_list_file(Path(ns.devices))
    elif ns.llama_server:
        from launcher.server import binary

        found = binary.list_devices(ns.llama_server)
    else:
        return ()
    return devices.mark_unified(found, mem_total(), ns.unified_memory)


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"


def render(plan: Plan) -> str:
    """The plan as a table for people."""
    lines = [f"plan: {plan.slots} slots x {plan.window} tokens each, KV cache {plan.cache}"]
    if plan.model is not None:
        m = plan.model
        lines.append(
            f"model: {m.path} ({m.arch}, n_ctx_train {m.n_ctx_train}, "
            f"weights {m.weights_bytes / 2**30:.1f} GiB)"
        )
        lines.append(
            f"memory: {plan.mem_available_bytes / 2**30:.1f} GiB available, "
            f"{plan.headroom_mib} MiB kept as headroom"
        )
        for d in plan.devices:
            kind = ", unified: the host's memory" if d.unified else ""
            lines.append(
                f"device: {d.name} ({d.description}): {d.free / 2**30:.1f} GiB free of "
                f"{d.total / 2**30:.1f}{kind}"
            )
    lines.append("")
    head: tuple[str, ...] = ("option", "window/slot", "promised", "pool cells", "KV GiB")
    head = (*head, "free GiB", *(("limit",) if plan.devices else ()), "")
    rows = [head]
    for o in plan.options:
        mark = "<- recommended" if o.key == plan.recommended else ""
        if o.pool.overcommitted:
            mark = "over-committed" + (" " + mark if mark else "")
        elif o.fits(plan.headroom_mib) is False:
            mark = "does not fit" + (" " + mark if mark else "")
        row: tuple[str, ...] = (
            o.key,
            str(o.guaranteed_window),
            str(o.pool.n_ctx_slot),
            str(o.pool.n_ctx),
            _gib(o.kv_mib),
            _gib(o.free_mib),
        )
        if plan.devices:
            row = (*row, o.limit or "-")
        rows.append((*row, mark))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        numbers = zip(r[1:-1], widths[1:-1], strict=True)
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in numbers]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    lines.append("")
    for o in plan.options:
        lines.append(f"{o.key}: {o.summary}")
        lines.append(f"    {' '.join(o.flags)}")
        if o.sides:
            free = dict(o.side_free)
            lines.append(
                "    "
                + ", ".join(
                    f"{'+'.join(s.members)} needs {(s.need or 0) / 2**30:.1f} GiB "
                    f"({free[s.name] / 2**30:.1f} left)"
                    for s in o.sides
                )
            )
    lines.append("")
    lines.append(f"recommended ({plan.recommended}): {plan.reason}")
    lines.append(f"    {plan.recommendation.set_command}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
