"""``llama-launcher bench``: total and per-agent speed of several agents on one llama-server."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from launcher.cli import emit

HELP = "measure total and per-agent tok/s, latency and time to first token with N agents"
DESCRIPTION = """\
Send concurrent streamed chat completions to any OpenAI-compatible llama-server and report,
per number of agents: total tok/s, mean per-agent tok/s, wall time, p50/p95 latency and time
to first token. Tokens are the server's own usage counts. With --long-prompt, one extra agent
sends a long prompt while the others chat, and the others' latency and time to first token
are shown with and without it: llama-server reads a long prompt in the same batches as the
other slots' decode steps, so every agent waits while it is read.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "bench",
        help=HELP,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url",
        help="server base URL (default: the --unit's live generation, else http://127.0.0.1:8080)",
    )
    p.add_argument(
        "--unit",
        help="a unit llama-launcher deployed: measure its live generation and name it",
    )
    p.add_argument("--instance", metavar="NAME", help="the same for llama-server@NAME.service")
    p.add_argument("--api-key-file", metavar="F", help="file holding the server's --api-key")
    p.add_argument(
        "--agents", type=int, nargs="+", default=[1, 2, 4], metavar="N",
        help="agent counts to measure (default: 1 2 4)",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="tokens per answer (%(default)s)"
    )
    p.add_argument(
        "--prompt-tokens", type=int, metavar="N",
        help="size each agent's prompt to about N tokens (default: one chat line)",
    )  # fmt: skip
    p.add_argument(
        "--long-prompt", type=int, metavar="TOKENS",
        help="also measure with one extra agent sending a prompt of about TOKENS tokens",
    )  # fmt: skip
    p.add_argument(
        "--rounds", type=int, default=1, metavar="R", help="rounds per agent count (%(default)s)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds per request (%(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG of tok/s against agents")
    p.set_defaults(func=run)


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
    from launcher.bench import agents

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
        agents.check_plot_available(ns.plot)
    api_key = agents.api_key_from_file(ns.api_key_file) if ns.api_key_file else None
    result = agents.run_bench(settings, api_key=api_key, generation=generation)
    data = result.to_dict()
    if ns.plot:
        data["plot"] = str(agents.write_plot(result, ns.plot))

    def human() -> str:
        text = agents.render_text(result)
        return text + (f"\nplot written to {ns.plot}" if ns.plot else "")

    emit(data, ns.json, human)
    return 0
