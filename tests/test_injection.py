"""Shell-injection payloads against the renderer, the strict parser and the three real readers.

Rendered through the tool (an alias word inside EXTRA_ARGS, and the whole API_KEY_FILE value),
every payload is refused with a message naming the field, or it executes nothing - no
``CANARY`` file after bash ``source``, ``bash -n``, the launcher's ``--print-argv`` or a systemd
transient unit - and the argv read back equals the intended words exactly.

Written raw into the file (an attacker's edit), every payload that bash really runs is refused
by the strict parser, the launcher exits 78 without creating the canary, and bash ``source``
of the same file does create it: the payloads are live.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from payloads import (
    CANARY,
    PAYLOADS,
    RAW_FORMS,
    Payload,
    bash_read,
    bash_syntax,
    batches,
    launcher,
    safe_to_render,
    systemd_read,
)

from launcher.host import envfile

SERVER = "/opt/llama/bin/llama-server"
IDS = [f"{i:02d}-{p.why}" for i, p in enumerate(PAYLOADS)]


def _words(p: Payload) -> list[str]:
    return ["--alias", p.text, "-c", "4096"]


def _render(p: Payload) -> str:
    return envfile.render_assignments(
        {
            "LLAMA_SERVER": SERVER,
            "EXTRA_ARGS": envfile.join_words(_words(p)),
            "API_KEY_FILE": p.text,
        }
    )


def _fresh(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return folder


def _no_canary(folder: Path, after: str) -> None:
    assert not (folder / CANARY).exists(), f"the payload ran a command during {after}"


def test_the_payload_list_is_curated() -> None:
    texts = [p.text for p in PAYLOADS]
    assert len(PAYLOADS) >= 50
    assert len(set(texts)) == len(texts)
    for needle in ["$(", "`", ";", "&&", "|", "\n", "'", '"', "\\", "*", "~", "$HOME", "${",
                   "$((", "<(", "＄", "＂", "\x00", "\r"]:  # fmt: skip
        assert any(needle in t for t in texts), needle
    assert any(len(t.encode()) >= 100_000 for t in texts)
    assert sum(1 for p in PAYLOADS if p.arms) >= 20, "too few payloads that really run something"


@pytest.mark.parametrize("p", PAYLOADS, ids=IDS)
def test_a_rendered_payload_is_refused_or_inert(tmp_path: Path, p: Payload) -> None:
    try:
        text = _render(p)
    except ValueError as e:
        assert str(e).startswith("EXTRA_ARGS: "), e
        assert not safe_to_render(p.text), f"a safe payload was refused: {e}"
        return
    assert safe_to_render(p.text)
    env_file = tmp_path / "llama.env"
    env_file.write_bytes(text.encode())
    expected = [SERVER, *_words(p), "--log-colors", "off", "--api-key-file", p.text]

    values = envfile.parse(text)
    assert values["API_KEY_FILE"] == p.text
    assert envfile.split_words(values["EXTRA_ARGS"]) == _words(p)

    syntax_dir = _fresh(tmp_path, "bash-n")
    syntax = bash_syntax(env_file, syntax_dir)
    assert (syntax.returncode, syntax.stderr) == (0, b"")
    _no_canary(syntax_dir, "bash -n")

    bash_dir = _fresh(tmp_path, "bash")
    read = bash_read(env_file, ["EXTRA_ARGS", "API_KEY_FILE"], bash_dir)
    assert (read.returncode, read.stderr) == (0, b"")
    assert read.stdout.split(b"\0")[:-1] == [values["EXTRA_ARGS"].encode(), p.text.encode()]
    _no_canary(bash_dir, "bash source")

    launcher_dir = _fresh(tmp_path, "launcher")
    r = launcher(env_file, launcher_dir)
    assert (r.returncode, r.stderr) == (0, "")
    assert json.loads(r.stdout) == expected
    _no_canary(launcher_dir, "the launcher's --print-argv")


def test_rendered_payloads_are_inert_under_systemd(sandbox: object, tmp_path: Path) -> None:
    """All renderable payloads in a few transient units: ``$E{i}`` expands to exactly the
    intended words, ``${A{i}}`` to exactly the payload, and the unit runs nothing else."""
    rendered = [p for p in PAYLOADS if safe_to_render(p.text)]
    assert len(rendered) >= 50
    unit_dir = _fresh(tmp_path, "systemd")
    for run in batches([len(p.text.encode()) * 4 + 64 for p in rendered], count=500):
        values: dict[str, str] = {}
        refs: list[str] = []
        for i in run:
            values[f"E{i}"] = envfile.join_words(_words(rendered[i]))
            values[f"A{i}"] = rendered[i].text
            refs += [f"$E{i}", f"${{A{i}}}"]
        env_file = tmp_path / "payloads.env"
        env_file.write_bytes(envfile.render_assignments(values).encode())
        got = systemd_read(env_file, refs, unit_dir)
        for k, i in enumerate(run):
            words = [w.encode() for w in _words(rendered[i])]
            assert got[2 * k] == words, rendered[i].why
            assert got[2 * k + 1] == [rendered[i].text.encode()], rendered[i].why
        _no_canary(unit_dir, "the systemd transient unit")


RAW_CASES = [(p, form) for p in PAYLOADS for form in RAW_FORMS]
RAW_IDS = [f"{i // len(RAW_FORMS):02d}-{form}-{p.why}" for i, (p, form) in enumerate(RAW_CASES)]


@pytest.mark.parametrize(("p", "form"), RAW_CASES, ids=RAW_IDS)
def test_a_raw_payload_is_refused_or_read_alike(tmp_path: Path, p: Payload, form: str) -> None:
    """An attacker-edited file: live payloads are refused by the parser and the launcher
    (exit 78, no canary); bash ``source`` of the same file proves them live."""
    text = f"LLAMA_SERVER={SERVER}\n{p.raw_line(form)}\n"
    env_file = tmp_path / "llama.env"
    env_file.write_bytes(text.encode("utf-8", "surrogatepass"))

    launcher_dir = _fresh(tmp_path, "launcher")
    r = launcher(env_file, launcher_dir)
    _no_canary(launcher_dir, "the launcher")
    try:
        value = envfile.parse(text, str(env_file))["EXTRA_ARGS"]
    except envfile.EnvFileError as e:
        assert e.lineno >= 2
        assert r.returncode == 78, r
        assert r.stderr.startswith(f"llama-launcher: config error: {env_file}:{e.lineno}: ")
        value = None
    assert value is None or form not in p.arms, "the parser accepted a live payload"

    syntax_dir = _fresh(tmp_path, "bash-n")
    bash_syntax(env_file, syntax_dir)
    _no_canary(syntax_dir, "bash -n")

    bash_dir = _fresh(tmp_path, "bash")
    read = bash_read(env_file, ["EXTRA_ARGS"], bash_dir)
    assert (bash_dir / CANARY).exists() == (form in p.arms), "the payload's arms are stale"
    if value is not None:
        assert read.stdout == value.encode() + b"\0", "bash reads an accepted line differently"
        if r.returncode == 0:
            assert json.loads(r.stdout)[1:-2] == envfile.split_words(value)
        else:
            assert r.returncode == 78 and "EXTRA_ARGS" in r.stderr
