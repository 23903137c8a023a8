"""Benchmark: what a config change costs agents that are using the server (run through
``scripts/bench-disruption``, inside a private sandboxed systemd, on the tiny model).

Four agents loop through multi-turn streamed chat conversations whose histories grow to
about 2,000 tokens, with a short think time between turns (an agent runs its tools). In the
middle, three deploys: two good changes (threads, which keep the KV layout) and one that
fails its gate and rolls back (a chat template that refuses only the probe). Per mode:

- ``bare``:  ``--no-drain``, the restart as it was before the handover (SIGTERM at once);
- ``drain``: wait for requests in flight, no slot save path (caches are lost);
- ``carry``: drain + the slots saved and restored (``--slot-save-path``, setting ``carry_slots``);
- ``front``: ``install --front haproxy``: new requests held at HAProxy, drain, carry;
- ``switch``: ``install --front haproxy --second-instance``: the live config serves on the
  second instance while the unit restarts (nothing is held), slots carried both ways.

After the three deploys, one more (``--alias``, which the answers name as their model) and a
``rollback`` at once: how long after the rollback began the old config answered again (a
client asks ``/v1/models`` every 20 ms), and how long the rollback command took. In
``switch`` mode the rollback is inside the warm period (the second instance still runs the
old config); in ``front`` it restarts. ``switch`` then does it once more after the warm
period (a held rollback; the turns from then on are not counted in its row).

It prints requests failed or cut, the longest wait for a first token any agent saw, and
each agent's first-turn time to first token after a deploy / its last turn's before it, in
the same conversation. Then the cache carry, per deploy: of the agents whose conversation
went on across the change of server, how many had their next turn served from cache (the
server had cached all of the agent's previous prompt: the usage's ``cached_tokens`` against
the previous turn's ``prompt_tokens``), and each that was not. In ``switch`` mode the change
is each switch (to the second instance, and back: the handover's ``ready_at``, when HAProxy
sent new requests to the other server); in the others, the deploy's end. Not a test:
nothing here asserts.

``BENCH_LOAD_S=20``: a stand-in for a real box's model load. The tiny model loads in
milliseconds; a real one takes tens of seconds from the page cache and minutes from disk.
The bench then runs llama-server through a wrapper script (written into its temporary folder)
that sleeps that long before it execs the real binary, whenever it is started to serve (its
arguments have ``--port``); the binary's probes (``--version``, ``--help``) run at once.

``BENCH_DUMP=PATH``: every turn and deploy of a mode to ``PATH.MODE.json``, and each timed
rollback's result (its timings, its handover) to ``PATH.ALIAS.rollback.json``.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import realserver  # noqa: E402
import tinymodel  # noqa: E402

from launcher.bench import chat  # noqa: E402

UNIT_DIR = Path(os.environ["LLAMA_LAUNCHER_SANDBOX"]) / "units"
AGENTS = 4
# the tiny vocabulary spells a word byte by byte: about 7.5 tokens a word
SYSTEM_WORDS = 150
TURN_WORDS = 12
REPLY_TOKENS = 16
HISTORY_LIMIT = 2000  # prompt tokens (the server's usage); then a new conversation
THINK = (0.3, 1.2)  # seconds between turns
BETWEEN_DEPLOYS = 6.0
BAD_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == 'Say OK.' %}"
    "{{ raise_exception('this template refuses the probe') }}{% endif %}"
    "{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PLAIN = [w for w in tinymodel.WORDS if not w.startswith("<|")]
#: seconds the stand-in's load takes (0: the real binary, the tiny model's milliseconds)
LOAD_S = float(os.environ.get("BENCH_LOAD_S", "0"))


@dataclass
class Turn:
    agent: int
    conversation: int
    start: float
    ttft: float | None = None
    end: float | None = None
    status: int | None = None
    complete: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Deploy:
    args: list[str]
    start: float
    end: float = 0.0
    outcome: str = ""
    handover: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return " ".join(Path(a).name if "/" in a else a for a in self.args)

    def changes(self) -> list[tuple[str, float]]:
        """When the front sent new requests to another server (``time.monotonic``): each
        switch, or else the deploy's end."""
        sw = self.handover.get("switch") or {}
        wall = [("to b", sw.get("ready_at")), ("back", (sw.get("back") or {}).get("ready_at"))]
        found = [(what, at - WALL) for what, at in wall if at is not None]
        return found or [("after", self.end)]


