"""The verbs of the config life cycle: render, check, deploy, set, unset, rollback, status,
history, install, uninstall, recover, and the two a unit's timers run (front-release,
stop-warm). Their options are declared in ``launcher.cli.table``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from launcher.cli.results import emit, human

if TYPE_CHECKING:
    from launcher.config import AnyConfig, ToolSettings
    from launcher.deploy.outcome import Result
    from launcher.deploy.transaction import Deployer


# -- helpers -----------------------------------------------------------------------------------


def settings_from(ns: argparse.Namespace, lane: bool = True) -> ToolSettings:
    """The settings of the unit the options name: with ``--lane NAME`` (and ``lane``), the
    lane's (its unit, env file and state folder beside the main unit's)."""
    from launcher import config
    from launcher.install import install

    unit = getattr(ns, "unit", None)
    if getattr(ns, "instance", None):
        unit = instance_unit(ns.instance, unit)
    settings = config.load_settings(
        unit=unit,
        scope=ns.scope,
        env_file=ns.env_file,
        state_dir=ns.state_dir,
        base_url=ns.base_url,
        start_timeout=ns.start_timeout,
        health_timeout=ns.health_timeout,
        probe_timeout=ns.probe_timeout,
        lock_timeout=ns.lock_timeout,
        unit_dir=getattr(ns, "unit_dir", None),
        drain_timeout=0.0 if getattr(ns, "no_drain", False) else getattr(ns, "drain_timeout", None),
        bake=getattr(ns, "bake", None),
    )
    install.require_root(settings)
    if lane and getattr(ns, "lane", None):
        return install.lane_settings(settings, ns.lane)
    return settings


def instance_unit(instance: str, unit: str | None = None) -> str:
    """The template's unit of ``--instance NAME``; a different ``--unit`` beside it is refused."""
    from launcher.errors import ConfigInvalid

    name = f"llama-server@{instance}.service"
    if unit is not None and (unit if "." in unit else f"{unit}.service") != name:
        raise ConfigInvalid(
            f"--instance {instance} is {name}, but --unit names {unit}: give one of them"
        )
    return name


