"""A server that is alive but no longer answers (stopped, deadlocked, a wedged device):
noticed by the sampler, and restarted.

systemd restarts a unit whose process exits (``Restart=on-failure``); a process that lives
on without answering is never acted on: llama-server sends no watchdog pings
(``WatchdogSec=`` needs ``sd_notify``; llama.cpp PR #15998 is open). So every sample looks
(``launcher.watch.sample``), and these rules say whether what it saw is a *wedged sample*:

- It counts only a unit that is active/running whose main process is not a zombie, past its
  load: a sample saw it answer ``/health`` 200, it served when its generation's gate passed,
  or it is older than its start budget (``launcher.deploy.budgets``, sized by its last
  load). ``/health`` 503 (``Loading model``) is a load, never a wedge. A sample taken while
  a deploy is in progress is skipped altogether (the deploy holds the unit).
- ``/health`` does not answer within ``HEALTH_TIMEOUT`` (``launcher.watch.reads``' bound on
  the read): the HTTP threads that answer it do not run (a refused connection is not
  counted: ``NOBODY``). The sample then skips ``/slots`` and ``/metrics`` (10 s each): a
  wedged sample takes about ``HEALTH_TIMEOUT``.
- ``/health`` answers but the loop does not progress, and a 1-token completion does not
  answer within ``COMPLETION_TIMEOUT``. llama-server answers ``/slots`` and ``/metrics``
  from its loop, between two decode batches; the loop is *stalled* when ``/metrics``
  answered with requests processing or deferred and none of its counters (``n_decode_total``
  moves at every batch) moved since the sample before, and *silent* when neither ``/slots``
  nor ``/metrics`` answered. Only then is the completion sent: a server that is idle, or
  busy and progressing (whose completion would wait for a slot), is never sent one, so the
  sampler adds no requests to the records it keeps. Without ``/metrics`` (off, or a build
  without ``n_decode_total``) only the ``/health`` rule judges.

``wedged_samples`` wedged samples in a row (the setting; 0: off) restart the unit
(``systemctl restart``: systemd sends a stopped process ``SIGCONT`` with its ``SIGTERM``,
and ``SIGKILL`` at ``TimeoutStopSec``), with a warning in the sampler's journal, a field of
the live generation's meta (``history``: ``restarted: wedged ...``) and the metrics
``llama_launcher_wedged_samples`` and ``llama_launcher_wedged_restarts_total``. During the
live generation's bake the count reaching it is a hard signal instead
(``launcher.watch.verdict``): the bake's revert puts the previous config back. Any other
sample (an answer, a load, the unit down) ends the run; a new process starts its own.

The sampler's service reads no settings: ``install`` renders the setting into its command
line (``sample --wedged-samples N``), as it renders ``sample_interval`` into the timer;
``install`` again to change it.

The rules (``Look``, ``judge``, ``run_of``, ``due``) are pure; below them, the sample's side:
its reads under the rules (``count``, which sends the 1-token completion), the restart
(``restart``) and the metrics file's lines (``page_lines``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from launcher import waits
from launcher.deploy import budgets, keys, store
from launcher.errors import LauncherError, ProbeError, StoreError
from launcher.host.systemd import Systemd
from launcher.server import metrics, probe
from launcher.server.httpclient import url_from_argv
from launcher.watch import bake, sampler, textfile
from launcher.watch.reads import HEALTH_TIMEOUT, Reads, process_of
from launcher.watch.sampler import Outcome, State, Target

#: Seconds the 1-token completion may take, when the loop looks stalled or silent.
COMPLETION_TIMEOUT = 5.0
#: The 1-token completion is sent once, never retried: it has its bound
ONCE = waits.Waits(probe_retry=(1, 0.0))
#: Kept in the live generation's meta (``history``): the newest wedge restarts.
KEEP = 20

#: /health's failures that say no one listens at the URL (or it is not one), not that a
#: process there stopped answering: a stopped or deadlocked server keeps its socket, whose
#: connections the kernel accepts, and times out. Never a wedge: a wrong URL must not
#: restart the unit over and over.
NOBODY = ("ConnectError", "UnsupportedProtocol")

#: What the loop did since the sample before (``loop_of``).
PROGRESS = "progress"
IDLE = "idle"
STALLED = "stalled"
SILENT = "silent"
UNKNOWN = "unknown"
#: The loop states in which the 1-token completion is sent.
SUSPECT = (STALLED, SILENT)


@dataclass(frozen=True)
class Look:
    """What one sample saw of a running unit's server (``judge`` reads it)."""

    #: /health's status; None: no answer within ``HEALTH_TIMEOUT`` (``detail`` says how)
    health: int | None
    detail: str = ""
    zombie: bool = False
    #: past its load: seen answering, served at its gate, or older than its start budget
    loaded: bool = True
    loop: str = UNKNOWN
    #: the 1-token completion answered (None: not sent)
    completion: bool | None = None

    @property
    def loading(self) -> bool:
        """``/health`` 503: llama-server answers so while the model loads (every route)."""
        return self.health == 503

    @property
    def suspect(self) -> bool:
        """The 1-token completion is to be sent: /health answers, the loop does not."""
        counted = not self.zombie and self.loaded
        return counted and self.health is not None and not self.loading and self.loop in SUSPECT


