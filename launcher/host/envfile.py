"""The env file: render assignments and parse them strictly, standard library only.

The unit's ``EnvironmentFile=``, bash ``source`` (a launcher script) and this module must
all read the same value from every line. The parser accepts only what all three read
alike: blank lines, ``#`` comments and ``KEY=value`` assignments whose value is built from
plain characters, single-quoted runs and double-quoted runs (with the backslash escapes
bash and systemd share: ``\\" \\\\ \\` \\$``). Anything bash would *do* rather than
*assign* - expansion, command substitution, a command after an assignment - is refused
with the line number and what bash would have done. So is what systemd 252 reads apart from
bash although bash runs nothing: a quote after unquoted characters (systemd keeps it), a
comment after a value (systemd keeps it), a comment ending in a backslash (systemd swallows
the next line), CR, control characters and the code points systemd refuses as UTF-8.

``split_words`` splits EXTRA_ARGS the way systemd splits an unquoted ``$EXTRA_ARGS`` in
``ExecStart=`` and refuses values the two splitters would read apart; ``join_words`` only
writes quoting that both read alike.

This module sits on the ExecStart path (``launcher.host.launch``): keep it standard-library only.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Characters that bash and systemd read the same way outside quotes.
_PLAIN = re.compile(r"[A-Za-z0-9_./:,+=@%^-]")
# Escapes that bash and systemd both honour inside double quotes.
_DQ_ESCAPABLE = '"\\`$'
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Code points Python can hold but systemd's utf8_is_valid() (src/basic/utf8.c, 252) refuses:
# UTF-16 surrogates and the Unicode noncharacters. One of them anywhere in a value makes
# EnvironmentFile= fail to load, and the unit fails with Result=resources.
_NONCHAR = re.compile(
    "[\ud800-\udfff\ufdd0-\ufdef"
    + "".join(chr(plane << 16 | 0xFFFE) + chr(plane << 16 | 0xFFFF) for plane in range(17))
    + "]"
)
#: The longest ``NAME=value`` string a process can receive: systemd passes every variable
#: to execve(), and Linux refuses a single string over MAX_ARG_STRLEN (32 pages, with its NUL).
MAX_ASSIGNMENT_BYTES = 32 * 4096 - 1
# systemd's WHITESPACE, which replace_env_argv() (src/core/execute.c) splits $VAR at.
_SD_WHITESPACE = " \t\n\r"
# What shlex.quote() leaves unquoted.
_SHLEX_SAFE = re.compile(r"[\w@%+=:,./-]+", re.ASCII)

#: Exit status of ``llama-launcher exec`` for a configuration error of its own (EX_CONFIG,
#: sysexits.h). The units list it in ``RestartPreventExitStatus=`` so a bad file never loops.
EX_CONFIG = 78


class EnvFileError(ValueError):
    """An env file line that the strict parser refuses. Carries the line number."""

    def __init__(self, path: str, lineno: int, line: str, reason: str) -> None:
        self.path = path
        self.lineno = lineno
        self.line = line
        self.reason = reason
        shown = line if len(line) <= 200 else line[:200] + f"... ({len(line):,} characters)"
        super().__init__(f"{path}:{lineno}: {reason}\n    {shown}")


class _Cursor:
    """Where the parser is. A plain class: ``dataclasses`` costs milliseconds to import,
    and this module is on the path of every server start."""

    __slots__ = ("line", "lineno", "path")

    def __init__(self, path: str, lineno: int, line: str) -> None:
        self.path, self.lineno, self.line = path, lineno, line

    def fail(self, reason: str) -> EnvFileError:
        return EnvFileError(self.path, self.lineno, self.line, reason)


def _describe(ch: str) -> str:
    if _CONTROL.match(ch):
        return f"the control character {ch!r}"
    return f"the code point U+{ord(ch):04X}, which systemd refuses as invalid UTF-8"


def _shorten(value: str, limit: int = 60) -> str:
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."


def check_value(name: str, value: str) -> None:
    """Refuse values that no env file can carry unchanged to bash, systemd and ``parse``.

    Refused: control characters (they break lines, or bash and systemd read them apart),
    surrogates and Unicode noncharacters (systemd fails the whole ``EnvironmentFile=``), and
    ``NAME=value`` strings longer than ``MAX_ASSIGNMENT_BYTES`` (execve() fails with E2BIG).
    The message starts with ``name``.
    """
    bad = _CONTROL.search(value) or _NONCHAR.search(value)
    if bad:
        raise ValueError(
            f"{name}: the value contains {_describe(bad.group())} at position "
            f"{bad.start()}; env files cannot carry it safely - remove it"
        )
    size = len(name) + 1 + len(value.encode())
    if size > MAX_ASSIGNMENT_BYTES:
        raise ValueError(
            f"{name}: the value {_shorten(value)} is {len(value.encode())} bytes; a variable "
            f"of more than {MAX_ASSIGNMENT_BYTES} bytes (name, '=' and value) cannot be passed "
            "to a process (execve fails with E2BIG) - shorten it or put it in a file"
        )


def quote_value(value: str) -> str:
    """Quote one value so bash, systemd's EnvironmentFile= and ``parse`` read it back unchanged."""
    check_value("value", value)
    out = "".join("\\" + ch if ch in _DQ_ESCAPABLE else ch for ch in value)
    return f'"{out}"'


def render_assignments(values: Mapping[str, str], header: Iterable[str] = ()) -> str:
    """Render ``KEY="value"`` lines (in the given order) behind ``#`` header lines."""
    lines = []
    for h in header:
        bad = _CONTROL.search(h) or _NONCHAR.search(h)
        if bad:
            raise ValueError(f"header line {h!r}: contains {_describe(bad.group())}")
        if h.endswith("\\"):
            # systemd's comment state treats a backslash as an escape, newline included.
            raise ValueError(
                f"header line {h!r} ends with a backslash: systemd would read the next line "
                "as part of this comment"
            )
        lines.append(f"# {h}" if h else "#")
    for key, value in values.items():
        if not _KEY.fullmatch(key):
            raise ValueError(f"{key!r} is not a valid variable name; use letters, digits and _")
        try:
            check_value(key, value)
        except ValueError as e:
            raise ValueError(str(e)) from None
        lines.append(f"{key}={quote_value(value)}")
    return "\n".join(lines) + "\n"


def _parse_double_quoted(cur: _Cursor, text: str, i: int, out: list[str]) -> int:
    """Read a double-quoted run starting after its opening quote; return the index after it."""
    n = len(text)
    while True:
        if i >= n:
            raise cur.fail("unterminated double quote: bash would wait for more input")
        c = text[i]
        if c == '"':
            return i + 1
        if c == "\\" and i + 1 < n and text[i + 1] in _DQ_ESCAPABLE:
            out.append(text[i + 1])
            i += 2
            continue
        if c == "\\":
            raise cur.fail(
                'a backslash inside double quotes that is not one of \\" \\\\ \\` \\$ '
                "(bash and systemd disagree on it)"
            )
        if c == "$":
            raise cur.fail(
                "'$' inside double quotes: bash would expand a variable or run a "
                "command here; write \\$ for a literal dollar sign"
            )
        if c == "`":
            raise cur.fail(
                "a backtick inside double quotes: bash would run a command here; "
                "write \\` for a literal backtick"
            )
        out.append(c)
        i += 1


def _after_value(cur: _Cursor, rest: str) -> None:
    """Refuse anything but blanks after the value: bash and systemd read it differently."""
    rest = rest.strip(" \t")
    if rest.startswith("#"):
        raise cur.fail(
            f"a comment after the value: bash ignores it, but systemd keeps {rest!r} as part "
            "of the value; put the comment on a line of its own"
        )
    if rest:
        word = (rest.split() or [rest])[0]  # a space bash splits on but str.strip keeps
        raise cur.fail(
            f"unquoted space: bash would set the variable only for one command and "
            f"then run {_shorten(word)} as a command (exit 127 if it does not exist); "
            f'quote the whole value: KEY="..."'
        )


def _unquoted_refusal(ch: str) -> str | None:
    """Why an unquoted character is refused, or None if bash and systemd read it alike."""
    if ch == "$":
        return (
            "'$': bash would expand a variable or run a command substitution here; "
            "quote it with single quotes or write \\$ inside double quotes"
        )
    if ch == "`":
        return "a backtick: bash would run a command substitution here"
    if ch == "\\":
        return "a backslash outside quotes: bash and systemd read it differently; quote the value"
    if ch in ";&|<>()":
        return (
            f"{ch!r} outside quotes: bash would treat it as shell syntax "
            "(a command separator, pipe or redirection); quote the value"
        )
    if not _PLAIN.match(ch):
        return (
            f"{ch!r} outside quotes: bash may expand or reinterpret it (globbing, tilde or "
            "history); quote the value"
        )
    return None


def _parse_value(cur: _Cursor, text: str) -> str:
    out: list[str] = []
    i, n = 0, len(text)
    unquoted_seen = False
    while i < n:
        ch = text[i]
        if ch in "'\"" and unquoted_seen:
            # systemd's parser (env-file.c) only opens quotes where a value starts or right
            # after a closing quote; once it has read an unquoted character, quotes are data.
            raise cur.fail(
                "a quote after unquoted characters: bash removes it, but systemd keeps it "
                f"as a literal character (it would read {text!r} with the quotes in it); "
                'quote the whole value: KEY="..."'
            )
        if ch == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise cur.fail("unterminated single quote: bash would wait for more input")
            out.append(text[i + 1 : end])
            i = end + 1
        elif ch == '"':
            i = _parse_double_quoted(cur, text, i + 1, out)
        elif ch in " \t":
            _after_value(cur, text[i:])
            break
        else:
            refusal = _unquoted_refusal(ch)
            if refusal:
                raise cur.fail(refusal)
            out.append(ch)
            unquoted_seen = True
            i += 1
    return "".join(out)


