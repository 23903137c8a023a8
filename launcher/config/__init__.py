"""The typed config: llama-server flags (``ServerConfig``) and the tool's own settings
(``ToolSettings``), and the way between flags, config, argv and the env file.

``ServerConfig`` is frozen with ``extra="forbid"``. It accepts llama-server's own long and
short spellings in ``from_flags`` (``-c``/``--ctx-size``, ``-np``/``--parallel``, ...), and
renders a deterministic argv and env file. The API key is a secret: it never reaches argv;
llama-server reads it from ``API_KEY_FILE`` (``--api-key-file``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from launcher.errors import ConfigInvalid, OvercommitError
from launcher.host import envfile
from launcher.server import binary, kvlayout


class CacheType(StrEnum):
    """KV cache types llama-server b11434 accepts (common/arg.cpp:304-323)."""

    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"
    q4_0 = "q4_0"
    q4_1 = "q4_1"
    iq4_nl = "iq4_nl"
    q5_0 = "q5_0"
    q5_1 = "q5_1"


class LoadMode(StrEnum):
    """``-lm/--load-mode`` values (common/arg.cpp:2694-2711); it replaced --no-mmap/--mlock."""

    auto = "auto"
    none = "none"
    mmap = "mmap"
    mlock = "mlock"
    mmap_mlock = "mmap+mlock"
    dio = "dio"


OnOffAuto = Literal["on", "off", "auto"]


@dataclass(frozen=True)
class Flag:
    """One typed llama-server flag: the config field and its spellings."""

    field: str
    spellings: tuple[str, ...]  # canonical (rendered) spelling first
    kind: Literal["value", "switch", "bool"]  # switch: flag only; bool: flag / negative flag
    negative: tuple[str, ...] = ()

    @property
    def canonical(self) -> str:
        return self.spellings[0]


#: The typed flags, in render order. Spellings from llama-server b11434 --help (common/arg.cpp).
FLAGS: tuple[Flag, ...] = (
    Flag("model", ("-m", "--model"), "value"),
    Flag("host", ("--host",), "value"),
    Flag("port", ("--port",), "value"),
    Flag("ctx_size", ("-c", "--ctx-size"), "value"),
    Flag("parallel", ("-np", "--parallel"), "value"),
    Flag("kv_unified", ("-kvu", "--kv-unified"), "bool", ("-no-kvu", "--no-kv-unified")),
    Flag("kv_unified_per_slot", ("--kv-unified-per-slot",), "value"),
    Flag("cache_type_k", ("-ctk", "--cache-type-k"), "value"),
    Flag("cache_type_v", ("-ctv", "--cache-type-v"), "value"),
    Flag("flash_attn", ("-fa", "--flash-attn"), "value"),
    Flag("n_gpu_layers", ("-ngl", "--gpu-layers", "--n-gpu-layers"), "value"),
    Flag("threads", ("-t", "--threads"), "value"),
    Flag("batch_size", ("-b", "--batch-size"), "value"),
    Flag("ubatch_size", ("-ub", "--ubatch-size"), "value"),
    Flag("cache_ram", ("-cram", "--cache-ram"), "value"),
    Flag("alias", ("-a", "--alias"), "value"),
    Flag("load_mode", ("-lm", "--load-mode"), "value"),
    Flag("jinja", ("--jinja",), "bool", ("--no-jinja",)),
    Flag("chat_template_file", ("--chat-template-file",), "value"),
    Flag("metrics", ("--metrics",), "switch"),
    Flag("slots", ("--slots",), "bool", ("--no-slots",)),
    Flag("slot_save_path", ("--slot-save-path",), "value"),
)
FLAG_BY_FIELD = {f.field: f for f in FLAGS}
SPELLING = {s: f for f in FLAGS for s in (*f.spellings, *f.negative)}
#: Flags the tool relies on (probe address, KV guarantee, secrets): never through extra_args.
OWNED = {
    "--api-key": "set api_key in a config file (deploy --config FILE); it reaches "
    "llama-server as a 0600 key file",
    "--api-key-file": "set api_key_file in a config file (deploy --config FILE)",
    "--log-colors": "the launcher passes --log-colors off itself",
}


def _hint_choices(value: object, choices: Iterable[str]) -> str:
    return f"{value!r} is not one of {', '.join(choices)}"


class ServerConfig(BaseModel):
    """The llama-server flags operators change, typed. ``None`` means "not passed"."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    llama_server: Path = Field(description="the llama-server binary the unit runs")
    model: Path = Field(description="-m: the GGUF model file")
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    ctx_size: int | None = Field(None, ge=0, description="-c: total KV pool cells")
    parallel: int | None = Field(None, description="-np: slots; -1 = auto (4, unified)")
    kv_unified: bool | None = Field(None, description="-kvu / -no-kvu")
    kv_unified_per_slot: int | None = Field(None, ge=1, description="--kv-unified-per-slot")
    cache_type_k: CacheType | None = None
    cache_type_v: CacheType | None = None
    flash_attn: OnOffAuto | None = None
    n_gpu_layers: str | None = None
    threads: int | None = Field(None, ge=-1)
    batch_size: int | None = Field(None, ge=1)
    ubatch_size: int | None = Field(None, ge=1)
    cache_ram: int | None = Field(None, ge=-1, description="-cram MiB; -1 unlimited, 0 off")
    alias: str | None = None
    load_mode: LoadMode | None = None
    jinja: bool | None = None
    chat_template_file: Path | None = None
    metrics: bool = False
    slots: bool | None = None
    slot_save_path: Path | None = Field(None, description="where slots are saved (handover)")
    api_key_file: Path | None = Field(None, description="file with the API key, one per line")
    api_key: SecretStr | None = Field(None, description="written to a 0600 file, never argv")
    extra_args: tuple[str, ...] = ()
    allow_overcommit: bool = Field(False, description="accept a shared pool that can overflow")

    @field_validator("cache_type_k", "cache_type_v", mode="before")
    @classmethod
    def _cache_type(cls, v: object) -> object:
        if v is None or isinstance(v, CacheType):
            return v
        if str(v) not in CacheType.__members__:
            raise ValueError(
                f"{v!r} is not a KV cache type; use one of {', '.join(CacheType.__members__)}"
            )
        return CacheType(str(v))

    @field_validator("load_mode", mode="before")
    @classmethod
    def _load_mode(cls, v: object) -> object:
        values = [m.value for m in LoadMode]
        if v is None or isinstance(v, LoadMode):
            return v
        if str(v) not in values:
            raise ValueError(_hint_choices(v, values))
        return LoadMode(str(v))

    @field_validator("parallel")
    @classmethod
    def _parallel(cls, v: int | None) -> int | None:
        if v is not None and (v == 0 or v < -1 or v > kvlayout.MAX_SLOTS):
            raise ValueError(
                f"-np {v} is out of range; use 1..{kvlayout.MAX_SLOTS}, or -1 for auto "
                "(llama-server does not accept 'auto' here)"
            )
        return v

    @field_validator("n_gpu_layers")
    @classmethod
    def _ngl(cls, v: str | None) -> str | None:
        if v is not None and v not in ("auto", "all") and not re.fullmatch(r"-?\d+", v):
            raise ValueError(f"-ngl {v!r} is not a number, 'auto' or 'all'")
        return v

    @field_validator(
        "host",
        "alias",
        "llama_server",
        "model",
        "chat_template_file",
        "api_key_file",
        "slot_save_path",
        mode="after",
    )
    @classmethod
    def _no_control(cls, v: Any) -> Any:
        if v is not None:
            envfile.check_value("value", str(v))
            if str(v) == "":
                raise ValueError("must not be empty")
        return v

    @field_validator("llama_server", "model", "chat_template_file", "api_key_file")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        # the unit starts llama-server in /, where a relative path names another file
        if v is not None and not v.is_absolute():
            raise ValueError(
                f"{str(v)!r} is a relative path; the unit runs llama-server from /, where it "
                f"would name another file: give the absolute path, e.g. {Path.cwd() / v}"
            )
        return v

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for word in v:
            envfile.check_value("extra_args", word)
            name = word.split("=", 1)[0]
            if name in SPELLING:
                field = SPELLING[name].field
                raise ValueError(
                    f"{word!r} in extra_args is a typed flag; set {field} instead "
                    f"(e.g. llama-launcher set {SPELLING[name].canonical} ...)"
                )
            if name in OWNED:  # named without its value: it may be a secret
                raise ValueError(f"{name!r} cannot go through extra_args: {OWNED[name]}")
        return v

    # -- views -----------------------------------------------------------------------------

    def server_args(self) -> list[str]:
        """llama-server's arguments (without the binary), in a stable order."""
        args: list[str] = []
        for flag in FLAGS:
            value = getattr(self, flag.field)
            if flag.field == "ctx_size" and value is None:
                value = self.derived_ctx_size()
            if value is None or (flag.kind == "switch" and not value):
                continue
            if flag.kind == "switch":
                args.append(flag.canonical)
            elif flag.kind == "bool":
                args.append(flag.canonical if value else flag.negative[0])
            else:
                args += [flag.canonical, str(getattr(value, "value", value))]
        return args + list(self.extra_args)

    def argv(self, api_key_file: str | None = None) -> list[str]:
        """The exact argv ``llama-launcher exec`` will exec for this config."""
        key_file = api_key_file or (str(self.api_key_file) if self.api_key_file else None)
        argv = [str(self.llama_server), *self.server_args(), "--log-colors", "off"]
        if key_file:
            argv += ["--api-key-file", key_file]
        return argv

    def derived_ctx_size(self) -> int | None:
        """-c is always passed when a per-slot cap is set: slots x per-slot."""
        if self.kv_unified_per_slot and self.ctx_size is None:
            slots = kvlayout.AUTO_SLOTS if self.parallel in (None, -1) else self.parallel
            return slots * self.kv_unified_per_slot
        return None

    def fit_off(self) -> bool:
        """``--fit off`` in extra_args (fit is on by default)."""
        for name, words in _group(list(self.extra_args)):
            if name in ("-fit", "--fit"):
                value = words[0].split("=", 1)[1] if "=" in words[0] else "".join(words[1:2])
                return value == "off"
        return False

    def pool_plan(self, n_ctx_train: int | None = None, np_default: int = -1) -> kvlayout.PoolPlan:
        """The pool llama-server will build for this config. ``np_default``: what the binary
        takes when -np is not given (``BinaryInfo.np_default``; -1, auto, in b9093..b11434)."""
        ctx = self.ctx_size if self.ctx_size is not None else self.derived_ctx_size()
        if ctx is None and n_ctx_train is not None and self.fit_off():
            # -c from the model: n_ctx_train per stream with fit on, n_ctx_train in all with
            # it off (common/fit.cpp:271-279, src/llama-context.cpp:135)
            ctx = n_ctx_train
        try:
            return kvlayout.resolve(
                ctx,
                np_default if self.parallel is None else self.parallel,
                self.kv_unified,
                self.kv_unified_per_slot or 0,
                n_ctx_train,
            )
        except ValueError as e:
            raise ConfigInvalid(str(e)) from None

    def check_overcommit(
        self, n_ctx_train: int | None, lacks_cap: str | None = None, np_default: int = -1
    ) -> kvlayout.PoolPlan:
        """Refuse a shared pool whose slots can exhaust it, unless allow_overcommit.
        ``lacks_cap``: the binary has no --kv-unified-per-slot, and why (``BinaryInfo.lacks``)."""
        plan = self.pool_plan(n_ctx_train, np_default)
        if plan.overcommitted and not self.allow_overcommit:
            raise OvercommitError(overcommit_message(plan, self, lacks_cap))
        return plan

    def masked(self) -> dict[str, Any]:
        """The config as JSON-able data with secrets shown as ***."""
        data = self.model_dump(mode="json", exclude_defaults=False)
        if self.api_key is not None:
            data["api_key"] = "***"
        return data


