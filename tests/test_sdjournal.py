"""The journal read in place (``launcher.host.sdjournal``) on the sandbox's real journal,
with ``journalctl -f -o json --after-cursor``'s meaning; ``journalctl -f`` where it cannot be
read so. How soon a line arrives is ``scripts/bench-journal``'s to measure, not a test's."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import Sandbox

from launcher.host import sdjournal
from launcher.host.systemd import JournalFollower, Systemd


def logged(unit: str, *script: str) -> None:
    """Run ``script`` (sh; it ends saying ``pid`` and its pid: systemd reads ``$$`` as
    ``$``) as unit ``unit``, to its end."""
    subprocess.run(
        ["systemd-run", "--user", "--quiet", "--collect", f"--unit={unit}",
         "-p", "Type=oneshot", "/bin/sh", "-c", "; ".join([*script, "echo pid $$$$"])],
        check=True, timeout=60, capture_output=True,
    )  # fmt: skip


def matches(unit: str) -> list[str]:
    return [f"_SYSTEMD_UNIT={unit}", "+", f"_SYSTEMD_USER_UNIT={unit}"]


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
    logged(u, "echo before")
    _, cursor = systemd.messages(None)  # the unit's own last entry
    assert cursor is not None
    with sdjournal.Poller(matches(u), cursor) as p:
        logged(u, "echo one", "echo two")
        lines = read_until(p, "pid")
    assert [line for line in lines if not line.startswith("pid")] == ["one", "two"]


def test_the_poller_from_no_cursor_reads_the_units_whole_journal(sandbox: Sandbox) -> None:
    u = unit("head")
    logged(u, "echo first")
    with sdjournal.Poller(matches(u), None) as p:
        assert "first" in read_until(p, "first")


def test_the_poller_keeps_only_the_messages_its_pattern_matches(sandbox: Sandbox) -> None:
    u = unit("grep")
    systemd = Systemd(u, "user")
    with sdjournal.Poller(matches(u), systemd.cursor(), grep=r"ke(ep)") as p:
        logged(u, "echo drop", "echo keep me", "echo dropped too", "echo keep")
        lines = read_until(p, "keep")
        lines += p.read(0.5)
    assert lines == ["keep me", "keep"]


def test_the_poller_leaves_out_the_lines_of_the_process_it_skips(sandbox: Sandbox) -> None:
    # two starts of one unit, as a restart's: the first process's lines are left out
    u = unit("skip")
    cursor = Systemd(u, "user").cursor()
    logged(u, "echo from the first")
    logged(u, "echo from the second")
    with sdjournal.Poller(matches(u), cursor) as p:
        both = read_until(p, "from the second")
    first = int(both[1].split()[-1])  # the first start's "pid N"
    with sdjournal.Poller(matches(u), cursor, skip_pid=first) as p:
        kept = read_until(p, "from the second")
    assert both[0] == "from the first" and kept[0] == "from the second"


def test_a_journal_the_poller_cannot_open_is_followed_with_journalctl(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # libsystemd missing or refusing cannot be made here: its error is passed in
    def unavailable(*args: object, **kw: object) -> None:
        raise sdjournal.Unavailable("libsystemd.so.0 cannot be loaded: (passed in by the test)")

    monkeypatch.setattr(sdjournal, "Poller", unavailable)
    u = unit("fallback")
    systemd = Systemd(u, "user")
    with systemd.follow(systemd.cursor()) as follower:
        assert isinstance(follower, JournalFollower)
        logged(u, "echo through journalctl")
        assert "through journalctl" in read_until(follower, "through journalctl")


def test_the_poller_reads_on_in_the_file_journald_rotates_to(sandbox: Sandbox) -> None:
    u = unit("rotate")
    with sdjournal.Poller(matches(u), Systemd(u, "user").cursor()) as p:
        subprocess.run(["journalctl", "--rotate"], check=True, timeout=60, capture_output=True)
        logged(u, "echo in the new file")
        assert "in the new file" in read_until(p, "in the new file")
