"""The HTTP probe of llama-server: /health, /props and a real chat completion.

``/health`` answers 503 ``Loading model`` while the model loads (every route does) and 200
when ready; an open port alone means nothing (FACTS §4.2). Readiness is a real
``POST /v1/chat/completions`` that returns a completion with ``usage``.

The probe runs on every deploy and uses the standard library's ``http.client``: three plain
requests to a local server do not need an HTTP client library, and importing one (with its
TLS set-up) cost a fifth of a deploy here. The connection is made by ``connect``, which a
caller may replace (a recorded transport in a test).
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from launcher.errors import ProbeError

Connect = Callable[[str, int, bool, float], http.client.HTTPConnection]


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


def connect(host: str, port: int, tls: bool, timeout: float) -> http.client.HTTPConnection:
    """A new connection (https with full verification when ``tls``)."""
    if tls:
        return http.client.HTTPSConnection(host, port, timeout=timeout)
    return http.client.HTTPConnection(host, port, timeout=timeout)


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


@dataclass(frozen=True)
class Completion:
    content: str
    completion_tokens: int
    prompt_tokens: int
    ms: float

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


class Probe:
    """Talks to one llama-server at ``base_url``."""

    def __init__(
        self, base_url: str, api_key: str | None = None, connector: Connect = connect
    ) -> None:
        self.base_url = base_url.rstrip("/")
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ProbeError(f"{base_url!r} is not an http(s) URL; e.g. http://127.0.0.1:8080")
        self.tls = url.scheme == "https"
        self.host = url.hostname
        self.port = url.port or (443 if self.tls else 80)
        self.prefix = url.path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.connector = connector

    def close(self) -> None:
        """Nothing to release: every request uses its own connection."""

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> Response:
        """One request; raises OSError/HTTPException when nothing (usable) answers."""
        conn = self.connector(self.host, self.port, self.tls, timeout)
        try:
            headers = dict(self.headers)
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            conn.request(method, self.prefix + path, body=data, headers=headers)
            r = conn.getresponse()
            return Response(r.status, r.read())
        finally:
            conn.close()

    def health(self, timeout: float = 0.1) -> tuple[int | None, str]:
        """(status, detail): None when nothing answers yet.

        The timeout is short on purpose: it is polled in a loop that also watches the unit,
        and whatever else holds the port (a stale process) may never answer.
        """
        try:
            r = self.request("GET", "/health", timeout=timeout)
        except (OSError, http.client.HTTPException) as e:
            return None, type(e).__name__
        try:
            detail = str(r.json().get("error", {}).get("message", "")) or r.text[:100]
        except (ValueError, AttributeError):
            detail = r.text[:100]
        return r.status, detail

    def props(self) -> dict[str, Any]:
        try:
            r = self.request("GET", "/props")
        except (OSError, http.client.HTTPException) as e:
            raise ProbeError(f"GET {self.base_url}/props failed: {e}") from e
        if r.status != 200:
            raise ProbeError(
                f"GET {self.base_url}/props returned {r.status}: {_error_text(r)}"
                + _auth_hint(r.status)
            )
        try:
            data = r.json()
        except ValueError as e:
            raise ProbeError(f"/props is not JSON: {r.text[:200]}") from e
        if not isinstance(data, dict):
            raise ProbeError(f"/props returned {type(data).__name__}, not an object")
        return data

    def _post_retrying(self, path: str, body: dict[str, Any], timeout: float) -> Response:
        """POST, retried briefly on a dropped connection or a 503: a server that just turned
        healthy may refuse the first request while it settles. A real error (4xx, 500) is
        returned at once, for the gate to judge."""
        delay = 0.05
        for attempt in range(3):
            try:
                r = self.request("POST", path, body, timeout)
                if r.status != 503 or attempt == 2:
                    return r
            except (OSError, http.client.HTTPException) as e:
                if attempt == 2:
                    raise ProbeError(f"the chat completion failed: {type(e).__name__}: {e}") from e
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

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
        if r.status != 200:
            raise ProbeError(
                f"the chat completion returned {r.status}: {_error_text(r)}" + _auth_hint(r.status)
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


def _error_text(r: Response) -> str:
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