def overcommit_message(
    plan: kvlayout.PoolPlan, config: ServerConfig | None = None, lacks_cap: str | None = None
) -> str:
    """The over-commit diagnosis and its three fixes, with the numbers of this config.

    ``lacks_cap``: why the installed binary cannot take --kv-unified-per-slot (it names the
    build that adds it); the fixes are then the ones that build can apply."""
    w, n = plan.n_ctx_slot, plan.n_slots
    head = (
        f"over-committed shared KV pool: {n} slots x n_ctx_slot {w} = {plan.promised} cells "
        f"promised, but the unified pool holds {plan.n_ctx}; when the slots fill up together, "
        f"every session fails with 'Context size has been exceeded' (only "
        f"{plan.guaranteed_window} per slot is guaranteed). Fixes:\n"
    )
    if lacks_cap:
        return head + (
            f"  1. split the pool, same memory (each slot gets {kvlayout.pad(plan.n_ctx // n)}): "
            f"llama-launcher set -np {n} -no-kvu\n"
            f"  2. split pools that keep every slot's {w}, {n} times the cells: "
            f"llama-launcher set -c {n * w} -np {n} -no-kvu\n"
            f"  3. one slot, which owns the whole pool: llama-launcher set -np 1\n"
            f"or accept the risk with allow_overcommit = true (--allow-overcommit). "
            f"A per-slot cap is not offered: {lacks_cap}."
        )
    return head + (
        f"  1. cap each slot and size the pool for all of them: "
        f"llama-launcher set --kv-unified-per-slot {w} -c {n * w}\n"
        f"  2. the same at 8-bit, about half the KV memory: "
        f"llama-launcher set --kv-unified-per-slot {w} -c {n * w} -ctk q8_0 -ctv q8_0\n"
        f"  3. split the pool instead (each slot gets {kvlayout.pad(plan.n_ctx // n)}): "
        f"llama-launcher set -np {n} -no-kvu\n"
        f"or accept the risk with allow_overcommit = true (--allow-overcommit)."
    )


