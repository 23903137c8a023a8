"""The typed config of a vLLM server (``VllmConfig``), in vLLM's own spellings.

A unit installed with ``--backend vllm`` runs ``vllm serve MODEL_FOLDER ...`` instead of
llama-server. Its config is recorded with ``backend = "vllm"`` in every generation, so
``config.build`` and ``config.from_flags`` read a vLLM unit's flags as vLLM's (``set
--max-num-seqs 2``) and every verb works on it. The closed sets (``--kv-cache-dtype``,
``--dtype``) are enums; a flag this config does not type goes through ``extra_args`` and is
checked against the installed vLLM's ``--help`` (``launcher.config.validate``).

The pool: vLLM pages one KV cache shared by all sequences. Its size is the KV budget
(``--kv-cache-memory-bytes``; on a GPU ``--gpu-memory-utilization`` of the device may be
the budget instead) over the model's bytes per token (``kv_tokens``). A sequence never
fails because others filled it: vLLM preempts one and queues it again, so an over-commit
is a wait, not a failure, and is said, not refused. A budget that cannot hold one sequence
of ``--max-model-len`` is refused: vLLM would exit at startup.

The env file: ``VLLM_PYTHON`` (the vLLM venv's python), ``EXTRA_ARGS`` (the model folder
and the flags) and ``API_KEY_FILE``; ``launcher.host.launch`` execs
``VLLM_PYTHON launcher/host/vllmshim/vllm_main.py serve EXTRA_ARGS``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from launcher.config.server import absolute, group_flags, merge_extra, no_control
from launcher.config.server import config_error as server_error
from launcher.errors import ConfigInvalid
from launcher.host import envfile
from launcher.server import kvlayout

#: vLLM's default block size on CPU and GPU (tokens a KV block holds): its pool is whole
#: blocks (``vllm:cache_config_info{block_size="128"}`` on CPU; 16 on CUDA).
CPU_BLOCK = 128


class KvCacheDtype(StrEnum):
    """``--kv-cache-dtype`` values vLLM 0.32 accepts (its argparse choices)."""

    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    fp8 = "fp8"
    fp8_ds_mla = "fp8_ds_mla"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"
    fp8_inc = "fp8_inc"
    fp8_per_token_head = "fp8_per_token_head"
    int4_per_token_head = "int4_per_token_head"
    int8_per_token_head = "int8_per_token_head"
    nvfp4 = "nvfp4"
    nvfp4_4over6 = "nvfp4_4over6"
    nvfp4_ds_mla = "nvfp4_ds_mla"
    turboquant_3bit_nc = "turboquant_3bit_nc"
    turboquant_4bit_nc = "turboquant_4bit_nc"
    turboquant_k3v4_nc = "turboquant_k3v4_nc"
    turboquant_k8v4 = "turboquant_k8v4"
    ultraquant_4bit = "ultraquant_4bit"


#: the KV dtypes whose bytes per value are exact here (the others' per-token scales and
#: packing are vLLM's: their pool is read from its startup line, not planned)
EXACT_WIDTH = {"auto": 2, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


class Dtype(StrEnum):
    """``--dtype`` values vLLM accepts."""

    auto = "auto"
    bfloat16 = "bfloat16"
    float = "float"
    float16 = "float16"
    float32 = "float32"
    half = "half"


@dataclass(frozen=True)
class VFlag:
    """One typed vLLM flag: the config field, its spelling, and its kind."""

    field: str
    spelling: str
    kind: Literal["value", "switch"]


#: The typed flags, in render order (the model folder is the positional first word).
FLAGS: tuple[VFlag, ...] = (
    VFlag("host", "--host", "value"),
    VFlag("port", "--port", "value"),
    VFlag("served_model_name", "--served-model-name", "value"),
    VFlag("max_model_len", "--max-model-len", "value"),
    VFlag("max_num_seqs", "--max-num-seqs", "value"),
    VFlag("kv_cache_dtype", "--kv-cache-dtype", "value"),
    VFlag("kv_cache_memory_bytes", "--kv-cache-memory-bytes", "value"),
    VFlag("gpu_memory_utilization", "--gpu-memory-utilization", "value"),
    VFlag("tensor_parallel_size", "--tensor-parallel-size", "value"),
    VFlag("dtype", "--dtype", "value"),
    VFlag("enforce_eager", "--enforce-eager", "switch"),
    VFlag("shutdown_timeout", "--shutdown-timeout", "value"),
)

FLAG_BY_FIELD = {f.field: f for f in FLAGS}

#: every spelling of a typed flag (vLLM's short forms included) -> the flag
SPELLING: dict[str, VFlag] = {f.spelling: f for f in FLAGS}
SPELLING["-tp"] = FLAG_BY_FIELD["tensor_parallel_size"]
SPELLING["--model"] = VFlag("model", "--model", "value")

#: the key vLLM's ``non-default args`` line gives each typed field, where it differs
NON_DEFAULT_KEY = {
    "host": "host",
    "port": "port",
    "served_model_name": "served_model_name",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "kv_cache_dtype": "kv_cache_dtype",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "tensor_parallel_size": "tensor_parallel_size",
    "dtype": "dtype",
    "enforce_eager": "enforce_eager",
    "shutdown_timeout": "shutdown_timeout",
}

#: Flags the launcher owns: never through extra_args.
OWNED = {
    "--api-key": "set api_key_file in a config file (deploy --config FILE); vLLM reads the "
    "key from the environment (VLLM_API_KEY), never from its command line",
}

#: the longest ``--shutdown-timeout``: the unit's TimeoutStopSec
#: (``launcher.host.units.VLLM_STOP_SECONDS``, 60) less 10 s for the engine's teardown
MAX_SHUTDOWN = 50

#: what vLLM reserves without a KV budget: this fraction of the device (of all RAM on CPU)
DEFAULT_UTILIZATION = 0.92

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def size_bytes(value: object, flag: str = "--kv-cache-memory-bytes") -> int:
    """Bytes of ``128M``, ``1G``, ``512MiB`` or a number: vLLM's reading (its
    ``human_readable_int``): an upper-case suffix is binary (1K = 1024), lower-case decimal
    (1k = 1000); ``MiB``/``GiB`` binary too."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    if m is None:
        raise ValueError(
            f"{value!r} is not a size for {flag}; write bytes or a number with K, M or G "
            "(128M, 2G: binary; 1000000)"
        )
    number, unit, bee = float(m[1]), m[2], m[3]
    base = 1024 if unit.isupper() or (bee or "").lower() == "ib" else 1000
    return int(number * base ** _POWERS[unit.lower()])


