"""The unit's ExecStart: read the env file without executing it, then exec the server.

``llama-launcher exec --env-file PATH`` parses the file with the strict parser of
``launcher.host.envfile``, builds llama-server's argv and replaces itself with llama-server
(``os.execve``), so systemd supervises llama-server directly: signals and exit statuses pass
through unchanged. An env file with ``VLLM_PYTHON`` instead of ``LLAMA_SERVER`` runs vLLM:
``VLLM_PYTHON launcher/host/vllmshim/vllm_main.py serve EXTRA_ARGS`` (``vllm_argv``), its key handed
over in ``VLLM_API_KEY``, never on its command line. A configuration error of the
launcher's own exits with ``EX_CONFIG`` (78), which the units list in
``RestartPreventExitStatus=``.

This is on the path of every server start. It imports the standard library and
``launcher.host.envfile`` only - no pydantic, httpx or the rest of the tool.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from launcher.host import envfile

#: The keys an env file may hold. Anything else is refused: a stray ``LLAMA_ARG_*`` line
#: would silently change llama-server behind the typed config's back.
KEYS = ("LLAMA_SERVER", "VLLM_PYTHON", "EXTRA_ARGS", "API_KEY_FILE")
REQUIRED = ("LLAMA_SERVER", "EXTRA_ARGS")
#: the shim vLLM's python runs, alone in a folder of its own: python puts a script's folder
#: first on its import path, where this folder's modules (proc, ports, ...) would shadow
#: vLLM's imports
VLLM_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllmshim", "vllm_main.py")
#: Environment variables llama-server reads as flags; removed so only the argv counts.
_SCRUBBED_PREFIXES = ("LLAMA_ARG_",)
_SCRUBBED = ("LLAMA_API_KEY", "PYTHONPATH")  # PYTHONPATH: the unit's, for the launcher only


class LaunchError(Exception):
    """A configuration error of the launcher itself (exit status 78)."""


def _key_lines(text: str) -> dict[str, int]:
    """The line number of each key's last assignment in text the parser has accepted."""
    lines: dict[str, int] = {}
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip(" \t")
        if line and not line.startswith("#"):
            lines[line.partition("=")[0]] = lineno
    return lines


def argv_from_values(
    values: Mapping[str, str], path: str = "<env>", lines: Mapping[str, int] | None = None
) -> list[str]:
    """Build llama-server's argv from parsed env file values.

    ``lines`` maps each key to the line that set it, so a refusal can name it.
    """

    def where(key: str) -> str:
        lineno = (lines or {}).get(key)
        return f"{path}:{lineno}" if lineno else path

    unknown = [k for k in values if k not in KEYS]
    if unknown:
        key = unknown[0]
        reads = (
            ", and llama-server reads LLAMA_ARG_* variables as flags behind the typed config"
            if key.startswith("LLAMA_ARG_")
            else ""
        )
        raise LaunchError(
            f"{where(key)}: unknown key {key!r}: bash would set it (set -a exports it to "
            f"llama-server){reads}; an env file for llama-launcher holds only "
            f"{', '.join(KEYS)} (llama-server flags go into EXTRA_ARGS)"
        )
    if "VLLM_PYTHON" in values and "LLAMA_SERVER" in values:
        raise LaunchError(
            f"{where('VLLM_PYTHON')}: the env file sets both LLAMA_SERVER and VLLM_PYTHON; "
            "one unit runs one server: keep the one of its backend (install --backend)"
        )
    vllm = "VLLM_PYTHON" in values
    required = ("VLLM_PYTHON", "EXTRA_ARGS") if vllm else REQUIRED
    missing = [k for k in required if not values.get(k)]
    if missing:
        key = missing[0]
        state = "is empty" if key in values else "is missing (no line sets it)"
        raise LaunchError(
            f"{where(key)}: {key} {state}: a bash launcher would "
            + (
                "start llama-server without its flags"
                if key == "EXTRA_ARGS"
                else "run the first word of EXTRA_ARGS as the program"
            )
            + f'; set it, e.g. {key}="..."'
        )
    try:
        words = envfile.split_words(values["EXTRA_ARGS"])
    except ValueError as e:
        raise LaunchError(f"{where('EXTRA_ARGS')}: {e}") from None
    if vllm:
        return _vllm_from(values, words, where)
    for word in words:
        if word in ("--api-key",) or word.startswith("--api-key="):
            raise LaunchError(
                f"{where('EXTRA_ARGS')}: EXTRA_ARGS carries --api-key: bash would put the key "
                "on llama-server's command line, where any user can read it with ps; put "
                "the key in a file and set API_KEY_FILE instead"
            )
    argv = [values["LLAMA_SERVER"], *words]
    if not any(w == "--log-colors" or w.startswith("--log-colors=") for w in words):
        argv += ["--log-colors", "off"]
    if values.get("API_KEY_FILE"):
        argv += ["--api-key-file", values["API_KEY_FILE"]]
    return argv


