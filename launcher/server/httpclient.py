"""The one way the tool builds an HTTP client (httpx), and reads a server's error message.

The probe (sync, every deploy) and ``bench`` (async, many agents) both come from ``client``:
the same base URL rule, the key as a bearer header, and a transport a test may hand in
(``httpx.MockTransport``) where the real server cannot produce the case.
"""

from __future__ import annotations

from typing import TypeVar

import httpx

C = TypeVar("C", httpx.Client, httpx.AsyncClient)


def client(
    kind: type[C],
    base_url: str,
    api_key: str | None,
    timeout: httpx.Timeout | float,
    transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    trust_env: bool = True,
) -> C:
    """A ``kind`` (``httpx.Client`` or ``httpx.AsyncClient``) for one server. A plain
    ``http://`` server has no certificate to check: its client skips loading the CA bundle
    (tens of milliseconds a client, three clients a deploy); an ``https://`` one verifies."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return kind(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=timeout,
        verify=not base_url.startswith("http://"),
        transport=transport,  # type: ignore[arg-type]
        trust_env=trust_env,
    )


def error_text(resp: httpx.Response) -> str:
    """The server's error message (``{"error": {"message": ...}}``), shortened to its first
    line; a Jinja error keeps its one-line reason."""
    try:
        body = resp.json()
        msg = str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        msg = resp.text
    lines = [x for x in msg.splitlines() if x.strip() and not x.startswith("---")]
    first = lines[0] if lines else msg
    if "Jinja Exception" in msg:
        first += " (" + msg[msg.index("Jinja Exception") :].splitlines()[0] + ")"
    return first[:300]


def url_from_argv(argv: list[str]) -> str:
    """http://HOST:PORT from llama-server's --host/--port (defaults 127.0.0.1:8080)."""
    host, port = "127.0.0.1", "8080"
    for i, word in enumerate(argv[:-1]):
        if word == "--host":
            host = argv[i + 1].split(",")[0]
        elif word == "--port":
            port = argv[i + 1]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
