"""Admission as a unit's users meet it (issue 42): ``install --front haproxy --admission``
under the sandboxed systemd, llama-server b11434 and Debian's HAProxy 2.6. An over-committed
shared pool passes the guard and says what admission promises; deploys tell the running
front the new pool; ``status`` shows the ledger; a deploy's hold keeps a waiting request
waiting, and it is answered after."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Host
from test_bake_server import until
from test_front_hold import front_of
from test_handover import Stream, installed, slow_host

from launcher.deploy.restart import admission

OVER = ["-c", "1024", "-np", "4", "-kvu", "-t", "1"]


def ledger(host: Host) -> admission.Ledger:
    found = admission.ledger(front_of(host))
    assert found is not None
    return found


def one_runs_one_waits(host: Host) -> tuple[Stream, Stream]:
    """A long generation that holds most of the pool, and a second one waiting for room."""
    first = Stream(host.url, 900)
    first.start()
    assert first.first_chunk.wait(60)
    waiting = Stream(host.url, 200, "I wait for room")
    waiting.start()
    until(lambda: ledger(host).waiting == 1, 60)
    return first, waiting


def test_an_over_committed_pool_is_refused_without_admission(host: Host) -> None:
    rc, out = host.install(*OVER, "--front", "haproxy")
    assert rc == 2, out
    assert "over-committed shared KV pool" in str(out)


def test_with_admission_an_over_committed_pool_is_deployed_and_says_so(host: Host) -> None:
    out = installed(host, *OVER, "--front", "haproxy", "--admission")
    assert (
        "4 slots x 1024 promised, one pool of 1024: the front admits against it; no request "
        "is killed by another's; a request may wait" in out["warnings"]
    )
    assert not any("allow_overcommit" in w for w in out["warnings"])
    assert out["message"].endswith(
        "the front admits against it; no request is killed by another's; a request may wait"
    )
    assert out["planned"]["admitted"] is True
    assert (ledger(host).pool, ledger(host).slot) == (1024, 1024)


def test_a_deploy_tells_the_running_front_the_new_pool(host: Host) -> None:
    installed(host, *OVER, "--front", "haproxy", "--admission")
    rc, out = host.cli_json("set", "-c", "2048")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert (ledger(host).pool, ledger(host).slot) == (2048, 2048)
    assert "LLAMA_ADMIT_POOL 2048" in front_of(host).live_text()  # a restarted HAProxy too


def test_a_split_pool_has_nothing_to_admit_against(host: Host) -> None:
    installed(host, "-c", "2048", "-np", "2", "--front", "haproxy", "--admission")
    assert ledger(host).pool == 0
    host.chat()
    assert ledger(host).admitted == 0


def test_status_shows_the_ledger(host: Host) -> None:
    installed(host, *OVER, "--front", "haproxy", "--admission")
    host.chat()
    rc, out = host.cli_json("status")
    seen: dict[str, Any] = out["front"]["admission"]
    assert (rc, seen["state"], seen["pool"], seen["admitted"]) == (0, "on", 1024, 1), seen
    assert seen["free"] == 1024 and seen["reserved"] == 0
    text = host.cli("status").stdout
    assert "admission: on: pool 1024 cells, 0 reserved by 0 running, 1024 free" in text


def test_admission_without_the_front_is_refused(host: Host) -> None:
    rc, out = host.install(*OVER, "--admission")
    assert rc == 2
    assert "--front haproxy --admission" in str(out)


def test_a_bound_without_admission_is_refused(host: Host) -> None:
    rc, out = host.install(*OVER, "--front", "haproxy", "--admission-queue", "8")
    assert rc == 2
    assert "--admission-queue 8 needs --admission" in str(out)


@pytest.mark.parametrize("handover", [(), ("--second-instance",)], ids=["hold", "switch"])
def test_requests_waiting_through_a_deploy_are_answered_after_it(
    host: Host, handover: tuple[str, ...]
) -> None:
    """A long generation holds most of the pool, a second request waits at the front for
    room, and a deploy begins (the front held, or a switch to the second instance): both
    are answered, and the front then counts on the new server's pool."""
    installed(slow_host(host), *OVER, "--front", "haproxy", "--admission", *handover)
    first, waiting = one_runs_one_waits(host)
    rc, out = host.cli_json("set", "-c", "1536")
    first.join(120)
    waiting.join(120)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert (first.status, first.error, first.done) == (200, None, True)
    assert (waiting.status, waiting.error, waiting.done) == (200, None, True)
    assert (ledger(host).pool, ledger(host).waiting, ledger(host).reserved) == (1536, 0, 0)


def test_top_shows_the_ledger(host: Host) -> None:
    installed(host, *OVER, "--front", "haproxy", "--admission")
    host.chat()
    rc, frame = host.cli_json("top", "--once")
    assert rc == 0
    assert (frame["admission"]["state"], frame["admission"]["admitted"]) == ("on", 1), frame
    assert "admission: on: pool 1024 cells" in host.cli("top", "--once").stdout


def test_a_front_killed_with_requests_waiting_comes_back_admitting(host: Host) -> None:
    """HAProxy killed while one generation runs and one waits: both clients lose their
    connection (a restart's cost, not admission's), systemd starts it again from its config
    on disk, and it admits against the deployed pool from an empty ledger."""
    installed(slow_host(host), *OVER, "--front", "haproxy", "--admission")
    first, waiting = one_runs_one_waits(host)
    service = front_of(host).service
    host.sandbox.systemctl("kill", "--signal=SIGKILL", service)
    first.join(120)
    waiting.join(120)
    assert first.error is not None and waiting.error is not None
    host.chat()  # the socket unit holds the port; the restarted HAProxy answers
    after = ledger(host)
    assert (after.pool, after.admitted, after.reserved) == (1024, 1, 0)
