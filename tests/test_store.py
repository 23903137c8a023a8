"""The generation store on its own (no systemd): what a killed deployer can leave in it."""

from __future__ import annotations

from pathlib import Path

from launcher.deploy import store


def test_a_generation_killed_while_being_written_is_not_listed_and_is_replaced(
    tmp_path: Path,
) -> None:
    s = store.Store(tmp_path / "state")
    s.new("A=1\n", {"origin": "first"})
    half = s.gen_dir / ".new-0002"  # what a deployer killed inside new() leaves behind
    half.mkdir()
    (half / "env").write_text("B=2\n")
    assert s.numbers() == [1]
    assert [g.number for g in s.all()] == [1]
    gen = s.new("C=3\n", {"origin": "second"})
    assert (gen.number, s.get(2).env_text, s.get(2).meta["origin"]) == (2, "C=3\n", "second")
    assert not half.exists()
