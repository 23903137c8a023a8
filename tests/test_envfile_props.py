"""Property tests: whatever the value, the env file means the same to every reader.

Three readers: the strict parser (+ ``split_words``) in-process, real bash
(``env -i bash -c 'set -f; source FILE'``, and ``bash -n FILE``) and a real systemd 252
(``EnvironmentFile=FILE`` in a transient unit of the sandboxed manager). Each property draws
a *list* of values per example and checks them in-process at once (so hypothesis shrinks any
failure there). Spawning bash 2,000 times costs half a minute on two busy cores, so the values
every example accepted are collected and read by the real readers at the end, many variables
(V0, V1, ...) to one file: one ``bash -n`` + ``source`` and one transient unit per batch of up
to 2,000 values. A mismatch there names the value. A value the renderer refuses must be
refused with a message that starts with the field's name, and only for a reason restated
independently in ``payloads.safe_to_render``.

Run inside the sandbox: ``scripts/sandbox run -- python -m pytest tests/test_envfile_props.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from payloads import bash_values, batches, safe_to_render, systemd_read

from launcher.host import envfile

settings.register_profile(
    "envfile-props",
    max_examples=2_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
PROPS = settings.get_profile("envfile-props")

# Characters and runs the shells and systemd treat specially, mixed into arbitrary unicode.
SPECIAL = [
    *" \t\n\r'\"\\$`;&|<>(){}[]*?~#!%=:,@^-",
    "\x00", "\x01", "\x1b", "\x7f", "\x85", "\u2028", "\u00a0", "\u3000", "\ufeff",
    "\ufffe", "\uffff", "\ufdd0", "\U0010ffff", "\udc80",
    "＄", "＂", "＇", "é", "😀", "$(", "${", "$((", "'\"'\"'", "\\\\", "\\\"", "\\$", "\\`",
    "$(touch CANARY)", "--api-key", "%h", "$$",
]  # fmt: skip
FRAGMENT = st.one_of(st.characters(codec="utf-8"), st.sampled_from(SPECIAL))
TEXT = st.one_of(st.text(), st.lists(FRAGMENT, max_size=24).map("".join))
WORDS = st.lists(TEXT, max_size=6)


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def _check_readers(
    cwd: Path, items: list[tuple[str, list[str]]], ref: Callable[[str], str]
) -> None:
    """Render every (value, words) as V0..Vn, a few files of many variables; then ``bash -n``
    passes, bash ``source`` gives each value byte for byte, and systemd's ExecStart expands
    ``ref(name)`` to exactly the words."""
    mismatches: list[str] = []
    for run in batches([len(v.encode()) * 2 + 64 for v, _ in items]):
        chunk = [items[i] for i in run]
        names = [f"V{i}" for i in range(len(chunk))]
        values = [v for v, _ in chunk]
        env_file = _write(
            cwd / "batch.env", envfile.render_assignments(dict(zip(names, values, strict=True)))
        )
        from_bash = bash_values(env_file, names, cwd, syntax_check=True)
        from_systemd = systemd_read(env_file, [ref(n) for n in names], cwd)
        for (value, words), in_bash, in_systemd in zip(chunk, from_bash, from_systemd, strict=True):
            if in_bash != value.encode():
                mismatches.append(f"value {value!r}: bash read {in_bash!r}")
            if in_systemd != [w.encode() for w in words]:
                mismatches.append(f"value {value!r}: systemd read {in_systemd!r}, not {words!r}")
    assert not mismatches, f"{len(mismatches)} of {len(items)} differ:\n" + "\n".join(
        mismatches[:10]
    )


def test_any_value_round_trips_through_parse_bash_and_systemd(
    sandbox: object, tmp_path: Path
) -> None:
    """render_assignments refuses a value naming its field, or all three read it unchanged
    (systemd through ``${V}``: one argument, exactly the value)."""
    accepted: list[str] = []
    examples = [0]

    @PROPS
    @given(st.lists(TEXT, min_size=1, max_size=8))
    @example(["", " ", "a b", "it's", 'say "hi"', "\\", "$HOME", "`x`", "# not a comment"])
    @example(["\ufffe", "a\nb", "x\r", "\x00", "\udc80"])
    def prop(values: list[str]) -> None:
        examples[0] += 1
        ok: list[str] = []
        for value in values:
            try:
                text = envfile.render_assignments({"EXTRA_ARGS": value})
            except ValueError as e:
                assert str(e).startswith("EXTRA_ARGS: "), e
                assert not safe_to_render(value), f"refused a safe value {value!r}: {e}"
                continue
            assert safe_to_render(value), f"rendered an unsafe value {value!r}"
            assert envfile.parse(text) == {"EXTRA_ARGS": value}
            ok.append(value)
        names = [f"V{i}" for i in range(len(ok))]
        text = envfile.render_assignments(dict(zip(names, ok, strict=True)))
        assert envfile.parse(text) == dict(zip(names, ok, strict=True))
        accepted.extend(ok)

    prop()
    assert examples[0] >= 2_000
    assert len(accepted) > 1_000, "the strategy hardly produces renderable values"
    _check_readers(tmp_path, [(v, [v]) for v in accepted], lambda n: "${" + n + "}")


def test_any_words_round_trip_through_split_bash_and_systemd(
    sandbox: object, tmp_path: Path
) -> None:
    """For any words, render_assignments({"EXTRA_ARGS": join_words(words)}) refuses naming
    EXTRA_ARGS, or: parse + split_words gives the words, bash gives the joined value byte
    for byte (and ``bash -n`` passes), and systemd's unquoted ``$EXTRA_ARGS`` gives the words."""
    accepted: list[tuple[str, list[str]]] = []
    examples = [0]

    @PROPS
    @given(st.lists(WORDS, min_size=1, max_size=5))
    @example([["a\\b"], ["'a\\b'"], ["", ""], ["it's", 'say "hi"'], ['\\"', "\\'"]])
    @example([["--alias", "my model", "--chat-template-kwargs", '{"enable_thinking":false}']])
    def prop(word_lists: list[list[str]]) -> None:
        examples[0] += 1
        ok: list[tuple[str, list[str]]] = []
        for words in word_lists:
            value = envfile.join_words(words)
            assert envfile.split_words(value) == words
            assert envfile.systemd_split(value) == words
            try:
                text = envfile.render_assignments({"EXTRA_ARGS": value})
            except ValueError as e:
                assert str(e).startswith("EXTRA_ARGS: "), e
                assert not safe_to_render(value), f"refused safe words {words!r}: {e}"
                continue
            assert envfile.split_words(envfile.parse(text)["EXTRA_ARGS"]) == words
            ok.append((value, words))
        accepted.extend(ok)

    prop()
    assert examples[0] >= 2_000
    assert len(accepted) > 1_000, "the strategy hardly produces renderable words"
    _check_readers(tmp_path, accepted, lambda n: "$" + n)


