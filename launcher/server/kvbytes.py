"""KV-cache memory of llama-server b11434, estimated from a model's GGUF metadata.

``ModelInfo.from_gguf(path)`` reads the attention layout (layers, per-layer K/V widths,
sliding-window and recurrent layers, MLA, n_ctx_train) and the weights' file size;
``estimate(info, plan, ctk, ctv)`` turns it and a ``kvlayout.PoolPlan`` into bytes, the way
``llama_kv_cache`` allocates them (src/llama-kv-cache.cpp:65-305,
src/llama-kv-cache-iswa.cpp:34-103, src/llama-memory-hybrid.cpp, src/llama-memory-recurrent.cpp).
The tests hold the result to the server's own ``llama_kv_cache: size = ... MiB`` lines.

Models whose cache this module does not model (the indexer/DSA/MSA caches, layers that share
KV, hybrid layouts other than Qwen3-Next/3.5, architectures nobody checked) raise
``EstimateUnsupported`` instead of a guess.

Error tree additions (leaves of ``launcher.errors``)::

    LauncherError
    └── EstimateUnsupported        the model needs a cache the estimator does not model
"""

from __future__ import annotations

import functools
import re
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from launcher.errors import ConfigInvalid, LauncherError
from launcher.server.kvlayout import PoolPlan, pad

MIB = 1024 * 1024

#: KV cache types llama-server accepts (common/arg.cpp:304-323) as (elements per block,
#: bytes per block): ggml/src/ggml.c ``type_traits[].blck_size`` / ``.type_size``, block
#: layouts in ggml/src/ggml-common.h (QK8_0 = QK4_0 = ... = 32).
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "iq4_nl": (32, 18),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
}
#: llama-server forces flash attention off for these (src/llama-context.cpp:3819-3822).
FA_OFF_ARCHS = frozenset({"grok"})
#: Recurrent R/S states are always F32 (src/llama-model.cpp create_memory, GGML_TYPE_F32).
RECURRENT_STATE_BYTES = 4
#: Defaults of -b / -ub (common/common.h); the SWA cache grows by the effective ubatch.
DEFAULT_BATCH = 2048
DEFAULT_UBATCH = 512

#: create_memory() returns no memory at all for these (src/llama-model.cpp:2364-2381).
NO_CACHE_ARCHS = frozenset(
    {
        "bert",
        "jina-bert-v2",
        "jina-bert-v3",
        "nomic-bert",
        "nomic-bert-moe",
        "neo-bert",
        "eurobert",
        "wavtokenizer-dec",
        "modern-bert",
        "gemma-embedding",
        "dream",
        "llada",
        "llada-moe",
        "rnd1",
        "clef",
    }
)

#: Plain ``llama_kv_cache`` architectures whose load_arch_hparams (src/models/<arch>.cpp)
#: changes nothing the cache size depends on, checked against b11434. MLA (deepseek2,
#: minicpm3) and nextn/MTP layers (glm4moe, ...) are read from the generic keys.
PLAIN_ARCHS = frozenset(
    {
        "llama",
        "mistral3",
        "qwen",
        "qwen2",
        "qwen2moe",
        "qwen2vl",
        "qwen3",
        "qwen3moe",
        "qwen3vl",
        "qwen3vlmoe",
        "phi2",
        "phi3",
        "phimoe",
        "gemma",
        "granite",
        "granitemoe",
        "command-r",
        "starcoder",
        "starcoder2",
        "internlm2",
        "deepseek",
        "deepseek2",
        "minicpm",
        "minicpm3",
        "glm4",
        "glm4moe",
        "chatglm",
        "olmo",
        "olmoe",
        "stablelm",
        "exaone",
        "smollm3",
        "seed_oss",
        "ernie4_5",
        "dots1",
        "hunyuan-moe",
        "bailingmoe",
        "bailingmoe2",
        "arcee",
        "apertus",
        "falcon",
        "gpt2",
        "gptneox",
        "bloom",
        "mpt",
        "baichuan",
        "orion",
        "xverse",
        "refact",
        "codeshell",
        "minimax-m2",
        "grok",
        "dbrx",
        "arctic",
        "nemotron",
        "jais",
        "jais2",
        "plamo",
        "plm",
        "openelm",
        "bitnet",
        "chameleon",
        "pangu-embedded",
        "maincoder",
        "deci",
    }
)


