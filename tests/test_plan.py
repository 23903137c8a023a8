"""``plan``: seed 000's table for its box, with the figures the KV formula predicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tinymodel

from launcher.errors import ConfigInvalid
from launcher.reports import plan

KIB, MIB, GIB = 1024, 1024**2, 1024**3
CRAM = 8 * GIB  # the default --cache-ram the deploy's memory guard counts
SLOTS, WINDOW = 4, 262144  # seed 000: four agents, 262k each
#: Llama-3.1-8B's attention: 32 layers, 32 heads, 8 KV heads, head dim 128, n_embd 4096.
LLAMA_8B = tinymodel.Shape(layers=32, n_embd=4096, heads=32, kv_heads=8, ff=14336, ctx_train=262144)


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 8B layout with every tensor declared at full size (sparse file, no weights)."""
    path = tmp_path_factory.mktemp("plan") / "llama8b-layout.gguf"
    return tinymodel.write_layout(path, LLAMA_8B, n_vocab=512, merges=0)


def weights(path: Path) -> int:
    return path.stat().st_size


def test_seed_box_figures(llama8b: Path) -> None:
    box = 120 * GIB
    p = plan.make_plan(SLOTS, WINDOW, "q8_0", llama8b, available=box)
    assert p.model is not None and p.model.n_ctx_train == 262144
    # f16: 32 layers x (K + V) x 8 heads x 128 x 2 bytes = 128 KiB per cell; q8_0 68; q4_0 36
    assert p.model.info is not None
    assert p.model.info.bytes_per_cell("f16", "f16") == 128 * KIB
    assert p.model.info.bytes_per_cell("q8_0", "q8_0") == 68 * KIB
    assert p.model.info.bytes_per_cell("q4_0", "q4_0") == 36 * KIB
    expected = {
        # key: (guaranteed window, promised n_ctx_slot, pool cells, KV MiB)
        "shared": (65536, 262144, 262144, 17408.0),
        "split": (65536, 65536, 262144, 17408.0),
        "per-slot-f16": (262144, 262144, 1048576, 131072.0),
        "per-slot-q8_0": (262144, 262144, 1048576, 69632.0),
        "per-slot-q4_0": (262144, 262144, 1048576, 36864.0),
    }
    got = {
        o.key: (o.guaranteed_window, o.pool.n_ctx_slot, o.pool.n_ctx, o.kv_mib) for o in p.options
    }
    assert got == expected
    for o in p.options:
        assert o.kv is not None
        assert o.free_bytes == box - weights(llama8b) - o.kv.total_bytes - CRAM
    assert p.option("shared").pool.overcommitted
    assert not p.option("per-slot-q8_0").pool.overcommitted
    assert p.option("per-slot-f16").fits() is False  # 128 GiB of KV on a 120 GiB box
    # seed 000 chose B: full 262k for every slot at 8 bit
    assert p.recommended == "per-slot-q8_0"
    assert p.recommendation.set_command == (
        "llama-launcher set -c 1048576 -np 4 -kvu --kv-unified-per-slot 262144 -ctk q8_0 -ctv q8_0"
    )


def test_a_smaller_box_gets_fewer_slots_and_a_smaller_window(llama8b: Path) -> None:
    box = weights(llama8b) + 60 * GIB + CRAM
    p = plan.make_plan(SLOTS, WINDOW, "q8_0", llama8b, available=box)
    # 68 GiB of q8_0 KV does not fit 60 GiB; q4_0's 36 GiB does
    assert p.option("per-slot-q8_0").fits() is False
    assert p.recommended == "per-slot-q4_0"
    fewer = p.option("fewer-slots")
    assert (fewer.pool.n_slots, fewer.guaranteed_window, fewer.kv_mib) == (3, 262144, 52224.0)
    smaller = p.option("smaller-window")
    # 4 x W x 68 KiB <= 59 GiB (60 minus 1024 MiB headroom), W a multiple of 1024
    assert (smaller.pool.n_slots, smaller.guaranteed_window) == (4, 227328)
    assert "--kv-unified-per-slot 227328" in smaller.set_command


def test_when_only_alternatives_fit_the_most_guaranteed_context_wins(llama8b: Path) -> None:
    box = weights(llama8b) + 20 * GIB + CRAM
    p = plan.make_plan(SLOTS, WINDOW, "q8_0", llama8b, available=box)
    assert not any(p.option(f"per-slot-{t}").fits() for t in plan.PER_SLOT_TYPES)
    # 1 x 262144 (17 GiB of KV) against 4 x 72704 (18.9 GiB; 19 GiB is free after the headroom)
    assert p.option("fewer-slots").pool.n_slots == 1
    assert p.option("smaller-window").guaranteed_window == 72704
    assert p.recommended == "smaller-window"


def test_without_a_model_only_the_pool_arithmetic(tmp_path: Path) -> None:
    p = plan.make_plan(SLOTS, WINDOW, "q8_0", available=64 * GIB)
    assert all(o.kv is None and o.fits() is None for o in p.options)
    assert p.option("per-slot-q8_0").guaranteed_window == 262144
    assert p.option("shared").guaranteed_window == 65536
    assert p.recommended == "per-slot-q8_0"
    assert any("cannot be estimated" in n for n in p.notes)


