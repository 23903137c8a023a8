"""Going back to a generation that served: its stored bytes, not a re-rendering of its config.

A rollback (``llama-launcher rollback [--to N]``) puts back exactly the env file a known-good
generation kept, hand edits and comments included. Serving before proved what the memory
guard and the pool check would say (and a generation deployed with ``--force-memory`` was
let past them on purpose), so they are not run again; the cheap checks on the bytes are
(``validate.check_bytes``: the launcher's strict parse and ``bash -n``), and so are the
checks of what can change under a config after it served (``validate.check_served``: the
binary runs and knows the flags, every file it names is there and the service can read
it, the slot folder can be written). A refusal there changes nothing: the old process
keeps serving. The gate still proves the restored config serves.

A hand-written live file the store adopts (``adopted``) gets the argv and the typed config
read from its bytes, so ``history`` shows what it ran and a later ``set`` can build on it.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from launcher import config
from launcher.config import memory, validate
from launcher.deploy import store
from launcher.errors import ConfigInvalid
from launcher.host import envfile, launch, service

#: The checks a restore runs: on the stored bytes, and on what can change after serving (the
#: pool and the memory guard of ``validate.STEPS`` served).
STEPS = ("lint", "bash -n", "llama-server", "flags", "model", "files", "service")


def config_of_argv(argv: list[str], key_file: str | None = None) -> config.ServerConfig:
    """The typed config an env file's argv means; ``ConfigInvalid`` when it has none (no
    ``-m``, a relative path, ...)."""
    words, i = [], 1
    while i < len(argv):
        if argv[i] in ("--log-colors", "--api-key-file"):  # the launcher adds these itself
            i += 2
            continue
        words.append(argv[i])
        i += 1
    base: dict[str, Any] = {"llama_server": argv[0]}
    if key_file:
        base["api_key_file"] = key_file
    return config.from_flags(words, base)


def adopted(text: str, source: str) -> dict[str, Any]:
    """argv and masked config of a hand-written env file (empty where its bytes do not
    parse: it is kept all the same, and restored as it is)."""
    try:
        values = envfile.parse(text, source)
        argv = launch.argv_from_values(values, source)
    except (envfile.EnvFileError, launch.LaunchError):
        return {"argv": [], "config": {}}
    try:
        cfg = config_of_argv(argv, values.get("API_KEY_FILE"))
    except ConfigInvalid:
        return {"argv": argv, "config": {}}
    return {"argv": argv, "config": cfg.masked()}


def adopt_unmanaged(
    st: store.Store, live_text: str | None, prev: int | None, source: str
) -> int | None:
    """A live env file the store does not know (hand-written) is kept as a generation, so it
    can be rolled back to; its number (``prev`` when the live file is that generation's)."""
    if live_text is None or (prev is not None and st.get(prev).env_text == live_text):
        return prev
    meta = {
        "origin": "adopted: found in the live env file",
        "time": time.time(),
        **adopted(live_text, source),
    }
    gen = st.new(live_text, meta)
    st.update(gen, outcome="adopted")
    return gen.number


def candidate(
    gen: store.Generation,
    svc: service.ServiceView | None = None,
    made: Path | None = None,
    workdir: Path | None = None,
) -> validate.Validated:
    """Generation ``gen``'s stored bytes, checked cheaply, as the deploy's ``Validated``;
    ``svc`` and ``made`` as for ``validate.validate``."""
    text = gen.env_text
    with tempfile.TemporaryDirectory(prefix="llama-launcher-", dir=workdir) as tmp:
        path = Path(tmp) / "restore.env"
        path.write_bytes(text.encode())
        os.chmod(path, 0o600)
        argv = validate.check_bytes(path)
    values = envfile.parse(text, str(gen.path / "env"))
    cfg = _config(gen, argv, values.get("API_KEY_FILE"))
    model = dict(gen.meta.get("model") or {"path": str(cfg.model)})
    plan = cfg.pool_plan(model.get("n_ctx_train"))
    info = validate.check_served(cfg, argv, svc, made)
    need = _need(gen.meta.get("kv_estimate"))
    return validate.Validated(cfg, text, values, argv, plan, model, info, need, steps=STEPS)


def _config(gen: store.Generation, argv: list[str], key_file: str | None) -> config.ServerConfig:
    """The stored typed config; read from the bytes for an adopted hand edit (stored
    without one before the adoption read it)."""
    data = gen.meta.get("config") or {}
    try:
        return config.build(dict(data)) if data else config_of_argv(argv, key_file)
    except ConfigInvalid as e:
        raise ConfigInvalid(
            f"generation {gen.number}'s env file ({gen.path / 'env'}) has no config the gate "
            f"can check ({e}); put it back by hand with cp, then restart the unit"
        ) from e


def _need(estimate: dict[str, Any] | None) -> memory.Need:
    """The memory estimate recorded when the generation was deployed (not re-made)."""
    e = estimate or {}
    return memory.Need(
        kv=e.get("kv_bytes"),
        weights=int(e.get("weights_bytes") or 0),
        cache_ram=int(e.get("cache_ram_bytes") or 0),
        estimate=e.get("estimate"),
        unsupported=e.get("unsupported") or (None if e else "not recorded"),
    )
