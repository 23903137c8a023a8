"""The llama-server log patterns: the formats read from b11434's source, in every wrapper.

The full lines come from the real server in tests/test_diagnose_real.py; here each pattern is
checked against the exact format string of its source line (LLAMA_SERVER_FACTS §1-2).
"""

from __future__ import annotations

import json
import re

import pytest

from launcher.server import serverlog

RELEASE = "slot      release: id  2 | task 8 | stop processing: n_tokens = 445, truncated = 0"
WRAPPERS = [
    pytest.param(lambda s: s, id="bare"),
    pytest.param(lambda s: f"0.03.844.729 I {s}\n", id="prefix"),
    pytest.param(lambda s: f"\x1b[34m0.03.844.729\x1b[0m \x1b[32mI \x1b[0m{s}\x1b[0m\n", id="ansi"),
    pytest.param(
        lambda s: f"Nov 29 18:07:48 host llama-server[123]: 0.03.844.729 I {s}", id="journal-short"
    ),
    pytest.param(lambda s: f"2026-11-29T18:07:48+0000 host llama-server[9]: {s}", id="short-iso"),
    pytest.param(
        lambda s: json.dumps(
            {"type": "log", "time": 1, "level": "info", "msg": s + "\n"}, separators=(",", ":")
        ),
        id="jsonl",
    ),
]


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_normalize_unwraps_every_form(wrap: object) -> None:
    assert serverlog.normalize(wrap(RELEASE)) == RELEASE  # type: ignore[operator]


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_release_pattern_matches_behind_every_prefix(wrap: object) -> None:
    m = serverlog.SLOT_RELEASE.search(wrap(RELEASE))  # type: ignore[operator]
    assert m is not None
    assert (m["slot"], m["task"], m["n_tokens"], m["truncated"]) == ("2", "8", "445", "0")


@pytest.mark.parametrize(
    ("pattern", "line", "groups"),
    [
        (
            serverlog.MEMORY_SLOT,
            "decode: failed to find a memory slot for batch of size 719",
            {"size": "719"},
        ),
        (
            serverlog.DECODE_RETRY,
            "srv        decode: failed to find free space in the KV cache, retrying with smaller "
            "batch size, off = 1329, n_batch = 1024, ret = 1",
            {"off": "1329", "n_batch": "1024", "ret": "1"},
        ),
        (
            serverlog.DECODE_ERROR,
            "srv        decode: Context size has been exceeded. off = 580, n_batch = 1, ret = 1",
            {"error": "Context size has been exceeded.", "off": "580", "n_batch": "1", "ret": "1"},
        ),
        (
            serverlog.PURGE,
            "srv  try_clear_id: purging slot 3 with 347 tokens",
            {"slot": "3", "tokens": "347"},
        ),
        (
            serverlog.SEND_ERROR,
            "srv    send_error: task id = 11, error: Context size has been exceeded.",
            {"task": "11", "error": "Context size has been exceeded."},
        ),
        (
            serverlog.DECODE_FAILED,
            "srv  update_slots: decode() failed: Context size has been exceeded.",
            {"error": "Context size has been exceeded."},
        ),
        (
            serverlog.REQUEST_TOO_LONG,
            "srv    send_error: task id = 0, error: request (444 tokens) exceeds the available "
            "context size (256 tokens), try increasing it",
            {"n_prompt": "444", "n_ctx": "256"},
        ),
        (
            serverlog.LLAMA_CONTEXT_N_CTX,
            "llama_context: n_ctx                 = 1024",
            {"n_ctx": "1024"},
        ),
        (
            serverlog.KV_CACHE_CELLS,
            "llama_kv_cache: size =   16.00 MiB (  1024 cells,   2 layers,  4/1 seqs), K (f16): "
            "8.00 MiB, V (f16):    8.00 MiB",
            {"cells": "1024", "seqs": "4", "streams": "1"},
        ),
        (
            serverlog.FIT_REDUCED,
            "common_fit_params_impl: context size reduced from 262144 to 65536 -> need 3 MiB less",
            {"from": "262144", "to": "65536"},
        ),
    ],
)
def test_runtime_patterns(pattern: object, line: str, groups: dict[str, str]) -> None:
    m = pattern.search(line)  # type: ignore[attr-defined]
    assert m is not None
    assert {k: m[k] for k in groups} == groups


