"""The streamed-chat reader (launcher/bench/chat.py): what it makes of the lines a server
streams, and, against the real llama-server b11434, that its usage is the server's own count.

The pure tests hand the reader an ``httpx.MockTransport`` answering with the lines
llama-server sends (``tools/server/server-context.cpp``, b11434): the error event after the
stream began and a connection cut mid-stream are cases a healthy tiny model does not produce
on demand."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import realserver

from launcher.bench import chat

BODY = {"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 2}
#: The last chunks of a b11434 stream: finish, then the usage with its timings.
USAGE = {"completion_tokens": 2, "prompt_tokens": 11, "total_tokens": 13,
         "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
TIMINGS = {"cache_n": 4, "prompt_n": 7, "prompt_ms": 3.5, "prompt_per_token_ms": 0.5,
           "prompt_per_second": 2000.0, "predicted_n": 2, "predicted_ms": 6.0,
           "predicted_per_token_ms": 3.0, "predicted_per_second": 333.3}  # fmt: skip
ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                     "finish_reason": None}], "model": "tiny"}  # fmt: skip
CONTEXT_EXCEEDED = {"code": 500, "message": "Context size has been exceeded.",
                    "type": "server_error"}  # fmt: skip


def text(word: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": finish}],
            "model": "tiny"}  # fmt: skip


def data(chunk: object) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


WHOLE = [
    data(ROLE),
    data(text("O")),
    ": ping\n\n",
    data(text("K", "length")),
    data({"choices": [], "model": "tiny", "usage": USAGE, "timings": TIMINGS}),
    "data: [DONE]\n\n",
]


def answering(
    lines: Sequence[str], status: int = 200, cut: httpx.HTTPError | None = None
) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A transport that answers every request with ``lines`` (then, with ``cut``, fails as a
    connection cut mid-stream does), and the requests it got."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        headers = {"content-type": "text/event-stream" if status == 200 else "application/json"}
        return httpx.Response(status, headers=headers, stream=Lines(lines, cut))

    return httpx.MockTransport(handle), seen


@dataclass
class Lines(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body either client reads, produced as it is read, so it can fail midway."""

    lines: Sequence[str]
    cut: httpx.HTTPError | None

    def __iter__(self) -> Iterator[bytes]:
        yield from (line.encode() for line in self.lines)
        if self.cut is not None:
            raise self.cut

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self:
            yield part


def read(transport: httpx.MockTransport, **kw: Any) -> chat.ChatResult:
    with httpx.Client(transport=transport, base_url="http://server") as client:
        return chat.stream_chat(client, BODY, **kw)


def test_a_whole_stream_is_read_to_done() -> None:
    r = read(answering(WHOLE)[0])
    assert (r.status, r.text, r.chunks, r.model) == (200, "OK", 3, "tiny")
    assert r.finish_reason == "length"
    assert (r.done, r.complete, r.failure) == (True, True, None)
    assert r.usage == chat.Usage(prompt_tokens=11, completion_tokens=2, total_tokens=13,
                                 cached_tokens=4)  # fmt: skip
    assert r.timings == chat.Timings(prompt_n=7, prompt_ms=3.5, predicted_n=2,
                                     predicted_ms=6.0, cache_n=4)  # fmt: skip


def test_the_request_is_streamed_and_asks_for_the_usage() -> None:
    transport, seen = answering(WHOLE)
    read(transport)
    (request,) = seen
    assert request.url.path == chat.CHAT_PATH
    sent = json.loads(request.content)
    assert sent == {**BODY, "stream": True, "stream_options": {"include_usage": True}}


def test_the_first_token_comes_after_the_role_only_chunk() -> None:
    r = read(answering(WHOLE)[0])
    assert r.first_chunk_s is not None and r.ttft_s is not None
    assert 0 <= r.first_chunk_s <= r.ttft_s <= r.elapsed_s


def test_a_stream_whose_choices_hold_no_text_counts_its_first_chunk_as_the_first_token() -> None:
    r = read(answering([data(ROLE), data(text("", "length")), "data: [DONE]\n\n"])[0])
    assert r.ttft_s == r.first_chunk_s is not None


def test_a_usage_chunk_with_empty_choices_is_no_token() -> None:
    usage_only = data({"choices": [], "usage": USAGE})
    r = read(answering([usage_only, "data: [DONE]\n\n"])[0])
    assert (r.chunks, r.first_chunk_s, r.ttft_s, r.text) == (0, None, None, "")
    assert r.usage is not None and r.usage.completion_tokens == 2
    assert r.timings is None  # not llama-server's: no timings


def test_nothing_after_done_is_read() -> None:
    r = read(answering([*WHOLE, "data: not json\n\n", data(text("late"))])[0])
    assert (r.text, r.malformed, r.complete) == ("OK", None, True)


def test_every_chunk_is_handed_to_on_chunk_as_it_is_read() -> None:
    got: list[Any] = []
    read(answering(WHOLE)[0], on_chunk=got.append)
    assert [c.get("choices") != [] for c in got] == [True, True, True, False]


@pytest.mark.parametrize(
    "event",
    [
        data({"error": CONTEXT_EXCEEDED}),  # b11434
        f"error: {json.dumps(CONTEXT_EXCEEDED)}\n\n",  # an error line of its own
    ],
)
def test_an_error_event_in_a_200_stream_is_the_servers_error(event: str) -> None:
    r = read(answering([data(ROLE), data(text("O")), event, "data: [DONE]\n\n"])[0])
    assert r.status == 200 and r.error is not None
    assert (r.error.message, r.error.in_stream) == ("Context size has been exceeded.", True)
    assert "server_error" in r.error.raw
    # reading stopped at the error: the server ends its stream there
    assert (r.text, r.done, r.complete) == ("O", False, False)
    assert r.failure == "200: Context size has been exceeded."


