"""Read-only views of a unit: ``status`` and ``history``."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from launcher import config
from launcher.config import argv_diff
from launcher.config.memory import process_memory
from launcher.deploy import home, store
from launcher.deploy.restart import lane, standby
from launcher.deploy.restart.front import Front, FrontError, address
from launcher.errors import LauncherError, StoreError
from launcher.host import envfile, launch
from launcher.host.systemd import Systemd
from launcher.reports import pressure
from launcher.watch import bake, sampler, wedge


def status(settings: config.ToolSettings, systemd: Systemd | None = None) -> dict[str, Any]:
    """Unit state, live generation, startup values, guaranteed window, memory."""
    systemd = systemd or Systemd(settings.unit_name, settings.scope)
    st = store.Store(home.state_dir(settings))
    state = systemd.state()
    live = st.live()
    data: dict[str, Any] = {
        "unit": settings.unit_name,
        "scope": settings.scope,
        "env_file": str(settings.resolved_env_file()),
        "state_dir": str(st.root),
        "installed": state.load_state != "not-found",
        "state": state.to_dict(),
        "memory": process_memory(state) if state.running else None,
        "live_generation": live.number if live else None,
        "pending_transaction": bool(st.txn()),
        **front_status(settings),
        **lane_of(st.root),
    }
    if live is not None:
        data["live_file"] = live_file(settings.resolved_env_file(), live)
        planned = live.meta.get("planned", {})
        data.update(
            {
                "argv": live.meta.get("argv"),
                "startup": live.meta.get("startup"),
                "planned": planned,
                "client_window": planned.get("guaranteed_window"),
                "deployed_at": live.meta.get("time"),
                "outcome": live.outcome,
                "memory_at_deploy": live.meta.get("memory"),
                "kv_estimate": live.meta.get("kv_estimate"),
            }
        )
        data["watch"] = pressure.status_of(settings, systemd)
        data["bake"] = bake.status_of(st)
    return data


def front_status(settings: config.ToolSettings) -> dict[str, Any]:
    """``front``: open, held (since when, by which pid, until when) or down; nothing for a
    unit without a front."""
    the_front = Front(home.state_dir(settings), settings.unit_name, settings.scope)
    try:
        if the_front.spec() is None:
            return {}
    except FrontError as e:
        return {"front": {"state": "unknown", "note": str(e)}}
    out = the_front.state()
    second = second_instance(settings, the_front)
    if second is not None:
        out["second_instance"] = second
    if (admitted := pressure.admission_status(the_front)) is not None:
        out["admission"] = admitted
    with contextlib.suppress(FrontError):
        if (routed := lane_status(the_front)) is not None:
            out["lane"] = routed
    return {"front": out}


def lane_status(the_front: Front) -> dict[str, Any] | None:
    """The front's long-prompt lane: its name, unit or address, threshold, and what the
    running HAProxy routed (None: no lane)."""
    spec = the_front.spec()
    if spec is None or not spec.lane:
        return None
    out: dict[str, Any] = {
        "name": spec.lane,
        "unit": spec.lane_unit or None,
        "address": address(spec.lane_host, spec.lane_port),
        "slots": spec.lane_slots,
        "threshold_tokens": spec.lane_threshold,
        "threshold_bytes": lane.threshold_bytes(spec),
    }
    try:
        ledger = lane.ledger(the_front)
        out["routing"] = ledger.to_dict() if ledger is not None else None
    except LauncherError as e:
        out["routing"], out["note"] = None, str(e)
    return out


def lane_of(state_dir: Path) -> dict[str, Any]:
    """A lane unit's ``lane_of``: the lane's name and the unit whose front routes to it."""
    try:
        record = lane.Record.read(state_dir)
    except LauncherError as e:
        return {"lane_of": {"note": str(e)}}
    if record is None:
        return {}
    return {"lane_of": {"name": record.name, "main_unit": record.main_unit}}


def _lane_line(g: dict[str, Any]) -> str:
    where = g["unit"] or "on another host"
    line = (
        f"  lane: {g['name']} ({where}, {g['address']}): prompts over "
        f"{g['threshold_tokens']} tokens (bodies over {g['threshold_bytes']} bytes)"
    )
    r = g.get("routing")
    if r is None:
        return line + (f"; routing unknown ({g['note']})" if g.get("note") else "")
    state = "held" if r["held"] else ("up" if r["up"] else "DOWN: its requests wait")
    return (
        line + f"; {state}; routed {r['routed']} to it, {r['main']} to the main server, "
        f"{r['waiting']} waiting, {r['refused_wait']} refused"
    )


def second_instance(settings: config.ToolSettings, the_front: Front) -> dict[str, Any] | None:
    """The unit's second instance (``launcher.deploy.restart.standby``): its unit, whether it runs,
    whether the front sends it requests, and until when it keeps the previous config warm."""
    with contextlib.suppress(FrontError):
        spec = the_front.spec()
        sb = standby.Standby.of(the_front.dir.parent, settings.unit_name, settings.scope, spec)
        if sb is None or spec is None:
            return None
        try:
            active = sb.systemd.show("ActiveState").get("ActiveState", "unknown")
        except LauncherError as e:
            active = f"unknown ({e})"
        return {
            "unit": sb.name,
            "port": sb.port,
            "active": active,
            "serving": spec.serving == "b",
            "warm_until": sb.warm_until() if active == "active" else None,
        }
    return None


def _front_line(f: dict[str, Any]) -> str:
    import time as _t

    def at(t: float) -> str:
        return _t.strftime("%H:%M:%S", _t.localtime(t))

    where = f"{f.get('public')} -> {f.get('private')}"
    if f.get("state") != "held":
        return f"  front: {f.get('state')} ({where})"
    if not f.get("held_by_pid"):
        return f"  front: HELD with no record ({where}); the next deploy or recover releases it"
    holder = "running" if f.get("holder_alive") else "gone"
    return (
        f"  front: HELD since {at(f['held_since'])} by pid {f['held_by_pid']} ({holder}) "
        f"({where}); its release watcher releases it by {at(f['release_deadline'])} at the latest"
    )


def _second_line(b: dict[str, Any]) -> str:
    import time as _t

    line = f"  second instance: {b['unit']} (port {b['port']}) {b['active']}"
    if b.get("serving"):
        return line + ", serving"
    if b.get("warm_until"):
        left = max(b["warm_until"] - _t.time(), 0)
        line += f", keeps the previous config warm for {left:.0f}s more (a rollback switches)"
    return line


def live_file(env_file: Path, live: store.Generation) -> dict[str, Any]:
    """Whether the live env file is the live generation's bytes, and if not how it differs
    (a hand edit, a deleted file): the argv diff, generation -> file."""
    try:
        text: str | None = env_file.read_bytes().decode("utf-8", "replace")
    except FileNotFoundError:
        text = None
    if text == live.env_text:
        return {"differs": False}
    if text is None:
        return {"differs": True, "missing": True, "diff": []}
    try:
        argv = launch.argv_from_values(envfile.parse(text, str(env_file)), str(env_file))
    except (envfile.EnvFileError, launch.LaunchError) as e:
        # the parser's own words, as exec --print-argv gives them
        return {"differs": True, "missing": False, "refused": str(e), "diff": []}
    diff = argv_diff(argv_of(live), argv)
    labels = [f"--- generation {live.number}", f"+++ {env_file}"]
    return {"differs": True, "missing": False, "diff": labels + diff[2:] if diff else []}


def argv_of(gen: store.Generation) -> list[str]:
    """A generation's argv: recorded, or read from its bytes (a hand edit adopted before
    the adoption recorded it)."""
    argv = list(gen.meta.get("argv") or [])
    if argv:
        return argv
    try:
        return launch.argv_of_text(gen.env_text, str(gen.path / "env"))
    except StoreError:
        return []


def _live_file_lines(d: dict[str, Any]) -> list[str]:
    lf = d.get("live_file") or {}
    if not lf.get("differs"):
        return []
    if lf.get("missing"):
        return [
            f"  the live env file {d['env_file']} is missing (deleted by hand?): the next "
            f"deploy puts generation {d['live_generation']}'s back if it fails; "
            "llama-launcher rollback puts it back now"
        ]
    if lf.get("refused"):
        return [
            f"  the live env file {d['env_file']} differs from generation "
            f"{d['live_generation']} and the launcher refuses it (the unit exits 78 at its "
            "next start; llama-launcher rollback puts the generation's back):",
            *(f"    {line}" for line in str(lf["refused"]).splitlines()),
        ]
    lines = [
        f"  the live env file {d['env_file']} differs from generation {d['live_generation']} "
        "(edited by hand?); the next deploy keeps it as a generation. argv diff:"
    ]
    return lines + [f"    {x}" for x in lf.get("diff") or ["(the same argv; other bytes differ)"]]


def status_text(d: dict[str, Any]) -> str:
    s = d["state"]
    if not d.get("installed", True):
        return (
            f"{d['unit']} ({d['scope']}): not installed (systemctl"
            f"{' --user' if d['scope'] == 'user' else ''} knows no such unit); "
            "llama-launcher install writes it and deploys a config through the gate"
            + ("" if d.get("live_generation") is None else f"; {d['state_dir']} keeps "
               f"generation {d['live_generation']} from an earlier install")
        )  # fmt: skip
    lines = [
        f"{d['unit']} ({d['scope']}): {s['active']}/{s['sub']}, pid {s['main_pid']}, "
        f"restarts {s['n_restarts']}, last exit status {s['exec_main_status']}"
    ]
    if d.get("memory"):
        lines.append(f"  memory now: {d['memory'] / 2**20:.1f} MiB")
    if d.get("front"):
        lines.append(_front_line(d["front"]))
        if (b := d["front"].get("second_instance")) is not None:
            lines.append(_second_line(b))
        if (a := d["front"].get("admission")) is not None:
            lines.append(pressure.admission_line(a))
        if (g := d["front"].get("lane")) is not None:
            lines.append(_lane_line(g))
    if (of := d.get("lane_of")) is not None and of.get("name"):
        lines.append(
            f"  the long-prompt lane {of['name']} of {of['main_unit']} (its front routes here)"
        )
    if d.get("live_generation") is None:
        lines.append("  no generation deployed by llama-launcher yet")
        return "\n".join(lines)
    lines.append(f"  live generation: {d['live_generation']} ({d['outcome']})")
    lines += _live_file_lines(d)
    if d.get("startup"):
        su = d["startup"]
        lines.append(
            f"  startup line: n_slots = {su['n_slots']}, n_ctx_slot = {su['n_ctx_slot']}, "
            f"kv_unified = '{str(su['kv_unified']).lower()}'"
        )
    p = d.get("planned") or {}
    if p:
        lines.append(
            f"  clients: guaranteed per-slot window {p['guaranteed_window']} tokens "
            f"({p['n_slots']} slots, pool {p['pool_cells']} cells"
            f"{', over-committed' if p.get('overcommitted') else ''})"
        )
    mem = d.get("memory_at_deploy") or {}
    if mem.get("after"):
        lines.append(f"  memory: {memory_line(mem, d.get('kv_estimate'))}")
    if sides := sides_line(mem, d.get("kv_estimate")):
        lines.append(f"  per side: {sides}")
    lines += pressure.status_lines(d.get("watch"))
    lines += bake.status_lines(d.get("bake"))
    if d.get("pending_transaction"):
        lines.append("  a deploy was interrupted: the next verb recovers it")
    return "\n".join(lines)


def history(settings: config.ToolSettings) -> dict[str, Any]:
    st = store.Store(home.state_dir(settings))
    live = st.live_number()
    tail = sampler.last_run(sampler.target_for(settings))
    out: list[dict[str, Any]] = []
    argvs: dict[int, list[str]] = {}
    for gen in st.all():
        argv = argv_of(gen)
        argvs[gen.number] = argv
        prev = gen.meta.get("previous")
        prev_argv = argvs.get(prev, []) if isinstance(prev, int) else []
        mem = gen.meta.get("memory") or {}
        out.append(
            {
                "generation": gen.number,
                "time": gen.meta.get("time"),
                "user": gen.meta.get("user"),
                "origin": gen.meta.get("origin"),
                "outcome": gen.outcome,
                "live": gen.number == live,
                "argv": argv,
                "previous": prev,
                "diff": argv_diff(prev_argv, argv) if prev_argv and argv else [],
                "memory": mem,
                "kv_estimate": gen.meta.get("kv_estimate"),
                "failure": (gen.meta.get("failure") or {}).get("message"),
                "watched": pressure.headline(gen, tail if gen.number == live else None),
                "bake": baked(gen),
                "reverted_from": gen.meta.get("reverted_from"),
                "wedged_restarts": gen.meta.get("wedged_restarts") or [],
            }
        )
    return {"unit": settings.unit_name, "live_generation": live, "generations": out}


def history_text(d: dict[str, Any]) -> str:
    import time as _t

    if not d["generations"]:
        return f"{d['unit']}: no generations yet"
    lines = []
    for g in d["generations"]:
        when = _t.strftime("%Y-%m-%d %H:%M:%S", _t.localtime(g["time"])) if g["time"] else "?"
        mark = "*" if g["live"] else " "
        lines.append(f"{mark}{g['generation']:4d}  {when}  {g['outcome']:<12} {g['origin'] or ''}")
        lines += [f"        {x}" for x in g["diff"]]
        if g.get("failure"):
            lines.append(f"        failed: {g['failure'][:200]}")
        if g["memory"].get("after"):
            lines.append(f"        memory: {memory_line(g['memory'], g.get('kv_estimate'))}")
        if sides := sides_line(g["memory"], g.get("kv_estimate")):
            lines.append(f"        per side: {sides}")
        if g.get("watched"):
            lines.append(f"        {pressure.headline_line(g['watched'])}")
        if g.get("bake"):
            lines.append(f"        {g['bake']['line']}")
        if restarted := wedge.line_of(g.get("wedged_restarts") or []):
            lines.append(f"        {restarted}")
    return "\n".join(lines)


def baked(gen: store.Generation) -> dict[str, Any] | None:
    """A generation's bake, as history shows it: state, verdict and one line."""
    b = bake.load(gen.path)
    if b is None:
        return None
    return {
        "state": b.state,
        "verdict": b.verdict.to_dict() if b.verdict else None,
        "line": bake.say(b),
    }


