"""Benchmark (the long-prompt lane): what a lane does to the chat agents' time to first token
while one client sends a huge one-off prompt now and then. Run through ``scripts/bench-lane``
(a private sandboxed systemd); prints figures from one run, not a test: nothing here asserts.

The load, the same in both phases: ``BENCH_AGENTS`` chat agents (4) each send short streamed
requests one after the other (a 40-word prompt, ``BENCH_MAX_TOKENS`` tokens, ``ignore_eos``),
timed from sent to their first token (TTFT); one more client sends a prompt of
``BENCH_LONG_TOKENS`` tokens (8,000, measured with the server's /tokenize) every
``BENCH_LONG_EVERY`` seconds (30), 16 tokens asked, timed to its first token and to its end.

1. ``no lane``: one unit behind its front (``install --front haproxy``) with a slot for each
   agent and one for the long prompt, each slot's window large enough for it
   (``-np AGENTS+1 -c (AGENTS+1)*WINDOW``): the long prompt is read in the same batches as
   the agents' tokens.
2. ``lane``: the same unit with ``-np AGENTS`` and a lane (``install --lane long -np 1``)
   that takes every prompt over ``BENCH_THRESHOLD`` tokens (2,000; the tiny model's
   vocabulary spells words nearly byte by byte: ``--lane-bytes-per-token 1``).

Both servers run with llama-server's default threads (every core): on a box whose cores are
all the compute there is, two servers share them. Printed per phase: the agents' requests,
failures, TTFT median and p90 (all, and those sent while a long prompt was in flight), and
each long prompt's TTFT and end. ``BENCH_SECONDS`` a phase (120), ``BENCH_SHAPE`` the model
(``layers,n_embd,heads,kv_heads,ff``: 4,256,4,2,512). Traffic goes to loopback only.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

import realserver  # noqa: E402
import repro  # noqa: E402
import tinymodel  # noqa: E402
from admission_bench import cli, percentile  # noqa: E402

from launcher.bench import chat  # noqa: E402
from launcher.server import binary  # noqa: E402

SECONDS = float(os.environ.get("BENCH_SECONDS", "120"))
AGENTS = int(os.environ.get("BENCH_AGENTS", "4"))
MAX_TOKENS = int(os.environ.get("BENCH_MAX_TOKENS", "16"))
LONG_TOKENS = int(os.environ.get("BENCH_LONG_TOKENS", "8000"))
LONG_EVERY = float(os.environ.get("BENCH_LONG_EVERY", "30"))
THRESHOLD = int(os.environ.get("BENCH_THRESHOLD", "2000"))
SHAPE = [int(x) for x in os.environ.get("BENCH_SHAPE", "4,256,4,2,512").split(",")]
TIMEOUT = 600.0
#: a slot's window: the long prompt and its answer, with room
WINDOW = 1024 * math.ceil((LONG_TOKENS + 512) / 1024)


@dataclass
class Load:
    url: str
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: (sent, ttft or None, failure or None) of every agent request
    agents: list[tuple[float, float | None, str | None]] = field(default_factory=list)
    #: (sent, ttft, elapsed, failure) of every long prompt
    longs: list[tuple[float, float | None, float, str | None]] = field(default_factory=list)
    #: (began, ended) while a long prompt was in flight
    windows: list[tuple[float, float]] = field(default_factory=list)

    def agent(self, i: int) -> None:
        n = 0
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(TIMEOUT, connect=10)) as c:
            while not self.stop.is_set():
                n += 1
                body = {
                    "messages": [{"role": "user", "content": repro.prompt(40, 31 * i + n)}],
                    "max_tokens": MAX_TOKENS,
                    "ignore_eos": True,
                }
                sent = time.time()
                r = chat.stream_chat(c, body)
                with self.lock:
                    self.agents.append((sent, r.ttft_s, None if r.complete else r.failure))

    def long_client(self, text: str) -> None:
        n = 0
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(TIMEOUT, connect=10)) as c:
            while not self.stop.is_set():
                n += 1
                body = {
                    "messages": [{"role": "user", "content": f"{n} {text}"}],
                    "max_tokens": 16,
                    "ignore_eos": True,
                }
                sent = time.time()
                r = chat.stream_chat(c, body)
                ended = time.time()
                with self.lock:
                    failure = None if r.complete else r.failure
                    self.longs.append((sent, r.ttft_s, ended - sent, failure))
                    self.windows.append((sent, ended))
                self.stop.wait(max(0.0, LONG_EVERY - (ended - sent)))


def s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def long_text(url: str) -> str:
    text, tokens = repro.sized_prompt(url, LONG_TOKENS, 5)
    print(f"the long prompt: {tokens} tokens ({len(text.encode())} bytes)", flush=True)
    return text


def run_phase(name: str, tmp: Path, model: Path, server: str, lane: bool) -> dict[str, Any]:
    where = tmp / name.replace(" ", "-")
    where.mkdir()
    unit = f"bench-lane-{'on' if lane else 'off'}.service"
    port, url, env = realserver.bench_unit(where, unit, sample_interval="3600")
    slots = AGENTS if lane else AGENTS + 1
    main = ["-np", str(slots), "-c", str(slots * (2048 if lane else WINDOW)), "-a", "main"]
    args = ["-m", str(model), "--port", str(port), "--llama-server", server]
    print(f"\n== {name}: main {' '.join(main)}", flush=True)
    res: dict[str, Any] = {"name": name}
    rc, out = cli(env, "install", *args, *main, "--front", "haproxy")
    if rc != 0:
        print(f"install refused (rc {rc}): {out.get('message')}", flush=True)
        cli(env, "uninstall", "--purge")
        return res
    try:
        if lane:
            flags = ["-np", "1", "-c", str(WINDOW), "-a", "lane"]
            print(f"   lane {' '.join(flags)}, over {THRESHOLD} tokens", flush=True)
            rc, out = cli(
                env,
                "install",
                "--lane",
                "long",
                "--lane-threshold",
                str(THRESHOLD),
                "--lane-bytes-per-token",
                "1",
                "-m",
                str(model),
                "--llama-server",
                server,
                *flags,
            )
            if rc != 0:
                print(f"lane refused (rc {rc}): {out.get('message')}", flush=True)
                return res
        text = long_text(url)
        load = Load(url)
        threads = [threading.Thread(target=load.agent, args=(i,)) for i in range(AGENTS)]
        threads.append(threading.Thread(target=load.long_client, args=(text,)))
        for t in threads:
            t.daemon = True
            t.start()
        load.stop.wait(SECONDS)
        load.stop.set()
        for t in threads:
            t.join(TIMEOUT)
        with load.lock:
            res.update(figures(load))
        if lane:
            _, status = cli(env, "status")
            routing = ((status.get("front") or {}).get("lane") or {}).get("routing") or {}
            res["routed"] = routing.get("routed")
    finally:
        if lane:
            cli(env, "uninstall", "--lane", "long", "--purge")
        cli(env, "uninstall", "--purge")
    return res


def figures(load: Load) -> dict[str, Any]:
    def during(sent: float) -> bool:
        return any(a <= sent < b for a, b in load.windows)

    ok = [(sent, t) for sent, t, f in load.agents if f is None and t is not None]
    ttft = [t for _, t in ok]
    near = [t for sent, t in ok if during(sent)]
    longs = [(t, e) for _, t, e, f in load.longs if f is None]
    return {
        "requests": len(load.agents),
        "failed": sum(1 for *_, f in load.agents if f is not None),
        "ttft": f"{s(percentile(ttft, 0.5))} / {s(percentile(ttft, 0.9))}",
        "ttft_during": f"{s(percentile(near, 0.5))} / {s(percentile(near, 0.9))} ({len(near)})",
        "long": ", ".join(f"{t:.1f}/{e:.1f} s" for t, e in longs if t is not None) or "-",
        "long_failed": sum(1 for *_, f in load.longs if f is not None),
    }


def main() -> None:
    server = realserver.server_binary()
    version = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=30)
    print(
        f"lane bench {time.strftime('%Y-%m-%d %H:%M:%S %z')} on {os.uname().nodename} "
        f"({os.cpu_count()} cores)",
        f"llama-server: {binary.describe(server)}; {version.stderr.strip().splitlines()[0]}",
        f"{SECONDS:g} s a phase, {AGENTS} agents (max_tokens {MAX_TOKENS}), a "
        f"{LONG_TOKENS}-token prompt every {LONG_EVERY:g} s; model shape {SHAPE}",
        sep="\n",
        flush=True,
    )
    layers, n_embd, heads, kv_heads, ff = SHAPE
    shape = tinymodel.Shape(layers, n_embd, heads, kv_heads, ff=ff, ctx_train=4 * WINDOW)
    results = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = tinymodel.write(tmp / "model.gguf", shape)
        results.append(run_phase("no lane", tmp, model, server, lane=False))
        results.append(run_phase("lane", tmp, model, server, lane=True))
    print("\n== the chat agents' TTFT while a long prompt comes every", f"{LONG_EVERY:g} s")
    print(
        "phase | agent requests | failed | TTFT p50 / p90 | TTFT p50 / p90 while a long prompt "
        "is read (n) | long prompts: TTFT/end | long failed"
    )
    for r in results:
        if "requests" not in r:
            print(f"{r['name']} | no figures")
            continue
        cols = ("requests", "failed", "ttft", "ttft_during", "long", "long_failed")
        print(" | ".join([r["name"], *(str(r[c]) for c in cols)]))


if __name__ == "__main__":
    main()
