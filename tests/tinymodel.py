"""Write a tiny, deterministic, random-weight llama GGUF with the ``gguf`` package.

It loads in milliseconds, answers real chat completions (gibberish) and has a real KV cache,
so a small shared pool overflows on demand. The shape is a parameter: the KV-memory tests
need several. The head dimension must be a multiple of 32, or llama-server refuses quantized
cache types (``K cache type q8_0 with block size 32 does not divide n_embd_head_k=16``).

Usage: ``python tests/tinymodel.py OUT.gguf [--layers N --heads N --kv-heads N ...]``
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = ["the", "a", "river", "model", "token", "cache", "slot", "pool", "hello", "world",
         "agent", "server", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]


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


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]  # UNKNOWN, CONTROL, CONTROL
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256  # BYTE
    for w in WORDS:
        tokens.append("\u2581" + w if not w.startswith("<|") else w)
        types.append(1)  # NORMAL
    scores = [0.0] * 3 + [0.0] * 256 + [-float(i + 1) for i in range(len(WORDS))]
    return tokens, scores, types


def write(path: Path | str, shape: Shape = Shape(), seed: int = 0) -> Path:
    """Write the model to ``path`` and return it. Same shape and seed, same bytes."""
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    n_vocab, e, hd = len(tokens), shape.n_embd, shape.hd
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name("llama-launcher tiny test model")
    w.add_context_length(shape.ctx_train)
    w.add_embedding_length(e)
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
            w.add_array(key, value)
        else:
            w.add_string(key, str(value))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHATML)

    def t(name: str, *dims: int) -> None:
        data = (rng.standard_normal(dims) * 0.02).astype(np.float32)
        w.add_tensor(name, data)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    t("token_embd.weight", n_vocab, e)
    ones("output_norm.weight", e)
    t("output.weight", n_vocab, e)
    for il in range(shape.layers):
        kvh = shape.kv_heads_of(il)
        ones(f"blk.{il}.attn_norm.weight", e)
        t(f"blk.{il}.attn_q.weight", shape.heads * hd, e)
        t(f"blk.{il}.attn_k.weight", kvh * hd, e)
        t(f"blk.{il}.attn_v.weight", kvh * hd, e)
        t(f"blk.{il}.attn_output.weight", e, shape.heads * hd)
        ones(f"blk.{il}.ffn_norm.weight", e)
        t(f"blk.{il}.ffn_gate.weight", shape.ff, e)
        t(f"blk.{il}.ffn_up.weight", shape.ff, e)
        t(f"blk.{il}.ffn_down.weight", e, shape.ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
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
    shape = Shape(layers=a.layers, n_embd=a.embd, heads=a.heads, kv_heads=a.kv_heads,
                  head_dim=a.head_dim, ctx_train=a.ctx_train)
    print(write(a.out, shape, a.seed))


if __name__ == "__main__":
    main()
