"""Benchmarks of the launcher and the deploy transaction, on the sandbox and the tiny model.

Run through ``scripts/bench-launcher`` and ``scripts/bench-deploy`` (they start a private
sandboxed systemd). Each prints ratios from one run: medians of N repetitions measured in
the same run, so the machine's speed cancels out. Not a test: nothing here asserts.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import realserver  # noqa: E402
import tinymodel  # noqa: E402

from launcher.config import build, render_env  # noqa: E402
from launcher.host import units  # noqa: E402


def unit_dir() -> Path:
    return Path(os.environ["LLAMA_LAUNCHER_SANDBOX"]) / "units"


def systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemctl", "--user", *args], capture_output=True, text=True, check=check
    )


def serving(url: str, timeout: float = 30) -> None:
    """Wait for /health 200, then one real completion."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=10) as c:
        while True:
            try:
                if c.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not healthy in {timeout}s")
            time.sleep(0.002)
        r = c.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        r.raise_for_status()


def restart_until_serving(unit: str, url: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        systemctl("restart", unit)
        serving(url)
        times.append(time.monotonic() - t0)
        systemctl("reset-failed", unit, check=False)  # manual restarts count toward the limit
    return times


def setup(tmp: Path) -> tuple[Path, str]:
    model = tinymodel.write(tmp / "tiny.gguf")
    return model, realserver.server_binary()


def write_unit(name: str, exec_start: str) -> None:
    text = units.render(*units.this_python(), "/dev/null", "user")
    lines = [
        f"ExecStart={exec_start}" if line.startswith("ExecStart=") else line
        for line in text.splitlines()
    ]
    (unit_dir() / name).write_text("\n".join(lines) + "\n")


def bench_launcher(n: int = 10) -> None:
    """Restart-until-serving with `llama-launcher exec` as ExecStart / llama-server directly."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model, server = setup(tmp)
        port = realserver.free_port()
        cfg = build(
            {"llama_server": server, "model": model, "port": port, "ctx_size": 4096, "parallel": 2}
        )
        env = tmp / "bench.env"
        env.write_text(render_env(cfg))
        python, _ = units.this_python()
        write_unit("bench-launcher.service", f"{python} -S -m launcher exec --env-file {env}")
        write_unit("bench-direct.service", " ".join(cfg.argv()))
        systemctl("daemon-reload")
        url = f"http://127.0.0.1:{port}"
        results = {}
        for unit in (
            "bench-direct.service",
            "bench-launcher.service",
            "bench-direct.service",
            "bench-launcher.service",
        ):
            other = (
                "bench-launcher.service"
                if unit == "bench-direct.service"
                else "bench-direct.service"
            )
            systemctl("stop", other)
            restart_until_serving(unit, url, 2)  # warm up
            results.setdefault(unit, []).extend(restart_until_serving(unit, url, n // 2))
        systemctl("stop", "bench-launcher.service", "bench-direct.service")
    direct = statistics.median(results["bench-direct.service"])
    via = statistics.median(results["bench-launcher.service"])
    print(f"restart until serving (systemctl restart, /health 200, one completion), median of {n}:")
    print(f"  llama-server as ExecStart:          {direct * 1000:7.1f} ms")
    print(f"  llama-launcher exec as ExecStart:   {via * 1000:7.1f} ms")
    print(f"  ratio launcher / direct:            {via / direct:7.2f}  (target <= 1.3)")


#: The stand-in load: a model that takes this long to load before llama-server starts, so a
#: ratio to the bare restart means what it means on a real model (not a tiny one's 0.1 s).
LOAD_S = 5


def slow_server(tmp: Path, server: str) -> str:
    """A LLAMA_SERVER wrapper that sleeps LOAD_S seconds, then execs the real llama-server
    (``--help`` and ``--version``, which the validation reads, answer at once)."""
    wrapper = tmp / "slow-llama-server"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --help|--version) exec {server} "$@";; esac\n'
        f"sleep {LOAD_S}\n"
        f'exec {server} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def bench_deploy(n: int = 6) -> None:
    """(a) gated deploy of a good change ÷ bare restart-until-serving, and (b) a crashing
    config: how often it was started, and deploy start -> old config serving ÷ bare
    restart, all with a stand-in load of LOAD_S seconds."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model, real_server = setup(tmp)
        server = slow_server(tmp, real_server)
        port = realserver.free_port()
        env = dict(
            os.environ,
            LLAMA_LAUNCHER_UNIT="bench-deploy.service",
            LLAMA_LAUNCHER_ENV_FILE=str(tmp / "etc/bench.env"),
            LLAMA_LAUNCHER_STATE_DIR=str(tmp / "state"),
            LLAMA_LAUNCHER_UNIT_DIR=str(unit_dir()),
        )
        url = f"http://127.0.0.1:{port}"

        def cli(*args: str) -> dict[str, object]:
            p = subprocess.run(
                ["llama-launcher", *args, "--json"], capture_output=True, text=True, env=env
            )
            return dict(json.loads(p.stdout.strip().splitlines()[-1]))

        flags = ["-m", str(model), "--port", str(port), "-c", "4096", "-np", "2"]
        out = cli("install", "--llama-server", server, *flags)
        assert out["outcome"] == "deployed", out
        bare = restart_until_serving("bench-deploy.service", url, n)
        deploys, gated, clocked = [], [], []
        for i in range(n):
            t0 = time.monotonic()
            out = cli("set", "-c", "8192" if i % 2 == 0 else "4096")
            deploys.append(time.monotonic() - t0)
            assert out["outcome"] == "deployed", out
            gated.append(float(out["timings"]["restart_to_serving"]))  # type: ignore[index]
            clocked.append(float(out["timings"]["total"]))  # type: ignore[index]
        crash_recovery, starts = [], []
        taken = __import__("socket").socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for _ in range(n):
            cursor = subprocess.run(
                ["journalctl", "-n", "1", "-o", "json"], capture_output=True, text=True
            ).stdout
            cur = json.loads(cursor)["__CURSOR"] if cursor.strip() else ""
            t0 = time.monotonic()
            out = cli("set", "--port", str(taken.getsockname()[1]))
            serving(url)
            crash_recovery.append(time.monotonic() - t0)
            assert out["outcome"] == "rolled_back", out
            log = subprocess.run(
                [
                    "journalctl",
                    "--no-pager",
                    "-o",
                    "cat",
                    "--after-cursor",
                    cur,
                    "_SYSTEMD_UNIT=bench-deploy.service",
                    "+",
                    "_SYSTEMD_USER_UNIT=bench-deploy.service",
                ],
                capture_output=True,
                text=True,
            ).stdout
            starts.append(log.count("couldn't bind HTTP server socket"))
        taken.close()
        cli("uninstall", "--purge")
    b, dep, rec = (statistics.median(x) for x in (bare, deploys, crash_recovery))
    start = statistics.median(w - c for w, c in zip(deploys, clocked, strict=True))
    before = statistics.median(c - g for c, g in zip(clocked, gated, strict=True))
    code = "import time\nt = time.perf_counter()\nimport launcher.config\n"
    code += "print(time.perf_counter() - t)"
    typed = statistics.median(_fresh(code) for _ in range(n))
    print(f"{time.strftime('%Y-%m-%d')}: medians of {n}, tiny model behind a {LOAD_S} s load:")
    print(f"  bare restart until serving:                   {b * 1000:7.0f} ms")
    print(f"  gated deploy of a good change (CLI, whole):   {dep * 1000:7.0f} ms")
    print(f"    the CLI's start-up, to the deploy's clock:  {start * 1000:7.0f} ms")
    print(f"      of it the typed config's import alone:    {typed * 1000:7.0f} ms")
    print(f"    validation, store, drain, slot save:        {before * 1000:7.0f} ms")
    print(
        f"    restart -> serving, gated:                  {statistics.median(gated) * 1000:7.0f} ms"
    )
    print(f"  crashing config, deploy start -> old serving: {rec * 1000:7.0f} ms")
    print(f"(a) gated deploy / bare restart = {dep / b:5.2f}  (target <= 1.1)")
    print(f"(b) bad config started {max(starts)} time(s) per deploy (target 1); ", end="")
    print(f"deploy start -> old serving / bare restart = {rec / b:5.2f}  (target <= 2.2)")


def _fresh(code: str) -> float:
    """Seconds the ``code`` prints (a time it measured itself) in a new interpreter."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(p.stdout.strip().splitlines()[-1])


def bench_imports(n: int = 15) -> None:
    """What tenacity, httpx and sh add to a deploy's imports (on top of what the deploy
    imports without them), and what the interpreter's teardown would add to every verb."""
    # what a deploy imported before the three (the validation chain, systemd, the log lines)
    before = (
        "import launcher.config, launcher.config.validate, launcher.host.systemd, "
        "launcher.server.serverlog, launcher.host.envfile, launcher.host.launch, "
        "concurrent.futures"
    )
    libs = ("tenacity", "httpx", "sh")
    cost = {
        lib: statistics.median(
            _fresh(
                f"{before}\nimport time\nt = time.perf_counter()\nimport {lib}\n"
                "print(time.perf_counter() - t)"
            )
            for _ in range(n)
        )
        for lib in libs
    }
    together = statistics.median(
        _fresh(
            f"{before}\nimport time\nt = time.perf_counter()\nimport {', '.join(libs)}\n"
            "print(time.perf_counter() - t)"
        )
        for _ in range(n)
    )
    print(f"{time.strftime('%Y-%m-%d')}: imports on top of a deploy's others, medians of {n}:")
    for lib, s in cost.items():
        print(f"  {lib:9s} {s * 1000:6.1f} ms")
    print(f"  together  {together * 1000:6.1f} ms")
    teardown = "import sys, time\nsys.stderr.write(repr(time.time()))\nsys.stderr.flush()"
    verb = (
        "from launcher import cli, config  # noqa\n"
        "from launcher.reports import status  # noqa\n"
        "config.load_settings()\n"
    )
    times: dict[str, list[float]] = {"os._exit": [], "exit": []}
    for _ in range(n):
        for how, tail in (("os._exit", "\nimport os\nos._exit(0)"), ("exit", "")):
            p = subprocess.run(
                [sys.executable, "-c", verb + teardown + tail], capture_output=True, text=True
            )
            times[how].append(time.time() - float(p.stderr.strip().splitlines()[-1]))
    quick, slow = (statistics.median(times[k]) for k in ("os._exit", "exit"))
    print(f"  the CLI's teardown, skipped by os._exit: {(slow - quick) * 1000:6.1f} ms per verb")


if __name__ == "__main__":
    {"launcher": bench_launcher, "deploy": bench_deploy, "imports": bench_imports}[sys.argv[1]]()
