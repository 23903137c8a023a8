"""One streamed chat completion, sent and read to its end: the one reader of llama-server's
streamed ``/v1/chat/completions`` that the bench, the scripts and the tests share.

The request always asks for ``stream_options.include_usage``, so the stream's last chunk
(``choices: []``) carries the server's own token counts; llama-server puts its ``timings``
(``prompt_n``, ``cache_n``, ...) in that chunk too. What the server sends is read from its
Server-Sent Events lines (``tools/server/server-context.cpp``, b11434): ``data: {chunk}``,
``data: [DONE]`` at the end, ``:`` pings, and an error after the stream began as
``data: {"error": {...}}``, after which the server ends the stream without ``[DONE]`` (an
``error: {...}`` line is read the same way). An error before the first chunk is an ordinary
answer with its status (500 "Context size has been exceeded", 400 a prompt too long).

Nothing here raises for what the server or the network did: a refusal (status not 200), an
error event in a 200 stream ("Context size has been exceeded"), a line that is not a chunk,
and a cut or timed-out connection are fields of the ``ChatResult``, and the caller decides
what each means. ``stream_chat`` (``httpx.Client``) and ``stream_chat_async``
(``httpx.AsyncClient``) differ only in how they read lines; ``_Reader`` parses them for both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from launcher.server.httpclient import error_text

CHAT_PATH = "/v1/chat/completions"

#: Called with every chunk as it is read (a test waits for a request to be generating).
OnChunk = Callable[[Mapping[str, Any]], object]


@dataclass(frozen=True)
class Usage:
    """The stream's final ``usage``: the server's own counts, never estimated."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    #: ``prompt_tokens_details.cached_tokens``: prompt tokens served from the slot's cache
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Timings:
    """llama-server's ``timings`` of the request (``server_slot_stats::to_json``), measured by
    the server itself."""

    prompt_n: int  # prompt tokens read (the cached ones not counted)
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int | None = None  # prompt tokens taken from the cache


@dataclass(frozen=True)
class ServerError:
    """The server's own error: its answer when it refused the request (status not 200), or
    an error event in a 200 stream."""

    message: str  # the error's message, first line
    raw: str  # the answer's body, or the event's data, as sent
    in_stream: bool


@dataclass(frozen=True)
class ChatResult:
    """What came back for one streamed chat completion. Times are ``time.perf_counter()``
    seconds; the durations count from ``sent_at``."""

    sent_at: float
    elapsed_s: float  # until the stream ended, stopped or failed
    status: int | None = None  # None: no answer (the connection failed before one)
    text: str = ""  # the choices' ``delta.content``, joined
    chunks: int = 0  # choice deltas read (a role-only first delta counts)
    model: str | None = None  # the chunks' ``model``
    #: until the first chunk with a choice, whatever it held
    first_chunk_s: float | None = None
    #: until the first generated output (text, reasoning, a tool call); a stream whose
    #: choices never held any (text held back, an incomplete UTF-8 sequence) counts its first
    #: chunk with a choice
    ttft_s: float | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    done: bool = False  # ``data: [DONE]`` arrived
    error: ServerError | None = None
    #: what was wrong with a line that is not a chunk (not JSON, not an object, a usage that
    #: is not token counts); reading stopped there
    malformed: str | None = None
    #: the connection refused, cut or timed out (``httpx.TimeoutException``); reading stopped
    cut: httpx.HTTPError | None = None

    @property
    def complete(self) -> bool:
        """Answered, read to ``[DONE]``, with no error on the way."""
        return (
            self.status == 200
            and self.done
            and self.error is None
            and self.malformed is None
            and self.cut is None
        )

    @property
    def failure(self) -> str | None:
        """What went wrong, in a line: the cut connection, the bad line or the server's
        error; None when nothing did (a stream that ended without ``[DONE]`` included)."""
        if self.cut is not None:
            return f"{type(self.cut).__name__}: {self.cut}"
        if self.malformed is not None:
            return f"the server streamed {self.malformed}"
        if self.error is not None:
            return f"{self.status}: {self.error.message}"
        return None