def loop_of(now: metrics.Metrics | None, silent: bool, before: Mapping[str, float] | None) -> str:
    """What the server's loop did since the sample before: ``now``, this sample's /metrics
    (None: not read; ``silent``: neither /slots nor /metrics answered), ``before``, the
    counters the sample before read of the same process (None: none)."""
    if now is None:
        return SILENT if silent else UNKNOWN
    if before is None or "n_decode_total" not in now.counters:
        return UNKNOWN  # nothing to compare; or a counter that moves only per request
    if any(now.counters.get(k) != before.get(k) for k in now.counters):
        return PROGRESS
    waiting = sum(now.gauges.get(g, 0.0) for g in ("requests_processing", "requests_deferred"))
    return STALLED if waiting > 0 else IDLE


def judge(look: Look | None) -> str | None:
    """Why this sample is wedged, in words; None: it is not (``look`` None: the unit is not
    running)."""
    if look is None or look.zombie or look.loading or not look.loaded:
        return None
    if look.health is None:
        if look.detail in NOBODY:
            return None
        return f"/health did not answer within {HEALTH_TIMEOUT:g}s ({look.detail})"
    if look.suspect and look.completion is False:
        what = (
            "neither /slots nor /metrics answered"
            if look.loop == SILENT
            else "requests wait and its counters have not moved since the sample before"
        )
        return (
            f"/health answers but a 1-token completion did not within "
            f"{COMPLETION_TIMEOUT:g}s, and {what}"
        )
    return None


def run_of(before: list[Any], pid: int, why: str | None) -> int:
    """The wedged samples in a row with this one (``before``: ``[pid, count]`` of the sample
    before, as the sampler's state keeps it): a sample that is not wedged ends the run, a
    new process starts its own."""
    if why is None:
        return 0
    same = len(before) == 2 and before[0] == pid
    return int(before[1]) + 1 if same else 1


def due(run: int, limit: int) -> bool:
    """The run is long enough to act on (``limit`` 0: never)."""
    return limit > 0 and run >= limit


def record_of(t: float, pid: int, run: int, why: str) -> dict[str, Any]:
    """One restart as the live generation's meta keeps it (``wedged_restarts``)."""
    return {"time": round(t, 3), "pid": pid, "samples": run, "why": why}


def line_of(restarts: list[dict[str, Any]]) -> str | None:
    """``history``'s line of a generation's wedge restarts (None: none)."""
    if not restarts:
        return None
    last = restarts[-1]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(last.get("time") or 0)))
    times = f"; {len(restarts)} times" if len(restarts) > 1 else ""
    return (
        f"restarted: wedged {last.get('samples')} samples in a row at {when} "
        f"({last.get('why')}){times}"
    )


# -- the sampler's look (launcher.watch.sample) ----------------------------------------------


