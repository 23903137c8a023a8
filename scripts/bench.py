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

from launcher import units, validate  # noqa: E402
from launcher.config import build  # noqa: E402

UNIT_DIR = Path(os.environ["LLAMA_LAUNCHER_SANDBOX"]) / "units"


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
    (UNIT_DIR / name).write_text("\n".join(lines) + "\n")


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
        env.write_text(validate.render(cfg))
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


def import_once() -> float:
    """Seconds to import httpx + pydantic-settings + tenacity + sh in a fresh python."""
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", "import httpx, pydantic_settings, tenacity, sh"], check=True
    )
    return time.monotonic() - t0


def bench_deploy(n: int = 10) -> None:
    """(a) gated deploy cost over a bare restart, and (b) a crashing config's recovery,
    both against the cost of importing the tool's libraries."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model, server = setup(tmp)
        port = realserver.free_port()
        env = dict(
            os.environ,
            LLAMA_LAUNCHER_UNIT="bench-deploy.service",
            LLAMA_LAUNCHER_ENV_FILE=str(tmp / "etc/bench.env"),
            LLAMA_LAUNCHER_STATE_DIR=str(tmp / "state"),
            LLAMA_LAUNCHER_UNIT_DIR=str(UNIT_DIR),
        )
        url = f"http://127.0.0.1:{port}"

        def cli(*args: str) -> dict[str, object]:
            p = subprocess.run(
                ["llama-launcher", *args, "--json"], capture_output=True, text=True, env=env
            )
            return dict(json.loads(p.stdout.strip().splitlines()[-1]))

        out = cli(
            "install",
            "--llama-server",
            server,
            "-m",
            str(model),
            "--port",
            str(port),
            "-c",
            "4096",
            "-np",
            "2",
        )
        assert out["outcome"] == "deployed", out
        bare = restart_until_serving("bench-deploy.service", url, n)
        # the import reference is sampled next to every deploy, so a slow spell of the
        # machine weighs on both sides of the ratio
        deploys, imports = [], []
        for i in range(n):
            imports.append(import_once())
            t0 = time.monotonic()
            out = cli("set", "-c", "8192" if i % 2 == 0 else "4096")
            deploys.append(time.monotonic() - t0)
            assert out["outcome"] == "deployed", out
        crash_recovery, starts = [], []
        taken = __import__("socket").socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for _ in range(n):
            imports.append(import_once())
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
    imp, b, dep, rec = (statistics.median(x) for x in (imports, bare, deploys, crash_recovery))
    print(f"medians of {n} on the tiny model ({2 * n} for the import, sampled between them):")
    print(f"  import httpx+pydantic-settings+tenacity+sh: {imp * 1000:7.1f} ms")
    print(f"  bare restart until serving:                 {b * 1000:7.1f} ms")
    print(f"  gated deploy of a good change (CLI, whole): {dep * 1000:7.1f} ms")
    print(f"  crashing config, deploy start -> old serving: {rec * 1000:7.1f} ms")
    print(f"(a) (deploy - bare restart) / import = {(dep - b) / imp:5.2f}  (target <= 1.5)")
    print(
        f"(b) bad config started {max(starts)} time(s) per deploy (target 1); "
        f"recovery / import = {rec / imp:5.2f}  (target <= 2.0)"
    )


if __name__ == "__main__":
    {"launcher": bench_launcher, "deploy": bench_deploy}[sys.argv[1]]()
