"""The subprocess chokepoint (launcher.host.proc, through sh) on real commands: argv, the given
environment, the timeout and the one error type."""

from __future__ import annotations

import os

import pytest

from launcher.errors import CommandError, CommandTimeout
from launcher.host import proc


def test_argv_words_reach_the_command_unsplit_and_unexpanded() -> None:
    words = ["a b", "$HOME", "*", "'q'", ""]
    r = proc.run(["printf", "%s\\n", *words])
    assert r.stdout.split("\n")[:-1] == words


def test_the_given_environment_replaces_the_callers() -> None:
    r = proc.run(["env"], env={"PATH": os.environ["PATH"], "ONLY": "this"})
    assert sorted(r.stdout.splitlines()) == sorted([f"PATH={os.environ['PATH']}", "ONLY=this"])


def test_input_reaches_stdin_and_no_input_is_an_empty_stdin() -> None:
    assert proc.run(["cat"], input="fed").stdout == "fed"
    assert proc.run(["cat"]).stdout == ""


def test_a_command_past_its_timeout_is_killed_and_named() -> None:
    with pytest.raises(CommandTimeout) as e:
        proc.run(["sleep", "30"], timeout=0.3)
    assert e.value.argv == ["sleep", "30"]
    assert "timed out after 0.3s" in str(e.value)


def test_a_failing_command_names_itself_its_status_and_its_stderr() -> None:
    with pytest.raises(CommandError) as e:
        proc.run(["bash", "-c", "echo the reason >&2; exit 3"])
    assert (e.value.argv[0], e.value.status) == ("bash", 3)
    assert "the reason" in str(e.value)
    assert proc.run(["bash", "-c", "exit 3"], check=False).status == 3


def test_a_missing_command_is_a_command_error() -> None:
    with pytest.raises(CommandError) as e:
        proc.run(["no-such-command-here"])
    assert e.value.argv == ["no-such-command-here"]
    assert "No such file or directory" in str(e.value)
