"""The server the bench measures, read before any agent starts: that it answers, its slot
layout (``/props``, ``/slots``: ``ServerInfo``), and filler text sized to a prompt of so many
tokens with the server's own tokenizer (``/apply-template`` + ``/tokenize``: ``PromptInfo``).

A server that lacks an endpoint (not a llama-server, or one with ``/slots`` off) is still
measured: what it does not say is ``None``, and without ``/tokenize`` the prompt size is a
guess. Only a server that does not answer, is still loading its model, or refuses the key
stops the bench, with a ``ProbeError`` that names the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.errors import ProbeError

if TYPE_CHECKING:
    import httpx
    from pydantic import SecretStr

DEFAULT_URL = "http://127.0.0.1:8080"
#: Words for filler text. Common English words are about one token each for most tokenizers.
FILLER_TEXT = (
    "the river runs past the old mill and the model reads every token of the text while "
    "the agent waits for its slot in the pool and the cache holds what it has seen"
)
#: Tokens per filler word assumed when the server has no ``/tokenize`` (llama-server has it).
TOKENS_PER_WORD_GUESS = 1.3


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
        # Not asdict: it would deep-copy a generation that is a Mapping but not a dict.
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
class PromptInfo:
    """How the chat prompt was sized."""

    target_tokens: int | None
    measured_tokens: int | None  # by the server's tokenizer
    method: str  # "chat line", "apply-template + tokenize", "tokenize" or "estimate"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    return _json_of(resp)


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
    return _json_of(resp)


def _json_of(resp: httpx.Response) -> Any:
    """The JSON of a 200 answer; None for another status or a body that is not JSON."""
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
