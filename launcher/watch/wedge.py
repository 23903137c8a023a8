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
- ``/health`` does not answer within ``HEALTH_TIMEOUT``: the HTTP threads that answer it do
  not run (a refused connection is not counted: ``NOBODY``). The sample then skips
  ``/slots`` and ``/metrics`` (10 s each): a wedged sample takes about ``HEALTH_TIMEOUT``.
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
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher.server import metrics

#: The setting ``wedged_samples``' default (``launcher.config.ToolSettings``): the count a
#: sampler started without the option (an older install's unit) uses.
SAMPLES = 3
#: Seconds ``/health`` may take: answered by llama-server's HTTP threads at once, busy or not.
HEALTH_TIMEOUT = 5.0
#: Seconds the 1-token completion may take, when the loop looks stalled or silent.
COMPLETION_TIMEOUT = 5.0
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
