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

Only the CLI prints; this module returns frozen dataclasses and raises ``LauncherError``s.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.bench import chat
from launcher.errors import InvalidInput, ProbeError

if TYPE_CHECKING:
    import httpx
    from pydantic import SecretStr

DEFAULT_URL = "http://127.0.0.1:8080"
CHAT_PATH = chat.CHAT_PATH
#: Words for filler text. Common English words are about one token each for most tokenizers.
FILLER_TEXT = (
    "the river runs past the old mill and the model reads every token of the text while "
    "the agent waits for its slot in the pool and the cache holds what it has seen"
)
#: Tokens per filler word assumed when the server has no ``/tokenize`` (llama-server has it).
TOKENS_PER_WORD_GUESS = 1.3
#: The long-prompt agent only has to make the server read its prompt; one token answers it.
LONG_PROMPT_MAX_TOKENS = 1
PLOT_HINT = "pip install 'llama-launcher[plot]'"


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
        return {
            "url": self.url,
            "agents": list(self.agents),
            "max_tokens": self.max_tokens,
            "prompt_tokens": self.prompt_tokens,
            "long_prompt_tokens": self.long_prompt_tokens,
            "rounds": self.rounds,
            "timeout_s": self.timeout_s,
        }


def _positive(flag: str, value: int, example: str) -> None:
    if value <= 0:
        raise InvalidInput(f"{flag} {value} must be a positive integer; use {example}")


def api_key_from_file(path: Path | str) -> SecretStr:
    """The server's API key from an ``--api-key-file``, read the way llama-server reads it
    (``launcher.deploy.keys.read_api_key``); a file without a key is refused."""
    from pydantic import SecretStr

    from launcher.deploy.keys import read_api_key
    from launcher.errors import ProbeError

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
class ServerInfo:
    """The configuration measured against, as the server reports it."""

    url: str
    model: str | None
    build_info: str | None
    total_slots: int | None  # /props total_slots
    n_ctx_slot: int | None  # /props default_generation_settings.n_ctx (per slot)
    slots_count: int | None  # len(/slots); None when the endpoint is off or absent
    #: The live generation if llama-launcher deployed this server; the caller passes it.
    generation: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "build_info": self.build_info,
            "total_slots": self.total_slots,
            "n_ctx_slot": self.n_ctx_slot,
            "slots_count": self.slots_count,
            "generation": dict(self.generation) if self.generation is not None else None,
        }


@dataclass(frozen=True)
class RequestResult:
    """One streamed chat completion."""

    agent: int  # 0..N-1; the long-prompt agent is N
    round: int
    long_prompt: bool
    prompt_tokens: int  # usage.prompt_tokens
    completion_tokens: int  # usage.completion_tokens
    start_s: float  # request sent, after the round's start
    latency_s: float  # request sent -> stream finished
    ttft_s: float  # request sent -> first generated text

    @property
    def tok_s(self) -> float:
        """This agent's speed: its tokens over its whole request time."""
        return self.completion_tokens / self.latency_s if self.latency_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "round": self.round,
            "long_prompt": self.long_prompt,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "start_s": round(self.start_s, 6),
            "latency_s": round(self.latency_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "tok_s": round(self.tok_s, 3),
        }


@dataclass(frozen=True)
class LevelResult:
    """N agents chatting at once for some rounds. Figures cover the N chat agents only."""

    agents: int
    with_long_prompt: bool
    round_wall_s: tuple[float, ...]  # each round: first request sent -> last one finished
    requests: tuple[RequestResult, ...]  # chat agents and, if any, the long-prompt agent

    @property
    def wall_s(self) -> float:
        return sum(self.round_wall_s)

    @property
    def chat(self) -> tuple[RequestResult, ...]:
        return tuple(r for r in self.requests if not r.long_prompt)

    @property
    def long(self) -> tuple[RequestResult, ...]:
        return tuple(r for r in self.requests if r.long_prompt)

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.chat)

    @property
    def total_tok_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def per_agent_tok_s(self) -> float:
        return _mean([r.tok_s for r in self.chat])

    @property
    def mean_prompt_tokens(self) -> float:
        return _mean([float(r.prompt_tokens) for r in self.chat])

    def latency(self, q: float) -> float:
        return percentile([r.latency_s for r in self.chat], q)

    def ttft(self, q: float) -> float:
        return percentile([r.ttft_s for r in self.chat], q)

    def to_dict(self) -> dict[str, Any]:
        return {
            "agents": self.agents,
            "with_long_prompt": self.with_long_prompt,
            "requests_count": len(self.chat),
            "completion_tokens": self.completion_tokens,
            "mean_prompt_tokens": round(self.mean_prompt_tokens, 1),
            "wall_s": round(self.wall_s, 6),
            "round_wall_s": [round(w, 6) for w in self.round_wall_s],
            "total_tok_s": round(self.total_tok_s, 3),
            "per_agent_tok_s": round(self.per_agent_tok_s, 3),
            "latency_p50_s": round(self.latency(50), 6),
            "latency_p95_s": round(self.latency(95), 6),
            "ttft_p50_s": round(self.ttft(50), 6),
            "ttft_p95_s": round(self.ttft(95), 6),
            "requests": [r.to_dict() for r in self.requests],
        }