@dataclass(frozen=True)
class SwaRule:
    """How an architecture picks its sliding-window layers (src/models/<arch>.cpp
    ``load_arch_hparams`` -> ``load_swa_pattern(ml, pattern, dense_first)``)."""

    pattern: int  # default period N: layer il is SWA iff il % N < N-1 (dense_first: il % N != 0)
    when: Literal[
        "always", "key>0", "key!=0"
    ]  # when SWA is on, judged by A.attention.sliding_window
    window: int | None = None  # None: read A.attention.sliding_window; else this fixed window
    default_window: int | None = None  # used when the key is absent (gemma2)
    dense_first: bool = False


SWA_RULES: dict[str, SwaRule] = {
    "gemma2": SwaRule(2, "always", default_window=4096),  # gemma2.cpp:4-10
    "gemma3": SwaRule(6, "key>0"),  # gemma3.cpp:4-12
    "cohere2": SwaRule(4, "always"),  # cohere2.cpp:4-9
    "olmo2": SwaRule(4, "key>0"),  # olmo2.cpp:6-16
    "gpt-oss": SwaRule(2, "always"),  # openai-moe.cpp:4-9
    "plamo3": SwaRule(8, "key>0"),  # plamo3.cpp:4-12
    "smallthinker": SwaRule(4, "key>0", window=4096, dense_first=True),  # smallthinker.cpp:4-16
    "llama4": SwaRule(4, "key!=0", window=8192),  # llama4.cpp:8-19 (chunked attention)
}

#: Hybrid attention + gated-delta-net layouts that use llama_memory_hybrid with the
#: "il < n_layer && !is_recr(il)" filters (src/llama-model.cpp create_memory; qwen3next.cpp:16-23).
HYBRID_INTERVAL_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe"})
#: Pure recurrent architectures (src/llama-arch.cpp:1110-1122).
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

#: Architectures with a cache the formula does not cover, and why.
SPECIAL_CACHES: dict[str, str] = {
    "minimax-m3": "an MSA indexer key cache (llama_kv_cache_msa)",
    "glm-dsa": "a DSA indexer cache (llama_kv_cache_dsa)",
    "deepseek32": "a DSA indexer cache (llama_kv_cache_dsa)",
    "hy_v4": "a DSA indexer cache (llama_kv_cache_dsa)",
    "dots3note": "a DSA indexer cache with SWA (llama_kv_cache_dsa_iswa)",
    "deepseek4": "the DeepSeek-V4 cache (llama_kv_cache_dsv4)",
    "glm5-next": "an indexer cache next to recurrent layers (llama_memory_hybrid_idx)",
    "qwen4exp": "an indexer cache next to recurrent layers (llama_memory_hybrid_idx)",
    "gemma3n": "layers that share KV (n_layer_kv_from_start)",
    "gemma4": "layers that share KV (shared_kv_layers)",
    "gemma4-assistant": "a draft cache that shares its target's KV",
    "eagle3": "a draft cache that lives next to its target's",
    "dflash": "a draft cache that lives next to its target's",
    "graniteswitch": "a router layer inside the nextn block",
    "t5": "an encoder-decoder cache",
    "t5encoder": "an encoder-only graph",
}
_HYBRID_OTHERS = frozenset(
    {
        "jamba",
        "falcon-h1",
        "plamo2",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "kimi-linear",
        "bailingmoe3",
        "kimi-k3",
        "minimax-01",
    }
)

Kind = Literal["attention", "iswa", "hybrid", "recurrent", "none"]


class EstimateUnsupported(LauncherError):
    """The model needs a cache the estimator does not model; no number is better than a guess."""

    fix = (
        "the memory guard leaves that model's KV memory to the server: measure it after the deploy"
    )

    def __init__(self, path: str, arch: str, why: str) -> None:
        self.path = path
        self.arch = arch
        super().__init__(
            f"cannot estimate the KV memory of {path} (architecture {arch!r}): {why}; "
            "measure it instead: start llama-server with -lv 4 and read its "
            "'llama_kv_cache: size = ... MiB' lines"
        )

    def details(self) -> dict[str, Any]:
        return {"model": self.path, "arch": self.arch}


# -- reading GGUF ------------------------------------------------------------------------------


