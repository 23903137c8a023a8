"""Between flags, the typed config, its argv and its env file.

``from_flags`` reads llama-server's own spellings (``-c``/``--ctx-size``, ``-np``/
``--parallel``, ...) into a ``ServerConfig`` (``launcher.config.server``), unknown flags kept
as ``extra_args``; ``remove_flags`` is ``unset``'s edit; ``argv_diff`` what a deploy changes.
``render_env`` is the env file a config deploys as: ``LLAMA_SERVER``, ``EXTRA_ARGS`` (the
argv, quoted so bash ``source``, systemd's ``EnvironmentFile=`` and the launcher read the
same words) and ``API_KEY_FILE``; the file's format, its quoting and its strict parse, is
``launcher.host.envfile``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from launcher.config.server import (
    FLAGS,
    SPELLING,
    ServerConfig,
    config_error,
    example,
    group_flags,
    merge_extra,
)
from launcher.config.vllm import VllmConfig
from launcher.config.vllm import build as vllm_build
from launcher.config.vllm import from_flags as vllm_flags
from launcher.config.vllm import remove_flags as vllm_remove
from launcher.errors import ConfigInvalid
from launcher.host import envfile
from launcher.server import binary


def _int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigInvalid(f"{flag} {value!r} is not a whole number; e.g. {flag} 4096") from None


_INT_FIELDS = {
    "ctx_size",
    "parallel",
    "kv_unified_per_slot",
    "threads",
    "batch_size",
    "ubatch_size",
    "cache_ram",
    "port",
}


def parse_flags(tokens: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Turn llama-server style flags into config fields; unknown flags go to the extra list.

    Accepts ``--flag value`` and ``--flag=value``. Returns ``(fields, extra)``. A bare word
    right after a typed flag and its value (``-a coder model``: an alias the shell split) is
    refused (``binary.stray_words`` by the typed flags' arity): llama-server would exit on
    it. After an unknown flag it goes to the extra list (the flag may take it); the
    validation's ``flags`` step judges it by the binary's ``--help``.
    """
    for stray in binary.stray_words(_typed_arity, list(tokens), _typed):
        raise ConfigInvalid(stray.message())
    fields: dict[str, Any] = {}
    extra: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        name, eq, inline = tok.partition("=")
        if name == "--allow-overcommit":  # the tool's own switch, never llama-server's
            fields["allow_overcommit"] = True
            i += 1
            continue
        flag = SPELLING.get(name)
        if flag is None:
            extra.append(tok)
            i += 1
            continue
        if flag.kind == "switch":
            fields[flag.field] = True
            i += 1
        elif flag.kind == "bool":
            fields[flag.field] = name not in flag.negative
            i += 1
        else:
            if eq:
                value, i = inline, i + 1
            elif i + 1 < len(tokens):
                value, i = tokens[i + 1], i + 2
            else:
                raise ConfigInvalid(f"{name} needs a value, e.g. {name} {example(flag.field)}")
            fields[flag.field] = _int(name, value) if flag.field in _INT_FIELDS else value
    return fields, extra


def _typed(name: str) -> bool:
    """A flag of the typed config (or the tool's own switch): its arity is known here."""
    return name == "--allow-overcommit" or name in SPELLING


def _typed_arity(name: str) -> int:
    flag = SPELLING.get(name)
    return 1 if flag is not None and flag.kind == "value" else 0


def build(data: dict[str, Any]) -> ServerConfig:
    """Validate ``data`` into a ``ServerConfig``, raising ``ConfigInvalid``."""
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as e:
        raise config_error(e) from None


def from_flags(tokens: Sequence[str], base: dict[str, Any] | None = None) -> ServerConfig:
    """A config from llama-server style flags on top of ``base`` (e.g. the live config)."""
    fields, extra = parse_flags(tokens)
    data = dict(base or {})
    data.update(fields)
    if extra:
        data["extra_args"] = merge_extra(tuple(data.get("extra_args", ())), extra)
    return build(data)


def of(data: dict[str, Any]) -> ServerConfig | VllmConfig:
    """The typed config of a unit's recorded config, whichever its backend (``backend``:
    ``vllm`` for a vLLM unit, none for llama-server)."""
    if data.get("backend") == "vllm":
        return vllm_build(data)
    return build(data)


def onto(tokens: Sequence[str], base: dict[str, Any]) -> ServerConfig | VllmConfig:
    """``from_flags`` for either backend: a vLLM unit's live config takes vLLM's flags."""
    if base.get("backend") == "vllm":
        return vllm_flags(tokens, base)
    return from_flags(tokens, base)


def without(data: dict[str, Any], names: Sequence[str]) -> ServerConfig | VllmConfig:
    """``unset`` for either backend."""
    if data.get("backend") == "vllm":
        return vllm_build(vllm_remove(data, names))
    return build(remove_flags(data, names))


def remove_flags(data: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``unset``: drop typed fields by any spelling, or extra flags by name."""
    data = dict(data)
    extra = group_flags(list(data.get("extra_args", ())))
    for name in names:
        flag = SPELLING.get(name)
        if flag is not None:
            if flag.field in ("llama_server", "model"):
                raise ConfigInvalid(f"{name} cannot be unset: the server needs a model")
            data.pop(flag.field, None)
            continue
        if name in ("allow_overcommit", "--allow-overcommit"):
            data.pop("allow_overcommit", None)
            continue
        if not any(n == name for n, _ in extra):
            known = sorted({f.canonical for f in FLAGS} | {n for n, _ in extra})
            raise ConfigInvalid(
                f"{name} is not set in the live config; set flags are: {' '.join(known)}"
            )
        extra = [(n, w) for n, w in extra if n != name]
    data["extra_args"] = tuple(w for _, ws in extra for w in ws)
    return data


def argv_lines(argv: list[str]) -> list[str]:
    """One flag and its values per line (values quoted as the env file would)."""
    out: list[str] = []
    for word in argv:
        if envfile.is_flag(word) or not out:
            out.append(word)
        else:
            out[-1] += " " + envfile.join_words([word])
    return out


def argv_diff(old: list[str], new: list[str]) -> list[str]:
    """A readable diff of two argvs, one flag per line."""
    import difflib

    diff = difflib.unified_diff(argv_lines(old), argv_lines(new), "live", "new", lineterm="", n=0)
    return [d for d in diff if not d.startswith("@@")]


def env_values(cfg: ServerConfig | VllmConfig, key_file: str | None = None) -> dict[str, str]:
    """The env file's variables for ``cfg``, in file order."""
    if isinstance(cfg, VllmConfig):
        return cfg.env_values(key_file)
    values = {
        "LLAMA_SERVER": str(cfg.llama_server),
        "EXTRA_ARGS": envfile.join_words(cfg.server_args()),
    }
    key = key_file or (str(cfg.api_key_file) if cfg.api_key_file else None)
    if key:
        values["API_KEY_FILE"] = key
    return values


HEADER = (
    "llama-server settings, rendered by llama-launcher.",
    "Change them with `llama-launcher set ...` or `deploy`;",
    "a hand edit is kept as a generation and replaced on the next deploy.",
    "Values are quoted so bash `source`, systemd EnvironmentFile= and the launcher read the same.",
)


def render_env(cfg: ServerConfig | VllmConfig, key_file: str | None = None) -> str:
    """The env file text for ``cfg``: pure and deterministic."""
    try:
        return envfile.render_assignments(env_values(cfg, key_file), HEADER)
    except ValueError as e:
        raise ConfigInvalid(str(e)) from None