def _check_line(cur: _Cursor, raw: str) -> None:
    if "\r" in raw:
        raise cur.fail(
            "a carriage return (CRLF line ending): systemd reads it as a line break, bash "
            "keeps it in the value; save the file with LF endings"
        )
    bad = _CONTROL.search(raw.replace("\t", " ")) or _NONCHAR.search(raw)
    if bad:
        raise cur.fail(
            f"the line contains {_describe(bad.group())} at column {bad.start() + 1}; "
            "bash and systemd read it differently - remove it"
        )


def _ends_in_escape(line: str) -> bool:
    return (len(line) - len(line.rstrip("\\"))) % 2 == 1


def parse(text: str, path: str = "<env>") -> dict[str, str]:
    """Parse env file text strictly; return the assignments in file order.

    Raises ``EnvFileError`` naming the line and what bash would have done with it.
    Read the file with ``newline=""``: universal newlines would hide a CR from this parser.
    """
    result: dict[str, str] = {}
    for lineno, raw in enumerate(text.split("\n"), start=1):
        cur = _Cursor(path, lineno, raw)
        _check_line(cur, raw)
        line = raw.strip(" \t")
        if not line:
            continue
        if line.startswith("#"):
            if _ends_in_escape(raw):
                # In systemd's comment state a backslash escapes the next character, newline too.
                raise cur.fail(
                    f"a comment ending in a backslash: systemd would treat line {lineno + 1} "
                    "as part of this comment and skip it, bash would read it; remove the "
                    "backslash"
                )
            continue
        key, eq, value = line.partition("=")
        if not eq:
            raise cur.fail(
                "not an assignment: bash would run this line as a command; "
                "only KEY=value lines, comments and blank lines are allowed"
            )
        if not _KEY.fullmatch(key):
            raise cur.fail(
                f"{key!r} is not a variable name (bash would run it as a command); "
                "use KEY=value with letters, digits and _"
            )
        parsed = _parse_value(cur, value)
        try:
            check_value(key, parsed)
        except ValueError as e:
            raise cur.fail(str(e)) from None
        result[key] = parsed
    return result


def systemd_split(value: str) -> list[str]:
    """Split ``value`` as systemd 252 splits an unquoted ``$VAR`` in ``ExecStart=``.

    A port of ``extract_first_word(EXTRACT_RELAX|EXTRACT_UNQUOTE)`` at systemd's whitespace
    (``replace_env_argv()``): quotes group and are removed, and a backslash - inside single
    or double quotes too - is dropped and the next character kept. Unlike a shell, an
    unterminated quote or a trailing backslash is accepted (EXTRACT_RELAX).
    """
    words: list[str] = []
    i, n = 0, len(value)
    while True:
        while i < n and value[i] in _SD_WHITESPACE:
            i += 1
        if i >= n:
            return words
        word: list[str] = []
        quote = ""
        while i < n:
            c = value[i]
            i += 1
            if c == "\\":
                if i < n:
                    word.append(value[i])
                    i += 1
            elif quote:
                if c == quote:
                    quote = ""
                else:
                    word.append(c)
            elif c in "'\"":
                quote = c
            elif c in _SD_WHITESPACE:
                break
            else:
                word.append(c)
        words.append("".join(word))


def split_words(value: str, name: str = "EXTRA_ARGS") -> list[str]:
    """Split a value into words with shell-word rules, exactly as systemd splits ``$VAR``.

    Refuses a value that ``shlex`` and systemd's ``ExecStart=`` expansion would split into
    different words (a backslash inside quotes), naming the word.
    """
    try:
        words = shlex.split(value, comments=False, posix=True)
    except ValueError as e:
        raise ValueError(f"{name}: cannot split into words ({e}); check its quotes") from None
    theirs = systemd_split(value)
    if words != theirs:
        at = next(
            (k for k, (a, b) in enumerate(zip(words, theirs, strict=False)) if a != b),
            min(len(words), len(theirs)),
        )
        ours = words[at] if at < len(words) else "(nothing)"
        sd = theirs[at] if at < len(theirs) else "(nothing)"
        raise ValueError(
            f"{name}: word {at + 1} reads as {ours!r} here but as {sd!r} in systemd's "
            "$VAR expansion (it drops every backslash, inside quotes too); write a word "
            'with a backslash in double quotes with \\\\ and \\" escaped'
        )
    return words


def _quote_word(word: str) -> str:
    if _SHLEX_SAFE.fullmatch(word):
        return word
    if "\\" not in word:
        return shlex.quote(word)
    # Inside single quotes systemd drops a backslash and shlex keeps it; inside double quotes
    # both read \\ and \" alike (and leave every other character as it is).
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def join_words(words: Iterable[str]) -> str:
    """Inverse of ``split_words``: quote each word so that both ``split_words`` and systemd's
    ``$VAR`` expansion return exactly these words."""
    return " ".join(_quote_word(w) for w in words)


_NUMBER = re.compile(r"-\d+(\.\d+)?")


def is_flag(word: str) -> bool:
    """Whether an argv word is a flag (``-c``, ``--port=8080``) rather than a value; a
    negative number (``-1``, ``-0.5``) is a value. The one rule for grouping argv."""
    return word.startswith("-") and not _NUMBER.fullmatch(word)