@dataclass(frozen=True)
class StallResult:
    """The same level without and with one extra agent reading a long prompt.

    The others send their requests ``others_delay_s`` after the long one: half the time the
    server took to read the long prompt alone, so they arrive while it is being read.
    """

    agents: int
    without: LevelResult
    with_long: LevelResult
    long_alone: RequestResult  # the long prompt with no other agent
    others_delay_s: float

    @property
    def long_prompt_tokens(self) -> float:
        return _mean([float(r.prompt_tokens) for r in self.with_long.long])

    @property
    def ttft_ratio(self) -> float:
        """How many times longer the others waited for their first token (p50)."""
        base = self.without.ttft(50)
        return self.with_long.ttft(50) / base if base > 0 else math.inf

    @property
    def latency_ratio(self) -> float:
        base = self.without.latency(50)
        return self.with_long.latency(50) / base if base > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "agents": self.agents,
            "long_prompt_tokens": round(self.long_prompt_tokens, 1),
            "long_prompt_read_alone_s": round(self.long_alone.ttft_s, 6),
            "others_delay_s": round(self.others_delay_s, 6),
            "ttft_p50_without_s": round(self.without.ttft(50), 6),
            "ttft_p50_with_s": round(self.with_long.ttft(50), 6),
            "ttft_p95_without_s": round(self.without.ttft(95), 6),
            "ttft_p95_with_s": round(self.with_long.ttft(95), 6),
            "latency_p50_without_s": round(self.without.latency(50), 6),
            "latency_p50_with_s": round(self.with_long.latency(50), 6),
            "latency_p95_without_s": round(self.without.latency(95), 6),
            "latency_p95_with_s": round(self.with_long.latency(95), 6),
            "ttft_ratio": _round_ratio(self.ttft_ratio),
            "latency_ratio": _round_ratio(self.latency_ratio),
            "with_long": self.with_long.to_dict(),
        }


