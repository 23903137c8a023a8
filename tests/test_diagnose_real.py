"""``diagnose`` on logs the real llama-server wrote during this test run (scripts/repro.py).

The numbers are held against what the clients saw (HTTP statuses) and against the relation
the real server obeys: the release lines after a failure add up to pool + the view that could
not be placed. The ``--unit`` test needs the sandboxed systemd (scripts/sandbox run --).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from launcher.reports import diagnose

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import realserver  # noqa: E402
import repro  # noqa: E402

pytestmark = pytest.mark.real


def run_cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "launcher", "diagnose", *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        cwd=REPO,
    )


def of(path: Path, **kw: object) -> diagnose.Report:
    with open(path, "rb") as f:
        return diagnose.diagnose(f, str(path), **kw)  # type: ignore[arg-type]


def grep_c(path: Path) -> int:
    return path.read_bytes().count(b"Context size has been exceeded")


def check_overflow(r: diagnose.Report, run: repro.Run) -> None:
    failed = run.statuses.count(500)
    assert failed >= 2, f"the repro did not overflow: {run.statuses}"
    assert r.requests_failed == failed
    assert r.failures_total == 1
    assert r.by_class == {diagnose.FailureClass.SHARED_POOL.value: 1}
    f = r.failures[0]
    assert f.cls is diagnose.FailureClass.SHARED_POOL
    assert len(f.slots) == failed and f.requests_failed == failed
    assert f.pool_cells == 1024
    assert f.total == sum(s.n_tokens for s in f.slots) > 1024
    # the real server's relation: sum = pool + the view that could not be placed. When every
    # prompt arrived in one batch larger than n_batch (1024), the first view at the final
    # offset was capped and the log does not state the remainder: then it is inferred.
    if f.overflow_source == "log":
        assert f.adds_up is True
    else:
        assert f.overflow_source == "inferred (sum - pool)" and f.steps[0].size == 1024
    assert f.total == 1024 + (f.overflow or 0)
    # every slot held its whole prompt (the chat template adds some tokens), and the tokens
    # it had generated when the burst did not overlap fully (a retry placed one prompt whole)
    for s in f.slots:
        top = max(run.prompt_tokens) + 100 + repro.BURST_MAX_TOKENS
        assert min(run.prompt_tokens) <= s.n_tokens <= top
        assert s.share == pytest.approx(s.n_tokens / 1024)
    # the cascade halves down to 1, possibly restarting at larger views after partial placement
    assert f.steps[-1].size in (1, None) and f.steps[-1].next_n_batch is None
    assert f.n_steps >= 10 and f.offsets >= 1
    # the warm idle slot was purged before the batch was halved (--cache-ram 0)
    assert f.purges >= 1
    c = r.config
    assert c is not None and c.n_slots == 4 and c.n_ctx_slot == 1024 and c.kv_unified
    assert c.plan is not None and c.plan.overcommitted and c.plan.guaranteed_window == 256
    fix = r.verdicts[0].fixes[0]
    assert fix.command == "llama-launcher set -c 4096 --kv-unified-per-slot 1024"
    assert fix.guaranteed_window == 1024 and fix.pool_cells == 4096 and fix.memory_bytes is None
    assert r.drift_lines == 0, r.drift_samples


def test_overflow_text_log(logs: dict[str, repro.Run]) -> None:
    run = logs["overflow"]
    r = of(run.log)
    check_overflow(r, run)
    assert r.exceeded_lines == grep_c(run.log)
    assert r.config is not None
    assert r.config.pool_source.startswith("startup: unified pool without a per-slot cap")


def test_overflow_jsonl_lv4_reads_pool_from_llama_context(logs: dict[str, repro.Run]) -> None:
    run = logs["jsonl"]
    r = of(run.log)
    check_overflow(r, run)
    assert r.exceeded_lines == grep_c(run.log)
    assert r.config is not None and r.config.pool_source == "startup: llama_context: n_ctx (-lv 4)"


def test_prefix_forms_give_the_same_report(logs: dict[str, repro.Run], tmp_path: Path) -> None:
    """journald -o short prefixes and ANSI colours around the real lines change nothing."""
    run = logs["overflow"]
    raw = run.log.read_bytes().splitlines(keepends=True)
    wrapped = b"".join(
        b"Nov 29 18:07:48 host llama-server[123]: \x1b[34m" + line.replace(b" W ", b" \x1b[35mW ")
        for line in raw
    )
    plain = of(run.log)
    other = diagnose.diagnose(io.BytesIO(wrapped), "wrapped", block=4096)
    assert other.failures[0].slots == plain.failures[0].slots
    assert (other.failures_total, other.requests_failed, other.exceeded_lines) == (
        plain.failures_total,
        plain.requests_failed,
        plain.exceeded_lines,
    )
    assert other.failures[0].n_steps == plain.failures[0].n_steps


def test_small_blocks_split_lines_without_losing_any(logs: dict[str, repro.Run]) -> None:
    run = logs["overflow"]
    whole = of(run.log)
    for block in (7, 100, 1 << 20):
        with open(run.log, "rb") as f:
            part = diagnose.diagnose(f, "x", block=block)
        assert part.lines == whole.lines == len(run.log.read_bytes().splitlines())
        assert part.failures == whole.failures


def test_changed_format_is_reported_as_drift(logs: dict[str, repro.Run]) -> None:
    run = logs["overflow"]
    data = run.log.read_bytes().replace(b"stop processing: n_tokens =", b"stop processing: tokens:")
    r = diagnose.diagnose(io.BytesIO(data), "drifted")
    assert r.drift_lines >= run.statuses.count(500)
    assert any("stop processing: tokens:" in s for s in r.drift_samples)
    assert r.failures[0].slots == ()
    assert r.failures[0].cls is diagnose.FailureClass.UNKNOWN


def test_too_long_is_a_rejection_not_a_failure(logs: dict[str, repro.Run]) -> None:
    run = logs["too_long"]
    assert run.statuses == (400,)
    r = of(run.log)
    assert (r.failures_total, r.exceeded_lines, r.rejections_total) == (0, 0, 1)
    rej = r.rejections[0]
    assert rej.n_ctx == 256 and rej.n_prompt >= run.prompt_tokens[0]
    v = r.verdicts[0]
    assert v.cls is diagnose.FailureClass.TOO_LONG
    assert v.fixes[0].command == "llama-launcher set -c 2048"
    assert v.fixes[0].guaranteed_window == 512 > rej.n_prompt
    assert r.config is not None and r.config.pool_cells == 1024


def test_healthy_config_keeps_its_promise(logs: dict[str, repro.Run]) -> None:
    run = logs["healthy"]
    assert run.statuses == (200, 200, 200)
    r = of(run.log)
    assert (r.failures_total, r.requests_failed, r.rejections_total, r.verdicts) == (0, 0, 0, ())
    c = r.config
    assert c is not None and c.pool_cells == 2048 and c.per_slot_cap == 512
    assert c.pool_source == "startup: --kv-unified-per-slot sizing KV pool line"
    assert c.plan is not None and not c.plan.overcommitted and c.plan.guaranteed_window == 512


def test_cli_human_table_and_json(logs: dict[str, repro.Run]) -> None:
    run = logs["overflow"]
    r = of(run.log)
    f = r.failures[0]
    human = run_cli("--log", str(run.log))
    assert human.returncode == 0, human.stderr
    text = human.stdout.decode()
    for s in f.slots:
        assert f"{s.n_tokens:,}" in text and f"{100 * (s.share or 0):.1f} %" in text
    assert f"Sum {f.total:>22,}" in text.replace("Sum   ", "Sum ")
    assert ("adds up" if f.adds_up else "inferred") in text
    assert "llama-launcher set -c 4096 --kv-unified-per-slot 1024" in text
    piped = run_cli("--json", "-", stdin=run.log.read_bytes())
    data = json.loads(piped.stdout)
    assert data["failures"][0]["total"] == f.total
    assert data["by_class"] == {"shared-pool exhaustion": 1}


def test_cli_rejects_since_without_unit(logs: dict[str, repro.Run]) -> None:
    p = run_cli("--log", str(logs["healthy"].log), "--since", "1 hour ago")
    assert p.returncode == 2 and b"--since" in p.stderr


def _overflow_unit(tiny_model: Path, llama_server_bin: str) -> tuple[str, tuple[int, ...]]:
    """Run the overflow burst against a transient --user unit; return (unit, statuses)."""
    unit = f"diag-{uuid.uuid4().hex[:8]}"
    port = realserver.free_port()
    argv = [
        llama_server_bin,
        "-m",
        str(tiny_model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-colors",
        "off",
        *repro.OVERFLOW_ARGS,
    ]
    subprocess.run(
        ["systemd-run", "--user", "--unit", unit, "--", *argv],
        check=True,
        capture_output=True,
        timeout=60,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        realserver.wait_healthy(url, 30)
        text, _ = repro.sized_prompt(url, 300, 99)
        repro.chat(url, text)
        statuses = repro.burst(url, [repro.sized_prompt(url, 400, i)[0] for i in range(3)])
    finally:
        subprocess.run(["systemctl", "--user", "stop", unit], capture_output=True, timeout=60)
    return unit, statuses


def test_unit_journal(sandbox: object, tiny_model: Path, llama_server_bin: str) -> None:
    """A transient --user unit overflows; diagnose --unit reads it from the journal."""
    for _ in range(3):  # the burst must overlap in the server; a loaded box may serialise it
        unit, statuses = _overflow_unit(tiny_model, llama_server_bin)
        if statuses.count(500) >= 2:
            break
    failed = statuses.count(500)
    assert failed >= 2, statuses
    p = run_cli("--unit", unit, "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["source"] == f"journal of {unit}"
    assert data["requests_failed"] == failed and data["failures_total"] == 1
    assert data["by_class"] == {"shared-pool exhaustion": 1}
    f = data["failures"][0]
    assert f["adds_up"] in (True, None) and f["total"] == 1024 + f["overflow"]
    assert data["config"]["n_ctx_slot"] == 1024
    since = run_cli("--unit", unit, "--since", "2000-01-01", "--json")
    assert json.loads(since.stdout)["failures_total"] == 1
    missing = run_cli("--unit", unit, "--since", "not a time")
    assert missing.returncode == 1 and b"journalctl" in missing.stderr
