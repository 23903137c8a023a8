"""Every llama-server log line the tool reads, in one place.

Read from llama.cpp builds b9093, b10405 and b11434 (tools/server/*, common/*, src/*) and
confirmed against each real server by the tests. Where the builds differ, each form is here
with the builds it was read from, and the readers accept every form (a log may hold several
builds' starts).
Lines may carry llama-server's prefix (``0.00.035.060 I ``) and, if colours were left on,
ANSI escapes; ``clean`` strips both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

#: The builds these patterns were read from and tested against.
TESTED_BUILDS = (9093, 10405, 11434)

#: A number in a named group: ``(?P<name>\d+)`` or ``(?P<name>-?\d+)``.
_NUMBER_GROUP = re.compile(r"(\(\?P<\w+>(?:-\?)?)\\d\+\)")
#: The most digits a number may have. llama-server prints 32-bit counts (10 digits); a longer
#: run is damage, not a number.
MAX_DIGITS = 10


def _compile(pattern: str, flags: int = 0) -> re.Pattern[str]:
    """Compile a log pattern: ASCII classes, and every named number at most MAX_DIGITS long.

    A run of more digits does not match, so a damaged line is counted as drift instead of
    giving a number no server prints.
    """
    return re.compile(
        _NUMBER_GROUP.sub(rf"\1\\d{{1,{MAX_DIGITS}}})(?!\\d)", pattern), flags | re.ASCII
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# "%d.%02d.%03d.%03d " timestamp, then a level letter (common/log.cpp:125-155).
_PREFIX = re.compile(r"^(?:\d+\.\d{2}\.\d{3}\.\d{3} )?(?:[IWED] )?")

# b10405, b11434: server-context.cpp:1383-1384 (INFO), the whole promise in one line
STARTUP = _compile(
    r"initializing, n_slots = (?P<n_slots>\d+), n_ctx_slot = (?P<n_ctx_slot>\d+), "
    r"kv_unified = '(?P<kv_unified>true|false)'"
)
# b9093: the promise in three lines. server-context.cpp:872 ``initializing slots, n_slots =
# %d``, then per slot :919 ``slot load_model: id 0 | task -1 | new slot, n_ctx = %d``; the pool
# from src/llama-context.cpp:200,206 (INFO, printed before them): ``llama_context: n_ctx =
# 1024``, ``llama_context: kv_unified = true``.
STARTUP_SLOTS = _compile(r"initializing slots, n_slots = (?P<n_slots>\d+)")
NEW_SLOT = _compile(r"new slot, n_ctx = (?P<n_ctx_slot>\d+)")
LLAMA_CONTEXT_KV_UNIFIED = _compile(r"llama_context: kv_unified += *(?P<kv_unified>true|false)")

#: The startup-line forms, with the builds each was read from.
STARTUP_FORMS = {
    "one line": (10405, 11434),  # initializing, n_slots = .., n_ctx_slot = .., kv_unified = ..
    "slots, new slot": (9093,),  # initializing slots, n_slots = ..; new slot, n_ctx = ..
}


def startup_form(build: int | None) -> str | None:
    """The startup-line form ``build`` prints; None when the build is not one of the tested
    ones (a build between two tested ones may print either, a newer one anything)."""
    for form, builds in STARTUP_FORMS.items():
        if build in builds:
            return form
    return None


# server.cpp:184
POOL_SIZING = _compile(
    r"--kv-unified-per-slot: sizing KV pool to n_parallel \* kv_unified_per_slot = "
    r"(?P<np>\d+) \* (?P<per_slot>\d+) = (?P<n_ctx>\d+)"
)
# server.cpp:495-498, :525-526
MODEL_LOADED = _compile(r"srv  llama_server: model loaded")
LISTENING = _compile(r"llama_server: listening on (?P<address>\S+)")
# common/arg.cpp:757
CONFIG_FILE = _compile(r"using config file: (?P<path>.+)$")

#: Startup warnings about the context (reported by the deploy gate).
CONTEXT_WARNINGS = {
    # src/llama-context.cpp:330
    "ctx_over_train": _compile(
        r"n_ctx_seq \((?P<n_ctx_seq>\d+)\) > n_ctx_train \((?P<n_ctx_train>\d+)\)"
    ),
    # src/llama-context.cpp:306
    "ctx_rounded": _compile(r"n_ctx is not divisible by n_seq_max - rounding down to (\d+)"),
    # server-context.cpp:1350
    "slot_capped": _compile(
        r"capping per-slot context \((?P<from>\d+)\) to --kv-unified-per-slot \((?P<to>\d+)\)"
    ),
    # server-context.cpp:1354-1358
    "cap_no_effect": _compile(
        r"--kv-unified-per-slot \((\d+)\) exceeds the per-slot pool capacity \((\d+)\)"
    ),
    # server-context.cpp:1366
    "slot_over_train": _compile(
        r"the slot context \((\d+)\) exceeds the training context of the model \((\d+)\)"
    ),
}

#: Why a server failed to start, most specific first (common/arg.cpp, server.cpp,
#: server-http.cpp, ggml/src/gguf.cpp, src/llama-context.cpp).
FAILURES: list[tuple[str, re.Pattern[str], str]] = [
    (
        "unknown_argument",
        _compile(r"error: invalid argument: (?P<arg>\S+)"),
        "llama-server does not know the flag {arg}",
    ),
    (
        "bad_value",
        _compile(r'error while handling argument "(?P<arg>[^"]+)": (?P<what>.*)'),
        "llama-server refused the value of {arg}: {what}",
    ),
    (
        "bad_cache_type",
        _compile(r"Unsupported cache type: (?P<type>\S+)"),
        "llama-server does not support the cache type {type}",
    ),
    # The files beside the model (common/common.cpp, tools/server/server-context.cpp,
    # common/speculative.cpp; read from b11434): each failure also prints a line a less
    # specific pattern matches (failed to open GGUF file, failed to create context).
    (
        "lora_load",
        _compile(r"failed to load lora adapter '(?P<path>[^']*)'"),
        "llama-server could not load the LoRA adapter {path} (--lora)",
    ),
    (
        "mmproj_load",
        _compile(r"failed to load multimodal model, '(?P<path>[^']*)'"),
        "llama-server could not load the multimodal projector {path} (--mmproj)",
    ),
    (
        "draft_load",
        _compile(r"failed to load draft model, '(?P<path>[^']*)'"),
        "llama-server could not load the draft model {path} (-md)",
    ),
    (
        "model_missing",
        _compile(r"failed to open GGUF file '(?P<path>[^']*)'"),
        "the model file {path} cannot be opened",
    ),
    (
        "port_in_use",
        _compile(r"couldn't bind HTTP server socket, hostname: (?P<host>\S+), port: (?P<port>\d+)"),
        "the port {port} on {host} is already in use",
    ),
    (
        "out_of_memory",
        _compile(
            r"(?P<what>failed to allocate buffer for kv cache|failed to allocate compute|"
            r"out of memory|cannot allocate memory)",
            re.I,
        ),
        "llama-server ran out of memory ({what})",
    ),
    (
        "quantized_v_needs_fa",
        _compile(r"quantized V cache requires flash_attn to be enabled"),
        "a quantized V cache needs flash attention; drop -fa off",
    ),
    (
        "block_size",
        _compile(
            r"(?P<which>[KV]) cache type (?P<type>\S+) with block size (?P<bs>\d+) does not divide "
            r"n_embd_head_\w+=(?P<hd>\d+)"
        ),
        "the {which} cache type {type} (block {bs}) does not fit this model's head size {hd}",
    ),
    (
        "model_load",
        _compile(r"failed to load model|error loading model"),
        "llama-server could not load the model",
    ),
    (
        "context_create",
        _compile(r"failed to create[_ ]context"),
        "llama-server could not create the context",
    ),
]


def clean(line: str) -> str:
    """Strip ANSI colours, llama-server's timestamp/level prefix and the line ending."""
    return _PREFIX.sub("", _ANSI.sub("", line.rstrip("\r\n")), count=1)


