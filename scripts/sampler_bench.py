"""Benchmark (sampler): what one live sample costs, and what sampling every second costs
llama-server's decode speed. Run through ``scripts/bench-sampler`` (a private sandboxed
systemd); prints figures from one run, not a test: nothing here asserts.

1. One sample: ``llama-launcher sample`` as its timer runs it, a new process each time,
   against an installed unit on a small random-weight model: wall time, and CPU time (user +
   system of the process and what it runs: systemctl, journalctl), medians of N, once with
   nothing new between two samples and once with a request between.
2. Decode speed: one agent generates without pause (64-token completions) while nothing
   samples, while the sampler's timer samples every second (a process per sample), and
   while one ``llama-launcher sample --every 1`` process does (its imports paid once), in
   alternating windows; decode tok/s from llama-server's own counters over each window
   (Δ tokens_predicted_total ÷ Δ tokens_predicted_seconds_total), the tokens per wall
   second the agent got, and the CPU the sampling took per second.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import realserver  # noqa: E402
import tinymodel  # noqa: E402

from launcher.host import timer  # noqa: E402
from launcher.server import metrics  # noqa: E402

UNIT = "bench-sampler.service"
#: wider and deeper than the tests' tiny model, so decoding is real work (random weights)
SHAPE = tinymodel.Shape(layers=6, n_embd=256, heads=4, kv_heads=2, ff=768, ctx_train=8192)
SAMPLES = int(os.environ.get("BENCH_SAMPLES", "20"))
WINDOW = float(os.environ.get("BENCH_WINDOW", "20"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
THREADS = os.environ.get("BENCH_THREADS", str(os.cpu_count() or 2))


def load() -> str:
    one, five, _ = os.getloadavg()
    others = subprocess.run(
        ["pgrep", "-c", "-f", "pytest|pip wheel"], capture_output=True, text=True
    ).stdout.strip()
    return f"load {one:.2f} (5 min {five:.2f}), other pytest/pip processes: {others or 0}"


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args], env=env, capture_output=True, text=True
    )


def systemctl(*args: str) -> None:
    subprocess.run(["systemctl", "--user", *args], check=True, capture_output=True)


def one_sample(env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one ``llama-launcher sample`` as the timer's service runs it
    (the unit, scope and folders named: no settings read), and of the commands it runs."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = cli(env, "sample", *_where(env), "--json")
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0 or '"skipped": null' not in p.stdout:
        raise RuntimeError(f"the sample did not run: {p.stdout}{p.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _where(env: dict[str, str]) -> list[str]:
    """What the timer's service names: the unit, its scope and folders."""
    return ["--unit", UNIT, "--scope", "user", "--state-dir", env["LLAMA_LAUNCHER_STATE_DIR"],
            "--env-file", env["LLAMA_LAUNCHER_ENV_FILE"],
            "--textfile-dir", env["LLAMA_LAUNCHER_METRICS_TEXTFILE_DIR"]]  # fmt: skip


def chat(url: str, max_tokens: int) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell a long story about a river."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    httpx.post(url + "/v1/chat/completions", json=body, timeout=300).raise_for_status()


