"""``llama-launcher bench`` against the real llama-server on generated models: no mocks.

One bench run on a module-scoped server with the tiny model feeds most tests. The tests
assert what the server did, never how fast: its token and decode counts (``/metrics``), its
own ``timings`` of each request, and the order of events in the streams. Speeds and ratios
are the bench's output, printed by ``scripts/bench-agents``; two rounds measured
milliseconds apart on a shared CPU swap their medians under load.

The concurrency tests use a wider model (2 layers, n_embd 1024, ~130 MB, written in about
half a second): its decode step takes long enough that four agents sent at once all reach
the server long before the first of them has its 64 tokens, even on a busy 2-core box.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import realserver
import tinymodel

from launcher.bench import agents, chat, report, results
from launcher.cli import main
from launcher.errors import InvalidInput, ProbeError

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
#: Tokens per answer in the concurrency run: the steps in which the 4 agents must all arrive.
CONCURRENT_TOKENS = 64


@pytest.fixture(scope="module")
def server(tiny_model: Path, llama_server_bin: str) -> Iterator[realserver.Server]:
    with realserver.run_server(tiny_model, SERVER_ARGS, binary=llama_server_bin) as srv:
        yield srv


def metric(url: str, name: str) -> float:
    """``llamacpp:NAME`` from /metrics: one of the server's own counters."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(rf"^llamacpp:{name} (\S+)$", text, re.MULTILINE)
    assert found, text
    return float(found.group(1))


def predicted_total(url: str) -> int:
    """Tokens the server says it generated (``tokens_predicted_total``)."""
    return int(metric(url, "tokens_predicted_total"))


def decode_total(url: str) -> int:
    """``llama_decode()`` calls the server made (``n_decode_total``): one per batch, whatever
    number of slots the batch holds."""
    return int(metric(url, "n_decode_total"))


@dataclass
class ServerTimings(httpx.AsyncBaseTransport):
    """The network, and the ``timings`` llama-server puts in the last chunk of every streamed
    chat (``prompt_n``, ``prompt_ms``, ``cache_n``: measured by the server itself), by the
    start of the request's prompt (the bench's ``[tag-seq] Agent N`` or ``Long agent``).

    Handed to ``run_bench`` as its transport. Each request gets its own connection, closed
    with its response: the bench gives the transport to many clients and closes each."""

    by_head: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        network = httpx.AsyncHTTPTransport(verify=False)
        response = await network.handle_async_request(request)
        head = None
        if request.url.path == chat.CHAT_PATH:
            head = json.loads(request.content)["messages"][0]["content"].split(":")[0]
        stream = _Tee(response.stream, network, head, self.by_head)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=stream,
            extensions=response.extensions,
        )

    def long_reads_s(self) -> list[float]:
        """Seconds the server took to read each long prompt (its ``prompt_ms``)."""
        return [t["prompt_ms"] / 1000 for h, t in self.by_head.items() if h.endswith("Long agent")]


@dataclass
class _Tee(httpx.AsyncByteStream):
    """A response's bytes, passed on as they come; the last ``timings`` of its SSE lines is
    kept under ``head``."""

    inner: Any  # the network transport's stream
    network: httpx.AsyncHTTPTransport
    head: str | None
    by_head: dict[str, dict[str, Any]]

    async def __aiter__(self) -> AsyncIterator[bytes]:
        rest = b""
        async for part in self.inner:
            if self.head is not None:
                *lines, rest = (rest + part).split(b"\n")
                for line in lines:
                    if line.startswith(b"data: {") and b'"timings"' in line:
                        self.by_head[self.head] = json.loads(line[6:])["timings"]
            yield part

    async def aclose(self) -> None:
        await self.inner.aclose()
        await self.network.aclose()


@dataclass(frozen=True)
class Concurrent:
    result: agents.BenchResult
    decodes: int  # the server's llama_decode() calls during the run


@pytest.fixture(scope="module")
def concurrent(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: str) -> Concurrent:
    """One run of 4 agents at once on a model whose decode step takes milliseconds, and the
    decode calls the server made meanwhile."""
    shape = tinymodel.Shape(layers=2, n_embd=1024, heads=8, kv_heads=4, ff=4096)
    model = tinymodel.write(tmp_path_factory.mktemp("bench") / "wide.gguf", shape)
    with realserver.run_server(model, SERVER_ARGS, binary=llama_server_bin) as srv:
        settings = agents.BenchSettings(url=srv.url, agents=(4,), max_tokens=CONCURRENT_TOKENS)
        before = decode_total(srv.url)
        result = agents.run_bench(settings)
        return Concurrent(result, decode_total(srv.url) - before)


@dataclass(frozen=True)
class Measured:
    result: agents.BenchResult
    predicted: int  # tokens the server says it generated during the run
    timings: ServerTimings


@pytest.fixture(scope="module")
def measured(server: realserver.Server) -> Measured:
    """One bench run, the tokens the server says it generated meanwhile, and its timings of
    every request."""
    before = predicted_total(server.url)
    settings = agents.BenchSettings(
        url=server.url,
        agents=AGENTS,
        max_tokens=MAX_TOKENS,
        long_prompt_tokens=LONG_PROMPT,
        rounds=ROUNDS,
    )
    timings = ServerTimings()
    result = agents.run_bench(settings, generation=GENERATION, transport=timings)
    return Measured(result, predicted_total(server.url) - before, timings)


@pytest.fixture(scope="module")
def result(measured: Measured) -> agents.BenchResult:
    return measured.result


def all_requests(result: agents.BenchResult) -> list[results.RequestResult]:
    reqs = [r for lv in result.levels for r in lv.requests]
    return reqs + [r for st in result.stalls for r in st.with_long.requests]