@dataclass(frozen=True)
class Startup:
    """The values of the startup line, plus what the lines around it said."""

    n_slots: int
    n_ctx_slot: int
    kv_unified: bool | None  # None: the log did not say (b9093 form without its context line)
    pool_cells: int | None = None  # from the per-slot sizing line, when printed
    warnings: tuple[str, ...] = ()
    config_file: str | None = None


@dataclass
class StartupScan:
    """Accumulates startup facts from a stream of lines (the journal since a cursor)."""

    startup: Startup | None = None
    pool_cells: int | None = None
    warnings: list[str] = field(default_factory=list)
    config_file: str | None = None
    model_loaded: bool = False
    failure: tuple[str, str] | None = None  # (class, sentence)
    slots: int | None = None  # b9093: ``initializing slots`` seen, waiting for ``new slot``
    kv_unified: bool | None = None  # b9093: from ``llama_context: kv_unified``

    def _found(self, n_slots: int, n_ctx_slot: int, kv_unified: bool | None) -> None:
        self.startup = Startup(
            n_slots,
            n_ctx_slot,
            kv_unified,
            self.pool_cells,
            tuple(self.warnings),
            self.config_file,
        )

    def feed(self, raw: str) -> None:
        line = clean(raw)
        if m := STARTUP.search(line):
            self._found(int(m["n_slots"]), int(m["n_ctx_slot"]), m["kv_unified"] == "true")
            return
        if m := STARTUP_SLOTS.search(line):
            self.slots = int(m["n_slots"])
        elif self.slots is not None and (m := NEW_SLOT.search(line)):
            self._found(self.slots, int(m["n_ctx_slot"]), self.kv_unified)
            self.slots = None
        elif m := LLAMA_CONTEXT_KV_UNIFIED.search(line):
            self.kv_unified = m["kv_unified"] == "true"
        elif m := POOL_SIZING.search(line):
            self.pool_cells = int(m["n_ctx"])
        elif m := CONFIG_FILE.search(line):
            self.config_file = m["path"].strip()
        elif MODEL_LOADED.search(line):
            self.model_loaded = True
        else:
            for pattern in CONTEXT_WARNINGS.values():
                if pattern.search(line):
                    self.warnings.append(line.strip())
                    return
            if self.failure is None:
                self.failure = classify_failure(line)

    def feed_all(self, lines: Iterable[str]) -> StartupScan:
        for line in lines:
            self.feed(line)
        return self


