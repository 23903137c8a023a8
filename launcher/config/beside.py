"""Would the new config fit as a second instance beside the running one?

A deploy that keeps the old instance serving while the new one loads (and warm after, for an
instant rollback) needs both at once: both KV pools, both prompt caches and, on a device, both
copies of the weights. The memory guard (``launcher.config.memory``) asks whether the new config
fits once the running server has stopped; this asks whether it fits while it still runs: the
same need against the same free memory, with nothing given back by the running server.

The weights: llama-server maps the model file (``-lm mmap``, the default), and two processes
that map one file share its page cache. On the host (and a unified-memory device, counted with
the host) they are counted once, as the guard counts them: MemAvailable holds the running
server's mapped pages as reclaimable, and the new instance needs them once. A new instance
that maps another file, or reads its weights into memory of its own (``-lm none``, ``dio``,
``mlock``), does not share them: the running server's mapped pages (its ``RssFile``) stay in
use beside the new copy and are taken off what the host can give. On a discrete device each
process holds its own copy: the device's free memory (which excludes the running server's
buffers) must hold the whole new side.

The headroom is the planner's (``launcher.config.memory.HEADROOM_MIB``): the host keeps that much
of MemAvailable free beside both instances; a device keeps its ``-fitt`` margin, as the guard
does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import config
from launcher.config import memory, offload
from launcher.config.memory import HEADROOM_MIB

MiB = memory.MiB
#: the load modes whose weights are the model file's page cache, shared between processes
SHARED_MODES = (None, config.LoadMode.auto, config.LoadMode.mmap, config.LoadMode.mmap_mlock)


@dataclass(frozen=True)
class Running:
    """What the running instance holds that a second one cannot use."""

    model: Path | None  # the model file it maps (the live generation's config)
    mapped: int  # its RssFile in bytes: the model pages it keeps in use while it serves


@dataclass(frozen=True)
class SideFit:
    """One side of the box with both instances on it."""

    name: str
    need: int  # the new instance's bytes here
    room: int  # what the side can give with the running instance still up, headroom kept
    shared: bool  # the weights here are the running instance's page cache, counted once

    @property
    def fits(self) -> bool:
        return self.need <= self.room

    def to_dict(self) -> dict[str, Any]:
        return {
            "side": self.name,
            "need_mib": round(self.need / MiB, 1),
            "room_mib": round(self.room / MiB, 1),
            "weights_shared": self.shared,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class Beside:
    """The verdict: ``fits`` None when the KV need is not known (an unsupported model)."""

    fits: bool | None
    why: str
    sides: tuple[SideFit, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"fits": self.fits, "why": self.why, "sides": [s.to_dict() for s in self.sides]}


def shares_weights(cfg: config.AnyConfig, running: Running) -> bool:
    """Whether the new instance maps the file the running one maps (its page cache, shared):
    a vLLM engine reads its weights into its own memory (never shared)."""
    if isinstance(cfg, config.VllmConfig):
        return False
    same = running.model is not None and Path(running.model) == Path(cfg.model)
    return same and cfg.load_mode in SHARED_MODES


def fit(
    need: memory.Need,
    cfg: config.AnyConfig,
    running: Running,
    host_free: int,
    headroom_mib: int = HEADROOM_MIB,
) -> Beside:
    """Both instances on the box: each side's new need against its free memory now."""
    if need.total is None:
        return Beside(None, f"the KV need is not known ({need.unsupported or 'no estimate'})")
    shared = shares_weights(cfg, running)
    headroom = headroom_mib * MiB
    # the running server's mapped pages are in MemAvailable, but stay in use beside a copy
    host_room = host_free - headroom - (0 if shared else running.mapped)
    if not need.sides:
        sides: tuple[SideFit, ...] = (SideFit(offload.HOST, need.total, host_room, shared),)
    else:
        sides = tuple(_side(s, host_room, shared) for s in need.sides if s.need)
    over = [s for s in sides if not s.fits]
    if over:
        worst = over[0]
        return Beside(
            False,
            f"{_words(worst.name)} would need {worst.need / MiB:,.0f} MiB for the new instance "
            f"beside the running one but can give {max(worst.room, 0) / MiB:,.0f} MiB "
            f"({_kept(worst.name, headroom_mib)})",
            sides,
        )
    weights = (
        "the host's weights counted once (both map the same model file)"
        if shared
        else "the weights counted twice (the new instance does not map the running one's file)"
    )
    copies = [s.name for s in sides if s.name not in (offload.HOST, "total")]
    if copies:
        weights += f", a second copy of the offloaded layers on {', '.join(copies)}"
    return Beside(
        True, f"both KV pools fit, {weights}, {headroom_mib} MiB of the host kept free", sides
    )


def _side(side: memory.Side, host_room: int, shared: bool) -> SideFit:
    assert side.need is not None
    if side.device_free is None:  # the host, with any unified device counted in it
        return SideFit(side.name, side.need, host_room, shared)
    if side.name == "total":  # the server's fit places it: host and devices as one pool
        return SideFit(side.name, side.need, host_room + side.device_free, shared)
    # a discrete device: every process holds its own copy of the weights it offloads; the
    # need keeps -fitt free there for compute buffers, the device's own headroom
    return SideFit(side.name, side.need, side.device_free, False)


def _kept(name: str, headroom_mib: int) -> str:
    if name in (offload.HOST, "total"):
        return f"{headroom_mib} MiB of the host kept free"
    return "its -fitt margin kept free"


def _words(name: str) -> str:
    if name == offload.HOST:
        return "the host"
    if name == "total":
        return "the box (host and devices together)"
    return f"device {name}"


def running_of(pid: int, live_config: Mapping[str, Any] | None) -> Running:
    """The running instance from its process and the live generation's (masked) config."""
    mapped = (memory.proc_status_bytes(pid, "RssFile") or 0) if pid > 0 else 0
    model = (live_config or {}).get("model")
    return Running(Path(model) if model else None, mapped)
