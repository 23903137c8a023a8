"""The command line: parse arguments, call one core function per verb, print, map exit codes.

Only this package prints to the user or exits. Every verb is a declaration in
``launcher.cli.table`` (name, group, help, options, the function), turned into argparse's
subparsers by ``launcher.cli.verbs``; the functions live in the modules beside it and import
the core they call lazily, so ``llama-launcher X`` pays only for the imports X needs. What
they print: ``launcher.cli.results``.

Exit codes: 0 success (changed or not), 1 other error, 2 invalid input (nothing changed),
3 deploy failed and rolled back, 4 rollback failed, 5 lock timeout, 6 reverted by its bake,
7 its bake's revert failed (the new config serves still).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Collection, Mapping, Sequence

from launcher.errors import EXIT_CODES

EPILOG = "exit codes:\n" + "\n".join(
    f"  {code:<3} {textwrap.fill(text, 76, subsequent_indent=' ' * 6)}" for code, text in EXIT_CODES
)

#: The options of every verb that names a unit (``launcher.cli.table.SETTINGS``), with
#: the number of values each takes: given before the verb, they are read after it
#: (``llama-launcher --scope system status``).
GLOBAL_OPTIONS = {
    "--unit": 1,
    "--instance": 1,
    "--lane": 1,
    "--scope": 1,
    "--env-file": 1,
    "--state-dir": 1,
    "--base-url": 1,
    "--start-timeout": 1,
    "--health-timeout": 1,
    "--probe-timeout": 1,
    "--lock-timeout": 1,
    "--json": 0,
    "-v": 0,
    "--verbose": 0,
}


def verb_first(args: list[str], takes: Mapping[str, Collection[str]] | None = None) -> list[str]:
    """``args`` with the global options given before the verb moved after it. ``takes``:
    the options of each verb (``verb_options``); one the verb does not take (``diagnose``,
    ``bench`` and ``plan`` take only some) is refused, ``ValueError`` naming it."""
    moved: list[str] = []
    names: list[str] = []
    i = 0
    while i < len(args):
        name, inline, _ = args[i].partition("=")
        if name not in GLOBAL_OPTIONS:
            break
        n = 1 + (0 if inline else GLOBAL_OPTIONS[name])
        moved += args[i : i + n]
        names.append(name)
        i += n
    if not moved or i >= len(args) or args[i].startswith("-"):
        return args
    verb = args[i]
    lacking = [n for n in names if takes is not None and verb in takes and n not in takes[verb]]
    if lacking:
        raise ValueError(
            f"{', '.join(lacking)}: not an option of {verb} (one given before the verb is "
            f"read as the verb's own); see llama-launcher {verb} --help"
        )
    return [verb, *moved, *args[i + 1 :]]


def verb_options(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """The option strings each verb of ``parser`` takes."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {v: set(p._option_string_actions) for v, p in action._name_parser_map.items()}
    return {}


DESCRIPTION = (
    "Launch llama-server under systemd and deploy its flags safely. The options that say "
    "where (--unit, --instance, --lane, --scope, --env-file, --state-dir, --base-url, the "
    "timeouts, --json, -v) may come before the verb or after it, for a verb that takes them "
    "(diagnose, bench and plan take only some: see their --help). `llama-launcher guide` "
    "lists the guides."
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every verb in ``launcher.cli.table``."""
    from launcher import __version__
    from launcher.cli import table, verbs

    return verbs.parser(table.VERBS, DESCRIPTION, EPILOG, f"llama-launcher {__version__}")


def main(args: Sequence[str], on_phase: Callable[[str], None] | None = None) -> int:
    """Run one verb; ``on_phase`` is told each phase of a deploy transaction (the
    crash-safety tests pass one in to inject a fault at a phase)."""
    parser = build_parser()
    # llama-server flags (`set -ctk q8_0 ...`) are whatever the verb's own options are not.
    try:
        ordered = verb_first(list(args), verb_options(parser))
    except ValueError as e:
        parser.error(str(e))
    ns, extra = parser.parse_known_args(ordered)
    if extra and not getattr(ns, "takes_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    ns.flags = extra
    ns.on_phase = on_phase
    from launcher.cli.results import fail
    from launcher.errors import Interrupted, LauncherError

    as_json, verbose = getattr(ns, "json", False), getattr(ns, "verbose", False)
    try:
        return int(ns.func(ns))
    except LauncherError as e:
        return fail(e, as_json, verbose)
    except BrokenPipeError:
        raise  # the reader went away: __main__ exits 141
    except OSError as e:  # one the core did not type: a clear line still (JSON with --json)
        return fail(e, as_json, verbose)
    except Interrupted as e:
        print(f"llama-launcher: {e} before the change went live", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("llama-launcher: interrupted", file=sys.stderr)
        return 130
