"""The handover around a restart (launcher/deploy/restart/handover.py): drain, slot
save/restore, the HAProxy front. Real parts: the sandboxed systemd, llama-server b11434,
Debian's HAProxy 2.6."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinymodel
from conftest import Host

from launcher.bench import chat
from launcher.deploy.restart import drain
from launcher.deploy.restart.front import Front, FrontSpec
from launcher.server import slotsave

#: A model slow enough that a long generation takes seconds, long past the moment a drain
#: begins: wider and deeper than the tiny default, still random weights.
SLOW = tinymodel.Shape(layers=6, n_embd=256, heads=4, kv_heads=2, ff=768, ctx_train=8192)


def slow_host(host: Host) -> Host:
    host.model = tinymodel.write(host.root / "slow.gguf", SLOW)
    return host


class Stream(threading.Thread):
    """One streamed chat completion read to its end in a thread: what came back."""

    def __init__(self, url: str, max_tokens: int, content: str = "Tell a long story.") -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.content = url, max_tokens, content
        self.first_chunk = threading.Event()
        self.status: int | None = None
        self.chunks = 0
        self.finish: str | None = None
        self.done = False
        self.error: str | None = None

    def run(self) -> None:
        body = {
            "messages": [{"role": "user", "content": self.content}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
        }
        try:
            with httpx.Client(timeout=120) as client:
                answer = chat.stream_chat(
                    client,
                    body,
                    url=self.url + chat.CHAT_PATH,
                    on_chunk=lambda _: self.first_chunk.set(),
                )
            self.status, self.chunks = answer.status, answer.chunks
            self.finish, self.done, self.error = answer.finish_reason, answer.done, answer.failure
        finally:
            self.first_chunk.set()  # a request that failed at once: the waiter reads why


FAULTS = str(Path(__file__).with_name("faults.py"))


def _state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` ('T': stopped by a signal)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rfind(")") + 2]


@contextmanager
def stopped_before_the_drain(host: Host, *args: str) -> Iterator[subprocess.Popen[str]]:
    """The CLI deploying ``args``, stopped (SIGSTOP, tests/faults.py) once it has stored the
    new generation, right before the drain: the block starts what the drain must find, and
    the deploy goes on (SIGCONT) when it ends. The validation, however long it takes on a
    busy machine, is over before the block starts."""
    p = subprocess.Popen(
        [sys.executable, FAULTS, "stored:stop", *args, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=host.env,
    )
    try:
        deadline = time.monotonic() + 120
        while _state(p.pid) != "T":
            assert p.poll() is None and time.monotonic() < deadline, "it never reached the drain"
            time.sleep(0.01)
        yield p
    except BaseException as e:
        p.kill()
        out = err = "(its output not read in 30 s)"
        with contextlib.suppress(subprocess.TimeoutExpired):
            out, err = p.communicate(timeout=30)
        e.add_note(f"the deploy: rc={p.returncode}\n{out}\n{err}")
        raise
    p.send_signal(signal.SIGCONT)


def deploy_in_background(host: Host, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", *args, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=host.env,
    )


def result_of(p: subprocess.Popen[str]) -> tuple[int, dict[str, Any]]:
    out, err = p.communicate(timeout=180)
    try:
        return p.returncode, json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise AssertionError(f"no JSON: rc={p.returncode}\n{out}\n{err}") from None


def installed(host: Host, *flags: str) -> dict[str, Any]:
    rc, out = host.install(*flags)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    return out


def completion(url: str, prompt: str, n_predict: int = 1) -> dict[str, Any]:
    r = httpx.post(
        url + "/completion",
        json={"prompt": prompt, "n_predict": n_predict, "cache_prompt": True},
        timeout=60,
    )
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


#: About 1,600 tokens (the tiny vocabulary spells most words byte by byte).
HISTORY = " ".join(f"the river {i} holds" for i in range(60))


# -- drain ---------------------------------------------------------------------------------


def test_drain_waits_for_a_generation_and_cuts_nothing(host: Host) -> None:
    installed(slow_host(host), "-c", "8192", "-np", "1", "-t", "1")
    with stopped_before_the_drain(host, "set", "-t", "2") as deploy:
        stream = Stream(host.url, 1000)
        stream.start()
        assert stream.first_chunk.wait(30) and stream.error is None
    rc, out = result_of(deploy)
    stream.join(120)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    drained = out["handover"]["drain"]
    assert drained["busy_at_start"] == [0], drained
    assert not drained["timed_out"]
    assert (stream.status, stream.error, stream.done, stream.finish) == (200, None, True, "length")


def test_drain_timeout_restarts_and_names_the_request_it_cut(host: Host) -> None:
    installed(slow_host(host), "-c", "8192", "-np", "1", "-t", "1")
    # a busy llama-server lingers after SIGTERM until systemd's TimeoutStopSec (10 s)
    flags = ("set", "-t", "2", "--drain-timeout", "0.2", "--start-timeout", "120")
    with stopped_before_the_drain(host, *flags) as deploy:
        stream = Stream(host.url, 2000)
        stream.start()
        assert stream.first_chunk.wait(30) and stream.error is None
    rc, out = result_of(deploy)
    stream.join(120)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    drained = out["handover"]["drain"]
    assert drained["timed_out"] is True
    assert [c["slot"] for c in drained["cut"]] == [0]
    assert any("drain timed out" in w for w in out["warnings"])
    assert not (stream.done and stream.finish == "length")  # it was cut
    # whether the busy server lingers after SIGTERM is llama-server's race, not ours: it
    # exited in 0.1 s on one CI run and after 30 s on another; the watch is tested below
    assert out["handover"]["stop"]["exited_after"] is not None, out["handover"]


class Clock:
    """A clock that moves when the test moves it: what the watch says follows from what the
    process did, not from how busy the machine was."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_exit_watch_sees_a_process_that_goes_at_sigterm() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    watch = drain.ExitWatch(proc.pid, Clock())
    proc.terminate()
    proc.wait(5)
    seen = watch.result()
    assert seen == {"old_pid": proc.pid, "exited_after": 0.0, "lingered": False}
    assert drain.linger_warning(seen) is None


