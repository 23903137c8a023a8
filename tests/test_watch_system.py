"""The live watch in system scope: systemd as PID 1 (scripts/sysbed), as root.

One bed for the module; the unit is installed once (a shared pool of four capped slots) and
the tests run in file order: the sampler's timer enabled beside the unit and its hardened
service run by PID 1, four agents past 90 % of the pool and the warning in the sample
service's journal, ``status`` against ``/slots``, node_exporter reading the metrics file,
deploys while the sampler runs every second, a journal that rotated, and uninstall.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sysbed
from test_watch import ran_once, sampled
from test_watch_record import samples_of

UNIT = "llama-server.service"
SERVICE, TIMER = "llama-server-sample.service", "llama-server-sample.timer"
PORT = 8080
CAP, POOL = 1024, 4096
PROM = "/var/lib/prometheus/node-exporter"
STATE = "/var/lib/llama-launcher/llama-server"
ENV = {
    "LLAMA_LAUNCHER_START_TIMEOUT": "30",
    "LLAMA_LAUNCHER_HEALTH_TIMEOUT": "30",
    "LLAMA_LAUNCHER_LOCK_TIMEOUT": "5",
    "LLAMA_LAUNCHER_SAMPLE_INTERVAL": "3600",
    "LLAMA_LAUNCHER_METRICS_TEXTFILE_DIR": PROM,
}

# Four agents at once inside the bed, each until its slot's cap; then /slots (stdlib only).
_AGENTS = """
import json, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
url, cap = sys.argv[1], int(sys.argv[2])
def post(body):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status
def agent(i):
    return post({"messages": [{"role": "user", "content": f"agent {i} river pool"}],
                 "max_tokens": 2 * cap, "ignore_eos": True, "temperature": 0})
for _ in range(5):
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(agent, range(4)))
    slots = json.load(urllib.request.urlopen(url + "/slots", timeout=30))
    if sum(s.get("n_prompt_tokens", 0) for s in slots) >= 0.9 * 4 * cap:
        break
print(json.dumps(slots))
"""

_GET = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())
"""


class System:
    def __init__(
        self, bed: sysbed.Bed, server: str, model: str, env: dict[str, str] | None = None
    ) -> None:
        self.bed, self.server, self.model = bed, server, model
        self.env = ENV if env is None else env

    def cli_json(self, *args: str, **env: str) -> tuple[int, dict[str, Any]]:
        return self.bed.cli_json(*args, env={**self.env, **env})

    def python(self, code: str, *args: str) -> str:
        p = self.bed.run(str(sysbed.VENV_BIN / "python"), "-c", code, *args)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    def slots(self) -> list[dict[str, Any]]:
        return json.loads(self.python(_GET, f"http://127.0.0.1:{PORT}/slots"))  # type: ignore[no-any-return]

    def sample(self) -> dict[str, Any]:
        return sampled(lambda: self.cli_json("sample"))

    def journal(self, unit: str, *args: str) -> str:
        """The unit's whole journal (the bed is fresh for the module)."""
        return self.bed.run("journalctl", "--no-pager", "-o", "cat", *args, "-u", unit).stdout


@contextmanager
def installed(
    system: type[System],
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    server: str,
    prefix: str,
    *flags: str,
) -> Iterator[Any]:
    """A fresh bed with the unit installed with ``flags`` on the tiny model, its sampler's
    timer run once; ``system``: the test module's System."""
    name = f"{prefix}-{os.getpid()}"
    with sysbed.bed(sysbed.state_folder(tmp_path_factory, name), name) as bed:
        s = system(bed, server, sysbed.share_model(bed, tiny_model))
        where = ["-m", s.model, "--port", str(PORT), "--llama-server", s.server]
        rc, out = s.cli_json("install", *where, *flags)
        assert (rc, out.get("outcome")) == (0, "deployed"), out
        ran_once(s.bed.show, SERVICE)
        yield s


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, llama_server_bin: str
) -> Iterator[System]:
    caps = ["-np", "4", "-kvu", "--kv-unified-per-slot", str(CAP), "-t", "1"]
    with installed(System, tmp_path_factory, tiny_model, llama_server_bin, "llw", *caps) as s:
        yield s


def test_the_timer_is_enabled_and_its_hardened_service_samples_as_root(system: System) -> None:
    assert system.bed.systemctl("is-enabled", TIMER).stdout.strip() == "enabled"
    state = system.bed.show(SERVICE, "Result", "ExecMainStatus", "User", "ProtectSystem")
    want = {"Result": "success", "ExecMainStatus": "0", "User": "", "ProtectSystem": "strict"}
    assert state == want
    # the timer's first sample came while install's deploy ran (it skips those): one more
    assert system.bed.systemctl("start", SERVICE).returncode == 0
    record = json.loads(system.bed.read(f"{STATE}/generations/0001/live.json"))
    assert record["generation"] == 1 and record["first"] is not None


