"""llama-server's ``GET /metrics``: the counters a watcher may use, and whose process they count.

Read from b9093, b10405 and b11434 (tools/server/server-context.cpp, server-task.cpp,
server-common.h) and confirmed against each real server by the tests:

- The endpoint exists only with ``--metrics``; without it every build answers 501 ``This
  server does not support metrics endpoint. Start it with `--metrics```. While the model
  loads it answers 503 ``Loading model`` like every route. With an API key it needs the key
  on all three builds (it is not among the public paths: ``/health``, ``/v1/health``, and
  on b9093 also ``/models``), so it is reachable exactly where the API is.
- The text is Prometheus' format 0.0.4, every name prefixed ``llamacpp:``. The counters are
  cumulative since the process started: ``prompt_tokens_total`` (prompt tokens processed,
  cache hits not counted), ``prompt_seconds_total``, ``tokens_predicted_total``,
  ``tokens_predicted_seconds_total``, ``n_decode_total``. Decode and prefill tok/s are their
  deltas between two reads. The seconds are the sum of each request's own time (its answer's
  ``timings.predicted_ms``); b9093 and b10405 add each request's in whole milliseconds, cut
  down, so requests that generate in under 1 ms (the tiny test model) add no time at all and
  the rate is None (``rate``); a real model's requests lose under 1 ms each. Every value is
  printed with six significant digits (C++'s default stream precision: ``3544.27``), so a
  counter past 1,000 s moves in steps of 0.01 s and one past 10,000 s in 0.1 s.
- The gauges ``prompt_tokens_seconds`` and ``predicted_tokens_seconds`` are averaged "over
  the window between two scrapes": every GET resets that window (``reset_bucket()``), so
  this module never reads them; ``requests_deferred`` (requests waiting for a free slot)
  and ``requests_processing`` are plain gauges of the moment.
- The header ``Process-Start-Time-Unix`` is ``ggml_time_us()`` when the server started
  (``server_metrics::init``): microseconds of the monotonic clock on b11434, not Unix time
  despite its name. It is read as the identity of the process the counters belong to: a new
  value means a restart, and counters back at zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx

from launcher.errors import Unreadable
from launcher.server import httpclient

PREFIX = "llamacpp:"
#: The counters a sample keeps (cumulative since the process started).
COUNTERS = (
    "prompt_tokens_total",
    "prompt_seconds_total",
    "tokens_predicted_total",
    "tokens_predicted_seconds_total",
    "n_decode_total",
)
#: Gauges of the moment (never the windowed ``*_tokens_seconds`` ones).
GAUGES = ("requests_processing", "requests_deferred")
START_HEADER = "Process-Start-Time-Unix"


@dataclass(frozen=True)
class Metrics:
    """One read of ``/metrics``: counters and instant gauges, and the process's start mark."""

    counters: dict[str, float]
    gauges: dict[str, float]
    process_start: str | None

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def parse(text: str) -> dict[str, float]:
    """The ``llamacpp:`` samples of a Prometheus text page (name without the prefix ->
    value). Comments, labels and other prefixes are ignored; a value that is not a number
    leaves its name out."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        name, _, rest = line[len(PREFIX) :].partition(" ")
        if "{" in name:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            values[name] = value
    return values


#: vLLM's names for the same figures (``launcher.server.vllm``): counters, then gauges. The
#: tokens are its per-request histograms' sums, observed as each request finishes, like the
#: seconds beside them (``generation_tokens_total`` grows while a request streams, its
#: seconds only at its end: their ratio would jump with long streams)
VLLM_COUNTERS = {
    "prompt_tokens_total": "vllm:request_prompt_tokens_sum",
    "prompt_seconds_total": "vllm:request_prefill_time_seconds_sum",
    "tokens_predicted_total": "vllm:request_generation_tokens_sum",
    "tokens_predicted_seconds_total": "vllm:request_decode_time_seconds_sum",
    "preemptions_total": "vllm:num_preemptions_total",
}
VLLM_GAUGES = {
    "requests_processing": "vllm:num_requests_running",
    "requests_deferred": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
}


def from_vllm(text: str) -> Metrics:
    """vLLM's ``/metrics`` as llama-server's: tokens and the engine's own prefill and decode
    seconds as the counters, requests running and waiting (preempted ones wait) as the
    gauges; the process's start (``process_start_time_seconds``) as its identity."""
    from launcher.server import vllm

    seen = vllm.metrics(text)
    missing = [v for v in list(VLLM_COUNTERS.values())[:4] if v not in seen]
    if missing:
        raise Unreadable(
            "metrics", f"/metrics has no {', '.join(missing)}: a vLLM this reader does not know"
        )
    start = next(
        (ln.split()[1] for ln in text.splitlines() if ln.startswith("process_start_time_seconds ")),
        None,
    )
    return Metrics(
        counters={k: seen[v] for k, v in VLLM_COUNTERS.items() if v in seen},
        gauges={k: seen[v] for k, v in VLLM_GAUGES.items() if v in seen},
        process_start=start,
    )


def from_response(resp: httpx.Response) -> Metrics:
    """``Metrics`` from an answer of ``GET /metrics`` (llama-server's, or vLLM's:
    ``from_vllm``); ``Unreadable`` naming why not."""
    if resp.status_code != 200:
        raise Unreadable("metrics", _refusal(resp), resp.status_code)
    if "\nvllm:" in resp.text and PREFIX not in resp.text:
        return from_vllm(resp.text)
    values = parse(resp.text)
    missing = [c for c in COUNTERS[:4] if c not in values]
    if missing:
        raise Unreadable(
            "metrics",
            f"/metrics has no {', '.join(PREFIX + m for m in missing)}: a llama-server build "
            "this reader does not know",
        )
    return Metrics(
        counters={c: values[c] for c in COUNTERS if c in values},
        gauges={g: values[g] for g in GAUGES if g in values},
        process_start=resp.headers.get(START_HEADER),
    )


def read(client: httpx.Client) -> Metrics:
    """``GET /metrics`` through ``client`` (``httpclient.client``)."""
    try:
        resp = client.get("/metrics")
    except httpx.TransportError as e:
        raise Unreadable("metrics", f"the server does not answer: {type(e).__name__}") from e
    return from_response(resp)


def _refusal(resp: httpx.Response) -> str:
    why = httpclient.error_text(resp)
    if resp.status_code == 501:
        return (
            f"/metrics is off (501: {why}): decode and prefill tok/s are unknown; deploy "
            "the config with --metrics (llama-launcher set --metrics)"
        )
    if resp.status_code == 503:
        return f"the server is loading (503: {why})"
    if resp.status_code == 401:
        return "/metrics wants the API key (401); the live env file names none that works"
    return f"/metrics answered {resp.status_code}: {why}"


def rate(tokens: float, seconds: float) -> float | None:
    """Tokens per second of a counter delta; None when no time was spent."""
    return tokens / seconds if seconds > 0 else None
