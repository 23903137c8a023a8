"""The env file: the strict parser's case tables, the renderer, and why each refusal exists.

The last section runs the real readers (bash, and a transient unit of the sandboxed systemd
252): every accepted form reads the same in both, and every construct the parser refuses
although bash runs nothing really is read differently by systemd.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from payloads import bash_values, systemd_exec, systemd_read

from launcher.host import envfile

# -- accepted forms -------------------------------------------------------------------------

ACCEPTED: list[tuple[str, dict[str, str]]] = [
    ("", {}),
    ("\n\n", {}),
    ("# a comment\n", {}),
    ("  \t# an indented comment with $(x) and 'quotes\n", {}),
    ("# ends in two backslashes \\\\\nK=1\n", {"K": "1"}),
    ("K=\n", {"K": ""}),
    ('K=""\n', {"K": ""}),
    ("K=''\n", {"K": ""}),
    ("K=plain-./:,+=@%^_09\n", {"K": "plain-./:,+=@%^_09"}),
    ("K=a=b\n", {"K": "a=b"}),
    ('K="a b"\n', {"K": "a b"}),
    ("K='a b'\n", {"K": "a b"}),
    ("K='a'\"b\"\n", {"K": "ab"}),
    ('K="a"\'b\'"c"\n', {"K": "abc"}),
    ('K="x"y\n', {"K": "xy"}),
    ("K=''x\n", {"K": "x"}),
    ('K="\\" \\\\ \\` \\$"\n', {"K": '" \\ ` $'}),
    ("K='$HOME `x` \\'\n", {"K": "$HOME `x` \\"}),
    ("K='a\\b'\n", {"K": "a\\b"}),
    ('K="it\'s"\n', {"K": "it's"}),
    ("K='say \"hi\"'\n", {"K": 'say "hi"'}),
    ('K="# not a comment"\n', {"K": "# not a comment"}),
    ('K="a;b|c&d>e<f(g)*?~!{x}"\n', {"K": "a;b|c&d>e<f(g)*?~!{x}"}),
    ('K="é 模型 😀 \u00a0"\n', {"K": "é 模型 😀 \u00a0"}),
    ("K=v   \n", {"K": "v"}),
    ('K="v"\t\n', {"K": "v"}),
    ("  K=v\n", {"K": "v"}),
    ("K=1\nK=2\n", {"K": "2"}),
    ("_k9=x\nA=1\nB=2\n", {"_k9": "x", "A": "1", "B": "2"}),
    ('K="no final newline"', {"K": "no final newline"}),
]


@pytest.mark.parametrize(("text", "expected"), ACCEPTED)
def test_parse_accepts(text: str, expected: dict[str, str]) -> None:
    assert envfile.parse(text) == expected


# -- refused forms --------------------------------------------------------------------------

REFUSED: list[tuple[str, int, str]] = [
    ("K=$X", 1, "bash would expand a variable"),
    ("K=${X}", 1, "bash would expand a variable"),
    ('K="$X"', 1, "'$' inside double quotes: bash would expand"),
    ('K="a$(id)"', 1, "bash would expand a variable or run a command"),
    ("K=`id`", 1, "a backtick: bash would run a command substitution"),
    ('K="`id`"', 1, "backtick inside double quotes: bash would run a command"),
    ("K=a b", 1, "then run 'b' as a command"),
    ("K= a", 1, "then run 'a' as a command"),
    ('K="a" b', 1, "then run 'b' as a command"),
    ("ls -l", 1, "not an assignment: bash would run this line as a command"),
    ("K =v", 1, "'K ' is not a variable name"),
    ("9K=v", 1, "'9K' is not a variable name"),
    ("K-1=v", 1, "'K-1' is not a variable name"),
    ("export K=v", 1, "'export K' is not a variable name"),
    ('K="a', 1, "unterminated double quote: bash would wait for more input"),
    ("K='a", 1, "unterminated single quote: bash would wait for more input"),
    ("K='a\nb'", 1, "unterminated single quote"),
    ('K="a\\b"', 1, "backslash inside double quotes that is not one of"),
    ('K="a\\\nb"', 1, "backslash inside double quotes"),
    ("K=a\\b", 1, "a backslash outside quotes"),
    ("K=a\\", 1, "a backslash outside quotes"),
    ("K=a;b", 1, "';' outside quotes: bash would treat it as shell syntax"),
    ("K=a&b", 1, "'&' outside quotes"),
    ("K=a|b", 1, "'|' outside quotes"),
    ("K=a>b", 1, "'>' outside quotes"),
    ("K=(a)", 1, "'(' outside quotes"),
    ("K=*", 1, "'*' outside quotes: bash may expand"),
    ("K=~", 1, "'~' outside quotes: bash may expand or reinterpret it (globbing, tilde"),
    ("K=!x", 1, "'!' outside quotes"),
    ("K=a#b", 1, "'#' outside quotes"),
    ("K=é", 1, "'é' outside quotes"),
    ("K=a'b'", 1, "a quote after unquoted characters: bash removes it, but systemd keeps it"),
    ('K="a"x"b"', 1, "a quote after unquoted characters"),
    ("K=abc # c", 1, "a comment after the value: bash ignores it, but systemd keeps '# c'"),
    ('K="abc" #c', 1, "a comment after the value"),
    ("# c \\\nK=1", 1, "systemd would treat line 2 as part of this comment"),
    ("# c \\\\\\\nK=1", 1, "comment ending in a backslash"),
    ('A=1\n\nK="a"\r', 3, "a carriage return (CRLF line ending): systemd reads it as a line"),
    ('K="a"\rB=1', 1, "a carriage return"),
    ('K="a\tb"', 1, "K: the value contains the control character '\\t'"),
    ('K="a\x1bb"', 1, "the control character '\\x1b'"),
    ("# \x00 in a comment", 1, "the control character '\\x00'"),
    ('K="\x85"', 1, "the control character '\\x85'"),
    ('K="\ufdd0"', 1, "the code point U+FDD0, which systemd refuses as invalid UTF-8"),
    ('K="\U0010ffff"', 1, "U+10FFFF"),
    ('K="' + "x" * 131_070 + '"', 1, "K: the value 'xxxx"),
    ("A=1\nB=2\nC=$x", 3, "'$'"),
    ('K="a" \u00a0', 1, "unquoted space: bash would set the variable only for one command"),
    ("K= \u3000", 1, "then run '\\u3000' as a command"),
]


@pytest.mark.parametrize(("text", "lineno", "says"), REFUSED)
def test_parse_refuses(text: str, lineno: int, says: str) -> None:
    with pytest.raises(envfile.EnvFileError) as e:
        envfile.parse(text, "f.env")
    assert e.value.lineno == lineno
    assert str(e.value).startswith(f"f.env:{lineno}: ")
    assert says in e.value.reason


def test_a_huge_refused_line_is_not_echoed_whole() -> None:
    line = 'K="a" ' + "b" * 1_000_000
    with pytest.raises(envfile.EnvFileError) as e:
        envfile.parse(line, "f.env")
    assert len(str(e.value)) < 1_000 and "(1,000,006 characters)" in str(e.value)


def test_the_seeds_line_is_refused_with_what_bash_did() -> None:
    line = "EXTRA_ARGS=--kv-unified-per-slot 262144 -ctk q8_0 -ctv q8_0"
    with pytest.raises(envfile.EnvFileError) as e:
        envfile.parse(f"LLAMA_SERVER=/x\n{line}\n", "llama.env")
    assert e.value.lineno == 2 and e.value.line == line
    assert "run '262144' as a command (exit 127" in str(e.value)
    assert str(e.value).endswith(f"\n    {line}")


# -- rendering --------------------------------------------------------------------------------

QUOTED = [
    ("", '""'),
    ("a b", '"a b"'),
    ('"', '"\\""'),
    ("\\", '"\\\\"'),
    ("$HOME `id`", '"\\$HOME \\`id\\`"'),
    ("it's", '"it\'s"'),
    ("é😀", '"é😀"'),
]


@pytest.mark.parametrize(("value", "quoted"), QUOTED)
def test_quote_value(value: str, quoted: str) -> None:
    assert envfile.quote_value(value) == quoted
    assert envfile.parse(f"K={quoted}") == {"K": value}


def test_render_assignments_keeps_order_and_header() -> None:
    text = envfile.render_assignments(
        {"LLAMA_SERVER": "/opt/llama-server", "EXTRA_ARGS": "-c 4096 --alias 'a b'"},
        header=["generated by llama-launcher", ""],
    )
    assert text == (
        "# generated by llama-launcher\n#\n"
        'LLAMA_SERVER="/opt/llama-server"\n'
        "EXTRA_ARGS=\"-c 4096 --alias 'a b'\"\n"
    )
    assert envfile.parse(text) == {
        "LLAMA_SERVER": "/opt/llama-server",
        "EXTRA_ARGS": "-c 4096 --alias 'a b'",
    }


@pytest.mark.parametrize(
    ("header", "says"),
    [
        ("line one\nEXTRA_ARGS=--injected", "control character '\\n'"),
        ("a\rb", "control character '\\r'"),
        ("ends in \\", "ends with a backslash: systemd would read the next line"),
    ],
)
def test_render_refuses_header_lines_that_leak_into_the_next_line(header: str, says: str) -> None:
    with pytest.raises(ValueError, match=r"^header line ") as e:
        envfile.render_assignments({"K": "v"}, header=[header])
    assert says in str(e.value)


@pytest.mark.parametrize("key", ["", "9A", "A-B", "A B", "A=B", "É"])
def test_render_refuses_bad_keys(key: str) -> None:
    with pytest.raises(ValueError, match="is not a valid variable name"):
        envfile.render_assignments({key: "v"})


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("a\nb", "the control character '\\n' at position 1"),
        ("\x00", "the control character '\\x00' at position 0"),
        ("\t", "control character '\\t'"),
        ("ok\x7f", "control character '\\x7f' at position 2"),
        ("a\ufffeb", "the code point U+FFFE, which systemd refuses as invalid UTF-8"),
        ("\udc80", "U+DC80"),
        ("\U0001ffff", "U+1FFFF"),
        ("x" * 131_061, "bytes; a variable of more than 131071 bytes"),
    ],
)
def test_render_refuses_values_naming_the_field(value: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        envfile.render_assignments({"EXTRA_ARGS": value})
    assert str(e.value).startswith("EXTRA_ARGS: ")
    assert says in str(e.value)


def test_the_size_limit_is_execves() -> None:
    name = "EXTRA_ARGS"
    fits = "x" * (envfile.MAX_ASSIGNMENT_BYTES - len(name) - 1)
    envfile.check_value(name, fits)
    with pytest.raises(ValueError, match="E2BIG"):
        envfile.check_value(name, fits + "x")
    with pytest.raises(ValueError, match="E2BIG"):
        envfile.check_value(name, fits[:-1] + "é")  # two bytes in UTF-8


# -- words ------------------------------------------------------------------------------------

JOINED = [
    ([], ""),
    (["-c", "4096"], "-c 4096"),
    (["--alias", "my model"], "--alias 'my model'"),
    ([""], "''"),
    (["it's"], "'it'\"'\"'s'"),
    (["$HOME", "`id`"], "'$HOME' '`id`'"),
    (['{"a":1}'], "'{\"a\":1}'"),
    (["a\\b"], '"a\\\\b"'),
    (['a\\"b'], '"a\\\\\\"b"'),
    (["'\\'"], "\"'\\\\'\""),
    (["模型"], "'模型'"),
]


@pytest.mark.parametrize(("words", "joined"), JOINED)
def test_join_words(words: list[str], joined: str) -> None:
    assert envfile.join_words(words) == joined
    assert envfile.split_words(joined) == words
    assert envfile.systemd_split(joined) == words


SYSTEMD_SPLITS = [
    ("a  b\tc", ["a", "b", "c"]),
    ("'a b' \"c d\"", ["a b", "c d"]),
    ("'' \"\" x''", ["", "", "x"]),
    ("'a\\b'", ["ab"]),
    ('"a\\b"', ["ab"]),
    ('"a\\\\b"', ["a\\b"]),
    ('"g\\$h"', ["g$h"]),
    ("m\\ n", ["m n"]),
    ("a\\", ["a"]),
    ("'unterminated", ["unterminated"]),
]


@pytest.mark.parametrize(("value", "words"), SYSTEMD_SPLITS)
def test_systemd_split(value: str, words: list[str]) -> None:
    assert envfile.systemd_split(value) == words


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("--alias 'a b", "EXTRA_ARGS: cannot split into words (No closing quotation)"),
        ("x\\", "EXTRA_ARGS: cannot split into words (No escaped character)"),
        ("--alias 'a\\b'", "word 2 reads as 'a\\\\b' here but as 'ab' in systemd's $VAR"),
        ('"a\\b"', "word 1 reads as 'a\\\\b' here but as 'ab'"),
        ('"\\$x"', "but as '$x' in systemd's"),
    ],
)
def test_split_words_refuses_what_systemd_splits_differently(value: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        envfile.split_words(value)
    assert says in str(e.value)


# -- the real readers: why the parser accepts and refuses what it does ------------------------


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def test_every_accepted_form_reads_the_same_in_bash_and_systemd(
    sandbox: object, tmp_path: Path
) -> None:
    for i, (text, expected) in enumerate(ACCEPTED):
        if not expected:
            continue
        env_file = _write(tmp_path / f"accepted{i}.env", text)
        names = list(expected)
        assert bash_values(env_file, names, tmp_path, syntax_check=True) == [
            expected[n].encode() for n in names
        ], text
        assert systemd_read(env_file, ["${" + n + "}" for n in names], tmp_path) == [
            [expected[n].encode()] for n in names
        ], text


# (file text, what bash reads for K, what systemd reads for K): all refused by parse.
DIVERGENT: list[tuple[str, bytes, bytes]] = [
    ("K=a'b'\n", b"ab", b"a'b'"),
    ("K='a'x'b'\n", b"axb", b"ax'b'"),
    ("K=abc   # c\n", b"abc", b"abc   # c"),
    ('K="abc" # c\n', b"abc", b"abc# c"),
    ("# c \\\nK=x\n", b"x", b""),
    ('K="a"\r\n', b"a\r", b"a"),
    ('K="a\\nb"\n', b"a\\nb", b"a\\nb"),  # agree, but the parser refuses the unknown escape
]


@pytest.mark.parametrize(("text", "in_bash", "in_systemd"), DIVERGENT)
def test_refused_forms_are_read_differently(
    sandbox: object, tmp_path: Path, text: str, in_bash: bytes, in_systemd: bytes
) -> None:
    with pytest.raises(envfile.EnvFileError):
        envfile.parse(text)
    env_file = _write(tmp_path / "k.env", text)
    assert bash_values(env_file, ["K"], tmp_path) == [in_bash]
    assert systemd_read(env_file, ["${K}"], tmp_path) == [[in_systemd]]


@pytest.mark.parametrize(
    ("value", "shlex_words", "systemd_words"),
    [
        ("'a\\b'", [b"a\\b"], [b"ab"]),
        ('"a\\b"', [b"a\\b"], [b"ab"]),
        ('"\\$x"', [b"\\$x"], [b"$x"]),
        ("a\\", None, [b"a"]),
    ],
)
def test_words_split_words_refuses_are_split_differently_by_systemd(
    sandbox: object,
    tmp_path: Path,
    value: str,
    shlex_words: list[bytes] | None,
    systemd_words: list[bytes],
) -> None:
    import shlex

    with pytest.raises(ValueError):
        envfile.split_words(value)
    if shlex_words is not None:
        assert [w.encode() for w in shlex.split(value)] == shlex_words
    assert [w.encode() for w in envfile.systemd_split(value)] == systemd_words
    env_file = _write(tmp_path / "w.env", envfile.render_assignments({"V": value}))
    assert systemd_read(env_file, ["$V"], tmp_path) == [systemd_words]


@pytest.mark.parametrize("value", ["a\ufffeb", "\ufdd0", "\U0010ffff"])
def test_systemd_fails_the_unit_on_a_noncharacter(
    sandbox: object, tmp_path: Path, value: str
) -> None:
    """systemd 252's utf8_is_valid() refuses noncharacters: the whole EnvironmentFile= fails
    to load and the unit never starts (Result=resources). Bash reads them fine."""
    env_file = _write(tmp_path / "n.env", f'K="{value}"\nOTHER="fine"\n')
    assert bash_values(env_file, ["K"], tmp_path) == [value.encode()]
    result, printed = systemd_exec(env_file, ["${OTHER}"], tmp_path)
    assert result.returncode != 0 and printed is None


def test_systemd_cannot_exec_with_a_variable_over_the_limit(
    sandbox: object, tmp_path: Path
) -> None:
    """execve() refuses an environment string over 128 KiB: the unit fails at exec."""
    fits = "x" * (envfile.MAX_ASSIGNMENT_BYTES - 2)
    ok, printed = systemd_exec(_write(tmp_path / "ok.env", f'K="{fits}"\n'), ["${K}"], tmp_path)
    assert ok.returncode == 0 and printed == fits.encode() + b"\0"
    big, printed = systemd_exec(_write(tmp_path / "big.env", f'K="{fits}x"\n'), ["${K}"], tmp_path)
    assert big.returncode != 0 and not printed
