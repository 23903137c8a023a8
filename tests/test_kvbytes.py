"""launcher.server.kvbytes without a server: the formula's parts, the GGUF reading, and the
refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import tinymodel

from launcher.errors import ConfigInvalid, LauncherError
from launcher.server import kvbytes, kvlayout

KIB, MIB, GIB = 1024, 1024**2, 1024**3


def md(arch: str, **keys: Any) -> dict[str, Any]:
    """GGUF key/values of a model: general.architecture plus ``arch.``-prefixed keys."""
    data: dict[str, Any] = {"general.architecture": arch}
    data.update({f"{arch}.{k.replace('__', '.')}": v for k, v in keys.items()})
    return data


def llama31_8b(**extra: Any) -> dict[str, Any]:
    keys: dict[str, Any] = dict(
        context_length=131072,
        block_count=32,
        embedding_length=4096,
        attention__head_count=32,
        attention__head_count_kv=8,
    )
    return md("llama", **{**keys, **extra})


def info_of(data: dict[str, Any]) -> kvbytes.ModelInfo:
    return kvbytes.ModelInfo.from_metadata(data, "model.gguf", 0)


@pytest.mark.parametrize(
    ("name", "block", "size"),
    [
        ("f32", 1, 4),
        ("f16", 1, 2),
        ("bf16", 1, 2),
        ("q8_0", 32, 34),
        ("q4_0", 32, 18),
        ("q4_1", 32, 20),
        ("iq4_nl", 32, 18),
        ("q5_0", 32, 22),
        ("q5_1", 32, 24),
    ],
)
def test_cache_type_sizes_are_ggmls(name: str, block: int, size: int) -> None:
    assert kvbytes.CACHE_TYPES[name] == (block, size)
    quant = gguf.GGMLQuantizationType[name.upper()]
    assert gguf.GGML_QUANT_SIZES[quant] == (block, size)


def test_llama31_8b_costs_128_kib_per_cell_at_f16_and_68_at_q8_0() -> None:
    info = info_of(llama31_8b())
    assert info.bytes_per_cell("f16", "f16") == 128 * KIB
    assert info.bytes_per_cell("q8_0", "q8_0") == 68 * KIB
    est = kvbytes.estimate(info, kvlayout.resolve(131072, 1, None, 0, 131072), "f16", "f16")
    assert est.total_bytes == 16 * GIB
    assert (est.k_bytes, est.v_bytes) == (8 * GIB, 8 * GIB)


def test_unified_and_split_cost_the_same_cells() -> None:
    info = info_of(llama31_8b())
    unified = kvbytes.estimate(info, kvlayout.resolve(65536, 4, True, 0, 131072))
    split = kvbytes.estimate(info, kvlayout.resolve(65536, 4, False, 0, 131072))
    assert unified.total_bytes == split.total_bytes == 65536 * 128 * KIB
    assert (unified.caches[0].streams, split.caches[0].streams) == (1, 4)
    assert (unified.caches[0].cells, split.caches[0].cells) == (65536, 16384)


def test_key_and_value_length_override_n_embd_over_heads() -> None:
    info = info_of(llama31_8b(attention__key_length=192, attention__value_length=128))
    assert info.head_dim_k[0] == 192 and info.head_dim_v[0] == 128
    assert info.bytes_per_cell("f16", "f16") == 32 * 8 * (192 + 128) * 2


def test_per_layer_head_count_kv_array() -> None:
    info = info_of(
        md(
            "deci",
            context_length=4096,
            block_count=3,
            embedding_length=1024,
            attention__head_count=8,
            attention__head_count_kv=[8, 0, 2],
        )
    )
    assert [info.k_width(il) for il in range(3)] == [1024, 0, 256]
    plan = kvlayout.resolve(1024, 1, None, 0, 4096)
    with_fa = kvbytes.estimate(info, plan, "f16", "f16", "auto")
    without = kvbytes.estimate(info, plan, "f16", "f16", "off")
    assert with_fa.v_bytes == (1024 + 0 + 256) * 2 * 1024
    # v_trans: every layer's V row is as wide as the widest layer's (TAG_V_CACHE_VARIABLE)
    assert without.v_bytes == 3 * 1024 * 2 * 1024
    assert without.k_bytes == with_fa.k_bytes


def test_head_count_kv_array_must_cover_every_layer() -> None:
    with pytest.raises(kvbytes.EstimateUnsupported, match="has 2 values, block_count is 3"):
        info_of(
            md(
                "deci",
                context_length=4096,
                block_count=3,
                embedding_length=1024,
                attention__head_count=8,
                attention__head_count_kv=[8, 2],
            )
        )


def test_pool_cells_are_padded_to_256() -> None:
    info = info_of(llama31_8b())
    est = kvbytes.estimate(info, kvlayout.resolve(1000, 3, False, 0, 131072))
    assert est.caches[0].cells == 512 and est.caches[0].streams == 3


def gemma2(**extra: Any) -> dict[str, Any]:
    return md(
        "gemma2",
        context_length=8192,
        block_count=4,
        embedding_length=2304,
        attention__head_count=8,
        attention__head_count_kv=4,
        attention__key_length=256,
        attention__value_length=256,
        **extra,
    )


def test_sliding_window_layers_hold_window_times_seqs_plus_ubatch() -> None:
    info = info_of(gemma2(attention__sliding_window=4096))
    assert info.is_swa == (True, False, True, False) and info.n_swa == 4096
    unified = kvbytes.estimate(info, kvlayout.resolve(32768, 4, True, 0, 8192), n_ubatch=512)
    base, swa = unified.caches
    assert (base.label, base.cells, base.layers) == ("non-SWA", 32768, 2)
    # min(32768, 4096 * 4 seqs + 512) padded to 256
    assert (swa.label, swa.cells, swa.layers) == ("SWA", 16896, 2)
    split = kvbytes.estimate(info, kvlayout.resolve(32768, 4, False, 0, 8192))
    assert split.caches[1].cells == 4608 and split.caches[1].streams == 4  # 4096 + 512
    full = kvbytes.estimate(info, kvlayout.resolve(32768, 4, True, 0, 8192), swa_full=True)
    assert full.caches[1].cells == 32768


def test_gemma2_defaults_to_a_4096_window_and_gemma3_needs_the_key() -> None:
    assert info_of(gemma2()).n_swa == 4096
    g3 = md(
        "gemma3",
        context_length=8192,
        block_count=6,
        embedding_length=1024,
        attention__head_count=4,
        attention__head_count_kv=1,
    )
    assert info_of(g3).kind == "attention"
    with_key = info_of({**g3, "gemma3.attention.sliding_window": 512})
    assert with_key.kind == "iswa"
    assert with_key.is_swa == (True,) * 5 + (False,)


def test_llama4_chunked_window_is_fixed_and_zero_turns_it_off() -> None:
    base = md(
        "llama4",
        context_length=8192,
        block_count=8,
        embedding_length=1024,
        attention__head_count=8,
        attention__head_count_kv=2,
    )
    chunked = info_of(base)
    assert chunked.n_swa == 8192 and sum(chunked.is_swa) == 6
    assert info_of({**base, "llama4.attention.sliding_window": 0}).kind == "attention"


def test_mla_has_no_v_cache_and_needs_equal_types() -> None:
    deepseek = md(
        "deepseek2",
        context_length=163840,
        block_count=4,
        embedding_length=7168,
        attention__head_count=128,
        attention__head_count_kv=1,
        attention__key_length=576,
        attention__value_length=512,
        attention__key_length_mla=192,
        attention__value_length_mla=128,
    )
    info = info_of(deepseek)
    assert info.mla
    est = kvbytes.estimate(info, kvlayout.resolve(4096, 1, None, 0, 163840), "q8_0", "q8_0")
    assert est.v_bytes == 0
    assert est.k_bytes == 4 * (576 // 32 * 34) * 4096
    with pytest.raises(ConfigInvalid, match="MLA and needs the same K and V cache types"):
        kvbytes.estimate(info, kvlayout.resolve(4096, 1, None, 0, 163840), "q8_0", "f16")


def test_nextn_layers_hold_no_kv_in_the_main_context() -> None:
    glm = {k.replace("llama.", "glm4moe."): v for k, v in llama31_8b(block_count=33).items()}
    info = info_of({**glm, "general.architecture": "glm4moe", "glm4moe.nextn_predict_layers": 1})
    assert info.n_layer == 32 and len(info.kv_layers) == 32
    assert info.bytes_per_cell() == 128 * KIB


def qwen3next(**extra: Any) -> dict[str, Any]:
    return md(
        "qwen3next",
        context_length=262144,
        block_count=48,
        embedding_length=2048,
        attention__head_count=16,
        attention__head_count_kv=2,
        attention__key_length=256,
        attention__value_length=256,
        ssm__conv_kernel=4,
        ssm__inner_size=4096,
        ssm__state_size=128,
        ssm__group_count=16,
        ssm__time_step_rank=32,
        **extra,
    )


def test_hybrid_kv_only_every_interval_and_state_scales_with_slots() -> None:
    info = info_of(qwen3next())
    assert info.kv_layers == tuple(range(3, 48, 4))
    assert info.n_recurrent_layers == 36
    one = kvbytes.estimate(info, kvlayout.resolve(262144, 1, None, 0, 262144))
    four = kvbytes.estimate(info, kvlayout.resolve(262144, 4, True, 0, 262144))
    assert one.k_bytes + one.v_bytes == four.k_bytes + four.v_bytes == 12 * 2 * 512 * 2 * 262144
    # (d_conv-1)(d_inner + 2 n_group d_state) + d_state d_inner, F32, per layer and sequence
    row = 3 * (4096 + 2 * 16 * 128) + 128 * 4096
    assert one.recurrent_bytes == 36 * row * 4
    assert four.recurrent_bytes == 4 * one.recurrent_bytes
    split = kvbytes.estimate(info, kvlayout.resolve(262144, 4, False, 0, 262144))
    assert split.recurrent_bytes == four.recurrent_bytes  # -kvu does not matter


def test_hybrid_recurrent_layers_array_wins_over_the_interval() -> None:
    marks = [i % 2 == 0 for i in range(48)]
    info = info_of(qwen3next(attention__recurrent_layers=marks, full_attention_interval=4))
    assert info.kv_layers == tuple(range(1, 48, 2))


def test_pure_recurrent_model_has_only_state() -> None:
    mamba = md(
        "mamba",
        context_length=1048576,
        block_count=64,
        embedding_length=2560,
        ssm__conv_kernel=4,
        ssm__inner_size=5120,
        ssm__state_size=16,
    )
    info = info_of(mamba)
    est = kvbytes.estimate(info, kvlayout.resolve(4096, 2, None, 0, 1048576))
    assert est.caches == ()
    assert est.recurrent_bytes == 64 * (3 * 5120 + 16 * 5120) * 4 * 2


def test_embedding_models_have_no_cache() -> None:
    bert = md(
        "bert", context_length=512, block_count=12, embedding_length=768, attention__head_count=12
    )
    est = kvbytes.estimate(info_of(bert), kvlayout.resolve(512, 1, None, 0, 512))
    assert est.total_bytes == 0


@pytest.mark.parametrize(
    ("arch", "reason"),
    [
        ("deepseek32", "DSA indexer cache"),
        ("minimax-m3", "MSA indexer"),
        ("qwen4exp", "llama_memory_hybrid_idx"),
        ("gemma3n", "share KV"),
        ("jamba", "hybrid attention/recurrent layout"),
        ("no-such-arch", "has not been checked"),
    ],
)
def test_refuses_caches_it_does_not_model(arch: str, reason: str) -> None:
    with pytest.raises(kvbytes.EstimateUnsupported, match=reason) as e:
        info_of(md(arch, context_length=4096, block_count=2, embedding_length=128))
    assert isinstance(e.value, LauncherError)
    assert repr(arch) in str(e.value) and "-lv 4" in str(e.value)


@pytest.mark.parametrize(
    ("ctk", "ctv", "fa", "message"),
    [
        ("q9_0", "f16", "auto", "'q9_0' is not a KV cache type; use one of f32, f16"),
        ("f16", "q8_0", "off", "-ctv q8_0 is quantized and needs flash attention; drop -fa off"),
        ("q8_0", "f16", "auto", "do not divide the head size 16"),
    ],
)
def test_refuses_cache_types_the_server_refuses(ctk: str, ctv: str, fa: str, message: str) -> None:
    info = info_of(
        md(
            "llama",
            context_length=4096,
            block_count=2,
            embedding_length=64,
            attention__head_count=4,
        )
    )
    with pytest.raises(ConfigInvalid, match=message):
        kvbytes.estimate(info, kvlayout.resolve(4096, 1, None, 0, 4096), ctk, ctv, fa)


def test_fast_reader_agrees_with_ggufreader(tmp_path: Path) -> None:
    path = tinymodel.write(
        tmp_path / "m.gguf",
        tinymodel.Shape(
            arch="gemma3",
            layers=4,
            kv_heads=1,
            extra={
                "gemma3.attention.sliding_window": 64,
                "gemma3.attention.sliding_window_pattern": [True, False, True, False],
            },
        ),
    )
    ours = kvbytes.read_metadata(path)
    upstream = gguf.GGUFReader(str(path))
    array = gguf.GGUFValueType.ARRAY
    expected = {
        name: field.contents()
        for name, field in upstream.fields.items()
        if not name.startswith("GGUF.")
        and not (name.startswith("tokenizer.") and field.types[0] == array)
    }
    assert ours == expected
    assert ours["gemma3.attention.sliding_window_pattern"] == [True, False, True, False]
    assert "tokenizer.ggml.tokens" not in ours and ours["tokenizer.ggml.model"] == "llama"


def test_model_info_from_a_real_file(tiny_model: Path) -> None:
    info = kvbytes.ModelInfo.from_gguf(tiny_model)
    assert (info.arch, info.n_ctx_train, info.n_layer_all) == ("llama", 4096, 2)
    assert info.head_count_kv == (2, 2) and info.head_dim_k == (32, 32)
    assert info.file_size == tiny_model.stat().st_size
    assert info.to_dict()["kv_layers"] == 2


def test_not_a_gguf_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    with pytest.raises(ConfigInvalid, match=r"notes.txt is not a readable GGUF file"):
        kvbytes.ModelInfo.from_gguf(bad)
    with pytest.raises(ConfigInvalid, match="does not exist"):
        kvbytes.ModelInfo.from_gguf(tmp_path / "missing.gguf")


def test_split_models_count_every_part(tmp_path: Path) -> None:
    for i, size in enumerate((100, 200, 300), start=1):
        (tmp_path / f"m-{i:05d}-of-00003.gguf").write_bytes(b"\0" * size)
    split = {"split.count": 3, "split.no": 0}
    assert kvbytes.weights_size(tmp_path / "m-00001-of-00003.gguf", split) == 600
    with pytest.raises(ConfigInvalid, match="give the first file"):
        kvbytes.weights_size(tmp_path / "m-00002-of-00003.gguf", {**split, "split.no": 1})
