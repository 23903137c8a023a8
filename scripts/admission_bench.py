"""Benchmark (admission): what the front's admission against the shared KV pool costs and
saves, for the same load, in one run. Run through ``scripts/bench-admission`` (a private
sandboxed systemd); prints figures from one run, not a test: nothing here asserts.

The load: four agents whose histories grow every turn (each turn appends the assistant's
reply and a new user message), so that together they hold more cells than an over-committed
pool has. Each request is streamed, generates exactly ``max_tokens`` (``ignore_eos``) and is
timed from sent to its first token (TTFT) and to its end. A request that fails, for any
reason, ends its agent's session (a session died: the agent begins a new one, a fresh
history); an agent whose next turn would no longer fit one slot's window (CAP) begins a new
session by itself (compacted, as real agents do; not a failure).

Three phases, one after the other, each ``BENCH_SECONDS`` long on the same tiny model, each
on a unit of its own behind an HAProxy front (``install --front haproxy``), uninstalled after:

1. ``over-committed``: ``-np 4 -kvu -c CAP --allow-overcommit``, no admission: four slots
   that may each grow to CAP share one pool of CAP cells.
2. ``admission``: the same server flags, the front installed with ``--admission``
   (no ``--allow-overcommit``: the over-commit guard lets an admitted pool through).
3. ``guaranteed``: ``-np 4 -kvu --kv-unified-per-slot CAP -c 4*CAP``: every slot's CAP is
   backed by the pool (the front without admission unless ``BENCH_GUARANTEED_ADMISSION=1``).

Printed per phase: the requests sent, answered and failed (by kind: ``context_exceeded``,
the shared pool ran out, "Context size has been exceeded"; ``too_long``, "exceeds the
available context size"; ``refused``, the admission's 503 past its queue or wait; ``cut``,
no answer or the front's 5xx; ``timeout``; ``other``), the sessions that died and those
compacted, the most cells the agents' histories held together, the client's TTFT, its
end-to-end time and the stream's time from its first token to its end, p50/p99 (answered
requests), the tokens generated per second, the prompt tokens and those the server read
(not from a slot's cache: a shared pool purges idle slots' caches when it needs the
cells); with admission, the front's ledger (``status --json`` ``front.admission``:
admitted, waited, refused, and the waits' p50/p99 as the upper bound of their histogram
bucket, with the mean); the server's memory after the load (``status --json`` ``memory``:
the unit's cgroup, and the main process's VmRSS), the KV estimate and the planned pool
(``pool_cells``, each slot's window ``n_ctx_slot``). A table of the three closes the run.

Environment: ``BENCH_SECONDS`` (60; the issue's full check is 600), ``BENCH_CAP`` (1,024),
``BENCH_MAX_TOKENS`` (48), ``BENCH_THINK`` (seconds between an agent's turns, 0),
``BENCH_TIMEOUT`` (seconds a request may wait for a byte, 180), ``BENCH_ADMISSION_QUEUE``
(64) and ``BENCH_ADMISSION_WAIT`` (120 s: ``--admission-queue``/``--admission-wait``),
``BENCH_GUARANTEED_ADMISSION`` (0: phase 3 without admission; 1: with it), ``BENCH_PHASES``
(which of 1,2,3 to run; all by default). Traffic goes to loopback only.
"""

from __future__ import annotations

import json
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

from launcher.bench import chat  # noqa: E402
from launcher.deploy.restart.admission import WAIT_BOUNDS  # noqa: E402
from launcher.server import binary  # noqa: E402