def config_from(ns: argparse.Namespace, base: dict[str, Any] | None = None) -> AnyConfig:
    """The desired config: --config TOML, then the server's flags on top (vLLM's for a
    unit of ``--backend vllm``, or one recorded so)."""
    import tomllib

    from launcher import config
    from launcher.errors import ConfigInvalid

    data: dict[str, Any] = dict(base or {})
    if ns.config:
        try:
            data.update(tomllib.loads(ns.config.read_text()))
        except OSError as e:
            raise ConfigInvalid(f"cannot read --config {ns.config}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigInvalid(f"--config {ns.config} is not valid TOML: {e}") from None
    backend = _backend(ns, data.pop("backend", None))
    if backend == "vllm":
        return _vllm_config(ns, data)
    if getattr(ns, "vllm_python", None):
        raise ConfigInvalid("--vllm-python is for a vLLM unit: add --backend vllm, or drop it")
    if ns.llama_server_bin:
        data["llama_server"] = ns.llama_server_bin
    if getattr(ns, "allow_overcommit", False):
        data["allow_overcommit"] = True
    data.setdefault("llama_server", _default_server())
    if "model" not in data and not any(f in ("-m", "--model") for f in ns.flags):
        raise ConfigInvalid('no model: give -m /path/to/model.gguf or model = "..." in --config')
    return config.from_flags(ns.flags, data)


def _backend(ns: argparse.Namespace, in_config: Any) -> str:
    """The server a desired config is for: ``--backend``, the config file's ``backend``, else
    the one the unit's newest generation recorded (a first install's that failed its gate
    too), else llama-server. Only ``install`` changes the server a unit runs (it rewrites
    the unit for it); another verb asking for another is refused before anything changes."""
    from launcher.errors import ConfigInvalid

    given = getattr(ns, "backend", None)
    if given and in_config and given != in_config:
        raise ConfigInvalid(
            f"--backend {given}, but --config {ns.config} says backend = {in_config!r}: give "
            "one of them"
        )
    if in_config not in (None, "llama-server", "vllm"):
        raise ConfigInvalid(
            f"backend = {in_config!r} in --config {ns.config} is not a backend; use "
            "'llama-server' or 'vllm'"
        )
    recorded = _recorded_backend(ns)
    backend = str(given or in_config or recorded or "llama-server")
    if recorded is not None and backend != recorded and getattr(ns, "verb", "") != "install":
        raise ConfigInvalid(
            f"the unit runs {recorded} (install recorded it in its generations); a deploy "
            f"does not change the server a unit runs: install --backend {backend} does (it "
            "rewrites the unit for it); nothing was changed"
        )
    return backend


def _recorded_backend(ns: argparse.Namespace) -> str | None:
    """The backend of the unit's newest generation (None: none stored, or unreadable)."""
    from launcher.deploy import home, store
    from launcher.errors import LauncherError

    try:
        st = store.Store(home.state_dir(settings_from(ns)), None)
        numbers = st.numbers()
        newest = st.get(numbers[-1]).meta if numbers else {}
    except (LauncherError, OSError, ValueError):
        return None
    if not (newest.get("config") or newest.get("argv")):
        return None
    return "vllm" if store.runs_vllm(newest) else "llama-server"


def _vllm_config(ns: argparse.Namespace, data: dict[str, Any]) -> AnyConfig:
    import os

    from launcher import config
    from launcher.errors import ConfigInvalid

    if ns.llama_server_bin:
        raise ConfigInvalid(
            "--llama-server is for a llama-server unit; a vLLM unit takes --vllm-python"
        )
    data["backend"] = "vllm"
    python = getattr(ns, "vllm_python", None) or os.environ.get("LLAMA_LAUNCHER_VLLM_PYTHON")
    if python:
        data["vllm_python"] = str(python)
    if "vllm_python" not in data:
        raise ConfigInvalid(
            "no vLLM: give --vllm-python /path/to/vllm-venv/bin/python (the venv vLLM is "
            "installed in; scripts/setup --vllm makes one) or vllm_python in --config"
        )
    if getattr(ns, "allow_overcommit", False):
        data["allow_overcommit"] = True
    first = ns.flags[0] if ns.flags else ""
    if "model" not in data and (not first or first.startswith("-")) and "--model" not in ns.flags:
        raise ConfigInvalid(
            "no model: give the model folder first (install --backend vllm /srv/models/NAME "
            '...) or model = "..." in --config'
        )
    return config.onto(ns.flags, data)


def _default_server() -> str:
    import os
    import shutil

    return (
        os.environ.get("LLAMA_SERVER_BIN")
        or shutil.which("llama-server")
        or "/usr/local/bin/llama-server"
    )


def deployer_for(ns: argparse.Namespace, unit_needed: bool = True) -> Deployer:
    from launcher.deploy.transaction import Deployer

    d = Deployer(
        settings_from(ns),
        progress=None if ns.json else _progress(),
        force_memory=bool(getattr(ns, "force_memory", False)),
        on_phase=ns.on_phase,
    )
    if unit_needed and not getattr(ns, "check", False):
        d.require_unit()
    return d


def _progress() -> Any:
    tty = sys.stderr.isatty()
    last = [0.0]

    slow = ("starting", "stopping", "loading")

    def show(phase: str, elapsed: float, line: str, expected: float | None = None) -> None:
        if not tty and (phase not in slow or elapsed < 2.0):
            return  # a log file wants only the slow waits, not every phase
        now = time.monotonic()
        if now - last[0] < (0.1 if tty else 2.0) and phase in slow:
            return
        last[0] = now
        of = f" of ~{expected:.3g}s" if expected else ""
        text = f"[{phase} {elapsed:5.1f}s{of}] {line[-100:]}" if elapsed else f"[{phase}]"
        try:
            if tty:
                print("\r\x1b[2K" + text, end="", file=sys.stderr, flush=True)
            else:
                print(text, file=sys.stderr, flush=True)
        except OSError:
            pass  # progress is for a reader; a closed stderr must not stop a transaction

    return show


def _finish(ns: argparse.Namespace, result: Result, settings: ToolSettings) -> int:
    if not ns.json and sys.stderr.isatty():
        print("\r\x1b[2K", end="", file=sys.stderr)
    emit(
        result.to_dict(),
        ns.json,
        lambda: human(
            result,
            getattr(ns, "diff", True) or result.outcome == "checked",
            ns.verbose,
            _second_instance(settings),
        ),
    )
    from launcher.errors import OUTCOME_EXIT

    return OUTCOME_EXIT.get(result.outcome, 0)


def _second_instance(settings: ToolSettings) -> bool:
    """Whether the unit has a second instance (``install --second-instance``): what a
    result says of one fitting beside the running server is news only then."""
    from launcher.deploy import home
    from launcher.deploy.restart.front import Front
    from launcher.errors import LauncherError

    try:
        spec = Front(home.state_dir(settings), settings.unit_name, settings.scope).spec()
    except LauncherError:
        return True  # a front spec that cannot be read: say all there is
    return spec is not None and spec.standby_port is not None


def _baked(ns: argparse.Namespace, d: Deployer, run: Callable[[], Result]) -> Result:
    """A verb that deploys, with its bake's hand-off (``launcher.watch.handoff``)."""
    from launcher.watch import handoff

    return handoff.baked(d, ns.verb, run, bool(getattr(ns, "wait", False)))


def _baking(ns: argparse.Namespace, d: Deployer) -> Deployer:
    """A deploy with a bake, refused before anything changes when nothing would watch it."""
    if not getattr(ns, "check", False):
        from launcher.watch import handoff

        handoff.require_carrier(d.settings)
    return d


# -- verbs -------------------------------------------------------------------------------------


def cmd_render(ns: argparse.Namespace) -> int:
    from launcher import config

    d = deployer_for(ns, unit_needed=False)
    deployed = d.preview(config_from(ns))
    text = config.render_env(deployed.config)
    front = d.front_of(deployed.config)
    data = {
        "env": text,
        "argv": deployed.config.argv(),
        "notes": list(deployed.notes),
        "front": front,
    }
    routing = (
        [f"llama-launcher: routing: {front['routing']}"] if front and "routing" in front else []
    )
    for note in [*deployed.notes, *routing] if not ns.json else ():
        print(note, file=sys.stderr)  # stdout is the env file's bytes
    emit(data, ns.json, lambda: text.rstrip("\n"))
    return 0


def cmd_check(ns: argparse.Namespace) -> int:
    ns.diff = True
    d = deployer_for(ns, unit_needed=False)
    return _finish(ns, d.deploy(config_from(ns), check=True, origin="check"), d.settings)


def cmd_deploy(ns: argparse.Namespace) -> int:
    d = _baking(ns, deployer_for(ns))
    cfg = config_from(ns)
    return _finish(ns, _baked(ns, d, lambda: d.deploy(cfg, check=ns.check)), d.settings)


def cmd_set(ns: argparse.Namespace) -> int:
    from launcher.errors import ConfigInvalid

    if not ns.flags:
        raise ConfigInvalid(
            "set needs the server's flags, e.g. llama-launcher set -ctk q8_0 (a vLLM unit: "
            "set --max-num-seqs 8)"
        )
    flags = ns.flags + (["--allow-overcommit"] if ns.allow_overcommit else [])
    from launcher import config
    from launcher.host import envfile

    d = _baking(ns, deployer_for(ns))
    origin = "set " + envfile.join_words(flags)

    def run() -> Result:
        return d.change(lambda live: config.onto(flags, live), origin, ns.check)

    return _finish(ns, _baked(ns, d, run), d.settings)


def cmd_unset(ns: argparse.Namespace) -> int:
    from launcher.errors import ConfigInvalid

    if not ns.flags:
        raise ConfigInvalid("unset needs flag names, e.g. llama-launcher unset -ctk -ctv")
    from launcher import config

    def edit(live: dict[str, Any]) -> AnyConfig:
        return config.without(live, ns.flags)

    origin = "unset " + " ".join(ns.flags)
    d = _baking(ns, deployer_for(ns))
    return _finish(ns, _baked(ns, d, lambda: d.change(edit, origin, ns.check)), d.settings)


def cmd_rollback(ns: argparse.Namespace) -> int:
    from launcher.watch import handoff

    d = deployer_for(ns)
    return _finish(ns, handoff.after(d, d.rollback(ns.to), ns.verb, bakes=False), d.settings)


def cmd_recover(ns: argparse.Namespace) -> int:
    from launcher.watch import bake

    d = deployer_for(ns)
    report = d.recover_only()
    # a bake whose revert was cut with its sampler: settled from what the generations say
    settled = bake.settle(d.store)
    data: dict[str, Any] = {"ok": True, "recovered": report}
    if settled is not None:
        data["bake"] = settled.view()

    def text() -> str:
        lines = recovered_lines(report, ns.verbose)
        if settled is not None:
            lines.append(bake.say(settled))
        return "\n".join(lines)

    emit(data, ns.json, text)
    return 0


def recovered_lines(report: dict[str, Any] | None, verbose: bool = False) -> list[str]:
    """``recover``'s report in words: the outcome first (a front left down before all),
    then what was done; ``verbose``: every field of the report too."""
    if not report:
        return ["nothing to recover"]
    lines = [report["front_down"]] if report.get("front_down") else []
    if "interrupted_phase" in report:
        lines.append(
            f"recovered: the deploy of generation {report.get('to')} was interrupted at "
            f"{report['interrupted_phase']}; {report.get('action', 'nothing was done')}"
        )
        gate = report.get("gate") or {}
        if gate:
            lines.append(f"  gate: {'passed' if gate.get('ok') else gate.get('message')}")
    else:
        lines.append("recovered: the front a dead holder left held was released")
    for key in ("front", "second_instance", "front_hold"):
        if report.get(key):
            lines.append(f"  {key.replace('_', ' ')}: {report[key]}")
    if verbose:
        lines += [f"  {k}: {v}" for k, v in report.items() if k not in ("gate",)]
    return lines


def cmd_front_release(ns: argparse.Namespace) -> int:
    from launcher.deploy.restart import release

    data = release.watch(settings_from(ns))
    emit(data, ns.json, lambda: f"front-release: {data['outcome']}")
    return 0


def cmd_stop_warm(ns: argparse.Namespace) -> int:
    from launcher.deploy.transaction import Deployer

    data = Deployer(settings_from(ns)).stop_warm()
    emit(data, ns.json, lambda: "stopped" if data.get("stopped") else f"kept: {data['why']}")
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    from launcher.reports import status

    data = status.status(settings_from(ns))
    emit(data, ns.json, lambda: status.status_text(data))
    return 0


def cmd_history(ns: argparse.Namespace) -> int:
    from launcher.reports import status

    data = status.history(settings_from(ns))
    emit(data, ns.json, lambda: status.history_text(data))
    return 0


def cmd_install(ns: argparse.Namespace) -> int:
    from launcher.install import install

    lane = _lane(ns)
    settings = settings_from(ns, lane=False)
    args: dict[str, Any] = {
        "progress": None if ns.json else _progress(),
        "force_memory": ns.force_memory,
        "on_phase": ns.on_phase,
        "force": ns.force,
        "site": install.site_for(tuple(ns.read_only_path), ns.mdwe, ns.allow_nice),
    }
    if lane is not None:
        cfg = None if lane.address is not None else config_from(ns)
        from launcher.config import VllmConfig

        if isinstance(cfg, VllmConfig):
            from launcher.errors import ConfigInvalid

            raise ConfigInvalid(
                "--lane installs a llama-server lane; a vLLM lane is not supported (vLLM "
                "schedules long prompts itself: --enable-chunked-prefill); nothing was changed"
            )
        done = install.install_lane(settings, cfg, lane, **args)
        if isinstance(done, dict):
            emit(done, ns.json, lambda: _lane_text(done))
            return 0
        return _finish(ns, done, install.lane_settings(settings, lane.name))
    result = install.install(
        settings,
        config_from(ns),
        template=bool(ns.instance),
        front_kind=ns.front,
        second_instance=ns.second_instance,
        admission=_admission(ns),
        **args,
    )
    return _finish(ns, result, settings)


def _lane(ns: argparse.Namespace) -> Any:
    """``--lane NAME`` and its routing (None: no lane); a lane option without it, or
    beside another front option, is refused."""
    from launcher.errors import ConfigInvalid
    from launcher.install import install

    given = {
        "--lane-threshold": ns.lane_threshold,
        "--lane-bytes-per-token": ns.lane_bytes_per_token,
        "--lane-wait": ns.lane_wait,
        "--lane-address": ns.lane_address,
        "--lane-slots": ns.lane_slots,
    }
    if not ns.lane:
        for flag, value in given.items():
            if value is not None:
                raise ConfigInvalid(f"{flag} {value} needs --lane NAME: add it, or drop {flag}")
        return None
    if ns.front != "none" or ns.second_instance or ns.admission:
        raise ConfigInvalid(
            "--lane installs the lane of a unit that has its front already: give --lane "
            "with the lane's own flags, without --front, --second-instance or --admission "
            "(--unit or --instance names the main unit); nothing was changed"
        )
    defaults = install.LaneOptions(ns.lane)
    return install.LaneOptions(
        ns.lane,
        ns.lane_threshold if ns.lane_threshold is not None else defaults.threshold,
        ns.lane_bytes_per_token
        if ns.lane_bytes_per_token is not None
        else defaults.bytes_per_token,
        ns.lane_wait if ns.lane_wait is not None else defaults.wait,
        ns.lane_address,
        ns.lane_slots,
    )


def _lane_text(done: dict[str, Any]) -> str:
    front = done.get("front") or {}
    lines = [f"the lane {done.get('lane')} is {done.get('address')}"]
    if front.get("threshold_tokens"):
        lines.append(
            f"  the front sends it prompts over {front['threshold_tokens']} tokens (bodies "
            f"over {front['threshold_bytes']} bytes)"
        )
    if front.get("applied"):
        lines.append(f"  applied {front['applied']}")
    return "\n".join(lines)


def _admission(ns: argparse.Namespace) -> Any:
    """``--admission`` and its bounds (None: off); a bound without it is refused."""
    from launcher.errors import ConfigInvalid
    from launcher.install import install

    if not ns.admission:
        for flag, value in (
            ("--admission-queue", ns.admission_queue),
            ("--admission-wait", ns.admission_wait),
        ):
            if value is not None:
                raise ConfigInvalid(f"{flag} {value:g} needs --admission: add it, or drop {flag}")
        return None
    defaults = install.Admission()
    return install.Admission(
        ns.admission_queue if ns.admission_queue is not None else defaults.queue,
        ns.admission_wait if ns.admission_wait is not None else defaults.wait,
    )


def cmd_uninstall(ns: argparse.Namespace) -> int:
    from launcher.install import install

    if ns.lane:
        data = install.uninstall_lane(settings_from(ns, lane=False), ns.lane, purge=ns.purge)
    else:
        data = install.uninstall(settings_from(ns), purge=ns.purge)
    emit(data, ns.json, lambda: "\n".join(f"{k}: {v}" for k, v in data.items()))
    return 0
