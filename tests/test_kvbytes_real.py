"""The KV estimate equals what the real llama-server allocates, line by line.

Each case starts llama-server b11434 with ``-lv 4`` on a generated tiny model and compares
every ``llama_kv_cache: size = ...`` line (one per cache: two for an iSWA model, non-SWA
first) with ``kvbytes.estimate``: cells, layers, streams, and K, V and total MiB to the two
decimals the server prints.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import realserver
import tinymodel

from launcher.server import kvbytes, kvlayout

# src/llama-kv-cache.cpp:289-293 (INFO: hidden at the default verbosity 3, shown with -lv 4)
KV_SIZE = re.compile(
    r"llama_kv_cache: size = +(?P<mib>[\d.]+) MiB \( *(?P<cells>\d+) cells, +(?P<layers>\d+) "
    r"layers, +(?P<seqs>\d+)/(?P<streams>\d+) seqs\), K \((?P<tk>\w+)\): +(?P<k>[\d.]+) MiB, "
    r"V \((?P<tv>\w+)\): +(?P<v>[\d.]+) MiB"
)
#: The server prints %7.2f of the exact size: it is within half a hundredth of the estimate.
PRINTED = 0.005 + 1e-9

MODELS = {
    # GQA: 4 heads share 2 KV heads, head dim 32
    "gqa": tinymodel.Shape(),
    # head dim 64 while n_embd / n_head = 32: key_length / value_length in the GGUF
    "headdim64": tinymodel.Shape(head_dim=64),
    # per-layer head_count_kv array, with a linear-attention layer that has no K/V
    "perlayer": tinymodel.Shape(arch="deci", layers=4, kv_heads=[2, 0, 1, 4]),
    # sliding window 256 on every other layer (gemma2's default pattern 2)
    "gemma2-swa": tinymodel.Shape(
        arch="gemma2", layers=4, extra={"gemma2.attention.sliding_window": 256}
    ),
    # window 512, pattern 6 (5 SWA layers, 1 full)
    "gemma3-swa": tinymodel.Shape(
        arch="gemma3", layers=6, extra={"gemma3.attention.sliding_window": 512}
    ),
}
EXTRA_MODELS = {
    # an explicit per-layer bool pattern instead of the period
    "gemma3-boolpattern": tinymodel.Shape(
        arch="gemma3",
        layers=4,
        extra={
            "gemma3.attention.sliding_window": 384,
            "gemma3.attention.sliding_window_pattern": [True, False, False, True],
        },
    ),
}
CACHES = [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16")]


@dataclass(frozen=True)
class Pool:
    """The context flags of one case: -c, -np, -kvu/-no-kvu, --kv-unified-per-slot."""

    c: int | None
    np: int
    kvu: bool | None
    cap: int = 0

    def args(self) -> list[str]:
        args = ["-np", str(self.np)]
        if self.c is not None:
            args += ["-c", str(self.c)]
        if self.kvu is not None:
            args.append("-kvu" if self.kvu else "-no-kvu")
        if self.cap:
            args += ["--kv-unified-per-slot", str(self.cap)]
        return args


POOLS = {
    "np1": Pool(4096, 1, None),
    "np4-unified": Pool(4096, 4, True),
    "np4-split": Pool(3000, 4, False),
    "np4-cap": Pool(None, 4, True, 1000),
}
POOL_PAIRS = [("np1", "np4-cap"), ("np4-unified", "np4-split")]


@dataclass(frozen=True)
class Case:
    model: str
    ctk: str
    ctv: str
    pool: str
    flash_attn: str = "auto"
    ubatch: int = 512
    swa_full: bool = False

    @property
    def id(self) -> str:
        extra = "" if self.flash_attn == "auto" else f"-fa{self.flash_attn}"
        extra += "" if self.ubatch == 512 else f"-ub{self.ubatch}"
        extra += "-swafull" if self.swa_full else ""
        return f"{self.model}-{self.ctk}-{self.ctv}-{self.pool}{extra}"

    def args(self) -> list[str]:
        args = [*POOLS[self.pool].args(), "-ctk", self.ctk, "-ctv", self.ctv]
        if self.flash_attn != "auto":
            args += ["-fa", self.flash_attn]
        if self.ubatch != 512:
            args += ["-ub", str(self.ubatch)]
        if self.swa_full:
            args.append("--swa-full")
        return args


# Every model x cache type, each with two of the four pools (alternating which two), so every
# pool meets every model and every cache type: 40 cases. Then the corners.
CASES = [
    Case(model, ctk, ctv, pool_name)
    for i, (model, (ctk, ctv)) in enumerate(itertools.product(MODELS, CACHES))
    for pool_name in POOL_PAIRS[i % 2]
] + [
    # -fa off stores V transposed, every layer as wide as the widest (TAG_V_CACHE_VARIABLE)
    Case("perlayer", "f16", "f16", "np4-unified", flash_attn="off"),
    Case("perlayer", "q8_0", "f16", "np4-split", flash_attn="off"),
    Case("gqa", "f16", "f16", "np1", flash_attn="off"),
    Case("perlayer", "q4_0", "q8_0", "np4-cap", flash_attn="on"),
    # the SWA cache is window x seqs + ubatch, or full-size with --swa-full
    Case("gemma2-swa", "f16", "f16", "np4-unified", ubatch=128),
    Case("gemma2-swa", "q8_0", "q8_0", "np4-split", swa_full=True),
    Case("gemma3-boolpattern", "f16", "q8_0", "np4-unified"),
    Case("gemma3-boolpattern", "f16", "f16", "np1", flash_attn="off"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kvmodels")
    return {
        name: tinymodel.write(root / f"{name}.gguf", shape)
        for name, shape in {**MODELS, **EXTRA_MODELS}.items()
    }


def test_the_matrix_is_big_enough() -> None:
    assert len(CASES) >= 40
    assert {c.pool for c in CASES} == set(POOLS)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_estimate_equals_the_servers_kv_cache_lines(
    models: dict[str, Path], tmp_path: Path, case: Case
) -> None:
    info = kvbytes.ModelInfo.from_gguf(models[case.model])
    p = POOLS[case.pool]
    plan = kvlayout.resolve(p.c, p.np, p.kvu, p.cap, info.n_ctx_train)
    est = kvbytes.estimate(
        info, plan, case.ctk, case.ctv, case.flash_attn, case.ubatch, swa_full=case.swa_full
    )
    args = ["-lv", "4", *case.args()]
    with realserver.run_server(models[case.model], args, tmp_path / "server.log") as s:
        log = s.log()
    lines = [m.groupdict() for m in KV_SIZE.finditer(log)]
    assert len(lines) == len(est.caches), log[-3000:]
    for printed, cache in zip(lines, est.caches, strict=True):
        assert (int(printed["cells"]), int(printed["layers"]), int(printed["streams"])) == (
            cache.cells,
            cache.layers,
            cache.streams,
        )
        assert (printed["tk"], printed["tv"]) == (case.ctk, case.ctv)
        assert abs(float(printed["k"]) - cache.k_bytes / kvbytes.MIB) <= PRINTED
        assert abs(float(printed["v"]) - cache.v_bytes / kvbytes.MIB) <= PRINTED
        assert abs(float(printed["mib"]) - cache.mib) <= PRINTED
    total = sum(float(line["mib"]) for line in lines)
    assert abs(total - est.total_mib) <= PRINTED * len(lines)
