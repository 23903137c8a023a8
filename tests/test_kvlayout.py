"""launcher.server.kvlayout: case tables, properties of the arithmetic, the real startup line."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import realserver
from hypothesis import given
from hypothesis import strategies as st

from launcher import config
from launcher.server import kvlayout, serverlog

# (ctx_size, parallel, kv_unified, per_slot, n_ctx_train) ->
# (n_slots, kv_unified, n_ctx, n_ctx_seq, n_ctx_slot, guaranteed_window, overcommitted)
CASES = [
    pytest.param(
        (1048576, 4, True, 262144, 262144),
        (4, True, 1048576, 1048576, 262144, 262144, False),
        id="seed-fix",
    ),
    pytest.param(
        (262144, 4, True, 0, 262144),
        (4, True, 262144, 262144, 262144, 65536, True),
        id="seed-overcommit",
    ),
    pytest.param(
        (262144, 4, False, 0, 262144),
        (4, False, 262144, 65536, 65536, 65536, False),
        id="seed-split",
    ),
    pytest.param(
        (1000, 3, False, 0, 4096), (3, False, 1536, 512, 512, 512, False), id="split-rounds-up"
    ),
    pytest.param(
        (None, -1, None, 0, 4096), (4, True, 4096, 4096, 4096, 1024, True), id="auto-from-model"
    ),
    pytest.param(
        (8192, -1, False, 0, 4096),
        (4, True, 8192, 8192, 4096, 2048, True),
        id="auto-forces-unified",
    ),
    pytest.param(
        (None, 2, True, 1000, 4096),
        (2, True, 2048, 2048, 1000, 1000, False),
        id="per-slot-sizes-pool",
    ),
    pytest.param(
        (0, 2, True, 1000, 4096),
        (2, True, 4096, 4096, 1000, 1000, False),
        id="explicit-0-no-sizing",
    ),
    pytest.param(
        (1024, 2, True, 3000, 4096), (2, True, 1024, 1024, 1024, 512, True), id="cap-above-pool"
    ),
    pytest.param(
        (8192, 1, None, 0, 4096), (1, False, 8192, 8192, 4096, 4096, False), id="train-caps-slot"
    ),
    pytest.param(
        (None, 4, False, 0, 4096), (4, False, 16384, 4096, 4096, 4096, False), id="split-from-model"
    ),
]


@pytest.mark.parametrize(("args", "expected"), CASES)
def test_resolve_cases(
    args: tuple[int | None, int, bool | None, int, int], expected: tuple[object, ...]
) -> None:
    p = kvlayout.resolve(*args)
    got = (
        p.n_slots,
        p.kv_unified,
        p.n_ctx,
        p.n_ctx_seq,
        p.n_ctx_slot,
        p.guaranteed_window,
        p.overcommitted,
    )
    assert got == expected


def test_seed_fix_guarantees_every_slot_its_window() -> None:
    p = kvlayout.resolve(1048576, 4, True, 262144, 262144)
    assert (p.n_slots, p.guaranteed_window, p.promised, p.n_ctx) == (4, 262144, 1048576, 1048576)
    assert not p.overcommitted


def test_seed_overcommit_promises_four_times_the_pool() -> None:
    p = kvlayout.resolve(262144, 4, True, 0, 262144)
    assert p.overcommitted
    assert p.promised == 4 * 262144
    assert "over-committed by 786432 cells" in p.describe()


@pytest.mark.parametrize("parallel", [0, -2, 257])
def test_resolve_refuses_slot_counts_out_of_range(parallel: int) -> None:
    with pytest.raises(ValueError, match=rf"-np {parallel} is out of range"):
        kvlayout.resolve(4096, parallel)


def test_resolve_needs_the_model_when_c_is_unset() -> None:
    with pytest.raises(ValueError, match="give the model"):
        kvlayout.resolve(None, 2, True, 0, None)


slots = st.integers(min_value=1, max_value=kvlayout.MAX_SLOTS)
cells = st.integers(min_value=1, max_value=1 << 21)
trains = st.one_of(st.none(), st.integers(min_value=256, max_value=1 << 20))


@given(slots, cells, st.booleans(), trains)
def test_per_slot_cap_with_an_unsized_pool_never_overcommits(
    n: int, cap: int, unified: bool, train: int | None
) -> None:
    p = kvlayout.resolve(None, n, unified, cap, train)
    assert not p.overcommitted
    assert p.n_ctx >= p.promised
    assert p.guaranteed_window == p.n_ctx_slot <= cap


@given(slots, st.one_of(st.none(), cells), st.integers(0, 1 << 20), trains)
def test_split_pools_never_overcommit(n: int, c: int | None, cap: int, train: int | None) -> None:
    if c is None and train is None:
        train = 4096
    p = kvlayout.resolve(c, n, False, cap, train)
    assert not p.overcommitted
    assert p.n_ctx == p.n_slots * p.n_ctx_seq
    assert p.guaranteed_window == p.n_ctx_slot <= p.n_ctx_seq


@given(
    st.integers(-1, kvlayout.MAX_SLOTS).filter(bool),
    st.one_of(st.none(), cells),
    st.one_of(st.none(), st.booleans()),
    st.integers(0, 1 << 20),
    trains,
)
def test_guaranteed_windows_fit_the_pool_together(
    n: int, c: int | None, kvu: bool | None, cap: int, train: int | None
) -> None:
    if c is None and train is None:
        train = 4096
    p = kvlayout.resolve(c, n, kvu, cap, train)
    assert p.n_ctx % kvlayout.CELL_PAD == 0 and p.n_ctx_seq % kvlayout.CELL_PAD == 0
    assert p.guaranteed_window <= p.n_ctx_slot
    assert p.guaranteed_window * p.n_slots <= p.n_ctx
    if train:
        assert p.n_ctx_slot <= train


# -- against the real server -------------------------------------------------------------------

# src/llama-context.cpp:316-317 (INFO, printed with -lv 4)
N_CTX = re.compile(r"llama_context: n_ctx\s+= (\d+)")
N_CTX_SEQ = re.compile(r"llama_context: n_ctx_seq\s+= (\d+)")

# Every (-c, -kvu, --kv-unified-per-slot) combination once, -np cycling through auto, 1, 3 and
# 4: 45 server starts instead of 180, and each -np value meets every -c and every flag.
SLOT_VALUES = [-1, 1, 3, 4]
MATRIX = [
    (c, SLOT_VALUES[i % len(SLOT_VALUES)], kvu, cap)
    for i, (c, kvu, cap) in enumerate(
        itertools.product(
            [None, 0, 1000, 4096, 8192],  # -c (None: not given)
            [None, True, False],  # -kvu / -no-kvu / neither
            [0, 1000, 3000],  # --kv-unified-per-slot
        )
    )
]


def _args(c: int | None, np_: int, kvu: bool | None, cap: int) -> list[str]:
    args = ["-lv", "4", "-np", str(np_)]
    if c is not None:
        args += ["-c", str(c)]
    if kvu is not None:
        args.append("-kvu" if kvu else "-no-kvu")
    if cap:
        args += ["--kv-unified-per-slot", str(cap)]
    return args


@pytest.mark.parametrize(
    ("c", "np_", "kvu", "cap"), MATRIX, ids=["c{}-np{}-kvu{}-cap{}".format(*m) for m in MATRIX]
)
def test_resolve_matches_the_startup_line(
    tiny_model: Path, tmp_path: Path, c: int | None, np_: int, kvu: bool | None, cap: int
) -> None:
    expected = kvlayout.resolve(c, np_, kvu, cap, n_ctx_train=4096)
    with realserver.run_server(tiny_model, _args(c, np_, kvu, cap), tmp_path / "server.log") as s:
        log = s.log()
    scan = serverlog.StartupScan().feed_all(log.splitlines())
    assert scan.startup is not None, log[-2000:]
    got = (scan.startup.n_slots, scan.startup.n_ctx_slot, scan.startup.kv_unified)
    assert got == (expected.n_slots, expected.n_ctx_slot, expected.kv_unified)
    n_ctx, n_ctx_seq = N_CTX.search(log), N_CTX_SEQ.search(log)
    assert n_ctx and n_ctx_seq, log[-2000:]
    assert (int(n_ctx[1]), int(n_ctx_seq[1])) == (expected.n_ctx, expected.n_ctx_seq)
    if expected.pool_sized_by_per_slot:
        assert scan.pool_cells == expected.n_slots * cap
    else:
        assert scan.pool_cells is None


@pytest.mark.parametrize("np_", [1, 4])
def test_fit_off_without_c_matches_the_startup_line(
    tiny_model: Path, tmp_path: Path, np_: int
) -> None:
    cfg = config.build(
        {
            "llama_server": "/x",
            "model": str(tiny_model),
            "parallel": np_,
            "kv_unified": False,
            "extra_args": ["--fit", "off"],
        }
    )
    expected = cfg.pool_plan(4096)
    args = ["-lv", "4", "-np", str(np_), "-no-kvu", "--fit", "off"]
    with realserver.run_server(tiny_model, args, tmp_path / "server.log") as s:
        log = s.log()
    scan = serverlog.StartupScan().feed_all(log.splitlines())
    assert scan.startup is not None, log[-2000:]
    assert (scan.startup.n_slots, scan.startup.n_ctx_slot) == (np_, expected.n_ctx_slot)
    n_ctx = N_CTX.search(log)
    assert n_ctx and int(n_ctx[1]) == expected.n_ctx == 4096
