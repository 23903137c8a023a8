"""A small on-disk cache of facts about files that rarely change (the llama-server binary's
``--help``, a model's GGUF metadata), keyed by the file's identity.

Reading them again costs a subprocess or importing numpy (0.3-0.6 s here); a deploy that
runs on every config change should not pay that when neither file changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llama-launcher"


def file_key(path: str | Path) -> str:
    """Identity of a file: real path, size, mtime and inode."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def cached(
    kind: str,
    key: str,
    compute: Callable[[], dict[str, Any]],
    folder: Path | None = None,
    valid: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """``compute()`` once per ``(kind, key)``; later calls read the JSON it returned.

    ``kind`` carries a version (``gguf-meta-v1``): change it when the JSON's shape changes.
    ``valid`` checks a cached entry's shape; a damaged one is computed again.
    """
    path = (folder or cache_dir() / kind) / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and (valid is None or valid(data)):
            return data
    except (OSError, ValueError):
        pass
    data = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the computation next time
    return data