def test_the_exit_watch_names_a_process_that_lingers_after_sigterm() -> None:
    proc = subprocess.Popen(
        ["bash", "-c", "trap '' TERM; echo ready; exec sleep 60"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # SIGTERM ignored
    clock = Clock()
    watch = drain.ExitWatch(proc.pid, clock)
    proc.terminate()
    clock.now = drain.ExitWatch.LINGER_SECONDS + 1  # still there: systemd's SIGKILL ends it
    proc.kill()
    proc.wait(5)
    seen = watch.result()
    assert seen == {"old_pid": proc.pid, "exited_after": 2.0, "lingered": True}, seen
    line = drain.linger_warning(seen)
    assert line and f"pid {proc.pid}" in line and "took 2.0s to exit after SIGTERM" in line


def test_no_drain_restarts_at_once_and_says_so(host: Host) -> None:
    installed(host, "-c", "4096", "-np", "2")
    rc, out = host.cli_json("set", "-t", "2", "--no-drain")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert "--no-drain" in out["handover"]["drain"]["skipped"]
    assert out["handover"]["slots"]["saved"] == []


# -- slot caches -----------------------------------------------------------------------------


def test_install_gives_the_server_a_slot_save_path_under_the_state_dir(host: Host) -> None:
    installed(host, "-c", "4096", "-np", "2")
    assert f"--slot-save-path {host.state_dir / 'slots'}" in host.env_file.read_text()


def test_carry_slots_off_renders_no_slot_save_path(host: Host) -> None:
    host.env["LLAMA_LAUNCHER_CARRY_SLOTS"] = "false"
    installed(host, "-c", "4096", "-np", "2")
    assert "--slot-save-path" not in host.env_file.read_text()
    rc, out = host.cli_json("set", "-t", "2")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert "no --slot-save-path" in out["handover"]["slots"]["note"]


def test_a_slot_folder_without_room_saves_nothing_and_says_why(host: Host) -> None:
    folder = host.root / "small-disk"
    folder.mkdir()
    # a 16 MiB filesystem: under the 1 GiB a save leaves free (the test runs in the
    # sandbox's own mount namespace, and so does the server)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)], check=True)
    try:
        installed(host, "-c", "4096", "-np", "2", "--slot-save-path", str(folder))
        assert completion(host.url, "the river holds")["timings"]["prompt_n"] > 0
        rc, out = host.cli_json("set", "-t", "2")
        assert (rc, out["outcome"]) == (0, "deployed"), out
        carried = out["handover"]["slots"]
        assert carried["saved"] == [] and "nothing saved" in carried["note"], carried
        assert str(folder) in carried["note"] and "MiB free" in carried["note"]
        assert any("caches are not carried" in w for w in out["warnings"])
        assert list(folder.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_restored_slot_keeps_its_cached_tokens_across_the_restart(host: Host) -> None:
    installed(host, "-c", "8192", "-np", "2", "-t", "1")
    first = completion(host.url, HISTORY)
    n_prompt = first["timings"]["prompt_n"]
    assert n_prompt > 1000
    rc, out = host.cli_json("set", "-t", "2")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    carried = out["handover"]["slots"]
    assert [s["tokens"] for s in carried["restored"]] == [s["tokens"] for s in carried["saved"]]
    assert max(s["tokens"] for s in carried["restored"]) >= n_prompt
    again = completion(host.url, HISTORY + " and one more turn")
    assert again["timings"]["cache_n"] >= n_prompt - 1
    assert again["timings"]["prompt_n"] < 50
    assert not list((host.state_dir / "slots").iterdir())  # the files are gone


def test_a_new_slot_folder_carries_the_caches_into_it(host: Host) -> None:
    installed(host, "-c", "8192", "-np", "2", "-t", "1")
    n_prompt = completion(host.url, HISTORY)["timings"]["prompt_n"]
    folder = host.root / "other-slots"
    folder.mkdir()
    rc, out = host.cli_json("set", "--slot-save-path", str(folder))
    assert (rc, out["outcome"]) == (0, "deployed"), out
    carried = out["handover"]["slots"]
    assert carried["moved"] == {
        "from": str(host.state_dir / "slots"),
        "to": str(folder),
        "files": len(carried["saved"]),
    }
    assert max(s["tokens"] for s in carried["restored"]) >= n_prompt
    again = completion(host.url, HISTORY + " and one more turn")
    assert again["timings"]["cache_n"] >= n_prompt - 1
    assert not list(folder.iterdir()) and not list((host.state_dir / "slots").iterdir())


def test_the_fingerprint_skips_a_restore_after_a_cache_type_change(host: Host) -> None:
    installed(host, "-c", "8192", "-np", "2")
    completion(host.url, HISTORY)
    rc, out = host.cli_json("set", "-ctk", "q8_0")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    carried = out["handover"]["slots"]
    assert carried["saved"] and carried["restored"] == []
    reasons = {s["reason"] for s in carried["skipped"]}
    assert all("cache_type_k changed (f16 -> q8_0)" in r for r in reasons), reasons
    after = completion(host.url, HISTORY)  # served from an empty slot, no error
    assert after["timings"]["cache_n"] == 0


def test_a_rollback_restores_the_slots_into_the_old_config(host: Host, tmp_path: Path) -> None:
    installed(host, "-c", "8192", "-np", "2")
    n_prompt = completion(host.url, HISTORY)["timings"]["prompt_n"]
    bad = tmp_path / "bad.jinja"
    bad.write_text(
        "{% for m in messages %}{% if m['content'] == 'Say OK.' %}"
        "{{ raise_exception('refuses the probe') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    rc, out = host.cli_json("set", "--chat-template-file", str(bad))
    assert (rc, out["outcome"]) == (3, "rolled_back"), out
    restored = out["handover"]["slots"]["restored"]
    assert max(s["tokens"] for s in restored) >= n_prompt
    assert completion(host.url, HISTORY + " again")["timings"]["cache_n"] >= n_prompt - 1


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"config": {"cache_type_v": "q8_0"}}, "cache_type_v changed (f16 -> q8_0)"),
        ({"planned": {"n_slots": 2, "pool_cells": 8192}}, "n_slots changed (1 -> 2)"),
        ({"model": {"inode": 99}}, "model file changed"),
        ({"llama_server": {"fingerprint": "other"}}, "llama-server build changed"),
        ({"config": {"extra_args": ["--swa-full"]}}, "layout_flags changed ([] -> ['--swa-full'])"),
        ({"config": {"flash_attn": "on"}}, "flash_attn changed (auto -> on)"),
        ({"config": {"kv_unified_per_slot": 2048}}, "kv_unified_per_slot changed (None -> 2048)"),
    ],
)
def test_the_fingerprint_names_what_changed_the_kv_layout(
    change: dict[str, dict[str, Any]], reason: str
) -> None:
    old = {
        "config": {"cache_type_k": None, "cache_type_v": None, "extra_args": []},
        "planned": {"n_slots": 1, "pool_cells": 4096, "n_ctx_slot": 4096, "kv_unified": False},
        "model": {"path": "/m.gguf", "size": 1, "mtime_ns": 2, "inode": 3},
        "llama_server": {"fingerprint": "abc"},
    }
    new = {k: {**v, **change.get(k, {})} for k, v in old.items()}
    assert slotsave.differences(slotsave.fingerprint(old), slotsave.fingerprint(old)) == []
    assert any(
        reason in d
        for d in slotsave.differences(slotsave.fingerprint(old), slotsave.fingerprint(new))
    )