def memory_line(mem: dict[str, Any], estimate: dict[str, Any] | None) -> str:
    """Measured service memory before -> after the deploy (after alone where nothing ran
    before: a first install), next to the KV estimate."""

    def mib(v: Any) -> str:
        return f"{v / 2**20:.1f} MiB" if isinstance(v, int) else "?"

    before = mem.get("before")
    text = f"service {mib(mem.get('after'))} after the gate"
    if isinstance(before, int):
        text = f"service {mib(before)} before -> {mib(mem.get('after'))} after the gate"
    if estimate and estimate.get("kv_bytes") is not None:
        text += f"; KV estimate {mib(estimate['kv_bytes'])}"
    elif estimate and estimate.get("unsupported"):
        text += "; KV not estimated (model not covered)"
    return text


def sides_line(mem: dict[str, Any], estimate: dict[str, Any] | None) -> str:
    """Device memory the server reported in its log, per side, next to the estimate per side
    ("" on a box without devices and without reported buffers)."""
    reported = (mem.get("devices") or {}).get("by_side") or {}
    sides = (estimate or {}).get("sides") or []
    if not reported and not sides:
        return ""

    def mib(v: Any) -> str:
        return f"{v / 2**20:,.0f} MiB" if isinstance(v, int) else "?"

    parts = []
    if reported:
        shown = ", ".join(f"{name} {mib(size)}" for name, size in reported.items())
        parts.append(f"reported by llama-server: {shown}")
    elif sides:
        note = (mem.get("devices") or {}).get("note")
        parts.append(f"reported by llama-server: none ({note or 'not recorded'})")
    if sides:
        shown = ", ".join(f"{'+'.join(s['members'])} {mib(s.get('need_bytes'))}" for s in sides)
        parts.append(f"estimate: {shown}")
    return "; ".join(parts)
