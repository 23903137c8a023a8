"""The gate's slow paths, on the real llama-server in the sandboxed systemd.

A slow load or a slow stop is made by a stand-in: a bash script given as the config's
llama-server that runs a few lines (a sleep, an ignored SIGTERM) and then execs the real
binary. Its flag probes (``--version``, ``--help``, ``--list-devices``) go straight to the
real binary, so validation sees b11434 itself. The unit's ``TimeoutStopSec`` is shortened by a
drop-in, as an operator would set it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import realserver
from conftest import Host


def stand_in(tmp_path: Path, real: str, body: str, name: str = "llama-server") -> str:
    """A llama-server that runs ``body`` (bash) before it execs the real one; ``"$REAL"`` and
    ``"$@"`` are there for a body that runs the server itself."""
    path = tmp_path / name
    path.write_text(
        "#!/bin/bash\n"
        f"REAL={real}\n"
        # only a server run has --port (the unit's argv always does): a flag probe goes on
        'case " $* " in *" --port "*) ;; *) exec "$REAL" "$@" ;; esac\n'
        f"{body}\n"
        'exec "$REAL" "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


def flags(host: Host, server: str, ctx: str = "4096") -> list[str]:
    """The installed config's flags (two slots of 2048), with the llama-server ``server``."""
    return [
        *("-m", str(host.model), "--port", str(host.port), "--llama-server", server),
        *("-c", ctx, "-np", "2"),
    ]


def installed(host: Host, *extra: str) -> dict:  # type: ignore[type-arg]
    rc, out = host.install("-c", "4096", "-np", "2", *extra)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    return out


@pytest.fixture
def drop_in(host: Host) -> Iterator[Callable[[str], None]]:
    """Writes a drop-in for the unit (``UNIT.d/slowpaths.conf``, loaded by a daemon-reload);
    removed after the test."""
    folder = host.sandbox.unit_dir / f"{host.unit}.d"

    def write(text: str) -> None:
        folder.mkdir(exist_ok=True)
        (folder / "slowpaths.conf").write_text("[Service]\n" + text)
        host.sandbox.systemctl("daemon-reload")

    yield write
    shutil.rmtree(folder, ignore_errors=True)


def generation_meta(host: Host, number: int) -> dict:  # type: ignore[type-arg]
    return json.loads((host.state_dir / "generations" / f"{number:04d}" / "meta.json").read_text())


def test_a_load_slower_than_its_budget_rolls_back(host: Host, tmp_path: Path) -> None:
    installed(host)
    slow = stand_in(tmp_path, host.server, "sleep 4")
    rc, out = host.cli_json("deploy", *flags(host, slow), "--start-timeout", "1")
    assert (rc, out.get("outcome")) == (3, "rolled_back"), out
    assert (out["failure"]["phase"], out["failure"]["class"]) == ("startup", "timeout")
    assert "no startup line within 1s" in out["failure"]["message"]
    assert out["rollback"]["ok"] is True
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_a_load_inside_its_budget_is_deployed_and_its_time_recorded(
    host: Host, tmp_path: Path
) -> None:
    installed(host)
    slow = stand_in(tmp_path, host.server, "sleep 2")
    rc, out = host.cli_json("deploy", *flags(host, slow), "--start-timeout", "20")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    load = generation_meta(host, out["generation"])["load"]
    # the stand-in sleeps 2 s after the old server is gone, before the real one starts: the
    # load the next budgets are sized by holds that wait
    assert load["start"] >= 2.0
    # and the stop of the old server is not part of it: the start is counted from the
    # moment the gate saw the old process gone (to the startup line, or to /health 200 when
    # that came first), not from the restart
    gate = out["timings"]
    started = gate.get("startup_line", gate["healthy"])
    assert load["stop"] == gate["stopped"]
    assert load["start"] == pytest.approx(started - gate["stopped"], abs=0.0015)
    assert load["stop_budget"] == 10 + 5  # the unit's TimeoutStopSec=10 and the grace