SECONDS = float(os.environ.get("BENCH_SECONDS", "60"))
#: the over-committed pool's cells and every slot's window (BENCH_CAP)
CAP = int(os.environ.get("BENCH_CAP", "1024"))
MAX_TOKENS = int(os.environ.get("BENCH_MAX_TOKENS", "48"))
THINK = float(os.environ.get("BENCH_THINK", "0"))
#: seconds a request may wait for its next byte (httpx's read timeout)
TIMEOUT = float(os.environ.get("BENCH_TIMEOUT", "180"))
QUEUE = int(os.environ.get("BENCH_ADMISSION_QUEUE", "64"))
WAIT = float(os.environ.get("BENCH_ADMISSION_WAIT", "120"))
GUARANTEED_ADMISSION = os.environ.get("BENCH_GUARANTEED_ADMISSION", "0") not in ("", "0")
ONLY = {p.strip() for p in os.environ.get("BENCH_PHASES", "1,2,3").split(",") if p.strip()}
AGENTS = 4
#: the cells one more turn may add: the next user message with its template (~30) and the reply
TURN = 40 + MAX_TOKENS
#: the whole run's deadline: each phase's load, its install and uninstall, with room
DEADLINE = time.monotonic() + 3 * (SECONDS + TIMEOUT + 900)

OVER = ["-np", "4", "-kvu", "-c", str(CAP), "-t", "1"]
GUARANTEED = ["-np", "4", "-kvu", "--kv-unified-per-slot", str(CAP), "-c", str(4 * CAP), "-t", "1"]
ADMISSION = [
    "--admission",
    "--admission-queue",
    str(QUEUE),
    "--admission-wait",
    f"{WAIT:g}",
]
KINDS = ("context_exceeded", "too_long", "refused", "cut", "timeout", "other")


@dataclass(frozen=True)
class Phase:
    number: str
    name: str
    unit: str
    flags: list[str]
    admission: bool


PHASES = [
    Phase(
        "1",
        "over-committed, no admission",
        "bench-adm-over.service",
        [*OVER, "--allow-overcommit"],
        False,
    ),
    Phase("2", "over-committed, admission", "bench-adm-admit.service", OVER, True),
    Phase(
        "3",
        "guaranteed" + (", admission" if GUARANTEED_ADMISSION else ", no admission"),
        "bench-adm-pool.service",
        GUARANTEED,
        GUARANTEED_ADMISSION,
    ),
]


