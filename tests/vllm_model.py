"""Write a tiny, deterministic, random-weight Llama model folder that vLLM serves on a CPU.

Run by the vLLM venv's python (scripts/setup --vllm; it has torch, transformers, tokenizers and
safetensors), not the project's: tests/realvllm.py ``tiny_model()`` does, once per machine.

The model is about 1 MB: a byte-level BPE tokenizer trained here on a few sentences (no
downloads), with the special tokens and a chat template, and a 2-layer Llama saved as bfloat16
safetensors. Its answers are gibberish that stops on ``max_tokens`` (``finish_reason:
"length"``). vLLM's CPU attention takes head sizes 32, 64, 80, ... only
(vllm/v1/attention/backends/cpu_attn.py), hence hidden 128 over 4 heads.

Usage: ``python tests/vllm_model.py OUTDIR [--no-tokenizer]``; ``--no-tokenizer`` writes the
same folder without any tokenizer file, which vLLM must refuse. A folder that already has
``config.json`` and ``model.safetensors`` is left as it is; a new one is written beside it
and renamed into place.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

SEED = 1234
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = [
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
CORPUS = [
    "Hello! How are you today? I am a tiny model served by vLLM on a CPU.",
    "The launcher deploys a server, waits for its health check and asks it a real question.",
    "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.",
    "Tokens, caches, slots and pools: 0 1 2 3 4 5 6 7 8 9, and a river runs to the sea.",
    "What is the answer? Write a short story about an agent, a model and a deployment.",
]


def tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on ``CORPUS``, with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write(out: Path, no_tokenizer: bool) -> None:
    """The model folder into ``out`` (which exists and is empty)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    tok = tokenizer()
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    ).save_pretrained(out)
    if not no_tokenizer:
        tok.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    for path in out.iterdir():  # safetensors writes 0600: a service's own user reads the model
        path.chmod(0o644)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--no-tokenizer", action="store_true", help="leave the tokenizer out")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out: Path = args.outdir
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(tmp, args.no_tokenizer)
        tmp.chmod(0o755)
        if out.exists():  # a folder without the model: what a killed run of an older script left
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
