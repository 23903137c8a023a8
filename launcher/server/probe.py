"""The HTTP probe of llama-server: /health, /props and a real chat completion.

``/health`` answers 503 ``Loading model`` while the model loads (every route does) and 200
when ready; an open port alone means nothing. Readiness is a real
``POST /v1/chat/completions`` that returns a completion with ``usage``.

One ``httpx.Client`` per gate (``launcher.server.httpclient``), kept alive across the /health polls;
a test may hand in a transport. Proxies from the environment are not used: the probe talks
to the server it restarted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import httpx

from launcher import waits
from launcher.errors import ProbeError
from launcher.server import httpclient


@dataclass(frozen=True)
class Completion:
    content: str
    completion_tokens: int
    prompt_tokens: int
    ms: float

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


class Probe:
    """Talks to one llama-server at ``base_url``; a context manager (closes its client)."""

    #: ``health``'s detail when nothing answered within the timeout
    TIMEOUT = "timeout"

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
        policy: waits.Waits | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ProbeError(f"{base_url!r} is not an http(s) URL; e.g. http://127.0.0.1:8080")
        self.waits = policy or waits.Waits()
        self.client = httpclient.client(
            httpx.Client, self.base_url, api_key, 10.0, transport, trust_env=False
        )

    def __enter__(self) -> Probe:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.client.close()

    def health(self, timeout: float = 0.1) -> tuple[int | None, str]:
        """(status, detail): None when nothing answers yet (detail ``TIMEOUT`` when nothing
        answered in time).

        The timeout is short on purpose: it is polled in a loop that also watches the unit,
        and whatever else holds the port (a stale process) may never answer.
        """
        return health(self.client, timeout)

    def props(self) -> dict[str, Any]:
        try:
            r = self.client.get("/props")
        except httpx.TransportError as e:
            raise ProbeError(f"GET {self.base_url}/props failed: {e}") from e
        if r.status_code != 200:
            raise ProbeError(
                f"GET {self.base_url}/props returned {r.status_code}: "
                f"{httpclient.error_text(r)}" + _auth_hint(r.status_code)
            )
        try:
            data = r.json()
        except ValueError as e:
            raise ProbeError(f"/props is not JSON: {r.text[:200]}") from e
        if not isinstance(data, dict):
            raise ProbeError(f"/props returned {type(data).__name__}, not an object")
        return data

    def chat(self, timeout: float, max_tokens: int = 4, model: str | None = None) -> Completion:
        """A real, greedy chat completion; it must come back with ``usage``. ``model``: the
        name to ask for (vLLM serves only its ``--served-model-name``).

        Retried briefly (``waits.probe_post``) on a dropped connection or a 503: a server
        that just turned healthy may refuse the first request while it settles. A real error
        (4xx, 500) is judged at once."""
        body = {
            "messages": [{"role": "user", "content": "Say OK."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "top_k": 1,
            "seed": 0,
            "stream": False,
        }
        if model is not None:
            body["model"] = model
        start = time.monotonic()
        try:
            r = waits.probe_post(self.waits, httpx.TransportError)(
                self.client.post, "/v1/chat/completions", json=body, timeout=timeout
            )
        except httpx.TransportError as e:
            raise ProbeError(f"the chat completion failed: {type(e).__name__}: {e}") from e
        ms = (time.monotonic() - start) * 1000
        if r.status_code != 200:
            raise ProbeError(
                f"the chat completion returned {r.status_code}: {httpclient.error_text(r)}"
                + _auth_hint(r.status_code)
            )
        try:
            data = r.json()
            usage = data["usage"]
            content = data["choices"][0]["message"].get("content") or ""
            return Completion(
                str(content),
                int(usage["completion_tokens"]),
                int(usage["prompt_tokens"]),
                round(ms, 1),
            )
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ProbeError(
                f"the chat completion has no usable choices/usage: {r.text[:300]}"
            ) from e


def health(client: httpx.Client, timeout: float) -> tuple[int | None, str]:
    """``GET /health`` through ``client`` within ``timeout`` seconds: (status, detail), None
    when nothing answered (detail ``Probe.TIMEOUT``, or the transport error's name). The
    probe's polls and the sampler's look at a wedged server (``launcher.watch.wedge``)."""
    try:
        r = client.get("/health", timeout=timeout)
    except httpx.TimeoutException:
        return None, Probe.TIMEOUT
    except httpx.TransportError as e:
        return None, type(e).__name__
    try:
        detail = str(r.json().get("error", {}).get("message", "")) or r.text[:100]
    except (ValueError, AttributeError):
        detail = r.text[:100]
    return r.status_code, detail


def _auth_hint(status: int) -> str:
    if status == 401:
        return " - the server wants an API key; set api_key_file to the key the server uses"
    return ""