def test_a_refusal_is_the_servers_error_with_its_status() -> None:
    body = {"error": {"code": 400, "message": "the request exceeds the available context size",
                      "type": "exceed_context_size_error"}}  # fmt: skip
    r = read(answering([json.dumps(body)], status=400)[0])
    assert r.error is not None
    assert (r.status, r.error.in_stream, r.done, r.chunks) == (400, False, False, 0)
    assert r.error.message == "the request exceeds the available context size"
    assert r.error.raw == json.dumps(body)


def test_a_connection_cut_mid_stream_keeps_what_came_before() -> None:
    cut = httpx.RemoteProtocolError("peer closed connection without sending complete message")
    r = read(answering([data(ROLE), data(text("O"))], cut=cut)[0])
    assert r.cut is cut
    assert (r.status, r.text, r.done, r.error, r.complete) == (200, "O", False, None, False)
    assert r.ttft_s is not None
    assert r.failure == f"RemoteProtocolError: {cut}"


def test_a_connection_refused_is_a_cut_without_an_answer() -> None:
    url = f"http://127.0.0.1:{realserver.free_port()}"  # nothing listens there
    with httpx.Client(base_url=url) as client:
        r = chat.stream_chat(client, BODY)
    assert isinstance(r.cut, httpx.ConnectError)
    assert (r.status, r.first_chunk_s, r.usage) == (None, None, None)


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("data: {not json", "a line that is not JSON: '{not json'"),
        ("data: [1, 2]", "'[1, 2]', not an object"),
        (data({"choices": [], "usage": {"prompt_tokens": "11"}}).strip(),
         "a usage that is not token counts: {'prompt_tokens': '11'}"),
    ],
)  # fmt: skip
def test_a_line_that_is_not_a_chunk_stops_the_reading(line: str, named: str) -> None:
    r = read(answering([data(text("O")), line + "\n\n", data(text("K"))])[0])
    assert (r.malformed, r.text, r.complete) == (named, "O", False)


def untimed(r: chat.ChatResult) -> chat.ChatResult:
    return replace(r, sent_at=0.0, elapsed_s=0.0, first_chunk_s=0.0, ttft_s=0.0)


def test_the_async_client_reads_the_same_stream() -> None:
    cut = httpx.ReadTimeout("timed out")

    async def both() -> tuple[chat.ChatResult, chat.ChatResult]:
        whole, broken = answering(WHOLE)[0], answering([data(text("O"))], cut=cut)[0]
        async with httpx.AsyncClient(transport=whole, base_url="http://server") as c:
            a = await chat.stream_chat_async(c, BODY)
        async with httpx.AsyncClient(transport=broken, base_url="http://server") as c:
            b = await chat.stream_chat_async(c, BODY)
        return a, b

    whole, broken = asyncio.run(both())
    assert untimed(whole) == untimed(read(answering(WHOLE)[0]))
    assert whole.complete and whole.text == "OK"
    assert (broken.cut, broken.text, broken.done) == (cut, "O", False)


# --------------------------------------------------------------------------- the real server


def metric(url: str, name: str) -> int:
    """``llamacpp:NAME`` from /metrics: one of the server's own counters."""
    found = re.search(rf"^llamacpp:{name} (\S+)$", httpx.get(url + "/metrics").text, re.M)
    assert found, name
    return int(float(found.group(1)))


def templated_tokens(url: str, messages: list[dict[str, str]]) -> int:
    """The tokens llama-server reads for ``messages``: its template, then its tokenizer."""
    prompt = httpx.post(url + "/apply-template", json={"messages": messages}).json()["prompt"]
    body = {"content": prompt, "add_special": True, "parse_special": True}
    return len(httpx.post(url + "/tokenize", json=body).json()["tokens"])


@pytest.mark.real
def test_the_usage_is_the_servers_own_count(tiny_model: Path, llama_server_bin: str) -> None:
    args = ["-np", "1", "-c", "2048", "-t", "1", "--metrics"]
    with realserver.run_server(tiny_model, args, binary=llama_server_bin) as srv:
        messages = [{"role": "user", "content": "Tell a story about rivers and mills."}]
        body = {"messages": messages, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        read_before = metric(srv.url, "prompt_tokens_total")
        made_before = metric(srv.url, "tokens_predicted_total")
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            first = chat.stream_chat(client, body)
            again = chat.stream_chat(client, body)  # the same prompt: the slot has it cached
        read_by_server = metric(srv.url, "prompt_tokens_total") - read_before
        made_by_server = metric(srv.url, "tokens_predicted_total") - made_before
        prompt = templated_tokens(srv.url, messages)
    assert first.complete and again.complete, (first.failure, again.failure)
    assert first.usage is not None and again.usage is not None
    assert first.timings is not None and again.timings is not None
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == prompt
    assert first.usage.completion_tokens + again.usage.completion_tokens == made_by_server == 12
    assert first.timings.prompt_n + again.timings.prompt_n == read_by_server
    for r in (first, again):
        assert r.usage is not None and r.timings is not None and r.timings.cache_n is not None
        assert r.usage.cached_tokens == r.timings.cache_n
        assert r.usage.prompt_tokens == r.timings.prompt_n + r.timings.cache_n
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert again.usage.cached_tokens is not None and again.usage.cached_tokens > 0
