"""What a deploy verb prints for a person: the outcome first, then only the lines that carry
news; ``-v`` for every line (``launcher.cli.results``). ``--json`` is the result's dict,
untouched by either."""

from __future__ import annotations

from typing import Any

from conftest import Host

from launcher.cli.results import human
from launcher.deploy.outcome import Result
from launcher.reports.status import memory_line

MiB = 1 << 20
PLANNED = {
    "n_slots": 2,
    "n_ctx_slot": 2048,
    "kv_unified": False,
    "pool_cells": 4096,
    "guaranteed_window": 2048,
}
BESIDE = {"fits": True, "why": "both KV pools fit, the host's weights counted once", "sides": []}


def deployed(**fields: Any) -> Result:
    """A result as a plain ``set`` on a unit without a second instance returns it."""
    base: dict[str, Any] = {
        "outcome": "deployed",
        "changed": True,
        "generation": 2,
        "message": "generation 2 is serving: 2 slots x 2048 cells each",
        "planned": dict(PLANNED),
        "startup": {"n_slots": 2, "n_ctx_slot": 2048, "kv_unified": False},
        "probe": {"completion_tokens": 4, "ms": 25.4},
        "memory": {"before": 9 * MiB, "after": 7 * MiB, "beside": dict(BESIDE)},
        "handover": {
            "drain": {"message": "drained: nothing was in flight"},
            "slots": {"saved": [{"slot": 0}], "restored": [{"slot": 0, "tokens": 54}]},
            "stop": {"exited_after": 0.07},
        },
    }
    return Result(**{**base, **fields})


def test_the_outcome_comes_first() -> None:
    assert human(deployed()).splitlines()[0] == (
        "deployed: generation 2 is serving: 2 slots x 2048 cells each"
    )


def test_no_second_instance_line_without_a_second_instance() -> None:
    assert "second instance" not in human(deployed())
    line = "  a second instance beside the running one: fits: both KV pools fit"
    assert line in human(deployed(), second_instance=True)
    assert line in human(deployed(), verbose=True)


def test_four_skipped_slots_are_one_line() -> None:
    why = "KV layout changed: cache_type_k changed (f16 -> q8_0); " + "x" * 150
    skipped = [{"slot": n, "tokens": 100, "reason": why} for n in range(4)]
    result = deployed(handover={"slots": {"saved": skipped, "restored": [], "skipped": skipped}})
    lines = human(result).splitlines()
    assert [line for line in lines if why in line] == [f"    skipped slots 0, 1, 2, 3: {why}"]
    assert "  slots: 4 saved, 0 restored (0 tokens), 4 skipped" in lines
    assert len([line for line in human(result, verbose=True).splitlines() if why in line]) == 4


def test_skipped_slots_for_several_reasons_say_how_many_more() -> None:
    skipped = [{"slot": 0, "reason": "a"}, {"slot": 1, "reason": "b"}, {"slot": 2, "reason": "a"}]
    result = deployed(handover={"slots": {"saved": skipped, "skipped": skipped}})
    assert "    skipped slots 0, 1, 2: a (and 1 other reasons; -v shows each)" in human(result)


def test_a_first_start_shows_no_question_mark_for_the_memory_before() -> None:
    result = deployed(memory={"after": int(24.9 * MiB)})
    assert "  memory of the service: 24.9 MiB" in human(result).splitlines()
    assert "?" not in human(result, verbose=True)
    assert "?" not in memory_line({"after": int(24.9 * MiB)}, None)
    assert "9.0 MiB -> 7.0 MiB" in human(deployed())


def test_the_gates_figures_are_verbose_only_when_they_are_as_planned() -> None:
    plain, full = human(deployed()), human(deployed(), verbose=True)
    for line in ("startup line:", "completion:", "old process:"):
        assert line not in plain and line in full
    other = deployed(startup={"n_slots": 2, "n_ctx_slot": 1024, "kv_unified": False})
    assert "startup line: n_slots = 2, n_ctx_slot = 1024" in human(other)


def test_verbose_changes_no_json() -> None:
    result = deployed()
    before = result.to_dict()
    human(result, verbose=True)
    human(result)
    assert result.to_dict() == before
    assert result.to_dict()["memory"]["beside"] == BESIDE


# -- the real CLI on a plain unit ---------------------------------------------------------------


def test_a_plain_set_prints_at_most_12_lines_and_v_more(host: Host) -> None:
    p = host.cli("install", *host.base_flags(), "-c", "4096", "-np", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "?" not in p.stdout, p.stdout
    p = host.cli("set", "--temp", "0.7")
    assert p.returncode == 0, p.stdout + p.stderr
    plain = (p.stdout + p.stderr).splitlines()
    assert plain[0].startswith("deployed: generation 2 is serving"), plain
    assert len(plain) <= 12, "\n".join(plain)
    assert not any("second instance" in line for line in plain), plain
    p = host.cli("set", "--temp", "0.8", "-v")
    assert p.returncode == 0, p.stdout + p.stderr
    full = (p.stdout + p.stderr).splitlines()
    assert len(full) > len(plain), "\n".join(full)
    assert any("a second instance beside the running one" in line for line in full), full
