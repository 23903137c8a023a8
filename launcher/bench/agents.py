"""Measure several agents sharing one llama-server: total and per-agent speed, latency, and
time to first token, with and without one long prompt read alongside.

Works against any OpenAI-compatible llama-server URL. Each agent is one
``httpx.AsyncClient`` that streams ``/v1/chat/completions`` with
``stream_options.include_usage`` (read by ``launcher.bench.chat``); generated tokens are the
server's own ``usage.completion_tokens`` from the final chunk (``choices: []``), never
estimated.

A level of N agents runs ``rounds`` rounds; in each round all N agents send one request at
once and the round ends when the last one finishes. With ``long_prompt_tokens``, every level
runs a second time with one extra agent that sends a fresh long prompt at the start of each
round, and the others send theirs halfway through its reading (timed once alone first):
llama-server reads a prompt in the same batches as the other slots' decode steps, so while
the long prompt is read every other agent waits (the stall this measures).

Every request starts with a run-unique tag so no request reuses another's prompt cache:
the figures are for prompts read cold.

The server is read first (``launcher.bench.target``); the figures are
``launcher.bench.results``'s, summed up in one ``BenchResult``; ``launcher.bench.report``
words and plots it. Only the CLI prints; the bench returns frozen dataclasses and raises
``LauncherError``s.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.bench import chat
from launcher.bench.results import LevelResult, RequestResult, StallResult
from launcher.bench.target import DEFAULT_URL, PromptInfo, ServerInfo, probe_server, size_prompt
from launcher.errors import InvalidInput, ProbeError

if TYPE_CHECKING:
    import httpx
    from pydantic import SecretStr

#: The long-prompt agent only has to make the server read its prompt; one token answers it.
LONG_PROMPT_MAX_TOKENS = 1


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class BenchSettings:
    """What to measure. ``validate()`` raises ``InvalidInput`` naming the bad value."""

    url: str = DEFAULT_URL
    agents: tuple[int, ...] = (1, 2, 4)
    max_tokens: int = 64
    prompt_tokens: int | None = None  # None: a one-line chat prompt
    long_prompt_tokens: int | None = None
    rounds: int = 1
    timeout_s: float = 300.0

    def validate(self) -> None:
        """Raise ``InvalidInput`` for values that cannot be measured."""
        if not self.url.startswith(("http://", "https://")):
            raise InvalidInput(f"--url {self.url!r} is not an http(s) URL; use e.g. {DEFAULT_URL}")
        if not self.agents:
            raise InvalidInput("--agents is empty; give at least one count, e.g. --agents 1 2 4")
        for n in self.agents:
            if n <= 0:
                raise InvalidInput(
                    f"--agents {n} is not a positive number of agents; use e.g. --agents 1 2 4"
                )
        _positive("--max-tokens", self.max_tokens, "e.g. --max-tokens 64")
        _positive("--rounds", self.rounds, "e.g. --rounds 3")
        if self.prompt_tokens is not None:
            _positive("--prompt-tokens", self.prompt_tokens, "e.g. --prompt-tokens 200")
        if self.long_prompt_tokens is not None:
            _positive("--long-prompt", self.long_prompt_tokens, "e.g. --long-prompt 2000")
        if self.timeout_s <= 0:
            raise InvalidInput(
                f"--timeout {self.timeout_s} must be positive; use e.g. --timeout 300"
            )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "agents": list(self.agents)}


def _positive(flag: str, value: int, example: str) -> None:
    if value <= 0:
        raise InvalidInput(f"{flag} {value} must be a positive integer; use {example}")


def api_key_from_file(path: Path | str) -> SecretStr:
    """The server's API key from an ``--api-key-file``, read the way llama-server reads it
    (``launcher.deploy.keys.read_api_key``); a file without a key is refused."""
    from pydantic import SecretStr

    from launcher.deploy.keys import read_api_key

    p = Path(path)
    try:
        key = read_api_key(p)
    except ProbeError as e:
        raise InvalidInput(
            f"--api-key-file {str(p)!r}: {e}; give a readable file that holds the server's key"
        ) from e
    if not key:
        raise InvalidInput(
            f"--api-key-file {str(p)!r} is empty; put the server's API key on its first line"
        )
    return SecretStr(key)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class BenchResult:
    """Everything one bench run measured."""

    server: ServerInfo
    settings: BenchSettings
    prompt: PromptInfo
    levels: tuple[LevelResult, ...]
    stalls: tuple[StallResult, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": True,
            "server": self.server.to_dict(),
            "settings": self.settings.to_dict(),
            "prompt": self.prompt.to_dict(),
            "levels": [lv.to_dict() for lv in self.levels],
            "stalls": [s.to_dict() for s in self.stalls],
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------- one request


def _client(
    settings: BenchSettings,
    api_key: SecretStr | None,
    transport: httpx.AsyncBaseTransport | None,
) -> httpx.AsyncClient:
    import httpx

    from launcher.server import httpclient

    return httpclient.client(
        httpx.AsyncClient,
        settings.url,
        api_key.get_secret_value() if api_key else None,
        httpx.Timeout(settings.timeout_s, connect=10.0),
        transport,
    )


@dataclass(frozen=True)
class _Request:
    agent: int
    round: int
    long_prompt: bool
    body: dict[str, Any]


async def _stream_chat(
    client: httpx.AsyncClient, req: _Request, round_start: float, delay_s: float = 0.0
) -> RequestResult:
    """Send one streamed chat completion ``delay_s`` into the round; time it; take its usage
    from the final chunk."""
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    answer = await chat.stream_chat_async(client, req.body)
    usage = _usage_of(client, answer)
    # Text held back (an incomplete UTF-8 sequence) still means a token was generated.
    ttft = answer.ttft_s if answer.ttft_s is not None else answer.elapsed_s
    return RequestResult(
        agent=req.agent,
        round=req.round,
        long_prompt=req.long_prompt,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        start_s=answer.sent_at - round_start,
        latency_s=answer.elapsed_s,
        ttft_s=ttft,
    )


def _usage_of(client: httpx.AsyncClient, answer: chat.ChatResult) -> chat.Usage:
    """The answer's usage; ``ProbeError`` naming the fix when it failed or has none."""
    import httpx

    where = f"{client.base_url}{chat.CHAT_PATH}"
    if isinstance(answer.cut, httpx.TimeoutException):
        raise ProbeError(
            f"{where} did not finish within the timeout ({answer.cut!r}); "
            "raise --timeout, lower --max-tokens or --long-prompt, or use fewer agents"
        ) from answer.cut
    if answer.cut is not None:
        raise ProbeError(f"{where} failed: {answer.cut!r}") from answer.cut
    if answer.error is not None and not answer.error.in_stream:
        raise _request_failed(where, answer.status, answer.error)
    if answer.error is not None:
        raw = answer.error.raw
        raise ProbeError(f"{where} streamed an error: {raw[:500]}{_context_hint(raw)}")
    if answer.malformed is not None:
        raise ProbeError(f"{where} streamed {answer.malformed}")
    if answer.usage is None:
        raise ProbeError(
            f"{where} sent no usage in its stream; tokens are counted "
            "from the server's usage, never estimated: use a server that honours "
            "stream_options.include_usage (llama-server does)"
        )
    return answer.usage