def startup_from_props(
    props: dict[str, object], build: str, scan: StartupScan
) -> tuple[Startup, str]:
    """The startup values from ``/props`` (``total_slots``, ``default_generation_settings.n_ctx``)
    when the log held no startup line in a known form, and the warning that says so."""
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    slots = props.get("total_slots")
    startup = Startup(
        slots if isinstance(slots, int) else 0,
        n_ctx if isinstance(n_ctx, int) else 0,
        None,
        scan.pool_cells,
        tuple(scan.warnings),
        scan.config_file,
    )
    tested = ", ".join(f"b{b}" for b in TESTED_BUILDS)
    return startup, (
        f"llama-server {build} printed no startup line in a form this launcher knows (read "
        f"from {tested}); the gate took n_slots and n_ctx_slot from /props instead and could "
        "not check kv_unified - tell the launcher's maintainers which build this is"
    )


def classify_failure(line: str) -> tuple[str, str] | None:
    """Return (class, sentence) when ``line`` says why llama-server could not start."""
    text = clean(line)
    for name, pattern, template in FAILURES:
        m = pattern.search(text)
        if m:
            return name, template.format(**m.groupdict())
    return None


#: A draft model (-md) is loaded twice, and fails with the main model's lines
#: (common/fit.cpp measures it first and warns; common/speculative.cpp loads it after the
#: main model; b11434): the warning says the lines before it were not fatal, the announcement
#: says the model lines after it are the draft's.
EXTRA_MODEL_SKIPPED = _compile(r"failed to measure the memory of the extra model")
DRAFT_LOADING = _compile(r"loading draft model '(?P<path>[^']*)'")
_MODEL_CLASSES = ("model_missing", "model_load")