@functools.cache
def _metadata_reader() -> type[Any]:
    """``gguf.GGUFReader`` with two slow paths replaced; imported lazily (numpy + gguf)."""
    import gguf
    import numpy as np
    from gguf.constants import GGUFValueType

    class MetadataReader(gguf.GGUFReader):
        """GGUFReader builds one numpy view per array element: 8-14 s for Llama 3's 128k
        tokens + 280k merges. Numeric arrays become one view; string arrays are skipped
        (length-prefixed strings, GGUF spec) and read back as []; tensor infos are not built
        (the estimator needs no tensor, the weights' size comes from the file)."""

        def _get_field_parts(
            self, orig_offs: int, raw_type: int
        ) -> tuple[int, list[Any], list[int], list[Any]]:
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs = orig_offs + 12
            itype = GGUFValueType(int(raw_itype[0]))
            count = int(alen[0])
            if itype == GGUFValueType.STRING:
                buf = self.data.data  # the memmap's buffer: struct reads it without numpy views
                little_endian = (sys.byteorder == "little") == (self.byte_order == "I")
                u64 = struct.Struct("<Q" if little_endian else ">Q").unpack_from
                for _ in range(count):
                    offs += 8 + u64(buf, offs)[0]
                return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is None:  # nested arrays: the general path
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, count)
            size = 12 + int(values.nbytes)
            return size, [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, itype]

        def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[Any]]:
            return offs, []

    return MetadataReader


def read_metadata(path: Path | str) -> dict[str, Any]:
    """The GGUF key/values of ``path``, without the vocabulary (the ``tokenizer.*`` arrays);
    other string arrays come back as []."""
    from gguf.constants import GGUFValueType

    reader = _metadata_reader()(str(path))
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
        and not (name.startswith("tokenizer.") and field.types[0] == GGUFValueType.ARRAY)
    }


_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@functools.cache
def _tensor_reader() -> type[Any]:
    """The metadata reader that also reads each tensor's name and size (no numpy views)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class TensorSizeReader(_metadata_reader()):  # type: ignore[misc]
        """Tensor infos (GGUF spec: name, n_dims, dims, type, offset) read with struct;
        a tensor's bytes are ggml_nbytes of its type and shape."""

        sizes: dict[str, int]

        def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[Any]]:
            buf = self.data.data
            little_endian = (sys.byteorder == "little") == (self.byte_order == "I")
            end = "<" if little_endian else ">"
            u32, u64 = struct.Struct(end + "I").unpack_from, struct.Struct(end + "Q").unpack_from
            self.sizes = {}
            for _ in range(count):
                n = u64(buf, offs)[0]
                name = bytes(buf[offs + 8 : offs + 8 + n]).decode("utf-8")
                offs += 8 + n
                n_dims = u32(buf, offs)[0]
                offs += 4
                elements = 1
                for i in range(n_dims):
                    elements *= u64(buf, offs + 8 * i)[0]
                offs += 8 * n_dims
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(u32(buf, offs)[0])]
                offs += 4 + 8  # type, then the data offset
                self.sizes[name] = elements * size // block
            return offs, []

    return TensorSizeReader


def read_tensor_sizes(path: Path | str) -> dict[str, int]:
    """Bytes of every weight tensor by name, over all files of a split model (what
    llama-server places on the host or a device, tensor by tensor)."""
    path = Path(path)
    md = read_metadata(path)
    count = int(md.get("split.count", 1) or 1)
    parts = [path]
    if count > 1 and (m := _SPLIT.match(path.name)):
        parts = [
            path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)
        ]
    sizes: dict[str, int] = {}
    for part in parts:
        sizes.update(_tensor_reader()(str(part)).sizes)
    return sizes


def weights_size(path: Path, md: dict[str, Any]) -> int:
    """Bytes of the model file, all splits included (llama_split_path "%s-%05d-of-%05d.gguf")."""
    count = int(md.get("split.count", 1) or 1)
    if count <= 1:
        return path.stat().st_size
    m = _SPLIT.match(path.name)
    if not m or int(md.get("split.no", 0)) != 0:
        raise ConfigInvalid(
            f"--model {path} is part of a {count}-file split model; "
            "give the first file (...-00001-of-NNNNN.gguf)"
        )
    total = 0
    for i in range(1, count + 1):
        part = path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
        try:
            total += part.stat().st_size
        except OSError as e:
            raise ConfigInvalid(f"split {part} of --model {path} is missing: {e}") from e
    return total


