"""``llama-launcher bench`` against the real llama-server on generated models: no mocks.

One bench run on a module-scoped server with the tiny model feeds most tests. The
concurrency test needs a model whose decode step is dominated by reading weights, which a
batch of agents shares: on the 2-core CPU the 2-layer tiny model is so cheap that per-token
overheads (sampling, streaming, the client itself) hide the batching, so that test uses a
wider model (2 layers, n_embd 1024, ~130 MB, written in about half a second).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import realserver
import tinymodel

from launcher.cli import main
from launcher.errors import InvalidInput, ProbeError
from launcher.reports import bench

AGENTS = (1, 4)
MAX_TOKENS = 16
ROUNDS = 3
PROMPT_TOKENS = 300
LONG_PROMPT = 1000
GENERATION = {"id": 7, "deployed_at": "2025-01-01T00:00:00Z"}
#: -c 16384 split over 4 slots: 4096 per slot, the model's training context. One thread:
#: other suites share the 2 cores, and a 2-thread ggml pool that loses a core spins at every
#: op's barrier (10x slower), while one thread only slows down in proportion.
SERVER_ARGS = ["-np", "4", "-c", "16384", "-t", "1", "--metrics"]


@pytest.fixture(scope="module")
def server(tiny_model: Path, llama_server_bin: str) -> Iterator[realserver.Server]:
    with realserver.run_server(tiny_model, SERVER_ARGS, binary=llama_server_bin) as srv:
        yield srv


@pytest.fixture(scope="module")
def concurrent(
    tmp_path_factory: pytest.TempPathFactory, llama_server_bin: str
) -> list[bench.BenchResult]:
    """Three runs of 1 and 4 agents on a model whose decode is weight-bound, so batching
    pays. Each run measures 1 and 4 agents back to back, so both see the same load."""
    shape = tinymodel.Shape(layers=2, n_embd=1024, heads=8, kv_heads=4, ff=4096)
    model = tinymodel.write(tmp_path_factory.mktemp("bench") / "wide.gguf", shape)
    with realserver.run_server(model, SERVER_ARGS, binary=llama_server_bin) as srv:
        settings = bench.BenchSettings(url=srv.url, agents=(1, 4), max_tokens=64)
        return [bench.run_bench(settings) for _ in range(3)]


def predicted_total(url: str) -> int:
    """llamacpp:tokens_predicted_total from /metrics: the server's own count."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(r"^llamacpp:tokens_predicted_total (\S+)$", text, re.MULTILINE)
    assert found, text
    return int(float(found.group(1)))


@pytest.fixture(scope="module")
def measured(server: realserver.Server) -> tuple[bench.BenchResult, int]:
    """One bench run and the tokens the server says it generated meanwhile."""
    before = predicted_total(server.url)
    settings = bench.BenchSettings(
        url=server.url,
        agents=AGENTS,
        max_tokens=MAX_TOKENS,
        long_prompt_tokens=LONG_PROMPT,
        rounds=ROUNDS,
    )
    result = bench.run_bench(settings, generation=GENERATION)
    return result, predicted_total(server.url) - before


@pytest.fixture(scope="module")
def result(measured: tuple[bench.BenchResult, int]) -> bench.BenchResult:
    return measured[0]


def all_requests(result: bench.BenchResult) -> list[bench.RequestResult]:
    reqs = [r for lv in result.levels for r in lv.requests]
    return reqs + [r for st in result.stalls for r in st.with_long.requests]


# --------------------------------------------------------------------------- the core


@pytest.mark.real
def test_tokens_are_the_sum_of_the_servers_usage(result: bench.BenchResult) -> None:
    for lv in result.levels:
        assert len(lv.chat) == lv.agents * ROUNDS
        assert lv.completion_tokens == sum(r.completion_tokens for r in lv.chat)
        # ignore_eos makes every answer exactly max_tokens long
        assert lv.completion_tokens == lv.agents * ROUNDS * MAX_TOKENS
        assert lv.to_dict()["completion_tokens"] == lv.completion_tokens