def test_an_adopted_config_has_no_fingerprint_and_is_never_restored() -> None:
    new = {"config": {"port": 1}, "planned": {"n_slots": 1}}
    assert (
        "KV layout is unknown"
        in slotsave.differences(slotsave.fingerprint({"config": {}}), slotsave.fingerprint(new))[0]
    )


# -- the front ---------------------------------------------------------------------------------


def test_the_front_config_is_valid_for_the_real_haproxy(tmp_path: Path) -> None:
    front = Front(tmp_path, "llama-server.service")
    spec = FrontSpec("127.0.0.1", 8080, "127.0.0.1", 18080)
    text = front.render(spec, 4)
    front.validate(text, spec)  # haproxy -c
    assert "server llama 127.0.0.1:18080 maxconn 4" in text


def test_haproxy_refuses_a_broken_front_config_and_says_so(tmp_path: Path) -> None:
    from launcher.deploy.restart.front import FrontError

    front = Front(tmp_path, "llama-server.service")
    spec = FrontSpec("127.0.0.1", 8080, "127.0.0.1", 18080)
    with pytest.raises(FrontError, match="haproxy -c refused"):
        front.validate(front.render(spec, 4).replace("option httpclose", "option httpclosed"), spec)


@pytest.fixture
def fronted(host: Host) -> Iterator[Host]:
    """A host whose front units are removed after the test (the host fixture's teardown)."""
    yield host


