"""Benchmark (bake): seed 000's mistake deployed with a bake while four agents' histories
grow, and how long the pool's overflow lasted before the old config served again. Run
through ``scripts/bench-bake`` (a private sandboxed systemd); prints figures from one run,
not a test: nothing here asserts.

The good config (``-np 4 -kvu --kv-unified-per-slot CAP -c 4*CAP``) serves four agents and
records a baseline; the over-committed one (``-np 4 -kvu -c CAP --allow-overcommit``) is
deployed with ``--bake 10m`` while they go on (CAP: ``BENCH_CAP``, 1,024), the default path: the
CLI returns after the gate and the sampler's service carries the bake (``BENCH_WAIT=1``: with
``--wait``). Printed: when the bake's first sample came, after the deploy's commit and after
the CLI returned;
the bake's sample interval and its pool watch (``bake_pool_limit``, ``bake_pool_poll``: set
them in the environment, ``LLAMA_LAUNCHER_BAKE_POOL_LIMIT=0`` for none); the verdict; the
first 'Context size has been exceeded' (the server's journal time from the baked
generation's live record, or a client's, whichever came first; negative: after the
verdict) if one came; the old config serving again (the revert's generation's gate
passed); the agents' requests that failed from the first hard signal (the first overflow,
else the verdict) until the old config served (lost), from the baked config's gate on, and
after, each split by kind: ``context_exceeded`` (the baked config's shared pool ran out:
"Context size has been exceeded", in the stream or the body), ``too_long`` (a history
longer than the good config's slots: "exceeds the available context size"; the agent then
begins a new session, as one that compacts its history does), ``cut`` (no answer: the
connection cut by the switch, or the front's own 5xx), ``other``; and when those lost in
between were sent: before the first hard signal (in flight when it came: the failure the
bake reverts on, which no revert can undo), after it and before the verdict (sent to the
failing config while the bake had not yet judged), or after the verdict (while the revert
was on its way, before the front held or switched); and when the front was held at the
journal's line of the first hard failure (the early hold), if it was. The requests sent
after the first hard
signal and lost before the old config served, less those too long for any slot (the
client's: the old config refuses them too), are what the revert could have saved: the
issue's goal is 0 of them behind the front.
``BENCH_FRONT=haproxy`` installs the HAProxy front (the agents talk to it);
``BENCH_FRONT=switch`` the front and a second instance (``--second-instance``), which keeps
the good config warm through the bake, so the revert is a switch to it.

``BENCH_SESSIONS``: ``fresh`` (the default: seed 000's case, a change made at one time and
the pool filled later) has each agent begin a new session at the deploy, so the histories
grow into the new pool during the bake; ``carried`` keeps them, so the histories the good
config held (up to CAP tokens each) arrive at once at a pool of CAP and overflow it in the
first batches after the gate. ``BENCH_THINK``: seconds each agent spends between two turns
(its tools; 0 by default, where the tiny model's turns take tens of milliseconds and four
agents fill a pool of 1,024 in about a second).
"""

from __future__ import annotations

import json
import os
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
import repro  # noqa: E402
import tinymodel  # noqa: E402

from launcher.deploy import store  # noqa: E402
from launcher.watch import bake, record  # noqa: E402

UNIT = "bench-bake.service"
#: the good config's per-slot cap and the bad one's whole pool (BENCH_CAP)
CAP = int(os.environ.get("BENCH_CAP", "1024"))
GOOD = ["-np", "4", "-kvu", "--kv-unified-per-slot", str(CAP), "-c", str(4 * CAP), "-t", "1"]
BAD = ["-np", "4", "-kvu", "-c", str(CAP), "-t", "1", "--allow-overcommit"]
INTERVAL = os.environ.get("BENCH_BAKE_INTERVAL", "15")
FRONT = os.environ.get("BENCH_FRONT", "none")
SESSIONS = os.environ.get("BENCH_SESSIONS", "fresh")
#: seconds an agent spends between two turns (its tools), BENCH_THINK
THINK = float(os.environ.get("BENCH_THINK", "0"))
#: BENCH_WAIT=1: ``deploy --wait`` (the deploy waits for the verdict); else the default path
WAIT = os.environ.get("BENCH_WAIT", "") not in ("", "0")


def cli(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    p = subprocess.run(
        [sys.executable, "-m", "launcher", *args, "--json"], env=env, capture_output=True, text=True
    )
    try:
        return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"{args[0]}: rc={p.returncode}\n{p.stdout}\n{p.stderr}") from None


