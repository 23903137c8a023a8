"""The tool's own settings (``ToolSettings``): where and how llama-launcher works on a host.

Every setting has a default, a ``LLAMA_LAUNCHER_<NAME>`` environment variable and a line in
a settings file (TOML, ``LLAMA_LAUNCHER_SETTINGS``); command-line options override them all
(``load_settings``). The bake's durations read ``30m``, ``2h`` or seconds (``duration``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from launcher.config.server import config_error
from launcher.errors import ConfigInvalid


def _default_settings_file() -> Path | None:
    """The settings file read when none is named: the system's, else the user's. One that
    cannot be looked at (a home folder closed to this user: ``su`` keeps root's HOME) is not
    there for this user; only a named one (``LLAMA_LAUNCHER_SETTINGS``) must be readable."""
    for where in ("/etc/llama-launcher", "~/.config/llama-launcher"):
        try:
            path = Path(where).expanduser() / "settings.toml"
            if path.is_file():
                return path
        except (OSError, RuntimeError):  # RuntimeError: no home folder to expand
            continue
    return None


def _default_scope() -> Literal["system", "user"]:
    return "system" if os.geteuid() == 0 and Path("/run/systemd/system").is_dir() else "user"


#: The longest bake (AWS AppConfig's limit: 1,440 minutes).
MAX_BAKE = 86400.0


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h)?\s*$")


_DURATION_UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def duration(value: Any, name: str) -> Any:
    """Seconds of ``30m``, ``2h``, ``90s`` or ``90`` (a number passes as it is); anything
    else is refused naming the value and the spellings."""
    if not isinstance(value, str):
        return value
    m = _DURATION.match(value)
    if m is None:
        raise ValueError(
            f"{value!r} is not a duration for {name}; write seconds or a number with s, m "
            "or h (90, 90s, 30m, 2h; 0: off)"
        )
    return float(m[1]) * _DURATION_UNITS[m[2]]


class ToolSettings(BaseSettings):
    """Where and how llama-launcher works on this host.

    Precedence, highest first (the one documented place):
      1. command-line options (``--unit``, ``--scope``, ``--env-file``, ...);
      2. environment variables ``LLAMA_LAUNCHER_<FIELD>`` (e.g. ``LLAMA_LAUNCHER_UNIT``);
      3. the TOML file named by ``LLAMA_LAUNCHER_SETTINGS``
         (default ``/etc/llama-launcher/settings.toml``, or the user's
         ``~/.config/llama-launcher/settings.toml`` in user scope), if it exists;
      4. the defaults below.
    """

    model_config = SettingsConfigDict(env_prefix="LLAMA_LAUNCHER_", extra="forbid", frozen=True)

    unit: str = Field(
        "llama-server.service",
        description="the systemd unit (--instance NAME: llama-server@NAME.service)",
    )
    scope: Literal["system", "user"] = Field(
        default_factory=_default_scope,
        description="the systemd manager: system as root where systemd runs, else user",
    )
    env_file: Path | None = Field(
        None,
        description="the live env file (unset: /etc/llama-launcher/NAME.env in system scope, "
        "~/.config/llama-launcher/NAME.env in user scope)",
    )
    state_dir: Path | None = Field(
        None,
        description="generations, the transaction record and the live records (unset: the "
        "one recorded beside the env file, else /var/lib/llama-launcher/NAME or "
        "~/.local/state/llama-launcher/NAME)",
    )
    unit_dir: Path | None = Field(
        None,
        description="where install writes the unit files (unset: /etc/systemd/system, or "
        "~/.config/systemd/user)",
    )
    base_url: str | None = Field(
        None,
        description="where the gate and the sampler reach llama-server (unset: from the "
        "config's --host and --port; behind a front the server's private address)",
    )
    # unset: sized from the unit's last measured load, max(floor, 4 x measured) (budgets.py)
    start_timeout: float | None = Field(
        None, gt=0, description="the old process gone until the startup line, seconds"
    )
    health_timeout: float | None = Field(
        None, gt=0, description="/health 200 after the startup line"
    )
    probe_timeout: float = Field(60.0, gt=0, description="the real chat completion")
    lock_timeout: float | None = Field(
        None, ge=0, description="waiting for another deploy (unset: one deploy's budget)"
    )
    settle_seconds: float = Field(
        0.0, ge=0, description="extra wait before the final stay-up check"
    )
    unified_memory: Literal["auto", "yes", "no"] = Field(
        "auto",
        description="whether the devices' memory is the host's (auto: a device as large as "
        "the host's MemTotal, or Metal)",
    )
    drain_timeout: float = Field(
        120.0, ge=0, description="wait for requests in flight before a restart; 0: no drain"
    )
    carry_slots: bool = Field(
        True,
        description="a config without --slot-save-path gets STATE_DIR/slots: the slots' "
        "caches are saved before a restart and restored after it",
    )
    # the second instance (launcher/deploy/restart/standby.py; install --front haproxy
    # --second-instance)
    handover: Literal["auto", "switch", "hold"] = Field(
        "auto",
        description="how a fronted unit with a second instance restarts: switch (the live "
        "config serves on the second instance meanwhile, nothing is held), hold (the "
        "front holds new requests), auto (switch when the second instance fits in memory "
        "beside the running one)",
    )
    keep_warm: float = Field(
        60.0,
        ge=0,
        description="seconds the second instance keeps the previous config warm after a "
        "switch (a rollback then is a switch); the bake's length when it is longer",
    )
    # the watch (launcher/watch/): install renders the interval into the sampler's timer
    sample_interval: float = Field(
        60.0, ge=1, description="seconds between two live samples (NAME-sample.timer)"
    )
    metrics_textfile_dir: Path | None = Field(
        None,
        description="node_exporter's --collector.textfile.directory: every sample writes "
        "llama_launcher_<unit>.prom there (unset: no metrics file)",
    )
    wedged_samples: int = Field(
        3,
        ge=0,
        description="samples in a row in which the server lives but does not answer (/health "
        "within 5 s; or a 1-token completion, while requests wait and its counters stand "
        "still) that restart it (during a bake: revert it); 0: off. Rendered into the "
        "sampler's service (install again to change it)",
    )
    metrics_endpoint: bool = Field(
        True,
        description="a config that keeps /slots on gets --metrics (the sampler's decode "
        "and prefill tok/s)",
    )
    # the bake (launcher/watch/bake.py, verdict.py): the defaults are the anchors' (the guide
    # "The bake and the live watch"); a deploy copies them into its bake record, the sampler
    # reads them
    bake: float = Field(
        0.0,
        ge=0,
        le=MAX_BAKE,
        description="watch a deployed config this long (30m, 2h, seconds) and put the "
        "previous one back when it is worse under load; 0: no bake",
    )
    bake_interval: float = Field(15.0, ge=1, description="seconds between two bake samples")
    bake_warmup: float = Field(
        120.0, ge=0, description="seconds after the gate before a soft signal counts"
    )
    bake_drain: float = Field(
        5.0, ge=0, description="the drain before a revert on a hard failure, seconds"
    )
    bake_failure_rate: float = Field(
        0.01, ge=0, le=1, description="failed requests (5xx, in-stream errors) that revert"
    )
    bake_soft_samples: int = Field(3, ge=1, description="bad samples in a row for a soft revert")
    bake_min_completions: int = Field(
        20, ge=1, description="completions in the window before a soft signal counts"
    )
    bake_decode_ratio: float = Field(
        0.8, gt=0, le=1, description="decode tok/s under this share of the baseline's is bad"
    )
    bake_memory_ratio: float = Field(
        1.5, gt=1, description="memory growing faster than this many times the baseline's"
    )
    bake_memory_floor: float = Field(
        256.0, ge=0, description="MiB per hour of memory growth that is never bad"
    )
    bake_pool_limit: float = Field(
        0.9,
        ge=0,
        le=1,
        description="an over-committed shared pool whose slots' sessions need this share of "
        "it (held and still to generate) reverts before it overflows (when the previous config "
        "guaranteed every slot); 0: off",
    )
    bake_pool_poll: float = Field(
        0.25,
        ge=0,
        description="seconds between two looks at /slots between the bake's samples of an "
        "over-committed pool; 0: only the samples look",
    )
    bake_unread_limit: int = Field(
        4, ge=1, description="samples in a row that cannot read the signals: inconclusive"
    )

    @field_validator("bake", mode="before")
    @classmethod
    def _bake_duration(cls, value: Any) -> Any:
        return duration(value, "bake")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        from pydantic_settings import TomlConfigSettingsSource

        named = os.environ.get("LLAMA_LAUNCHER_SETTINGS")
        path = Path(named) if named is not None else _default_settings_file()
        if path is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, path))

    @property
    def unit_name(self) -> str:
        return self.unit if "." in self.unit else f"{self.unit}.service"

    @property
    def instance(self) -> str:
        """The unit name without ``.service``; names the env file and state dir."""
        return self.unit_name.removesuffix(".service")

    @property
    def env_name(self) -> str:
        """The env file's stem: the instance of a template unit (``llama-server@X`` reads
        ``X.env``, its ``%i.env``), else the unit name."""
        return self.instance.split("@", 1)[1] if "@" in self.instance else self.instance

    def resolved_env_file(self) -> Path:
        if self.env_file:
            return self.env_file
        base = (
            Path("/etc/llama-launcher")
            if self.scope == "system"
            else Path.home() / ".config/llama-launcher"
        )
        # the template unit llama-server@X.service reads <dir>/X.env (%i.env)
        return base / f"{self.env_name}.env"

    def default_state_dir(self) -> Path:
        base = (
            Path("/var/lib/llama-launcher")
            if self.scope == "system"
            else Path.home() / ".local/state/llama-launcher"
        )
        return base / self.instance

    def resolved_unit_file(self) -> Path:
        """The installed unit file: a template's for an instance (``llama-server@.service``)."""
        name = self.unit_name
        if "@" in name:
            name = name.split("@", 1)[0] + "@.service"
        return self.resolved_unit_dir() / name

    def resolved_unit_dir(self) -> Path:
        if self.unit_dir:
            return self.unit_dir
        return (
            Path("/etc/systemd/system")
            if self.scope == "system"
            else Path.home() / ".config/systemd/user"
        )


def load_settings(**overrides: Any) -> ToolSettings:
    """Tool settings with CLI ``overrides`` (None values are ignored)."""
    clean = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ToolSettings(**clean)
    except ValidationError as e:
        raise config_error(e) from None
    except PermissionError as e:  # a settings file of another user (HOME kept by sudo -E)
        raise ConfigInvalid(
            f"cannot read the settings file {e.filename}: permission denied; run as its "
            "owner, or point LLAMA_LAUNCHER_SETTINGS at a file you can read"
        ) from None