def classify(lines: Iterable[str]) -> tuple[str, str] | None:
    """The first failure class found in ``lines`` (most specific pattern wins per line)."""
    found: tuple[str, str] | None = None
    rank = {name: i for i, (name, _, _) in enumerate(FAILURES)}
    template = {name: sentence for name, _, sentence in FAILURES}
    draft: str | None = None
    for line in lines:
        text = clean(line)
        if EXTRA_MODEL_SKIPPED.search(text):
            found = None if found and found[0] in _MODEL_CLASSES else found
            continue
        if m := DRAFT_LOADING.search(text):
            draft = m["path"]
            continue
        hit = classify_failure(line)
        if hit and draft is not None and hit[0] in _MODEL_CLASSES:
            hit = ("draft_load", template["draft_load"].format(path=draft))
        if hit and (found is None or rank[hit[0]] < rank[found[0]]):
            found = hit
    return found


# ---------------------------------------------------------------------------------------------
# Runtime lines: KV exhaustion, request-time rejections (read by ``launcher.reports.diagnose``).
# All of them print at the default verbosity (3) unless noted. The patterns are searched, not
# anchored, so they match behind every prefix form: llama-server's ``0.00.035.060 I ``, ANSI
# colours, journald's ``-o short`` prefix and inside a ``--log-jsonl`` record's "msg".
# ---------------------------------------------------------------------------------------------

# src/llama-context.cpp:1843 (WARN, libllama; ``llama_context::decode`` then returns 1)
MEMORY_SLOT = _compile(r"decode: failed to find a memory slot for batch of size (?P<size>\d+)")
# tools/server/server-context.cpp:4061 (SRV_WRN). n_batch is the size of the NEXT try: it is
# halved, or kept when try_clear_idle_slots purged an idle slot (unified pools only). The
# offset is ``off =`` from b10405 on, ``i =`` in b9093 (server-context.cpp:2850); a shortened
# excerpt may drop ``, ret = N``.
RETRY_TEXT = "failed to find free space in the KV cache, retrying with smaller batch size, "
DECODE_RETRY = _compile(
    re.escape(RETRY_TEXT)
    + r"(?:off|i) = (?P<off>\d+), n_batch = (?P<n_batch>\d+)(?:, ret = (?P<ret>-?\d+))?(?![\d,])"
)
# server-context.cpp:1813 (SRV_WRN, try_clear_idle_slots; the function name prints as
# ``try_clear_id``)
PURGE = _compile(r"purging slot (?P<slot>\d+) with (?P<tokens>\d+) tokens")
# server-context.cpp:4019-4038 (SRV_ERR, ``srv decode:``; b9093 :2813-2827 ``srv
# update_slots:`` with ``i =``): the error that ends a cascade. Only "Context size has been
# exceeded." is KV exhaustion; the other two are other faults.
DECODE_ERROR = _compile(
    r"(?P<error>Context size has been exceeded\.|Invalid input batch\.|Compute error\.) "
    r"(?:off|i) = (?P<off>\d+), n_batch = (?P<n_batch>\d+)(?:, ret = (?P<ret>-?\d+))?(?![\d,])"
)
# server-context.cpp:2163 (SRV_ERR), once per request that gets an error
SEND_ERROR = _compile(r"send_error: task id = (?P<task>-?\d+), error: (?P<error>.*?)(?:\\n)?$")
# server-context.cpp:586 (SLT_INF; b9093 :418): ``slot      release: id  0 | task 12 | stop
# processing: n_tokens = 401, truncated = 0``. Shortened excerpts drop the task and truncated.
SLOT_RELEASE = _compile(
    r"release: id +(?P<slot>\d+) (?:\| task (?P<task>-?\d+) )?\| stop processing: "
    r"n_tokens = (?P<n_tokens>\d+)(?:, truncated = (?P<truncated>\d+))?"
)
# server-context.cpp:3096 (SRV_ERR): after every slot was released (b10405 on; b9093 prints
# no such line)
DECODE_FAILED = _compile(r"update_slots: decode\(\) failed: (?P<error>.*?)(?:\\n)?$")
# server-context.cpp:3043, :3105: other faults in the same wording (no KV cascade)
OTHER_DECODE_FAILED = _compile(r"update_slots: (?:pre|post)_decode\(\) failed: ")
#: The phrase ``grep -c`` looks for (the first step of diagnosing it). It appears on the
#: decode error line, on one send_error line per request and on the update_slots line.
CONTEXT_EXCEEDED = "Context size has been exceeded"
#: The 500 body of such a request, when something logs response bodies (-v, a proxy).
CONTEXT_EXCEEDED_BODY = '"message":"Context size has been exceeded'
#: The lines of a request failed by the server itself (the pool ran out, a decode failure;
#: not a request too long for its slot), as a pattern for ``journalctl --grep`` (PCRE2):
#: ``DECODE_ERROR``'s, the ``send_error`` lines after it, ``OTHER_DECODE_FAILED``'s.
HARD_FAILURE_GREP = (
    r"Context size has been exceeded|Invalid input batch|Compute error|"
    r"update_slots: (pre|post)_decode\(\) failed"
)

