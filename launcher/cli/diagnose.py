"""``llama-launcher diagnose``: why requests failed with "Context size has been exceeded" (its
options: ``launcher.cli.table``)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launcher.deploy.store import Generation
    from launcher.reports.diagnose import Failure, Fix, MemoryCost, Report
    from launcher.server.kvlayout import PoolPlan


@contextlib.contextmanager
def _open(ns: argparse.Namespace) -> Iterator[tuple[IO[bytes], str]]:
    from launcher.errors import ConfigInvalid
    from launcher.reports import diagnose

    if ns.since and not ns.unit:
        raise ConfigInvalid(
            f"--since {ns.since!r} needs --unit: a log file's timestamps are "
            "relative to the server start; cut the file instead"
        )
    if ns.unit:
        with diagnose.journal(ns.unit, ns.since) as stream:
            yield stream, f"journal of {ns.unit}"
    elif ns.log and ns.log != "-":
        try:
            f = open(ns.log, "rb")  # noqa: SIM115 - closed below
        except OSError as e:
            raise ConfigInvalid(
                f"cannot read the log {ns.log!r}: {e.strerror}; give a readable file, '-' or --unit"
            ) from e
        with f:
            yield f, ns.log
    elif ns.log == "-" or ns.stdin == "-":
        yield sys.stdin.buffer, "stdin"
    else:
        raise ConfigInvalid("no log given; use --unit UNIT, --log FILE or - (stdin)")


def _default_unit(ns: argparse.Namespace) -> str | None:
    """The unit whose journal is read: ``--unit``, ``--instance``'s, else (no log file and
    no stdin given) the configured one, as every other verb takes it."""
    if ns.instance:
        from launcher.cli.deploy import instance_unit

        return instance_unit(ns.instance)
    if ns.unit or ns.log or ns.stdin:
        return str(ns.unit) if ns.unit else None
    from launcher import config

    return config.load_settings().unit_name


def _live_generation(unit: str) -> Generation | None:
    """The generation llama-launcher deployed for ``unit``, if it manages that unit."""
    from launcher import config
    from launcher.deploy import home, store
    from launcher.errors import LauncherError

    try:
        settings = config.load_settings(unit=unit)
        return store.Store(home.state_dir(settings)).live()
    except (LauncherError, OSError):
        return None


def _pricer(model: str | None) -> MemoryCost | None:
    """KV bytes of a fix's pool for ``model`` (None: no model, or one not covered)."""
    if not model:
        return None
    from pathlib import Path

    from launcher.errors import LauncherError
    from launcher.server import kvbytes

    try:
        info = kvbytes.ModelInfo.from_gguf(Path(model))
    except (LauncherError, OSError):
        return None

    def cost(plan: PoolPlan, ctk: str, ctv: str) -> int | None:
        try:
            return kvbytes.estimate(info, plan, ctk, ctv).total_bytes
        except LauncherError:
            return None

    return cost


def _lacks_cap(path: str | None, live: Generation | None) -> str | None:
    """Why the llama-server the fixes are for has no --kv-unified-per-slot (None: it has it,
    or no binary is known)."""
    import os

    if path is None and live is not None:
        path = live.meta.get("config", {}).get("llama_server")
    path = path or os.environ.get("LLAMA_SERVER_BIN")
    if not path:
        return None
    from launcher.server import (
        binary,  # with the subprocess chokepoint: only when a binary is known
    )

    return binary.inspect(path).lacks("--kv-unified-per-slot")


def run(ns: argparse.Namespace) -> int:
    from launcher.cli.results import emit
    from launcher.deploy import store
    from launcher.errors import ConfigInvalid
    from launcher.reports import diagnose

    if ns.pool is not None and ns.pool <= 0:
        raise ConfigInvalid(f"--pool {ns.pool} is not a positive number of cells; give -c")
    ns.unit = _default_unit(ns)
    pool_hint, hint_source, model = ns.pool, "--pool", ns.model
    live = _live_generation(ns.unit) if ns.unit else None
    if live is not None and store.runs_vllm(live.meta):
        raise ConfigInvalid(
            f"{ns.unit} runs vLLM, which answers a prompt too long with a 400 and queues what "
            "its pool cannot hold (it never fails a request with 'Context size has been "
            "exceeded'): `llama-launcher status` and `check` say its pool and its queue"
        )
    if live is not None:
        if pool_hint is None and live.meta.get("planned"):
            pool_hint = int(live.meta["planned"]["pool_cells"])
            hint_source = f"the live generation {live.number} deployed by llama-launcher"
        model = model or live.meta.get("config", {}).get("model")
    with _open(ns) as (stream, source):
        report = diagnose.diagnose(
            stream,
            source,
            pool_hint=pool_hint,
            pool_hint_source=hint_source,
            memory=_pricer(model),
            lacks_cap=_lacks_cap(ns.llama_server, live),
        )
    recorded = _recorded_failures(ns.unit) if ns.unit else []
    emit(
        {**report.to_dict(), "recorded": recorded},
        ns.json,
        lambda: "\n\n".join(filter(None, [render(report), _recorded_text(recorded)])),
    )
    return 0


