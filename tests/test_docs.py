"""The docs cannot rot: README and the guides (launcher/guides/) name only verbs and options
the CLI has, links and repo paths that exist, and references equal to the code.

Pure: the CLI's own parser reads each command line (nothing runs); the files are read as
text."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from launcher import cli
from launcher.reports import reference

REPO = Path(__file__).resolve().parent.parent
GUIDES = REPO / "launcher" / "guides"
#: the README's budget: a newcomer reads it in five minutes
README_MAX = 15_000
#: the top-level folders a repo path in the docs starts with
TOP = ("launcher/", "scripts/", "tests/", "units/", "env/", ".ci/")


def docs() -> list[Path]:
    """README and every guide (not the scratch files whose names begin with ``_``)."""
    return [REPO / "README.md", *sorted(p for p in GUIDES.glob("*.md") if p.name[0] != "_")]


def code_lines(text: str) -> list[str]:
    """The lines of the fenced and indented code blocks, continuations joined."""
    lines: list[str] = []
    fenced = False
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or raw.startswith("    ") or raw.startswith("\t"):
            lines.append(raw.strip())
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line
        else:
            joined.append(line)
    return joined


def commands(path: Path) -> list[str]:
    """The ``llama-launcher ...`` command lines of ``path``'s code blocks (a ``$`` prompt
    and a trailing comment left out)."""
    found = []
    for line in code_lines(path.read_text()):
        line = line.removeprefix("$ ").strip()
        if not line.startswith("llama-launcher "):
            continue
        words = shlex.split(line, comments=True)
        found.append(shlex.join(words[1:]))
    return found


def every_command() -> list[tuple[str, str]]:
    return [(p.name, c) for p in docs() for c in commands(p)]


def parse(args: list[str]) -> None:
    """What ``launcher.cli.main`` does before it runs a verb: the verb first, its options
    parsed, llama-server's flags only where the verb takes them."""
    parser = cli.build_parser()
    ordered = cli.verb_first(args, cli.verb_options(parser))
    ns, extra = parser.parse_known_args(ordered)
    if extra and not getattr(ns, "takes_flags", False):
        raise SystemExit(f"unrecognized arguments: {' '.join(extra)}")


@pytest.mark.parametrize(("doc", "line"), every_command())
def test_every_command_line_in_the_docs_parses(doc: str, line: str) -> None:
    try:
        parse(shlex.split(line))
    except SystemExit as e:
        pytest.fail(f"{doc}: `llama-launcher {line}` does not parse: {e}")


def test_the_docs_show_commands() -> None:
    assert len(every_command()) >= 30  # the parse test above is not vacuous


def test_the_readme_is_short_and_links_the_guides() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text) <= README_MAX, len(text)
    linked = set(re.findall(r"\]\((launcher/guides/[\w.-]+\.md)\)", text))
    guides = {f"launcher/guides/{p.name}" for p in docs()[1:]}
    assert len(linked & guides) >= 8, linked
    assert linked <= guides, linked - guides


def links(path: Path) -> list[str]:
    """The relative link targets of ``path`` (anchors left out)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    return [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t) and t[0] != "#"]


@pytest.mark.parametrize("doc", docs(), ids=lambda p: p.name)
def test_every_relative_link_resolves(doc: Path) -> None:
    missing = [t for t in links(doc) if not (doc.parent / t).exists()]
    assert missing == [], f"{doc.name} links to what does not exist: {missing}"


@pytest.mark.parametrize("doc", docs(), ids=lambda p: p.name)
def test_every_repo_path_named_exists(doc: Path) -> None:
    named = re.findall(r"`((?:" + "|".join(map(re.escape, TOP)) + r")[\w./-]*)`", doc.read_text())
    missing = [n for n in named if "*" not in n and not (REPO / n.rstrip(".")).exists()]
    assert missing == [], f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("name", sorted(reference.FILES))
def test_each_reference_equals_the_code(name: str) -> None:
    path = GUIDES / name
    assert path.exists(), f"{name} is missing: run scripts/references"
    assert path.read_text() == reference.generate()[name], f"{name} differs: run scripts/references"


def test_every_error_class_is_in_the_error_reference() -> None:
    """An error class defined anywhere in the package (by its source: a subclass of one in
    the tree) is in the reference: ``reference.ERROR_MODULES`` names every module with one."""
    listed = {cls.__name__ for _, cls in reference.error_classes()}
    defined = set()
    for path in (REPO / "launcher").rglob("*.py"):
        for name, base in re.findall(r"^class (\w+)\((\w+)\)", path.read_text(), re.M):
            if base in listed:
                defined.add(name)
    assert defined and defined <= listed, defined - listed


def test_every_setting_says_what_it_means() -> None:
    from launcher.config.settings import ToolSettings

    assert [n for n, f in ToolSettings.model_fields.items() if not f.description] == []


def test_the_readmes_exit_codes_are_the_codes_of_the_cli() -> None:
    """README's table of exit codes lists the statuses ``launcher.errors.EXIT_CODES`` has."""
    from launcher.errors import EXIT_CODES

    text = (REPO / "README.md").read_text()
    shown = re.findall(r"(?m)^\| (\d+(?:\+n)?) \|", text)
    codes = [c.replace("128+signal", "128+n") for c, _ in EXIT_CODES]
    assert shown == [c for c in codes if c != "141"], shown