def cli(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    p = subprocess.run(
        [sys.executable, "-m", "launcher", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    try:
        return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return p.returncode, {"message": f"rc={p.returncode}: {p.stdout[-2000:]}{p.stderr[-2000:]}"}


def kind_of(r: chat.ChatResult) -> str | None:
    """Why a request failed (the module docstring's kinds); None: it was answered."""
    if r.complete:
        return None
    if isinstance(r.cut, httpx.TimeoutException):
        return "timeout"
    if r.cut is not None:
        return "cut"
    said = r.error.raw if r.error is not None else ""
    if "Context size has been exceeded" in said:
        return "context_exceeded"
    if "exceeds the available context size" in said:
        return "too_long"
    if r.status == 503 and ("admission queue" in said or "no room in the KV pool" in said):
        return "refused"
    if r.status in (502, 503, 504):
        return "cut"
    return "other"


@dataclass(frozen=True)
class Request:
    sent: float  # time.time()
    kind: str | None  # None: answered
    ttft: float | None  # seconds from sent to the first token (answered requests)
    elapsed: float  # seconds from sent to the end
    generated: int  # completion tokens
    prompt: int  # prompt tokens (the server's usage)
    read: int | None  # of them, those the server read, not taken from a slot's cache
    error: str | None  # the failure in a line


@dataclass
class Agents:
    """Four agents whose histories grow; every request they sent, the sessions that died
    (a failed request) and those compacted (the next turn would pass a slot's window)."""

    url: str
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: list[Request] = field(default_factory=list)
    died: int = 0
    compacted: int = 0
    #: each agent's history in cells (the server's count after its last answer)
    cells: list[int] = field(default_factory=lambda: [0] * AGENTS)
    #: the most cells the agents' histories held together
    most: int = 0

    def agent(self, i: int) -> None:
        session = 0

        def fresh() -> list[dict[str, str]]:
            return [{"role": "user", "content": repro.prompt(20, 97 * i + 7 * session)}]

        history = fresh()
        timeout = httpx.Timeout(TIMEOUT, connect=10)
        with httpx.Client(base_url=self.url, timeout=timeout) as client:
            while not self.stop.is_set():
                body = {
                    "messages": history,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                sent = time.time()
                r = chat.stream_chat(client, body)
                why = kind_of(r)
                generated = r.usage.completion_tokens if r.usage else 0
                prompt = r.usage.prompt_tokens if r.usage else 0
                read = r.timings.prompt_n if r.timings else None
                with self.lock:
                    self.requests.append(
                        Request(
                            sent, why, r.ttft_s, r.elapsed_s, generated, prompt, read, r.failure
                        )
                    )
                    if why is not None:
                        self.died += 1
                        self.cells[i] = 0
                    else:
                        self.cells[i] = r.usage.total_tokens if r.usage else 0
                        self.most = max(self.most, sum(self.cells))
                if why is not None:  # the session died: a new one, after a breath
                    session += 1
                    history = fresh()
                    self.stop.wait(0.2)
                    continue
                history.append({"role": "assistant", "content": r.text})
                history.append({"role": "user", "content": repro.prompt(20, 100 + len(history))})
                if self.cells[i] + 2 * TURN > CAP:  # the next turn might not fit one slot
                    with self.lock:
                        self.compacted += 1
                        self.cells[i] = 0
                    session += 1
                    history = fresh()
                self.stop.wait(THINK)


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def bucket_quantile(buckets: list[int], count: int, q: float) -> str:
    """The ``q`` quantile of the ledger's waits: the bound of the first bucket that holds it."""
    if count <= 0:
        return "-"
    need = math.ceil(q * count)
    for bound, n in zip(WAIT_BOUNDS, buckets, strict=True):
        if n >= need:
            return f"<= {bound:g} s"
    return f"> {WAIT_BOUNDS[-1]:g} s"


def ledger_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """The ledger's counters over the load (after less before; the gauges as after)."""
    if not after or "pool" not in after:
        return {}
    before = before if before and "pool" in before else {}
    out = dict(after)
    for key in ("admitted", "waited", "refused", "refused_queue", "refused_wait"):
        out[key] = after.get(key, 0) - before.get(key, 0)
    for key in ("refused_large", "left", "counted", "bounded", "released", "cut", "wait_count"):
        out[key] = after.get(key, 0) - before.get(key, 0)
    out["wait_sum"] = after.get("wait_sum", 0.0) - before.get("wait_sum", 0.0)
    old = before.get("wait_buckets") or [0] * len(WAIT_BOUNDS)
    out["wait_buckets"] = [a - b for a, b in zip(after["wait_buckets"], old, strict=True)]
    return out


def vm_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def journal_tail(unit: str, lines: int = 40) -> str:
    p = subprocess.run(
        ["journalctl", "--user", "-u", unit, "-n", str(lines), "--no-pager", "-o", "short-precise"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return (p.stdout + p.stderr).rstrip()


def run_phase(phase: Phase, tmp: Path, model: Path, server: str) -> dict[str, Any]:
    """Install the phase's unit behind the front, load it, read the figures, uninstall."""
    where = tmp / phase.unit.removesuffix(".service")
    where.mkdir()
    port, url, env = realserver.bench_unit(where, phase.unit, sample_interval="3600")
    front = ["--front", "haproxy", *(ADMISSION if phase.admission else [])]
    args = ["-m", str(model), "--port", str(port), "--llama-server", server]
    flags = " ".join([*phase.flags, *front])
    print(f"\n== phase {phase.number}: {phase.name}: {flags}", flush=True)
    rc, out = cli(env, "install", *args, *phase.flags, *front)
    res: dict[str, Any] = {"phase": phase, "installed": rc == 0}
    if rc != 0:
        print(f"install refused (rc {rc}): {out.get('message') or out}", flush=True)
        print(journal_tail(phase.unit.replace(".service", "-front.service"), 20))
        cli(env, "uninstall", "--purge")
        return res
    for warning in out.get("warnings") or []:
        print(f"install: {warning}")
    try:
        _, before = cli(env, "status")
        agents = Agents(url)
        threads = [
            threading.Thread(target=agents.agent, args=(i,), daemon=True) for i in range(AGENTS)
        ]
        began = time.monotonic()
        for t in threads:
            t.start()
        agents.stop.wait(max(0.0, min(SECONDS, DEADLINE - time.monotonic())))
        agents.stop.set()
        for t in threads:  # a request in flight ends within its bounds
            t.join(timeout=max(1.0, min(TIMEOUT + WAIT + 30, DEADLINE - time.monotonic())))
        took = time.monotonic() - began
        stuck = sum(t.is_alive() for t in threads)
        _, after = cli(env, "status")
        with agents.lock:
            res.update(report(phase, agents, took, before, after, stuck))
        if phase.admission and res["failed"]:
            print(f"-- the front's journal ({phase.unit.replace('.service', '-front.service')}):")
            print(journal_tail(phase.unit.replace(".service", "-front.service")))
    finally:
        rc, out = cli(env, "uninstall", "--purge")
        if rc != 0:
            print(f"uninstall: rc {rc}: {out.get('message')}")
    return res


def report(
    phase: Phase,
    agents: Agents,
    took: float,
    before: dict[str, Any],
    after: dict[str, Any],
    stuck: int,
) -> dict[str, Any]:
    """Print the phase's figures; return those the closing table shows."""
    reqs = agents.requests
    answered = [r for r in reqs if r.kind is None]
    failed = [r for r in reqs if r.kind is not None]
    by_kind = {k: sum(1 for r in failed if r.kind == k) for k in KINDS}
    ttfts = [r.ttft for r in answered if r.ttft is not None]
    ends = [r.elapsed for r in answered]
    # from the first token to the end: the generation as the client saw it (the tiny model
    # makes max_tokens tokens in about a millisecond when it runs alone)
    spans = [r.elapsed - r.ttft for r in answered if r.ttft is not None]
    tokens = sum(r.generated for r in answered)
    ttft50, ttft99 = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
    planned = after.get("planned") or before.get("planned") or {}
    state = after.get("state") or {}
    rss = vm_rss(int(state.get("main_pid") or 0)) if state.get("main_pid") else None
    kv = (after.get("kv_estimate") or {}).get("kv_bytes")
    pool, window = planned.get("pool_cells"), planned.get("n_ctx_slot")
    print(
        f"load: {took:.1f} s, {AGENTS} agents"
        + (f" ({stuck} still in a request at the end)" if stuck else "")
    )
    print(
        f"requests: {len(reqs)}, answered {len(answered)}, failed {len(failed)} "
        f"({', '.join(f'{k} {v}' for k, v in by_kind.items())})"
    )
    print(
        f"sessions died: {agents.died}; compacted (next turn past a slot's {CAP}): "
        f"{agents.compacted}; the histories together held at most {agents.most} cells "
        f"(pool {pool})"
    )
    if failed:
        first: dict[str | None, str | None] = {}
        for r in failed:
            first.setdefault(r.kind, r.error)
        for k, e in first.items():
            print(f"  first {k}: {(e or '')[:200]}")
    print(
        f"client TTFT p50 {seconds(ttft50)}, p99 {seconds(ttft99)}; end-to-end p50 "
        f"{seconds(percentile(ends, 0.5))}, p99 {seconds(percentile(ends, 0.99))} "
        f"(answered requests)"
    )
    print(
        f"first token -> end p50 {seconds(percentile(spans, 0.5))}, "
        f"p99 {seconds(percentile(spans, 0.99))} ({MAX_TOKENS} tokens streamed)"
    )
    print(f"generated: {tokens} tokens, {tokens / took if took else 0:.1f} tokens/s")
    timed = [r for r in answered if r.read is not None]
    prompts, read = sum(r.prompt for r in timed), sum(r.read or 0 for r in timed)
    print(
        f"prompt tokens: {prompts}, of them read by the server (not from a slot's cache): "
        f"{read} ({read / prompts if prompts else 0:.0%}; a purged slot's history is read again)"
    )
    ledger = ledger_delta(
        (before.get("front") or {}).get("admission"), (after.get("front") or {}).get("admission")
    )
    wait50 = wait99 = "-"
    if phase.admission:
        if not ledger:
            adm = (after.get("front") or {}).get("admission")
            print(f"admission ledger: none ({adm})")
        else:
            n = ledger["wait_count"]
            wait50 = bucket_quantile(ledger["wait_buckets"], n, 0.5)
            wait99 = bucket_quantile(ledger["wait_buckets"], n, 0.99)
            mean = f"{ledger['wait_sum'] / n:.3f} s" if n else "-"
            print(
                f"admission ({ledger['state']}, pool {ledger['pool']}, slot {ledger['slot']}): "
                f"admitted {ledger['admitted']}, waited {ledger['waited']}, refused "
                f"{ledger['refused']} (queue {ledger['refused_queue']}, wait "
                f"{ledger['refused_wait']}, too large {ledger['refused_large']}); prompts "
                f"counted {ledger['counted']}, bounded {ledger['bounded']}; left "
                f"{ledger['left']}"
            )
            print(
                f"admission wait (the ledger, a bucket's upper bound): p50 {wait50}, "
                f"p99 {wait99}; mean {mean} over {n} admissions; now reserved "
                f"{ledger['reserved']} by {ledger['running']}, waiting {ledger['waiting']}"
            )
    print(
        f"memory after the load: unit {mib(after.get('memory'))}, llama-server VmRSS "
        f"{mib(rss)}; KV estimate {mib(kv)}; planned pool_cells {pool}, n_ctx_slot {window}, "
        f"overcommitted {planned.get('overcommitted')}",
        flush=True,
    )
    return {
        "requests": len(reqs),
        "failed": len(failed),
        "died": agents.died,
        "ttft": f"{seconds(ttft50)} / {seconds(ttft99)}",
        "wait": f"{wait50} / {wait99}",
        "memory": mib(after.get("memory")),
        "rss": mib(rss),
        "pool": f"{pool} ({window}/slot)",
    }


def header(server: str) -> None:
    version = subprocess.run(
        [server, "--version"], capture_output=True, text=True, timeout=30
    ).stderr.strip()
    print(
        f"admission bench {time.strftime('%Y-%m-%d %H:%M:%S %z')} on {os.uname().nodename}",
        f"llama-server: {binary.describe(server)}; --version: {version.splitlines()[0]}",
        f"CAP {CAP}, {SECONDS:g} s a phase, {AGENTS} agents, max_tokens {MAX_TOKENS} "
        f"(ignore_eos), think {THINK:g} s, request timeout {TIMEOUT:g} s",
        f"admission: queue {QUEUE}, wait {WAIT:g} s; phase 3 "
        + ("with admission" if GUARANTEED_ADMISSION else "without admission (the front alone)"),
        sep="\n",
        flush=True,
    )


def main() -> None:
    server = realserver.server_binary()
    header(server)
    results = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = tinymodel.write(tmp / "model.gguf")
        for phase in PHASES:
            if phase.number not in ONLY:
                continue
            if time.monotonic() > DEADLINE:
                print(f"\n== phase {phase.number}: skipped (past the run's deadline)")
                continue
            results.append(run_phase(phase, tmp, model, server))
    print("\n== the same load, three pools")
    cols = ("requests", "failed", "died", "ttft", "wait", "memory", "rss", "pool")
    names = ("requests", "failed", "died", "TTFT p50/p99", "wait p50/p99", "unit mem", "RSS")
    print(" | ".join(["phase", *names, "pool (window)"]))
    for res in results:
        phase = res["phase"]
        label = f"{phase.number} {phase.name}"
        if not res["installed"]:
            print(f"{label} | install refused")
            continue
        if "requests" not in res:
            print(f"{label} | no figures")
            continue
        print(" | ".join([label, *(str(res[c]) for c in cols)]))


if __name__ == "__main__":
    main()
