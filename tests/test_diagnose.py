"""The pure parts of ``launcher.reports.diagnose``: fixes from the pool arithmetic, inputs, argv.

Counting and grouping are tested on real server logs in tests/test_diagnose_real.py.
"""

from __future__ import annotations

import io
from typing import Any

import pytest

from launcher.errors import ConfigInvalid
from launcher.host import systemd
from launcher.reports import diagnose
from launcher.reports.diagnose import scanner
from launcher.server import kvlayout


def config(n: int, slot: int, cells: int, unified: bool = True) -> diagnose.Config:
    plan = kvlayout.PoolPlan(
        n, unified, cells, cells if unified else cells // n, slot, 0, False, None
    )
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
        plan = kvlayout.resolve(int(flags[1]), 4, "-no-kvu" not in flags, per_slot)
        assert not plan.overcommitted
        assert plan.guaranteed_window == fix.guaranteed_window


def test_memory_hook_prices_each_fix() -> None:
    def cost(plan: kvlayout.PoolPlan, k: str, v: str) -> int:
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
    assert systemd.journal_argv("llama", "1 hour ago") == [
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
        systemd.journal_argv(unit)


def test_bad_pool_hint_is_refused() -> None:
    with pytest.raises(ConfigInvalid, match="pool size -5"):
        diagnose.diagnose(io.BytesIO(b""), "empty", pool_hint=-5)


def test_empty_input_has_no_verdict() -> None:
    r = diagnose.diagnose(io.BytesIO(b""), "empty", pool_hint=4096)
    assert (r.lines, r.failures_total, r.verdicts, r.config) == (0, 0, (), None)
    assert (r.pool_cells, r.pool_source) == (4096, "--pool")


# A failing server's log in b11434's format (cf. scripts/repro-overflow): a startup, a warm
# slot, then a cascade at rising offsets, a purge, the decode error and the release lines.
# Abridged: the halvings from 128 to 2 at offset 580 are left out.
SEED = b"""0.00.003.981 I srv  llama_server: initializing ...
0.00.748.696 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 1024, kv_unified = 'true'
0.02.522.065 I slot      release: id  3 | task 0 | stop processing: n_tokens = 346, truncated = 0
0.03.007.117 W decode: failed to find a memory slot for batch of size 880
0.03.007.149 W srv        decode: RETRY off = 0, n_batch = 512, ret = 1
0.03.007.150 W srv  try_clear_id: purging slot 3 with 346 tokens
0.03.310.303 W decode: failed to find a memory slot for batch of size 368
0.03.310.361 W srv        decode: RETRY off = 512, n_batch = 512, ret = 1
0.03.310.481 W decode: failed to find a memory slot for batch of size 368
0.03.310.507 W srv        decode: RETRY off = 512, n_batch = 256, ret = 1
0.03.310.606 W decode: failed to find a memory slot for batch of size 256
0.03.310.631 W srv        decode: RETRY off = 512, n_batch = 128, ret = 1
0.03.570.194 W decode: failed to find a memory slot for batch of size 304
0.03.570.251 W srv        decode: RETRY off = 576, n_batch = 512, ret = 1
0.03.570.360 W decode: failed to find a memory slot for batch of size 304
0.03.570.385 W srv        decode: RETRY off = 576, n_batch = 256, ret = 1
0.03.842.187 W decode: failed to find a memory slot for batch of size 300
0.03.842.240 W srv        decode: RETRY off = 580, n_batch = 512, ret = 1
0.03.842.343 W decode: failed to find a memory slot for batch of size 300
0.03.842.363 W srv        decode: RETRY off = 580, n_batch = 256, ret = 1
0.03.842.864 W decode: failed to find a memory slot for batch of size 256
0.03.842.883 W srv        decode: RETRY off = 580, n_batch = 1, ret = 1
0.03.842.912 W decode: failed to find a memory slot for batch of size 1
0.03.842.933 E srv        decode: Context size has been exceeded. off = 580, n_batch = 1, ret = 1
0.03.842.935 E srv    send_error: task id = 11, error: Context size has been exceeded.
0.03.844.095 I slot      release: id  0 | task 11 | stop processing: n_tokens = 439, truncated = 0
0.03.844.165 E srv    send_error: task id = 10, error: Context size has been exceeded.
0.03.844.196 I slot      release: id  1 | task 10 | stop processing: n_tokens = 440, truncated = 0
0.03.844.723 E srv    send_error: task id = 8, error: Context size has been exceeded.
0.03.844.729 I slot      release: id  2 | task 8 | stop processing: n_tokens = 445, truncated = 0
0.03.844.856 E srv  update_slots: decode() failed: Context size has been exceeded.
""".replace(
    b"RETRY", b"failed to find free space in the KV cache, retrying with smaller batch size,"
)

# The real server (b11434) under load, from the sandbox journal: the retry after the purge
# placed all 441 tokens (no line says so); the next batch, one generated token for each of
# two slots, then failed at the same offset 0. The overflow is that batch of 2, not the 441.
NEW_BATCH = b"""\
0.00.090.416 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 1024, kv_unified = 'true'
0.00.166.829 I slot launch_slot_: id  3 | task 0 | processing task, is_child = 0
0.00.182.440 I slot      release: id  3 | task 0 | stop processing: n_tokens = 347, truncated = 0
0.00.355.593 I slot launch_slot_: id  2 | task 9 | processing task, is_child = 0
0.00.390.200 I slot launch_slot_: id  1 | task 12 | processing task, is_child = 0
0.00.390.473 W decode: failed to find a memory slot for batch of size 441
0.00.390.503 W srv  try_clear_id: purging slot 3 with 347 tokens
0.00.390.555 W srv        decode: RETRY off = 0, n_batch = 1024, ret = 1
0.00.416.961 W decode: failed to find a memory slot for batch of size 2
0.00.417.023 W srv        decode: RETRY off = 0, n_batch = 512, ret = 1
0.00.417.061 W decode: failed to find a memory slot for batch of size 2
0.00.417.088 W srv        decode: RETRY off = 0, n_batch = 256, ret = 1
0.00.417.124 W decode: failed to find a memory slot for batch of size 2
0.00.417.151 W srv        decode: RETRY off = 0, n_batch = 128, ret = 1
0.00.417.189 W decode: failed to find a memory slot for batch of size 2
0.00.417.215 W srv        decode: RETRY off = 0, n_batch = 64, ret = 1
0.00.417.251 W decode: failed to find a memory slot for batch of size 2
0.00.417.278 W srv        decode: RETRY off = 0, n_batch = 32, ret = 1
0.00.417.313 W decode: failed to find a memory slot for batch of size 2
0.00.417.341 W srv        decode: RETRY off = 0, n_batch = 16, ret = 1
0.00.417.376 W decode: failed to find a memory slot for batch of size 2
0.00.417.402 W srv        decode: RETRY off = 0, n_batch = 8, ret = 1
0.00.417.438 W decode: failed to find a memory slot for batch of size 2
0.00.417.464 W srv        decode: RETRY off = 0, n_batch = 4, ret = 1
0.00.417.499 W decode: failed to find a memory slot for batch of size 2
0.00.417.532 W srv        decode: RETRY off = 0, n_batch = 2, ret = 1
0.00.417.567 W decode: failed to find a memory slot for batch of size 2
0.00.417.594 W srv        decode: RETRY off = 0, n_batch = 1, ret = 1
0.00.417.630 W decode: failed to find a memory slot for batch of size 1
0.00.417.657 E srv        decode: Context size has been exceeded. off = 0, n_batch = 1, ret = 1
0.00.417.674 E srv    send_error: task id = 12, error: Context size has been exceeded.
0.00.417.921 I slot      release: id  1 | task 12 | stop processing: n_tokens = 510, truncated = 0
0.00.417.994 E srv    send_error: task id = 9, error: Context size has been exceeded.
0.00.418.085 I slot      release: id  2 | task 9 | stop processing: n_tokens = 516, truncated = 0
0.00.418.276 E srv  update_slots: decode() failed: Context size has been exceeded.
0.00.430.467 I slot launch_slot_: id  0 | task 86 | processing task, is_child = 0
0.00.460.620 I slot      release: id  0 | task 86 | stop processing: n_tokens = 544, truncated = 0
""".replace(
    b"RETRY", b"failed to find free space in the KV cache, retrying with smaller batch size,"
)

VARIANTS = {
    "seed": SEED,
    "repeated": SEED * 7,
    "new-batch": NEW_BATCH + SEED + NEW_BATCH,
    "offset-returns": SEED.replace(b"off = 576, n_batch = 256", b"off = 0, n_batch = 256"),
    "other-decode-error": SEED.replace(
        b"Context size has been exceeded. off", b"Compute error. off"
    ),
    "drifted-retry": SEED.replace(b"off = 512, n_batch = 128", b"off = 512, nbatch = 128"),
    "no-final-newline": SEED.rstrip(b"\n"),
    # a cascade that finds room: a release without an error ends it
    "recovered": SEED.replace(
        b"0.03.842.933 E",
        b"0.03.842.932 I slot      release: id  0 | "
        b"task 11 | stop processing: n_tokens = 1, truncated = 0\n0.03.842.933 E",
    ),
    "long-cascade-runs": SEED.replace(
        b"0.03.570.194 W",
        b"".join(
            b"0.03.500.000 W decode: failed to find a memory slot for batch of size 64\n"
            b"0.03.500.001 W srv        decode: RETRY off = %d, n_batch = 32, ret = 1\n"
            % (1000 + i)
            for i in range(100)
        ).replace(
            b"RETRY",
            b"failed to find free space in the KV cache, retrying with smaller batch size,",
        )
        + b"0.03.570.194 W",
    ),
    "long-cascade": SEED.replace(
        b"0.03.842.864 W",
        b"".join(
            b"0.03.842.800 W decode: failed to find a memory slot for batch of size 300\n"
            b"0.03.842.801 W srv        decode: failed to find free space in the KV cache, "
            b"retrying with smaller batch size, off = %d, n_batch = 2, ret = 1\n" % (600 + i)
            for i in range(100)
        )
        + b"0.03.842.864 W",
    ),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("block", [7, 333, 4096, diagnose.BLOCK])
def test_cascade_runs_give_what_line_by_line_gives(
    name: str, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run-at-once path (``Scanner.cascade``) changes nothing in the report."""
    data = VARIANTS[name]
    kw: dict[str, Any] = dict(block=block, keep=3, pool_hint=1024)
    fast = diagnose.diagnose(io.BytesIO(data), "x", **kw)
    monkeypatch.setattr(scanner.Scanner, "cascade", lambda *a: False)
    slow = diagnose.diagnose(io.BytesIO(data), "x", **kw)
    assert fast == slow
    assert fast.lines == len(data.splitlines())
    assert fast.exceeded_lines == sum(
        b"Context size has been exceeded" in line for line in data.splitlines()
    )


def test_seed_failure_in_detail() -> None:
    r = diagnose.diagnose(io.BytesIO(SEED * 3), "seed")
    assert (r.failures_total, r.requests_failed, r.exceeded_lines, r.startups) == (3, 9, 15, 3)
    f = r.failures[-1]
    assert (f.n_steps, f.offsets, f.first_view, f.purges, f.off) == (10, 4, 880, 1, 580)
    assert f.steps[0] == diagnose.Step(0, 880, 512, (3, 346))
    assert f.steps[-1] == diagnose.Step(580, 1, None)
    assert (f.total, f.pool_cells, f.overflow, f.overflow_source) == (1324, 1024, 300, "log")
    assert f.adds_up is True and r.adds_up == r.checked == 3
    assert r.by_class == {diagnose.FailureClass.SHARED_POOL.value: 3}
    assert r.drift_lines == 0


def test_a_new_batch_at_the_same_offset_is_the_overflow() -> None:
    r = diagnose.diagnose(io.BytesIO(NEW_BATCH), "journal")
    f = r.failures[0]
    assert (r.failures_total, r.requests_failed, f.purges) == (1, 2, 1)
    assert (f.total, f.pool_cells, f.overflow, f.overflow_source) == (1026, 1024, 2, "log")
    assert f.adds_up is True and f.first_view == 441 and f.offsets == 2


FIXED_RESTART = b"""\
0.00.001.000 I srv  llama_server: initializing ...
0.00.002.000 I srv  llama_server: --kv-unified-per-slot: sizing KV pool to n_parallel * \
kv_unified_per_slot = 4 * 1024 = 4096
0.00.003.000 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 1024, kv_unified = 'true'
"""


def test_the_fix_is_sized_from_the_startup_the_failures_ran_under() -> None:
    r = diagnose.diagnose(io.BytesIO(SEED + FIXED_RESTART), "seed, then the fix deployed")
    assert r.config is not None and r.config.pool_cells == 4096  # the last startup
    (v,) = r.verdicts
    assert v.fixes[0].command == "llama-launcher set -c 4096 --kv-unified-per-slot 1024"
    assert v.fixes[0].note.endswith("pool x4")  # from the failing pool of 1024, not 4096
    assert "these ran under the startup at line 2" in v.reason
    assert "now: 4 slots x 1024 cells each, one shared pool of 4096 cells" in v.reason


def test_a_startup_line_in_a_new_format_is_shown_as_drift() -> None:
    drifted = SEED.replace(b"kv_unified = 'true'", b"kv_unified = true")
    r = diagnose.diagnose(io.BytesIO(drifted), "drifted")
    assert (r.config, r.drift_lines) == (None, 1)
    assert "n_slots = 4, n_ctx_slot = 1024, kv_unified = true" in r.drift_samples[0]


def test_a_request_longer_than_the_training_context_gets_no_impossible_fix() -> None:
    log = b"""\
llama_context: n_ctx_seq (1048576) > n_ctx_train (262144) -- possible training context overflow
srv    load_model: initializing, n_slots = 4, n_ctx_slot = 262144, kv_unified = 'true'
srv    send_error: task id = 9, error: request (300000 tokens) exceeds the available \
context size (262144 tokens), try increasing it
"""
    (v,) = diagnose.diagnose(io.BytesIO(log), "too long").verdicts
    assert v.fixes == ()
    assert "no context setting holds 300000 tokens on this model (trained for 262144)" in (v.reason)


def test_other_decode_faults_and_logged_bodies_are_known_and_counted_once() -> None:
    log = b"""\
srv    load_model: initializing, n_slots = 4, n_ctx_slot = 1024, kv_unified = 'true'
srv  update_slots: pre_decode() failed: Invalid input batch.
srv  update_slots: post_decode() failed: Compute error.
srv    send_error: task id = 9, error: request (5000 tokens) exceeds the available \
context size (1024 tokens), try increasing it
srv  log_server_r: response: {"error":{"code":400,"message":"request (5000 tokens) exceeds \
the available context size (1024 tokens), try increasing it","type":"exceed_context_size_error",\
"n_prompt_tokens":5000,"n_ctx":1024}}
srv  log_server_r: response: {"error":{"code":500,"message":"Context size has been exceeded.",\
"type":"server_error"}}
"""
    r = diagnose.diagnose(io.BytesIO(log), "verbose")
    assert (r.drift_lines, r.rejections_total, r.failures_total) == (0, 1, 0)


@pytest.mark.parametrize(
    "values",
    [
        b"n_slots = 0, n_ctx_slot = 2",
        b"n_slots = 300, n_ctx_slot = 256",
        b"n_slots = 1, n_ctx_slot = 0",
    ],
)
def test_startup_values_no_server_prints_are_drift_not_a_crash(values: bytes) -> None:
    damaged = SEED.replace(b"n_slots = 4, n_ctx_slot = 1024", values)
    r = diagnose.diagnose(io.BytesIO(damaged), "damaged")
    assert (r.config, r.drift_lines, r.failures_total) == (None, 1, 1)


def test_a_pool_sized_per_slot_is_padded_like_llama_cpp() -> None:
    log = b"""\
srv  llama_server: --kv-unified-per-slot: sizing KV pool to n_parallel * kv_unified_per_slot \
= 4 * 100000 = 400000
srv    load_model: initializing, n_slots = 4, n_ctx_slot = 100000, kv_unified = 'true'
"""
    r = diagnose.diagnose(io.BytesIO(log), "sized")
    assert r.pool_cells == 400128 and r.config is not None
    assert r.config.pool_source == "startup: --kv-unified-per-slot sizing KV pool line"
