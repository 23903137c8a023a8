"""``llama-launcher plan``: the table of options for N slots x W tokens on this box.

For a wanted slot count and per-slot window, ``make_plan`` lays out what each way of running
llama-server guarantees and costs: the over-committed shared pool (``-c W -np N -kvu``), the
split pool (``-c W -np N``), the per-slot cap (``--kv-unified-per-slot W``, pool N x W) at
f16 / q8_0 / q4_0, fewer slots and a smaller window. With a model it estimates the KV memory
(``launcher.server.kvbytes``) and what is left of ``MemAvailable`` after the weights and the KV; it
recommends one option as a ``llama-launcher set ...`` line. With devices (``--devices``, a
saved ``--list-devices``, or the live binary's) the weights and KV are placed as
llama-server places them with ``-ngl`` (all layers by default: ``launcher.config.offload``) and
every side, the host and each device, is checked; the option's free memory is that of the
side that limits it. Pure apart from reading the GGUF and /proc/meminfo; returns frozen
results and never prints.

Only flags the installed llama-server has are offered: on a build without
``--kv-unified-per-slot`` (before b10901) the guaranteed rows are split pools of W each
(``-c N*W -np N -no-kvu``, the same cells as the cap), fewer slots or a smaller window.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from launcher.config import memory, offload
from launcher.config.memory import DEFAULT_CACHE_RAM_MIB, HEADROOM_MIB, mem_available
from launcher.errors import ConfigInvalid
from launcher.server import binary, kvbytes, kvlayout
from launcher.server.devices import Device

MIB = 1024 * 1024
#: The per-slot cap of a shared pool (b10901 and later).
CAP = "--kv-unified-per-slot"
#: Cache types the per-slot rows compare (f16, then 8 and 4 bit).
PER_SLOT_TYPES = ("f16", "q8_0", "q4_0")
#: The smaller-window option is a multiple of this (1k tokens: a number to tell clients).
WINDOW_STEP = 1024


@dataclass(frozen=True)
class ModelSummary:
    """What the plan knows about the model."""

    path: str
    arch: str
    n_ctx_train: int
    weights_bytes: int
    info: kvbytes.ModelInfo | None  # None: the estimator does not cover this model
    unsupported: str | None = None  # why, when info is None
    tensors: Mapping[str, int] | None = None  # weight tensors by name, for placing them

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "path": self.path,
            "arch": self.arch,
            "n_ctx_train": self.n_ctx_train,
            "weights_mib": round(self.weights_bytes / MIB, 1),
            "estimate_supported": self.info is not None,
        }
        if self.info is not None:
            data["kind"] = self.info.kind
            data["kv_layers"] = len(self.info.kv_layers)
            data["f16_bytes_per_cell"] = self.info.bytes_per_cell("f16", "f16")
        if self.unsupported:
            data["unsupported"] = self.unsupported
        return data


def load_model(path: Path | str) -> ModelSummary:
    """Read the GGUF once; a model the estimator refuses still gives n_ctx_train and weights."""
    p = Path(path)
    try:
        md = kvbytes.read_metadata(p)
    except FileNotFoundError as e:
        raise ConfigInvalid(f"--model {p} does not exist; give the GGUF file") from e
    except (OSError, ValueError, KeyError) as e:
        raise ConfigInvalid(f"--model {p} is not a readable GGUF file ({e})") from e
    weights = kvbytes.weights_size(p, md)
    arch = str(md.get("general.architecture", ""))
    n_ctx_train = md.get(f"{arch}.context_length")
    if not arch or not isinstance(n_ctx_train, int):
        raise ConfigInvalid(f"--model {p} has no architecture/context_length; is it a model?")
    try:
        info = kvbytes.ModelInfo.from_metadata(md, str(p), weights)
    except kvbytes.EstimateUnsupported as e:
        return ModelSummary(str(p), arch, n_ctx_train, weights, None, str(e))
    return ModelSummary(str(p), arch, info.n_ctx_train, weights, info)


@dataclass(frozen=True)
class Option:
    """One row of the table: a way to run the slots, what it guarantees and costs."""

    key: str
    summary: str
    cache_type: str
    flags: tuple[str, ...]
    pool: kvlayout.PoolPlan
    kv: kvbytes.KvEstimate | None
    free_bytes: int | None  # MemAvailable - weights - KV - --cache-ram (the limiting side's)
    sides: tuple[memory.Side, ...] = ()  # with devices: what each side takes
    side_free: tuple[tuple[str, int], ...] = ()  # (side, free bytes after this option)
    limit: str | None = None  # the side with the least left, with devices

    @property
    def guaranteed_window(self) -> int:
        return self.pool.guaranteed_window

    @property
    def kv_mib(self) -> float | None:
        return None if self.kv is None else self.kv.total_mib

    @property
    def free_mib(self) -> float | None:
        return None if self.free_bytes is None else self.free_bytes / MIB

    def fits(self, headroom_mib: int = HEADROOM_MIB) -> bool | None:
        """Whether the KV leaves ``headroom_mib`` free; None without an estimate."""
        return None if self.free_bytes is None else self.free_bytes >= headroom_mib * MIB

    @property
    def set_command(self) -> str:
        return "llama-launcher set " + " ".join(self.flags)

    def to_dict(self, headroom_mib: int = HEADROOM_MIB) -> dict[str, Any]:
        return {
            "key": self.key,
            "summary": self.summary,
            "cache_type": self.cache_type,
            "flags": list(self.flags),
            "set_command": self.set_command,
            "n_slots": self.pool.n_slots,
            "kv_unified": self.pool.kv_unified,
            "pool_cells": self.pool.n_ctx,
            "n_ctx_slot": self.pool.n_ctx_slot,
            "guaranteed_window": self.guaranteed_window,
            "overcommitted": self.pool.overcommitted,
            "kv_mib": None if self.kv_mib is None else round(self.kv_mib, 1),
            "free_mib": None if self.free_mib is None else round(self.free_mib, 1),
            "fits": self.fits(headroom_mib),
            "sides": [
                {**side.to_dict(), "free_mib": round(free / MIB, 1)}
                for side, (_, free) in zip(self.sides, self.side_free, strict=True)
            ],
            "limit": self.limit,
        }


@dataclass(frozen=True)
class Plan:
    """The whole table plus the recommendation."""

    slots: int
    window: int
    cache: str
    model: ModelSummary | None
    mem_available_bytes: int
    headroom_mib: int
    options: tuple[Option, ...]
    recommended: str  # an Option.key
    reason: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    devices: tuple[Device, ...] = ()

    def option(self, key: str) -> Option:
        for opt in self.options:
            if opt.key == key:
                return opt
        raise KeyError(key)

    @property
    def recommendation(self) -> Option:
        return self.option(self.recommended)

    def to_dict(self) -> dict[str, Any]:
        return {
            "slots": self.slots,
            "window": self.window,
            "cache": self.cache,
            "model": None if self.model is None else self.model.to_dict(),
            "mem_available_mib": round(self.mem_available_bytes / MIB, 1),
            "headroom_mib": self.headroom_mib,
            "options": [o.to_dict(self.headroom_mib) for o in self.options],
            "recommended": self.recommended,
            "recommendation": self.recommendation.set_command,
            "reason": self.reason,
            "notes": list(self.notes),
            "devices": [d.to_dict() for d in self.devices],
        }


def _flags(
    c: int, slots: int, unified: bool, per_slot: int, cache: str, cram: int, ngl: str | None
) -> tuple[str, ...]:
    flags = ["-c", str(c), "-np", str(slots), "-kvu" if unified else "-no-kvu"]
    if per_slot:
        flags += ["--kv-unified-per-slot", str(per_slot)]
    flags += ["-ctk", cache, "-ctv", cache]
    if cram != DEFAULT_CACHE_RAM_MIB:
        flags += ["--cache-ram", str(cram)]  # what the free memory was counted with
    if ngl is not None:
        flags += ["-ngl", ngl]  # the offload the devices' memory was counted with
    return tuple(flags)


class _Builder:
    """Builds options for one model and box."""

    def __init__(
        self,
        model: ModelSummary | None,
        available: int,
        cram: int,
        box: Sequence[Device] = (),
        n_gpu_layers: int | None = None,
        capped: bool = True,
    ) -> None:
        self.model, self.available, self.cram = model, available, cram
        self.info = model.info if model else None
        self.n_ctx_train = model.n_ctx_train if model else None
        self.box = tuple(box)
        self.ngl = None if not box else "all" if n_gpu_layers is None else str(n_gpu_layers)
        # the headroom is kept on every side, so no -fitt margin on top of it here
        self.off = offload.Offload(
            n_gpu_layers=n_gpu_layers, all_layers=n_gpu_layers is None, fit_target_mib=(0,)
        )
        self.deferred: list[str] = []
        #: the binary has --kv-unified-per-slot; else the guarantee is a split pool of W each
        self.capped = capped
        self.guarded = "per-slot" if capped else "split"

    def option(
        self,
        key: str,
        summary: str,
        slots: int,
        window: int,
        unified: bool,
        per_slot: bool,
        cache: str,
    ) -> Option:
        c = slots * window if per_slot or (not unified and key.startswith("split-")) else window
        cap = window if per_slot else 0
        plan = kvlayout.resolve(c, slots, unified, cap, self.n_ctx_train)
        kv = kvbytes.estimate(self.info, plan, cache, cache) if self.info else None
        flags = _flags(c, slots, unified, cap, cache, self.cram, self.ngl)
        free = None
        if kv is not None and self.model is not None:
            if self.box and self.info is not None:
                return self._on_sides(Option(key, summary, cache, flags, plan, kv, None), kv)
            # what the deploy's memory guard counts too (memory.need), so a recommended line
            # is not refused there
            free = self.available - self.model.weights_bytes - kv.total_bytes - self.cram * MIB
        return Option(key, summary, cache, flags, plan, kv, free)

    def _on_sides(self, opt: Option, kv: kvbytes.KvEstimate) -> Option:
        """``opt`` placed on the host and the devices; its free memory is the limiting side's."""
        assert self.model is not None and self.info is not None
        base = memory.Need(kv.total_bytes, self.model.weights_bytes, self.cram * MIB, None, None)
        sides, deferred = memory.place_sides(
            base, self.off, self.box, self.model.tensors, self.info.n_layer_all, kv
        )
        self.deferred = deferred
        left = tuple(
            (s.name, memory.side_room(s, self.available, {}) - (s.need or 0)) for s in sides
        )
        limit, free = min(left, key=lambda item: item[1])
        return replace(opt, free_bytes=free, sides=sides, side_free=left, limit=limit)

    def per_slot(self, slots: int, window: int, cache: str, key: str = "") -> Option:
        """The option that guarantees ``window`` to each of ``slots``: the per-slot cap, or
        on a build without it, split pools of ``window`` each."""
        if not self.capped:
            return self.option(
                f"split-{cache}" if not key else f"split-{key}",
                f"split the pool: {slots} pools of {window}, one per slot ({cache})",
                slots,
                window,
                False,
                False,
                cache,
            )
        return self.option(
            key or f"per-slot-{cache}",
            f"cap every slot at {window} and size the pool for all {slots} ({cache})",
            slots,
            window,
            True,
            True,
            cache,
        )

    def largest(self, fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
        """The largest x in [lo, hi] with fits(x), for a monotone ``fits``; None if none."""
        if hi < lo or not fits(lo):
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo


def _check(slots: int, window: int, model: ModelSummary | None) -> None:
    if not 1 <= slots <= kvlayout.MAX_SLOTS:
        raise ConfigInvalid(f"--slots {slots} is out of range; use 1..{kvlayout.MAX_SLOTS}")
    if window < 1:
        raise ConfigInvalid(f"--window {window} must be at least 1 token; e.g. --window 32768")
    if model is not None and window > model.n_ctx_train:
        raise ConfigInvalid(
            f"--window {window} exceeds the training context of {model.path} "
            f"({model.n_ctx_train}); llama-server caps every slot there: "
            f"use --window {model.n_ctx_train} or less"
        )


def make_plan(
    slots: int,
    window: int,
    cache: str = "f16",
    model: ModelSummary | Path | str | None = None,
    available: int | None = None,
    headroom_mib: int = HEADROOM_MIB,
    cache_ram_mib: int | None = None,
    box: Sequence[Device] = (),
    n_gpu_layers: int | None = None,
    server: binary.BinaryInfo | None = None,
) -> Plan:
    """The options for ``slots`` clients that each need ``window`` tokens.

    ``model`` is a GGUF path (or an already loaded ``ModelSummary``); without one only the
    pool arithmetic is done. ``available`` is the host memory to plan for in bytes (default:
    this machine's MemAvailable). ``cache_ram_mib`` is llama-server's host prompt cache
    (-cram), counted as used (None: its default). ``box`` is the devices (their free memory
    is planned for) and ``n_gpu_layers`` the ``-ngl`` to place with (None: all layers).
    ``server`` is the installed llama-server: only its flags are offered (None: a build with
    --kv-unified-per-slot is assumed, and a note says so). Raises ``ConfigInvalid`` for bad
    input.
    """
    if isinstance(model, (str, Path)):
        model = load_model(model)
    if box and model is not None and model.tensors is None:
        model = replace(model, tensors=_tensors(model.path))
    _check(slots, window, model)
    kvbytes.check_cache_types(model.info if model else None, cache, cache, "auto")
    avail = mem_available() if available is None else available
    cram = DEFAULT_CACHE_RAM_MIB if cache_ram_mib is None else cache_ram_mib
    lacks = server.lacks(CAP) if server is not None else None
    b = _Builder(model, avail, cram, box, n_gpu_layers, capped=lacks is None)
    w, n = window, slots
    opts = _rows(b, n, w, cache, model)
    notes = _server_notes(lacks, server)
    if b.info is not None and not b.per_slot(n, w, cache).fits(headroom_mib):
        opts += _alternatives(b, n, w, cache, headroom_mib)
    elif b.info is not None:
        notes.append(f"{n} x {w} fits at {cache}: no need for fewer slots or a smaller window")
    key, reason = _recommend(opts, headroom_mib, n, w, cache, b.guarded)
    if box and b.info is not None:
        notes += _fewer_layers(b, next(o for o in opts if o.key == key), headroom_mib)
    notes += _memory_notes(b, model, box, cram)
    return Plan(
        n, w, cache, model, avail, headroom_mib, tuple(opts), key, reason, tuple(notes), tuple(box)
    )


def _rows(b: _Builder, n: int, w: int, cache: str, model: ModelSummary | None) -> list[Option]:
    """The rows every plan has: the over-committed shared pool, the split pool, and the
    guaranteed window at each cache type the model can use (and at ``cache``)."""
    opts = [
        b.option(
            "shared",
            f"one pool of {w} shared by {n} slots (over-committed: when they fill it together "
            "every request in flight fails; behind install --front haproxy --admission they "
            "wait instead)",
            n,
            w,
            True,
            False,
            cache,
        ),
        b.option("split", f"{w} split into {n} pools of ~{w // n}", n, w, False, False, cache),
    ]
    # only the cache types this model can use (a head size of 80 takes no 32-value blocks)
    types = [t for t in PER_SLOT_TYPES if _accepts(model, t)]
    per_slot = [b.per_slot(n, w, t) for t in types]
    if cache not in types:
        per_slot.append(b.per_slot(n, w, cache))
    return opts + per_slot


def _server_notes(lacks: str | None, server: binary.BinaryInfo | None) -> list[str]:
    """What the rows assume of the llama-server they are for."""
    if lacks:
        return [f"{lacks}: the guaranteed rows split the pool instead"]
    if server is None:
        return [
            f"no --llama-server: the rows assume a build with {CAP} "
            f"(b{binary.FLAG_ADDED_IN[CAP]} or later)"
        ]
    return []


def _memory_notes(
    b: _Builder, model: ModelSummary | None, box: Sequence[Device], cram: int
) -> list[str]:
    """How the free memory of the rows was counted, or why it could not be."""
    if model is None:
        return ["no --model: the KV memory cannot be estimated; pass the GGUF to get it"]
    if model.info is None and model.unsupported:
        return [model.unsupported]
    if box:
        sides = ", ".join(
            f"{d.name} {d.free / MIB:,.0f} MiB free"
            + (" (unified: the host's memory)" if d.unified else "")
            for d in box
        )
        return [
            f"placed as llama-server places -ngl {b.ngl} on {sides}: free is what the side that "
            f"limits an option keeps (host: MemAvailable - host weights - host KV - --cache-ram "
            f"{cram} MiB; a device: its free memory - its weights and KV); it leaves out compute "
            "buffers (the headroom is kept on every side)",
            *b.deferred,
        ]
    return [
        f"free = MemAvailable - weights - KV - the host prompt cache (--cache-ram {cram} "
        "MiB, as the deploy's memory guard counts it; plan --cache-ram N to change it); "
        "it leaves out compute buffers; run plan while llama-server is stopped, or its "
        "current KV is counted as used"
    ]


def _fewer_layers(b: _Builder, opt: Option, headroom_mib: int) -> list[str]:
    """When a device limits the recommended option, the most layers that let it fit."""
    if opt.fits(headroom_mib) or opt.limit in (None, offload.HOST) or b.info is None:
        return []
    p = opt.pool
    cap = p.per_slot_cap
    total = b.info.n_layer_all + 1

    def fits(ngl: int) -> bool:
        nb = _Builder(b.model, b.available, b.cram, b.box, ngl)
        o = nb.option(
            opt.key, opt.summary, p.n_slots, cap or p.n_ctx, p.kv_unified, bool(cap), opt.cache_type
        )
        return bool(o.fits(headroom_mib))

    ngl = b.largest(fits, 0, total - 1)
    if ngl is None:
        return [f"{opt.key} does not fit even with -ngl 0 (everything on the host)"]
    return [
        f"{opt.key} fits with -ngl {ngl} ({ngl} of {total} layers on the devices, the rest "
        f"and their KV on the host): plan --ngl {ngl} shows it"
    ]


def _tensors(path: str) -> dict[str, int]:
    try:
        return kvbytes.read_tensor_sizes(path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigInvalid(f"--model {path}: its tensors cannot be read ({e})") from e


def _alternatives(b: _Builder, n: int, w: int, cache: str, headroom_mib: int) -> list[Option]:
    """Fewer slots with the full window, or all slots with the largest window that fits."""
    out: list[Option] = []
    fewer = b.largest(lambda k: bool(b.per_slot(k, w, cache).fits(headroom_mib)), 1, n - 1)
    if fewer is not None:
        opt = b.per_slot(fewer, w, cache, "fewer-slots")
        slots = "1 slot" if fewer == 1 else f"{fewer} slots"
        out.append(_retitle(opt, f"{slots} x {w}, each guaranteed ({cache})"))
    step = WINDOW_STEP
    smaller = b.largest(
        lambda k: bool(b.per_slot(n, k * step, cache).fits(headroom_mib)), 1, (w - 1) // step
    )
    if smaller is not None:
        sw = smaller * step
        opt = b.per_slot(n, sw, cache, "smaller-window")
        out.append(_retitle(opt, f"{n} slots x {sw}, each guaranteed; tell clients {sw}"))
    return out


def _accepts(model: ModelSummary | None, cache: str) -> bool:
    try:
        kvbytes.check_cache_types(model.info if model else None, cache, cache, "auto")
    except ConfigInvalid:
        return False
    return True


def _retitle(opt: Option, summary: str) -> Option:
    return replace(opt, summary=summary)


def _same_or_smaller(cache: str) -> list[str]:
    """``cache``, then the per-slot types that store fewer bytes per element, largest first."""
    size = kvbytes.bytes_per_element(cache)
    smaller = [t for t in PER_SLOT_TYPES if kvbytes.bytes_per_element(t) < size]
    return [cache, *sorted(smaller, key=kvbytes.bytes_per_element, reverse=True)]


def _recommend(
    opts: list[Option], headroom_mib: int, n: int, w: int, cache: str, guarded: str = "per-slot"
) -> tuple[str, str]:
    by_key = {o.key: o for o in opts}
    if all(o.kv is None for o in opts):
        how = (
            f"caps every slot at {w} and sizes the pool for all {n}"
            if guarded == "per-slot"
            else f"gives each of the {n} slots a pool of {w} of its own"
        )
        return f"{guarded}-{cache}", f"{how}: no slot can starve another"
    for t in _same_or_smaller(cache):
        opt = by_key.get(f"{guarded}-{t}")
        if opt is not None and opt.fits(headroom_mib):
            why = f"guarantees {w} to all {n} slots at {t} and leaves {opt.free_mib:.0f} MiB free"
            if t != cache:
                why += f" ({cache} does not fit)"
            return opt.key, why
    keys = ("fewer-slots", "smaller-window")
    alternatives = [by_key[k] for k in (*keys, *(f"split-{k}" for k in keys)) if k in by_key]
    if alternatives:
        # the one that guarantees the most context at once
        best = max(alternatives, key=lambda o: o.pool.n_slots * o.guaranteed_window)
        return best.key, (
            f"no cache type fits {n} x {w}; {best.pool.n_slots} x {best.guaranteed_window} "
            f"is the most guaranteed context that fits at {cache}"
        )
    split = by_key["split"]
    if split.fits(headroom_mib):
        return (
            "split",
            "nothing else fits: split pools cost no extra memory and fail one slot at a time",
        )
    return "split", (
        f"nothing fits this box, not even split pools ({split.free_mib:.0f} MiB free, "
        f"{headroom_mib} MiB headroom wanted): this line is the least memory for {n} x {w}; "
        "use a smaller model or window, fewer slots, a smaller --cache-ram, or a bigger box"
    )
