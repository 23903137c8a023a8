"""The validation chain: prove what llama-server will receive before anything live is touched.

Runs on the rendered temporary file; each step is named in its error:

1. ``lint``       the launcher's strict parser reads the file;
2. ``bash -n``    bash parses it;
3. ``subshell``   ``env -i bash -c 'set -f; source FILE; printf ...'`` prints exactly the
                  expected values (with expansion and globbing off);
4. ``argv``       ``llama-launcher exec --print-argv`` on the file equals the typed argv;
5. ``flags``      every flag is known to the installed llama-server (``--help``), and every
                  other word is the value of the flag before it;
6. ``model``      the model exists, is readable and is a GGUF whose metadata loads;
   ``files``      every other file llama-server opens (``--lora``, ``--mmproj``, ``-md``,
                  ``--chat-template-file``, ...) is an absolute path that exists and is
                  readable, and a GGUF where llama-server loads one;
   ``files``      and ``--slot-save-path`` is a folder the service can write;
7. ``service``    (system scope) the hardened unit's own user can open the binary, the model
                  and every other file llama-server reads, and write the slot folder
                  (``launcher.host.service``);
8. ``pool``       the pool arithmetic: no over-committed shared pool unless allowed;
9. ``memory``     KV estimate + weights + prompt cache fit what the box can give, on each
                  side: the host and every device of ``--list-devices``
                  (``launcher.config.memory``).
10. ``port``      (a deploy, with the unit's state) no process but the unit's own listens
                  where the server will: llama-server exits at start when it cannot bind,
                  and the deploy would have stopped the serving one for it
                  (``launcher.host.ports``).
"""

from __future__ import annotations

import getpass
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from launcher import config
from launcher.config import memory
from launcher.config import vllm as vllm_config
from launcher.errors import CommandError, ConfigInvalid, MemoryGuardError, ValidationFailed
from launcher.host import launch, ports, proc, service, units
from launcher.server import binary, devices, filefacts, kvbytes, kvlayout, vllm

if TYPE_CHECKING:
    from launcher.host.systemd import UnitState

T = TypeVar("T")

#: The per-slot cap: offered only where the binary has it (b10901 and later).
CAP = "--kv-unified-per-slot"
STEPS = (
    "lint",
    "bash -n",
    "subshell",
    "argv",
    "flags",
    "model",
    "files",
    "service",
    "pool",
    "memory",
)
#: llama-server flags whose value is a file it reads (common/arg.cpp, b11434); --lora and
#: --mmproj also take comma-separated lists.
FILE_FLAGS = {
    "--lora": "LoRA adapter",
    "--lora-scaled": "LoRA adapter",
    "-mm": "multimodal projector",
    "--mmproj": "multimodal projector",
    "-md": "draft model",
    "--model-draft": "draft model",
    "--grammar-file": "grammar file",
    "-jf": "JSON schema file",
    "--json-schema-file": "JSON schema file",
    "--control-vector": "control vector",
    "--control-vector-scaled": "control vector",
    "-lcs": "lookup cache",
    "--lookup-cache-static": "lookup cache",
}
#: Files llama-server loads as GGUF beside the model (names of ``FILE_FLAGS``).
GGUF_FILES = ("LoRA adapter", "multimodal projector", "draft model", "control vector")


def files_of(cfg: config.ServerConfig) -> list[tuple[str, Path]]:
    """(what it is, path) of every file llama-server opens, the binary first."""
    files = [("llama-server binary", cfg.llama_server), ("model", cfg.model)]
    if cfg.chat_template_file:
        files.append(("chat template", cfg.chat_template_file))
    words = list(cfg.extra_args)
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in FILE_FLAGS:
            value = value if eq else (words[i + 1] if i + 1 < len(words) else "")
            for v in value.split(","):
                if name.endswith("-scaled"):  # FNAME:SCALE
                    v = v.rpartition(":")[0] or v
                if v:
                    files.append((FILE_FLAGS[name], Path(v)))
    return files