def _context_hint(text: str) -> str:
    if "context" not in text:
        return ""
    return "; the prompt does not fit a slot: lower --prompt-tokens/--long-prompt or raise -c"


def _request_failed(where: str, status: int | None, error: chat.ServerError) -> ProbeError:
    if status == 401:
        return ProbeError(
            f"{where} answered 401 Invalid API Key; pass --api-key-file with the server's key"
        )
    hint = _context_hint(error.raw) if status == 400 else ""
    return ProbeError(f"{where} answered {status}: {error.message}{hint}")


# --------------------------------------------------------------------------- the run


def _head(tag: str, seq: int, agent: int, long_prompt: bool) -> str:
    """The start of every prompt: unique per request, so no request reuses a cached prefix."""
    who = "Long agent" if long_prompt else f"Agent {agent}"
    return f"[{tag}-{seq}] {who}: "


@dataclass
class _Run:
    """Per-run state: the clients, the prompts, and a tag that keeps prompts cache-cold."""

    settings: BenchSettings
    api_key: SecretStr | None
    transport: httpx.AsyncBaseTransport | None
    chat_text: str
    long_text: str
    tag: str
    seq: int = 0

    def body(self, agent: int, long_prompt: bool, text: str, max_tokens: int) -> dict[str, Any]:
        self.seq += 1
        content = _head(self.tag, self.seq, agent, long_prompt) + text
        return {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            # llama-server extension: generate exactly max_tokens, so every level counts
            # the same work (a random-weight model would otherwise stop at random).
            "ignore_eos": True,
        }

    def chat_request(self, agent: int, rnd: int) -> _Request:
        body = self.body(agent, False, self.chat_text, self.settings.max_tokens)
        return _Request(agent, rnd, False, body)

    def long_request(self, agent: int, rnd: int) -> _Request:
        body = self.body(agent, True, self.long_text, LONG_PROMPT_MAX_TOKENS)
        return _Request(agent, rnd, True, body)