def test_a_model_the_estimator_refuses_still_plans_the_pool(tmp_path: Path) -> None:
    path = tinymodel.write_layout(
        tmp_path / "gemma3n.gguf", tinymodel.Shape(arch="gemma3n"), n_vocab=512, merges=0
    )
    p = plan.make_plan(2, 4096, "f16", path, available=8 * GIB)
    assert p.model is not None and p.model.info is None
    assert all(o.kv is None for o in p.options)
    assert any("layers that share KV" in n for n in p.notes)


@pytest.mark.parametrize(
    ("slots", "window", "cache", "message"),
    [
        (0, 4096, "f16", "--slots 0 is out of range; use 1..256"),
        (4, 0, "f16", "--window 0 must be at least 1 token"),
        (4, 4096, "q9_0", "'q9_0' is not a KV cache type"),
        (4, 300000, "f16", "--window 300000 exceeds the training context"),
    ],
)
def test_bad_input_names_the_value(
    llama8b: Path, slots: int, window: int, cache: str, message: str
) -> None:
    with pytest.raises(ConfigInvalid, match=message):
        plan.make_plan(slots, window, cache, llama8b, available=GIB)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher", "plan", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_json(llama8b: Path) -> None:
    r = cli(
        "--slots",
        "4",
        "--window",
        "256k",
        "--cache",
        "q8_0",
        "--model",
        str(llama8b),
        "--mem-available",
        str(120 * 1024),
        "--json",
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {
        "ok",
        "slots",
        "window",
        "cache",
        "model",
        "mem_available_mib",
        "options",
        "recommended",
        "recommendation",
        "reason",
        "notes",
    } <= data.keys()
    assert (data["slots"], data["window"], data["recommended"]) == (4, 262144, "per-slot-q8_0")
    option = data["options"][0]
    assert {
        "key",
        "flags",
        "set_command",
        "guaranteed_window",
        "pool_cells",
        "kv_mib",
        "free_mib",
        "fits",
        "overcommitted",
    } <= option.keys()
    assert [o["key"] for o in data["options"]][:5] == [
        "shared",
        "split",
        "per-slot-f16",
        "per-slot-q8_0",
        "per-slot-q4_0",
    ]


def test_cli_human_table_without_model() -> None:
    r = cli("--slots", "4", "--window", "262144")
    assert r.returncode == 0, r.stderr
    assert "per-slot-f16" in r.stdout and "<- recommended" in r.stdout
    assert "llama-launcher set -c 1048576 -np 4 -kvu --kv-unified-per-slot 262144" in r.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--slots", "four", "--window", "4096"],
            "--slots 'four' is not a whole number; e.g. --slots 4",
        ),
        (["--slots", "4", "--window", "4096", "--cache", "q9_0"], "'q9_0' is not a KV cache type"),
        (["--slots", "4", "--window", "4096", "--model", "/nonexistent.gguf"], "does not exist"),
    ],
)
def test_cli_bad_input_exits_2(args: list[str], message: str) -> None:
    r = cli(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert r.stdout == ""


def test_cache_types_the_model_cannot_use_are_left_out(tmp_path: Path) -> None:
    # head size 80 (phi-2, StableLM-3B): no 32-value blocks, so no q8_0/q4_0 rows
    path = tinymodel.write_layout(
        tmp_path / "hd80.gguf",
        tinymodel.Shape(layers=2, n_embd=320, heads=4, kv_heads=4, ff=640, ctx_train=8192),
        n_vocab=512,
        merges=0,
    )
    p = plan.make_plan(2, 4096, "f16", path, available=64 * GIB)
    keys = {o.key for o in p.options}
    assert "per-slot-f16" in keys and not keys & {"per-slot-q8_0", "per-slot-q4_0"}
    assert p.recommended == "per-slot-f16"


def test_when_nothing_fits_the_plan_says_so(llama8b: Path) -> None:
    p = plan.make_plan(SLOTS, WINDOW, "q8_0", llama8b, available=weights(llama8b))
    assert p.recommended == "split" and p.option("split").fits() is False
    assert p.reason.startswith("nothing fits this box, not even split pools")


def test_a_smaller_prompt_cache_is_counted_and_carried_into_the_set_line(llama8b: Path) -> None:
    box = weights(llama8b) + 40 * GIB
    p = plan.make_plan(SLOTS, WINDOW, "q4_0", llama8b, available=box, cache_ram_mib=0)
    o = p.option("per-slot-q4_0")
    assert o.kv is not None and o.free_bytes == box - weights(llama8b) - o.kv.total_bytes
    assert p.recommended == "per-slot-q4_0"  # 36 GiB of KV fits 40 only without the 8 GiB
    assert p.recommendation.set_command.endswith("-ctk q4_0 -ctv q4_0 --cache-ram 0")
