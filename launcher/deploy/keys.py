"""API keys: the key files llama-server reads, and the one reader of a key file.

A key given in the config (``api_key``, a ``SecretStr``) never reaches a command line or the
env file: it is written to a 0600 file in the state dir, named by a salted hash of the key
(the same key renders the same file, a new key a new one), and the config keeps the path.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.deploy import store
from launcher.errors import ConfigInvalid, ProbeError
from launcher.host import envfile

if TYPE_CHECKING:  # the live sampler reads keys without the typed config's import
    from launcher import config


def read_api_key(path: Path | None) -> str | None:
    """The first key in an ``--api-key-file`` (skips blank and ``#`` lines, like llama-server)."""
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                return line
    except OSError as e:
        raise ProbeError(f"cannot read the API key file {path}: {e.strerror}") from e
    return None


def materialize(st: store.Store, cfg: config.AnyConfig, write: bool) -> config.AnyConfig:
    """``cfg`` with its ``api_key`` turned into ``api_key_file`` (written when ``write``).

    A preview (``write`` False) names the file the deploy will write. It makes nothing, but
    one thing: the salt of the names, a state folder's first time (the name depends on it).
    Before the state folder exists (a preview before ``install``) the salt is not made
    either; the name shown then is an example, and the deploy salts its own."""
    if cfg.api_key is None:
        return cfg
    key = cfg.api_key.get_secret_value()
    if "\n" in key or not key:
        raise ConfigInvalid("api_key must be one non-empty line")
    salt_path = st.root / "key-salt"
    if write:
        st.ensure()
    if not salt_path.exists() and (write or st.root.is_dir()):
        store.atomic_write(salt_path, secrets.token_hex(16).encode(), 0o600)
    salt = salt_path.read_bytes() if salt_path.exists() else secrets.token_hex(16).encode()
    digest = hashlib.sha256(salt + key.encode()).hexdigest()[:16]
    path = st.root / "keys" / f"{digest}.key"
    if write and not path.exists():
        path.parent.mkdir(mode=0o700, exist_ok=True)
        store.atomic_write(path, (key + "\n").encode(), 0o600)
    return cfg.model_copy(update={"api_key": None, "api_key_file": path})


def key_of_env(env_text: str | None, source: str) -> str | None:
    """The key an env file's server wants (its ``API_KEY_FILE``), to probe it with."""
    if not env_text:
        return None
    try:
        values = envfile.parse(env_text, source)
    except envfile.EnvFileError:
        return None  # a hand-written file the strict parser refuses: probe without a key
    path = values.get("API_KEY_FILE")
    return read_api_key(Path(path)) if path else None
