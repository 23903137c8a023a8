"""``llama-launcher guide [TOPIC]``: the guides that ship with the tool.

They are Markdown files in the package (``launcher/guides/NN-topic.md``, package data), read
with ``importlib.resources`` so an installed wheel and an editable checkout find them
alike. ``NN`` orders the list; the topic is the name without it; a guide's title is its
first ``# `` heading.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable

from launcher.cli.results import emit

_NAME = re.compile(r"(?:(\d+)-)?(.+)")


@dataclass(frozen=True)
class Guide:
    """One guide: its topic, its title and its file's name."""

    topic: str
    title: str
    file: str
    path: Traversable = field(compare=False, repr=False)

    def text(self) -> str:
        return self.path.read_text("utf-8")


def guides(folder: Traversable | None = None) -> list[Guide]:
    """Every guide in ``folder`` (default: the ones that ship), in the order of their
    files' numbers."""
    found: list[tuple[float, Guide]] = []
    for f in (folder or resources.files("launcher").joinpath("guides")).iterdir():
        m = _NAME.fullmatch(f.name.removesuffix(".md"))
        if m is None or not f.name.endswith(".md"):
            continue
        number, topic = m.groups()
        title = next(
            (
                line[2:].strip()
                for line in f.read_text("utf-8").splitlines()
                if line.startswith("# ")
            ),
            topic,
        )
        found.append((int(number) if number else float("inf"), Guide(topic, title, f.name, f)))
    return [g for _, g in sorted(found, key=lambda x: (x[0], x[1].topic))]


def find(topic: str, among: list[Guide]) -> Guide:
    """The guide ``topic`` names: its topic, its file's name, or a prefix of one topic only.
    ``InvalidInput`` naming the topics otherwise."""
    from launcher.errors import InvalidInput

    for g in among:
        if topic in (g.topic, g.file, g.file.removesuffix(".md")):
            return g
    matches = [g for g in among if g.topic.startswith(topic)]
    if len(matches) == 1:
        return matches[0]
    topics = ", ".join(g.topic for g in (matches or among))
    if matches:
        raise InvalidInput(f"guide {topic!r} names more than one guide ({topics}); give more of it")
    raise InvalidInput(
        f"no guide {topic!r}; the topics: {topics} (llama-launcher guide lists them)"
    )


def cmd_guide(ns: argparse.Namespace) -> int:
    among = guides()
    if ns.topic is None:
        width = max((len(g.topic) for g in among), default=0)
        emit(
            {"topics": [{"topic": g.topic, "title": g.title, "file": g.file} for g in among]},
            ns.json,
            lambda: "\n".join(
                ["guides (llama-launcher guide TOPIC):"]
                + [f"  {g.topic:<{width}}  {g.title}" for g in among]
            ),
        )
        return 0
    g = find(ns.topic, among)
    text = g.text()
    emit({"topic": g.topic, "title": g.title, "text": text}, ns.json, lambda: text.rstrip("\n"))
    return 0
