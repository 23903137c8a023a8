"""The typed config, and what is proved about it before anything changes.

The server's flags (``launcher.config.server``: ``ServerConfig``), the way between flags,
the typed config, its argv and its env file (``launcher.config.argv``), and the tool's own
settings (``launcher.config.settings``: ``ToolSettings``) are re-exported here, so callers
write ``config.ServerConfig``, ``config.from_flags``, ``config.load_settings``. The rest of
the folder: the validation chain (``validate``), the KV memory estimate and guard
(``memory``, ``offload``), whether a second instance fits beside the running one
(``beside``), and the endpoints a config keeps on (``endpoints``). A unit installed with
``--backend vllm`` has a ``VllmConfig`` (``launcher.config.vllm``); ``of``, ``onto`` and
``without`` read, change and unset either.
"""

from launcher.config.argv import (
    HEADER,
    argv_diff,
    argv_lines,
    build,
    env_values,
    from_flags,
    of,
    onto,
    parse_flags,
    remove_flags,
    render_env,
    without,
)
from launcher.config.server import (
    FLAG_BY_FIELD,
    FLAGS,
    OWNED,
    SPELLING,
    CacheType,
    Flag,
    LoadMode,
    OnOffAuto,
    ServerConfig,
    admission_note,
    config_error,
    merge_extra,
    overcommit_message,
    overcommit_warning,
)
from launcher.config.settings import MAX_BAKE, ToolSettings, duration, load_settings
from launcher.config.vllm import VllmConfig

#: a unit's typed config, whichever server it runs
AnyConfig = ServerConfig | VllmConfig

__all__ = [
    "FLAGS",
    "FLAG_BY_FIELD",
    "HEADER",
    "MAX_BAKE",
    "OWNED",
    "SPELLING",
    "AnyConfig",
    "CacheType",
    "Flag",
    "LoadMode",
    "OnOffAuto",
    "ServerConfig",
    "ToolSettings",
    "VllmConfig",
    "admission_note",
    "argv_diff",
    "argv_lines",
    "build",
    "config_error",
    "duration",
    "env_values",
    "from_flags",
    "load_settings",
    "merge_extra",
    "of",
    "onto",
    "overcommit_message",
    "overcommit_warning",
    "parse_flags",
    "remove_flags",
    "render_env",
    "without",
]
