"""Memory truth: the estimate in every generation, the guard, and measured vs estimated."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import Host

MiB = 1 << 20


def test_memory_guard_refuses_what_the_box_cannot_hold(host: Host) -> None:
    rc, out = host.install("-c", "4096", "-np", "2")
    assert rc == 0, out
    # 2 layers x (K 2x32 + V 2x32) x 2 bytes = 512 B per cell at f16: 64 Mi cells = 32 GiB
    rc, out = host.cli_json("set", "--check", "-c", str(64 << 20), "-np", "1")
    assert rc == 2
    assert out["error"] == "MemoryGuardError"
    assert "KV 32,768" in out["message"] and "-ctk q8_0 -ctv q8_0" in out["message"]
    assert "--force-memory" in out["message"]
    rc, out = host.cli_json("set", "--check", "--force-memory", "-c", str(64 << 20), "-np", "1")
    assert (rc, out["outcome"]) == (0, "checked")


def test_generation_records_estimate_and_measurement(host: Host) -> None:
    rc, out = host.install("-c", "4096", "-np", "2")
    assert rc == 0, out
    assert out["memory"]["estimate"]["kv_bytes"] == 4096 * 512
    assert out["memory"]["after"] > 0
    rc, status = host.cli_json("status")
    assert status["kv_estimate"]["kv_mib"] == 2.0


def test_measured_delta_matches_the_estimated_delta(host: Host, make_model) -> None:  # type: ignore[no-untyped-def]
    """Two deploys that differ only in pool size: the cgroup's memory moves by the KV delta."""
    # 8 layers x (K 4x64 + V 4x64) x 2 bytes = 8 KiB per cell: KV dominates the compute
    # buffer's per-cell mask (n_ubatch x 2 bytes), unlike with the 512 B/cell tiny model.
    model: Path = make_model(
        "wide.gguf", layers=8, n_embd=256, heads=4, kv_heads=4, ff=512, ctx_train=16384
    )
    host.model = model
    small, big = 4096, 4096 + 8192  # +64 MiB of f16 KV
    rc, out = host.install("-c", str(small), "-np", "1")
    assert rc == 0, out
    rc, out1 = host.cli_json("set", "-c", str(big))
    assert rc == 0, out1
    rc, out2 = host.cli_json("set", "-c", str(small))
    assert rc == 0, out2
    estimated = out1["memory"]["estimate"]["kv_bytes"] - out2["memory"]["estimate"]["kv_bytes"]
    assert estimated == 64 * MiB
    measured = out1["memory"]["after"] - out2["memory"]["after"]
    assert abs(measured - estimated) <= 0.10 * estimated, (measured / MiB, estimated / MiB)
    hist = json.loads(host.cli("history", "--json").stdout)
    assert hist["generations"][1]["kv_estimate"]["kv_bytes"] == 64 * MiB + small * 8192


def test_what_a_restart_releases_is_the_anonymous_memory_only() -> None:
    import os

    from launcher.config.memory import releasable_memory
    from launcher.host.systemd import UnitState

    me = UnitState("active", "running", "success", 0, 0, os.getpid(), None, "x", "loaded")
    status = Path(f"/proc/{os.getpid()}/status").read_text()
    kib = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if "kB" in line}
    anon = releasable_memory(me)
    assert 0 < anon <= kib["VmRSS"] * 1024
    assert abs(anon - kib["RssAnon"] * 1024) < 64 << 20  # read moments apart
    assert releasable_memory(UnitState("inactive", "dead", "", 0, 0, 0, None, "", "")) == 0