async def _run_level(
    run: _Run, agents: int, with_long: bool, rounds: int, others_delay_s: float = 0.0
) -> LevelResult:
    """``rounds`` rounds of ``agents`` concurrent requests, each agent its own client.

    With ``with_long``, one more agent sends the long prompt at the start of each round and
    the others follow ``others_delay_s`` later.
    """
    n_clients = agents + (1 if with_long else 0)
    clients = [_client(run.settings, run.api_key, run.transport) for _ in range(n_clients)]
    results: list[RequestResult] = []
    walls: list[float] = []
    try:
        for rnd in range(rounds):
            reqs = [run.chat_request(i, rnd) for i in range(agents)]
            delays = [others_delay_s if with_long else 0.0] * agents
            if with_long:
                reqs.insert(0, run.long_request(agents, rnd))
                delays.insert(0, 0.0)
                order = [clients[agents], *clients[:agents]]
            else:
                order = clients
            start = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(_stream_chat(c, r, start, d))
                    for c, r, d in zip(order, reqs, delays, strict=True)
                ]
            walls.append(time.perf_counter() - start)
            results.extend(t.result() for t in tasks)
    except ExceptionGroup as eg:
        leaf = _first_leaf(eg)
        raise leaf from leaf.__cause__
    finally:
        for c in clients:
            await c.aclose()
    results.sort(key=lambda r: (r.round, r.long_prompt, r.agent))
    return LevelResult(agents, with_long, tuple(walls), tuple(results))


def _first_leaf(eg: BaseExceptionGroup[Exception]) -> Exception:
    """The first real error of a task group, so the CLI sees one ``ProbeError``."""
    first = eg.exceptions[0]
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


def _notes(settings: BenchSettings, server: ServerInfo, prompt: PromptInfo) -> tuple[str, ...]:
    notes: list[str] = []
    slots = server.total_slots or server.slots_count
    if slots is not None:
        for n in settings.agents:
            extra = 1 if settings.long_prompt_tokens else 0
            if n + extra > slots:
                notes.append(
                    f"{n} agents{' + the long-prompt agent' if extra else ''} exceed the "
                    f"server's {slots} slots: the surplus requests queue for a free slot"
                )
    if prompt.method == "estimate":
        notes.append("the server has no /tokenize: the prompt size is a guess")
    if server.total_slots is None:
        notes.append("no /props: the slot layout is unknown (not a llama-server?)")
    return tuple(notes)


async def run_bench_async(
    settings: BenchSettings,
    api_key: SecretStr | None = None,
    generation: Mapping[str, Any] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> BenchResult:
    """The bench in an event loop that already runs; see ``run_bench``."""
    settings.validate()
    tag = uuid.uuid4().hex[:8]
    async with _client(settings, api_key, transport) as probe:
        server = await probe_server(probe, api_key, generation)
        if settings.prompt_tokens is None:
            chat_text = "write two sentences about rivers."
            prompt = PromptInfo(None, None, "chat line")
        else:
            head = _head(tag, 10, 0, long_prompt=False)
            chat_text, prompt = await size_prompt(probe, settings.prompt_tokens, head)
        long_text = ""
        if settings.long_prompt_tokens is not None:
            head = _head(tag, 10, 0, long_prompt=True)
            long_text, _ = await size_prompt(probe, settings.long_prompt_tokens, head)
    run = _Run(settings, api_key, transport, chat_text, long_text, tag)
    # A first request pays one-off costs (graph allocation, warm caches); it is not counted.
    await _run_level(run, 1, False, rounds=1)
    levels: list[LevelResult] = []
    stalls: list[StallResult] = []
    long_alone = None
    if settings.long_prompt_tokens is not None:
        # How long the server takes to read the long prompt with nobody else: the others
        # then send theirs halfway through, so they surely arrive while it is read.
        (long_alone,) = (await _run_level(run, 0, True, rounds=1)).long
    for n in settings.agents:
        level = await _run_level(run, n, False, settings.rounds)
        levels.append(level)
        if long_alone is not None:
            delay = long_alone.ttft_s / 2
            with_long = await _run_level(run, n, True, settings.rounds, delay)
            stalls.append(StallResult(n, level, with_long, long_alone, delay))
    return BenchResult(
        server=server,
        settings=settings,
        prompt=prompt,
        levels=tuple(levels),
        stalls=tuple(stalls),
        notes=_notes(settings, server, prompt),
    )


def run_bench(
    settings: BenchSettings,
    api_key: SecretStr | None = None,
    generation: Mapping[str, Any] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> BenchResult:
    """Measure ``settings.agents`` concurrent agents against ``settings.url``.

    ``generation`` is the live generation when llama-launcher deployed the server (the CLI
    passes it); it is reported in the header as given. ``transport`` replaces httpx's network
    transport, for a recorded or in-process server.
    """
    return asyncio.run(run_bench_async(settings, api_key, generation, transport))