#: time.time() - time.monotonic(): the handover's wall times on the turns' clock
WALL = time.time() - time.monotonic()


class Agent(threading.Thread):
    def __init__(self, n: int, url: str, stop: threading.Event, turns: list[Turn]) -> None:
        super().__init__(daemon=True)
        self.n, self.url, self.stop, self.turns = n, url, stop, turns
        self.rng = random.Random(n)
        self.conversation = 0
        self.messages: list[dict[str, str]] = []
        self.tokens = 0

    def words(self, k: int) -> str:
        return " ".join(self.rng.choice(PLAIN) for _ in range(k))

    def new_conversation(self) -> None:
        self.conversation += 1
        self.messages = [{"role": "system", "content": self.words(SYSTEM_WORDS)}]
        self.tokens = 0

    def run(self) -> None:
        self.new_conversation()
        pending = False
        with httpx.Client(timeout=httpx.Timeout(120, connect=120)) as client:
            while not self.stop.is_set():
                if self.tokens > HISTORY_LIMIT and not pending:
                    self.new_conversation()
                if not pending:
                    self.messages.append({"role": "user", "content": self.words(TURN_WORDS)})
                turn = Turn(self.n, self.conversation, time.monotonic())
                self.turns.append(turn)
                reply = self.turn(client, turn)
                # a failed turn is sent again after the think time, like an agent retrying
                pending = not turn.complete
                if turn.complete:
                    self.messages.append({"role": "assistant", "content": reply})
                self.stop.wait(self.rng.uniform(*THINK))

    def turn(self, client: httpx.Client, turn: Turn) -> str:
        body = {
            "messages": self.messages,
            "max_tokens": REPLY_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
        }
        answer = chat.stream_chat(client, body, url=self.url + chat.CHAT_PATH)
        turn.status = answer.status
        turn.ttft = answer.first_chunk_s
        turn.complete = answer.done and answer.finish_reason is not None
        if answer.usage is not None:
            self.tokens = answer.usage.total_tokens or self.tokens
            turn.prompt_tokens = answer.usage.prompt_tokens
            turn.cached_tokens = answer.usage.cached_tokens or 0
        if answer.cut is not None:
            turn.error = type(answer.cut).__name__
        elif answer.malformed is not None:
            turn.error = "ValueError"
        turn.end = turn.start + answer.elapsed_s
        return answer.text


