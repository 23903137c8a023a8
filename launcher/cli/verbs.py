"""Verbs as data: what a verb is called, where ``--help`` lists it, its options and the
function that runs it (``Verb``), and the one builder that turns a table of them into
argparse's subparsers (``parser``). The table itself is ``launcher.cli.table``.

Options are declared once as ``Options`` sets (the settings, the drain, the bake) that
the verbs share, so a verb's options are the sets it names and nothing added by hand.
"""

from __future__ import annotations

import argparse
import enum
import shutil
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Handler = Callable[[argparse.Namespace], int]


class Group(enum.Enum):
    """Where ``--help`` lists a verb: the everyday verbs first, the units' own last."""

    EVERYDAY = "everyday verbs"
    PLANNING = "planning and diagnosis (change nothing)"
    MAINTENANCE = "maintenance"
    UNITS = "run by the units (systemd runs these, not people)"


@dataclass(frozen=True)
class Arg:
    """One argument: ``add_argument``'s names and keywords."""

    names: tuple[str, ...]
    keywords: tuple[tuple[str, Any], ...] = ()

    def add_to(self, to: Any) -> None:
        to.add_argument(*self.names, **dict(self.keywords))


def arg(*names: str, **keywords: Any) -> Arg:
    """An ``Arg``, spelled as ``add_argument`` is."""
    return Arg(names, tuple(keywords.items()))


@dataclass(frozen=True)
class Options:
    """A set of arguments declared once, for every verb that takes them."""

    args: tuple[Arg, ...]
    #: a heading of their own in the verb's ``--help`` (None: among the verb's options)
    title: str | None = None
    #: at most one of them may be given (argparse's mutually exclusive group)
    exclusive: bool = False

    def add_to(self, p: argparse.ArgumentParser) -> None:
        to: Any = p
        if self.exclusive:
            to = p.add_mutually_exclusive_group()
        elif self.title is not None:
            to = p.add_argument_group(self.title)
        for a in self.args:
            a.add_to(to)


def options(*args: Arg, title: str | None = None, exclusive: bool = False) -> Options:
    """An ``Options`` set of ``args``."""
    return Options(args, title, exclusive)


@dataclass(frozen=True)
class Verb:
    """One verb of ``llama-launcher``."""

    name: str
    group: Group
    #: one line in the list of verbs; the verb's own ``--help`` starts with it, unless
    #: ``description`` says more
    help: str
    run: Handler
    options: tuple[Options, ...] = ()
    description: str = ""
    #: llama-server flags follow, in llama-server's own spellings (``set -ctk q8_0``):
    #: whatever is not the verb's own option
    flags: bool = False


def _width() -> int:
    # argparse's own: the terminal's columns less two
    return max(shutil.get_terminal_size().columns - 2, 40)


def fill(text: str, width: int | None = None) -> str:
    """``text`` with each paragraph (blank-line separated) re-flowed to ``width``."""
    paragraphs = [" ".join(p.split()) for p in text.strip().split("\n\n")]
    return "\n\n".join(textwrap.fill(p, width or _width()) for p in paragraphs)


def listing(verbs: Iterable[Verb], width: int | None = None) -> str:
    """The verbs under their groups' headings, in ``Group`` order, each group's verbs in
    the table's order."""
    verbs = list(verbs)
    width = width or _width()
    column = max(len(v.name) for v in verbs) + 4
    blocks = []
    for group in Group:
        lines = [f"{group.value}:"]
        for v in (v for v in verbs if v.group is group):
            body = textwrap.wrap(v.help, max(width - column, 20))
            lines.append(f"  {v.name:<{column - 2}}{body[0]}")
            lines += [" " * column + line for line in body[1:]]
        if len(lines) > 1:
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def parser(
    verbs: Sequence[Verb], description: str, epilog: str, version: str
) -> argparse.ArgumentParser:
    """``llama-launcher``'s parser: one subparser per verb, the verbs listed by group."""
    top = argparse.ArgumentParser(
        prog="llama-launcher",
        usage="%(prog)s [-h] [--version] VERB ...",
        allow_abbrev=False,
        description=f"{fill(description)}\n\n{listing(verbs)}",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--version", action="version", version=version)
    # the verbs are listed by group in the description; argparse's own list is one block
    sub = top.add_subparsers(
        dest="verb", metavar="VERB", help=argparse.SUPPRESS, prog="llama-launcher"
    )
    sub.required = True
    for v in verbs:
        p = sub.add_parser(
            v.name,
            description=fill(v.description or v.help),
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            allow_abbrev=False,
        )
        for o in v.options:
            o.add_to(p)
        p.set_defaults(func=v.run, takes_flags=v.flags)
    return top
