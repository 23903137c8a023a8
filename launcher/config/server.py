"""The typed config of llama-server's flags (``ServerConfig``): the flags it owns, in
llama-server's own spellings (``FLAGS``), their closed sets as enums, and what a value that
breaks them is told.

``ServerConfig`` is frozen with ``extra="forbid"``; its validators quote the bad value and
give the fix. It renders a deterministic argv (``argv``, ``server_args``; the way from
flags to a config and back is ``launcher.config.argv``). The API key is a secret: it never
reaches argv; llama-server reads it from ``API_KEY_FILE`` (``--api-key-file``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from launcher.errors import ConfigInvalid, OvercommitError
from launcher.host import envfile
from launcher.server import kvlayout


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


def group_flags(words: list[str]) -> list[tuple[str, list[str]]]:
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


def merge_extra(current: tuple[str, ...], new: Sequence[str]) -> tuple[str, ...]:
    """Add ``new`` extra flags to ``current``, replacing a flag's previous occurrence."""
    groups = group_flags(list(current))
    for name, words in group_flags(list(new)):
        groups = [(n, w) for n, w in groups if n != name]
        groups.append((name, words))
    return tuple(w for _, ws in groups for w in ws)


def no_control(v: Any) -> Any:
    """A value the env file can hold: no control character, not empty (a field validator's
    body, shared by the typed configs)."""
    if v is not None:
        envfile.check_value("value", str(v))
        if str(v) == "":
            raise ValueError("must not be empty")
    return v


def absolute(v: Path | None, server: str) -> Path | None:
    """An absolute path: the unit starts ``server`` in /, where a relative one names another
    file."""
    if v is not None and not v.is_absolute():
        raise ValueError(
            f"{str(v)!r} is a relative path; the unit runs {server} from /, where it "
            f"would name another file: give the absolute path, e.g. {Path.cwd() / v}"
        )
    return v


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
        return no_control(v)

    @field_validator("llama_server", "model", "chat_template_file", "api_key_file")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        return absolute(v, "llama-server")

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
        for name, words in group_flags(list(self.extra_args)):
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
        self,
        n_ctx_train: int | None,
        lacks_cap: str | None = None,
        np_default: int = -1,
        admitted: bool = False,
    ) -> kvlayout.PoolPlan:
        """Refuse a shared pool whose slots can exhaust it, unless allow_overcommit or
        ``admitted`` (the front admits requests against the pool, so none can exhaust it).
        ``lacks_cap``: the binary has no --kv-unified-per-slot, and why (``BinaryInfo.lacks``)."""
        plan = self.pool_plan(n_ctx_train, np_default)
        if plan.overcommitted and not (self.allow_overcommit or admitted):
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


def admission_note(plan: kvlayout.PoolPlan) -> str:
    """What a deploy says of an over-committed shared pool that the front admits against."""
    return plan.describe(admitted=True)


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


def example(field: str) -> str:
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


def config_error(
    e: ValidationError,
    spelling: Callable[[str], str | None] | None = None,
    what: str = "config",
) -> ConfigInvalid:
    """Turn pydantic's error into one ``ConfigInvalid`` naming field, value and fix;
    ``spelling``: a field's flag (default llama-server's), ``what``: the config's name."""

    def canonical(name: str) -> str | None:
        flag = FLAG_BY_FIELD.get(name)
        return flag.canonical if flag else None

    spelled = spelling or canonical
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        flag = spelled(str(err["loc"][0])) if err["loc"] else None
        name = f"{loc} ({flag})" if flag else loc
        msg = str(err["msg"]).removeprefix("Value error, ")
        value = err.get("input")
        # extra_args is not echoed: its messages name the word, and a value may be a secret
        secret = loc == "api_key" or loc.startswith("extra_args")
        shown = "" if isinstance(value, dict) or secret else f" (got {value!r})"
        parts.append(f"{name}: {msg}{shown}")
    return ConfigInvalid(f"invalid {what}: " + "; ".join(parts))