def test_four_agents_past_90_percent_warn_in_the_sample_services_journal(system: System) -> None:
    slots = json.loads(system.python(_AGENTS, f"http://127.0.0.1:{PORT}", str(CAP)))
    held = sum(s.get("n_prompt_tokens", 0) for s in slots)
    assert held >= 0.9 * POOL, f"four agents held only {held} of {POOL}"
    p = system.bed.systemctl("start", SERVICE)  # as the timer starts it
    assert p.returncode == 0, p.stderr
    want = f"KV pool of {UNIT}: pool {round(100 * held / POOL)}%"
    deadline = time.monotonic() + 10
    while want not in (warnings := system.journal(SERVICE, "-p", "warning")):
        assert time.monotonic() < deadline, system.journal(SERVICE)
        time.sleep(0.2)
    for s in slots:
        assert f"{s['id']}: {s['n_prompt_tokens']:,}/{s['n_ctx']:,} idle" in warnings


def test_status_shows_what_slots_says(system: System) -> None:
    slots = system.slots()
    rc, out = system.cli_json("status")
    assert rc == 0, out
    got = [(s["id"], s["tokens"], s["n_ctx"]) for s in out["watch"]["pool"]["slots"]]
    assert got == [(s["id"], s["n_prompt_tokens"], s["n_ctx"]) for s in slots]
    assert out["watch"]["pool"]["pool_cells"] == POOL


def test_node_exporter_reads_the_metrics_file_in_system_scope(system: System) -> None:
    system.sample()
    mode = system.bed.run("stat", "-c", "%a", f"{PROM}/llama_launcher_llama_server.prom")
    assert mode.stdout.strip() == "644"
    p = system.bed.run(
        "systemd-run", "--unit=llw-node-exporter", "/usr/bin/prometheus-node-exporter",
        "--collector.disable-defaults", "--collector.textfile",
        f"--collector.textfile.directory={PROM}", "--web.listen-address=127.0.0.1:9199",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    try:
        page = ""
        for _ in range(100):
            r = system.bed.run(str(sysbed.VENV_BIN / "python"), "-c", _GET,
                               "http://127.0.0.1:9199/metrics")  # fmt: skip
            if r.returncode == 0:
                page = r.stdout
                break
            time.sleep(0.1)
    finally:
        system.bed.systemctl("stop", "llw-node-exporter")
    samples = {(n, tuple(sorted(lab.items()))): v for n, lab, v in samples_of(page)}
    assert samples[("node_textfile_scrape_error", ())] == 0
    unit = ("unit", UNIT)
    for s in system.slots():
        key = ("llama_launcher_slot_tokens", tuple(sorted([("slot", str(s["id"])), unit])))
        assert samples[key] == s["n_prompt_tokens"]
    assert samples[("llama_launcher_kv_pool_tokens", (unit,))] == POOL


def test_deploys_succeed_while_the_sampler_runs_every_second(system: System) -> None:
    flags = ["-m", system.model, "--port", str(PORT), "--llama-server", system.server]
    caps = ["-np", "4", "-kvu", "--kv-unified-per-slot", str(CAP)]
    fast = {"LLAMA_LAUNCHER_SAMPLE_INTERVAL": "1"}
    rc, out = system.cli_json("install", *flags, *caps, "-t", "1", **fast)
    assert rc == 0, out
    try:
        for threads in ("2", "1", "2"):
            rc, out = system.cli_json("set", "-t", threads)
            assert (rc, out["outcome"]) == (0, "deployed"), out
        # the timer's next samples are of the last generation (however slow this machine)
        deadline = time.monotonic() + 120
        while True:
            rc, hist = system.cli_json("history")
            watched = [g["generation"] for g in hist["generations"] if g.get("watched")]
            if (watched and watched[-1] == out["generation"]) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert watched and watched[-1] == out["generation"], (watched, out["generation"])
    finally:
        rc, out = system.cli_json("install", *flags, *caps, "-t", "1")
        assert rc == 0, out


def test_a_sample_after_the_journal_rotated_says_what_may_be_missing(system: System) -> None:
    # the timer's own samples (one a second after the last install) would read on between
    assert system.bed.systemctl("stop", TIMER, SERVICE).returncode == 0
    try:
        system.sample()
        for _ in range(3):
            assert system.bed.chat(PORT)[0] == 200  # lines the next sample has not read
        assert system.bed.run("journalctl", "--rotate").returncode == 0
        assert system.bed.run("journalctl", "--vacuum-files=1").returncode == 0
        out = system.sample()
        assert "the journal no longer holds the last entry read" in out["lost"]
        assert "may be missing" in out["lost"]
        system.bed.chat(PORT)
        again = system.sample()
        assert again["lost"] is None and again["counts"]["requests"] == 1
    finally:
        assert system.bed.systemctl("start", TIMER).returncode == 0


def test_uninstall_removes_the_samplers_units_in_system_scope(system: System) -> None:
    rc, out = system.cli_json("uninstall")
    assert rc == 0, out
    assert f"/etc/systemd/system/{TIMER}" in out["removed_sampler"]
    assert system.bed.show(TIMER, "LoadState")["LoadState"] == "not-found"
