"""The verbs as data (``launcher.cli.table``): what ``--help`` lists and where, every verb's
options as they were before the table (``data/cli_options.json``, recorded from the
``register`` functions it replaced), and ``guide``."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from launcher import cli
from launcher.cli import guide, table
from launcher.cli.verbs import Group
from launcher.install import prestart

DATA = Path(__file__).parent / "data"
#: What the table added to the recorded verbs: -v on every verb a person types.
VERBOSE = "-v --verbose dest=verbose StoreTrueAction nargs=0"
UNIT_VERBS = {"exec", "prestart", "sample", "front-release", "stop-warm"}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub._name_parser_map)


def option_line(a: argparse.Action) -> str:
    """One option as ``data/cli_options.json`` records it."""
    parts = [" ".join(a.option_strings) or f"<{a.dest}>", f"dest={a.dest}"]
    parts.append(type(a).__name__.lstrip("_"))
    if a.default not in (None, False):
        parts.append(f"default={a.default!r}")
    if a.required:
        parts.append("required")
    if a.nargs is not None:
        parts.append(f"nargs={a.nargs}")
    if a.choices is not None:
        parts.append(f"choices={','.join(a.choices)}")
    if a.type is not None:
        parts.append(f"type={getattr(a.type, '__name__', a.type)}")
    if a.metavar is not None:
        parts.append(f"metavar={a.metavar}")
    return " ".join(parts)


def options_of(p: argparse.ArgumentParser) -> set[str]:
    return {option_line(a) for a in p._actions if not isinstance(a, argparse._HelpAction)}


def listed(help_text: str) -> dict[str, list[str]]:
    """The verbs ``--help`` lists under each heading, in order."""
    groups: dict[str, list[str]] = {}
    heading = None
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
            groups[heading] = []
        elif heading is not None and (m := re.match(r"  ([a-z][a-z-]*)(\s|$)", line)):
            groups[heading].append(m[1])
    return groups


@pytest.fixture(scope="module")
def top_help() -> str:
    return cli.build_parser().format_help()


def test_every_recorded_verb_keeps_its_options() -> None:
    recorded: dict[str, list[str]] = json.loads((DATA / "cli_options.json").read_text())
    now = subparsers()
    for verb, options in recorded.items():
        assert options_of(now[verb]) - {VERBOSE} == set(options), verb


def test_the_verbs_are_the_recorded_ones_and_guide_and_prestart() -> None:
    recorded = json.loads((DATA / "cli_options.json").read_text())
    assert set(subparsers()) == {*recorded, "guide", "prestart"}


def test_every_verb_a_person_types_takes_v_and_the_units_own_do_not() -> None:
    for verb, p in subparsers().items():
        assert (VERBOSE in options_of(p)) is (verb not in {"exec", "prestart"}), verb


def test_prestarts_options_are_those_its_own_parser_takes() -> None:
    """``launcher.__main__`` hands ``prestart`` to its own standard-library parser; the
    table's entry (for --help and cli.main) takes the same options."""
    usage = set(re.findall(r"--[a-z-]+", prestart._USAGE))
    assert set(subparsers()["prestart"]._option_string_actions) - {"-h", "--help"} == usage


def test_every_verb_is_listed_once_under_one_heading(top_help: str) -> None:
    groups = listed(top_help)
    names = [v for verbs in groups.values() for v in verbs]
    assert sorted(names) == sorted(subparsers())
    assert len(names) == len(set(names))


def test_the_everyday_verbs_come_first_and_the_units_own_last(top_help: str) -> None:
    groups = listed(top_help)
    headings = [h for h in groups if groups[h]]
    assert headings == [g.value for g in Group]
    assert groups[Group.EVERYDAY.value][:9] == [
        "install", "set", "unset", "deploy", "rollback", "status", "history", "top", "compare"
    ]  # fmt: skip
    assert groups[Group.PLANNING.value] == ["plan", "check", "render", "diagnose", "bench"]
    assert groups[Group.MAINTENANCE.value] == ["recover", "uninstall"]
    assert set(groups[Group.UNITS.value]) == UNIT_VERBS


