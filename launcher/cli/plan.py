"""``llama-launcher plan``: the options for N slots x W tokens, their memory, a recommendation."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launcher.reports.plan import Plan

GIB = 1024.0


def register(subparsers: Any) -> None:
    """Add the ``plan`` verb."""
    p = subparsers.add_parser(
        "plan",
        help="compare shared, split and per-slot KV pools for N slots x W tokens",
        description=(
            "Lay out the options for N clients that each need a W-token window: the "
            "shared over-committed pool, split pools, the per-slot cap at f16/q8_0/q4_0, fewer "
            "slots and a smaller window; with --model, the KV memory of each and what is left "
            "of MemAvailable; with --devices (or --llama-server) also on each device, the "
            "weights and KV placed as -ngl places them, and which side limits. Changes nothing."
        ),
    )
    p.add_argument("--slots", required=True, metavar="N", help="clients served at once (-np)")
    p.add_argument(
        "--window", required=True, metavar="W", help="tokens each client needs, e.g. 262144 or 256k"
    )
    p.add_argument("--cache", default="f16", metavar="TYPE", help="KV cache type (default f16)")
    p.add_argument("--model", metavar="FILE", help="the GGUF model, for the memory estimate")
    p.add_argument(
        "--mem-available",
        metavar="MIB",
        help="memory to plan for in MiB (default: MemAvailable of this machine)",
    )
    p.add_argument(
        "--cache-ram",
        metavar="MIB",
        help="llama-server's host prompt cache (-cram) in MiB, counted as used "
        "(default 8192, llama-server's; 0 turns it off and adds --cache-ram 0 to the lines)",
    )
    p.add_argument(
        "--devices",
        metavar="FILE",
        help="the output of `llama-server --list-devices` saved to a file: plan for those "
        "devices (another box's GPUs)",
    )
    p.add_argument(
        "--llama-server",
        metavar="BIN",
        help="the llama-server to plan for: only its flags are offered, and without --devices "
        "the devices it sees now (its --list-devices); default for the flags: "
        "$LLAMA_SERVER_BIN; without either a build with --kv-unified-per-slot is assumed",
    )
    p.add_argument(
        "--ngl",
        metavar="N",
        help="layers offloaded to the devices (-ngl; default all)",
    )
    p.add_argument(
        "--unified-memory",
        choices=("auto", "yes", "no"),
        default="auto",
        help="whether the devices' memory is the host's (auto: a device as large as the "
        "host's MemTotal, or Metal)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=handle)


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
    from launcher.cli import emit
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