def kind_of(status: int | None, body: str) -> str:
    """Why a request failed (the module docstring's kinds)."""
    if "Context size has been exceeded" in body:
        return "context_exceeded"
    if "exceeds the available context" in body:
        return "too_long"
    if status is None or status in (502, 503, 504):
        return "cut"
    return "other"


class Agents:
    """Four agents whose histories grow; every request's end, whether it was answered, and
    why not (``kind_of``)."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        #: set at the deploy: each agent's next turn begins a new session (SESSIONS=fresh)
        self.begin_again: set[int] = set()
        self.done: list[tuple[float, bool]] = []
        #: each failed request's (sent, ended, why: ``kind_of``)
        self.lost: list[tuple[float, float, str]] = []

    def agent(self, i: int) -> None:
        history = [{"role": "user", "content": repro.prompt(20, 90 + i)}]
        while not self.stop.is_set():
            if i in self.begin_again:
                self.begin_again.discard(i)
                history[:] = [{"role": "user", "content": repro.prompt(20, 300 + i)}]
            body = {"messages": history, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            began = time.time()
            try:
                r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
                ok = r.status_code == 200 and "choices" in r.text
                why = None if ok else kind_of(r.status_code, r.text)
            except httpx.HTTPError:
                ok, why = False, "cut"
            now = time.time()
            self.done.append((now, ok))
            if why is not None:
                self.lost.append((began, now, why))
            if ok:
                reply = r.json()["choices"][0]["message"]["content"]
                history.append({"role": "assistant", "content": reply})
                time.sleep(THINK)
            else:
                time.sleep(0.2)
            history.append({"role": "user", "content": repro.prompt(20, 100 + i + len(history))})
            if why == "too_long" or len(history) > 40 * CAP // 1024:
                # past its slot's window: the agent compacts, as real ones do (a new session)
                history[:] = history[:1]


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = tinymodel.write(tmp / "model.gguf")
        port, url, env = realserver.bench_unit(
            tmp, UNIT, sample_interval="3600", bake_interval=INTERVAL
        )
        where = [
            "-m",
            str(model),
            "--port",
            str(port),
            "--llama-server",
            realserver.server_binary(),
        ]
        front = (
            ["--front", "haproxy", "--second-instance"] if FRONT == "switch" else ["--front", FRONT]
        )
        rc, out = cli(env, "install", *where, *GOOD, *front)
        if rc != 0:
            raise SystemExit(f"install failed: {out}")
        try:
            run(env, url, where, tmp / "state")
        finally:
            cli(env, "uninstall", "--purge")


def run(env: dict[str, str], url: str, where: list[str], state: Path) -> None:
    agents = Agents(url)
    threads = [threading.Thread(target=agents.agent, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(10)
    cli(env, "sample")  # the baseline, with its load
    spec = state / "front" / "front.json"
    if spec.exists():  # behind the front, a config's port is the server's private one
        private = json.loads(spec.read_text())["private_port"]
        where = [str(private) if w == where[where.index("--port") + 1] else w for w in where]
    if SESSIONS == "fresh":
        agents.begin_again.update(range(4))
    wait = ["--wait"] if WAIT else []
    rc, out = cli(env, "deploy", *where, *BAD, "--drain-timeout", "5", "--bake", "10m", *wait)
    returned = time.time()
    st = store.Store(state)
    baked = (out.get("bake") or {}).get("started", {}).get("generation")
    the_bake = bake.load(st.get(baked).path) if baked is not None else None
    deadline = time.monotonic() + 600
    while the_bake is not None and the_bake.state in (bake.RUNNING, bake.REVERTING):
        if time.monotonic() > deadline:  # the default path: the sampler's service carries it
            break
        time.sleep(0.2)
        the_bake = bake.load(st.get(baked).path) or the_bake
    time.sleep(5)
    agents.stop.set()
    for t in threads:
        t.join(timeout=130)
    live = st.live()
    if the_bake is None or the_bake.state != "reverted" or live is None or baked is None:
        state = the_bake.state if the_bake else None
        said = f"outcome {out.get('outcome')}, bake {state}: {out.get('message')}"
        print(f"no revert: rc {rc}, {said}")
        return
    gone = st.get(baked)
    rec = record.load(gone.path, baked)
    assert the_bake.ended is not None
    policy, ended = the_bake.policy, the_bake.ended
    gated = bake.served_from(gone)
    # the overflows the baked generation's record has, and those only its clients saw (a
    # revert decided on a look can come before the sample that would have read them)
    overflows = [f["t"] for f in rec.failures if f["kind"] == "context_exceeded"]
    overflows += [e for _, e, w in agents.lost if w == "context_exceeded" and e >= gated]
    # the first hard signal: the first overflow (before the sample that saw it), else the
    # verdict itself (the pool watch's look: the overflow had not come)
    first = min([*overflows, ended])
    serving = bake.served_from(live)
    # a revert that switched to the warm second instance served the old config from then on
    switched = ((the_bake.revert or {}).get("handover") or {}).get("switch", {}).get("switched_at")
    if switched:
        serving = min(serving, float(switched))
    watch = (
        f"pool watch {policy.pool_limit:.0%} every {policy.pool_poll:g} s"
        if policy.pool_limit
        else "pool watch off"
    )
    assert the_bake.verdict is not None
    why = the_bake.verdict.to_dict()
    print(
        time.strftime("%Y-%m-%d", time.localtime()),
        f"front {FRONT}, bake_interval {INTERVAL} s, {watch},",
        f"sessions {SESSIONS}, cap {CAP}, think {THINK:g} s,",
        "deploy --wait" if WAIT else "the default path (the CLI returns after the gate)",
    )
    first_sample = the_bake.progress.first
    if first_sample is not None:
        print(
            f"first bake sample: {first_sample - gated:+.2f} s after the deploy's commit, "
            f"{first_sample - returned:+.2f} s after the CLI returned"
        )
    kind = "hard" if why["hard"] else "soft"
    print(f"verdict: {why['signal']} ({kind}), {ended - gated:.1f} s after the gate")
    if overflows:
        print(f"first 'Context size has been exceeded' -> verdict: {ended - min(overflows):+.1f} s")
    else:
        print("'Context size has been exceeded': none before the old config served")
    mode = ((the_bake.revert or {}).get("handover") or {}).get("mode", "hold")
    print(f"the revert: a {mode} (handover.mode)")
    early = (the_bake.revert or {}).get("early_hold") or {}
    if early.get("at"):
        print(f"first hard signal -> the front held (the early hold): {early['at'] - first:+.2f} s")
    else:
        why = [n for n in the_bake.progress.notes if "held early" in n]
        print(
            "the early hold: none (the revert held or switched in its own time)"
            + (f"; the bake's notes: {' | '.join(why)}" if why else "")
        )
    print(f"verdict -> the old config serving (generation {live.number}): {serving - ended:.1f} s")
    print(f"first hard signal -> the old config serving: {serving - first:.1f} s")
    lost = sum(1 for t, ok in agents.done if not ok and first <= t <= serving)
    since = sum(1 for t, ok in agents.done if not ok and gated <= t <= serving)
    after = sum(1 for t, ok in agents.done if not ok and t > serving)
    answered = sum(1 for t, ok in agents.done if ok and t > serving)
    print(f"requests lost from the first hard signal to the old config serving: {lost}")
    print(f"lost in between, by kind: {split(agents.lost, first, serving)}")
    between = [x for x in agents.lost if first <= x[1] <= serving]
    struck = sum(1 for b, _, _ in between if b < first)
    before = sum(1 for b, _, _ in between if first <= b < ended)
    later = sum(1 for b, _, _ in between if b >= ended)
    print(
        f"lost in between, sent before the first hard signal (in flight when it came): {struck}, "
        f"after it and before the verdict: {before}, after the verdict: {later}"
    )
    saveable = [x for x in between if x[0] >= first]
    print(
        f"requests sent after the first hard signal and lost before the old config served, "
        f"a history too long for any slot aside: {sum(1 for x in saveable if x[2] != 'too_long')} "
        f"({split(saveable, first, serving)})"
    )
    print(f"lost from the baked config's gate to the old config serving: {since}")
    print(f"lost from the gate on, by kind: {split(agents.lost, gated, serving)}")
    print(f"failed after: {after}; answered after: {answered}")
    print(f"failed after, by kind: {split(agents.lost, serving, float('inf'))}")
    print(f"verdict: {why['reason']}")


def split(lost: list[tuple[float, float, str]], start: float, end: float) -> str:
    """The failed requests that ended from ``start`` to ``end``, by kind."""
    kinds = ("context_exceeded", "too_long", "cut", "other")
    n = {k: sum(1 for _, e, w in lost if w == k and start <= e <= end) for k in kinds}
    return ", ".join(f"{k} {v}" for k, v in n.items())


if __name__ == "__main__":
    main()