def count(
    target: Target,
    gen: store.Generation,
    reads: Reads,
    state: State,
    transport: httpx.BaseTransport | None,
    out: Outcome,
) -> tuple[int, str | None]:
    """This sample under the wedge rules: the wedged samples in a row with it, and why it
    is one (None: it is not). Sends the 1-token completion when the rules ask for it. Runs
    before the sample counts what changed (``launcher.watch.sample``): it compares /metrics'
    counters with the sample before's."""
    unit = reads.unit
    if reads.health is not None and reads.health[0] == 200:
        state.answered = unit.main_pid
    look = _look_of(gen, reads, state) if unit.running and target.wedged_samples else None
    if look is not None and look.suspect:
        look = dataclasses.replace(look, completion=_completes(target, gen, transport))
    why = judge(look)
    run = run_of(state.wedged, unit.main_pid, why)
    state.wedged = [unit.main_pid, run] if run else []
    if why is not None:
        limit = target.wedged_samples
        out.wedged = {
            "pid": unit.main_pid,
            "samples": run,
            "limit": limit,
            "why": why,
            "restarted": False,
        }
        if not due(run, limit):
            out.warnings.append(
                f"{target.unit}: the server (pid {unit.main_pid}) lives but does not answer: "
                f"{why}; wedged sample {run} in a row, restarted at {limit}"
            )
    return run, why


def _look_of(gen: store.Generation, reads: Reads, state: State) -> Look:
    status, detail = reads.health or (None, "not read")
    m = reads.metrics
    before = state.counters if m is not None and state.process == process_of(reads) else None
    silent = "metrics" in reads.silent and reads.slots is None
    return Look(
        health=status,
        detail=detail,
        zombie=reads.process is not None and reads.process.zombie,
        loaded=_loaded(gen, reads, state),
        loop=loop_of(m, silent, before),
    )


def _loaded(gen: store.Generation, reads: Reads, state: State) -> bool:
    """The unit's process is past its load: a sample saw it answer /health 200, it served
    when its generation's gate passed (it started before), or it is older than its start
    budget (sized by the generation's last load: ``launcher.deploy.budgets``). A process
    whose age cannot be read counts only once a sample saw it answer."""
    if state.answered == reads.unit.main_pid:
        return True
    if reads.process is None:
        return False
    if time.time() - reads.process.age < bake.served_from(gen):
        return True
    b = budgets.for_deploy(waits.Waits(), budgets.Load.of_meta(gen.meta))
    return reads.process.age > b.start + b.health


def _completes(
    target: Target, gen: store.Generation, transport: httpx.BaseTransport | None
) -> bool | None:
    """Whether a 1-token completion comes back within ``COMPLETION_TIMEOUT``: any
    HTTP answer counts, an error too (None: it could not be sent)."""
    try:
        key = keys.key_of_env(gen.env_text, str(gen.path / "env"))
        url = target.base_url or url_from_argv(list(gen.meta.get("argv") or []))
        with probe.Probe(url, key, transport, ONCE) as p:
            p.chat(COMPLETION_TIMEOUT, max_tokens=1)
    except ProbeError as e:
        return not isinstance(e.__cause__, httpx.TransportError)
    except LauncherError:
        return None
    return True


def restart(
    target: Target,
    systemd: Systemd,
    st: store.Store,
    live: int,
    state: State,
    out: Outcome,
    save_state: Callable[[], object],
) -> None:
    """Restart the wedged unit (``systemctl restart --no-block``: systemd stops it, with
    ``SIGCONT`` and, at ``TimeoutStopSec``, ``SIGKILL``; the next sample sees the new
    process) and record why: the live generation's meta, the journal, the metrics. Not
    while a deploy is in progress: it restarts the unit itself."""
    assert out.wedged is not None
    pid, run, why = out.wedged["pid"], out.wedged["samples"], out.wedged["why"]
    if sampler.deploying(st) or st.live_number() != live:
        return
    try:
        systemd.restart()
    except LauncherError as e:
        out.errors.append(f"{target.unit}: the wedged server was not restarted: {e}")
        return
    out.wedged["restarted"] = True
    state.wedged, state.wedged_restarts = [], state.wedged_restarts + 1
    out.warnings.append(
        f"{target.unit}: restarted: the server (pid {pid}) lived but did not answer {run} "
        f"samples in a row: {why}"
    )
    save_state()
    try:
        gen = st.get(live)
        kept = list(gen.meta.get("wedged_restarts") or [])
        kept.append(record_of(time.time(), pid, run, why))
        st.update(gen, wedged_restarts=kept[-KEEP:])
    except StoreError as e:
        out.errors.append(f"the wedge restart was not recorded in generation {live}: {e}")


def page_lines(state: State, page: textfile.Page) -> None:
    page.add("llama_launcher_wedged_samples", state.wedged[1] if state.wedged else 0)
    page.add("llama_launcher_wedged_restarts_total", state.wedged_restarts)
