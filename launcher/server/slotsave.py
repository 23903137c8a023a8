"""Carry llama-server's per-slot KV caches across a restart: save, fingerprint, restore.

With ``--slot-save-path DIR``, ``POST /slots/{id}?action=save`` writes a slot's tokens and KV
cells to ``DIR/<filename>`` and ``?action=restore`` reads them back (b11434,
tools/server/server-context.cpp). Measured on b11434: a 2051-token prompt saved, the server
restarted, the slot restored, and the next request read 1 prompt token instead of 2051
(8.4 ms instead of 418 ms). A save waits while its slot is processing, so it follows the
drain.

The file holds raw KV cells: the server checks only that they fit, not that they mean the
same. A restore is tried only when what the KV layout depends on is unchanged (the
*fingerprint*: the model file's identity, the build, ``-ctk/-ctv``, the pool and slots as
planned, the per-slot cap, ``--swa-full``, flash attention); after ``-ctk q8_0`` or
``-np 1 -c 4096`` -> ``-np 2 -c 8192`` the server refuses the file with 400 "invalid slot save
file", and the fingerprint skips it before that, with the reason.

The gate's probe and the restore: the probe runs before the restore and lands on whichever
slot is idle; the restore then replaces that slot's cells with the saved ones, so the probe
never evicts a restored cache. Nothing else reaches the new server before the restore with
a front (it holds every request); without one, a client that comes in between is served
from an empty slot, and the restore of that slot waits until it is done.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

#: The name of a saved slot in the server's --slot-save-path (llama-server accepts only a
#: plain file name: fs_validate_filename in common/common.cpp).
FILENAME = "llama-launcher-slot-{slot}.bin"

#: Every file named so, and a copy under way (the sweep of a killed deploy's leftovers).
FILE_PATTERN = re.compile(r"^llama-launcher-slot-\d+\.bin(\.part)?$")
#: The suffix of a copy under way into another folder (``move``), renamed when whole.
PART = ".part"

#: A slot file as b11434 writes it (read from the files: ``llama_state_seq_save_file`` in
#: src/llama-context.cpp, the server's token words, the KV cache's state): a header of three
#: uint32 (magic ``ggsq`` = LLAMA_STATE_SEQ_MAGIC, version, the count of token words), the
#: token words (the server's own 4 before the tokens), then the cells: 12 bytes of metadata
#: each (position, one sequence id) and their K and V rows. The tiny test model's cells are
#: 512 bytes of KV: 528 bytes a token with the rest, 597,272 bytes for 1,131 tokens. b11434
#: aborts (SIGABRT) on a file cut short by as little as 8 bytes.
SEQ_MAGIC = 0x67677371
HEADER = struct.Struct("<III")
TOKEN_WORD = 4
CELL_META = 12

#: The flags besides the typed ones that change the KV layout (common/arg.cpp).
LAYOUT_EXTRA_FLAGS = ("--swa-full", "-fa", "--flash-attn", "--no-kv-offload", "-nkvo")


class SlotError(Exception):
    """A save or restore request failed (the message says how)."""


class RestoreCrashed(SlotError):
    """The server went down during a restore (a slot file it could not read)."""

    def __init__(self, slot: int, message: str) -> None:
        self.slot = slot
        super().__init__(message)


@dataclass(frozen=True)
class Saved:
    """One slot written to the save path."""

    slot: int
    filename: str
    tokens: int
    bytes: int
    ms: float

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def fingerprint(meta: dict[str, Any]) -> dict[str, Any] | None:
    """What the KV layout of a generation depends on, from its stored meta (the model's
    identity as it was when that generation was deployed). None for a generation the tool
    did not render (an adopted hand-written file): its layout is unknown."""
    cfg = meta.get("config") or {}
    planned = meta.get("planned") or {}
    if not cfg or not planned:
        return None
    model = meta.get("model") or {}
    layout_extra = _layout_words(list(cfg.get("extra_args") or ()))
    return {
        "model": [model.get(k) for k in ("path", "size", "mtime_ns", "inode")],
        "build": (meta.get("llama_server") or {}).get("fingerprint"),
        "cache_type_k": cfg.get("cache_type_k") or "f16",
        "cache_type_v": cfg.get("cache_type_v") or "f16",
        "pool_cells": planned.get("pool_cells"),
        "n_slots": planned.get("n_slots"),
        "kv_unified": planned.get("kv_unified"),
        "n_ctx_slot": planned.get("n_ctx_slot"),
        "kv_unified_per_slot": cfg.get("kv_unified_per_slot"),
        "flash_attn": cfg.get("flash_attn") or "auto",
        "layout_flags": layout_extra,
    }


def _layout_words(words: list[str]) -> list[str]:
    """The layout flags among ``extra_args``, each with its value (``-fa on``)."""
    out: list[str] = []
    taking = False
    for w in words:
        if w.startswith("-"):
            taking = w.split("=", 1)[0] in LAYOUT_EXTRA_FLAGS
            if taking:
                out.append(w)
            taking = taking and "=" not in w
        elif taking:
            out.append(w)
            taking = False
    return out


def differences(old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[str]:
    """Why a save made under ``old`` cannot be restored under ``new`` (empty: it can)."""
    if old is None:
        return ["the live config was not deployed by llama-launcher, so its KV layout is unknown"]
    if new is None:
        return ["the new config's KV layout is unknown"]
    names = {"model": "model file", "build": "llama-server build"}
    return [
        f"{names.get(k, k)} changed ({_short(old.get(k))} -> {_short(new.get(k))})"
        for k in old.keys() | new.keys()
        if old.get(k) != new.get(k)
    ]


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def save_path(config: dict[str, Any]) -> Path | None:
    """The --slot-save-path of a config (its stored form), or None."""
    value = config.get("slot_save_path")
    return Path(value) if value else None


def no_carry(config: dict[str, Any]) -> str:
    """Why nothing is carried from a server with the stored ``config`` (no ``save_path``)."""
    if config.get("backend") == "vllm":
        return "vLLM keeps no slot cache to carry"
    return "the live config has no --slot-save-path: no cache is carried"


def slot_ids(client: httpx.Client) -> list[int]:
    """The slots the server has (``GET /slots``)."""
    import httpx

    try:
        r = client.get("/slots", timeout=10)
        r.raise_for_status()
        return [int(s["id"]) for s in r.json()]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise SlotError(f"GET /slots failed: {e}") from e


def save(client: httpx.Client, slot: int, timeout: float = 600.0) -> Saved:
    """Save one slot; it waits while the slot is processing (server-side)."""
    name = FILENAME.format(slot=slot)
    data = _post(client, slot, "save", name, timeout)
    return Saved(
        slot,
        name,
        int(data.get("n_saved", 0)),
        int(data.get("n_written", 0)),
        float((data.get("timings") or {}).get("save_ms", 0.0)),
    )


def restore(client: httpx.Client, saved: Saved, timeout: float = 600.0) -> dict[str, Any]:
    """Restore one saved slot into the same slot id; the server's answer."""
    return _post(client, saved.slot, "restore", saved.filename, timeout)