def cli(env: dict[str, str], *args: str) -> dict[str, Any]:
    p = subprocess.run(
        ["llama-launcher", *args, "--json"], capture_output=True, text=True, env=env, timeout=600
    )
    try:
        return dict(json.loads(p.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise RuntimeError(f"{args}: rc {p.returncode}\n{p.stdout}\n{p.stderr}") from None


def run_mode(mode: str, tmp: Path, model: Path, server: str) -> dict[str, Any]:
    port = realserver.free_port()
    unit = f"bench-disruption-{mode}.service"
    env = dict(
        os.environ,
        LLAMA_LAUNCHER_UNIT=unit,
        LLAMA_LAUNCHER_SCOPE="user",
        LLAMA_LAUNCHER_ENV_FILE=str(tmp / mode / "etc/llama.env"),
        LLAMA_LAUNCHER_STATE_DIR=str(tmp / mode / "state"),
        LLAMA_LAUNCHER_UNIT_DIR=str(UNIT_DIR),
    )
    # drain: no --slot-save-path, the caches are lost
    env["LLAMA_LAUNCHER_CARRY_SLOTS"] = "false" if mode == "drain" else "true"
    flags = ["-m", str(model), "--port", str(port), "--llama-server", server]
    flags += ["-c", "16384", "-np", str(AGENTS), "-t", "1"]
    fronted = {
        "front": ["--front", "haproxy"],
        "switch": ["--front", "haproxy", "--second-instance"],
    }
    out = cli(env, "install", *flags, *fronted.get(mode, []))
    assert out["outcome"] == "deployed", out
    extra = ["--no-drain"] if mode == "bare" else []
    bad = tmp / mode / "bad.jinja"
    bad.write_text(BAD_TEMPLATE)
    changes = [["set", "-t", "2"], ["set", "-t", "1"], ["set", "--chat-template-file", str(bad)]]
    url = f"http://127.0.0.1:{port}"
    turns: list[Turn] = []
    stop = threading.Event()
    agents = [Agent(i, url, stop, turns) for i in range(AGENTS)]
    for a in agents:
        a.start()
    deploys = []
    cutoff = float("inf")
    try:
        time.sleep(BETWEEN_DEPLOYS * 1.5)  # every agent's conversation has grown a while
        for change in changes:
            d = Deploy(change, time.monotonic())
            result = cli(env, *change, *extra)
            d.end, d.outcome = time.monotonic(), str(result.get("outcome"))
            d.handover = result.get("handover") or {}
            deploys.append(d)
            time.sleep(BETWEEN_DEPLOYS)
        rollback = timed_rollback(env, url, extra)
        cutoff = time.monotonic()
        if mode == "switch":  # and outside the warm period: the rollback holds (its turns
            # are not counted above: the row is the switch's)
            late = timed_rollback({**env, "LLAMA_LAUNCHER_KEEP_WARM": "1"}, url, extra, unit)
            rollback.update({f"late_{k}": v for k, v in late.items()})
    finally:
        stop.set()
        for a in agents:
            a.join(180)
        cli(env, "uninstall", "--purge")
    counted = [t for t in turns if t.start < cutoff]
    return {**summarize(mode, counted, deploys), **rollback}


def timed_rollback(
    env: dict[str, str], url: str, extra: list[str], cooled: str | None = None
) -> dict[str, Any]:
    """A deploy that renames the model (``--alias``), then ``rollback``: seconds from the
    rollback's start until ``/v1/models`` names the old model again, and until the command
    returned. ``cooled``: the unit whose second instance is waited for to stop first (its
    warm period over)."""
    new = "bench-after" if cooled is None else "bench-after-late"
    out = cli(env, "set", "--alias", new, *extra)
    assert out["outcome"] == "deployed", out
    time.sleep(BETWEEN_DEPLOYS / 2)
    if cooled is not None:
        second = cooled.removesuffix(".service") + "-b.service"
        deadline = time.monotonic() + 60
        while (
            time.monotonic() < deadline
            and subprocess.run(
                ["systemctl", "--user", "is-active", "--quiet", second], check=False
            ).returncode
            == 0
        ):
            time.sleep(0.2)
    served: list[float] = []
    done = threading.Event()

    def watch(t0: float) -> None:
        with httpx.Client(timeout=5) as c:
            while not done.is_set():
                try:
                    ids = [m.get("id") for m in c.get(url + "/v1/models").json()["data"]]
                except (httpx.HTTPError, ValueError, KeyError):
                    ids = []
                if ids and new not in ids:
                    served.append(time.monotonic() - t0)
                    return
                time.sleep(0.02)

    t0 = time.monotonic()
    w = threading.Thread(target=watch, args=(t0,), daemon=True)
    w.start()
    back = cli(env, "rollback", *extra)
    took = time.monotonic() - t0
    w.join(30)
    done.set()
    mode = (back.get("handover") or {}).get("mode", "hold")
    if os.environ.get("BENCH_DUMP"):  # the rollback's own result, its timings with it
        with open(os.environ["BENCH_DUMP"] + f".{new}.rollback.json", "w") as f:
            json.dump({"serves_s": served[0] if served else None, "result": back}, f)
    return {
        "rollback_serves_s": served[0] if served else None,
        "rollback_s": took,
        "rollback": f"{back.get('outcome')} ({mode})",
    }


def summarize(mode: str, turns: list[Turn], deploys: list[Deploy]) -> dict[str, Any]:
    cut = [t for t in turns if t.ttft is not None and not t.complete]
    first = min(d.start for d in deploys) if deploys else float("inf")
    normal = [(t.end or 0) - t.start for t in turns if t.complete and (t.end or 0) < first]
    refused = [t for t in turns if t.ttft is None and not t.complete]
    waits = [t.ttft if t.ttft is not None else (t.end or 0) - t.start for t in turns]
    ratios, shares = [], []
    for d in deploys:
        for agent in range(AGENTS):
            mine = [t for t in turns if t.agent == agent and t.complete and t.ttft is not None]
            after = [t for t in mine if t.start > d.end][:1]
            # before: the agent's last three turns in the same conversation (a conversation's
            # first turn has nothing cached, with or without a deploy)
            before = [
                t.ttft
                for t in mine
                if (t.end or 0) < d.start and after and t.conversation == after[0].conversation
            ][-3:]
            if before and after and after[0].ttft:
                ratios.append(after[0].ttft / statistics.median(before))
                shares.append(after[0].cached_tokens / max(after[0].prompt_tokens, 1))
    if os.environ.get("BENCH_DUMP"):
        with open(os.environ["BENCH_DUMP"] + f".{mode}.json", "w") as f:
            json.dump(
                {
                    "turns": [t.__dict__ for t in turns],
                    "deploys": [d.__dict__ for d in deploys],
                },
                f,
                default=str,
            )
    restored = sum(len((d.handover.get("slots") or {}).get("restored", [])) for d in deploys)
    return {
        "carry": [{"deploy": d.name, "changes": carried(turns, d)} for d in deploys],
        "mode": mode,
        "requests": len(turns),
        "failed": len(refused),
        "cut": len(cut),
        "longest_wait_s": max(waits) if waits else 0.0,
        "normal_turn_s": statistics.median(normal) if normal else None,
        "ttft_ratio_median": statistics.median(ratios) if ratios else None,
        "ttft_ratio_max": max(ratios) if ratios else None,
        "ratios": len(ratios),
        "cached_share_after": statistics.median(shares) if shares else None,
        "outcomes": [d.outcome for d in deploys],
        "deploy_s": [round(d.end - d.start, 1) for d in deploys],
        "slots_restored": restored,
    }


def carried(turns: list[Turn], d: Deploy) -> list[dict[str, Any]]:
    """Per change of server in deploy ``d``: each agent's first turn after it, in the
    conversation of its last turn begun before it; from cache when the server had cached
    all of that last turn's prompt."""
    out = []
    for what, at in d.changes():
        row: dict[str, Any] = {"at": what, "agents": 0, "cached": 0, "new": 0, "missed": []}
        for agent in range(AGENTS):
            mine = [t for t in turns if t.agent == agent]
            last = [t for t in mine if t.start < at][-1:]
            after = [t for t in mine if t.start >= at and t.complete][:1]
            if not last or not after or not last[0].complete:
                continue
            if after[0].conversation != last[0].conversation:
                row["new"] += 1
                continue
            row["agents"] += 1
            if after[0].cached_tokens >= last[0].prompt_tokens:
                row["cached"] += 1
            else:
                row["missed"].append(
                    {
                        "agent": agent,
                        "prompt": after[0].prompt_tokens,
                        "cached": after[0].cached_tokens,
                        "before": last[0].prompt_tokens,
                    }
                )
        out.append(row)
    return out


def slow_loader(tmp: Path, server: str, seconds: float) -> str:
    """A llama-server whose start to serve takes ``seconds`` longer (``BENCH_LOAD_S``)."""
    path = tmp / "slow-llama-server"
    path.write_text(
        "#!/bin/sh\n"
        "# a stand-in for a real model load (scripts/disruption.py, BENCH_LOAD_S)\n"
        f'case " $* " in *" --port "*) sleep {seconds:g} ;; esac\n'
        f'exec {shlex.quote(server)} "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


def main() -> None:
    modes = sys.argv[1:] or ["bare", "drain", "carry", "front", "switch"]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = tinymodel.write(tmp / "tiny.gguf")
        server = realserver.server_binary()
        if LOAD_S:
            server = slow_loader(tmp, server, LOAD_S)
        rows = [run_mode(m, tmp, model, server) for m in modes]
    print(
        f"{AGENTS} agents, streamed multi-turn chats growing to ~{HISTORY_LIMIT} tokens, "
        f"think {THINK[0]}-{THINK[1]} s; deploys: -t 2, -t 1, a template refusing the probe "
        "(rolls back); the tiny model, -c 16384 -np 4 -t 1, on this machine"
        + (f", each start to serve {LOAD_S:g} s longer (BENCH_LOAD_S):" if LOAD_S else ":")
    )
    print(
        f"{'mode':6} {'requests':>8} {'failed':>6} {'cut':>4} {'longest wait s':>14} "
        f"{'TTFT after/before':>18} {'(max)':>7} {'cached after':>12}  "
        "outcomes; deploy s; slots restored"
    )
    for r in rows:
        med = f"{r['ttft_ratio_median']:.2f}" if r["ttft_ratio_median"] is not None else "-"
        mx = f"{r['ttft_ratio_max']:.2f}" if r["ttft_ratio_max"] is not None else "-"
        share = f"{r['cached_share_after']:.0%}" if r["cached_share_after"] is not None else "-"
        print(
            f"{r['mode']:6} {r['requests']:8d} {r['failed']:6d} {r['cut']:4d} "
            f"{r['longest_wait_s']:14.2f} {med:>18} {mx:>7} {share:>12}  "
            f"{'/'.join(r['outcomes'])}; {r['deploy_s']}; {r['slots_restored']}"
        )
    print(
        f"{'mode':6} {'normal turn s':>13} {'rollback: old config serves after s':>36} "
        f"{'command s':>10}  outcome"
    )
    for r in rows:
        normal = f"{r['normal_turn_s']:.2f}" if r["normal_turn_s"] is not None else "-"
        for late in ("", "late_"):
            if f"{late}rollback" not in r:
                continue
            serves = r[f"{late}rollback_serves_s"]
            print(
                f"{'' if late else r['mode']:6} {'' if late else normal:>13} "
                f"{(f'{serves:.2f}' if serves is not None else '-'):>36} "
                f"{r[f'{late}rollback_s']:10.2f}  {r[f'{late}rollback']}"
                + (" after the warm period" if late else "")
            )
    print(
        "cache carry per deploy: of the agents whose conversation went on, how many had their "
        "next turn after the change of server served from cache"
    )
    for r in rows:
        for c in r["carry"]:
            parts = []
            for ch in c["changes"]:
                line = f"{ch['at']} {ch['cached']}/{ch['agents']}"
                line += "".join(
                    f"; agent {m['agent']} cached {m['cached']} of {m['prompt']} "
                    f"(its last prompt {m['before']})"
                    for m in ch["missed"]
                )
                parts.append(line + (f" ({ch['new']} began anew)" if ch["new"] else ""))
            print(f"{r['mode']:6} {c['deploy'][:40]:40}  {', '.join(parts)}")
    print(
        "TTFT after/before: each agent's first turn after a deploy / the median of its last "
        "three turns before it, in the same conversation (median and max over agents and "
        "deploys); cached after: the share of that turn's prompt the server had cached; "
        "normal turn: the median turn, first request to last token, before the first deploy"
    )
    print(
        "goals: front and switch 0 failed or cut; carry TTFT after/before <= 1.3; switch: "
        "longest wait <= a normal turn + 0.5 s, rollback serves under 1 s, every agent whose "
        f"conversation went on served from cache ({date.today()})"
    )
    if "--json" in os.environ.get("BENCH_FLAGS", ""):
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
