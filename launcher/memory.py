"""Host memory: the guard (does KV + weights + prompt cache fit what the box can give?) and
the readers of what the box and the service use (``/proc/meminfo``, ``/proc/PID/status``,
the cgroup's ``MemoryCurrent``).

A per-token rule of thumb can be off by a factor of two; the estimate here follows
llama.cpp's allocation (``launcher.kvbytes``), and the deploy measures the service before
and after so the two can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import config, kvbytes, kvlayout
from launcher.errors import ConfigInvalid, MemoryGuardError
from launcher.systemd import UnitState

MiB = 1 << 20
#: -cram default: 8192 MiB of host RAM for the prompt cache (common/common.h:638).
DEFAULT_CACHE_RAM_MIB = 8192


MEMINFO = Path("/proc/meminfo")


def mem_available(meminfo: Path = MEMINFO) -> int:
    """``MemAvailable`` in bytes (the kernel's estimate of memory usable without swapping)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ConfigInvalid(f"{meminfo} has no MemAvailable line; give --mem-available MIB")


@dataclass(frozen=True)
class Need:
    """What a config will take: KV estimate, weights, prompt cache (bytes)."""

    kv: int | None
    weights: int
    cache_ram: int
    estimate: dict[str, Any] | None
    unsupported: str | None

    @property
    def total(self) -> int | None:
        return None if self.kv is None else self.kv + self.weights + self.cache_ram

    def to_dict(self) -> dict[str, Any]:
        return {
            "kv_bytes": self.kv,
            "weights_bytes": self.weights,
            "cache_ram_bytes": self.cache_ram,
            "total_bytes": self.total,
            "total_mib": None if self.total is None else round(self.total / MiB, 2),
            "kv_mib": None if self.kv is None else round(self.kv / MiB, 2),
            "estimate": self.estimate,
            "unsupported": self.unsupported,
        }


def need(
    cfg: config.ServerConfig,
    plan: kvlayout.PoolPlan,
    layout: kvbytes.ModelInfo | None,
    weights: int,
    unsupported: str | None,
) -> Need:
    """The memory ``cfg`` takes under ``plan``; kv None when the estimator cannot tell."""
    cram = DEFAULT_CACHE_RAM_MIB if cfg.cache_ram in (None, -1) else cfg.cache_ram
    if layout is None:
        return Need(None, weights, cram * MiB, None, unsupported)
    try:
        est = kvbytes.estimate(
            layout,
            plan,
            str(cfg.cache_type_k or "f16"),
            str(cfg.cache_type_v or "f16"),
            cfg.flash_attn or "auto",
            cfg.ubatch_size or kvbytes.DEFAULT_UBATCH,
            "--swa-full" in cfg.extra_args,
            cfg.batch_size or kvbytes.DEFAULT_BATCH,
        )
    except ConfigInvalid as e:
        from launcher.errors import ValidationFailed

        raise ValidationFailed("memory", str(e)) from None
    return Need(est.total_bytes, weights, cram * MiB, est.to_dict(), None)


def guard(
    need: Need, releasable: int = 0, force: bool = False, available: int | None = None
) -> None:
    """Refuse a config that does not fit, with the numbers and the cheapest fix."""
    if need.total is None or force:
        return
    free = (mem_available() if available is None else available) + releasable
    if need.total <= free:
        return
    fixes = []
    if need.kv:
        fixes.append(
            f"a q8_0 cache (-ctk q8_0 -ctv q8_0) stores KV in about half of "
            f"{need.kv / MiB:,.0f} MiB"
        )
    if need.cache_ram:
        fixes.append(f"a smaller prompt cache (-cram 1024 instead of {need.cache_ram // MiB})")
    fixes.append("a smaller -c or fewer slots (llama-launcher plan shows the options)")
    kv_mib = need.kv / MiB if need.kv else 0
    raise MemoryGuardError(
        f"the config needs about {need.total / MiB:,.0f} MiB (KV {kv_mib:,.0f}"
        f" + weights {need.weights / MiB:,.0f} + prompt cache {need.cache_ram / MiB:,.0f}) but "
        f"the box can give {free / MiB:,.0f} MiB (MemAvailable + {releasable / MiB:,.0f} the "
        f"running server frees). Cheapest fixes: "
        + "; ".join(fixes)
        + ". Or deploy anyway with --force-memory."
    )


def _proc_status_bytes(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/PID/status`` in bytes; None when the process or field is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def releasable_memory(state: UnitState) -> int:
    """What restarting the running server gives back to MemAvailable: its anonymous memory
    (KV cache, buffers; weights loaded without mmap). The pages of an mmap'd model count in
    MemAvailable already, as reclaimable page cache, so they are not counted twice."""
    if not state.running or state.main_pid <= 0:
        return 0
    return _proc_status_bytes(state.main_pid, "RssAnon") or 0


def process_memory(state: UnitState) -> int | None:
    """The service's memory: the cgroup's MemoryCurrent, else MainPID's RSS from /proc."""
    if state.memory_current:
        return state.memory_current
    if state.main_pid > 0:
        return _proc_status_bytes(state.main_pid, "VmRSS")
    return None
