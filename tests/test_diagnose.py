"""The pure parts of ``launcher.diagnose``: fixes from the pool arithmetic, inputs, argv.

Counting and grouping are tested on real server logs in tests/test_diagnose_real.py.
"""

from __future__ import annotations

import io

import pytest

from launcher import diagnose, pool
from launcher.errors import ConfigInvalid


def config(n: int, slot: int, cells: int, unified: bool = True) -> diagnose.Config:
    plan = pool.PoolPlan(n, unified, cells, cells if unified else cells // n, slot, 0, False, None)
    return diagnose.Config(1, n, slot, unified, cells, "test", 0, None, None, plan, plan.describe())


def test_shared_pool_fixes_follow_seed_000() -> None:
    fixes = diagnose.shared_pool_fixes(config(4, 262144, 262144))
    keep, q8, same, split = fixes
    assert keep.command == "llama-launcher set -c 1048576 --kv-unified-per-slot 262144"
    assert (keep.guaranteed_window, keep.pool_cells) == (262144, 1048576)
    assert q8.command.endswith("-ctk q8_0 -ctv q8_0") and q8.guaranteed_window == 262144
    assert same.command == "llama-launcher set -c 262144 --kv-unified-per-slot 65536"
    assert (same.guaranteed_window, same.pool_cells) == (65536, 262144)
    assert split.command == "llama-launcher set -c 262144 -no-kvu"
    assert split.guaranteed_window == 65536
    assert all(f.memory_bytes is None for f in fixes)


def test_every_fix_removes_the_overcommit() -> None:
    for fix in diagnose.shared_pool_fixes(config(4, 1024, 1024)):
        flags = fix.command.split()[2:]
        per_slot = (
            int(flags[flags.index("--kv-unified-per-slot") + 1])
            if ("--kv-unified-per-slot" in flags)
            else 0
        )
        plan = pool.resolve(int(flags[1]), 4, "-no-kvu" not in flags, per_slot)
        assert not plan.overcommitted
        assert plan.guaranteed_window == fix.guaranteed_window


def test_memory_hook_prices_each_fix() -> None:
    def cost(plan: pool.PoolPlan, k: str, v: str) -> int:
        return plan.n_ctx * (1 if k == "q8_0" else 2)

    keep, q8, *_ = diagnose.shared_pool_fixes(config(4, 1024, 1024), cost)
    assert (keep.memory_bytes, q8.memory_bytes) == (8192, 4096)


@pytest.mark.parametrize(
    ("unified", "needed", "command", "window"),
    [
        (False, 444, "llama-launcher set -c 2048", 512),
        (True, 1500, "llama-launcher set -c 6144 --kv-unified-per-slot 1536", 1536),
        (True, 1535, "llama-launcher set -c 6144 --kv-unified-per-slot 1536", 1536),
        (True, 1536, "llama-launcher set -c 7168 --kv-unified-per-slot 1792", 1792),
    ],
)
def test_too_long_fix_holds_the_request(
    unified: bool, needed: int, command: str, window: int
) -> None:
    fix = diagnose.too_long_fixes(config(4, 256, 1024, unified), needed)[0]
    assert (fix.command, fix.guaranteed_window) == (command, window)
    assert fix.guaranteed_window > needed  # the server refuses n_prompt >= n_ctx_slot


def test_journal_argv_matches_system_and_user_units() -> None:
    assert diagnose.journal_argv("llama", "1 hour ago") == [
        "journalctl",
        "--no-pager",
        "-o",
        "cat",
        "_SYSTEMD_UNIT=llama.service",
        "+",
        "_SYSTEMD_USER_UNIT=llama.service",
        "--since",
        "1 hour ago",
    ]


@pytest.mark.parametrize("unit", ["", "-x", "a/b"])
def test_bad_unit_names_are_refused(unit: str) -> None:
    with pytest.raises(ConfigInvalid, match="unit name"):
        diagnose.journal_argv(unit)


def test_bad_pool_hint_is_refused() -> None:
    with pytest.raises(ConfigInvalid, match="pool size -5"):
        diagnose.diagnose(io.BytesIO(b""), "empty", pool_hint=-5)


def test_empty_input_has_no_verdict() -> None:
    r = diagnose.diagnose(io.BytesIO(b""), "empty", pool_hint=4096)
    assert (r.lines, r.failures_total, r.verdicts, r.config) == (0, 0, (), None)
    assert (r.pool_cells, r.pool_source) == (4096, "--pool")
