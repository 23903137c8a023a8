"""The bake in system scope: systemd as PID 1 (scripts/sysbed), as root, the sampler's
hardened service started by its own timer carrying the bake.

One bed for the module; the unit is installed once and the tests run in file order, each
with a bake of its own (a later deploy ends the one before): a hard failure reverted by the
timer's own sampler (not ``--wait``: the revert writes the env file, the lock and the client
window from inside the sample service's sandbox), a sampler killed mid-bake that the next
timer run resumes and says so, one killed and away past the deadline that ends
``inconclusive`` and says so, and a reboot mid-bake after which the bake resumes with a
note and the boot's restart is not held against the config.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sysbed
import test_watch_system

UNIT = "llama-server.service"
SERVICE, TIMER = "llama-server-sample.service", "llama-server-sample.timer"
PORT = 8080
STATE = "/var/lib/llama-launcher/llama-server"
ENV_FILE = "/etc/llama-launcher/llama-server.env"
WINDOW = "/var/lib/llama-launcher/llama-server.client-window.json"
#: The timer's own samples an hour apart, but for the one it starts when it is (re)started
#: (OnActiveSec=1s); a bake's samples every 2 s with no warm-up (the deploy records them in
#: the bake: the sample service reads no settings). Timeouts for a CPU the lead saturates.
ENV = {
    "LLAMA_LAUNCHER_START_TIMEOUT": "120",
    "LLAMA_LAUNCHER_HEALTH_TIMEOUT": "120",
    "LLAMA_LAUNCHER_LOCK_TIMEOUT": "30",
    "LLAMA_LAUNCHER_SAMPLE_INTERVAL": "3600",
    "LLAMA_LAUNCHER_BAKE_INTERVAL": "2",
    "LLAMA_LAUNCHER_BAKE_WARMUP": "0",
}
#: A sampler away this long is away for the bake (bake_unread_limit 4 x bake_interval 2 s).
AWAY = 12
FINAL = ("passed", "inconclusive", "reverted", "revert_failed", "ended")


class System(test_watch_system.System):
    """The bed of test_watch_system, with this module's settings and the bake's helpers."""

    def __init__(self, bed: sysbed.Bed, server: str, model: str) -> None:
        super().__init__(bed, server, model, ENV)

    def bake(self, generation: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.bed.read(f"{STATE}/generations/{generation:04d}/bake.json"))  # type: ignore[no-any-return]
        except (FileNotFoundError, ValueError):
            return None

    def live(self) -> int:
        return int(self.bed.read(f"{STATE}/live").strip())

    def baking(self, *flags: str) -> int:
        """``set FLAGS --bake ...`` (no --wait), and the timer's sample carrying the bake
        once it sampled it: the new generation."""
        rc, out = self.cli_json("set", *flags)
        assert (rc, out.get("outcome")) == (0, "deployed"), out
        assert out["bake"]["started"]["state"] == "baking", out
        baked = int(out["generation"])
        self.timer_runs_a_sample()
        until(lambda: (self.bake(baked) or {}).get("progress", {}).get("samples"), "a sample")
        return baked

    def timer_runs_a_sample(self) -> None:
        """The timer started again: its OnActiveSec=1s starts the sample service, as every
        interval does."""
        self.stop_sampler()
        p = self.bed.systemctl("restart", TIMER)
        assert p.returncode == 0, p.stderr

    def sampler_running(self) -> bool:
        return self.bed.show(SERVICE, "ActiveState")["ActiveState"] in ("activating", "active")

    def stop_sampler(self) -> None:
        self.bed.systemctl("stop", SERVICE)

    def kill_sampler(self) -> None:
        p = self.bed.systemctl("kill", "--signal=SIGKILL", SERVICE)
        assert p.returncode == 0, p.stderr
        until(lambda: not self.sampler_running(), "the killed sampler to end")


def until(ok: Callable[[], Any], what: str, timeout: float = 300) -> Any:
    """``ok()`` once it is true; bounded generously (a saturated CPU), never a measurement."""
    deadline = time.monotonic() + timeout
    while not (got := ok()):
        assert time.monotonic() < deadline, f"waited {timeout:g}s for {what}"
        time.sleep(0.5)
    return got


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, llama_server_bin: str
) -> Iterator[System]:
    flags = ("-np", "2", "-c", "2048", "-t", "1")
    with test_watch_system.installed(
        System, tmp_path_factory, tiny_model, llama_server_bin, "llb", *flags
    ) as s:
        yield s


def test_a_hard_failure_is_reverted_by_the_timers_own_sampler(system: System) -> None:
    """The baked generation's server crashes (SIGKILL; Restart=on-failure starts it again):
    the sample the timer started finds the restart and reverts from inside its sandbox."""
    before = system.live()
    good_env = system.bed.read(ENV_FILE)
    baked = system.baking("-t", "2", "--bake", "10m")
    assert system.bed.read(ENV_FILE) != good_env
    p = system.bed.systemctl("kill", "--signal=SIGKILL", UNIT)
    assert p.returncode == 0, p.stderr
    ended = until(
        lambda: (b := system.bake(baked)) and b["state"] in FINAL and b, "the bake's verdict"
    )
    assert ended["state"] == "reverted", json.dumps(ended)[-3000:]
    assert ended["verdict"]["hard"] is True
    assert ended["verdict"]["signal"] in ("restart", "down"), ended["verdict"]
    assert ended["revert"]["outcome"] == "reverted", ended["revert"]
    now = system.live()
    assert now == ended["revert"]["generation"] and now > baked
    meta = json.loads(system.bed.read(f"{STATE}/generations/{now:04d}/meta.json"))
    assert meta["reverted_from"] == baked
    # what the revert wrote outside the state folder: the env file, the client window
    assert system.bed.read(ENV_FILE) == good_env
    assert json.loads(system.bed.read(WINDOW))["generation"] == now
    assert f"bake of generation {baked}: reverted" in system.bed.journal(SERVICE)
    until(lambda: system.bed.chat(PORT)[0] == 200, "the old config serving")
    assert before != now  # a new generation, the old config's


def test_a_sampler_killed_mid_bake_is_resumed_by_the_next_timer_run_which_says_so(
    system: System,
) -> None:
    baked = system.baking("-t", "2", "--bake", "10m")
    system.kill_sampler()
    time.sleep(AWAY)  # away for longer than the bake allows without a note
    system.timer_runs_a_sample()

    def resumed() -> dict[str, Any] | None:
        b = system.bake(baked)
        notes = " ".join((b or {}).get("progress", {}).get("notes", []))
        return b if b and "the sampler did not run for" in notes else None

    b = until(resumed, "the resumed bake's note")
    assert b["state"] == "baking" and system.live() == baked, b
    assert system.sampler_running()  # it carries the bake again
    system.stop_sampler()


def test_a_sampler_killed_and_away_past_the_deadline_ends_inconclusive_and_says_so(
    system: System,
) -> None:
    # a bake long enough for its first sample, in the bed's time, to come before its end
    baked = system.baking("-t", "1", "--bake", "20s")
    system.kill_sampler()
    first = system.bake(baked)
    assert first is not None and first["state"] == "baking", first
    wait = max(first["deadline"] - time.time(), 0) + AWAY
    time.sleep(wait)  # the deadline passes while no sampler runs
    system.timer_runs_a_sample()
    b = until(lambda: (b := system.bake(baked)) and b["state"] in FINAL and b, "the verdict")
    assert (b["state"], b["verdict"]["signal"]) == ("inconclusive", "gap"), b["verdict"]
    assert "the sampler did not run for" in b["verdict"]["reason"]
    assert system.live() == baked  # the new config stays


def test_a_reboot_mid_bake_resumes_the_bake_with_a_note_and_does_not_hold_it_against_it(
    system: System,
) -> None:
    baked = system.baking("-t", "2", "--bake", "10m")
    boot = system.bake(baked)["boot_id"]  # type: ignore[index]
    system.bed.reboot()
    # the enabled timer's first run after the boot carries the bake on

    def rebooted() -> dict[str, Any] | None:
        b = system.bake(baked)
        notes = " ".join((b or {}).get("progress", {}).get("notes", []))
        return b if b and "the host rebooted" in notes else None

    b = until(rebooted, "the bake's note of the reboot")
    assert b["state"] == "baking", json.dumps(b)[-4000:]
    assert b["boot_id"] != boot
    assert system.live() == baked
    assert system.bed.chat(PORT)[0] == 200
    system.stop_sampler()
    b = system.bake(baked)
    assert b is not None and b["state"] == "baking", b  # nothing was held against it