def overcommit_warning(plan: kvlayout.PoolPlan) -> str:
    """What a deploy with ``allow_overcommit`` says: the pool, the promise, what comes."""
    w, n = plan.n_ctx_slot, plan.n_slots
    return (
        f"allow_overcommit: the shared KV pool holds {plan.n_ctx} cells but promises "
        f"{plan.promised} ({n} slots x {w}); only {plan.guaranteed_window} per slot is "
        "guaranteed. When the busy slots fill the pool together, every request in flight "
        "fails at once with 'Context size has been exceeded' (HTTP 200 with an error event "
        "in the stream). Watch it with --bake 30m (a revert on the first one), or cap the "
        f"slots: llama-launcher set --kv-unified-per-slot {w} -c {n * w}"
    )


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
                raise ConfigInvalid(f"{name} needs a value, e.g. {name} {_example(flag.field)}")
            fields[flag.field] = _int(name, value) if flag.field in _INT_FIELDS else value
    return fields, extra


def _typed(name: str) -> bool:
    """A flag of the typed config (or the tool's own switch): its arity is known here."""
    return name == "--allow-overcommit" or name in SPELLING


def _typed_arity(name: str) -> int:
    flag = SPELLING.get(name)
    return 1 if flag is not None and flag.kind == "value" else 0