def test_progress_shows_the_load_against_the_last_measured_one(host: Host, tmp_path: Path) -> None:
    installed(host)
    slow = stand_in(tmp_path, host.server, "sleep 3")
    p = host.cli("deploy", *flags(host, slow, ctx="8192"))
    assert p.returncode == 0, p.stderr
    # stderr is no terminal here: a line every 2 s of a slow wait, with the expected time
    loading = [line for line in p.stderr.splitlines() if line.startswith("[loading")]
    assert loading and all(" of ~" in line for line in loading), p.stderr


def test_a_rollback_after_a_slow_stop_lands(
    host: Host, tmp_path: Path, drop_in: Callable[[str], None]
) -> None:
    """The issue's case: a server that ignores SIGTERM and never loads, short budgets. The
    rollback's restart waits for systemd's stop (SIGKILL at TimeoutStopSec) before its start
    clock runs, so the old config comes back through its gate."""
    drop_in("TimeoutStopSec=4\n")
    installed(host)
    hung = stand_in(tmp_path, host.server, "trap '' TERM\nsleep 60")
    rc, out = host.cli_json(
        "deploy",
        *flags(host, hung),
        "--start-timeout",
        "2",
        "--health-timeout",
        "2",
    )
    assert (rc, out.get("outcome")) == (3, "rolled_back"), out
    assert out["rollback"]["ok"] is True, out["rollback"]
    # the stop of the hung process took systemd's TimeoutStopSec, longer than the start budget
    assert out["rollback"]["timings"]["stopped"] > 2
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_rollback_gets_the_budget_its_own_generation_needed(host: Host, tmp_path: Path) -> None:
    """Generation 1 takes 2 s to load; a rollback to it given 1 s still waits what it needs."""
    slow = stand_in(tmp_path, host.server, "sleep 2")
    rc, out = host.cli_json("install", *flags(host, slow))
    assert (rc, out["outcome"]) == (0, "deployed"), out
    rc, out = host.cli_json("set", "-ctk", "q8_0")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    rc, out = host.cli_json("rollback", "--start-timeout", "1")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert "q8_0" not in host.env_file.read_text()


def test_a_spawn_failure_is_restarted_once_and_then_serves(
    host: Host, drop_in: Callable[[str], None]
) -> None:
    """systemd cannot load a credential whose file is missing (status 243/CREDENTIALS) - not
    the config's fault; the unit's ExecStopPost creates the file, so the one restart that
    follows spawns."""
    cred = host.root / "respawn.cred"
    drop_in(f"LoadCredential=respawn:{cred}\nExecStopPost=+/bin/touch {cred}\n")
    out = installed(host)
    assert any("failed to spawn the service (status 243" in w for w in out["warnings"]), out
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_settle_seconds_catch_a_server_that_dies_after_its_first_answers(
    host: Host, tmp_path: Path
) -> None:
    installed(host)
    # healthy and answering at once, gone 3 s after it started
    dies = stand_in(tmp_path, host.server, '"$REAL" "$@" &\nsleep 3\nexit 1')
    rc, out = host.cli_json(
        "deploy",
        *flags(host, dies),
        env={"LLAMA_LAUNCHER_SETTLE_SECONDS": "8"},
    )
    assert (rc, out.get("outcome")) == (3, "rolled_back"), out
    assert "exited" in out["failure"]["message"]
    assert out["rollback"]["ok"] is True
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_props_that_differ_from_the_plan_roll_back(host: Host, tmp_path: Path) -> None:
    """The probe asks the base URL; one that reaches another server (a wrong proxy target)
    shows its /props, which do not match the plan, though the unit's startup line does. The
    other server has the old config's layout, so the rollback's gate passes."""
    installed(host)
    with realserver.run_server(host.model, ["-c", "4096", "-np", "2"]) as other:
        rc, out = host.cli_json(
            "deploy",
            *flags(host, host.server, ctx="8192"),
            env={"LLAMA_LAUNCHER_BASE_URL": other.url},
        )
    assert (rc, out.get("outcome")) == (3, "rolled_back"), out
    assert out["failure"]["class"] == "gate_mismatch"
    said = "/props says total_slots = 2, n_ctx = 2048; planned 2 and 4096"
    assert said in out["failure"]["message"]
    assert out["rollback"]["ok"] is True
