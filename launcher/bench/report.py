"""The bench's report for a person: a header of what was measured against, one row per number
of agents, then the long-prompt stall; and the plot of speed against agents (matplotlib, the
``plot`` extra). ``--json`` gets ``BenchResult.to_dict()`` instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.errors import InvalidInput

if TYPE_CHECKING:
    from launcher.bench.agents import BenchResult
    from launcher.bench.results import StallResult

PLOT_HINT = "pip install 'llama-launcher[plot]'"


def check_plot_available(path: Path | str | None = None) -> None:
    """Raise ``InvalidInput`` when matplotlib is missing or ``path`` cannot be written.

    Checked before the bench runs, so a bad ``--plot`` does not throw its figures away.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise InvalidInput(
            f"--plot needs matplotlib, which is not installed; run {PLOT_HINT}"
        ) from e
    if path is not None:
        parent = Path(path).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise InvalidInput(
                f"--plot {str(path)!r}: {str(parent)!r} is not a writable directory; "
                "give a path in an existing directory"
            )


def write_plot(result: BenchResult, path: Path | str) -> Path:
    """Write a PNG of total and mean per-agent tok/s against the number of agents."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv.agents for lv in result.levels]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        ax.plot(xs, [lv.total_tok_s for lv in result.levels], marker="o", label="total tok/s")
        ax.plot(
            xs, [lv.per_agent_tok_s for lv in result.levels], marker="s", label="per-agent tok/s"
        )
        ax.set_xlabel("concurrent agents")
        ax.set_ylabel("generated tokens/s")
        ax.set_xticks(xs)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        slots = result.server.total_slots
        ctx = result.server.n_ctx_slot
        ax.set_title(
            f"{result.server.model or result.server.url}  slots={slots} n_ctx/slot={ctx}",
            fontsize=9,
        )
        out = Path(path)
        fig.tight_layout()
        fig.savefig(out, format="png")
    except OSError as e:
        raise InvalidInput(f"--plot {str(path)!r} cannot be written ({e.strerror})") from e
    finally:
        plt.close(fig)
    return out


def _fmt_generation(gen: Mapping[str, Any] | None) -> str:
    if gen is None:
        return "not deployed by llama-launcher (or not given)"
    return ", ".join(f"{k}={v}" for k, v in gen.items())


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def render_text(result: BenchResult) -> str:
    """The human report: header, one row per agent count, then the long-prompt stall."""
    s, srv = result.settings, result.server
    prompt = (
        f"~{result.prompt.target_tokens} tokens ({result.prompt.method})"
        if result.prompt.target_tokens
        else "one chat line"
    )
    lines = [
        f"server      {srv.url}  model {srv.model or '?'}  build {srv.build_info or '?'}",
        f"slots       /props total_slots {_q(srv.total_slots)}, n_ctx per slot "
        f"{_q(srv.n_ctx_slot)}; /slots lists {_q(srv.slots_count)}",
        f"generation  {_fmt_generation(srv.generation)}",
        f"requests    prompt {prompt}, max_tokens {s.max_tokens}, rounds {s.rounds}, "
        "greedy, streamed; tokens from the server's usage",
        "",
    ]
    rows = [
        [
            str(lv.agents),
            f"{lv.total_tok_s:.1f}",
            f"{lv.per_agent_tok_s:.1f}",
            f"{lv.wall_s:.2f}",
            f"{lv.latency(50):.3f}",
            f"{lv.latency(95):.3f}",
            f"{lv.ttft(50) * 1000:.0f}",
            f"{lv.ttft(95) * 1000:.0f}",
            str(lv.completion_tokens),
        ]
        for lv in result.levels
    ]
    header = ["agents", "total tok/s", "per-agent tok/s", "wall s", "lat p50 s", "lat p95 s",
              "TTFT p50 ms", "TTFT p95 ms", "tokens"]  # fmt: skip
    lines.append(_table(header, rows))
    if result.stalls:
        lines += ["", _stall_text(result.stalls)]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def _stall_text(stalls: Sequence[StallResult]) -> str:
    size = stalls[0].long_prompt_tokens
    alone = stalls[0].long_alone.ttft_s * 1000
    delay = stalls[0].others_delay_s * 1000
    rows = [
        [
            str(st.agents),
            f"{st.without.ttft(50) * 1000:.0f}",
            f"{st.with_long.ttft(50) * 1000:.0f}",
            _ratio(st.ttft_ratio),
            f"{st.without.latency(50):.3f}",
            f"{st.with_long.latency(50):.3f}",
            _ratio(st.latency_ratio),
        ]
        for st in stalls
    ]
    header = ["agents", "TTFT p50 ms", "+long", "x", "latency p50 s", "+long", "x"]
    return (
        f"long prompt: one extra agent sends {size:.0f} tokens (read alone in {alone:.0f} ms);\n"
        f"the others send theirs {delay:.0f} ms later, while it is read. Their figures without "
        "it and with it (+long):\n" + _table(header, rows)
    )


def _ratio(x: float) -> str:
    return f"{x:.1f}" if math.isfinite(x) else "-"


def _q(x: int | None) -> str:
    return "?" if x is None else str(x)