# -- the model's layout ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """The KV-relevant layout of a GGUF model, per layer over all ``block_count`` layers."""

    path: str
    arch: str
    name: str | None
    kind: Kind
    n_ctx_train: int
    n_embd: int
    n_layer_all: int
    n_layer_nextn: int  # MTP/nextn layers at the end: no KV in the server's main context
    head_count_kv: tuple[int, ...]
    head_dim_k: tuple[int, ...]
    head_dim_v: tuple[int, ...]
    is_swa: tuple[bool, ...]
    n_swa: int  # sliding window in tokens, 0 without SWA layers
    is_recurrent: tuple[bool, ...]
    mla: bool  # MLA: K holds the compressed latent, no V cache
    recurrent_row_floats: int  # n_embd_r + n_embd_s of one recurrent layer, one sequence
    file_size: int  # weights: the GGUF file(s)

    @classmethod
    def from_gguf(cls, path: Path | str) -> ModelInfo:
        """Read ``path``'s metadata (memory-mapped, no tensor data is touched)."""
        path = Path(path)
        try:
            md = read_metadata(path)
        except FileNotFoundError as e:
            raise ConfigInvalid(f"--model {path} does not exist; give the GGUF file") from e
        except (OSError, ValueError, KeyError, struct.error) as e:
            raise ConfigInvalid(
                f"--model {path} is not a readable GGUF file ({e}); give the .gguf model"
            ) from e
        return cls.from_metadata(md, str(path), weights_size(path, md))

    @classmethod
    def from_metadata(cls, md: dict[str, Any], path: str, file_size: int) -> ModelInfo:
        """Build from already-read key/values (see ``read_metadata``)."""
        arch = str(md.get("general.architecture", ""))
        if not arch:
            raise ConfigInvalid(f"--model {path} has no general.architecture; is it a model?")
        return _Layout(md, arch, path).build(file_size)

    # -- views --

    @property
    def n_layer(self) -> int:
        """Layers of the main model (without nextn/MTP layers)."""
        return self.n_layer_all - self.n_layer_nextn

    def k_width(self, il: int) -> int:
        """n_embd_k_gqa(il): K elements per cell of layer ``il``."""
        return self.head_dim_k[il] * self.head_count_kv[il]

    def v_width(self, il: int) -> int:
        """n_embd_v_gqa(il): V elements per cell of layer ``il``."""
        return self.head_dim_v[il] * self.head_count_kv[il]

    def has_kv(self, il: int) -> bool:
        """Whether layer ``il`` holds K/V in the server's main context."""
        if self.kind in ("recurrent", "none") or il >= self.n_layer:
            return False
        return not (self.kind == "hybrid" and self.is_recurrent[il])

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return tuple(il for il in range(self.n_layer_all) if self.has_kv(il))

    @property
    def n_recurrent_layers(self) -> int:
        return sum(1 for il in range(self.n_layer) if self.is_recurrent[il])

    def bytes_per_cell(self, ctk: str = "f16", ctv: str = "f16", swa: bool = False) -> int:
        """K+V bytes one cell costs over the full-attention (or, ``swa``, the SWA) layers."""
        total = 0
        for il in self.kv_layers:
            if self.is_swa[il] == swa:
                total += _row_bytes(ctk, self.k_width(il))
                if not self.mla:
                    total += _row_bytes(ctv, self.v_width(il))
        return total

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("head_count_kv", "head_dim_k", "head_dim_v", "is_swa", "is_recurrent"):
            data[key] = list(data[key])
        data["n_layer"] = self.n_layer
        data["kv_layers"] = len(self.kv_layers)
        return data