def _example(field: str) -> str:
    return {
        "cache_type_k": "q8_0",
        "cache_type_v": "q8_0",
        "flash_attn": "auto",
        "model": "/srv/models/model.gguf",
        "host": "127.0.0.1",
        "alias": "my-model",
        "load_mode": "mmap",
        "n_gpu_layers": "all",
    }.get(field, "4096")


def config_error(e: ValidationError) -> ConfigInvalid:
    """Turn pydantic's error into one ``ConfigInvalid`` naming field, value and fix."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        flag = FLAG_BY_FIELD.get(str(err["loc"][0])) if err["loc"] else None
        name = f"{loc} ({flag.canonical})" if flag else loc
        msg = str(err["msg"]).removeprefix("Value error, ")
        value = err.get("input")
        # extra_args is not echoed: its messages name the word, and a value may be a secret
        secret = loc == "api_key" or loc.startswith("extra_args")
        shown = "" if isinstance(value, dict) or secret else f" (got {value!r})"
        parts.append(f"{name}: {msg}{shown}")
    return ConfigInvalid("invalid config: " + "; ".join(parts))


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


def merge_extra(current: tuple[str, ...], new: Sequence[str]) -> tuple[str, ...]:
    """Add ``new`` extra flags to ``current``, replacing a flag's previous occurrence."""
    groups = _group(list(current))
    for name, words in _group(list(new)):
        groups = [(n, w) for n, w in groups if n != name]
        groups.append((name, words))
    return tuple(w for _, ws in groups for w in ws)


