"""Verbs of the config life cycle: render, check, deploy, set, unset, rollback, status,
history, install, uninstall."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.cli import emit
from launcher.cli.results import human

if TYPE_CHECKING:
    from launcher.config import ServerConfig, ToolSettings
    from launcher.deploy.outcome import Result
    from launcher.deploy.transaction import Deployer


def _settings_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "where (also LLAMA_LAUNCHER_* variables or settings.toml; before the verb as well)"
    )
    g.add_argument("--unit", help="systemd unit (default llama-server.service)")
    g.add_argument(
        "--instance",
        metavar="NAME",
        help="the instance llama-server@NAME.service of the template unit (install "
        "--instance NAME makes it)",
    )
    g.add_argument("--scope", choices=["system", "user"], help="systemd manager to use")
    g.add_argument("--env-file", type=Path, help="the live env file")
    g.add_argument(
        "--state-dir",
        type=Path,
        help="generations and the transaction record (default: the one recorded beside the "
        "env file; another is refused)",
    )
    g.add_argument("--base-url", help="probe URL (default: from --host/--port)")
    g.add_argument(
        "--start-timeout",
        type=float,
        help="seconds from the old process gone until the startup line (default: 4x the "
        "unit's last measured load, at least 120; a rollback gets its own generation's)",
    )
    g.add_argument(
        "--health-timeout",
        type=float,
        help="seconds from the startup line until /health 200 (default: 4x the last "
        "measured, at least 300)",
    )
    g.add_argument("--probe-timeout", type=float, help="seconds for the real completion")
    g.add_argument(
        "--lock-timeout",
        type=float,
        help="seconds to wait for another deploy (default: one deploy's budget)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _config_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="a TOML file with the whole desired config")
    p.add_argument(
        "--llama-server", dest="llama_server_bin", type=Path, help="the llama-server binary"
    )
    p.add_argument(
        "--allow-overcommit",
        action="store_true",
        help="accept a shared KV pool whose slots can exhaust it",
    )


def _memory_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--force-memory",
        action="store_true",
        help="go ahead even if the memory estimate exceeds what the box can give",
    )


def _drain_options(p: argparse.ArgumentParser) -> None:
    """The handover of a restart (launcher/deploy/restart/handover.py)."""
    g = p.add_argument_group("before the restart")
    g.add_argument(
        "--drain-timeout",
        type=float,
        metavar="SECONDS",
        help="wait at most this long for requests in flight to finish (default 120)",
    )
    g.add_argument(
        "--no-drain",
        action="store_true",
        help="restart at once, cutting requests in flight (and saving no slot caches)",
    )


def _bake_options(p: argparse.ArgumentParser) -> None:
    """The bake after the gate (launcher/watch/bake.py)."""
    g = p.add_argument_group("after the gate")
    g.add_argument(
        "--bake",
        metavar="DURATION",
        help="watch the new config this long (30m, 2h, seconds; max 24h) against the "
        "previous one and put the previous one back when it is worse under load; the "
        "sampler carries it (default: the setting bake; 0: off)",
    )
    g.add_argument(
        "--wait",
        action="store_true",
        help="wait for the bake's verdict (exit 6 when it reverted)",
    )


def _parser(sub: Any, name: str, help: str, flags: bool = False) -> argparse.ArgumentParser:
    from launcher.cli import EPILOG

    p: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help,
        description=help,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.set_defaults(takes_flags=flags)
    return p


def register(sub: Any) -> None:
    flags_note = " LLAMA-SERVER FLAGS follow, in llama-server's own spellings (-c, -np, -ctk...)."
    p = _parser(
        sub,
        "render",
        "print the env file a deploy of a config writes (with the deploy's defaults: the "
        "slot folder, the key file); change nothing live (a config with an api_key makes "
        "the state folder's salt of key-file names once, if the folder exists, so the "
        "name shown is the one the deploy writes)." + flags_note,
        True,
    )
    _config_options(p)
    _settings_options(p)
    p.set_defaults(func=cmd_render)

    p = _parser(
        sub,
        "check",
        "validate a config and show the argv diff against the live env "
        "file; change nothing live (an api_key: the salt of key-file names, as render)."
        + flags_note,
        True,
    )
    _config_options(p)
    _settings_options(p)
    _memory_option(p)
    p.set_defaults(func=cmd_check)

    p = _parser(
        sub,
        "deploy",
        "deploy a whole desired config through the gate (the Ansible path)." + flags_note,
        True,
    )
    _config_options(p)
    _mode_options(p)
    _drain_options(p)
    _bake_options(p)
    _settings_options(p)
    _memory_option(p)
    p.set_defaults(func=cmd_deploy)

    p = _parser(
        sub,
        "set",
        "change some flags of the live config and deploy it, e.g. "
        "llama-launcher set -ctk q8_0 -ctv q8_0",
        True,
    )
    p.add_argument(
        "--allow-overcommit",
        action="store_true",
        help="accept a shared KV pool whose slots can exhaust it",
    )
    _mode_options(p)
    _drain_options(p)
    _bake_options(p)
    _settings_options(p)
    _memory_option(p)
    p.set_defaults(func=cmd_set)

    p = _parser(
        sub,
        "unset",
        "remove flags from the live config and deploy it, e.g. llama-launcher unset -ctk -ctv",
        True,
    )
    _mode_options(p)
    _drain_options(p)
    _bake_options(p)
    _settings_options(p)
    _memory_option(p)
    p.set_defaults(func=cmd_unset)

    p = _parser(
        sub,
        "rollback",
        "go back to the last known-good generation (or --to N): put back its stored env "
        "file bytes (strict parse and bash -n; no memory guard: it served) and gate them",
    )
    p.add_argument("--to", type=int, metavar="N", help="generation number (see history)")
    _drain_options(p)
    _settings_options(p)
    p.set_defaults(func=cmd_rollback)

    p = _parser(
        sub,
        "status",
        "unit state, live generation, startup values, the guaranteed "
        "per-slot window, process memory, the front's hold and the live pool (the slots "
        "now, the last hour's peaks, the sampler's last run)",
    )
    _settings_options(p)
    p.set_defaults(func=cmd_status)

    p = _parser(sub, "history", "generations with time, outcome and argv diff")
    _settings_options(p)
    p.set_defaults(func=cmd_history)

    p = _parser(
        sub,
        "recover",
        "revert a deploy that was killed half-way (deploy, check, set, unset, rollback and "
        "install do this first, too), then settle a bake whose revert was cut with its "
        "sampler (reverted or revert_failed); exit 4 if the restored config fails its gate",
    )
    _settings_options(p)
    p.set_defaults(func=cmd_recover)

    p = _parser(
        sub,
        "front-release",
        "the front's release watcher (NAME-front-release.service runs it while a hold is "
        "recorded): recover the transaction of a holder that died and release the front, "
        "or release it at the hold's deadline (one deploy's budget)",
    )
    _settings_options(p)
    p.set_defaults(func=cmd_front_release)

    p = _parser(
        sub,
        "stop-warm",
        "stop the second instance when its warm period after a switch is over and it does "
        "not serve (a timer the deploy starts runs it; under the unit's lock)",
    )
    _settings_options(p)
    p.set_defaults(func=cmd_stop_warm)

    p = _parser(
        sub,
        "install",
        "first deployment on a host: validate first (a refusal changes nothing), then "
        "install the unit, its sampler timer (and the front's units with --front), create "
        "the env and state folders, enable it and deploy through the gate." + flags_note,
        True,
    )
    _config_options(p)
    p.add_argument("--unit-dir", type=Path, help="where the unit file goes")
    p.add_argument(
        "--force", action="store_true", help="replace a unit file that was edited by hand"
    )
    g = p.add_argument_group("site settings of the hardened system unit")
    g.add_argument(
        "--read-only-path",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="bind DIR read-only into the service (models under /tmp or /var/tmp)",
    )
    g.add_argument(
        "--no-memory-deny-write-execute",
        dest="mdwe",
        action="store_false",
        help="for GPU drivers that compile code at run time (ROCm/HIP is reported to)",
    )
    g.add_argument(
        "--allow-nice", action="store_true", help="grant CAP_SYS_NICE, for llama-server --prio"
    )
    p.add_argument(
        "--front",
        choices=["none", "haproxy"],
        default="none",
        help="haproxy: HAProxy holds the address and holds requests during deploys; "
        "llama-server moves to a private one (default none)",
    )
    p.add_argument(
        "--second-instance",
        action="store_true",
        help="with --front haproxy: a second instance (NAME-b.service, on a port of its "
        "own) serves the live config while the unit restarts, so nothing is held, and "
        "keeps it warm after (keep_warm): a rollback then is a switch (setting handover)",
    )
    _drain_options(p)
    _settings_options(p)
    _memory_option(p)
    p.set_defaults(func=cmd_install)

    p = _parser(
        sub,
        "uninstall",
        "stop, disable and remove the unit, its sampler and front units and the env file "
        "(generations are kept unless --purge)",
    )
    p.add_argument("--unit-dir", type=Path, help="where the unit file is")
    p.add_argument(
        "--purge",
        action="store_true",
        help="also delete the generations and all else install made (the service's "
        "StateDirectory, the record, the lock, empty folders)",
    )
    _settings_options(p)
    p.set_defaults(func=cmd_uninstall)


def _mode_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--check",
        action="store_true",
        help="validate and diff only; change nothing (like ansible --check)",
    )
    p.add_argument("--diff", action="store_true", help="show the argv diff (like ansible --diff)")


# -- helpers -----------------------------------------------------------------------------------


def settings_from(ns: argparse.Namespace) -> ToolSettings:
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


def config_from(ns: argparse.Namespace, base: dict[str, Any] | None = None) -> ServerConfig:
    """The desired config: --config TOML, then llama-server flags on top."""
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
    if ns.llama_server_bin:
        data["llama_server"] = ns.llama_server_bin
    if getattr(ns, "allow_overcommit", False):
        data["allow_overcommit"] = True
    data.setdefault("llama_server", _default_server())
    if "model" not in data and not any(f in ("-m", "--model") for f in ns.flags):
        raise ConfigInvalid('no model: give -m /path/to/model.gguf or model = "..." in --config')
    return config.from_flags(ns.flags, data)


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


def _finish(ns: argparse.Namespace, result: Result) -> int:
    if not ns.json and sys.stderr.isatty():
        print("\r\x1b[2K", end="", file=sys.stderr)
    emit(
        result.to_dict(),
        ns.json,
        lambda: human(result, getattr(ns, "diff", True) or result.outcome == "checked"),
    )
    from launcher.errors import OUTCOME_EXIT

    return OUTCOME_EXIT.get(result.outcome, 0)


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

    deployed = deployer_for(ns, unit_needed=False).preview(config_from(ns))
    text = config.render_env(deployed.config)
    data = {"env": text, "argv": deployed.config.argv(), "notes": list(deployed.notes)}
    for note in deployed.notes if not ns.json else ():
        print(note, file=sys.stderr)  # stdout is the env file's bytes
    emit(data, ns.json, lambda: text.rstrip("\n"))
    return 0


def cmd_check(ns: argparse.Namespace) -> int:
    ns.diff = True
    return _finish(
        ns, deployer_for(ns, unit_needed=False).deploy(config_from(ns), check=True, origin="check")
    )


def cmd_deploy(ns: argparse.Namespace) -> int:
    d = _baking(ns, deployer_for(ns))
    cfg = config_from(ns)
    return _finish(ns, _baked(ns, d, lambda: d.deploy(cfg, check=ns.check)))


def cmd_set(ns: argparse.Namespace) -> int:
    from launcher.errors import ConfigInvalid

    if not ns.flags:
        raise ConfigInvalid("set needs llama-server flags, e.g. llama-launcher set -ctk q8_0")
    flags = ns.flags + (["--allow-overcommit"] if ns.allow_overcommit else [])
    from launcher import config
    from launcher.host import envfile

    d = _baking(ns, deployer_for(ns))
    origin = "set " + envfile.join_words(flags)

    def run() -> Result:
        return d.change(lambda live: config.from_flags(flags, live), origin, ns.check)

    return _finish(ns, _baked(ns, d, run))


def cmd_unset(ns: argparse.Namespace) -> int:
    from launcher.errors import ConfigInvalid

    if not ns.flags:
        raise ConfigInvalid("unset needs flag names, e.g. llama-launcher unset -ctk -ctv")
    from launcher import config

    def edit(live: dict[str, Any]) -> ServerConfig:
        return config.build(config.remove_flags(live, ns.flags))

    origin = "unset " + " ".join(ns.flags)
    d = _baking(ns, deployer_for(ns))
    return _finish(ns, _baked(ns, d, lambda: d.change(edit, origin, ns.check)))


def cmd_rollback(ns: argparse.Namespace) -> int:
    from launcher.watch import handoff

    d = deployer_for(ns)
    return _finish(ns, handoff.after(d, d.rollback(ns.to), ns.verb, bakes=False))


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
        line = f"recovered: {report}" if report else "nothing to recover"
        if report and report.get("front_down"):
            line = f"{report['front_down']}\n{line}"
        return f"{line}\n{bake.say(settled)}" if settled is not None else line

    emit(data, ns.json, text)
    return 0


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

    settings = settings_from(ns)
    result = install.install(
        settings,
        config_from(ns),
        template=bool(ns.instance),
        progress=None if ns.json else _progress(),
        force_memory=ns.force_memory,
        on_phase=ns.on_phase,
        force=ns.force,
        site=install.site_for(tuple(ns.read_only_path), ns.mdwe, ns.allow_nice),
        front_kind=ns.front,
        second_instance=ns.second_instance,
    )
    return _finish(ns, result)


def cmd_uninstall(ns: argparse.Namespace) -> int:
    from launcher.install import install

    data = install.uninstall(settings_from(ns), purge=ns.purge)
    emit(data, ns.json, lambda: "\n".join(f"{k}: {v}" for k, v in data.items()))
    return 0