def test_decode_error_does_not_match_the_retry_line() -> None:
    retry = (
        "failed to find free space in the KV cache, retrying with smaller batch size, "
        "off = 0, n_batch = 512, ret = 1"
    )
    assert serverlog.DECODE_ERROR.search(retry) is None


def test_every_runtime_line_holds_a_prefilter_keyword() -> None:
    """The fast path only looks at lines with a keyword: each pattern's line must have one."""
    keywords = [kw.decode() for kws in serverlog.KEYWORDS.values() for kw in kws]
    lines = [
        RELEASE,
        "decode: failed to find a memory slot for batch of size 719",
        "srv  try_clear_id: purging slot 3 with 347 tokens",
        "srv        decode: Compute error. off = 0, n_batch = 1, ret = -3",
        "srv  update_slots: decode() failed: Compute error.",
        "srv    load_model: initializing, n_slots = 4, n_ctx_slot = 1024, kv_unified = 'true'",
        "llama_context: n_ctx                 = 1024",
        "srv  llama_server: initializing ...",
    ]
    for line in lines:
        assert any(kw in line for kw in keywords), line


def test_existing_clean_is_unchanged() -> None:
    assert serverlog.clean("0.00.035.060 I srv  llama_server: model loaded\n") == (
        "srv  llama_server: model loaded"
    )


#: b11434's lines for ``-md cut.gguf`` (a draft model that is no loadable GGUF), as it printed
#: them on 2026-12-01: fit measures the draft first and warns, then speculative loads it.
DRAFT_FAILS = [
    "0.00.005.591 E gguf_init_from_reader: invalid magic characters: 'junk', expected 'GGUF'",
    "0.00.012.136 E llama_model_load: error loading model: llama_model_loader: failed to load "
    "model from /m/cut.gguf",
    "0.00.012.145 E llama_model_load_from_file_impl: failed to load model",
    "0.00.012.193 W operator(): failed to measure the memory of the extra model, fitting "
    "without it: failed to load model",
    "0.00.017.996 I common_speculative_init_result: loading draft model '/m/cut.gguf'",
    "0.00.018.247 E llama_model_load: error loading model: llama_model_loader: failed to load "
    "model from /m/cut.gguf",
    "0.00.018.345 E common_speculative_init_result: failed to load draft model, '/m/cut.gguf'",
]


DRAFT = ("draft_load", "llama-server could not load the draft model /m/cut.gguf (-md)")


@pytest.mark.parametrize(
    ("upto", "expected"),
    [(4, None), (5, None), (6, DRAFT), (7, DRAFT)],  # the fit's warning: its lines not fatal
)
def test_a_draft_model_failing_is_the_draft_not_the_model(
    upto: int, expected: tuple[str, str] | None
) -> None:
    assert serverlog.classify(DRAFT_FAILS[:upto]) == expected


@pytest.mark.parametrize(
    "line",
    [
        "srv        decode: Context size has been exceeded. off = 580, n_batch = 1, ret = 1",
        "srv    send_error: task id = 11, error: Context size has been exceeded.",
        "srv  update_slots: decode() failed: Context size has been exceeded.",
        "srv    send_error: task id = 4, error: Compute error.",
        "srv  update_slots: pre_decode() failed: Invalid input batch.",
        "srv  update_slots: post_decode() failed: something else",
    ],
)
def test_the_journals_hard_failure_pattern_takes_every_line_of_a_request_the_server_failed(
    line: str,
) -> None:
    # PCRE2 (journalctl --grep) and Python's re read this pattern alike
    assert re.search(serverlog.HARD_FAILURE_GREP, line)


def test_the_journals_hard_failure_pattern_leaves_a_request_too_long_for_its_slot() -> None:
    line = (
        "srv    send_error: task id = 0, error: request (444 tokens) exceeds the available "
        "context size (256 tokens), try increasing it"
    )
    assert serverlog.tally(line) == "failures" and serverlog.failure_kind(line) == "too_long"
    assert not re.search(serverlog.HARD_FAILURE_GREP, line)