@dataclass(frozen=True)
class PromptInfo:
    """How the chat prompt was sized."""

    target_tokens: int | None
    measured_tokens: int | None  # by the server's tokenizer
    method: str  # "chat line", "apply-template + tokenize", "tokenize" or "estimate"

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_tokens": self.target_tokens,
            "measured_tokens": self.measured_tokens,
            "method": self.method,
        }


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


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _round_ratio(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# --------------------------------------------------------------------------- HTTP


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


def _error_text(resp: httpx.Response) -> str:
    from launcher.server.httpclient import error_text

    return error_text(resp)


def _unauthorized(url: str, path: str, api_key: SecretStr | None) -> ProbeError:
    fix = (
        "the key in --api-key-file is not the server's --api-key; give the right file"
        if api_key is not None
        else "the server wants an API key; pass --api-key-file FILE"
    )
    return ProbeError(f"{url}{path} answered 401 Invalid API Key: {fix}")


async def _get_json(client: httpx.AsyncClient, path: str, api_key: SecretStr | None) -> Any:
    """GET ``path``; None when the server does not have or has disabled the endpoint."""
    import httpx

    try:
        resp = await client.get(path)
    except httpx.HTTPError as e:
        raise ProbeError(f"GET {client.base_url}{path} failed: {e!r}") from e
    if resp.status_code == 401:
        raise _unauthorized(str(client.base_url), path, api_key)
    if resp.status_code != 200:
        return None
    try:
        return resp.json()
    except ValueError:
        return None


async def probe_server(
    client: httpx.AsyncClient,
    api_key: SecretStr | None,
    generation: Mapping[str, Any] | None = None,
) -> ServerInfo:
    """Check the server answers, and read the slot layout from ``/props`` and ``/slots``."""
    import httpx

    url = str(client.base_url)
    try:
        health = await client.get("/health")
    except httpx.HTTPError as e:
        raise ProbeError(
            f"cannot reach llama-server at {url} ({type(e).__name__}: {e}); "
            f"start it, or pass --url with its address (default {DEFAULT_URL})"
        ) from e
    if health.status_code == 503:
        raise ProbeError(f"{url} is still loading its model ({_error_text(health)}); retry")
    props = await _get_json(client, "/props", api_key)
    slots = await _get_json(client, "/slots", api_key)
    if not isinstance(props, dict):
        props = {}
    dgs = props.get("default_generation_settings")
    n_ctx = dgs.get("n_ctx") if isinstance(dgs, dict) else None
    total = props.get("total_slots")
    return ServerInfo(
        url=url,
        model=_model_name(props),
        build_info=_str_or_none(props.get("build_info")),
        total_slots=total if isinstance(total, int) else None,
        n_ctx_slot=n_ctx if isinstance(n_ctx, int) else None,
        slots_count=len(slots) if isinstance(slots, list) else None,
        generation=generation,
    )


def _model_name(props: Mapping[str, Any]) -> str | None:
    """The model's alias, or its file name (the alias defaults to the -m path)."""
    name = props.get("model_alias") or props.get("model_path")
    if not name:
        return None
    return Path(str(name)).name if str(name).endswith(".gguf") else str(name)


def _str_or_none(x: Any) -> str | None:
    return str(x) if x is not None else None


async def _post_json(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
    """POST ``body``; the JSON answer, or None when the server lacks the endpoint."""
    import httpx

    try:
        resp = await client.post(path, json=body)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return resp.json()
    except ValueError:
        return None


async def _count_tokens(client: httpx.AsyncClient, content: str) -> tuple[int | None, str]:
    """Tokens the server will read for a one-message chat of ``content``, and how counted.

    llama-server's ``/apply-template`` + ``/tokenize`` give exactly its ``prompt_tokens``;
    without ``/apply-template`` the message alone is counted; without ``/tokenize``, None.
    """
    messages = [{"role": "user", "content": content}]
    templated = await _post_json(client, "/apply-template", {"messages": messages})
    if isinstance(templated, dict) and isinstance(templated.get("prompt"), str):
        body = {"content": templated["prompt"], "add_special": True, "parse_special": True}
        method = "apply-template + tokenize"
    else:
        body = {"content": content, "add_special": False}
        method = "tokenize"
    answer = await _post_json(client, "/tokenize", body)
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    return (len(tokens), method) if isinstance(tokens, list) else (None, "estimate")


def filler(words: int) -> str:
    """Deterministic filler text of ``words`` words."""
    vocab = FILLER_TEXT.split()
    return " ".join(vocab[i % len(vocab)] for i in range(max(words, 1)))


async def size_prompt(
    client: httpx.AsyncClient, target: int, head: str = ""
) -> tuple[str, PromptInfo]:
    """Filler text so that a chat of ``head + filler`` is about ``target`` tokens.

    Sized with the server's own tokenizer when it has one, else guessed from the word count.
    """
    words = target
    count: int | None = None
    method = "estimate"
    for _ in range(6):
        count, method = await _count_tokens(client, head + filler(words))
        if count is None:
            guess = max(1, round(target / TOKENS_PER_WORD_GUESS))
            return filler(guess), PromptInfo(target, None, method)
        if abs(count - target) <= max(2, target // 50):
            break
        words = max(1, words + round((target - count) * words / max(count, 1)))
    return filler(words), PromptInfo(target, count, method)


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

    where = f"{client.base_url}{CHAT_PATH}"
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


# --------------------------------------------------------------------------- output


def check_plot_available(path: Path | str | None = None) -> None:
    """Raise ``InvalidInput`` when matplotlib is missing or ``path`` cannot be written.

    Checked before the bench runs, so a bad ``--plot`` does not throw its figures away.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise InvalidInput(
            f"--plot needs matplotlib, which is not installed; run {PLOT_HINT}"
        ) from e
    if path is not None:
        parent = Path(path).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise InvalidInput(
                f"--plot {str(path)!r}: {str(parent)!r} is not a writable directory; "
                "give a path in an existing directory"
            )


def write_plot(result: BenchResult, path: Path | str) -> Path:
    """Write a PNG of total and mean per-agent tok/s against the number of agents."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv.agents for lv in result.levels]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        ax.plot(xs, [lv.total_tok_s for lv in result.levels], marker="o", label="total tok/s")
        ax.plot(
            xs, [lv.per_agent_tok_s for lv in result.levels], marker="s", label="per-agent tok/s"
        )
        ax.set_xlabel("concurrent agents")
        ax.set_ylabel("generated tokens/s")
        ax.set_xticks(xs)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        slots = result.server.total_slots
        ctx = result.server.n_ctx_slot
        ax.set_title(
            f"{result.server.model or result.server.url}  slots={slots} n_ctx/slot={ctx}",
            fontsize=9,
        )
        out = Path(path)
        fig.tight_layout()
        fig.savefig(out, format="png")
    except OSError as e:
        raise InvalidInput(f"--plot {str(path)!r} cannot be written ({e.strerror})") from e
    finally:
        plt.close(fig)
    return out


def _fmt_generation(gen: Mapping[str, Any] | None) -> str:
    if gen is None:
        return "not deployed by llama-launcher (or not given)"
    return ", ".join(f"{k}={v}" for k, v in gen.items())


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def render_text(result: BenchResult) -> str:
    """The human report: header, one row per agent count, then the long-prompt stall."""
    s, srv = result.settings, result.server
    prompt = (
        f"~{result.prompt.target_tokens} tokens ({result.prompt.method})"
        if result.prompt.target_tokens
        else "one chat line"
    )
    lines = [
        f"server      {srv.url}  model {srv.model or '?'}  build {srv.build_info or '?'}",
        f"slots       /props total_slots {_q(srv.total_slots)}, n_ctx per slot "
        f"{_q(srv.n_ctx_slot)}; /slots lists {_q(srv.slots_count)}",
        f"generation  {_fmt_generation(srv.generation)}",
        f"requests    prompt {prompt}, max_tokens {s.max_tokens}, rounds {s.rounds}, "
        "greedy, streamed; tokens from the server's usage",
        "",
    ]
    rows = [
        [
            str(lv.agents),
            f"{lv.total_tok_s:.1f}",
            f"{lv.per_agent_tok_s:.1f}",
            f"{lv.wall_s:.2f}",
            f"{lv.latency(50):.3f}",
            f"{lv.latency(95):.3f}",
            f"{lv.ttft(50) * 1000:.0f}",
            f"{lv.ttft(95) * 1000:.0f}",
            str(lv.completion_tokens),
        ]
        for lv in result.levels
    ]
    header = ["agents", "total tok/s", "per-agent tok/s", "wall s", "lat p50 s", "lat p95 s",
              "TTFT p50 ms", "TTFT p95 ms", "tokens"]  # fmt: skip
    lines.append(_table(header, rows))
    if result.stalls:
        lines += ["", _stall_text(result.stalls)]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def _stall_text(stalls: Sequence[StallResult]) -> str:
    size = stalls[0].long_prompt_tokens
    alone = stalls[0].long_alone.ttft_s * 1000
    delay = stalls[0].others_delay_s * 1000
    rows = [
        [
            str(st.agents),
            f"{st.without.ttft(50) * 1000:.0f}",
            f"{st.with_long.ttft(50) * 1000:.0f}",
            _ratio(st.ttft_ratio),
            f"{st.without.latency(50):.3f}",
            f"{st.with_long.latency(50):.3f}",
            _ratio(st.latency_ratio),
        ]
        for st in stalls
    ]
    header = ["agents", "TTFT p50 ms", "+long", "x", "latency p50 s", "+long", "x"]
    return (
        f"long prompt: one extra agent sends {size:.0f} tokens (read alone in {alone:.0f} ms);\n"
        f"the others send theirs {delay:.0f} ms later, while it is read. Their figures without "
        "it and with it (+long):\n" + _table(header, rows)
    )


def _ratio(x: float) -> str:
    return f"{x:.1f}" if math.isfinite(x) else "-"


def _q(x: int | None) -> str:
    return "?" if x is None else str(x)