def streaming(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` as a streamed request whose last chunk carries the usage."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def stream_chat(
    client: httpx.Client,
    body: Mapping[str, Any],
    *,
    url: str = CHAT_PATH,
    on_chunk: OnChunk | None = None,
) -> ChatResult:
    """Send ``body`` (messages, max_tokens, ...) streamed to ``url`` (the client's base URL
    joins a relative one) and read the answer to its end."""
    reader = _Reader(on_chunk)
    try:
        with client.stream("POST", url, json=streaming(body)) as resp:
            reader.status = resp.status_code
            if resp.status_code != 200:
                resp.read()
                reader.refused(resp)
            else:
                for line in resp.iter_lines():
                    if reader.line(line):
                        break
    except httpx.HTTPError as e:
        reader.cut = e
    return reader.result()


async def stream_chat_async(
    client: httpx.AsyncClient,
    body: Mapping[str, Any],
    *,
    url: str = CHAT_PATH,
    on_chunk: OnChunk | None = None,
) -> ChatResult:
    """``stream_chat`` on an ``httpx.AsyncClient``."""
    reader = _Reader(on_chunk)
    try:
        async with client.stream("POST", url, json=streaming(body)) as resp:
            reader.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                reader.refused(resp)
            else:
                async for line in resp.aiter_lines():
                    if reader.line(line):
                        break
    except httpx.HTTPError as e:
        reader.cut = e
    return reader.result()


@dataclass
class _Reader:
    """The lines of one answer, read into what becomes its ``ChatResult``."""

    on_chunk: OnChunk | None
    sent_at: float = field(default_factory=time.perf_counter)
    status: int | None = None
    parts: list[str] = field(default_factory=list)
    chunks: int = 0
    model: str | None = None
    first_chunk: float | None = None
    first_output: float | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    done: bool = False
    error: ServerError | None = None
    malformed: str | None = None
    cut: httpx.HTTPError | None = None

    def refused(self, resp: httpx.Response) -> None:
        self.error = ServerError(error_text(resp), resp.text, in_stream=False)

    def line(self, line: str) -> bool:
        """Read one SSE line; True when reading stops ([DONE], an error, a bad line)."""
        if line.startswith("error:"):  # an error sent as its own SSE field
            self.error = _event_error(line[6:].strip())
            return True
        if not line.startswith("data:"):
            return False  # a blank separator, a ``:`` ping, an ``event:`` name
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return True
        try:
            chunk = json.loads(data)
        except ValueError:
            self.malformed = f"a line that is not JSON: {data[:200]!r}"
            return True
        if not isinstance(chunk, dict):
            self.malformed = f"{data[:200]!r}, not an object"
            return True
        if "error" in chunk:
            self.error = _event_error(data)
        else:
            self.chunk(chunk, time.perf_counter())
        if self.on_chunk is not None:
            self.on_chunk(chunk)
        return self.error is not None or self.malformed is not None

    def chunk(self, chunk: Mapping[str, Any], now: float) -> None:
        if isinstance(chunk.get("model"), str):
            self.model = chunk["model"]
        choices = [c for c in chunk.get("choices") or () if isinstance(c, dict)]
        if choices and self.first_chunk is None:
            self.first_chunk = now
        if self.first_output is None and _has_output(choices):
            self.first_output = now
        for choice in choices:
            self.chunks += 1
            delta = choice.get("delta") or {}
            self.parts.append(delta.get("content") or "")
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
            if self.usage is None:
                self.malformed = f"a usage that is not token counts: {str(chunk['usage'])[:200]}"
        if "timings" in chunk:
            self.timings = _timings(chunk["timings"]) or self.timings

    def result(self) -> ChatResult:
        end = time.perf_counter()
        first = self.first_output if self.first_output is not None else self.first_chunk
        return ChatResult(
            sent_at=self.sent_at,
            elapsed_s=end - self.sent_at,
            status=self.status,
            text="".join(self.parts),
            chunks=self.chunks,
            model=self.model,
            first_chunk_s=self._since(self.first_chunk),
            ttft_s=self._since(first),
            finish_reason=self.finish_reason,
            usage=self.usage,
            timings=self.timings,
            done=self.done,
            error=self.error,
            malformed=self.malformed,
            cut=self.cut,
        )

    def _since(self, t: float | None) -> float | None:
        return None if t is None else t - self.sent_at


def _has_output(choices: list[dict[str, Any]]) -> bool:
    """True once a chunk carries generated output (a role-only first delta does not)."""
    for choice in choices:
        delta = choice.get("delta") or {}
        for key, value in delta.items():
            if key != "role" and value:
                return True
    return False


def _event_error(data: str) -> ServerError:
    """An error event's data: ``{"error": {"message": ...}}`` or the error object itself."""
    try:
        body = json.loads(data)
    except ValueError:
        return ServerError(data, data, in_stream=True)
    err = body.get("error", body) if isinstance(body, dict) else body
    message = err.get("message") if isinstance(err, dict) else None
    return ServerError(str(message if message is not None else err), data, in_stream=True)


def _usage(usage: object) -> Usage | None:
    """The usage's token counts, whole numbers; None when they are not."""
    if not isinstance(usage, Mapping):
        return None
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    total = usage.get("total_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=total if isinstance(total, int) else prompt + completion,
        cached_tokens=cached if isinstance(cached, int) else None,
    )


def _timings(timings: object) -> Timings | None:
    """llama-server's timings; None when the chunk's are not its shape (another server)."""
    if not isinstance(timings, Mapping):
        return None
    ints = [timings.get(k) for k in ("prompt_n", "predicted_n")]
    floats = [timings.get(k) for k in ("prompt_ms", "predicted_ms")]
    if not all(isinstance(x, int) for x in ints) or not all(
        isinstance(x, int | float) for x in floats
    ):
        return None
    cache_n = timings.get("cache_n")
    return Timings(
        prompt_n=int(timings["prompt_n"]),
        prompt_ms=float(timings["prompt_ms"]),
        predicted_n=int(timings["predicted_n"]),
        predicted_ms=float(timings["predicted_ms"]),
        cache_n=cache_n if isinstance(cache_n, int) else None,
    )
