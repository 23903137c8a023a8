"""The HTTP probe of llama-server: /health, /props and a real chat completion.

``/health`` answers 503 ``Loading model`` while the model loads (every route does) and 200
when ready; an open port alone means nothing (FACTS §4.2). Readiness is a real
``POST /v1/chat/completions`` that returns a completion with ``usage``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from launcher.errors import ProbeError


def read_api_key(path: Path | None) -> str | None:
    """The first key in an ``--api-key-file`` (skips blank and ``#`` lines, like llama-server)."""
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                return line
    except OSError as e:
        raise ProbeError(f"cannot read the API key file {path}: {e.strerror}") from e
    return None


@dataclass(frozen=True)
class Completion:
    content: str
    completion_tokens: int
    prompt_tokens: int
    ms: float

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


class Probe:
    """Talks to one llama-server. ``transport`` may be passed in (e.g. a recorded one)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Plain http (llama-server's default) needs no TLS context; building one loads the CA
        # bundle, which costs ~50 ms on every deploy. https keeps full verification.
        tls = self.base_url.startswith("https:")
        self.client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            transport=transport,
            timeout=10.0,
            verify=tls,
        )

    def close(self) -> None:
        self.client.close()

    def health(self, timeout: float = 0.1) -> tuple[int | None, str]:
        """(status, detail): None when nothing answers yet.

        The timeout is short on purpose: it is polled in a loop that also watches the unit,
        and whatever else holds the port (a stale process) may never answer.
        """
        try:
            r = self.client.get("/health", timeout=timeout)
        except httpx.HTTPError as e:
            return None, type(e).__name__
        try:
            detail = str(r.json().get("error", {}).get("message", "")) or r.text[:100]
        except ValueError:
            detail = r.text[:100]
        return r.status_code, detail

    def props(self) -> dict[str, Any]:
        r = self._get("/props")
        data = r.json()
        if not isinstance(data, dict):
            raise ProbeError(f"/props returned {type(data).__name__}, not an object")
        return data

    def _get(self, path: str) -> httpx.Response:
        try:
            r = self.client.get(path)
        except httpx.HTTPError as e:
            raise ProbeError(f"GET {self.base_url}{path} failed: {e}") from e
        if r.status_code != 200:
            raise ProbeError(
                f"GET {self.base_url}{path} returned {r.status_code}: {r.text[:300]}"
                + _auth_hint(r.status_code)
            )
        return r

    def _post_retrying(self, path: str, body: dict[str, Any], timeout: float) -> httpx.Response:
        """POST, retried briefly on a dropped connection or a 503: a server that just turned
        healthy may still refuse the first request while it settles. A real error (4xx,
        500) is returned at once, for the gate to judge."""
        from tenacity import (
            Retrying,
            retry_if_exception_type,
            retry_if_result,
            stop_after_attempt,
            wait_exponential,
        )

        retrying = Retrying(
            retry=retry_if_exception_type(httpx.TransportError)
            | retry_if_result(lambda r: r.status_code == 503),
            stop=stop_after_attempt(3),
            wait=wait_exponential(multiplier=0.05, max=0.5),
            # out of attempts: the last response, or the last exception raised again
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        try:
            r = retrying(self.client.post, path, json=body, timeout=timeout)
        except httpx.HTTPError as e:
            raise ProbeError(f"the chat completion failed: {type(e).__name__}: {e}") from e
        assert isinstance(r, httpx.Response)
        return r

    def chat(self, timeout: float, max_tokens: int = 4) -> Completion:
        """A real, greedy chat completion; it must come back with ``usage``."""
        body = {
            "messages": [{"role": "user", "content": "Say OK."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "top_k": 1,
            "seed": 0,
            "stream": False,
        }
        start = time.monotonic()
        r = self._post_retrying("/v1/chat/completions", body, timeout)
        ms = (time.monotonic() - start) * 1000
        if r.status_code != 200:
            raise ProbeError(
                f"the chat completion returned {r.status_code}: {_error_text(r)}"
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


def _error_text(r: httpx.Response) -> str:
    """The server's error message, shortened to its first line."""
    try:
        msg = str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        msg = r.text
    lines = [x for x in msg.splitlines() if x.strip() and not x.startswith("---")]
    first = lines[0] if lines else msg
    if "Jinja Exception" in msg:
        first += " (" + msg[msg.index("Jinja Exception") :].splitlines()[0] + ")"
    return first[:300]


def _auth_hint(status: int) -> str:
    if status == 401:
        return " - the server wants an API key; set api_key_file to the key the server uses"
    return ""