@pytest.mark.real
def test_token_counts_match_the_servers_metrics(measured: tuple[bench.BenchResult, int]) -> None:
    result, server_delta = measured
    counted = sum(r.completion_tokens for r in all_requests(result))
    # plus the uncounted warm-up request of max_tokens and the long prompt read alone
    assert server_delta == counted + MAX_TOKENS + result.stalls[0].long_alone.completion_tokens


@pytest.mark.real
def test_four_agents_are_served_at_once(concurrent: list[bench.BenchResult]) -> None:
    for result in concurrent:
        reqs = result.levels[1].chat
        assert len(reqs) == 4
        # Every agent had its first token before any agent finished: the server decoded
        # them together. Served one after another, the 2nd would start after the 1st ended.
        assert max(r.start_s + r.ttft_s for r in reqs) < min(r.start_s + r.latency_s for r in reqs)


@pytest.mark.real
def test_four_agents_take_well_under_four_times_one(concurrent: list[bench.BenchResult]) -> None:
    # Served one after another, 4 agents would take 4 single latencies. Best of three runs
    # (as timeit does), so a burst of load from other processes on the box does not count.
    ratios = [four.wall_s / one.latency(50) for one, four in (r.levels for r in concurrent)]
    assert min(ratios) < 0.8 * 4, ratios


@pytest.mark.real
def test_a_long_prompt_delays_the_others_first_token(result: bench.BenchResult) -> None:
    assert [st.agents for st in result.stalls] == list(AGENTS)
    for st in result.stalls:
        assert st.with_long.ttft(50) > st.without.ttft(50)
        assert st.with_long.latency(50) > st.without.latency(50)
        assert st.ttft_ratio > 1
        (long_req, *_) = st.with_long.long
        assert len(st.with_long.long) == ROUNDS
        assert abs(long_req.prompt_tokens - LONG_PROMPT) < 0.1 * LONG_PROMPT
        # the long agent is not in the others' figures; they were sent while it was read
        assert len(st.with_long.chat) == st.agents * ROUNDS
        assert 0 < st.others_delay_s < st.long_alone.ttft_s
        assert all(r.start_s >= st.others_delay_s for r in st.with_long.chat)


@pytest.mark.real
def test_prompt_is_sized_with_tokenize(server: realserver.Server) -> None:
    settings = bench.BenchSettings(
        url=server.url, agents=(2,), max_tokens=2, prompt_tokens=PROMPT_TOKENS
    )
    result = bench.run_bench(settings)
    assert result.prompt.method == "apply-template + tokenize"
    assert result.prompt.measured_tokens is not None
    assert abs(result.prompt.measured_tokens - PROMPT_TOKENS) <= 6
    # the server reads about as many tokens as were aimed at, chat template included
    assert abs(result.levels[0].mean_prompt_tokens - PROMPT_TOKENS) <= 10


@pytest.mark.real
def test_header_reports_the_servers_slots(result: bench.BenchResult) -> None:
    assert result.server.total_slots == 4
    assert result.server.n_ctx_slot == 4096
    assert result.server.slots_count == 4
    assert result.server.to_dict()["generation"] == GENERATION
    assert any("exceed the server's 4 slots" in n for n in result.notes)


@pytest.mark.real
def test_text_report_has_a_row_per_agent_count(result: bench.BenchResult) -> None:
    text = bench.render_text(result)
    assert "total_slots 4, n_ctx per slot 4096; /slots lists 4" in text
    assert "id=7" in text
    rows = [ln.split() for ln in text.splitlines() if re.match(r"\s+\d+\s+\d", ln)]
    assert [r[0] for r in rows] == ["1", "4", "1", "4"]  # levels, then the stall table


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([3.0], 95, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        ([0.0, 10.0], 95, 9.5),
        ([], 50, 0.0),
    ],
)
def test_percentile(values: list[float], q: float, expected: float) -> None:
    assert bench.percentile(values, q) == pytest.approx(expected)