@dataclass(frozen=True)
class Validated:
    """A config that passed every step, with what the steps learned."""

    config: config.AnyConfig
    env_text: str
    values: dict[str, str]
    argv: list[str]
    plan: kvlayout.PoolPlan
    model: dict[str, Any]
    server: binary.BinaryInfo | vllm.VllmInfo
    memory: memory.Need
    steps: tuple[str, ...] = field(default=STEPS)
    #: the unit's front admits against the shared pool (``launcher.deploy.restart.admission``)
    admitted: bool = False
    #: what the checks say of a config that passes them (vLLM's pool: ``vllm.pool_plan``)
    notes: tuple[str, ...] = ()

    @property
    def warnings(self) -> list[str]:
        """What a deploy of it says: a pool over-committed on purpose (allow_overcommit), or
        one the front admits against."""
        if isinstance(self.config, config.VllmConfig):
            return list(self.notes)
        if self.plan.overcommitted and self.admitted:
            return [config.admission_note(self.plan)]
        if self.plan.overcommitted and self.config.allow_overcommit:
            return [config.overcommit_warning(self.plan)]
        return []

    def describe(self) -> str:
        """The plan in a sentence: the startup line's figures, or vLLM's."""
        if not isinstance(self.config, config.VllmConfig):
            return self.plan.describe(self.admitted)
        p = self.plan
        if not p.exact:
            return (
                f"vLLM {p.n_slots} sequences x {p.n_ctx_slot} tokens, one KV pool vLLM sizes "
                "at start (its KV cache line says how large)"
            )
        text = (
            f"vLLM {p.n_slots} sequences x {p.n_ctx_slot} tokens, one KV pool of {p.n_ctx} tokens"
        )
        if p.overcommitted:
            return text + (
                f": when all are long vLLM preempts and queues (none fails); "
                f"{p.guaranteed_window} tokens each while all {p.n_slots} run"
            )
        return text + ": every sequence fits at once"

    def meta(self) -> dict[str, Any]:
        """What the generation store keeps about it (the config with its secrets masked)."""
        return {
            "time": time.time(),
            "user": _user(),
            "argv": self.argv,
            "config": self.config.masked(),
            "model": self.model,
            **(
                {"vllm": self.server.meta()}
                if isinstance(self.server, vllm.VllmInfo)
                else {
                    "llama_server": {
                        "path": self.server.path,
                        "version": self.server.version,
                        "fingerprint": self.server.fingerprint,
                    }
                }
            ),
            "kv_estimate": self.memory.to_dict(),
        }


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _step_lint(path: Path) -> list[str]:
    try:
        return launch.read_argv(str(path))
    except launch.LaunchError as e:
        raise ValidationFailed("lint", str(e)) from None


def _step_bash_n(path: Path) -> None:
    try:
        proc.run(["bash", "-n", str(path)], timeout=10)
    except CommandError as e:
        raise ValidationFailed("bash -n", e.stderr.strip() or str(e)) from e


def check_bytes(path: Path) -> list[str]:
    """The cheap checks on an env file's own bytes (a rollback's, ``launcher.deploy.rollback``):
    the strict parse and ``bash -n``; the argv it launches."""
    argv = _step_lint(path)
    _step_bash_n(path)
    return argv


def _step_subshell(path: Path, values: dict[str, str]) -> None:
    names = list(values)
    script = 'set -f; source "$1" || exit 97; shift; for n in "$@"; do printf "%s\\0" "${!n}"; done'
    try:
        r = proc.run(
            ["env", "-i", "bash", "-c", script, "bash", str(path), *names], timeout=10, env={}
        )
    except CommandError as e:
        raise ValidationFailed("subshell", f"sourcing the file failed: {e}") from e
    got = r.stdout.split("\0")[: len(names)]
    for name, value in zip(names, got, strict=False):
        if value != values[name]:
            raise ValidationFailed(
                "subshell", f"bash reads {name} as [{value}] but the config means [{values[name]}]"
            )
    if len(got) != len(names):
        raise ValidationFailed("subshell", f"bash printed {len(got)} values for {len(names)}")