# --------------------------------------------------------------------------- the core


@pytest.mark.real
def test_tokens_are_the_sum_of_the_servers_usage(result: agents.BenchResult) -> None:
    for lv in result.levels:
        assert len(lv.chat) == lv.agents * ROUNDS
        assert lv.completion_tokens == sum(r.completion_tokens for r in lv.chat)
        # ignore_eos makes every answer exactly max_tokens long
        assert lv.completion_tokens == lv.agents * ROUNDS * MAX_TOKENS
        assert lv.to_dict()["completion_tokens"] == lv.completion_tokens


@pytest.mark.real
def test_token_counts_match_the_servers_metrics(measured: Measured) -> None:
    result = measured.result
    counted = sum(r.completion_tokens for r in all_requests(result))
    # plus the uncounted warm-up request of max_tokens and the long prompt read alone
    expected = counted + MAX_TOKENS + result.stalls[0].long_alone.completion_tokens
    assert measured.predicted == expected


@pytest.mark.real
def test_four_agents_are_served_at_once(concurrent: Concurrent) -> None:
    (level,) = concurrent.result.levels
    assert len(level.chat) == 4
    # Every agent had its first token before any agent finished: the server decoded them
    # together. Served one after another, the 2nd would start after the 1st ended.
    reqs = level.chat
    assert max(r.start_s + r.ttft_s for r in reqs) < min(r.start_s + r.latency_s for r in reqs)


@pytest.mark.real
def test_four_agents_share_the_servers_decode_steps(concurrent: Concurrent) -> None:
    # An answer of N tokens served alone takes N llama_decode() calls (the prompt's gives the
    # first token). The run is the uncounted warm-up and the 4 agents: one after another,
    # 5 x N calls; in shared batches, N for the warm-up and N for the four, plus one call
    # per step by which the last agent arrived after the first (fewer than N: it had its
    # first token before the first one finished).
    n = CONCURRENT_TOKENS
    assert concurrent.result.levels[0].completion_tokens == 4 * n
    assert concurrent.decodes < 3 * n, concurrent.decodes


@pytest.mark.real
def test_a_long_prompt_delays_the_others_first_token(measured: Measured) -> None:
    # The server reads a prompt in one batch and takes new requests between batches, so an
    # agent sent while the long prompt is read gets its first token only after that read
    # ended: at least the read's own duration (the server's prompt_ms, its shortest of
    # them) after the long prompt was sent. Where the server let the short prompts in
    # between, their first tokens would come halfway through the read.
    reads = measured.timings.long_reads_s()
    assert len(reads) == 1 + len(AGENTS) * ROUNDS  # alone, then once a round with others
    read_s = min(reads)
    for st in measured.result.stalls:
        for rnd in range(ROUNDS):
            (long_req,) = [r for r in st.with_long.long if r.round == rnd]
            others = [r for r in st.with_long.chat if r.round == rnd]
            first_tokens = [r.start_s + r.ttft_s for r in others]
            assert min(first_tokens) >= long_req.start_s + read_s, (st.agents, rnd, read_s)


@pytest.mark.real
def test_the_stall_table_has_the_others_figures_without_the_long_agent(
    result: agents.BenchResult,
) -> None:
    assert [st.agents for st in result.stalls] == list(AGENTS)
    for st in result.stalls:
        (long_req, *_) = st.with_long.long
        assert len(st.with_long.long) == ROUNDS
        assert abs(long_req.prompt_tokens - LONG_PROMPT) < 0.1 * LONG_PROMPT
        assert len(st.with_long.chat) == st.agents * ROUNDS
        assert len(st.without.chat) == st.agents * ROUNDS
        # the others were sent halfway through the time the long prompt took alone
        assert st.others_delay_s == st.long_alone.ttft_s / 2
        assert all(r.start_s >= st.others_delay_s for r in st.with_long.chat)


@pytest.mark.real
def test_prompt_is_sized_with_tokenize(server: realserver.Server) -> None:
    settings = agents.BenchSettings(
        url=server.url, agents=(2,), max_tokens=2, prompt_tokens=PROMPT_TOKENS
    )
    result = agents.run_bench(settings)
    assert result.prompt.method == "apply-template + tokenize"
    assert result.prompt.measured_tokens is not None
    assert abs(result.prompt.measured_tokens - PROMPT_TOKENS) <= 6
    # the server reads about as many tokens as were aimed at, chat template included
    assert abs(result.levels[0].mean_prompt_tokens - PROMPT_TOKENS) <= 10


@pytest.mark.real
def test_header_reports_the_servers_slots(result: agents.BenchResult) -> None:
    assert result.server.total_slots == 4
    assert result.server.n_ctx_slot == 4096
    assert result.server.slots_count == 4
    assert result.server.to_dict()["generation"] == GENERATION
    assert any("exceed the server's 4 slots" in n for n in result.notes)


@pytest.mark.real
def test_text_report_has_a_row_per_agent_count(result: agents.BenchResult) -> None:
    text = report.render_text(result)
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
    assert results.percentile(values, q) == pytest.approx(expected)


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

    out = tmp_path / "agents.png"
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
        "from launcher.bench import report\n"
        "from launcher.errors import InvalidInput\n"
        "try:\n    report.check_plot_available()\n"
        "except InvalidInput as e:\n    print(e)\n"
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
        agents.run_bench(agents.BenchSettings(agents=(0,)))


def test_unreachable_server_is_a_probe_error(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{realserver.free_port()}"
    with pytest.raises(ProbeError, match=re.escape(url)):
        agents.run_bench(agents.BenchSettings(url=url))
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
