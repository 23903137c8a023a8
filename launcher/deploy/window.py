"""What clients are promised: the planned layout and the client window file.

The guaranteed per-slot window is published beside the unit's state folder after each deploy, so
clients can size their requests to what every slot really has.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher import config
from launcher.deploy import home, store
from launcher.server import kvlayout

if TYPE_CHECKING:
    from launcher.config.validate import Validated


def plan_dict(plan: kvlayout.PoolPlan) -> dict[str, Any]:
    return {
        "n_slots": plan.n_slots,
        "n_ctx_slot": plan.n_ctx_slot,
        "kv_unified": plan.kv_unified,
        "pool_cells": plan.n_ctx,
        "guaranteed_window": plan.guaranteed_window,
        "overcommitted": plan.overcommitted,
    }


def client_window_path(settings: config.ToolSettings) -> Path:
    """Where clients read the guaranteed window: runtime state beside the unit's state
    folder, not in /etc (``/var/lib/llama-launcher/llama-server.client-window.json``, one
    per instance: ``chat.client-window.json``), readable by everyone."""
    return home.state_dir(settings).parent / f"{settings.env_name}.client-window.json"


def window_data(unit: str, checked: Validated, number: int | None) -> dict[str, Any]:
    """The client window file's content for a validated config as generation ``number``."""
    plan = checked.plan
    return {
        "unit": unit,
        "generation": number,
        "per_slot_window": plan.guaranteed_window,
        "slots": plan.n_slots,
        "n_ctx_slot": plan.n_ctx_slot,
        "pool_cells": plan.n_ctx,
        "kv_unified": plan.kv_unified,
        **_cache_types(checked.config),
    }


def _cache_types(cfg: config.AnyConfig) -> dict[str, str]:
    if isinstance(cfg, config.VllmConfig):
        return {"kv_cache_dtype": str(cfg.kv_cache_dtype or "auto")}
    return {
        "cache_type_k": str(cfg.cache_type_k or "f16"),
        "cache_type_v": str(cfg.cache_type_v or "f16"),
    }


def publish(settings: config.ToolSettings, data: dict[str, Any]) -> dict[str, Any]:
    """Write the client window file (0644: clients read it)."""
    path = client_window_path(settings)
    store.atomic_write(path, (json.dumps(data, indent=2) + "\n").encode(), 0o644)
    return data
