"""Verbs of the live watch: sample (what the sampler's timer runs), top, compare (their
options: ``launcher.cli.table``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any

from launcher.cli.deploy import settings_from
from launcher.cli.results import emit
from launcher.host import notify

if TYPE_CHECKING:
    from launcher.watch.sampler import Outcome


def cmd_sample(ns: argparse.Namespace) -> int:
    from launcher.host.systemd import Systemd
    from launcher.watch import sample, sampler

    if ns.unit and ns.scope and ns.state_dir:
        # as the sampler's timer runs it, with the unit, its scope and its state folder that
        # install resolved: no settings are read (their typed config's import would be most
        # of a sample's CPU time)
        unit = ns.unit if "." in ns.unit else f"{ns.unit}.service"
        target = sampler.Target(unit, ns.state_dir.absolute(), ns.textfile_dir, ns.base_url)
        systemd = Systemd(unit, ns.scope)
    else:
        settings = settings_from(ns)
        target = sampler.target_for(settings, ns.textfile_dir)
        systemd = Systemd(settings.unit_name, settings.scope)
    if ns.wedged_samples is not None:
        from launcher.errors import ConfigInvalid

        if ns.wedged_samples < 0:
            raise ConfigInvalid(
                f"--wedged-samples {ns.wedged_samples} is not a count; give 0 (off) or more"
            )
        target = dataclasses.replace(target, wedged_samples=ns.wedged_samples)
    if ns.every is not None:
        from launcher import waits
        from launcher.errors import ConfigInvalid

        if ns.every <= 0:
            raise ConfigInvalid(f"--every {ns.every:g} is not a positive number of seconds")
        waits.every(ns.every)(lambda: _report(sample.sample(target, systemd), ns.json))
    return _through_bake(target, systemd, ns.json)


def _through_bake(target: Any, systemd: Any, as_json: bool) -> int:
    """One sample; while the live generation bakes, one every ``bake_interval`` until its
    verdict (the bake's cadence, whatever the timer's). Started during a deploy that
    announced a bake (``launcher.watch.handoff``), it waits for that bake first."""
    from launcher.deploy import store
    from launcher.watch import bake, sample

    st = store.Store(target.state_dir)
    found = None
    if bake.announced(st) is not None:
        # started at a deploy's gate, before the bake it announced begins (the live one's,
        # if any, is about to end): the modules of a revert imported while it waits, not at
        # the first hard failure
        from launcher.watch import revert  # noqa: F401

        found = bake.awaited(st)
    found = found or bake.live_bake(st)
    if found is None or not found[1].running:
        code = _report(sample.sample(target, systemd), as_json)
        notify.ready()  # the sampler's service (Type=notify): one sample done
        return code
    worst, sampled = [0], [False]

    def once(peak: Any, revert: Any) -> Outcome:
        sampled[0] = True
        out = sample.sample(target, systemd, peak=peak, revert=revert)
        worst[0] = max(worst[0], _report(out, as_json))
        notify.ready()  # after the first sample; systemd ignores the ones after
        return out

    from launcher.watch import carry

    final = carry.on_unit(target, systemd, st, found[0], once)
    if final is not None and final.verdict is not None and final.verdict.signal == carry.UNJUDGED:
        _warn(bake.say(final))  # no sample said it: the carry ended it
    if not sampled[0]:
        # the bake ended before the carry began (another sampler's verdict): one sample
        # still, so that every run reports one (--json: one object, never none)
        worst[0] = _report(sample.sample(target, systemd), as_json)
        notify.ready()
    return worst[0]


def _report(out: Outcome, as_json: bool) -> int:
    for w in out.warnings:
        _warn(w)
    emit(out.to_dict(), as_json, lambda: _sample_text(out))
    for e in out.errors:
        print(f"llama-launcher: {e}", file=sys.stderr)
    sys.stdout.flush()
    return 0 if out.ok else 1


def _warn(text: str) -> None:
    """A warning on stderr; in the journal (a unit's stderr) at priority warning."""
    print(f"{'<4>' if _to_journal() else ''}llama-launcher: warning: {text}", file=sys.stderr)


def _to_journal() -> bool:
    """stderr is the journal stream systemd connected (``$JOURNAL_STREAM`` names it)."""
    try:
        dev, ino = (int(x) for x in os.environ.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(2)
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def _sample_text(out: Outcome) -> str:
    if out.skipped:
        return f"skipped: {out.skipped}"
    head = f"sampled {out.unit} (generation {out.generation})"
    lines = [head]
    if out.pressure:
        from launcher.reports import pressure

        lines += [f"  {x}" for x in pressure.pool_lines(out.pressure)]
    if out.decode_tps is not None:
        lines.append(f"  decode since the last sample: {out.decode_tps:,.1f} tok/s")
    if out.wedged:
        w = out.wedged
        did = "restarted" if w["restarted"] else f"wedged sample {w['samples']} of {w['limit']}"
        lines.append(f"  {did}: {w['why']}")
    if out.counts:
        shown = ", ".join(f"{k} +{v:g}" for k, v in out.counts.items() if k in _SHOWN)
        if shown:
            lines.append(f"  {shown}")
    lines += [f"  could not read {k}: {v}" for k, v in out.unread.items()]
    if out.lost:
        lines.append(f"  journal: {out.lost}")
    lines.append(f"  wrote: {', '.join(out.wrote)}" if out.wrote else "  nothing changed")
    return "\n".join(lines)


_SHOWN = ("requests", "completions", "failures", "context_exceeded", "restarts")


def cmd_top(ns: argparse.Namespace) -> int:
    from launcher.errors import ConfigInvalid
    from launcher.host.systemd import Systemd
    from launcher.reports import pressure

    if ns.interval <= 0:
        raise ConfigInvalid(f"--interval {ns.interval:g} is not a positive number of seconds")
    settings = settings_from(ns)
    view = pressure.Top(settings, Systemd(settings.unit_name, settings.scope))
    if ns.once or ns.json or not sys.stdout.isatty():
        frame = view.frame()
        emit(frame, ns.json, lambda: "\n".join(pressure.top_lines(frame)))
        return 0
    _loop(view, ns.interval)
    return 0


def _loop(view: Any, interval: float) -> None:
    """Redraw every ``interval`` seconds until q (or Ctrl-C): the terminal in cbreak mode,
    no curses needed for one screen of text."""
    import select
    import termios
    import tty

    from launcher.reports import pressure

    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    saved = termios.tcgetattr(fd) if fd is not None else None
    try:
        if fd is not None:
            tty.setcbreak(fd)
        while True:
            lines = pressure.top_lines(view.frame())
            sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n\n(q to quit)\n")
            sys.stdout.flush()
            ready = select.select([fd], [], [], interval)[0] if fd is not None else []
            if fd is None:
                import time

                time.sleep(interval)
            elif ready and os.read(fd, 1) in (b"q", b"Q"):
                return
    except KeyboardInterrupt:
        return
    finally:
        if fd is not None and saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def cmd_compare(ns: argparse.Namespace) -> int:
    from launcher.reports import compare

    data = compare.compare(settings_from(ns), ns.a, ns.b)
    emit(data, ns.json, lambda: compare.compare_text(data))
    return 0
