"""Rollback puts back the bytes that served, and every fault is a true outcome.

Sandboxed systemd, the real llama-server (b11434) and the tiny model. The read-only cases
are real read-only bind mounts, made inside the sandbox's mount namespace the tests run in
(scripts/sandbox: ``nsenter -m``), and unmounted afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Host, taken_at_restart

from launcher.host import timer


def installed(host: Host, *flags: str) -> dict:  # type: ignore[type-arg]
    rc, out = host.install("-c", "4096", "-np", "2", *flags)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    return out


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """``folder`` as a read-only bind mount of itself (EROFS for every write, root's too)."""
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_rollback_to_an_adopted_hand_edit_puts_its_bytes_back(host: Host) -> None:
    installed(host)
    edited = host.env_file.read_text().replace("-c 4096", "-c 8192") + "# tuned by hand\n"
    host.env_file.write_text(edited)
    rc, out = host.cli_json("set", "-ctk", "q8_0")  # keeps the hand edit as generation 2
    assert (rc, out["generation"], out["previous_generation"]) == (0, 3, 2), out
    rc, hist = host.cli_json("history")
    adopted = hist["generations"][1]
    assert adopted["outcome"] == "adopted"
    assert adopted["argv"][adopted["argv"].index("-c") + 1] == "8192"  # read from its bytes
    rc, out = host.cli_json("rollback", "--to", "2")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert host.env_file.read_bytes() == edited.encode()  # the bytes, comment included
    assert out["startup"]["n_ctx_slot"] == 4096
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_a_generation_deployed_with_force_memory_can_be_rolled_back_to(host: Host) -> None:
    installed(host)
    # the guard counts the prompt cache limit (-cram MiB) in full: 40000 MiB do not fit this
    # box, but llama-server allocates the cache only as prompts fill it, so it serves
    rc, out = host.cli_json("set", "-cram", "40000")
    assert (rc, out["error"]) == (2, "MemoryGuardError"), out
    rc, out = host.cli_json("set", "--force-memory", "-cram", "40000")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    forced = host.env_file.read_bytes()
    assert host.cli_json("set", "-cram", "0")[0] == 0
    rc, out = host.cli_json("rollback", "--to", "2")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert host.env_file.read_bytes() == forced
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_plain_rollback_of_a_live_config_failing_from_outside_goes_to_the_one_before(
    host: Host, tmp_path: Path
) -> None:
    installed(host)
    first = host.env_file.read_bytes()
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert host.cli_json("set", "--chat-template-file", str(template))[0] == 0
    template.unlink()  # an outside cause: the live config now fails at every start
    host.sandbox.systemctl("restart", host.unit, check=False)
    rc, out = host.cli_json("rollback")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert host.env_file.read_bytes() == first  # generation 1, not the failing 2 again
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_a_read_only_state_dir_is_a_clear_error_in_json(host: Host) -> None:
    installed(host)
    before, pid = host.env_file.read_bytes(), host.state()["MainPID"]
    with read_only(host.state_dir):
        p = host.cli("set", "-c", "8192", "--json")
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["error"] == "StoreError"
    assert str(host.state_dir) in out["message"]
    assert "Read-only file system" in out["message"] and "--state-dir" in out["message"]
    assert host.env_file.read_bytes() == before
    assert host.state()["MainPID"] == pid


def test_a_read_only_env_folder_swaps_nothing_and_restarts_nothing(host: Host) -> None:
    installed(host)
    before, pid = host.env_file.read_bytes(), host.state()["MainPID"]
    with read_only(host.env_file.parent):
        rc, out = host.cli_json("set", "-c", "8192")
    assert (rc, out["outcome"]) == (3, "rolled_back"), out
    assert out["failure"]["class"] == "swap_failed"
    assert str(host.env_file.parent) in out["failure"]["message"]
    assert "read-only" in out["failure"]["message"]
    assert "nothing was restarted" in out["message"]
    assert host.env_file.read_bytes() == before
    assert host.state()["MainPID"] == pid
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_a_deleted_live_file_then_a_failing_deploy_restores_the_live_generation(
    host: Host,
) -> None:
    installed(host)
    good = host.env_file.read_bytes()
    host.env_file.unlink()
    rc, status = host.cli_json("status")
    assert status["live_file"] == {"differs": True, "missing": True, "diff": []}
    p, _ = taken_at_restart(host)
    rc, out = p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
    assert (rc, out["outcome"]) == (3, "rolled_back"), out
    assert out["failure"]["class"] == "port_in_use"
    assert "generation 1 is serving again" in out["message"]
    assert host.env_file.read_bytes() == good
    assert host.state()["ActiveState"] == "active"
    assert host.chat()["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(
    ("flag", "what"),
    [
        ("--lora", "LoRA adapter"),
        ("--mmproj", "multimodal projector"),
        ("-md", "draft model"),
        ("--chat-template-file", "chat template"),
    ],
)
def test_a_missing_file_beside_the_model_is_refused_before_anything_changes(
    host: Host, flag: str, what: str
) -> None:
    installed(host)
    pid, missing = host.state()["MainPID"], host.root / "nope.gguf"
    rc, out = host.cli_json("set", flag, str(missing))
    assert (rc, out["error"], out["step"]) == (2, "ValidationFailed", "files"), out
    assert f"the {what} {missing} does not exist" in out["message"]
    assert host.state()["MainPID"] == pid


def test_a_file_beside_the_model_that_is_no_gguf_is_refused(host: Host) -> None:
    installed(host)
    junk = host.root / "adapter.gguf"
    junk.write_text("not a gguf\n")
    rc, out = host.cli_json("set", "--lora", str(junk))
    assert (rc, out.get("step")) == (2, "files"), out
    assert f"the LoRA adapter {junk} is not a GGUF file" in out["message"]


@pytest.mark.parametrize(
    ("flag", "kind", "sentence", "line"),
    [
        ("--lora", "lora_load", "the LoRA adapter", "failed to load lora adapter"),
        ("--mmproj", "mmproj_load", "the multimodal projector", "failed to load multimodal"),
        ("-md", "draft_load", "the draft model", "failed to load draft model"),
    ],
)
def test_a_file_beside_the_model_that_fails_to_load_is_classified_from_its_log_line(
    host: Host, flag: str, kind: str, sentence: str, line: str
) -> None:
    installed(host)
    # GGUFs that pass the checks and fail in llama-server: the model is no adapter and no
    # projector; a draft model cut after its header cannot be loaded
    path = host.model
    if flag == "-md":
        path = host.root / "cut.gguf"
        path.write_bytes(host.model.read_bytes()[:64])
    rc, out = host.cli_json("set", flag, str(path))
    assert (rc, out["outcome"]) == (3, "rolled_back"), out
    assert out["failure"]["class"] == kind, out["failure"]
    assert f"could not load {sentence} {path} ({flag})" in out["failure"]["message"]
    assert any(line in logged for logged in out["failure"]["log_tail"])
    assert host.chat()["usage"]["completion_tokens"] > 0


def test_temporary_files_of_a_killed_deployer_are_removed_by_the_next_run(host: Host) -> None:
    installed(host)
    # the sampler's timer sweeps the live generation's folder too: recover is the next run
    host.sandbox.systemctl("stop", *reversed(timer.names(host.unit)))
    # the names store.atomic_write gives its files, left by a writer that is gone (a real
    # process that exited) and by one that still runs (this one: it may still be writing)
    gone = subprocess.Popen(["true"])
    gone.wait()
    env = host.env_file
    left = [
        env.with_name(f".{env.name}.bak.tmp-{gone.pid}"),
        host.state_dir / f".txn.json.tmp-{gone.pid}",
        host.state_dir / f".live.tmp-{gone.pid}",
        host.state_dir / "generations" / "0001" / f".meta.json.tmp-{gone.pid}",
    ]
    busy = host.state_dir / f".live.tmp-{os.getpid()}"
    for path in [*left, busy]:
        path.write_text("partial")
    rc, out = host.cli_json("recover")
    assert rc == 0, out
    assert sorted(out["recovered"]["removed_temp_files"]) == sorted(map(str, left))
    assert not any(p.exists() for p in left)
    assert busy.exists()


def test_status_says_how_the_live_file_differs_from_the_live_generation(host: Host) -> None:
    installed(host)
    host.env_file.write_text(host.env_file.read_text().replace("-c 4096", "-c 8192"))
    rc, out = host.cli_json("status")
    assert (rc, out["live_file"]["differs"], out["live_file"]["missing"]) == (0, True, False)
    assert "--c 4096" in out["live_file"]["diff"] and "+-c 8192" in out["live_file"]["diff"]
    text = host.cli("status").stdout
    assert "differs from generation 1" in text and "+-c 8192" in text
