"""The second instance of a fronted unit: the bridge that serves while the unit restarts,
and the old config kept warm after a deploy, for an instant rollback.

``install --front haproxy --second-instance`` writes ``NAME-b.service``
(``units.render_standby``): llama-server on the front's ``standby_port`` (its second server,
``llama_b``), from an env file of its own (``STATE_DIR/standby.env``), never enabled. The
unit itself always ends a transaction serving; the second instance only bridges it::

    deploy:   the live config on b (its env file written, started, gated on its port) ->
              the slots saved on the unit, restored into b -> the front switched to b (ready
              before the unit drains: there is never a moment with no usable server) ->
              the env file swapped, the unit restarted and gated, no request waiting on it ->
              the slots saved on b, restored into the unit (where the KV layout allows) ->
              the front switched back -> b, still the old config, kept warm ``warm`` seconds
    rollback: the target is what b keeps warm: the front switched to b at once (the old
              config serves again in a switch, no load), then the unit restarted into it
              and switched back as above, and b stopped

So a generation, its history, ``status``, the sampler and a boot all stay the unit's, and a
killed deployer leaves what any deploy leaves: a transaction record, which the next command
recovers (the unit restarted into the old config, unheld while b serves it, then b stopped
once its requests finished). b's warm period ends with ``llama-launcher stop-warm``, run by
a transient timer (``systemd-run``) that the bridge sets when it starts, for two deploys'
budgets plus the warm period, and moves when the deploy ends: it takes the unit's lock
(recovering a dead deployer's transaction first) and stops b unless it serves.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import waits
from launcher.deploy import budgets, store
from launcher.deploy.gate import Gate, GateResult, Progress
from launcher.deploy.restart.front import FrontSpec
from launcher.errors import LauncherError
from launcher.host import launch, proc
from launcher.host.systemd import Scope, Systemd


def unit_name(unit: str) -> str:
    """The second instance's unit: ``llama-server-b.service`` for ``llama-server.service``
    (``@`` as ``-``, as the front's units: no instance of the template)."""
    return unit.removesuffix(".service").replace("@", "-", 1) + "-b.service"


def env_path(state_dir: Path) -> Path:
    return state_dir / "standby.env"


def key_stage_path(state_dir: Path) -> Path:
    return state_dir / "standby-api-key"


@dataclass(frozen=True)
class Standby:
    """The second instance of one unit, on the front's standby port."""

    unit: str  # the unit it bridges (``llama-server.service``)
    scope: Scope
    state_dir: Path
    host: str
    port: int

    @classmethod
    def of(cls, state_dir: Path, unit: str, scope: Scope, spec: FrontSpec | None) -> Standby | None:
        """The unit's second instance, when its front has a standby port; None otherwise."""
        if spec is None or spec.standby_port is None:
            return None
        return cls(unit, scope, state_dir, spec.private_host, spec.standby_port)

    @property
    def name(self) -> str:
        return unit_name(self.unit)

    @property
    def systemd(self) -> Systemd:
        return Systemd(self.name, self.scope)

    @property
    def env_file(self) -> Path:
        return env_path(self.state_dir)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def stop_unit(self) -> str:
        """The transient timer (and its service) that ends the warm period, without suffix."""
        return self.name.removesuffix(".service") + "-stop"

    @property
    def key_stage(self) -> Path:
        """Its own copy of the API key of the config it runs (system scope: the unit's
        ``LoadCredential=api-key:``), written before each start: a restart after a crash
        reads the key of its own config, not the unit's."""
        return key_stage_path(self.state_dir)

    @property
    def warm_path(self) -> Path:
        return self.state_dir / "front" / "warm.json"

    def missing(self) -> str | None:
        """Why the second instance cannot be used (its unit is not installed), or None."""
        try:
            load = self.systemd.show("LoadState").get("LoadState", "")
        except LauncherError as e:
            return f"systemd did not say whether {self.name} is installed: {e}"
        if load in ("", "not-found"):
            return (
                f"{self.name} is not installed; run `llama-launcher install --front haproxy "
                "--second-instance` to install it"
            )
        return None

    def text(self) -> str | None:
        try:
            return self.env_file.read_text()
        except FileNotFoundError:
            return None

    def running_with(self, text: str | None) -> bool:
        """Whether the second instance runs the env file ``text`` (a warm copy of it)."""
        if text is None or self.text() != text:
            return False
        try:
            return self.systemd.state().running
        except LauncherError:
            return False

    def healthy(self) -> bool:
        """Whether it answers ``/health`` 200 now (a warm one that crashed is restarting)."""
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def keeps(self, text: str | None) -> bool:
        """Whether it keeps ``text`` warm: its env file, running, or being started again by
        systemd after a crash (``Restart=on-failure``; the bridge gates it first)."""
        if text is None or self.text() != text:
            return False
        try:
            return self.systemd.state().active in ("active", "activating", "reloading")
        except LauncherError:
            return False

    def serve(
        self,
        text: str,
        argv: list[str],
        api_key: str | None,
        policy: waits.Waits,
        load: budgets.Load | None,
        progress: Progress | None = None,
    ) -> GateResult:
        """Start the second instance on ``text`` (restarted if it runs something else) and
        gate it on its own port: its startup line and a real completion, against ``argv`` as
        its unit runs it (``exec --port``: on the standby port). Raises ``GateFailure``; the
        caller stops it."""
        b = self.systemd
        before = b.state()
        store.atomic_write(self.env_file, text.encode(), 0o600)
        if self.scope == "system":
            store.atomic_write(self.key_stage, (api_key or "").encode(), 0o600)
        b.cancel_auto_restart(before)
        b.reset_failed()
        cursor = b.cursor()
        b.restart()
        gate = Gate(b, policy, self.url, progress)
        argv = launch.with_port(argv, str(self.port))
        return gate(None, cursor, before, api_key, argv, budgets.for_deploy(policy, load))

    def stop(self) -> str | None:
        """Stop the second instance and forget its warm period; what went wrong, or None."""
        self.warm_path.unlink(missing_ok=True)
        try:
            self.systemd.stop()
            self.systemd.reset_failed()
        except LauncherError as e:
            return f"{self.name} did not stop: {e}"
        return None

    # -- the warm period ---------------------------------------------------------------------

    def keep_warm(self, seconds: float, generation: int | None, where: list[str]) -> dict[str, Any]:
        """Keep the second instance (the old config) running for ``seconds``, then stop it
        (``stop-warm``, run by a transient timer; ``where``: the settings options naming the
        unit). Returns what the result says of it: ``note`` when no timer was set (then only
        a command ends the warm period)."""
        until = time.time() + seconds
        out: dict[str, Any] = {"instance": self.name, "generation": generation}
        try:
            store.write_json(self.warm_path, {"until": until, "generation": generation})
        except OSError as e:  # the warm period's record: no timer is set without it
            out["note"] = f"no timer stops it: {e.strerror or e}; `llama-launcher stop-warm` does"
            return out
        timer = self.stop_unit
        ctl = ["systemctl", *(["--user"] if self.scope == "user" else [])]
        with contextlib.suppress(LauncherError):
            # the one before (a stop-warm waiting for the lock this deployer holds, too)
            both = [f"{timer}.timer", f"{timer}.service"]
            proc.run([*ctl, "stop", "--", *both], check=False, timeout=30)
            proc.run([*ctl, "reset-failed", "--", *both], check=False, timeout=30)
        from launcher.host import units

        python, package_dir = units.this_python()
        run = [
            "systemd-run",
            *(["--user"] if self.scope == "user" else []),
            f"--unit={timer}",
            f"--on-active={max(math.ceil(seconds), 1)}s",  # never before ``until``
            "--timer-property=AccuracySec=1s",
            f"--setenv=PYTHONPATH={package_dir}",
            "--collect",
            "--quiet",
            "--",
            python,
            "-m",
            "launcher",
            "stop-warm",
            *where,
            "--json",
        ]
        out["warm_until"] = until
        try:
            proc.run(run, timeout=30)
        except LauncherError as e:
            out["note"] = f"no timer stops it: {e}; `llama-launcher stop-warm` does"
        return out

    def warm_until(self) -> float | None:
        try:
            return float(json.loads(self.warm_path.read_text())["until"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def stop_due(
    standby: Standby,
    spec: FrontSpec,
    now: float | None = None,
    idle: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """``stop-warm``, under the unit's lock: the second instance stopped when its warm period
    is over and it does not serve (a rollback in the warm period may have switched to it),
    after ``idle`` (a wait until what the front sent it has finished)."""
    if spec.serving == "b":
        return {"stopped": False, "why": f"{standby.name} serves (the front points at it)"}
    until = standby.warm_until()
    now = time.time() if now is None else now
    if until is not None and now < until:
        return {"stopped": False, "why": f"warm for {until - now:.0f}s more"}
    if idle is not None:
        idle()
    problem = standby.stop()
    if problem is not None:
        return {"stopped": False, "why": problem}
    return {"stopped": True, "instance": standby.name}