def _post(
    client: httpx.Client, slot: int, action: str, filename: str, timeout: float
) -> dict[str, Any]:
    import httpx

    try:
        r = client.post(
            f"/slots/{slot}",
            params={"action": action},
            json={"filename": filename},
            timeout=timeout,
        )
    except httpx.HTTPError as e:
        raise SlotError(f"{action} of slot {slot} failed: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        try:
            msg = str(r.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            msg = r.text[:200]
        hint = ""
        if r.status_code == 501 or "slot-save-path" in msg:
            hint = " (the server runs without --slot-save-path)"
        raise SlotError(f"{action} of slot {slot} returned {r.status_code}: {msg}{hint}")
    try:
        data = r.json()
    except ValueError as e:
        raise SlotError(f"{action} of slot {slot}: the answer is not JSON: {r.text[:200]}") from e
    return data if isinstance(data, dict) else {}


#: What a save leaves free on the slot folder's filesystem, beyond the slots' own files
#: (the state directory shares it with the journal, the store and often the weights).
RESERVE_BYTES = 1 << 30
MiB = 1 << 20


def no_room(folder: Path, kv_bytes: int | None) -> str | None:
    """Why the slots cannot be saved into ``folder`` without filling its filesystem, or
    None. All saved slots together hold at most the KV pool (``kv_bytes``, the generation's
    estimate; unknown: only the reserve is checked)."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError as e:
        return f"cannot read the free space of {folder}: {e}"
    need = (kv_bytes or 0) + RESERVE_BYTES
    if free >= need:
        return None
    return (
        f"{folder} has {free / MiB:.0f} MiB free; the slot files need up to "
        f"{(kv_bytes or 0) / MiB:.0f} MiB (the KV pool) and {RESERVE_BYTES / MiB:.0f} MiB stay "
        "free: free space there, give the config a --slot-save-path on a larger filesystem, "
        "or set carry_slots = false"
    )


def save_all(
    client: httpx.Client, folder: Path, only: list[int] | None = None
) -> tuple[list[Saved], list[dict[str, Any]]]:
    """Save every slot (``only``: those) that holds tokens; (saved, skipped with the
    reason). A slot that holds nothing leaves no file."""
    saved: list[Saved] = []
    skipped: list[dict[str, Any]] = []
    try:
        ids = slot_ids(client) if only is None else only
    except SlotError as e:
        return [], [{"slot": None, "reason": str(e)}]
    for slot in ids:
        try:
            s = save(client, slot)
        except SlotError as e:
            skipped.append({"slot": slot, "reason": str(e)})
            continue
        if s.tokens > 0:
            saved.append(s)
        else:
            discard(folder, [s])
    return saved, skipped


def bytes_per_token(meta: dict[str, Any]) -> int | None:
    """KV bytes a cell holds in the layout a generation's meta estimated: the cache that
    holds every token (``kv``, or an iSWA model's ``non-SWA``); None when not estimated."""
    est = ((meta.get("kv_estimate") or {}).get("estimate")) or {}
    for cache in est.get("caches") or ():
        cells = int(cache.get("cells") or 0) * int(cache.get("streams") or 1)
        if cache.get("label") in ("kv", "non-SWA") and cells > 0:
            return (int(cache.get("k_bytes") or 0) + int(cache.get("v_bytes") or 0)) // cells
    return None


def damage(path: Path, saved: Saved, kv_per_token: int | None) -> str | None:
    """Why a saved slot file must not be restored (a restore of a short file aborts the
    server), or None: its header, its size against the header's token words and the layout's
    bytes per token, and against the size the server said it wrote."""
    try:
        with path.open("rb") as f:
            head = f.read(HEADER.size)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    if len(head) < HEADER.size:
        return f"{path} is {size} bytes, shorter than a slot file's header"
    magic, _version, words = HEADER.unpack(head)
    if magic != SEQ_MAGIC:
        return f"{path} is not a slot file (magic {magic:#x}, not {SEQ_MAGIC:#x})"
    if words < saved.tokens:
        return f"{path}: its header counts {words} token words for {saved.tokens} saved tokens"
    need = HEADER.size + TOKEN_WORD * words + saved.tokens * (CELL_META + (kv_per_token or 0))
    if size < need:
        return (
            f"{path} is {size} bytes, truncated: its header's {words} token words and "
            f"{saved.tokens} cells of {CELL_META + (kv_per_token or 0)} bytes need at least "
            f"{need}"
        )
    if saved.bytes and size != saved.bytes:
        return f"{path} is {size} bytes; the server wrote {saved.bytes}: it was changed since"
    return None


def check_files(
    folder: Path, saved: list[Saved], kv_per_token: int | None
) -> tuple[list[Saved], list[dict[str, Any]]]:
    """(the saved slots whose files are sound, the others skipped with the reason)."""
    sound: list[Saved] = []
    skipped: list[dict[str, Any]] = []
    for s in saved:
        why = damage(folder / s.filename, s, kv_per_token)
        if why is None:
            sound.append(s)
        else:
            skipped.append({"slot": s.slot, "tokens": s.tokens, "reason": why})
    return sound, skipped


def is_slot_file(name: str) -> bool:
    """Whether ``name`` is a slot file this tool saves (what a killed deploy leaves: only
    under the deploy lock are they leftovers; a slot file can be gigabytes)."""
    return FILE_PATTERN.match(name) is not None


def _alive(client: httpx.Client) -> bool:
    import httpx

    try:
        return client.get("/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def restore_all(
    client: httpx.Client, saved: list[Saved], window: int | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Restore each saved slot whose tokens fit the new per-slot ``window``;
    (restored, skipped with the reason). ``RestoreCrashed`` when a restore took the server
    down (its request failed, and ``/health`` does not answer 200 after it)."""
    restored: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for s in saved:
        if window is not None and s.tokens > window:
            skipped.append(
                {
                    "slot": s.slot,
                    "tokens": s.tokens,
                    "reason": f"{s.tokens} tokens do not fit the new per-slot window {window}",
                }
            )
            continue
        try:
            data = restore(client, s)
        except SlotError as e:
            if not _alive(client):
                raise RestoreCrashed(
                    s.slot,
                    f"the server went down restoring slot {s.slot} from {s.filename} "
                    f"({s.tokens} tokens): {e}",
                ) from e
            skipped.append({"slot": s.slot, "tokens": s.tokens, "reason": str(e)})
            continue
        restored.append(
            {
                "slot": s.slot,
                "tokens": int(data.get("n_restored", 0)),
                "bytes": int(data.get("n_read", 0)),
                "ms": float((data.get("timings") or {}).get("restore_ms", 0.0)),
            }
        )
    return restored, skipped


def move(saved: list[Saved], src: Path, dst: Path) -> tuple[list[Saved], list[dict[str, Any]]]:
    """Move saved slot files from the folder one config saved them in to the one another
    restores them from (a deploy that changes ``--slot-save-path``; a second instance's own
    folder): (moved, skipped with the reason). A file goes into ``dst`` owned as ``dst`` is
    (a folder's owner is the service that reads it: each ``DynamicUser=`` unit has a user
    of its own), mode 0600; into a folder of root's (one the services share) it keeps the
    owner that wrote it. A rename where both are on one filesystem, else a copy written
    as ``NAME.part`` and renamed when whole. The folders belong to the services, so
    nothing in them is trusted: only a regular file is moved, opened without following a
    link, and owner and mode are set on what was opened, never on a path. A file that
    cannot be moved stays in ``src``."""
    try:
        folder = dst.stat()
    except OSError as e:
        why = f"cannot read the slot folder {dst}: {e.strerror or e}"
        return [], [{"slot": s.slot, "tokens": s.tokens, "reason": why} for s in saved]
    owner = (folder.st_uid, folder.st_gid) if folder.st_uid != 0 else None
    moved: list[Saved] = []
    skipped: list[dict[str, Any]] = []
    for s in saved:
        try:
            _move_one(src / s.filename, dst / s.filename, owner)
        except OSError as e:
            why = e.strerror or str(e)
            if e.errno == errno.ELOOP:
                why = "it is a symbolic link, not a slot file"
            reason = f"cannot move {s.filename} from {src} to {dst}: {why}"
            skipped.append({"slot": s.slot, "tokens": s.tokens, "reason": reason})
            continue
        moved.append(s)
    return moved, skipped


def _move_one(a: Path, b: Path, owner: tuple[int, int] | None) -> None:
    fd = os.open(a, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        uid, gid = owner or (st.st_uid, st.st_gid)
        try:
            os.rename(a, b)  # a rename moves the name: what was opened is what it names
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            _copy(fd, b, uid, gid)
            os.unlink(a)
            return
        _own(fd, uid, gid)
    finally:
        os.close(fd)


def _copy(src_fd: int, b: Path, uid: int, gid: int) -> None:
    part = b.with_name(b.name + PART)
    with contextlib.suppress(FileNotFoundError):
        part.unlink()  # a killed move's
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(part, flags, 0o600)
    try:
        try:
            _own(fd, uid, gid)
            with open(src_fd, "rb", closefd=False) as f, open(fd, "wb", closefd=False) as g:
                shutil.copyfileobj(f, g, 1 << 20)
        finally:
            os.close(fd)
        os.rename(part, b)
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise


def _own(fd: int, uid: int, gid: int) -> None:
    if os.geteuid() == 0:
        os.fchown(fd, uid, gid)
    os.fchmod(fd, 0o600)


def discard(folder: Path | None, saved: list[Saved]) -> None:
    """Remove saved files (a slot file can be gigabytes)."""
    if folder is None:
        return
    for s in saved:
        with contextlib.suppress(OSError):
            (folder / s.filename).unlink()