class _Layout:
    """Reads the per-layer hparams the way src/llama-model.cpp:1300-1480 does."""

    def __init__(self, md: dict[str, Any], arch: str, path: str) -> None:
        self.md, self.arch, self.path = md, arch, path

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def number(self, suffix: str, default: int | None = None) -> int:
        value = self.md.get(self.key(suffix), default)
        if value is None:
            raise EstimateUnsupported(self.path, self.arch, f"the GGUF has no {self.key(suffix)}")
        if isinstance(value, list):
            raise EstimateUnsupported(self.path, self.arch, f"{self.key(suffix)} is an array")
        return int(value)

    def per_layer(self, suffix: str, n: int, default: Sequence[int]) -> tuple[int, ...]:
        """Scalar (broadcast) or an array of exactly n values (llama-model-loader.cpp:473-480)."""
        value = self.md.get(self.key(suffix))
        if value is None:
            return tuple(default)
        if isinstance(value, list):
            if len(value) != n:
                raise EstimateUnsupported(
                    self.path,
                    self.arch,
                    f"{self.key(suffix)} has {len(value)} values, block_count is {n}",
                )
            return tuple(int(v) for v in value)
        return (int(value),) * n

    def unsupported(self) -> str | None:
        a = self.arch
        if a in SPECIAL_CACHES:
            return f"it needs {SPECIAL_CACHES[a]}, which the estimator does not model"
        if a in _HYBRID_OTHERS:
            return "its hybrid attention/recurrent layout is not modelled (only qwen3next/qwen35)"
        known = NO_CACHE_ARCHS | PLAIN_ARCHS | SWA_RULES.keys() | HYBRID_INTERVAL_ARCHS
        if a not in known | RECURRENT_ARCHS:
            return "the architecture has not been checked against llama.cpp b11434's cache code"
        return None

    def build(self, file_size: int) -> ModelInfo:
        why = self.unsupported()
        if why:
            raise EstimateUnsupported(self.path, self.arch, why)
        n_all = self.number("block_count")
        n_nextn = self.number("nextn_predict_layers", 0)
        n_layer = n_all - n_nextn
        n_embd = self.number("embedding_length", 0)
        heads = self.per_layer("attention.head_count", n_all, (0,) * n_all)
        heads_kv = self.per_layer("attention.head_count_kv", n_all, heads)
        hd0 = n_embd // heads[0] if heads[0] else 0
        hk = self.number("attention.key_length", hd0) if heads[0] else 0
        hv = self.number("attention.value_length", hd0) if heads[0] else 0
        hk_swa = self.number("attention.key_length_swa", hk)
        hv_swa = self.number("attention.value_length_swa", hv)
        is_swa, n_swa = self.swa_layers(n_all, n_layer)
        mla = (
            self.key("attention.key_length_mla") in self.md
            and self.key("attention.value_length_mla") in self.md
        )
        kind, is_recr, row = self.recurrence(n_all, n_layer, n_embd)
        if kind == "attention" and any(is_swa):
            kind = "iswa"
        return ModelInfo(
            path=self.path,
            arch=self.arch,
            name=self.md.get("general.name"),
            kind=kind,
            n_ctx_train=self.number("context_length"),
            n_embd=n_embd,
            n_layer_all=n_all,
            n_layer_nextn=n_nextn,
            head_count_kv=heads_kv,
            head_dim_k=tuple(hk_swa if s else hk for s in is_swa),
            head_dim_v=tuple(hv_swa if s else hv for s in is_swa),
            is_swa=is_swa,
            n_swa=n_swa if any(is_swa) else 0,
            is_recurrent=is_recr,
            mla=mla,
            recurrent_row_floats=row,
            file_size=file_size,
        )

    def swa_layers(self, n_all: int, n_layer: int) -> tuple[tuple[bool, ...], int]:
        """llama_model_base::load_swa_pattern + llama_hparams::set_swa_pattern
        (src/llama-model.cpp:3451-3458, src/llama-hparams.cpp:8-22)."""
        rule = SWA_RULES.get(self.arch)
        none = (False,) * n_all
        if rule is None:
            return none, 0
        key = self.md.get(self.key("attention.sliding_window"))
        if rule.when == "key>0" and not key:
            return none, 0
        if rule.when == "key!=0" and key is not None and int(key) == 0:
            return none, 0
        if rule.window is not None:
            window = rule.window
        else:
            window = self.number("attention.sliding_window", rule.default_window)
        pattern = self.md.get(self.key("attention.sliding_window_pattern"))
        if isinstance(pattern, list):
            flags = [bool(v) for v in pattern[:n_all]]
            return tuple(flags + [False] * (n_all - len(flags))), window
        n = rule.pattern if pattern is None else int(pattern)
        if rule.dense_first:
            flags = [n == 0 or il % n != 0 for il in range(n_layer)]
        else:
            flags = [n == 0 or il % n < n - 1 for il in range(n_layer)]
        return tuple(flags + [False] * (n_all - n_layer)), window

    def recurrence(
        self, n_all: int, n_layer: int, n_embd: int
    ) -> tuple[Kind, tuple[bool, ...], int]:
        """Which layers are recurrent and the floats one sequence's state costs per layer."""
        if self.arch in NO_CACHE_ARCHS:
            return "none", (False,) * n_all, 0
        if self.arch in RECURRENT_ARCHS:
            return "recurrent", (True,) * n_all, self.state_floats(n_embd)
        if self.arch not in HYBRID_INTERVAL_ARCHS:
            return "attention", (False,) * n_all, 0
        marks = self.md.get(self.key("attention.recurrent_layers"))
        if isinstance(marks, list):
            if len(marks) != n_all:
                raise EstimateUnsupported(
                    self.path,
                    self.arch,
                    f"attention.recurrent_layers has {len(marks)} values, block_count is {n_all}",
                )
            recr = tuple(bool(v) for v in marks)
        else:
            interval = self.number("full_attention_interval", 4)  # qwen3next.cpp:16-23
            recr = tuple(il < n_layer and (il + 1) % interval != 0 for il in range(n_all))
        return "hybrid", recr, self.state_floats(n_embd)

    def state_floats(self, n_embd: int) -> int:
        """n_embd_r() + n_embd_s() (src/llama-hparams.cpp:208-258)."""
        if self.arch.startswith(("rwkv", "arwkv")):
            head = self.number("wkv.head_size")
            return self.number("token_shift_count", 2) * n_embd + n_embd * head
        d_conv = self.number("ssm.conv_kernel")
        d_inner = self.number("ssm.inner_size")
        d_state = self.number("ssm.state_size")
        n_group = self.number("ssm.group_count", 0)
        conv = (d_conv - 1 if d_conv > 0 else 0) * (d_inner + 2 * n_group * d_state)
        return conv + d_state * d_inner