# server-context.cpp:3395-3424: request-time rejections, HTTP 400 exceed_context_size_error.
REQUEST_TOO_LONG = _compile(
    r"request \((?P<n_prompt>\d+) tokens\) exceeds the available context size "
    r"\((?P<n_ctx>\d+) tokens\)"
)
INPUT_TOO_LARGE = _compile(
    r"input \((?P<n_prompt>\d+) tokens\) is larger than the max context size "
    r"\((?P<n_ctx>\d+) tokens\)"
)
#: The error type of the 400 body (tools/server/server-common.cpp:36-77); it reaches the log
#: only when something logs response bodies (-v, a proxy).
EXCEED_CONTEXT_TYPE = "exceed_context_size_error"

# Pool size, when the log states it. src/llama-context.cpp:311 (INFO, only at -lv 4); the
# field name is padded with spaces so the '=' signs line up.
LLAMA_CONTEXT_N_CTX = _compile(r"llama_context: n_ctx +=\s*(?P<n_ctx>\d+)")
# src/llama-kv-cache.cpp:301 (INFO, -lv 4): ``llama_kv_cache: size = ... (  1024 cells, ...``
KV_CACHE_CELLS = _compile(
    r"llama_kv_cache: size = +[\d.]+ MiB \( *(?P<cells>\d+) cells, +(?P<layers>\d+) layers, "
    r"+(?P<seqs>\d+)/(?P<streams>\d+) seqs\)"
)
# common/fit.cpp:434,443 (TRACE, -lv 4): ``common_fit_params...: context size reduced from A to B``
FIT_REDUCED = _compile(r"context size reduced from (?P<from>\d+) to (?P<to>\d+)")
# server.cpp:116: the first line of every server start; a new generation of the log begins.
SERVER_INIT = _compile(r"srv  llama_server: initializing \.\.\.")
# What the server allocated, per buffer (libllama INFO: printed at -lv 4). The buffer name is
# ggml_backend_buffer_name: a device (CUDA0, Vulkan0, MTL0) or a host buffer (CPU, CPU_Mapped,
# CUDA_Host, CPU_REPACK). src/llama-model.cpp:1932 "%s: %12s model buffer size = %8.2f MiB",
# src/llama-kv-cache.cpp:291 "%s: %10s KV buffer size = %8.2f MiB",
# src/llama-memory-recurrent.cpp:124 "%s: %10s RS buffer size = %8.2f MiB",
# src/llama-context.cpp:742 "%s: %10s compute buffer size = %8.2f MiB" (in sched_reserve).
BUFFER_SIZES = {
    "model": _compile(r"load_tensors: +(?P<buffer>\S+) model buffer size = +(?P<mib>\d+\.\d+) MiB"),
    "kv": _compile(
        r"llama_(?:kv_cache|memory_recurrent): +(?P<buffer>\S+) (?:KV|RS) buffer size = "
        r"+(?P<mib>\d+\.\d+) MiB"
    ),
    "compute": _compile(
        r"sched_reserve: +(?P<buffer>\S+) compute buffer size = +(?P<mib>\d+\.\d+) MiB"
    ),
}