class Agent(threading.Thread):
    """One agent that generates without pause; counts the tokens it got."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.tokens = url, threading.Event(), 0

    def run(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "Tell a long story about a river."}],
            "max_tokens": 64,  # the counters move when a request ends: end often
            "ignore_eos": True,
        }
        with httpx.Client(timeout=300) as c:
            while not self.stop.is_set():
                r = c.post(self.url + "/v1/chat/completions", json=body)
                r.raise_for_status()
                self.tokens += int(r.json()["usage"]["completion_tokens"])


def window(url: str, agent: Agent, seconds: float) -> tuple[float, float]:
    """(decode tok/s by the server's counters, tokens per wall second) over ``seconds``."""
    a, ta, t0 = metrics.parse(httpx.get(url + "/metrics").text), agent.tokens, time.monotonic()
    time.sleep(seconds)
    b, tb, t1 = metrics.parse(httpx.get(url + "/metrics").text), agent.tokens, time.monotonic()
    tokens = b["tokens_predicted_total"] - a["tokens_predicted_total"]
    spent = b["tokens_predicted_seconds_total"] - a["tokens_predicted_seconds_total"]
    return tokens / spent, (tb - ta) / (t1 - t0)


def main() -> None:
    sandbox = Path(os.environ["LLAMA_LAUNCHER_SANDBOX"])
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = tinymodel.write(tmp / "model.gguf", SHAPE)
        port, url, env = realserver.bench_unit(
            tmp, UNIT, metrics_textfile_dir=str(tmp / "prom"), sample_interval="1"
        )
        server = realserver.server_binary()
        p = cli(env, "install", "-m", str(model), "--port", str(port), "--llama-server", server,
                "-c", "8192", "-np", "1", "-t", THREADS, "--json")  # fmt: skip
        if p.returncode != 0:
            raise SystemExit(f"install failed: {p.stdout}{p.stderr}")
        _, timer_unit = timer.names(UNIT)
        try:
            systemctl("stop", timer_unit)
            print(f"before: {load()}")
            cost(env, url)
            decode(env, url, timer_unit)
            print(f"after:  {load()}")
        finally:
            cli(env, "uninstall")
            for name in timer.names(UNIT):
                (sandbox / "units" / name).unlink(missing_ok=True)


def cost(env: dict[str, str], url: str) -> None:
    one_sample(env)  # the first one counts everything since the start
    idle = [one_sample(env) for _ in range(SAMPLES)]
    busy = []
    for _ in range(SAMPLES):
        chat(url, 16)
        busy.append(one_sample(env))
    print(f"one sample (llama-launcher sample, a new process), medians of {SAMPLES}:")
    for name, runs in (("nothing new", idle), ("a request between", busy)):
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"  {name:<18} wall {wall * 1000:7.1f} ms   CPU {cpu * 1000:7.1f} ms")


MODES = ("none", "timer, every 1 s", "--every 1")


def decode(env: dict[str, str], url: str, timer_unit: str) -> None:
    agent = Agent(url)
    agent.start()
    time.sleep(3)  # warm
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    try:
        for _ in range(ROUNDS):
            for mode in MODES:
                results[mode].append(_window(env, url, agent, timer_unit, mode))
    finally:
        systemctl("stop", timer_unit)
        agent.stop.set()
        agent.join(600)
    print(
        f"decode while nothing samples / the timer samples every second / one process "
        f"samples every second ({ROUNDS} alternating windows of {WINDOW:g} s each, -np 1 "
        f"-t {THREADS}, one agent; medians):"
    )
    med = {m: [statistics.median(x[i] for x in r) for i in range(3)] for m, r in results.items()}
    for mode, (server_tps, wall_tps, cpu) in med.items():
        used = f"{1000 * cpu:5.1f} ms/s" if cpu else "not accounted (cgroup v1)"
        print(
            f"  {mode:<17} server's counters {server_tps:7.1f} tok/s  agent {wall_tps:7.1f} "
            f"tok/s  sampling CPU {used if mode != 'none' else '-'}"
        )
    for mode in MODES[1:]:
        ratio = med[mode][0] / med["none"][0]
        wall_ratio = med[mode][1] / med["none"][1]
        print(f"  {mode} / none: {ratio:.3f} (counters), {wall_ratio:.3f} (agent); goal >= 0.98")


def _window(
    env: dict[str, str], url: str, agent: Agent, timer_unit: str, mode: str
) -> tuple[float, float, float]:
    """One window in ``mode``: (server tok/s, agent tok/s, sampling CPU seconds per second)."""
    resident = None
    if mode == "timer, every 1 s":
        systemctl("start", timer_unit)
    elif mode == "--every 1":
        resident = subprocess.Popen(
            [sys.executable, "-m", "launcher", "sample", "--every", "1", *_where(env), "--json"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    time.sleep(1)
    cpu0 = _cpu_of_samples(timer_unit)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    server, wall = window(url, agent, WINDOW)
    cpu = _cpu_of_samples(timer_unit) - cpu0
    if resident is not None:
        resident.terminate()
        resident.wait(60)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    systemctl("stop", timer_unit)
    return server, wall, cpu / WINDOW


def _cpu_of_samples(timer_unit: str) -> float:
    """CPU seconds the timer's sample service has used (systemd's CPUUsageNSec; cgroup v1
    here: 0 when not accounted)."""
    service = timer_unit.removesuffix(".timer") + ".service"
    out = subprocess.run(
        ["systemctl", "--user", "show", "-p", "CPUUsageNSec", "--value", service],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return int(out) / 1e9 if out.isdigit() else 0.0


if __name__ == "__main__":
    main()
