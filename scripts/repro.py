"""Reproduce seed 000's failures with the real llama-server and the tiny model; keep the log.

Used by scripts/repro-overflow, scripts/repro-too-long, scripts/repro-healthy,
scripts/bench-diagnose and tests/test_diagnose_real.py, so the tests read logs made the same
way during the test run. Each scenario returns what the clients saw (HTTP status per request,
prompt sizes) next to the log path, so a test can hold the diagnosis against it.

The tiny model's tokenizer splits words into single bytes, so prompts are sized with
``/tokenize`` rather than guessed.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import realserver
import tinymodel

WORDS = ("river", "model", "cache", "pool", "token", "slot", "agent", "server")

#: The seed's failure, scaled down: 4 slots promised 1024 each, one shared pool of 1024.
#: --cache-ram 0 keeps the idle warm slot in the pool, so the cascade purges it first; with
#: b11434's default host-RAM prompt cache the idle slot leaves the pool and no purge is logged.
OVERFLOW_ARGS = ("-c", "1024", "-np", "4", "-kvu", "--cache-ram", "0")
#: A split pool: 4 slots of 256 cells each; a 400-token prompt is refused up front.
TOO_LONG_ARGS = ("-c", "1024", "-np", "4", "-no-kvu")
#: The seed's fix: every slot capped at 512, the pool sized to 4 x 512 by the server.
HEALTHY_ARGS = ("-np", "4", "-kvu", "--kv-unified-per-slot", "512")


@dataclass(frozen=True)
class Run:
    """What one scenario did: the server's flags, the log, and what each client got."""

    log: Path
    args: tuple[str, ...]
    prompt_tokens: tuple[int, ...]  # per concurrent request (as /tokenize + template counts)
    statuses: tuple[int, ...]  # HTTP status per concurrent request
    warmup_tokens: int  # a request run before the burst (it stays cached in its slot)


def prompt(n_words: int, seed: int) -> str:
    """A prompt of repeated words; a different word order per seed defeats the prompt cache."""
    k = len(WORDS)
    return " ".join(WORDS[(i * (seed + 1) + seed) % k] for i in range(n_words))


def sized_prompt(url: str, tokens: int, seed: int) -> tuple[str, int]:
    """A prompt that tokenizes to about ``tokens`` (measured with /tokenize)."""
    per_word = (
        len(httpx.post(url + "/tokenize", json={"content": prompt(40, seed)}).json()["tokens"]) / 40
    )
    text = prompt(max(1, int(tokens / per_word)), seed)
    n = len(httpx.post(url + "/tokenize", json={"content": text}).json()["tokens"])
    return text, n


def chat(url: str, text: str, max_tokens: int = 8, ignore_eos: bool = False) -> int:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    if ignore_eos:
        body["ignore_eos"] = True
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    return r.status_code


#: Tokens each request of a burst generates. Long enough that the first request is still in
#: its slot when the last one arrives (the HTTP threads tokenize in turn on 2 cores); the
#: random-weight model samples its end-of-text token after as few as 3 tokens, so a burst
#: ignores it (a burst that ended early was served one request at a time and overflowed
#: nothing, now and then, in a suite).
BURST_MAX_TOKENS = 256


def burst(url: str, texts: Sequence[str]) -> tuple[int, ...]:
    """Send the prompts at once, one thread each; return the statuses in order."""
    statuses = [0] * len(texts)

    def go(i: int) -> None:
        statuses[i] = chat(url, texts[i], BURST_MAX_TOKENS, ignore_eos=True)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tuple(statuses)


def scenario(
    model: Path,
    log: Path,
    args: Sequence[str],
    tokens: Sequence[int],
    warmup: int = 0,
    extra: Sequence[str] = (),
    binary: str | None = None,
) -> Run:
    """Start the server with ``args``, optionally warm one slot, then send ``tokens`` at once."""
    argv = (*args, *extra)
    with realserver.run_server(model, argv, log_path=log, binary=binary) as server:
        warm = 0
        if warmup:
            text, warm = sized_prompt(server.url, warmup, 99)
            chat(server.url, text)
        sized = [sized_prompt(server.url, n, i) for i, n in enumerate(tokens)]
        statuses = burst(server.url, [t for t, _ in sized])
    return Run(log, tuple(argv), tuple(n for _, n in sized), statuses, warm)


def overflow(
    model: Path, log: Path, extra: Sequence[str] = (), tries: int = 3, binary: str | None = None
) -> Run:
    """Seed 000 in miniature: a warm idle slot (purged first), then 3 x 400 tokens > 1024.

    The overflow needs the three requests to overlap in the server; on a loaded machine one
    may finish before the last arrives. Then the whole scenario runs again on a fresh server
    and log (at most ``tries`` times), so the log always matches the statuses it returns.
    """
    for _ in range(tries):
        run = scenario(
            model, log, OVERFLOW_ARGS, (400, 400, 400), warmup=300, extra=extra, binary=binary
        )
        if run.statuses.count(500) >= 2:
            break
    return run


def too_long(model: Path, log: Path, extra: Sequence[str] = (), binary: str | None = None) -> Run:
    """One 400-token prompt against 256-cell split slots: refused with HTTP 400."""
    return scenario(model, log, TOO_LONG_ARGS, (400,), extra=extra, binary=binary)


def healthy(model: Path, log: Path, extra: Sequence[str] = ()) -> Run:
    """The fixed config under the same burst: every request answers 200."""
    return scenario(model, log, HEALTHY_ARGS, (400, 400, 400), warmup=300, extra=extra)


SCENARIOS = {"overflow": overflow, "too-long": too_long, "healthy": healthy}


def main(argv: Sequence[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(
        description="Reproduce a llama-server failure and keep its log.",
        epilog="more llama-server flags go after --",
    )
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--out", default=None, help="log file (default: ./repro-SCENARIO.log)")
    p.add_argument("--model", default=None, help="GGUF (default: write the tiny test model)")
    argv = list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    a = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    out = Path(a.out or f"repro-{a.scenario}.log").resolve()
    model = Path(a.model) if a.model else tinymodel.write(out.with_suffix(".gguf"))
    run = SCENARIOS[a.scenario](model, out, extra)
    print(f"llama-server {' '.join(run.args)}")
    print(f"prompts (tokens): {list(run.prompt_tokens)}; HTTP statuses: {list(run.statuses)}")
    print(f"log: {run.log}")
    print(f"next: llama-launcher diagnose --log {run.log}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
