"""``llama-launcher bench``: total and per-agent speed of several agents on one llama-server (its
options: ``launcher.cli.table``)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from launcher.cli.results import emit


def _live(unit: str) -> dict[str, Any] | None:
    """The live generation of ``unit`` (number, argv, plan, URL), if llama-launcher manages it."""
    from launcher import config
    from launcher.deploy import home, store
    from launcher.errors import LauncherError
    from launcher.server.httpclient import url_from_argv

    try:
        settings = config.load_settings(unit=unit)
        gen = store.Store(home.state_dir(settings)).live()
    except (LauncherError, OSError):
        return None
    if gen is None:
        return None
    argv = list(gen.meta.get("argv") or [])
    return {
        "unit": settings.unit_name,
        "generation": gen.number,
        "argv": argv,
        "planned": gen.meta.get("planned"),
        "url": settings.base_url or url_from_argv(argv),
    }


def run(ns: argparse.Namespace, generation: Mapping[str, Any] | None = None) -> int:
    """Run the bench. ``generation``: the live generation, when llama-launcher deployed it."""
    from launcher.bench import agents, report

    url = ns.url
    if ns.instance:
        from launcher.cli.deploy import instance_unit

        ns.unit = instance_unit(ns.instance, ns.unit)
    if ns.unit:
        live = _live(ns.unit)
        if live is not None:
            generation = generation or live
            url = url or str(live["url"])
        elif not url:
            from launcher.errors import ConfigInvalid

            raise ConfigInvalid(
                f"--unit {ns.unit}: llama-launcher has no live generation for it, so its URL "
                "is unknown; check the unit name, or give --url"
            )
    settings = agents.BenchSettings(
        url=url or "http://127.0.0.1:8080",
        agents=tuple(ns.agents),
        max_tokens=ns.max_tokens,
        prompt_tokens=ns.prompt_tokens,
        long_prompt_tokens=ns.long_prompt,
        rounds=ns.rounds,
        timeout_s=ns.timeout,
    )
    settings.validate()
    if ns.plot:
        report.check_plot_available(ns.plot)
    api_key = agents.api_key_from_file(ns.api_key_file) if ns.api_key_file else None
    result = agents.run_bench(settings, api_key=api_key, generation=generation)
    data = result.to_dict()
    if ns.plot:
        data["plot"] = str(report.write_plot(result, ns.plot))

    def human() -> str:
        text = report.render_text(result)
        return text + (f"\nplot written to {ns.plot}" if ns.plot else "")

    emit(data, ns.json, human)
    return 0