def _step_argv(path: Path, expected: list[str]) -> None:
    # exactly the way the unit runs it: python -S -m launcher, the package on PYTHONPATH
    python, package_dir = units.this_python()
    try:
        r = proc.run(
            [python, "-S", "-m", "launcher", "exec", "--env-file", str(path), "--print-argv"],
            timeout=30,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": package_dir},
        )
        got = json.loads(r.stdout)
    except (CommandError, ValueError) as e:
        raise ValidationFailed("argv", f"llama-launcher exec --print-argv failed: {e}") from e
    if got != expected:
        raise ValidationFailed(
            "argv",
            "the launcher would exec\n  "
            + json.dumps(got)
            + "\nbut the config means\n  "
            + json.dumps(expected),
        )


def check_flags(info: binary.BinaryInfo, args: list[str]) -> None:
    """Refuse flags the installed llama-server does not know, with a did-you-mean."""
    if info.log_colors_off() != ["--log-colors", "off"]:
        # the launcher turns colours off with "--log-colors off" (launch.py, config.argv)
        raise ValidationFailed(
            "flags",
            f"{info.path} ({info.name}) takes --log-colors without a value; llama-launcher "
            "needs a build whose --log-colors takes on|off|auto (b9093 and later do)",
        )
    for name in binary.unknown_flags(info, args):
        if replaced := info.replacement(name):
            hint = f"this build dropped it; use {replaced}"
        elif name == CAP:
            hint = (
                f"it came with b{binary.FLAG_ADDED_IN[CAP]} ({binary.FLAG_ADDED_BY[CAP]}); on this "
                "build guarantee each slot its window with split pools (-no-kvu, -c slots x "
                "window), fewer slots (-np) or a smaller window, or install b"
                f"{binary.FLAG_ADDED_IN[CAP]} or later"
            )
        else:
            close = info.suggest(name)
            hint = f"did you mean {' or '.join(close)}?" if close else "see llama-server --help"
        raise ValidationFailed(
            "flags", f"{name} is not a flag of {info.path} ({info.name}); {hint}"
        )
    for stray in binary.stray_words(info.arity, args):
        raise ValidationFailed("flags", stray.message(f"{info.path} ({info.name})"))


def model_facts(path: Path) -> tuple[dict[str, Any], kvbytes.ModelInfo | None, str | None]:
    """Identity and metadata of the GGUF at ``path``, its KV layout (None with the reason
    when the estimator does not cover it); raises ValidationFailed('model')."""
    if not path.exists():
        raise ValidationFailed("model", f"the model file {path} does not exist; check -m/model")
    if not os.access(path, os.R_OK):
        raise ValidationFailed("model", f"the model file {path} is not readable; fix its mode")
    meta = filefacts.cached(
        "gguf-meta-v1",
        filefacts.file_key(path),
        lambda: _read_meta(path),
        valid=lambda d: isinstance(d.get("metadata"), dict) and isinstance(d.get("weights"), int),
    )
    md, weights = meta["metadata"], int(meta["weights"])
    arch = str(md.get("general.architecture", ""))
    n_ctx_train = md.get(f"{arch}.context_length")
    st = path.stat()
    facts = {
        "path": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino,
        "arch": arch,
        "weights": weights,
        "n_ctx_train": n_ctx_train if isinstance(n_ctx_train, int) else None,
    }
    try:
        return facts, kvbytes.ModelInfo.from_metadata(md, str(path), weights), None
    except kvbytes.EstimateUnsupported as e:
        return facts, None, str(e)
    except ConfigInvalid as e:
        raise ValidationFailed("model", str(e)) from None


def check_files(cfg: config.ServerConfig) -> None:
    """Step ``files``: the files beside the model, checked the way ``-m`` is (the server
    would fail at start, after the restart, with a log line naming only one of them)."""
    for what, path in files_of(cfg)[2:]:
        if not path.is_absolute():
            raise ValidationFailed(
                "files",
                f"the {what} {str(path)!r} is a relative path; the unit runs llama-server "
                f"from /, where it names another file: give the absolute path",
            )
        if not path.is_file():
            state = "is not a file" if path.exists() else "does not exist"
            raise ValidationFailed("files", f"the {what} {path} {state}; check its flag's value")
        try:
            with path.open("rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ValidationFailed(
                "files", f"the {what} {path} is not readable ({e.strerror}); fix its mode"
            ) from None
        if what in GGUF_FILES and magic != b"GGUF":
            raise ValidationFailed(
                "files",
                f"the {what} {path} is not a GGUF file (it starts with {magic!r}, not "
                "b'GGUF'); llama-server loads only GGUF files there",
            )