# -- hand-written files: what the strict parser accepts, bash and systemd read alike --------

PLAIN = st.text(alphabet="abcXYZ019_./:,+=@%^-", min_size=1, max_size=4)
SQ_BODY = st.lists(st.sampled_from([*'ab #;$`"\\\t', "é", "\\\\"]), max_size=6).map("".join)
DQ_PIECE = st.sampled_from(
    [*"ab #;'", "é", '\\"', "\\\\", "\\$", "\\`", "\\a", "\\n", "$", "`", "\\", "\t"]
)
TOKEN = st.one_of(
    PLAIN,
    SQ_BODY.map(lambda s: f"'{s}'"),
    st.lists(DQ_PIECE, max_size=6).map(lambda p: '"' + "".join(p) + '"'),
    st.sampled_from([" ", "  # c", " # c \\", "\t", "\\", "$x", "'", '"', "~", "*", "\r", "a b"]),
)
VALUE = st.lists(TOKEN, max_size=5).map("".join)
# Lines that are no assignment: comments (some end in backslashes), blanks and a command.
OTHER = st.sampled_from(
    ["# note", "# note \\", "# note \\\\", "# \\\\\\", "", "  ", "\t# x", "# a'b\"", "ls -l"]
)
LINES = st.lists(
    st.one_of(st.tuples(st.just(True), VALUE), st.tuples(st.just(False), OTHER)),
    min_size=1,
    max_size=6,
)


def test_what_the_parser_accepts_bash_and_systemd_read_alike(
    sandbox: object, tmp_path: Path
) -> None:
    """Raw files built from quoted runs, escapes, comments and blanks: whenever ``parse``
    accepts one, bash and systemd read exactly the parsed values."""
    accepted: list[tuple[str, list[str]]] = []
    tried = [0]

    @PROPS
    @given(LINES)
    @example([(True, "a'b'"), (True, "abc  # c")])
    @example([(False, "# note \\"), (True, "x")])
    def prop(lines: list[tuple[bool, str]]) -> None:
        rendered, names = [], []
        for i, (assign, body) in enumerate(lines):
            if assign:
                names.append(f"K{i}")
                rendered.append(f"K{i}={body}")
            else:
                rendered.append(body)
        text = "\n".join(rendered) + "\n"
        tried[0] += 1
        try:
            values = envfile.parse(text)
        except envfile.EnvFileError as e:
            assert 1 <= e.lineno <= len(lines)
            return
        assert list(values) == names
        accepted.append((text, names))

    prop()
    assert tried[0] >= 2_000
    assert len(accepted) > 300, f"only {len(accepted)} of {tried[0]} files were accepted"
    mismatches: list[str] = []
    for run in batches([len(t) * 2 + 64 for t, _ in accepted]):
        # Accepted files, concatenated with their keys renamed: one bash and one unit a batch.
        parts, names, expected = [], [], []
        for j in run:
            text, keys = accepted[j]
            values = envfile.parse(text)
            for key in keys:
                text = text.replace(f"{key}=", f"F{j}_{key}=", 1)
                names.append(f"F{j}_{key}")
                expected.append(values[key])
            parts.append(text)
        env_file = _write(tmp_path / "raw-batch.env", "".join(parts))
        assert list(envfile.parse("".join(parts)).values()) == expected
        from_bash = bash_values(env_file, names, tmp_path, syntax_check=True)
        from_systemd = systemd_read(env_file, ["${" + n + "}" for n in names], tmp_path)
        for name, want, in_bash, in_systemd in zip(
            names, expected, from_bash, from_systemd, strict=True
        ):
            if in_bash != want.encode() or in_systemd != [want.encode()]:
                mismatches.append(f"{name}: parse {want!r} bash {in_bash!r} systemd {in_systemd!r}")
    assert not mismatches, "\n".join(mismatches[:10])


@pytest.mark.parametrize("value", ["", " ", "x"])
def test_systemd_gives_an_empty_value_one_argument_and_no_words(
    sandbox: object, tmp_path: Path, value: str
) -> None:
    """``${V}`` is always exactly one argument; ``$V`` splits into shlex's words (none for
    blank values). The property tests rely on both."""
    env_file = _write(tmp_path / "v.env", envfile.render_assignments({"V": value}))
    assert systemd_read(env_file, ["${V}", "$V"], tmp_path) == [
        [value.encode()],
        [w.encode() for w in envfile.split_words(value)],
    ]