class VllmConfig(BaseModel):
    """The vLLM server flags operators change, typed. ``None`` means "not passed"."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    backend: Literal["vllm"] = Field("vllm", description="the server this unit runs")
    vllm_python: Path = Field(description="the python of the venv vLLM is installed in")
    model: Path = Field(description="the model folder (config.json and a tokenizer)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    served_model_name: str | None = Field(None, description="the name clients ask for")
    max_model_len: int | None = Field(None, ge=1, description="the window of one sequence")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences scheduled at once")
    kv_cache_dtype: KvCacheDtype | None = None
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="the KV budget, bytes")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    tensor_parallel_size: int | None = Field(None, ge=1)
    dtype: Dtype | None = None
    enforce_eager: bool = False
    shutdown_timeout: int | None = Field(None, ge=0, description="seconds a stop drains")
    api_key_file: Path | None = Field(None, description="file with the API key")
    api_key: SecretStr | None = Field(None, description="written to a 0600 file, never argv")
    extra_args: tuple[str, ...] = ()
    allow_overcommit: bool = Field(False, description="kept for the shared verbs; vLLM queues")

    @field_validator("shutdown_timeout")
    @classmethod
    def _shutdown(cls, v: int | None) -> int | None:
        if v is not None and v > MAX_SHUTDOWN:
            raise ValueError(
                f"--shutdown-timeout {v} is longer than the unit lets a stop take (its "
                f"TimeoutStopSec={MAX_SHUTDOWN + 10}s ends it with SIGKILL, cutting the drain): "
                f"use at most {MAX_SHUTDOWN}"
            )
        return v

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _kv_dtype(cls, v: object) -> object:
        return _choice(v, KvCacheDtype, "--kv-cache-dtype")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v: object) -> object:
        return _choice(v, Dtype, "--dtype")

    @field_validator("kv_cache_memory_bytes", mode="before")
    @classmethod
    def _size(cls, v: object) -> object:
        return None if v is None else size_bytes(v)

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _window(cls, v: object) -> object:
        # vLLM reads 32k and 32K as it reads a size (human_readable_int): 32000 and 32768
        if isinstance(v, str) and v.strip() and not v.strip().isdigit():
            try:
                return size_bytes(v.replace("B", "").replace("b", ""), "--max-model-len")
            except ValueError:
                raise ValueError(
                    f"{v!r} is not a number of tokens for --max-model-len; e.g. 32768, 32k "
                    "(32,000) or 32K (32,768)"
                ) from None
        return v

    @field_validator("host", "served_model_name", "vllm_python", "model", "api_key_file")
    @classmethod
    def _no_control(cls, v: Any) -> Any:
        return no_control(v)

    @field_validator("vllm_python", "model", "api_key_file")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        return absolute(v, "vLLM")

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for word in v:
            envfile.check_value("extra_args", word)
            name = word.split("=", 1)[0]
            if name in SPELLING:
                flag = SPELLING[name]
                raise ValueError(
                    f"{word!r} in extra_args is a typed flag; set {flag.field} instead "
                    f"(e.g. llama-launcher set {flag.spelling} ...)"
                )
            if name in OWNED:
                raise ValueError(f"{name!r} cannot go through extra_args: {OWNED[name]}")
        return v

    # -- views -----------------------------------------------------------------------------

    def server_args(self) -> list[str]:
        """``vllm serve``'s arguments: the model folder, then the flags in a stable order."""
        args = [str(self.model)]
        for flag in FLAGS:
            value = getattr(self, flag.field)
            if value is None or value is False:
                continue
            if flag.kind == "switch":
                args.append(flag.spelling)
            else:
                args += [flag.spelling, str(getattr(value, "value", value))]
        return args + list(self.extra_args)

    def argv(self, api_key_file: str | None = None) -> list[str]:
        """The argv ``llama-launcher exec`` execs (``launcher.host.launch.vllm_argv``)."""
        from launcher.host import launch

        return launch.vllm_argv(str(self.vllm_python), self.server_args())

    def env_values(self, key_file: str | None = None) -> dict[str, str]:
        values = {
            "VLLM_PYTHON": str(self.vllm_python),
            "EXTRA_ARGS": envfile.join_words(self.server_args()),
        }
        key = key_file or (str(self.api_key_file) if self.api_key_file else None)
        if key:
            values["API_KEY_FILE"] = key
        return values

    def budget_said(self) -> str | None:
        """Why the config has no explicit KV budget (None: it has one)."""
        if self.kv_cache_memory_bytes or self.gpu_memory_utilization:
            return None
        return (
            "no KV budget: without --kv-cache-memory-bytes (or --gpu-memory-utilization) "
            f"vLLM reserves {DEFAULT_UTILIZATION:.0%} of the device's memory (of all RAM on a "
            "CPU) for its KV cache; give one, e.g. --kv-cache-memory-bytes 2G"
        )

    def masked(self) -> dict[str, Any]:
        data = self.model_dump(mode="json", exclude_defaults=False)
        if self.api_key is not None:
            data["api_key"] = "***"
        return data