# -- the estimate --------------------------------------------------------------------------------


def bytes_per_element(cache_type: str) -> float:
    """Average bytes one element of ``cache_type`` takes (q8_0: 34/32 = 1.0625)."""
    block, size = CACHE_TYPES[cache_type]
    return size / block


def _row_bytes(cache_type: str, n: int) -> int:
    """ggml_row_size: bytes of ``n`` elements of ``cache_type``."""
    block, size = CACHE_TYPES[cache_type]
    return n // block * size


@dataclass(frozen=True)
class CacheSize:
    """One ``llama_kv_cache`` the server builds (it prints one ``size = ...`` line for each)."""

    label: str  # "kv", or "non-SWA" / "SWA" for the two caches of an iSWA model
    cells: int  # per stream
    streams: int
    layers: int
    k_bytes: int
    v_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.k_bytes + self.v_bytes

    @property
    def mib(self) -> float:
        return self.total_bytes / MIB


@dataclass(frozen=True)
class KvEstimate:
    """The KV (and recurrent state) memory llama-server allocates for one config."""

    ctk: str
    ctv: str
    flash_attn: bool
    caches: tuple[CacheSize, ...]
    recurrent_bytes: int
    recurrent_rows: int
    #: KV + recurrent bytes of each of the n_layer_all layers: a layer's cache lives on that
    #: layer's device (src/llama-kv-cache.cpp:212-221, ``model.dev_layer(il)``)
    per_layer: tuple[int, ...] = ()

    @property
    def k_bytes(self) -> int:
        return sum(c.k_bytes for c in self.caches)

    @property
    def v_bytes(self) -> int:
        return sum(c.v_bytes for c in self.caches)

    @property
    def total_bytes(self) -> int:
        return self.k_bytes + self.v_bytes + self.recurrent_bytes

    @property
    def total_mib(self) -> float:
        return self.total_bytes / MIB

    def to_dict(self) -> dict[str, Any]:
        return {
            "ctk": self.ctk,
            "ctv": self.ctv,
            "flash_attn": self.flash_attn,
            "caches": [{**asdict(c), "mib": round(c.mib, 2)} for c in self.caches],
            "k_bytes": self.k_bytes,
            "v_bytes": self.v_bytes,
            "recurrent_bytes": self.recurrent_bytes,
            "recurrent_rows": self.recurrent_rows,
            "total_bytes": self.total_bytes,
            "total_mib": round(self.total_mib, 2),
        }


