"""The env file: render assignments and parse them strictly, standard library only.

The unit's ``EnvironmentFile=``, bash ``source`` (the seed's launcher) and this module must
all read the same value from every line. The parser accepts only what all three read
alike: blank lines, ``#`` comments and ``KEY=value`` assignments whose value is built from
plain characters, single-quoted runs and double-quoted runs (with the backslash escapes
bash and systemd share: ``\\" \\\\ \\` \\$``). Anything bash would *do* rather than
*assign* - expansion, command substitution, a command after an assignment - is refused
with the line number and what bash would have done.

This module sits on the ExecStart path (``launcher.launch``): keep it standard-library only.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Characters that bash and systemd read the same way outside quotes.
_PLAIN = re.compile(r"[A-Za-z0-9_./:,+=@%^-]")
# Escapes that bash and systemd both honour inside double quotes.
_DQ_ESCAPABLE = '"\\`$'
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

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
        super().__init__(f"{path}:{lineno}: {reason}\n    {line}")


@dataclass(frozen=True)
class _Cursor:
    path: str
    lineno: int
    line: str

    def fail(self, reason: str) -> EnvFileError:
        return EnvFileError(self.path, self.lineno, self.line, reason)


def check_value(name: str, value: str) -> None:
    """Refuse values that no env file can carry unchanged (control characters)."""
    bad = _CONTROL.search(value)
    if bad:
        raise ValueError(
            f"{name}: the value contains the control character {bad.group()!r} at position "
            f"{bad.start()}; env files cannot carry it safely - remove it"
        )


def quote_value(value: str) -> str:
    """Quote one value so bash, systemd's EnvironmentFile= and ``parse`` read it back unchanged."""
    check_value("value", value)
    out = "".join("\\" + ch if ch in _DQ_ESCAPABLE else ch for ch in value)
    return f'"{out}"'


def render_assignments(values: Mapping[str, str], header: Iterable[str] = ()) -> str:
    """Render ``KEY="value"`` lines (in the given order) behind ``#`` header lines."""
    lines = [f"# {h}" if h else "#" for h in header]
    for key, value in values.items():
        if not _KEY.fullmatch(key):
            raise ValueError(f"{key!r} is not a valid variable name; use letters, digits and _")
        try:
            check_value(key, value)
        except ValueError as e:
            raise ValueError(str(e)) from None
        lines.append(f"{key}={quote_value(value)}")
    return "\n".join(lines) + "\n"


def _parse_value(cur: _Cursor, text: str) -> str:
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise cur.fail("unterminated single quote: bash would wait for more input")
            out.append(text[i + 1 : end])
            i = end + 1
        elif ch == '"':
            i += 1
            while True:
                if i >= n:
                    raise cur.fail("unterminated double quote: bash would wait for more input")
                c = text[i]
                if c == '"':
                    i += 1
                    break
                if c == "\\" and i + 1 < n and text[i + 1] in _DQ_ESCAPABLE:
                    out.append(text[i + 1])
                    i += 2
                    continue
                if c == "\\":
                    raise cur.fail(
                        "a backslash inside double quotes that is not one of \\\" \\\\ \\` \\$ "
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
        elif ch in " \t":
            rest = text[i:].strip()
            if rest and not rest.startswith("#"):
                word = rest.split()[0]
                raise cur.fail(
                    f"unquoted space: bash would set the variable only for one command and "
                    f"then run {word!r} as a command (exit 127 if it does not exist); "
                    f'quote the whole value: KEY="..."'
                )
            break
        elif ch == "$":
            raise cur.fail(
                "'$': bash would expand a variable or run a command substitution here; "
                "quote it with single quotes or write \\$ inside double quotes"
            )
        elif ch == "`":
            raise cur.fail("a backtick: bash would run a command substitution here")
        elif ch == "\\":
            raise cur.fail(
                "a backslash outside quotes: bash and systemd read it differently; "
                "quote the value"
            )
        elif ch in ";&|<>()":
            raise cur.fail(
                f"{ch!r} outside quotes: bash would treat it as shell syntax "
                "(a command separator, pipe or redirection); quote the value"
            )
        elif not _PLAIN.match(ch):
            raise cur.fail(
                f"{ch!r} outside quotes: bash may expand or reinterpret it (globbing, tilde or "
                "history); quote the value"
            )
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def parse(text: str, path: str = "<env>") -> dict[str, str]:
    """Parse env file text strictly; return the assignments in file order.

    Raises ``EnvFileError`` naming the line and what bash would have done with it.
    """
    result: dict[str, str] = {}
    for lineno, raw in enumerate(text.split("\n"), start=1):
        cur = _Cursor(path, lineno, raw)
        if "\r" in raw:
            raise cur.fail("a carriage return (CRLF line ending): save the file with LF endings")
        line = raw.strip(" \t")
        if not line or line.startswith("#"):
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
        if value.endswith("\\") and not value.endswith("\\\\"):
            raise cur.fail("a trailing backslash continues the line in systemd; remove it")
        parsed = _parse_value(cur, value)
        bad = _CONTROL.search(parsed)
        if bad:
            raise cur.fail(f"the value contains the control character {bad.group()!r}")
        result[key] = parsed
    return result


def split_words(value: str, name: str = "EXTRA_ARGS") -> list[str]:
    """Split a value into words with shell-word rules, as systemd splits an unquoted ``$VAR``."""
    try:
        return shlex.split(value, comments=False, posix=True)
    except ValueError as e:
        raise ValueError(f"{name}: cannot split into words ({e}); check its quotes") from None


def join_words(words: Iterable[str]) -> str:
    """Inverse of ``split_words``: quote each word so the split returns exactly these words."""
    return shlex.join(words)