def _recorded_failures(unit: str) -> list[dict[str, Any]]:
    """The failures the sampler recorded for ``unit``, with the pool before each (none when
    llama-launcher does not manage the unit)."""
    from launcher import config
    from launcher.deploy import home, store
    from launcher.errors import LauncherError
    from launcher.reports import pressure

    try:
        settings = config.load_settings(unit=unit)
        return pressure.failures_recorded(store.Store(home.state_dir(settings)))
    except (LauncherError, OSError):
        return []


def _recorded_text(recorded: list[dict[str, Any]]) -> str:
    from launcher.reports import pressure

    return "\n".join(pressure.failure_lines(recorded))


def _n(x: int | None) -> str:
    return "?" if x is None else f"{x:,}"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f} %"


def _failure(f: Failure) -> list[str]:
    where = f"line {f.line}"
    head = f"Failure {f.number} ({where}): {f.error}"
    out = [head]
    if f.n_steps > 1:
        views = [s.size for s in f.steps if s.size is not None]
        out.append(
            f"  cascade: {f.n_steps} tries at {f.offsets} offset(s), views "
            f"{_n(views[0] if views else None)} -> {_n(views[-1] if views else None)}"
            f"{f', {f.purges} idle slot(s) purged' if f.purges else ''}; "
            f"gave up at off = {f.off}"
        )
    if not f.slots:
        out.append("  no slot release lines followed")
        return out
    out.append(f"  {'Slot':<6}{'Tokens at the failure':>22}  {'Share of the pool':>17}")
    for s in f.slots:
        out.append(f"  {s.slot:<6}{s.n_tokens:>22,}  {_pct(s.share):>17}")
    share = f.total / f.pool_cells if f.pool_cells else None
    out.append(f"  {'Sum':<6}{f.total:>22,}  {_pct(share):>17}")
    if f.pool_cells is not None and f.overflow is not None:
        check = {True: "adds up", False: "does NOT add up", None: "inferred"}[f.adds_up]
        out.append(
            f"  pool {f.pool_cells:,} + overflow {f.overflow:,} (the batch that could not be "
            f"placed, {f.overflow_source}) = {f.pool_cells + f.overflow:,}: {check}"
        )
    return out


def _fix(fix: Fix, lead: str) -> list[str]:
    if fix.memory_bytes is None:
        mem = "unknown"
    elif fix.memory_bytes >= 2**30:
        mem = f"{fix.memory_bytes / 2**30:.2f} GiB"
    else:
        mem = f"{fix.memory_bytes / 2**20:.1f} MiB"
    return [
        f"  {lead}{fix.command}",
        f"  {' ' * len(lead)}every slot guaranteed {fix.guaranteed_window:,}; pool "
        f"{fix.pool_cells:,} cells; KV memory {mem}; {fix.note}",
    ]


def render(r: Report) -> str:
    """The report as text."""
    out = [f"Source: {r.source} ({r.lines:,} lines)"]
    out.append(
        f"'Context size has been exceeded': {r.exceeded_lines:,} lines (grep -c), "
        f"{r.failures_total:,} failure(s), {r.requests_failed:,} request(s) answered 500"
    )
    out.append(
        f"Requests refused as too long (400 exceed_context_size_error): {r.rejections_total:,}"
    )
    if r.recovered_cascades:
        out.append(f"Cascades that found room after all: {r.recovered_cascades:,}")
    c = r.config
    if c is None:
        out.append("Startup: no startup line in the input (widen --since, or give --pool)")
    else:
        out.append(
            f"Startup (line {c.line}, {r.startups} in the input): n_slots = {c.n_slots}, "
            f"n_ctx_slot = {c.n_ctx_slot}, kv_unified = '{str(c.kv_unified).lower()}'"
        )
        out.append(f"  {c.promise}")
    out.append(f"  pool: {_n(r.pool_cells)} cells, from {r.pool_source}")
    if r.failures:
        shown = len(r.failures)
        if shown < r.failures_total:
            out.append(f"Showing the last {shown} of {r.failures_total:,} failures")
        if r.checked:
            out.append(
                f"Release lines add up to pool + overflow in {r.adds_up} of {r.checked} "
                "failure(s) that could be checked"
            )
        for f in r.failures:
            out.append("")
            out.extend(_failure(f))
    for rej in r.rejections[-3:]:
        out.append(
            f"Refused (line {rej.line}): request of {rej.n_prompt:,} tokens, "
            f"slot holds {rej.n_ctx:,}"
        )
    for v in r.verdicts:
        out.append("")
        out.append(f"Verdict: {v.cls.value} ({v.count:,}): {v.reason}")
        for i, fix in enumerate(v.fixes):
            out.extend(_fix(fix, "Fix: " if i == 0 else "Or:  "))
    if not r.verdicts:
        out.append("")
        out.append("Verdict: no context failures in the input")
    if r.unplaced_lines:
        out.append("")
        out.append(
            f"Not placed in any failure: {r.unplaced_lines:,} line(s) with "
            "'Context size has been exceeded':"
        )
        out.extend(f"  {s}" for s in r.unplaced_samples)
    if r.drift_lines:
        out.append("")
        out.append(f"Possible format drift: {r.drift_lines:,} slot/KV line(s) not understood:")
        out.extend(f"  {s}" for s in r.drift_samples)
    return "\n".join(out)
