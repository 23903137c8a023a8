"""Write a tiny, deterministic, random-weight llama GGUF with the ``gguf`` package.

It loads in milliseconds, answers real chat completions (gibberish) and has a real KV cache,
so a small shared pool overflows on demand. The shape is a parameter: the KV-memory tests
need several. The head dimension must be a multiple of 32, or llama-server refuses quantized
cache types (``K cache type q8_0 with block size 32 does not divide n_embd_head_k=16``).

Architectures (``Shape.arch``), each with the tensors llama.cpp b11434 loads for it
(src/models/<arch>.cpp ``load_arch_tensors``):

- ``llama``: one K/V width for every layer (llama.cpp sizes the tensors from layer 0).
- ``deci``: per-layer ``kv_heads`` (a list); a layer with 0 KV heads is a linear-attention
  layer without K/V projections (DeciLM).
- ``gemma2`` / ``gemma3``: sliding-window attention; ``extra`` carries
  ``{arch}.attention.sliding_window`` (and optionally ``..._pattern``). gemma3 turns SWA on only
  when the window is > 0; gemma2 defaults to 4096.

Usage: ``python tests/tinymodel.py OUT.gguf [--layers N --heads N --kv-heads N ...]``
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# fmt: off
WORDS = ["", "the", "a", "river", "model", "token", "cache", "slot", "pool", "hello", "world",
         "agent", "server", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
# fmt: on


@dataclass(frozen=True)
class Shape:
    """The attention layout of a generated model."""

    layers: int = 2
    n_embd: int = 128
    heads: int = 4
    kv_heads: int | list[int] = 2
    head_dim: int | None = None  # None: n_embd // heads
    ff: int = 256
    ctx_train: int = 4096
    arch: str = "llama"
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.heads

    def kv_heads_of(self, il: int) -> int:
        return self.kv_heads[il] if isinstance(self.kv_heads, list) else self.kv_heads


#: The bytes that have a byte token: printable ASCII and the newline. Whatever the random
#: weights generate then decodes to valid text; b9093 answers 500 ``Failed to parse input``
#: when a completion holds a lone byte of a UTF-8 sequence (0x80-0xFF), as a vocabulary with
#: all 256 byte tokens produces. The bare "\u2581" (a space, WORDS[0]) keeps the tokenizer
#: from falling back to the bytes of that character, which have no token then.
TEXT_BYTES = (0x0A, *range(0x20, 0x7F))


FILLER = 256 - len(TEXT_BYTES)


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]  # UNKNOWN, CONTROL, CONTROL
    tokens += [f"<0x{b:02X}>" for b in TEXT_BYTES]
    types += [6] * len(TEXT_BYTES)  # BYTE
    for w in WORDS:
        tokens.append("\u2581" + w if not w.startswith("<|") else w)
        types.append(1)  # NORMAL
    # filler text tokens keep the vocabulary about its old size (276), so end-of-sequence is as
    # rare in a random completion as it was with all 256 byte tokens
    tokens += [f"w{i}" for i in range(FILLER)]
    types += [1] * FILLER
    scores = [0.0] * 3 + [0.0] * len(TEXT_BYTES) + [-float(i + 1) for i in range(len(WORDS))]
    scores += [-float(len(WORDS) + i + 1) for i in range(FILLER)]
    return tokens, scores, types


def _tensors(shape: Shape, n_vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, is a norm of ones) of every tensor llama.cpp loads for ``shape``."""
    e, hd, ff = shape.n_embd, shape.hd, shape.ff
    gemma = shape.arch in ("gemma2", "gemma3")
    out: list[tuple[str, tuple[int, ...], bool]] = [
        ("token_embd.weight", (n_vocab, e), False),
        ("output_norm.weight", (e,), True),
    ]
    if not gemma:  # gemma ties the output to token_embd
        out.append(("output.weight", (n_vocab, e), False))
    for il in range(shape.layers):
        kvh = shape.kv_heads_of(il)
        blk = f"blk.{il}."
        out.append((blk + "attn_norm.weight", (e,), True))
        if kvh == 0:  # deci linear attention: no Q/K/V, a square output projection
            out.append((blk + "attn_output.weight", (e, e), False))
        else:
            out += [
                (blk + "attn_q.weight", (shape.heads * hd, e), False),
                (blk + "attn_k.weight", (kvh * hd, e), False),
                (blk + "attn_v.weight", (kvh * hd, e), False),
                (blk + "attn_output.weight", (e, shape.heads * hd), False),
            ]
        if gemma:
            out += [
                (blk + "post_attention_norm.weight", (e,), True),
                (blk + "post_ffw_norm.weight", (e,), True),
            ]
        if shape.arch == "gemma3":
            out += [
                (blk + "attn_q_norm.weight", (hd,), True),
                (blk + "attn_k_norm.weight", (hd,), True),
            ]
        out += [
            (blk + "ffn_norm.weight", (e,), True),
            (blk + "ffn_gate.weight", (ff, e), False),
            (blk + "ffn_up.weight", (ff, e), False),
            (blk + "ffn_down.weight", (e, ff), False),
        ]
    return out


