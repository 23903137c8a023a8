"""What the agents measured: one streamed request (``RequestResult``), one level of N agents
over its rounds (``LevelResult``), and one level without and with the long prompt read
alongside (``StallResult``); and the percentiles they are summed up by.

Every figure comes from the requests' own timings and the server's ``usage``: a level's
properties derive its speeds, latencies and times to first token, never stored twice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


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
            **asdict(self),
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
