"""The journal read in place (``launcher.host.sdjournal``, systemd's Python binding) on the
sandbox's real journal, with ``journalctl -f -o json --after-cursor``'s meaning (as systemd
252's journalctl ought to read it: see ``launcher.host.systemd``); ``journalctl -f`` where
it cannot be read so. How soon a line arrives is ``scripts/bench-journal``'s to measure,
not a test's."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import Sandbox

from launcher.host import sdjournal
from launcher.host.systemd import JournalFollower, Systemd
from launcher.host.systemd import unit_matches as matches


def read_until(follower: sdjournal.Poller | JournalFollower, want: str) -> list[str]:
    """What ``follower`` reads until a line with ``want`` (at most 30 s)."""
    lines: list[str] = []
    for _ in range(30):
        lines += follower.read(1.0)
        if any(want in line for line in lines):
            break
    return lines


def unit(name: str) -> str:
    return f"llj-{name}-{os.getpid()}.service"


def test_the_follower_reads_the_journal_in_place(sandbox: Sandbox) -> None:
    u = unit("kind")
    with Systemd(u, "user").follow(None) as follower:
        assert isinstance(follower, sdjournal.Poller)


def test_the_poller_reads_what_comes_after_its_cursor_in_order(sandbox: Sandbox) -> None:
    u = unit("after")
    systemd = Systemd(u, "user")
    sandbox.log_as(u, "before")
    _, cursor = systemd.messages(None)  # the unit's own last entry
    assert cursor is not None
    with sdjournal.Poller(matches(u), cursor) as p:
        sandbox.log_as(u, "one", "two")
        lines = read_until(p, "pid")
    assert [line for line in lines if not line.startswith("pid")] == ["one", "two"]


def test_the_poller_from_no_cursor_reads_the_units_whole_journal(sandbox: Sandbox) -> None:
    u = unit("head")
    sandbox.log_as(u, "first")
    with sdjournal.Poller(matches(u), None) as p:
        assert "first" in read_until(p, "first")


def test_the_poller_keeps_only_the_messages_its_pattern_matches(sandbox: Sandbox) -> None:
    u = unit("grep")
    systemd = Systemd(u, "user")
    with sdjournal.Poller(matches(u), systemd.cursor(), grep=r"ke(ep)") as p:
        sandbox.log_as(u, "drop", "keep me", "dropped too", "keep")
        lines = read_until(p, "keep")
        lines += p.read(0.5)
    assert lines == ["keep me", "keep"]


def test_a_lowercase_pattern_ignores_case_as_journalctls_grep_does(sandbox: Sandbox) -> None:
    u = unit("case")
    with sdjournal.Poller(matches(u), Systemd(u, "user").cursor(), grep="keep") as p:
        sandbox.log_as(u, "KEEP it", "drop", "Keep")
        lines = read_until(p, "Keep") + p.read(0.5)
    assert lines == ["KEEP it", "Keep"]


def test_a_pattern_python_cannot_compile_is_followed_with_journalctl(sandbox: Sandbox) -> None:
    # \K (PCRE2's "keep what matched so far out of the match"): Python's re refuses it
    u = unit("pcre")
    systemd = Systemd(u, "user")
    with systemd.follow(systemd.cursor(), grep=r"ke\Kep") as follower:
        assert isinstance(follower, JournalFollower)
        sandbox.log_as(u, "drop", "keep")
        assert read_until(follower, "keep") == ["keep"]


def test_a_poller_read_in_a_forked_child_has_ended(sandbox: Sandbox) -> None:
    # sd-journal(3): a handle is its process's; libsystemd answers -ECHILD in a child
    u = unit("fork")
    with sdjournal.Poller(matches(u), None) as p:
        r, w = os.pipe()
        child = os.fork()
        if child == 0:  # never back into pytest
            try:
                p.read(0.1)
                os.write(w, b"ended" if p.ended else b"reading")
            finally:
                os._exit(0)
        os.waitpid(child, 0)
        assert os.read(r, 16) == b"ended"
        assert not p.ended  # the parent's reads on


@pytest.mark.parametrize("kind", ["messages", "journalctl -f"])
def test_what_comes_after_another_units_cursor_begins_with_the_units_first_line(
    sandbox: Sandbox, kind: str
) -> None:
    # the cursor of the journal's end is another unit's entry: systemd 252's journalctl
    # --after-cursor skipped the unit's first line after it
    u = unit("first" + kind[-1])
    systemd = Systemd(u, "user")
    cursor = systemd.cursor()
    sandbox.log_as(u, "first", "second")
    if kind == "messages":
        lines = systemd.messages(cursor)[0]
    else:
        with systemd.follow_journalctl(cursor) as follower:
            assert isinstance(follower, JournalFollower)
            lines = read_until(follower, "pid")
    assert lines[:2] == ["first", "second"]


def test_the_poller_leaves_out_the_lines_of_the_process_it_skips(sandbox: Sandbox) -> None:
    # two starts of one unit, as a restart's: the first process's lines are left out
    u = unit("skip")
    cursor = Systemd(u, "user").cursor()
    sandbox.log_as(u, "from the first")
    sandbox.log_as(u, "from the second")
    with sdjournal.Poller(matches(u), cursor) as p:
        both = read_until(p, "from the second")
    first = int(both[1].split()[-1])  # the first start's "pid N"
    with sdjournal.Poller(matches(u), cursor, skip_pid=first) as p:
        kept = read_until(p, "from the second")
    assert both[0] == "from the first" and kept[0] == "from the second"


def missing() -> object:
    """An import of systemd's binding where it is not installed (it is in the test venv)."""
    raise ModuleNotFoundError("No module named 'systemd'")


def test_a_poller_without_the_binding_is_unavailable_and_names_the_fix() -> None:
    with pytest.raises(sdjournal.Unavailable, match=r"llama-launcher\[journal\]"):
        sdjournal.Poller(matches(unit("nobinding")), None, binding=missing)


def test_a_journal_without_the_binding_is_followed_with_journalctl(sandbox: Sandbox) -> None:
    u = unit("fallback")
    systemd = Systemd(u, "user", binding=missing)
    with systemd.follow(systemd.cursor()) as follower:
        assert isinstance(follower, JournalFollower)
        sandbox.log_as(u, "through journalctl")
        assert "through journalctl" in read_until(follower, "through journalctl")


def test_the_poller_reads_on_in_the_file_journald_rotates_to(sandbox: Sandbox) -> None:
    u = unit("rotate")
    with sdjournal.Poller(matches(u), Systemd(u, "user").cursor()) as p:
        subprocess.run(["journalctl", "--rotate"], check=True, timeout=60, capture_output=True)
        sandbox.log_as(u, "in the new file")
        assert "in the new file" in read_until(p, "in the new file")