def remove_flags(data: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``unset``: drop typed fields by any spelling, or extra flags by name."""
    data = dict(data)
    extra = _group(list(data.get("extra_args", ())))
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


def _group(words: list[str]) -> list[tuple[str, list[str]]]:
    """Group ``--flag [value...]`` runs by flag name (a value is a word not starting with -)."""
    groups: list[tuple[str, list[str]]] = []
    for w in words:
        if envfile.is_flag(w):
            groups.append((w.split("=", 1)[0], [w]))
        elif groups:
            groups[-1][1].append(w)
        else:
            groups.append((w, [w]))
    return groups


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


# -- tool settings ---------------------------------------------------------------------------


def _default_settings_file() -> Path | None:
    """The settings file read when none is named: the system's, else the user's. One that
    cannot be looked at (a home folder closed to this user: ``su`` keeps root's HOME) is not
    there for this user; only a named one (``LLAMA_LAUNCHER_SETTINGS``) must be readable."""
    for where in ("/etc/llama-launcher", "~/.config/llama-launcher"):
        try:
            path = Path(where).expanduser() / "settings.toml"
            if path.is_file():
                return path
        except (OSError, RuntimeError):  # RuntimeError: no home folder to expand
            continue
    return None


def _default_scope() -> Literal["system", "user"]:
    return "system" if os.geteuid() == 0 and Path("/run/systemd/system").is_dir() else "user"


#: The longest bake (AWS AppConfig's limit: 1,440 minutes).
MAX_BAKE = 86400.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h)?\s*$")
_DURATION_UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def duration(value: Any, name: str) -> Any:
    """Seconds of ``30m``, ``2h``, ``90s`` or ``90`` (a number passes as it is); anything
    else is refused naming the value and the spellings."""
    if not isinstance(value, str):
        return value
    m = _DURATION.match(value)
    if m is None:
        raise ValueError(
            f"{value!r} is not a duration for {name}; write seconds or a number with s, m "
            "or h (90, 90s, 30m, 2h; 0: off)"
        )
    return float(m[1]) * _DURATION_UNITS[m[2]]


class ToolSettings(BaseSettings):
    """Where and how llama-launcher works on this host.

    Precedence, highest first (the one documented place):
      1. command-line options (``--unit``, ``--scope``, ``--env-file``, ...);
      2. environment variables ``LLAMA_LAUNCHER_<FIELD>`` (e.g. ``LLAMA_LAUNCHER_UNIT``);
      3. the TOML file named by ``LLAMA_LAUNCHER_SETTINGS``
         (default ``/etc/llama-launcher/settings.toml``, or the user's
         ``~/.config/llama-launcher/settings.toml`` in user scope), if it exists;
      4. the defaults below.
    """

    model_config = SettingsConfigDict(env_prefix="LLAMA_LAUNCHER_", extra="forbid", frozen=True)

    unit: str = "llama-server.service"
    scope: Literal["system", "user"] = Field(default_factory=_default_scope)
    env_file: Path | None = None
    state_dir: Path | None = None
    unit_dir: Path | None = None
    base_url: str | None = None
    # unset: sized from the unit's last measured load, max(floor, 4 x measured) (budgets.py)
    start_timeout: float | None = Field(
        None, gt=0, description="the old process gone until the startup line, seconds"
    )
    health_timeout: float | None = Field(
        None, gt=0, description="/health 200 after the startup line"
    )
    probe_timeout: float = Field(60.0, gt=0, description="the real chat completion")
    lock_timeout: float | None = Field(
        None, ge=0, description="waiting for another deploy (unset: one deploy's budget)"
    )
    settle_seconds: float = Field(
        0.0, ge=0, description="extra wait before the final stay-up check"
    )
    unified_memory: Literal["auto", "yes", "no"] = Field(
        "auto",
        description="whether the devices' memory is the host's (auto: a device as large as "
        "the host's MemTotal, or Metal)",
    )
    drain_timeout: float = Field(
        120.0, ge=0, description="wait for requests in flight before a restart; 0: no drain"
    )
    carry_slots: bool = Field(
        True,
        description="a config without --slot-save-path gets STATE_DIR/slots: the slots' "
        "caches are saved before a restart and restored after it",
    )
    # the second instance (launcher/deploy/standby.py; install --front haproxy
    # --second-instance)
    handover: Literal["auto", "switch", "hold"] = Field(
        "auto",
        description="how a fronted unit with a second instance restarts: switch (the live "
        "config serves on the second instance meanwhile, nothing is held), hold (the "
        "front holds new requests), auto (switch when the second instance fits in memory "
        "beside the running one)",
    )
    keep_warm: float = Field(
        60.0,
        ge=0,
        description="seconds the second instance keeps the previous config warm after a "
        "switch (a rollback then is a switch); the bake's length when it is longer",
    )
    # the watch (launcher/watch/): install renders the interval into the sampler's timer
    sample_interval: float = Field(
        60.0, ge=1, description="seconds between two live samples (NAME-sample.timer)"
    )
    metrics_textfile_dir: Path | None = Field(
        None,
        description="node_exporter's --collector.textfile.directory: every sample writes "
        "llama_launcher_<unit>.prom there (unset: no metrics file)",
    )
    wedged_samples: int = Field(
        3,
        ge=0,
        description="samples in a row in which the server lives but does not answer (/health "
        "within 5 s; or a 1-token completion, while requests wait and its counters stand "
        "still) that restart it (during a bake: revert it); 0: off. Rendered into the "
        "sampler's service (install again to change it)",
    )
    metrics_endpoint: bool = Field(
        True,
        description="a config that keeps /slots on gets --metrics (the sampler's decode "
        "and prefill tok/s)",
    )
    # the bake (launcher/watch/bake.py, verdict.py): the defaults are the anchors' (README,
    # "The bake window"); a deploy copies them into its bake record, the sampler reads them
    bake: float = Field(
        0.0,
        ge=0,
        le=MAX_BAKE,
        description="watch a deployed config this long (30m, 2h, seconds) and put the "
        "previous one back when it is worse under load; 0: no bake",
    )
    bake_interval: float = Field(15.0, ge=1, description="seconds between two bake samples")
    bake_warmup: float = Field(
        120.0, ge=0, description="seconds after the gate before a soft signal counts"
    )
    bake_drain: float = Field(
        5.0, ge=0, description="the drain before a revert on a hard failure, seconds"
    )
    bake_failure_rate: float = Field(
        0.01, ge=0, le=1, description="failed requests (5xx, in-stream errors) that revert"
    )
    bake_soft_samples: int = Field(3, ge=1, description="bad samples in a row for a soft revert")
    bake_min_completions: int = Field(
        20, ge=1, description="completions in the window before a soft signal counts"
    )
    bake_decode_ratio: float = Field(
        0.8, gt=0, le=1, description="decode tok/s under this share of the baseline's is bad"
    )
    bake_memory_ratio: float = Field(
        1.5, gt=1, description="memory growing faster than this many times the baseline's"
    )
    bake_memory_floor: float = Field(
        256.0, ge=0, description="MiB per hour of memory growth that is never bad"
    )
    bake_pool_limit: float = Field(
        0.9,
        ge=0,
        le=1,
        description="an over-committed shared pool whose slots' sessions need this share of "
        "it (held and still to generate) reverts before it overflows (when the previous config "
        "guaranteed every slot); 0: off",
    )
    bake_pool_poll: float = Field(
        0.25,
        ge=0,
        description="seconds between two looks at /slots between the bake's samples of an "
        "over-committed pool; 0: only the samples look",
    )
    bake_unread_limit: int = Field(
        4, ge=1, description="samples in a row that cannot read the signals: inconclusive"
    )

    @field_validator("bake", mode="before")
    @classmethod
    def _bake_duration(cls, value: Any) -> Any:
        return duration(value, "bake")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        from pydantic_settings import TomlConfigSettingsSource

        named = os.environ.get("LLAMA_LAUNCHER_SETTINGS")
        path = Path(named) if named is not None else _default_settings_file()
        if path is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, path))

    @property
    def unit_name(self) -> str:
        return self.unit if "." in self.unit else f"{self.unit}.service"

    @property
    def instance(self) -> str:
        """The unit name without ``.service``; names the env file and state dir."""
        return self.unit_name.removesuffix(".service")

    @property
    def env_name(self) -> str:
        """The env file's stem: the instance of a template unit (``llama-server@X`` reads
        ``X.env``, its ``%i.env``), else the unit name."""
        return self.instance.split("@", 1)[1] if "@" in self.instance else self.instance

    def resolved_env_file(self) -> Path:
        if self.env_file:
            return self.env_file
        base = (
            Path("/etc/llama-launcher")
            if self.scope == "system"
            else Path.home() / ".config/llama-launcher"
        )
        # the template unit llama-server@X.service reads <dir>/X.env (%i.env)
        return base / f"{self.env_name}.env"

    def default_state_dir(self) -> Path:
        base = (
            Path("/var/lib/llama-launcher")
            if self.scope == "system"
            else Path.home() / ".local/state/llama-launcher"
        )
        return base / self.instance

    def resolved_unit_file(self) -> Path:
        """The installed unit file: a template's for an instance (``llama-server@.service``)."""
        name = self.unit_name
        if "@" in name:
            name = name.split("@", 1)[0] + "@.service"
        return self.resolved_unit_dir() / name

    def resolved_unit_dir(self) -> Path:
        if self.unit_dir:
            return self.unit_dir
        return (
            Path("/etc/systemd/system")
            if self.scope == "system"
            else Path.home() / ".config/systemd/user"
        )


def load_settings(**overrides: Any) -> ToolSettings:
    """Tool settings with CLI ``overrides`` (None values are ignored)."""
    clean = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ToolSettings(**clean)
    except ValidationError as e:
        raise config_error(e) from None
    except PermissionError as e:  # a settings file of another user (HOME kept by sudo -E)
        raise ConfigInvalid(
            f"cannot read the settings file {e.filename}: permission denied; run as its "
            "owner, or point LLAMA_LAUNCHER_SETTINGS at a file you can read"
        ) from None