def check_cache_types(info: ModelInfo | None, ctk: str, ctv: str, flash_attn: str) -> bool:
    """Refuse what llama-server refuses (src/llama-context.cpp:3838-3874); return FA on/off."""
    for flag, value in (("-ctk", ctk), ("-ctv", ctv)):
        if value not in CACHE_TYPES:
            raise ConfigInvalid(
                f"{flag} {value!r} is not a KV cache type; use one of {', '.join(CACHE_TYPES)}"
            )
    if flash_attn not in ("on", "off", "auto"):
        raise ConfigInvalid(f"-fa {flash_attn!r} is not on, off or auto")
    v_quantized = CACHE_TYPES[ctv][0] > 1
    if v_quantized and flash_attn == "off":
        raise ConfigInvalid(
            f"-ctv {ctv} is quantized and needs flash attention; drop -fa off or use -ctv f16"
        )
    # auto creates the cache with FA on (llama-context.cpp:232); Grok forces it off (:3819-3822)
    fa = flash_attn != "off" and (info is None or info.arch not in FA_OFF_ARCHS)
    if info is None:
        return fa
    if v_quantized and not fa:
        raise ConfigInvalid(
            f"-ctv {ctv} is quantized and needs flash attention, which llama-server turns off "
            f"for {info.arch}; use -ctv f16"
        )
    if info.mla and ctk != ctv:
        raise ConfigInvalid(
            f"{info.arch} uses MLA and needs the same K and V cache types; "
            f"got -ctk {ctk} -ctv {ctv}, use -ctk {ctk} -ctv {ctk}"
        )
    for flag, value, dims in (("-ctk", ctk, info.head_dim_k), ("-ctv", ctv, info.head_dim_v)):
        block = CACHE_TYPES[value][0]
        bad = sorted({d for d in dims[: info.n_layer] if d % block})
        if bad:
            raise ConfigInvalid(
                f"{flag} {value} has blocks of {block}, which do not divide the head size "
                f"{bad[0]} of {info.path}; use f16 (or bf16/f32) for this model"
            )
    return fa


def estimate(
    info: ModelInfo,
    plan: PoolPlan,
    ctk: str = "f16",
    ctv: str = "f16",
    flash_attn: str = "auto",
    n_ubatch: int = DEFAULT_UBATCH,
    swa_full: bool = False,
    n_batch: int = DEFAULT_BATCH,
) -> KvEstimate:
    """The bytes llama-server b11434 allocates for ``info`` under ``plan``.

    ``flash_attn`` is ``-fa``: with ``off`` the V cache is stored transposed and every layer's V
    row is as wide as the widest (TAG_V_CACHE_VARIABLE). Raises ``ConfigInvalid`` for cache
    types the server would refuse for this model.
    """
    fa = check_cache_types(info, ctk, ctv, flash_attn)
    streams = plan.streams
    size_base = plan.n_ctx_seq
    n_ubatch_eff = min(min(plan.n_ctx, n_batch), n_ubatch)  # llama-context.cpp:248-250
    if swa_full:
        size_swa = size_base
    else:
        seqs = plan.n_slots if plan.kv_unified else 1
        size_swa = pad(min(size_base, info.n_swa * seqs + n_ubatch_eff))
    v_max = max((info.v_width(il) for il in range(info.n_layer_all)), default=0)

    per_layer = [0] * info.n_layer_all

    def cache(label: str, cells: int, layers: list[int]) -> CacheSize:
        width: Callable[[int], int] = (lambda il: v_max) if not fa else info.v_width
        k = v = 0
        for il in layers:
            k_il = _row_bytes(ctk, info.k_width(il)) * cells * streams
            v_il = 0 if info.mla else _row_bytes(ctv, width(il)) * cells * streams
            per_layer[il] += k_il + v_il
            k, v = k + k_il, v + v_il
        return CacheSize(label, cells, streams, len(layers), k, v)

    layers = info.kv_layers
    caches: tuple[CacheSize, ...] = ()
    if info.kind == "iswa":
        base = [il for il in layers if not info.is_swa[il]]
        swa = [il for il in layers if info.is_swa[il]]
        caches = (cache("non-SWA", size_base, base), cache("SWA", size_swa, swa))
    elif layers:
        caches = (cache("kv", size_base, list(layers)),)
    rows = max(1, plan.n_slots) if info.kind in ("hybrid", "recurrent") else 0
    row_bytes = info.recurrent_row_floats * RECURRENT_STATE_BYTES * rows
    for il in range(info.n_layer):
        if info.is_recurrent[il]:
            per_layer[il] += row_bytes
    recurrent = info.n_recurrent_layers * row_bytes
    return KvEstimate(ctk, ctv, fa, caches, recurrent, rows, tuple(per_layer))