def _writer(
    path: Path, shape: Shape, vocab: tuple[list[str], list[float], list[int]], merges: int = 0
) -> Any:
    """A GGUFWriter with every key/value of ``shape`` added (no tensors yet)."""
    import gguf

    tokens, scores, types = vocab
    hd = shape.hd
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name("llama-launcher tiny test model")
    w.add_context_length(shape.ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ff)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if shape.head_dim is not None:
        w.add_key_length(hd)
        w.add_value_length(hd)
    for key, value in shape.extra.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)  # bools stay bools: a per-layer pattern
        else:
            w.add_string(key, str(value))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if merges:
        w.add_token_merges([f"t{i} m{i}" for i in range(merges)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHATML)
    return w


def write(path: Path | str, shape: Shape = Shape(), seed: int = 0) -> Path:
    """Write the model to ``path`` and return it. Same shape and seed, same bytes."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    vocab = _vocab()
    w = _writer(path, shape, vocab)
    for name, dims, is_norm in _tensors(shape, len(vocab[0])):
        if is_norm:
            w.add_tensor(name, np.ones(dims, dtype=np.float32))
        else:
            w.add_tensor(name, (rng.standard_normal(dims) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_layout(
    path: Path | str, shape: Shape, n_vocab: int = 128256, merges: int = 280147
) -> Path:
    """A real-size GGUF without its weights: the metadata (with an ``n_vocab`` vocabulary and
    ``merges`` BPE merges, Llama 3's sizes by default) and every tensor declared at full size
    as Q8_0, the data left as a hole (a sparse file). Metadata readers see a real model file;
    llama-server cannot run it (the weights are zeros)."""
    import gguf

    path = Path(path)
    tokens, scores, types = _vocab()
    extra = n_vocab - len(tokens)
    vocab = (
        tokens + [f"tok{i}" for i in range(extra)],
        scores + [0.0] * extra,
        types + [1] * extra,
    )
    w = _writer(path, shape, vocab, merges)
    q8 = gguf.GGMLQuantizationType.Q8_0
    block, size = gguf.GGML_QUANT_SIZES[q8]
    data = 0
    for name, dims, is_norm in _tensors(shape, n_vocab):
        n = int(np.prod(dims))
        if is_norm:
            w.add_tensor_info(name, dims, np.dtype(np.float32), n * 4)
            nbytes = n * 4
        else:
            nbytes = n // block * size
            byte_dims = (*dims[:-1], dims[-1] // block * size)
            w.add_tensor_info(name, byte_dims, np.dtype(np.uint8), nbytes, raw_dtype=q8)
        data += -(-nbytes // gguf.GGUF_DEFAULT_ALIGNMENT) * gguf.GGUF_DEFAULT_ALIGNMENT
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    start = -(-path.stat().st_size // gguf.GGUF_DEFAULT_ALIGNMENT) * gguf.GGUF_DEFAULT_ALIGNMENT
    os.truncate(path, start + data)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description="Write a tiny random-weight llama GGUF.")
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--ctx-train", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    shape = Shape(
        layers=a.layers,
        n_embd=a.embd,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        ctx_train=a.ctx_train,
    )
    print(write(a.out, shape, a.seed))


if __name__ == "__main__":
    main()