def front_stat(host: Host) -> dict[str, str]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)  # a wedged HAProxy fails the test instead of hanging it
        s.connect(str(host.state_dir / "front" / "admin.sock"))
        s.sendall(b"show stat\n")
        text = b""
        while chunk := s.recv(65536):
            text += chunk
    lines = text.decode().splitlines()
    head = lines[0][2:].split(",")
    rows = [dict(zip(head, line.split(","), strict=False)) for line in lines[1:] if line]
    return next(r for r in rows if r["svname"] == "FRONTEND")


def test_held_requests_are_answered_200_after_a_restart_behind_the_front(fronted: Host) -> None:
    host = fronted
    out = installed(slow_host(host), "-c", "8192", "-np", "1", "-t", "1", "--front", "haproxy")
    assert out["handover"]["front"]["public"] == f"127.0.0.1:{host.port}"
    assert f"--port {host.port}" not in host.env_file.read_text()  # llama-server is private
    stream = Stream(host.url, 800)  # keeps the drain waiting while requests arrive
    stream.start()
    assert stream.first_chunk.wait(30) and stream.error is None
    deploy = deploy_in_background(host, "set", "-a", "after-the-deploy")
    deadline = time.monotonic() + 60
    while front_stat(host)["status"] != "PAUSED":
        assert time.monotonic() < deadline and deploy.poll() is None, "the front never held"
        time.sleep(0.01)
    held = [Stream(host.url, 4, content=f"held {i}") for i in range(3)]
    for h in held:
        h.start()
    rc, result = result_of(deploy)
    for t in (stream, *held):
        t.join(60)
    assert (rc, result["outcome"]) == (0, "deployed"), result
    assert result["handover"]["front"]["held_seconds"] > 0
    assert (stream.status, stream.done, stream.finish) == (200, True, "length")
    assert [(h.status, h.error, h.done) for h in held] == [(200, None, True)] * 3
    models = httpx.get(host.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "after-the-deploy"  # answered by the new config


def test_a_rollback_behind_the_front_releases_the_held_requests_to_the_old_config(
    fronted: Host, tmp_path: Path
) -> None:
    host = fronted
    installed(host, "-c", "4096", "-np", "2", "--front", "haproxy")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ raise_exception('refuses every request') }}")
    deploy = deploy_in_background(host, "set", "--chat-template-file", str(bad))
    deadline = time.monotonic() + 60
    while front_stat(host)["status"] != "PAUSED" and deploy.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    held = [Stream(host.url, 4, content=f"held {i}") for i in range(2)]
    for h in held:
        h.start()
    rc, result = result_of(deploy)
    for h in held:
        h.join(60)
    assert (rc, result["outcome"]) == (3, "rolled_back"), result
    assert [(h.status, h.done) for h in held] == [(200, True)] * 2
    assert front_stat(host)["status"] == "OPEN"