# --------------------------------------------------------------------------- the CLI


@pytest.mark.real
def test_json_output(server: realserver.Server, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--url", server.url, "--agents", "1", "2", "--max-tokens", "4",
                 "--json"])  # fmt: skip
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert {"ok", "server", "settings", "prompt", "levels", "stalls", "notes"} <= data.keys()
    assert data["ok"] is True
    assert {"total_slots", "n_ctx_slot", "slots_count", "generation"} <= data["server"].keys()
    assert [lv["agents"] for lv in data["levels"]] == [1, 2]
    level_keys = {"agents", "total_tok_s", "per_agent_tok_s", "wall_s", "latency_p50_s",
                  "latency_p95_s", "ttft_p50_s", "ttft_p95_s", "completion_tokens",
                  "requests"}  # fmt: skip
    for lv in data["levels"]:
        assert level_keys <= lv.keys()
        assert lv["completion_tokens"] == sum(r["completion_tokens"] for r in lv["requests"])
    assert data["stalls"] == []


@pytest.mark.real
def test_plot_is_a_png(
    server: realserver.Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import matplotlib.image

    out = tmp_path / "bench.png"
    code = main(["bench", "--url", server.url, "--agents", "1", "2", "--max-tokens", "4",
                 "--plot", str(out)])  # fmt: skip
    assert code == 0
    assert f"plot written to {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_plot_without_matplotlib_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from launcher.reports import bench\n"
        "try:\n    bench.check_plot_available()\n"
        "except bench.InvalidInput as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'llama-launcher[plot]'" in out.stdout


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--agents", "0"], "--agents 0"),
        (["--agents", "2", "-1"], "--agents -1"),
        (["--max-tokens", "0"], "--max-tokens 0"),
        (["--rounds", "0"], "--rounds 0"),
        (["--long-prompt", "-5"], "--long-prompt -5"),
        (["--url", "localhost:8080"], "'localhost:8080'"),
        (["--api-key-file", "/nonexistent/key"], "/nonexistent/key"),
        (["--plot", "/nonexistent/dir/b.png"], "/nonexistent/dir"),
        (["--timeout", "0"], "--timeout 0"),
    ],
)
def test_bad_input_exits_2(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *flags]) == 2
    assert named in capsys.readouterr().err


def test_a_unit_without_a_live_generation_needs_a_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LLAMA_LAUNCHER_STATE_DIR", str(tmp_path / "state"))
    assert main(["bench", "--unit", "no-such-unit"]) == 2
    assert "--unit no-such-unit: llama-launcher has no live generation" in capsys.readouterr().err


def test_bad_agents_raise_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="--agents 0"):
        bench.run_bench(bench.BenchSettings(agents=(0,)))


def test_unreachable_server_is_a_probe_error(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{realserver.free_port()}"
    with pytest.raises(ProbeError, match=re.escape(url)):
        bench.run_bench(bench.BenchSettings(url=url))
    assert main(["bench", "--url", url, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["error"] == "ProbeError"
    assert "--url" in data["message"]


@pytest.mark.real
def test_api_key_is_sent_and_never_printed(
    tiny_model: Path, llama_server_bin: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = "s3cret-bench-key"
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    args = ["-np", "2", "-c", "4096", "--api-key-file", str(key_file)]
    with realserver.run_server(tiny_model, args, binary=llama_server_bin) as srv:
        base = ["bench", "--url", srv.url, "--agents", "1", "--max-tokens", "4"]
        assert main(base) == 1
        assert "--api-key-file" in capsys.readouterr().err
        assert main([*base, "--api-key-file", str(key_file)]) == 0
        text = capsys.readouterr()
        assert main([*base, "--api-key-file", str(key_file), "--json"]) == 0
        data = capsys.readouterr()
    assert "total_slots 2" in text.out
    assert json.loads(data.out)["levels"][0]["completion_tokens"] == 4
    for out in (text.out, text.err, data.out, data.err):
        assert key not in out