def _choice(v: object, enum: type[StrEnum], flag: str) -> object:
    if v is None or isinstance(v, enum):
        return v
    values = [m.value for m in enum]
    if str(v) not in values:
        raise ValueError(f"{v!r} is not one of {', '.join(values)}: e.g. {flag} {values[1]}")
    return enum(str(v))


# -- the model's bytes per token, and the pool ---------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the KV arithmetic needs of a Hugging Face model folder's ``config.json``."""

    layers: int
    kv_heads: int
    head_dim: int
    max_position: int | None
    dtype: str | None
    #: every layer keeps K and V of every token (no sliding window, latent or mixed
    #: attention): the bytes a token are this arithmetic's
    plain: bool = True
    #: rope scaling: vLLM may derive a window past ``max_position``
    scaled: bool = False

    @classmethod
    def read(cls, folder: Path) -> ModelShape:
        path = folder / "config.json"
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ConfigInvalid(
                f"the model folder {folder} has no readable config.json ({e.strerror}); vLLM "
                "serves a Hugging Face model folder: give the folder that holds config.json"
            ) from None
        except ValueError as e:
            raise ConfigInvalid(f"{path} is not JSON ({e})") from None
        if isinstance(data, dict) and isinstance(data.get("text_config"), dict):
            data = data["text_config"]  # a multimodal model's language half
        if not isinstance(data, dict):
            raise ConfigInvalid(f"{path} is no JSON object: not a model's config")
        try:
            heads = int(data["num_attention_heads"])
            layers = int(data["num_hidden_layers"])
            head_dim = int(data.get("head_dim") or int(data["hidden_size"]) // heads)
            kv_heads = int(data.get("num_key_value_heads") or heads)
            pos = data.get("max_position_embeddings")
            max_position = int(pos) if pos else None
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise ConfigInvalid(
                f"{path} lacks the attention shape ({type(e).__name__}: {e}); the KV budget "
                "cannot be checked"
            ) from None
        kinds = data.get("layer_types")
        plain = not (
            data.get("sliding_window")
            or data.get("kv_lora_rank")
            or (isinstance(kinds, list) and any(k != "full_attention" for k in kinds))
        )
        dtype = data.get("torch_dtype") or data.get("dtype")
        return cls(
            layers,
            kv_heads,
            head_dim,
            max_position,
            str(dtype) if dtype else None,
            plain,
            bool(data.get("rope_scaling")),
        )

    def bytes_per_token(self, cfg: VllmConfig) -> int:
        """K and V of every layer for one token, in the KV cache's dtype (an estimate for a
        dtype not in ``EXACT_WIDTH``: a byte a value for the 8-bit ones, half for 4-bit).
        ``auto`` stores the model's dtype, 16-bit unless ``--dtype float32`` asks for more
        (vLLM serves a float32 checkpoint in 16 bits by default)."""
        kv = cfg.kv_cache_dtype.value if cfg.kv_cache_dtype else "auto"
        values = 2 * self.layers * self.kv_heads * self.head_dim
        if kv == "auto" and cfg.dtype in (Dtype.float32, Dtype.float):
            return values * 4
        if kv in EXACT_WIDTH:
            return values * EXACT_WIDTH[kv]
        return values // 2 if "4" in kv or "3bit" in kv else values


def kv_tokens(budget: int, per_token: int, block: int = CPU_BLOCK) -> int:
    """The tokens a KV budget holds, in whole blocks (what vLLM's ``KV cache size`` says)."""
    return budget // (per_token * block) * block


def exact(cfg: VllmConfig, shape: ModelShape, cpu: bool) -> str | None:
    """Why the pool a budget holds is not this arithmetic's to say (None: it is): it is
    exact for vLLM's CPU build on one process, a plain model, an explicit budget and a KV
    dtype of known width; otherwise vLLM sizes it and its startup line says how large."""
    kv = cfg.kv_cache_dtype.value if cfg.kv_cache_dtype else "auto"
    if not cpu:
        return "on a GPU vLLM sizes its pool (its block size and the device's own use)"
    if (cfg.tensor_parallel_size or 1) > 1:
        return "--tensor-parallel-size splits the pool across processes"
    if not shape.plain:
        return "the model's attention is not plain (sliding window, latent or mixed layers)"
    if not cfg.kv_cache_memory_bytes or cfg.gpu_memory_utilization:
        return "--gpu-memory-utilization sizes the pool from the memory vLLM finds"
    if kv not in EXACT_WIDTH:
        return f"--kv-cache-dtype {kv} packs its values with scales of its own"
    return None


def pool_plan(
    cfg: VllmConfig, shape: ModelShape, cpu: bool = True
) -> tuple[kvlayout.PoolPlan, list[str]]:
    """vLLM's pool as the launcher's plan: ``max_num_seqs`` slots of ``max_model_len`` in one
    shared pool of the KV budget's tokens; and the notes a deploy says of it. Where the
    arithmetic is exact (``exact``), a budget that cannot hold one whole sequence is
    refused (vLLM exits with 'larger than the available KV cache memory'); elsewhere the
    pool is vLLM's to size, and the plan says so."""
    window = cfg.max_model_len or shape.max_position
    if window is None:
        raise ConfigInvalid(
            f"{cfg.model}/config.json gives no max_position_embeddings; set --max-model-len"
        )
    if shape.max_position and window > shape.max_position and not shape.scaled:
        raise ConfigInvalid(
            f"--max-model-len {window} is over the model's max_position_embeddings "
            f"({shape.max_position}); vLLM refuses it at startup: use at most {shape.max_position}"
        )
    seqs = cfg.max_num_seqs or (DEFAULT_SEQS if cpu else GPU_DEFAULT_SEQS)
    per_token = shape.bytes_per_token(cfg)
    notes: list[str] = []
    why_not = exact(cfg, shape, cpu)
    tokens = 0
    if why_not is None:
        assert cfg.kv_cache_memory_bytes is not None
        tokens = kv_tokens(cfg.kv_cache_memory_bytes, per_token)
        # one block of the pool is vLLM's own (its null block): a sequence gets the rest
        # (measured: 2,048 tokens of budget serve at most 1,920)
        if tokens - CPU_BLOCK < window:
            need = (-(-window // CPU_BLOCK) + 1) * CPU_BLOCK * per_token
            raise ConfigInvalid(
                f"--kv-cache-memory-bytes {cfg.kv_cache_memory_bytes} holds {tokens} tokens "
                f"({per_token} bytes each, one block of {CPU_BLOCK} vLLM's own), less than one "
                f"sequence of --max-model-len {window}: vLLM would exit at startup; give at "
                f"least {need} bytes (--kv-cache-memory-bytes {-(-need // 2**20)}M) or a "
                "smaller --max-model-len"
            )
    else:
        notes.append(
            f"the KV pool is vLLM's to size ({why_not}): its startup line says how many "
            "tokens it holds, and the deploy records that"
        )
    plan = kvlayout.PoolPlan(
        n_slots=seqs,
        kv_unified=True,
        n_ctx=tokens or seqs * window,
        n_ctx_seq=window,
        n_ctx_slot=window,
        per_slot_cap=0,
        pool_sized_by_per_slot=False,
        n_ctx_train=shape.max_position,
        exact=why_not is None,
    )
    if cfg.max_num_seqs is None:
        notes.append(
            f"--max-num-seqs is not set: planned with vLLM's default on this path ({seqs}); "
            "set it to plan the pool exactly"
        )
    if tokens and plan.overcommitted:
        notes.append(
            f"{seqs} sequences x {window} tokens is more than the KV pool's {tokens}: when "
            "all are long, vLLM preempts one and queues it again (a wait, not a failure; "
            "vllm:num_preemptions counts them); every sequence is guaranteed "
            f"{plan.guaranteed_window} tokens while all {seqs} run"
        )
    return plan, notes


#: ``--max-num-seqs`` when not given: vLLM's default for ``vllm serve`` on CPU, and on most
#: GPUs (1024 on one of 70 GiB or more: an H100, an H200; engine/arg_utils.py, 0.32)
DEFAULT_SEQS = 128
GPU_DEFAULT_SEQS = 256


# -- flags <-> config ------------------------------------------------------------------------


def parse_flags(tokens: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """vLLM style flags into config fields (``--flag value``, ``--flag=value``); a first bare
    word is the model folder; unknown flags go to the extra list."""
    fields: dict[str, Any] = {}
    extra: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        name, eq, inline = tok.partition("=")
        if name == "--allow-overcommit":
            fields["allow_overcommit"] = True
            i += 1
            continue
        if i == 0 and not envfile.is_flag(tok):
            fields["model"] = tok
            i += 1
            continue
        if name == "--no-enforce-eager":
            fields["enforce_eager"] = False
            i += 1
            continue
        flag = SPELLING.get(name)
        if flag is None:
            extra.append(tok)
            i += 1
            continue
        if flag.kind == "switch":
            fields[flag.field] = _switch(name, inline) if eq else True
            i += 1
            continue
        if eq:
            value, i = inline, i + 1
        elif i + 1 < len(tokens) and not envfile.is_flag(tokens[i + 1]):
            value, i = tokens[i + 1], i + 2
        else:
            raise ConfigInvalid(f"{name} needs a value, e.g. {name} {_EXAMPLE.get(flag.field, 4)}")
        fields[flag.field] = value
    return fields, extra


def _switch(name: str, value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ConfigInvalid(f"{name}={value!r} is not true or false; e.g. {name} or --no-{name[2:]}")


_EXAMPLE = {
    "kv_cache_dtype": "fp8",
    "dtype": "bfloat16",
    "kv_cache_memory_bytes": "2G",
    "gpu_memory_utilization": "0.85",
    "served_model_name": "my-model",
    "host": "127.0.0.1",
    "model": "/srv/models/my-model",
}


def build(data: dict[str, Any]) -> VllmConfig:
    """Validate ``data`` into a ``VllmConfig``, raising ``ConfigInvalid``."""
    try:
        return VllmConfig.model_validate(data)
    except ValidationError as e:
        raise config_error(e) from None


def from_flags(tokens: Sequence[str], base: dict[str, Any]) -> VllmConfig:
    fields, extra = parse_flags(tokens)
    data = {**base, **fields}
    if extra:
        data["extra_args"] = merge_extra(tuple(data.get("extra_args", ())), extra)
    return build(data)


def remove_flags(data: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``unset`` of a vLLM config: typed fields by spelling, extra flags by name."""
    data = dict(data)
    extra = group_flags(list(data.get("extra_args", ())))
    for name in names:
        flag = SPELLING.get(name)
        if flag is not None:
            if flag.field == "model":
                raise ConfigInvalid(f"{name} cannot be unset: the server needs a model")
            data.pop(flag.field, None)
            continue
        if not any(n == name for n, _ in extra):
            known = sorted(
                {f.spelling for f in FLAGS if data.get(f.field) not in (None, False)}
                | {n for n, _ in extra}
            )
            raise ConfigInvalid(
                f"{name} is not set in the live config; set flags are: {' '.join(known)}"
            )
        extra = [(n, w) for n, w in extra if n != name]
    data["extra_args"] = tuple(w for _, ws in extra for w in ws)
    return data


def config_error(e: ValidationError) -> ConfigInvalid:
    def spelling(name: str) -> str | None:
        flag = FLAG_BY_FIELD.get(name)
        return flag.spelling if flag else None

    return server_error(e, spelling, "vLLM config")