def check_slot_folder(
    cfg: config.ServerConfig, svc: service.ServiceView | None, made: Path | None = None
) -> None:
    """``--slot-save-path``: llama-server refuses to start when it is not a folder (b11434:
    ``error while handling argument "--slot-save-path": not a directory: X``, exit 1), and a
    save fails when the service cannot write it. ``made``: the folder the deploy itself gives
    a config (the slot carry's), which the deploy (user scope) or systemd (a
    ``StateDirectory=``) makes before the start."""
    path = cfg.slot_save_path
    if path is None:
        return
    what = "slot folder (--slot-save-path)"
    if not path.is_absolute():
        raise ValidationFailed(
            "files",
            f"the {what} {str(path)!r} is a relative path; the unit runs llama-server from /, "
            "where it names another folder: give the absolute path",
        )
    if svc is not None:
        service.check_writable(svc, what, path)
        return
    if made is not None and path == made:
        return
    if not path.is_dir():
        state = "is not a folder" if path.exists() else "does not exist"
        raise ValidationFailed(
            "files",
            f"the {what} {path} {state}: llama-server exits at start (not a directory). Make "
            f"it (mkdir -p {path}), or leave --slot-save-path out: the deploy then carries "
            "the slots in a folder of its own",
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValidationFailed(
            "files",
            f"the {what} {path} is not writable by {_user()}, whom the user unit runs as; "
            f"fix its mode (chmod u+w {path}) or leave --slot-save-path out",
        )


def check_world(
    cfg: config.ServerConfig, svc: service.ServiceView | None, made: Path | None = None
) -> tuple[dict[str, Any], kvbytes.ModelInfo | None, str | None]:
    """Steps ``model``, ``files`` and ``service``: every file the config names exists, is
    what llama-server loads there, and the service's user can read it; the slot folder is
    one it can write. A rollback runs them too: they can change after a config served."""
    facts = model_facts(cfg.model)
    check_files(cfg)
    if svc is not None:
        service.check(svc, files_of(cfg))
    check_slot_folder(cfg, svc, made)
    return facts


def check_served(
    cfg: config.ServerConfig,
    argv: list[str],
    svc: service.ServiceView | None,
    made: Path | None = None,
) -> binary.BinaryInfo:
    """What can change under a generation since it served, for a rollback to it: the binary
    still runs and knows every word of ``argv`` (steps ``llama-server``, ``flags``), and
    ``check_world``. The memory guard and the pool check are not run: serving proved them."""
    info = binary.inspect(argv[0])
    check_flags(info, argv[1:])
    check_world(cfg, svc, made)
    return info


def _read_meta(path: Path) -> dict[str, Any]:
    """The GGUF metadata, read with the gguf package (llama.cpp's reader); JSON-able."""
    try:
        md = kvbytes.read_metadata(path)
        weights = kvbytes.weights_size(path, md)
    except ConfigInvalid as e:
        raise ValidationFailed("model", str(e)) from None
    except Exception as e:
        raise ValidationFailed(
            "model", f"{path} is not a GGUF model llama-server can load ({e})"
        ) from e
    return {"metadata": md, "weights": weights}


def validate_file(
    path: Path, cfg: config.ServerConfig, values: dict[str, str], expected_argv: list[str]
) -> binary.BinaryInfo:
    """Steps 1-5 on an env file already written at ``path``."""
    info: binary.BinaryInfo = check_file(
        path, values, expected_argv, lambda: binary.inspect(str(cfg.llama_server))
    )
    check_flags(info, expected_argv[1:])
    return info


def check_file(
    path: Path, values: dict[str, str], expected_argv: list[str], server: Callable[[], Any]
) -> Any:
    """Steps 1-4 on an env file already written at ``path``, with ``server()`` (what the
    installed server is: its ``--help``) asked beside them; its answer."""
    argv = _step_lint(path)
    if argv != expected_argv:
        raise ValidationFailed(
            "lint", f"the parser reads {argv} but the config means {expected_argv}"
        )
    # The three subprocess steps are independent: run them at once (they cost a process
    # start each on every deploy), then report the first failure in chain order.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as workers:
        steps = [
            workers.submit(_step_bash_n, path),
            workers.submit(_step_subshell, path, values),
            workers.submit(_step_argv, path, expected_argv),
        ]
        info = server()
        for step in steps:
            step.result()
    return info


#: The box's devices, passed in: a tuple, or a function that reads them (the binary's
#: ``--list-devices``, asked only when the memory step is reached).
Devices = Sequence[devices.Device] | Callable[[], Sequence[devices.Device]]
Releasable = int | Mapping[str, int] | Callable[[], int | Mapping[str, int]]


def validate(
    cfg: config.AnyConfig,
    key_file: str | None = None,
    workdir: Path | None = None,
    releasable: Releasable = 0,
    force_memory: bool = False,
    box: Devices | None = None,
    available: int | None = None,
    unified: devices.UnifiedSetting = "auto",
    svc: service.ServiceView | None = None,
    made: Path | None = None,
    admitted: bool = False,
) -> Validated:
    """Render ``cfg`` to a temporary file and run the whole chain on it.

    ``releasable``: bytes the running server frees when it is restarted (memory guard), on
    the host or per side, or a function that gives them, asked only when the guard is
    reached. ``box``: the devices (default: the binary's ``--list-devices``, each marked
    unified per ``unified``); ``available``: the host's free memory (default MemAvailable).
    ``svc``: the hardened unit's view, whose user must be able to read every file (None: the
    service reads as the caller). ``made``: the slot folder the deploy makes itself.
    ``admitted``: the unit's front admits requests against the shared pool, so a pool that
    promises more than it holds passes step ``pool`` (no request is killed by another's).
    """
    if isinstance(cfg, config.VllmConfig):
        return validate_vllm(cfg, key_file, workdir, releasable, force_memory, available, svc)
    text, values, expected, info = _candidate(
        cfg, key_file, workdir, lambda path, v, e: validate_file(path, cfg, v, e)
    )
    model, layout, unsupported = check_world(cfg, svc, made)
    try:
        plan = cfg.check_overcommit(
            model.get("n_ctx_train"), info.lacks(CAP), info.np_default, admitted
        )
    except ConfigInvalid as e:
        raise ValidationFailed("pool", str(e)) from None
    need = memory_step(cfg, plan, model, layout, unsupported, info, box, unified)
    memory.guard(
        need, releasable() if callable(releasable) else releasable, force_memory, available
    )
    return Validated(cfg, text, values, expected, plan, model, info, need, admitted=admitted)


def _candidate(
    cfg: config.AnyConfig,
    key_file: str | None,
    workdir: Path | None,
    steps: Callable[[Path, dict[str, str], list[str]], T],
) -> tuple[str, dict[str, str], list[str], T]:
    """``cfg`` rendered to a temporary env file (0600) and ``steps`` run on it (its path,
    the values it must hold, the argv it must launch): the text, values, argv and what the
    steps said of the installed server."""
    text = config.render_env(cfg, key_file)
    values = config.env_values(cfg, key_file)
    expected = cfg.argv(key_file)
    with tempfile.TemporaryDirectory(prefix="llama-launcher-", dir=workdir) as tmp:
        path = Path(tmp) / "candidate.env"
        path.write_text(text)
        os.chmod(path, 0o600)
        return text, values, expected, steps(path, values, expected)


def check_port(
    cfg: config.AnyConfig,
    running: UnitState | None,
    unit: str | None = None,
    proc_dir: Path = Path("/proc"),
) -> None:
    """Step ``port``: no process but the unit's own (``running``'s MainPID, or a process in
    the cgroup of ``unit``) listens where the config's server will. Another holder is
    refused, named (its command, pid and unit), before anything stops: llama-server would
    exit at start with "couldn't bind HTTP server socket" and the deploy roll back."""
    found = ports.on(cfg.host, cfg.port, proc_dir)
    if not found:
        return
    inodes = {s.inode for s in found}
    own = running.main_pid if running is not None else 0
    if own > 0 and inodes <= (ports.socket_inodes(own, proc_dir) or set()):
        return  # the serving server's own socket: the restart frees it
    held = ports.holders(inodes, proc_dir)
    others = [h for h in held if h.pid != own and (unit is None or h.unit != unit)]
    if held and not others:
        return
    where = ", ".join(sorted({f"{s.host}:{s.port}" for s in found}))
    if others:
        who = " and ".join(h.describe() for h in others)
        services = [h.unit for h in others if h.unit and h.unit.endswith(".service")]
        if any(h.comm == "systemd" for h in others):  # a socket unit: its service is passed it
            stop = "stop the socket unit that listens there (`systemctl list-sockets` names it)"
        else:
            stop = f"stop {services[0]}" if services else f"stop pid {others[0].pid}"
    else:
        inode = min(inodes)
        who = f"a process of another user (socket inode {inode})"
        stop = f"stop it (`sudo ss -ltnp 'sport = :{cfg.port}'` names it)"
    raise ValidationFailed(
        "port",
        f"the port {cfg.port} on {cfg.host} is held by {who}, listening on {where}; "
        f"the server could not bind it and would exit at start. Give another --port, or "
        f"{stop}; nothing was changed",
    )


def beside_state(
    cfg: config.AnyConfig,
    read_state: Callable[[], UnitState],
    check: bool,
    force_memory: bool = False,
    svc: service.ServiceView | None = None,
    box: Devices | None = None,
    unified: devices.UnifiedSetting = "auto",
    live_meta: Callable[[], Mapping[str, Any] | None] = lambda: None,
    made: Path | None = None,
    unit: str | None = None,
    admitted: bool = False,
) -> tuple[Validated, UnitState | None]:
    """``validate`` with the unit's state (a systemctl) read beside the chain's processes;
    the state tells the memory guard what the running server frees, on the host (its
    anonymous memory) and on each device (what the live generation's log reported there,
    ``live_meta``), and step ``port`` which listener is the serving server's own (``unit``:
    the unit's name, whose processes' sockets are its own too). Check mode works without a
    reachable systemd (a build box): the state is None then."""
    from concurrent.futures import ThreadPoolExecutor

    from launcher.errors import LauncherError

    with ThreadPoolExecutor(1) as workers:
        shown = workers.submit(read_state)

        def unit_state() -> UnitState | None:
            try:
                return shown.result()
            except LauncherError:
                if not check:
                    raise
                return None

        def releasable() -> dict[str, int]:
            running = unit_state()
            if not running or not running.running:
                return {}
            if isinstance(cfg, config.VllmConfig):  # its engine's processes hold its memory
                return {"host": memory.tree_releasable(running)}
            on_devices = memory.device_releasable(live_meta())
            return {**on_devices, "host": memory.releasable_memory(running)}

        checked = validate(
            cfg,
            releasable=releasable,
            force_memory=force_memory,
            svc=svc,
            box=box,
            unified=unified,
            made=made,
            admitted=admitted,
        )
        state = unit_state()
        check_port(checked.config, state, unit)
        return replace(checked, steps=(*checked.steps, "port")), state


def box_devices(
    server: str, unified: devices.UnifiedSetting = "auto"
) -> tuple[devices.Device, ...]:
    """The devices of the llama-server at ``server``, each marked unified or not."""
    found = binary.list_devices(server)
    return devices.mark_unified(found, memory.mem_total(), unified) if found else ()


def memory_step(
    cfg: config.ServerConfig,
    plan: kvlayout.PoolPlan,
    model: dict[str, Any],
    layout: kvbytes.ModelInfo | None,
    unsupported: str | None,
    info: binary.BinaryInfo,
    box: Devices | None,
    unified: devices.UnifiedSetting = "auto",
) -> memory.Need:
    """Where the bytes go on this box; with devices, llama-fit-params' figures beside."""
    if box is None:
        found: Sequence[devices.Device] = box_devices(str(cfg.llama_server), unified)
    else:
        found = box() if callable(box) else box
    tensors = model_tensors(cfg.model) if found else None
    need = memory.need(cfg, plan, layout, model["weights"], unsupported, tuple(found), tensors)
    if need.sides and box is None:
        need = with_fit_params(need, cfg, info)
    return need


def model_tensors(path: Path) -> dict[str, int]:
    """The model's weight tensors by name and bytes (cached per file identity)."""
    data = filefacts.cached(
        "gguf-tensors-v1",
        filefacts.file_key(path),
        lambda: {"tensors": _read_tensors(path)},
        valid=lambda d: isinstance(d.get("tensors"), dict),
    )
    return {str(k): int(v) for k, v in data["tensors"].items()}


def _read_tensors(path: Path) -> dict[str, int]:
    try:
        return kvbytes.read_tensor_sizes(path)
    except Exception as e:
        raise ValidationFailed("model", f"the tensors of {path} cannot be read ({e})") from e


def with_fit_params(
    need: memory.Need, cfg: config.ServerConfig, server: binary.BinaryInfo
) -> memory.Need:
    """``need`` with llama-fit-params' own figures beside it (where the build ships it)."""
    tool = binary.fit_params_binary(str(cfg.llama_server))
    if tool is None:
        return need
    try:
        lines, dropped = binary.fit_print(tool, cfg.server_args(), server)
    except (ValidationFailed, ConfigInvalid) as e:
        return replace(need, deferred=(*need.deferred, f"llama-fit-params gave no figures: {e}"))
    figures = {
        "tool": tool,
        "sides": [line.to_dict() for line in lines],
        "flags_left_out": dropped,
    }
    disagree = memory.fit_disagreements(need, lines)
    return replace(need, fit_params=figures, deferred=(*need.deferred, *disagree))


# -- a vLLM unit -------------------------------------------------------------------------------

#: the checks of a vLLM config, in order (``port`` follows where the unit's state is read)
VLLM_STEPS = ("lint", "bash -n", "subshell", "argv", "vllm", "flags", "model", "pool", "memory")
#: files one of which is a tokenizer vLLM loads from a model folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
#: what vLLM's engine takes beside its KV cache and the weights (torch, the workers)
VLLM_OVERHEAD = 2 * 2**30


def validate_vllm(
    cfg: config.VllmConfig,
    key_file: str | None = None,
    workdir: Path | None = None,
    releasable: Releasable = 0,
    force_memory: bool = False,
    available: int | None = None,
    svc: service.ServiceView | None = None,
) -> Validated:
    """The chain for a vLLM config: the file steps as for llama-server, then the installed
    vLLM and its flags (``--help=all``), the model folder (a config and a tokenizer), the
    KV budget (explicit, and room for one whole sequence) and the memory guard."""
    text, values, expected, info = _candidate(
        cfg,
        key_file,
        workdir,
        lambda path, v, e: check_file(
            path, v, e, lambda: vllm.inspect(str(cfg.vllm_python), launch.VLLM_SHIM)
        ),
    )
    unknown = vllm.unknown_flags(info, list(cfg.extra_args))
    if unknown:
        raise ValidationFailed(
            "flags",
            f"{unknown[0]} is not a flag of vllm serve ({info.name} at {info.path}); see "
            f"`vllm serve --help=all`",
        )
    shape, model = vllm_model(cfg)
    if svc is not None:
        service.check(svc, [("vLLM python", cfg.vllm_python), ("model folder", cfg.model)])
    said = cfg.budget_said()
    if said:
        raise ValidationFailed("pool", said)
    try:
        plan, notes = vllm_config.pool_plan(cfg, shape, info.cpu)
    except ConfigInvalid as e:
        raise ValidationFailed("pool", str(e)) from None
    need = vllm_need(cfg, shape, model, info.cpu)
    if need.total is not None and not force_memory:
        frees = releasable() if callable(releasable) else releasable
        host = frees if isinstance(frees, int) else frees.get("host", 0)
        free = (memory.mem_available() if available is None else available) + host
        if need.total > free:
            raise MemoryGuardError(
                f"vLLM needs about {need.total / memory.MiB:,.0f} MiB of this host (its KV "
                f"budget {(need.kv or 0) / memory.MiB:,.0f} + weights and its engine "
                f"{need.weights / memory.MiB:,.0f}) but the host can give "
                f"{free / memory.MiB:,.0f} MiB (MemAvailable + {host / memory.MiB:,.0f} the "
                "running server frees). Cheapest fixes: a smaller --kv-cache-memory-bytes; "
                "--kv-cache-dtype fp8 (half the bytes a token: the same pool in half the "
                "budget); free memory. Or deploy anyway with --force-memory."
            )
    return Validated(
        cfg, text, values, expected, plan, model, info, need, steps=VLLM_STEPS, notes=tuple(notes)
    )


def served_vllm(
    cfg: config.VllmConfig,
    text: str,
    values: dict[str, str],
    argv: list[str],
    need: memory.Need,
) -> Validated:
    """A rollback's checks of a vLLM generation that served: vLLM is still installed and
    knows its flags, the model folder is still whole; the pool as planned then."""
    info = vllm.inspect(str(cfg.vllm_python), launch.VLLM_SHIM)
    unknown = vllm.unknown_flags(info, list(cfg.extra_args))
    if unknown:
        raise ValidationFailed("flags", f"{unknown[0]} is no longer a flag of {info.name}")
    shape, model = vllm_model(cfg)
    try:
        plan, notes = vllm_config.pool_plan(cfg, shape, info.cpu)
    except ConfigInvalid as e:
        raise ValidationFailed("pool", str(e)) from None
    return Validated(
        cfg, text, values, argv, plan, model, info, need, steps=VLLM_STEPS, notes=tuple(notes)
    )


def vllm_need(
    cfg: config.VllmConfig, shape: vllm_config.ModelShape, model: dict[str, Any], cpu: bool
) -> memory.Need:
    """What a vLLM config takes of the host: on its CPU build the KV budget, the weights and
    the engine (torch, the workers: ``VLLM_OVERHEAD``); on a GPU the KV cache and the weights
    are the device's, sized by vLLM itself (the gate reads its KV line), so the host's guard
    has nothing it can add up."""
    weights = int(model.get("weights_bytes") or 0)
    estimate = {
        "bytes_per_token": shape.bytes_per_token(cfg),
        "engine_bytes": VLLM_OVERHEAD,
        "weights_file_bytes": weights,
    }
    if not cpu or not cfg.kv_cache_memory_bytes:
        return memory.Need(
            kv=None,
            weights=weights,
            cache_ram=0,
            estimate=estimate,
            unsupported="vLLM sizes its KV cache on the device (or by "
            "--gpu-memory-utilization): its startup line is the check",
        )
    return memory.Need(
        kv=cfg.kv_cache_memory_bytes,
        weights=weights + VLLM_OVERHEAD,
        cache_ram=0,
        estimate=estimate,
        unsupported=None,
    )


def vllm_model(cfg: config.VllmConfig) -> tuple[vllm_config.ModelShape, dict[str, Any]]:
    """Step ``model`` of a vLLM config: a folder with a config.json and a tokenizer (one
    given with ``--tokenizer`` counts); its shape, and what the generation records of it."""
    folder = cfg.model
    if not folder.is_dir():
        raise ValidationFailed(
            "model",
            f"the model folder {folder} "
            + ("is a file" if folder.exists() else "does not exist")
            + "; vLLM serves a Hugging Face model folder (config.json, the weights and a "
            "tokenizer): give its absolute path",
        )
    try:
        shape = vllm_config.ModelShape.read(folder)
    except ConfigInvalid as e:
        raise ValidationFailed("model", str(e)) from None
    own_tokenizer = any(w == "--tokenizer" or w.startswith("--tokenizer=") for w in cfg.extra_args)
    if not own_tokenizer and not any((folder / n).is_file() for n in TOKENIZER_FILES):
        raise ValidationFailed(
            "model",
            f"the model folder {folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}): vLLM "
            "would exit at startup; copy the model's tokenizer files into it, or pass "
            "--tokenizer FOLDER",
        )
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors")) or sum(
        p.stat().st_size for p in folder.glob("*.bin")
    )
    model = {
        "path": str(folder),
        "n_ctx_train": shape.max_position,
        "layers": shape.layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "weights_bytes": weights,
    }
    return shape, model
