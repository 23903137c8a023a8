"""Shell-injection payloads, and the three real readers of an env file that must agree on them.

Every payload that runs something does so with ``touch CANARY`` or ``>CANARY`` relative to the
working directory, so a test runs each reader in a fresh folder and checks that no ``CANARY``
appeared. ``arms`` lists the raw forms in which ``bash`` really runs the payload when an
attacker writes it straight into the file (``EXTRA_ARGS=P``, ``EXTRA_ARGS="P"``,
``EXTRA_ARGS='P'``); the tests check that too, so the list cannot go stale or toothless.

The readers: real ``bash`` (``env -i bash -c 'set -f; source FILE'``), the real launcher
(``python -m launcher exec --env-file FILE --print-argv``) and a real systemd 252 manager
(a transient unit with ``EnvironmentFile=FILE`` that prints its ExecStart arguments).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CANARY = "CANARY"
#: systemd's transient units cannot carry an argv over ARG_MAX (argv and environment
#: together, about 2 MiB): the readers split bigger batches.
BATCH_BYTES = 400_000

UNQUOTED, DOUBLE, SINGLE = "unquoted", "double", "single"
RAW_FORMS = (UNQUOTED, DOUBLE, SINGLE)


@dataclass(frozen=True)
class Payload:
    """One hostile value. ``arms``: the raw forms in which bash ``source`` runs it."""

    text: str
    why: str
    arms: frozenset[str] = frozenset()

    def raw_line(self, form: str, key: str = "EXTRA_ARGS") -> str:
        """The payload as an attacker would write it into the file, unescaped."""
        quote = {UNQUOTED: "", DOUBLE: '"', SINGLE: "'"}[form]
        return f"{key}={quote}{self.text}{quote}"


def _p(text: str, why: str, *arms: str) -> Payload:
    return Payload(text, why, frozenset(arms))


ALL = (UNQUOTED, DOUBLE, SINGLE)
UD = (UNQUOTED, DOUBLE)

PAYLOADS: tuple[Payload, ...] = (
    # command substitution and separators
    _p("$(touch CANARY)", "command substitution", *UD),
    _p("`touch CANARY`", "backtick command substitution", *UD),
    _p("x; touch CANARY", "command separator", UNQUOTED),
    _p(";touch CANARY", "separator at the start", UNQUOTED),
    _p("x && touch CANARY", "and-list", UNQUOTED),
    _p("x false || touch CANARY", "or-list after a failing command", UNQUOTED),
    _p("x | touch CANARY", "pipe", UNQUOTED),
    _p("x & touch CANARY", "background job", UNQUOTED),
    _p("x touch CANARY", "command after the assignment (the seed's shape)", UNQUOTED),
    _p("a=b touch CANARY", "assignment prefix, then a command", UNQUOTED),
    _p("--kv-unified-per-slot 262144 -ctk q8_0 -ctv q8_0", "the seed's unquoted value"),
    _p("x\ntouch CANARY", "newline: a second line runs", UNQUOTED),
    _p("x\r\ntouch CANARY", "CRLF then a command", UNQUOTED),
    _p("x\rtouch CANARY", "a lone CR"),
    _p("x\ttouch CANARY", "tab as a separator", UNQUOTED),
    _p("x\u2028touch CANARY", "U+2028 LINE SEPARATOR: a Python line break, not a shell one"),
    _p("x\u0085touch CANARY", "U+0085 NEXT LINE"),
    # redirections and process substitution
    _p(">CANARY", "output redirection creates the file", UNQUOTED),
    _p("x >> CANARY", "append redirection", UNQUOTED),
    _p("x 2>CANARY", "stderr redirection", UNQUOTED),
    _p("$(>CANARY)", "redirection inside command substitution", *UD),
    _p("<(touch CANARY)", "process substitution", UNQUOTED),
    _p("x >(touch CANARY)", "output process substitution", UNQUOTED),
    # quote breakouts
    _p('"; touch CANARY; "', "double-quote breakout", DOUBLE),
    _p("'; touch CANARY; '", "single-quote breakout", SINGLE),
    _p("'$(touch CANARY)'", "single quotes around a substitution", DOUBLE, SINGLE),
    _p('"$(touch CANARY)"', "double quotes around a substitution", *UD),
    _p('\\"; touch CANARY; \\"', "escaped quotes", UNQUOTED),
    _p("\\'; touch CANARY; \\'", "backslash before a single quote", UNQUOTED),
    _p("' --api-key 'secret", "word-level breakout: smuggle a flag"),
    _p('" --api-key "secret', "word-level breakout with double quotes"),
    _p("'", "a lone single quote"),
    _p('"', "a lone double quote"),
    _p("'\"'\"'", "shlex.quote's own escape sequence"),
    # expansions that do not run a command but change the value
    _p("$HOME", "parameter expansion"),
    _p("${HOME}", "braced parameter expansion"),
    _p("${NOPE:?$(touch CANARY)}", "error-message expansion runs a command", *UD),
    _p("${NOPE:-$(touch CANARY)}", "default-value expansion runs a command", *UD),
    _p("${NOPE:=x}", "assigning expansion"),
    _p("$((1+1))", "arithmetic expansion"),
    _p("$'\\x41'", "ANSI-C quoting"),
    _p('$"x"', "locale quoting"),
    _p("$$ $! $? $0 $@ $* $#", "special parameters"),
    _p("$EXTRA_ARGS", "self reference"),
    _p("$(touch${IFS}CANARY)", "substitution without spaces", *UD),
    _p("\\$(touch CANARY)", "escaped dollar"),
    _p("\\\\$(touch CANARY)", "escaped backslash, live dollar", *UD),
    # globs, tilde, braces, history, comments
    _p("*", "glob"),
    _p("/*", "absolute glob"),
    _p("[a-z]*", "bracket glob"),
    _p("?", "single-character glob"),
    _p("~", "tilde"),
    _p("~root/x", "user tilde"),
    _p("a:~/x", "tilde after a colon in an assignment"),
    _p("{a,b}", "brace expansion"),
    _p("!!", "history expansion"),
    _p("#", "a comment character"),
    _p("x # touch CANARY", "an inline comment"),
    # backslashes
    _p("\\", "a lone backslash (line continuation)"),
    _p("a\\\\b", "two backslashes"),
    _p("a\\b", "backslash in a word: systemd drops it inside quotes"),
    _p("x\\", "trailing backslash"),
    # systemd-specific
    _p("$$FOO", "systemd's literal dollar"),
    _p("%h %u %%", "unit-file specifiers"),
    _p("%n%s%x", "printf conversions"),
    # unicode look-alikes and odd code points
    _p("＄(touch CANARY)", "fullwidth dollar"),
    _p("＂; touch CANARY; ＂", "fullwidth quotation marks", UNQUOTED),
    _p("｀touch CANARY｀", "fullwidth grave accents"),
    _p("x；touch CANARY", "fullwidth semicolon"),
    _p("\u202etouch CANARY", "right-to-left override"),
    _p("a\u200bb", "zero-width space"),
    _p("e\u0301", "combining accent"),
    _p("模型 😀", "CJK and a 4-byte emoji"),
    _p("\u00a0--api-key", "no-break space is not a separator"),
    _p("a\ufffeb", "noncharacter: systemd refuses the whole file"),
    _p("\ufdd0", "noncharacter U+FDD0"),
    # control characters
    _p("a\x00b", "NUL"),
    _p("a\x1b[31mred", "ANSI escape"),
    _p("a\x7fb", "DEL"),
    # size
    _p("A" * 100_000, "100 KB value"),
    _p("A" * 100_000 + " $(touch CANARY)", "a substitution behind 100 KB", *UD),
    _p("B" * 200_000, "200 KB: longer than execve accepts for one variable"),
)


def safe_to_render(text: str, key: str = "EXTRA_ARGS") -> bool:
    """Whether an env file can carry ``text`` at all (the renderer's refusal rule, restated
    independently: control characters, surrogates, noncharacters, execve's size limit)."""
    for ch in text:
        o = ord(ch)
        if o < 0x20 or 0x7F <= o <= 0x9F or 0xD800 <= o <= 0xDFFF:
            return False
        if 0xFDD0 <= o <= 0xFDEF or (o & 0xFFFE) == 0xFFFE:
            return False
    return len(key) + 1 + len(text.encode()) <= 131_071


# -- the readers --------------------------------------------------------------------------

_BASH_READ = 'set -f; source "$1"; shift; for n; do printf "%s\\0" "${!n}"; done'
# The same after ``bash -n FILE`` (the seed's check) in one spawn: the properties run it per
# example.
_BASH_CHECK_READ = 'bash -n "$1" || exit 96; ' + _BASH_READ


def bash_read(
    env_file: Path, names: Sequence[str], cwd: Path, *, syntax_check: bool = False
) -> subprocess.CompletedProcess[bytes]:
    """``env -i bash -c 'set -f; source FILE'`` in ``cwd``, then each name's value, NUL-ended.

    With ``syntax_check``, ``bash -n FILE`` runs first and its failure exits 96.
    """
    script = _BASH_CHECK_READ if syntax_check else _BASH_READ
    return subprocess.run(
        ["env", "-i", "bash", "-c", script, "bash", str(env_file.resolve()), *names],
        cwd=cwd,
        capture_output=True,
        timeout=60,
        check=False,
    )


def bash_values(
    env_file: Path, names: Sequence[str], cwd: Path, *, syntax_check: bool = False
) -> list[bytes]:
    """The values bash reads; fails on any output to stderr (an error or a command's noise)."""
    r = bash_read(env_file, names, cwd, syntax_check=syntax_check)
    assert r.returncode == 0 and r.stderr == b"", (r.returncode, r.stderr[-2000:])
    values = r.stdout.split(b"\0")
    assert values[-1] == b"", r.stdout[-200:]
    return values[:-1]


def bash_syntax(env_file: Path, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    """``bash -n FILE``: the seed's pre-restart check."""
    return subprocess.run(
        ["bash", "-n", str(env_file.resolve())],
        cwd=cwd,
        capture_output=True,
        timeout=60,
        check=False,
    )


def launcher(
    env_file: Path, cwd: Path, *, print_argv: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real ExecStart: ``python -m launcher exec --env-file FILE [--print-argv]``."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "launcher", "exec", "--env-file", str(env_file.resolve())]
    return subprocess.run(
        args + (["--print-argv"] if print_argv else []),
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def launcher_argv(env_file: Path, cwd: Path) -> list[str]:
    """The argv the launcher would exec; fails with its stderr if it refuses."""
    r = launcher(env_file, cwd)
    assert r.returncode == 0, (r.returncode, r.stderr)
    argv = json.loads(r.stdout)
    assert isinstance(argv, list)
    return [str(w) for w in argv]


def systemd_exec(
    env_file: Path, args: Sequence[str], cwd: Path
) -> tuple[subprocess.CompletedProcess[str], bytes | None]:
    """Run ``/usr/bin/printf '%s\\0' ARGS...`` in a transient unit of the sandboxed manager
    with ``EnvironmentFile=env_file`` and ``WorkingDirectory=cwd``.

    Returns systemd-run's result and what the unit printed (None if it never started).
    ``Type=oneshot`` makes systemd-run return when the process has exited; no D-Bus needed.
    """
    out = cwd / f".systemd-out-{uuid.uuid4().hex}"
    r = subprocess.run(
        [
            "systemd-run", "--user", "--quiet", "--collect",
            "-p", "Type=oneshot",
            "-p", f"EnvironmentFile={env_file.resolve()}",
            "-p", f"WorkingDirectory={cwd.resolve()}",
            "-p", f"StandardOutput=file:{out}",
            "/usr/bin/printf", "%s\\0", *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    printed = out.read_bytes() if out.exists() else None
    out.unlink(missing_ok=True)
    return r, printed


def systemd_read(env_file: Path, refs: Sequence[str], cwd: Path) -> list[list[bytes]]:
    """Expand each ``$NAME`` / ``${NAME}`` in ``refs`` the way systemd execs ExecStart.

    One transient unit: ``ExecStart=/usr/bin/printf '%s\\0' M0 ref0 M1 ref1 ...`` (the markers
    are control characters no accepted value contains). Returns the words each reference
    became, as bytes. Fails if the unit fails (systemd refused the file or the exec).
    """
    markers = [f"\x01{i}" for i in range(len(refs))]
    args = [w for pair in zip(markers, refs, strict=True) for w in pair]
    r, printed = systemd_exec(env_file, args, cwd)
    assert r.returncode == 0 and printed is not None, (
        f"the transient unit failed ({r.returncode}): {r.stderr}"
    )
    tokens = printed.split(b"\0")
    assert tokens[-1] == b""
    groups: list[list[bytes]] = []
    for token in tokens[:-1]:
        if len(groups) < len(markers) and token == markers[len(groups)].encode():
            groups.append([])
        else:
            assert groups, f"output before the first marker: {token[:100]!r}"
            groups[-1].append(token)
    assert len(groups) == len(refs), (len(groups), len(refs))
    return groups


def batches(sizes: Sequence[int], limit: int = BATCH_BYTES, count: int = 2_000) -> list[range]:
    """Split item indices into runs whose sizes stay under ``limit`` and ``count``."""
    runs: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and (total + size > limit or i - start >= count):
            runs.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs
