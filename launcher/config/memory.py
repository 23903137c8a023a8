"""The memory guard: does KV + weights + prompt cache fit what the box can give, side by side?

Seed 000's author sized a box from a per-token figure that was off by a factor of two; the
estimate here follows llama.cpp's allocation (``launcher.server.kvbytes``), and the deploy measures
the service before and after so the two can be compared.

On a box with devices (``launcher.server.devices``) the weights and the KV are placed where
llama-server puts them (``launcher.config.offload``), and each side is checked against its own free
memory plus what the running server frees there: the host (``MemAvailable``; the prompt
cache ``--cache-ram`` lives here) and every device (its free memory; ``-fitt``, 1024 MiB by
default, is kept free for compute buffers, as llama-server's fit keeps it). A device whose
memory is the host's (unified memory) is one side with the host, counted once. Where the code
cannot know (``-ngl auto`` with ``--fit on``: the server's fit chooses the layers; a backend
or buffer type it does not place) it checks what it can (the total over all sides) and says
that llama-server's fit and the gate's startup-line check decide the rest.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher import config
from launcher.config import offload
from launcher.errors import ConfigInvalid, MemoryGuardError, ValidationFailed
from launcher.host.systemd import UnitState
from launcher.server import devices, kvbytes, kvlayout

MiB = 1 << 20
#: -cram default: 8192 MiB of host RAM for the prompt cache (common/common.h:638).
DEFAULT_CACHE_RAM_MIB = 8192


#: Memory left free for what the estimate leaves out (compute buffers, output buffer, the
#: prompt cache's first entries): llama-server's own --fit-target default, 1024 MiB
#: (common/arg.cpp:2899-2922). The planner's and the second instance's fit keep it.
HEADROOM_MIB = 1024
MEMINFO = Path("/proc/meminfo")


def mem_available(meminfo: Path = MEMINFO) -> int:
    """``MemAvailable`` in bytes (the kernel's estimate of memory usable without swapping)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ConfigInvalid(f"{meminfo} has no MemAvailable line; give --mem-available MIB")


def mem_total(meminfo: Path = MEMINFO) -> int:
    """``MemTotal`` in bytes (0 when unreadable: no device is then taken for unified)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass(frozen=True)
class Side:
    """What one side of the box takes: the host (with any unified device) or a device."""

    name: str  # offload.HOST or a device name
    members: tuple[str, ...]  # the host and the unified devices counted with it
    weights: int
    kv: int | None
    cache_ram: int  # the host's prompt cache (host only)
    margin: int  # -fitt kept free on a device for compute buffers
    device_free: int | None  # the device's free memory (None: the host's MemAvailable)
    layers: int = 0  # offloaded layers here (the output layer counts)

    @property
    def need(self) -> int | None:
        return None if self.kv is None else self.weights + self.kv + self.cache_ram + self.margin

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "members": list(self.members),
            "weights_bytes": self.weights,
            "kv_bytes": self.kv,
            "cache_ram_bytes": self.cache_ram,
            "margin_bytes": self.margin,
            "need_bytes": self.need,
            "need_mib": None if self.need is None else round(self.need / MiB, 2),
            "device_free_bytes": self.device_free,
            "layers": self.layers,
        }


@dataclass(frozen=True)
class Need:
    """What a config will take: KV estimate, weights, prompt cache (bytes), and where."""

    kv: int | None
    weights: int
    cache_ram: int
    estimate: dict[str, Any] | None
    unsupported: str | None
    #: per side, when the binary has devices; () on a CPU-only box (one side: the host)
    sides: tuple[Side, ...] = ()
    #: what the code cannot know and leaves to llama-server's fit and the gate
    deferred: tuple[str, ...] = ()
    #: llama-fit-params' own figures per side, when it ran (bytes: model, context, compute)
    fit_params: dict[str, Any] | None = None
    devices: tuple[devices.Device, ...] = field(default_factory=tuple)

    @property
    def total(self) -> int | None:
        return None if self.kv is None else self.kv + self.weights + self.cache_ram

    @property
    def notes(self) -> list[str]:
        """What the report says about the memory check besides its verdict."""
        return [f"llama-launcher: memory: {d}" for d in self.deferred]

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
            "sides": [s.to_dict() for s in self.sides],
            "deferred": list(self.deferred),
            "fit_params": self.fit_params,
            "devices": [d.to_dict() for d in self.devices],
        }


def _kv_estimate(
    cfg: config.ServerConfig, plan: kvlayout.PoolPlan, layout: kvbytes.ModelInfo
) -> kvbytes.KvEstimate:
    try:
        return kvbytes.estimate(
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
        raise ValidationFailed("memory", str(e)) from None


def need(
    cfg: config.ServerConfig,
    plan: kvlayout.PoolPlan,
    layout: kvbytes.ModelInfo | None,
    weights: int,
    unsupported: str | None,
    box: Sequence[devices.Device] = (),
    tensors: Mapping[str, int] | None = None,
) -> Need:
    """The memory ``cfg`` takes under ``plan``; kv None when the estimator cannot tell.

    ``box`` is the binary's devices (``()``: a CPU-only build, everything on the host);
    ``tensors`` the model's weight tensors by name and size (``kvbytes.read_tensor_sizes``),
    needed only when there are devices.
    """
    cram = (DEFAULT_CACHE_RAM_MIB if cfg.cache_ram in (None, -1) else cfg.cache_ram) * MiB
    est = None if layout is None else _kv_estimate(cfg, plan, layout)
    kv = None if est is None else est.total_bytes
    base = Need(kv, weights, cram, None if est is None else est.to_dict(), unsupported)
    try:
        off = offload.parse(cfg)
        used = offload.active_devices(off, box)
    except ConfigInvalid as e:
        raise ValidationFailed("memory", str(e)) from None
    if not used:
        return base  # every byte on the host: the one side, as before
    n_layer_all = layout.n_layer_all if layout is not None else None
    sides, deferred = place_sides(base, off, used, tensors, n_layer_all, est)
    return _with(base, sides, deferred, used)


def place_sides(
    base: Need,
    off: offload.Offload,
    used: Sequence[devices.Device],
    tensors: Mapping[str, int] | None,
    n_layer_all: int | None,
    est: kvbytes.KvEstimate | None,
) -> tuple[tuple[Side, ...], list[str]]:
    """The sides of ``base``'s bytes on the devices ``used``, and what could not be known."""
    deferred = [
        f"{d.name} ({d.description}) is a {d.backend} device the code does not place; "
        "llama-server's fit and the gate decide whether it fits"
        for d in used
        if not d.known
    ]
    if n_layer_all is None and tensors:
        n_layer_all = _n_layer_from(tensors)
    if off.layers_by_fit or n_layer_all is None or tensors is None:
        deferred.append(
            "-ngl is auto and --fit is on: llama-server's fit chooses how many layers go to "
            f"{', '.join(d.name for d in used)} for their free memory; only the total over host "
            "and devices is checked here, and the gate checks the startup line"
            if off.layers_by_fit
            else "the model's tensors could not be read: only the total is checked"
        )
        return (_total_side(base, used, off),), deferred
    placed = offload.place(off, used, tensors, n_layer_all, est.per_layer if est else None)
    deferred += list(placed.unknown)
    return _sides(base, placed, off, base.kv is not None), deferred


def _with(
    base: Need, sides: tuple[Side, ...], deferred: list[str], used: Sequence[devices.Device]
) -> Need:
    return Need(
        base.kv,
        base.weights,
        base.cache_ram,
        base.estimate,
        base.unsupported,
        sides,
        tuple(deferred),
        None,
        tuple(used),
    )


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _n_layer_from(tensors: Mapping[str, int]) -> int | None:
    blocks = [int(m[1]) for name in tensors if (m := _BLOCK.match(name))]
    return max(blocks) + 1 if blocks else None


def _total_side(base: Need, used: Sequence[devices.Device], off: offload.Offload) -> Side:
    """Host and devices as one pool: what is known when the server's fit places the layers."""
    margin = sum(off.margin(i) for i in range(len(used)))
    free = sum(d.free for d in used if not d.unified)
    names = (offload.HOST, *(d.name for d in used))
    return Side("total", names, base.weights, base.kv, base.cache_ram, margin, free)


def _sides(
    base: Need, placed: offload.Layout, off: offload.Offload, known: bool
) -> tuple[Side, ...]:
    host_w = placed.weights[offload.HOST]
    host_kv = placed.kv[offload.HOST]
    members = [offload.HOST]
    margin = 0
    out: list[Side] = []
    for i, d in enumerate(placed.devices):
        w, kv = placed.weights[d.name], placed.kv[d.name]
        if d.unified:  # the host's memory: one side with the host, counted once
            members.append(d.name)
            host_w, host_kv, margin = host_w + w, host_kv + kv, margin + off.margin(i)
            continue
        side = Side(
            d.name,
            (d.name,),
            w,
            kv if known else None,
            0,
            off.margin(i),
            d.free,
            placed.layers[d.name],
        )
        out.append(side)
    host = Side(
        offload.HOST,
        tuple(members),
        host_w,
        host_kv if known else None,
        base.cache_ram,
        margin,
        None,
        sum(placed.layers[n] for n in members[1:]),
    )
    return (host, *out)


def guard(
    need: Need,
    releasable: int | Mapping[str, int] = 0,
    force: bool = False,
    available: int | None = None,
) -> None:
    """Refuse a config that does not fit, with the numbers and the cheapest fix.

    ``releasable`` is what the running server frees on restart: bytes on the host, or bytes
    per side (``offload.HOST`` and device names).
    """
    if need.total is None or force:
        return
    frees = {offload.HOST: releasable} if isinstance(releasable, int) else dict(releasable)
    host_free = mem_available() if available is None else available
    if not need.sides:
        _host_only(need, host_free, frees.get(offload.HOST, 0))
        return
    for side in need.sides:
        _check_side(need, side, host_free, frees)


def _host_only(need: Need, host_free: int, releasable: int) -> None:
    assert need.total is not None
    free = host_free + releasable
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


def proc_status_bytes(pid: int, field: str) -> int | None:
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
    return proc_status_bytes(state.main_pid, "RssAnon") or 0


def tree_releasable(state: UnitState, proc: Path = Path("/proc")) -> int:
    """``releasable_memory`` over the main process and its descendants: vLLM's KV cache and
    weights live in its engine's and workers' processes, not in its main one."""
    if not state.running or state.main_pid <= 0:
        return 0
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            parents[int(entry.name)] = int(fields[1])
    tree, grew = {state.main_pid}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    return sum(proc_status_bytes(pid, "RssAnon") or 0 for pid in tree)


def process_memory(state: UnitState) -> int | None:
    """The service's memory: the cgroup's MemoryCurrent, else MainPID's RSS from /proc."""
    if state.memory_current:
        return state.memory_current
    if state.main_pid > 0:
        return proc_status_bytes(state.main_pid, "VmRSS")
    return None


def side_frees(side: Side, frees: Mapping[str, int]) -> int:
    """What the running server frees on ``side``. For the host and devices as one pool, a
    live generation that was placed by the server's fit too is known only as a whole
    (``total``): that or what its members free, whichever is more (never both: the host's
    share of the whole is in the host's figure)."""
    back = sum(frees.get(m, 0) for m in side.members)
    return max(back, frees.get("total", 0)) if side.name == "total" else back


def side_room(side: Side, host_free: int, frees: Mapping[str, int]) -> int:
    """What ``side`` can give: its free memory plus what the running server frees there."""
    back = side_frees(side, frees)
    if side.name == "total":
        return host_free + (side.device_free or 0) + back
    return (host_free if side.device_free is None else side.device_free) + back


def _check_side(need: Need, side: Side, host_free: int, frees: Mapping[str, int]) -> None:
    total = side.need
    if total is None:
        return
    room = side_room(side, host_free, frees)
    if total <= room:
        return
    what = _side_words(side)
    parts = f"weights {side.weights / MiB:,.0f} + KV {(side.kv or 0) / MiB:,.0f}"
    if side.cache_ram:
        parts += f" + prompt cache {side.cache_ram / MiB:,.0f}"
    if side.margin:
        parts += f" + {side.margin / MiB:,.0f} kept free for compute buffers (-fitt)"
    back = side_frees(side, frees)
    raise MemoryGuardError(
        f"{what} needs about {total / MiB:,.0f} MiB ({parts}) but can give "
        f"{room / MiB:,.0f} MiB ({_free_words(side)} + {back / MiB:,.0f} the running server "
        f"frees). Cheapest fixes: "
        + "; ".join(_fixes(need, side, total - room))
        + ". Or deploy anyway with --force-memory."
    )


def _side_words(side: Side) -> str:
    if side.name == "total":
        return "the box (host and " + ", ".join(side.members[1:]) + " together)"
    if side.name == offload.HOST:
        if len(side.members) > 1:
            return f"the host with {', '.join(side.members[1:])} (unified memory, counted once)"
        return "the host"
    return f"device {side.name}"


def _free_words(side: Side) -> str:
    if side.name == "total":
        return "MemAvailable + the devices' free memory"
    return "MemAvailable" if side.device_free is None else f"{side.name}'s free memory"


def _fixes(need: Need, side: Side, over: int) -> list[str]:
    fixes = []
    # a unified device's layers moved to the host stay in the same memory: no fix there
    on_device = side.name not in (offload.HOST, "total")
    if on_device and side.layers > 0:
        per_layer = (side.weights + (side.kv or 0)) / side.layers
        drop = min(side.layers, int(over // per_layer) + 1) if per_layer else side.layers
        total_layers = sum(s.layers for s in need.sides)
        fixes.append(
            f"fewer layers on {side.name}: -ngl {max(0, total_layers - drop)} "
            f"(about {per_layer / MiB:,.0f} MiB per layer; the rest stays on the host)"
        )
    if side.kv:
        ctk = (need.estimate or {}).get("ctk", "f16")
        if ctk != "q8_0" and kvbytes.bytes_per_element(str(ctk)) > 1.0625:
            fixes.append(
                f"a q8_0 KV cache (-ctk q8_0 -ctv q8_0) stores the {side.kv / MiB:,.0f} MiB "
                f"of KV{' on ' + side.name if on_device else ''} in about half"
            )
        fixes.append("a smaller pool: a smaller -c or fewer slots (llama-launcher plan)")
    if side.cache_ram:
        fixes.append(f"a smaller prompt cache (-cram 1024 instead of {side.cache_ram // MiB})")
    return fixes


# -- what the server allocated, from its log -------------------------------------------------


def log_buffers(lines: Iterable[str]) -> dict[str, dict[str, int]]:
    """The buffers llama-server reported per buffer name (bytes), from its startup lines.

    ``{"model": {"CUDA0": ..., "CPU_Mapped": ...}, "kv": {...}, "compute": {...}}``; empty
    kinds are left out, so a log without the lines (they are libllama INFO, printed at
    ``-lv 4``) gives ``{}``. A restart's lines replace an earlier start's.
    """
    from launcher.server import serverlog

    out: dict[str, dict[str, int]] = {}
    for raw in lines:
        line = serverlog.normalize(raw)
        if serverlog.SERVER_INIT.search(line):
            out = {}
            continue
        for kind, pattern in serverlog.BUFFER_SIZES.items():
            if m := pattern.search(line):
                size = round(float(m["mib"]) * MiB)
                bucket = out.setdefault(kind, {})
                bucket[m["buffer"]] = bucket.get(m["buffer"], 0) + size
                break
    return out


def buffer_side(buffer: str, device_names: Iterable[str]) -> str:
    """The side a buffer name is on: a device (``CUDA0``) or the host (``CPU``,
    ``CPU_Mapped``, ``CUDA_Host``, anything else)."""
    for name in device_names:
        if buffer == name:
            return name
    return offload.HOST


def by_side(
    buffers: Mapping[str, Mapping[str, int]], device_names: Iterable[str] = ()
) -> dict[str, int]:
    """The reported buffers summed per side; a device name that is not listed is kept as
    its own side when it does not look like a host buffer."""
    names = list(device_names)
    out: dict[str, int] = {}
    for kind in buffers.values():
        for buffer, size in kind.items():
            side = buffer_side(buffer, names)
            if side == offload.HOST and re.fullmatch(r"[A-Za-z]+\d+", buffer) and buffer != "CPU":
                side = buffer  # CUDA0 of a log read without the device list
            out[side] = out.get(side, 0) + size
    return out


#: How far llama-fit-params' figure for a device may be from this estimate before the
#: report says so (a quarter, and at least 256 MiB).
FIT_TOLERANCE = 0.25


def fit_disagreements(need: Need, lines: Sequence[devices.FitLine]) -> list[str]:
    """Where llama-fit-params (the build's own estimate) puts much more or less of the
    weights and context on a device than this estimate: said, not refused (the guard checks
    its own figure, the gate what the server does)."""
    ours = {
        s.name: s.weights + (s.kv or 0) for s in need.sides if s.name not in (offload.HOST, "total")
    }
    out = []
    for line in lines:
        mine, theirs = ours.get(line.name), line.model + line.context
        if mine is None:  # the Host line, or a device this estimate does not place
            continue
        off = abs(theirs - mine)
        if off > FIT_TOLERANCE * max(theirs, mine) and off > 256 * MiB:
            out.append(
                f"llama-fit-params puts {theirs / MiB:,.0f} MiB of weights and context on "
                f"{line.name} where this estimate has {mine / MiB:,.0f} MiB; the guard checks "
                "its own figure, and the gate what the server really allocates"
            )
    return out


def device_releasable(live_meta: Mapping[str, Any] | None) -> dict[str, int]:
    """What the running generation holds on each device, freed by a restart: the buffers
    its log reported, else its estimate per device (``total``: host and devices as one,
    where the server's fit placed the layers). The host's share is not here (that is the
    process's anonymous memory, read from /proc)."""
    if not live_meta:
        return {}
    mem = live_meta.get("memory") or {}
    reported = mem.get("devices") or {}
    if isinstance(reported, dict) and reported.get("buffers"):
        sides = by_side(reported["buffers"], reported.get("device_names") or ())
        return {k: v for k, v in sides.items() if k != offload.HOST}
    est = live_meta.get("kv_estimate") or {}
    out: dict[str, int] = {}
    for side in est.get("sides") or ():
        if side.get("name") != offload.HOST:
            out[str(side["name"])] = int(side.get("weights_bytes") or 0) + int(
                side.get("kv_bytes") or 0
            )
    return out


def measured(lines: Iterable[str], box: Sequence[devices.Device] = ()) -> dict[str, Any]:
    """A generation's record of what the server reported: buffers by name and per side."""
    buffers = log_buffers(lines)
    names = [d.name for d in box]
    if not buffers:
        return {
            "buffers": {},
            "by_side": {},
            "device_names": names,
            "note": "the log has no buffer sizes: llama-server prints them at -lv 4 "
            "(libllama INFO lines); add -lv 4 to record them",
        }
    return {"buffers": buffers, "by_side": by_side(buffers, names), "device_names": names}