def vllm_argv(python: str, words: Sequence[str]) -> list[str]:
    """What a vLLM env file launches: its python runs ``vllm serve`` through the shim."""
    return [python, VLLM_SHIM, "serve", *words]


def _vllm_from(values: Mapping[str, str], words: list[str], where: Any) -> list[str]:
    for word in words:
        if word == "--api-key" or word.startswith("--api-key="):
            raise LaunchError(
                f"{where('EXTRA_ARGS')}: EXTRA_ARGS carries --api-key: bash would put the key "
                "on vLLM's command line, where any user can read it with ps; put the key in "
                "a file and set API_KEY_FILE instead"
            )
    if not words or words[0].startswith("-"):
        raise LaunchError(
            f"{where('EXTRA_ARGS')}: EXTRA_ARGS of a vLLM unit starts with the model folder "
            '(vllm serve MODEL ...), e.g. EXTRA_ARGS="/srv/models/my-model --port 8000"'
        )
    return vllm_argv(values["VLLM_PYTHON"], words)


#: Credential names of the system-scope unit (``LoadCredential=``; launcher.host.units).
ENV_CREDENTIAL = "env-file"
KEY_CREDENTIAL = "api-key"


def _credential(name: str) -> str | None:
    """The path of credential ``name`` PID 1 loaded for this service, if any."""
    folder = os.environ.get("CREDENTIALS_DIRECTORY")
    if not folder:
        return None
    path = os.path.join(folder, name)
    return path if os.path.isfile(path) else None


def read_argv(path: str) -> list[str]:
    """Read and parse the env file at ``path`` into llama-server's argv."""
    return read_launch(path)[0]


def read_launch(path: str) -> tuple[list[str], dict[str, str]]:
    """Read and parse the env file at ``path``: the server's argv, and what its environment
    adds for vLLM (its key, ``VLLM_API_KEY``, read from ``API_KEY_FILE``; ``TMPDIR``, the
    unit's ``RuntimeDirectory=``; no usage reports).

    Under the hardened unit the service's own user cannot read the env file or the key:
    PID 1 hands them over as credentials, read here in their place (messages still name
    ``path``, the file an operator edits)."""
    source = _credential(ENV_CREDENTIAL) or path
    try:
        # newline="": universal newlines would turn a CR into a line break and hide a CRLF
        # file, which bash reads with a CR at the end of every value, from the parser.
        with open(source, encoding="utf-8", newline="") as f:
            text = f.read()
    except OSError as e:
        raise LaunchError(f"cannot read the env file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise LaunchError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        values = envfile.parse(text, path)
    except envfile.EnvFileError as e:
        raise LaunchError(str(e)) from None
    argv = argv_from_values(values, path, _key_lines(text))
    key = _credential(KEY_CREDENTIAL)
    staged = bool(values.get("API_KEY_FILE") and key and os.path.getsize(key))
    if "VLLM_PYTHON" in values:
        env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        # the unit's RuntimeDirectory= (launcher.host.units): its temporary files go with it
        if runtime := os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]:
            env["TMPDIR"] = runtime
        if values.get("API_KEY_FILE"):
            env["VLLM_API_KEY"] = _first_key(key if staged and key else values["API_KEY_FILE"])
        return argv, env
    if staged and key:
        argv[-1] = key  # the staged copy of API_KEY_FILE (launcher.install.prestart)
    return argv, {}