# journald ``-o short`` / ``-o short-iso`` / ``-o short-precise`` prefixes.
_JOURNAL_PREFIX = re.compile(
    r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d(?:\.\d+)?|"
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d{2}:?\d{2}|Z)?) "
    r"\S+ [^\s:\[]+(?:\[\d+\])?: "
)


def normalize(line: str) -> str:
    """The bare message of one log line, whatever carried it.

    Unwraps a ``--log-jsonl`` record (``{"type":"log",...,"msg":"..."}``) or a ``journalctl -o
    json`` one (``{..., "MESSAGE":"..."}``), strips a journald
    ``-o short`` prefix, then does what ``clean`` does (ANSI colours, the timestamp and level
    letter, the line ending).
    """
    text = line.rstrip("\r\n")
    if text.startswith("{"):
        import json

        try:
            record = json.loads(text)
        except ValueError:
            return clean(text)
        # --log-jsonl's "msg", journalctl -o json's "MESSAGE"
        msg = record.get("msg", record.get("MESSAGE")) if isinstance(record, dict) else None
        return clean(msg) if isinstance(msg, str) else clean(text)
    return clean(_JOURNAL_PREFIX.sub("", _ANSI.sub("", text), count=1))


#: Cheap substrings, one set per kind of line, tried on the raw bytes before any regex runs
#: (``launcher.reports.diagnose``'s fast path). A line holding one of them but matching none of the
#: patterns above is reported as possible format drift.
KEYWORDS: dict[str, tuple[bytes, ...]] = {
    "memory_slot": (b"memory slot",),
    "retry": (b"retrying with smaller batch",),
    "decode_error": (b"Invalid input batch", b"Compute error"),
    "purge": (b"purging slot",),
    "send_error": (b"send_error",),
    "release": (b"stop processing",),
    "decode_failed": (b"decode() failed",),
    "exceeded": (CONTEXT_EXCEEDED.encode(),),
    "too_long": (
        b"exceeds the available context",
        b"larger than the max context",
        EXCEED_CONTEXT_TYPE.encode(),
    ),
    "startup": (
        b"n_slots = ",
        b"new slot, n_ctx",
        b"llama_context: kv_unified",
        b"sizing KV pool",
        b"n_ctx_seq (",
        b"capping per-slot",
        b"exceeds the per-slot pool",
        b"llama_context: n_ctx ",
        b" cells, ",
        b"context size reduced",
        b"llama_server: initializing",
    ),
}


# -- what a live sample counts in the journal ------------------------------------------------

# server-context.cpp:1962 (SLT_INF; b9093 :1353, b10405 :1858): ``slot launch_slot_: id  3 |
# task 2 | processing task, is_child = 0``, once per task a slot starts (one per request;
# a request with n > 1 choices starts children, is_child = 1)
TASK_LAUNCH = _compile(r"\| processing task(?:, is_child = (?P<child>\d+))?")

#: The counters of ``tally``, in the order a live record keeps them.
TALLY_KEYS = (
    "requests",
    "completions",
    "failures",
    "context_exceeded",
    "too_long",
    "decode_failed",
    "kv_retries",
)


def tally(line: str) -> str | None:
    """Which live counter one message line adds to (``TALLY_KEYS``): a request launched, a
    task released (``completions``; a failed one is subtracted by the caller through
    ``failures``), a request answered with an error (``failure_kind`` says which kind), a
    step of a KV cascade. None: a line no counter wants (the ``decode() failed`` line that
    follows a failure repeats what its requests' error lines said)."""
    if "processing task" in line:
        m = TASK_LAUNCH.search(line)
        return "requests" if m and m["child"] in (None, "0") else None
    if "stop processing" in line:
        return "completions" if SLOT_RELEASE.search(line) else None
    if "send_error" in line and SEND_ERROR.search(line):
        return "failures"
    if RETRY_TEXT in line:
        return "kv_retries"
    return None


def failure_kind(line: str) -> str:
    """The kind of a request's error line (``tally`` said ``failures``): the exhausted pool,
    a request too long for its slot, or another decode failure."""
    if CONTEXT_EXCEEDED in line:
        return "context_exceeded"
    if REQUEST_TOO_LONG.search(line) or INPUT_TOO_LARGE.search(line):
        return "too_long"
    return "decode_failed"
