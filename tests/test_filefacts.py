"""The per-file caches (llama-server --help, GGUF metadata): a damaged entry is rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.config import validate
from launcher.server import binary


@pytest.mark.parametrize("damage", [{}, {"version": "x", "flags": []}, {"flags": {"--a": 3}}])
def test_a_damaged_help_cache_entry_is_read_again(
    llama_server_bin: str, tmp_path: Path, damage: dict[str, object]
) -> None:
    first = binary.inspect(llama_server_bin, tmp_path)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text(json.dumps(damage))
    again = binary.inspect(llama_server_bin, tmp_path)
    assert "--ctx-size" in again.flags and again.flags.keys() == first.flags.keys()
    assert json.loads(entry.read_text())["version"] == first.version


def test_a_damaged_gguf_cache_entry_is_read_again(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first, _, _ = validate.model_facts(tiny_model)
    (entry,) = (tmp_path / "llama-launcher" / "gguf-meta-v1").glob("*.json")
    entry.write_text(json.dumps({"metadata": [], "weights": "many"}))
    again, _, _ = validate.model_facts(tiny_model)
    assert again == first