def test_no_verb_of_the_units_is_among_the_everyday_ones() -> None:
    everyday = {v.name for v in table.VERBS if v.group is Group.EVERYDAY}
    assert everyday.isdisjoint(UNIT_VERBS)
    assert {v.name for v in table.VERBS if v.group is Group.UNITS} == UNIT_VERBS


def test_v_before_the_verb_is_read_after_it() -> None:
    takes = {v: set(p._option_string_actions) for v, p in subparsers().items()}
    assert cli.verb_first(["-v", "status", "--json"], takes) == ["status", "-v", "--json"]
    with pytest.raises(ValueError, match="-v: not an option of exec"):
        cli.verb_first(["-v", "exec", "--env-file", "x"], takes)


def test_a_verb_that_takes_llama_server_flags_passes_them_on_and_keeps_v() -> None:
    parser = cli.build_parser()
    ns, extra = parser.parse_known_args(["set", "-v", "--temp", "0.7", "-ctk", "q8_0"])
    assert ns.verbose and ns.takes_flags
    assert extra == ["--temp", "0.7", "-ctk", "q8_0"]


# -- guide ------------------------------------------------------------------------------------


def test_the_shipped_guides_are_found_in_the_package() -> None:
    found = guide.guides()
    assert found and found[0].topic == "first-deployment"
    text = found[0].text()
    assert text.startswith(f"# {found[0].title}\n")


def test_guides_are_listed_by_their_number_with_their_first_heading(tmp_path: Path) -> None:
    (tmp_path / "10-later.md").write_text("intro\n# Later on\n## a part\n")
    (tmp_path / "02-second.md").write_text("# The second\n")
    (tmp_path / "01-first.md").write_text("no heading at all\n")
    (tmp_path / "notes.txt").write_text("# not a guide\n")
    found = guide.guides(tmp_path)
    assert [(g.topic, g.title) for g in found] == [
        ("first", "first"),
        ("second", "The second"),
        ("later", "Later on"),
    ]


@pytest.mark.parametrize(
    ("given", "expected"),
    [("second", "second"), ("sec", "second"), ("02-second", "second"), ("se", "second")],
)
def test_a_topic_or_a_unique_prefix_names_a_guide(
    tmp_path: Path, given: str, expected: str
) -> None:
    (tmp_path / "01-first.md").write_text("# First\n")
    (tmp_path / "02-second.md").write_text("# Second\n")
    assert guide.find(given, guide.guides(tmp_path)).topic == expected


def test_a_prefix_of_two_topics_is_refused_naming_both(tmp_path: Path) -> None:
    from launcher.errors import InvalidInput

    (tmp_path / "01-front.md").write_text("# Front\n")
    (tmp_path / "02-first.md").write_text("# First\n")
    with pytest.raises(InvalidInput, match=r"'f' names more than one guide \(front, first\)"):
        guide.find("f", guide.guides(tmp_path))


def test_guide_lists_the_topics_and_prints_one(capsys: pytest.CaptureFixture[str]) -> None:
    first = guide.guides()[0]
    assert cli.main(["guide"]) == 0
    assert re.search(rf"(?m)^  {re.escape(first.topic)} +{re.escape(first.title)}$",
                     capsys.readouterr().out)  # fmt: skip
    assert cli.main(["guide", first.topic[:3]]) == 0
    assert capsys.readouterr().out == first.text().rstrip("\n") + "\n"


def test_guide_json(capsys: pytest.CaptureFixture[str]) -> None:
    first = guide.guides()[0]
    assert cli.main(["guide", "--json"]) == 0
    listing: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert listing["topics"][0] == {"topic": first.topic, "title": first.title, "file": first.file}
    assert cli.main(["--json", "guide", first.topic]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one == {"topic": first.topic, "title": first.title, "text": first.text()}


def test_an_unknown_topic_is_refused_with_exit_2_listing_the_topics(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["guide", "no-such-topic"]) == 2
    err = capsys.readouterr().err
    assert "no guide 'no-such-topic'" in err
    assert all(g.topic in err for g in guide.guides())