def _first_key(path: str) -> str:
    """The first key in a key file (llama-server's --api-key-file takes one a line)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    return line.strip()
    except OSError as e:
        raise LaunchError(f"cannot read the API key file {path}: {e.strerror}") from None
    raise LaunchError(f"the API key file {path} holds no key; write one on its first line")


def server_environ(
    environ: Mapping[str, str], added: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment the server gets: ours, less the variables llama-server would read as
    flags, plus ``added`` (vLLM's: ``read_launch``). An empty ``VLLM_CPU_KVCACHE_SPACE``
    is dropped: vLLM's CPU worker dies on it (``int('')``)."""
    env = {
        k: v
        for k, v in environ.items()
        if k not in _SCRUBBED and not k.startswith(_SCRUBBED_PREFIXES)
    }
    if added:
        if not env.get("VLLM_CPU_KVCACHE_SPACE", "x").strip():
            del env["VLLM_CPU_KVCACHE_SPACE"]
        env.pop("VLLM_API_KEY", None)  # only the env file's key: an inherited one is not

        for k, v in added.items():
            env.setdefault(k, v)
    return env


#: execve errors that a restart cannot cure: the config names a wrong file
_PERMANENT = frozenset(
    {errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR, errno.ELOOP, errno.EISDIR}
)
_USAGE = "usage: llama-launcher exec --env-file PATH [--port N] [--print-argv]"


def with_port(argv: list[str], port: str) -> list[str]:
    """``argv`` listening on ``port``: the value of its ``--port`` replaced (or ``--port N``
    added). The second instance's unit runs the same env file on a port of its own."""
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--port {port!r} is no TCP port (1-65535)")
    out = list(argv)
    for i in range(len(out) - 2, 0, -1):
        if out[i] == "--port":
            out[i + 1] = port
            return out
    return [*out, "--port", port]


def _parse_args(args: Sequence[str]) -> tuple[str, bool, str | None]:
    env_file, print_argv, port, i = "", False, None, 0
    while i < len(args):
        a = args[i]
        if a == "--env-file" and i + 1 < len(args):
            env_file, i = args[i + 1], i + 2
        elif a.startswith("--env-file="):
            env_file, i = a.split("=", 1)[1], i + 1
        elif a == "--port" and i + 1 < len(args):
            port, i = args[i + 1], i + 2
        elif a == "--print-argv":
            print_argv, i = True, i + 1
        elif a in ("-h", "--help"):
            print(
                _USAGE
                + "\n\nRead the env file strictly and exec its server (llama-server, or vLLM) "
                "(--port N: listen on N whatever the env file says; --print-argv: print the "
                "argv as JSON and exit)."
            )
            raise SystemExit(0)
        else:
            raise LaunchError(f"unexpected argument {a!r}; {_USAGE}")
    if not env_file:
        raise LaunchError(f"--env-file is required; {_USAGE}")
    return env_file, print_argv, port


def main(args: Sequence[str]) -> int:
    """Entry point of ``llama-launcher exec``; returns an exit status or does not return."""
    try:
        env_file, print_argv, port = _parse_args(args)
        argv, added = read_launch(env_file)
        if port is not None:
            argv = with_port(argv, port)
        if print_argv:
            import json

            print(json.dumps(argv))
            return 0
        try:
            os.execve(argv[0], argv, server_environ(os.environ, added))
        except OSError as e:
            if e.errno not in _PERMANENT:
                # ETXTBSY (the binary is being replaced), ENOMEM, EAGAIN, EIO: may clear
                # on its own, so not EX_CONFIG - systemd's Restart= retries
                print(
                    f"llama-launcher: cannot execute {argv[0]!r}: {e.strerror}; "
                    "exiting 1 so systemd's Restart= tries again",
                    file=sys.stderr,
                )
                return 1
            key = "VLLM_PYTHON" if added else "LLAMA_SERVER"
            what = "the python of vLLM's venv" if added else "the llama-server binary"
            raise LaunchError(
                f"cannot execute {key}={argv[0]!r}: {e.strerror}; set {key} to {what}"
            ) from None
    except LaunchError as e:
        print(f"llama-launcher: config error: {e}", file=sys.stderr, flush=True)
        return envfile.EX_CONFIG
    return 0  # pragma: no cover - execve does not return


def argv_of_text(text: str | None, source: str) -> list[str]:
    """The argv an env file's text launches (empty for no file), for diffs and the gate."""
    if text is None:
        return []
    try:
        return argv_from_values(envfile.parse(text, source))
    except (envfile.EnvFileError, LaunchError):
        return ["(unreadable live env file)"]
