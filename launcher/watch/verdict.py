"""The bake's judge: one sample of the new generation against the previous one's record.

Pure functions over figures (no files, no clock): ``launcher.watch.bake`` hands in what one
sample saw, what the generation recorded since its gate, and the baseline taken from the
previous generation's live record when the bake began; the judge says go on, or the verdict.

The signals, after Argo Rollouts' analysis, Flagger's checks and AWS AppConfig's bake
(/work/shared/research/anchors-next-wave.md, section 1):

- **hard** (revert on the first one, warm-up or not): the unit restarted (``NRestarts`` rose,
  or a new process no deploy explains), it was OOM-killed or is failing, or its server lives
  but has not answered ``wedged_samples`` samples in a row (``launcher.watch.wedge``); a
  ``Context size has been exceeded`` or a decode failure where the baseline had none at a
  comparable load (as many busy slots, or more); an over-committed shared pool whose slots'
  sessions need ``pool_limit`` of it (what every slot holds and the busy ones may still
  generate: the overflow before it comes, since a batch that finds no room fails every busy
  request at once), when the previous config guaranteed every slot its window; failed
  requests (in-stream errors and 5xx; a request too long for its slot is the client's) above
  ``failure_rate`` of the generation's requests.
- **soft** (revert after ``soft_samples`` bad samples in a row, after the warm-up, and only
  with ``min_completions`` completions since the gate): decode tok/s under ``decode_ratio``
  of the baseline's median at a similar number of busy slots (the server's own counters:
  tokens per slot-second fall as slots batch together, so only a like load compares);
  ``RssAnon + VmSwap`` growing faster than ``memory_ratio`` times the baseline's slope (and
  faster than ``memory_floor``: a flat baseline is no reason to revert a few pages); a vLLM
  that preempts sequences at a load where the baseline never queued a request (vLLM puts
  back what its pool cannot hold instead of failing it: ``preempting``).
- **inconclusive**: too little traffic by the deadline, the signals unreadable
  ``unread_limit`` samples in a row, or the sampler away past the deadline (and
  ``unjudged``, decided by ``carry.carry``: no sample could judge it past the deadline):
  the new config stays. Missing data never reverts (flagger#1035, argo-rollouts#1466).
- **passed**: the deadline came with enough data and nothing decided.

With no baseline only the hard signals count (and a failure of a kind counts as one the
baseline never had).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from launcher.watch import record

if TYPE_CHECKING:
    from launcher.config import ToolSettings

#: A sample that decoded fewer tokens than this measured nothing: its rate is noise.
MIN_DECODE_TOKENS = 32
#: The failure kinds that compare with the baseline at a like load.
POOL_FAILURES = ("context_exceeded", "decode_failed")
MIB = 1 << 20


@dataclass(frozen=True)
class Policy:
    """The bake's knobs (the ``bake_*`` settings; the guide "The bake and the live watch")."""

    duration: float
    interval: float = 15.0
    warmup: float = 120.0
    drain: float = 5.0
    failure_rate: float = 0.01
    soft_samples: int = 3
    min_completions: int = 20
    decode_ratio: float = 0.8
    memory_ratio: float = 1.5
    memory_floor: float = 256.0 * MIB  # bytes per hour
    unread_limit: int = 4
    #: the slots' need of an over-committed pool that reverts (0: off, and always 0
    #: when the baked pool is not over-committed or the previous one was too: ``bake.begin``)
    pool_limit: float = 0.0
    #: seconds between two looks at /slots between samples while the pool is watched
    pool_poll: float = 0.0

    @classmethod
    def from_settings(cls, s: ToolSettings, duration: float | None = None) -> Policy:
        return cls(
            duration=s.bake if duration is None else duration,
            interval=s.bake_interval,
            warmup=s.bake_warmup,
            drain=s.bake_drain,
            failure_rate=s.bake_failure_rate,
            soft_samples=s.bake_soft_samples,
            min_completions=s.bake_min_completions,
            decode_ratio=s.bake_decode_ratio,
            memory_ratio=s.bake_memory_ratio,
            memory_floor=s.bake_memory_floor * MIB,
            unread_limit=s.bake_unread_limit,
            pool_limit=s.bake_pool_limit,
            pool_poll=s.bake_pool_poll,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Baseline:
    """The previous generation as the bake compares with it: decode medians by busy slots,
    its memory slope, and its pool failures by the busy slots of their minute."""

    generation: int
    decode_by_busy: dict[int, float] = field(default_factory=dict)
    memory_slope: float | None = None
    #: kind -> busy slots of a minute -> failures of that kind in such minutes
    failures: dict[str, dict[int, int]] = field(default_factory=dict)
    completions: int = 0
    #: busy slots of a minute -> the most requests it queued in such minutes
    waited_by_busy: dict[int, int] = field(default_factory=dict)

    def waited_at(self, busy: int | None) -> bool | None:
        """Whether the baseline queued requests at ``busy`` slots or fewer; None when it was
        never sampled at that load or more (nothing to compare)."""
        if busy is None or not any(b >= busy for b in self.waited_by_busy):
            return None
        return any(n for b, n in self.waited_by_busy.items() if b <= busy)

    def decode_at(self, busy: int | None) -> float | None:
        """The median decode tok/s at ``busy`` slots, else at one slot more or fewer."""
        if busy is None:
            return None
        for b in (busy, busy - 1, busy + 1):
            if b in self.decode_by_busy:
                return self.decode_by_busy[b]
        return None

    def had(self, kind: str, busy: int | None) -> bool:
        """The baseline failed requests of ``kind`` at ``busy`` slots or more."""
        by = self.failures.get(kind, {})
        return any(n for b, n in by.items() if busy is None or b >= busy)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Baseline | None:
        if not data:
            return None
        return cls(
            generation=int(data["generation"]),
            decode_by_busy={int(k): float(v) for k, v in data["decode_by_busy"].items()},
            memory_slope=data.get("memory_slope"),
            failures={
                str(k): {int(b): int(n) for b, n in v.items()}
                for k, v in data.get("failures", {}).items()
            },
            completions=int(data.get("completions") or 0),
            waited_by_busy={int(b): int(n) for b, n in data.get("waited_by_busy", {}).items()},
        )


def baseline_of(rec: record.Record) -> Baseline:
    """The baseline from a generation's live record: over its own time, with the load each
    figure was measured at (a row's busy peak)."""
    rows = rec.rows()
    rates: dict[int, list[float]] = {}
    failures: dict[str, dict[int, int]] = {}
    waited: dict[int, int] = {}
    for row in rows:
        busy = int(row[record.COL["busy_peak"]] or 0)
        deferred = row[record.COL["deferred_peak"]]
        if deferred is not None:
            waited[busy] = max(waited.get(busy, 0), int(deferred))
        seconds = row[record.COL["decode_seconds"]] or 0
        tokens = row[record.COL["decode_tokens"]] or 0
        if seconds > 0 and tokens >= MIN_DECODE_TOKENS:
            rates.setdefault(busy, []).append(tokens / seconds)
        for kind in POOL_FAILURES:
            n = int(row[record.COL[kind]] or 0)
            if n:
                by = failures.setdefault(kind, {})
                by[busy] = by.get(busy, 0) + n
    summary = rec.summary()
    return Baseline(
        generation=rec.generation,
        decode_by_busy={b: round(statistics.median(r), 3) for b, r in sorted(rates.items())},
        memory_slope=summary.memory_slope,
        failures=failures,
        completions=summary.completions,
        waited_by_busy=waited,
    )


@dataclass(frozen=True)
class Seen:
    """What one sample of the baking generation saw."""

    t: float
    #: this sample's counts (``launcher.watch.record.ROW`` names: requests, failures,
    #: context_exceeded, restarts, decode_tokens, decode_seconds, ...)
    counts: Mapping[str, float]
    #: the busy slots (the minute's peak)
    busy: int | None = None
    #: the unit as ``systemctl show`` said: active/sub and Result
    active: str = "active"
    sub: str = "running"
    result: str = "success"
    #: the sources that could not be read while the unit ran
    unread: Sequence[str] = ()
    #: seconds since the bake's sample before (None: the first)
    gap: float | None = None
    rebooted: bool = False
    #: the slots' need of the pool (held and still to generate): the most this sample or a
    #: look at /slots since the sample before saw (``slots.Pressure.need``), with its
    #: line
    pool_need: float | None = None
    pool_line: str | None = None
    #: the server lived but did not answer ``wedged_samples`` samples in a row: why
    #: (``launcher.watch.wedge``)
    wedged: str | None = None
    #: the requests the server queues now (llama-server's deferred, vLLM's waiting)
    waiting: int | None = None


@dataclass(frozen=True)
class Window:
    """What the generation recorded since its gate (its live record)."""

    requests: int = 0
    completions: int = 0
    failures: int = 0
    too_long: int = 0
    #: (time, RssAnon + VmSwap bytes) of its rows
    memory: Sequence[tuple[float, float | None]] = ()

    @classmethod
    def of(cls, rec: record.Record) -> Window:
        t = rec.totals
        points = [(r[0] or 0.0, r[record.COL["memory"]]) for r in rec.rows()]
        return cls(
            requests=int(t.get("requests", 0)),
            completions=int(t.get("completions", 0)),
            failures=int(t.get("failures", 0)),
            too_long=int(t.get("too_long", 0)),
            memory=points,
        )

    @property
    def failed(self) -> int:
        """Failed requests that are the server's (a request too long is the client's)."""
        return max(0, self.failures - self.too_long)


@dataclass
class Progress:
    """What the bake carries from one sample to the next (in its record)."""

    samples: int = 0
    soft_bad: int = 0
    soft_why: list[str] = field(default_factory=list)
    unread: int = 0
    last: float | None = None
    notes: list[str] = field(default_factory=list)
    #: when the first sample judged the bake (how soon after the deploy it was watched)
    first: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Progress:
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in (data or {}).items() if k in known})


@dataclass(frozen=True)
class Verdict:
    """How a bake ended: ``revert`` (``hard`` or soft), ``passed`` or ``inconclusive``;
    ``signal`` names what decided, ``reason`` says it with the figures."""

    state: str
    signal: str
    reason: str
    hard: bool = False
    figures: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Verdict | None:
        return cls(**data) if data else None


def judge(
    policy: Policy,
    baseline: Baseline | None,
    seen: Seen,
    window: Window,
    progress: Progress,
    started: float,
) -> Verdict | None:
    """One sample judged; ``progress`` is updated. None: the bake goes on. ``started``:
    when the generation passed its gate (the bake's start)."""
    deadline = started + policy.duration
    progress.samples += 1
    progress.last = seen.t
    if progress.first is None:
        progress.first = seen.t
    away = seen.gap is not None and seen.gap > policy.unread_limit * policy.interval
    if away:
        what = "the host rebooted" if seen.rebooted else "the sampler did not run"
        if seen.t >= deadline:
            return Verdict(
                "inconclusive",
                "gap",
                f"{what} for {seen.gap:.0f}s and the bake's window passed meanwhile: it ends "
                "inconclusive and the new config stays",
                figures={"gap_seconds": round(seen.gap or 0, 1)},
            )
        progress.notes.append(f"{what} for {seen.gap:.0f}s; the bake resumed at {seen.t:.0f}")
    if seen.rebooted:
        progress.notes.append(
            f"the host rebooted; the bake resumed at {seen.t:.0f} (the boot's restart of the "
            "unit is not held against the config)"
        )
    if (hard := hard_failure(policy, baseline, seen, window)) is not None:
        return hard
    if seen.active == "inactive":
        return Verdict(
            "inconclusive",
            "stopped",
            "the unit was stopped (not by a failure): the bake ends, nothing is put back",
        )
    if seen.unread:
        progress.unread += 1
        if progress.unread >= policy.unread_limit:
            return Verdict(
                "inconclusive",
                "unreadable",
                f"the signals could not be read {progress.unread} samples in a row "
                f"({', '.join(seen.unread)}): the bake ends inconclusive, the new config stays",
            )
        return _at_deadline(policy, window, progress, seen.t, deadline)
    progress.unread = 0
    bad = soft_signals(policy, baseline, seen, window, seen.t - started)
    if bad is not None:
        progress.soft_bad = progress.soft_bad + 1 if bad else 0
        progress.soft_why = bad
        if progress.soft_bad >= policy.soft_samples:
            return Verdict(
                "revert",
                bad[0].split(":", 1)[0],
                f"{progress.soft_bad} bad samples in a row: " + "; ".join(bad),
                figures={"bad_samples": progress.soft_bad, "completions": window.completions},
            )
    return _at_deadline(policy, window, progress, seen.t, deadline)


def _at_deadline(
    policy: Policy, window: Window, progress: Progress, now: float, deadline: float
) -> Verdict | None:
    if now < deadline:
        return None
    figures = {"completions": window.completions, "requests": window.requests}
    if window.completions < policy.min_completions:
        return Verdict(
            "inconclusive",
            "too_little_traffic",
            f"{window.completions} completion(s) in the window, under the "
            f"{policy.min_completions} a verdict needs: the new config stays (nothing was "
            "judged on missing data)",
            figures=figures,
        )
    return Verdict(
        "passed",
        "window_ended",
        f"{window.completions} completions in the window and no signal decided: the new "
        "config stays",
        figures=figures,
    )


def hard_failure(
    policy: Policy, baseline: Baseline | None, seen: Seen, window: Window
) -> Verdict | None:
    """The first hard signal of this sample, or None."""
    restarts = int(seen.counts.get("restarts", 0))
    if seen.result == "oom-kill":
        return _hard("oom", "the kernel's OOM killer ended the server (Result=oom-kill)", {})
    if restarts and not seen.rebooted:
        return _hard("restart", f"the unit restarted {restarts} time(s) since the last sample", {})
    # the unit coming up again after a reboot is the boot's doing; one failing is not
    coming_up = seen.rebooted and seen.active == "activating"
    if not coming_up and (seen.active in ("failed", "activating") or seen.sub == "auto-restart"):
        return _hard("down", f"the unit is {seen.active}/{seen.sub} (Result={seen.result})", {})
    if seen.wedged:
        return _hard("wedged", f"the server lives but does not answer: {seen.wedged}", {})
    for kind in POOL_FAILURES:
        n = int(seen.counts.get(kind, 0))
        if n and (baseline is None or not baseline.had(kind, seen.busy)):
            against = (
                "there is no baseline"
                if baseline is None
                else f"generation {baseline.generation} had none at {seen.busy} busy slots or more"
            )
            if kind == POOL_FAILURES[0]:
                what = "'Context size has been exceeded'"
            elif "preemptions" in seen.counts:  # vLLM's counters: its access log's answers
                what = "a server error or 'model does not exist' (vLLM's 5xx and 404)"
            else:
                what = "decode"
            return _hard(
                kind,
                f"{n} request(s) failed with {what} since the last sample; {against}",
                {kind: n, "busy": seen.busy},
            )
    limit = policy.pool_limit
    if limit and seen.pool_need is not None and seen.pool_need >= limit:
        return _hard(
            "pool",
            f"the slots' sessions need {seen.pool_need:.0%} of the over-committed shared "
            f"pool (what every slot holds and the busy ones may still generate; the bake's "
            f"limit: {limit:.0%}; {seen.pool_line or 'no line'}): once their turns overlap "
            "past it, every busy request fails at once with 'Context size has been "
            "exceeded'; the previous config guaranteed every slot its window",
            {"pool_need": round(seen.pool_need, 3), "busy": seen.busy},
        )
    if seen.counts.get("failures", 0) and window.requests:
        share = window.failed / window.requests
        if share > policy.failure_rate:
            return _hard(
                "failed_requests",
                f"{window.failed} of {window.requests} requests failed ({share:.1%}, over "
                f"{policy.failure_rate:.0%})",
                {"failed": window.failed, "requests": window.requests},
            )
    return None


def _hard(signal: str, reason: str, figures: dict[str, Any]) -> Verdict:
    return Verdict("revert", signal, reason, hard=True, figures=figures)


def soft_signals(
    policy: Policy, baseline: Baseline | None, seen: Seen, window: Window, age: float
) -> list[str] | None:
    """This sample's bad soft signals (empty: none was bad); None: the sample measured
    nothing to judge (in the warm-up, too little data, no baseline, nothing decoded): it
    neither adds to the run of bad samples nor breaks it."""
    if baseline is None or age < policy.warmup or window.completions < policy.min_completions:
        return None
    bad: list[str] = []
    measured = False
    tokens = seen.counts.get("decode_tokens", 0)
    seconds = seen.counts.get("decode_seconds", 0)
    base = baseline.decode_at(seen.busy)
    if base and seconds > 0 and tokens >= MIN_DECODE_TOKENS:
        measured = True
        rate = tokens / seconds
        if rate < policy.decode_ratio * base:
            bad.append(
                f"decode_speed: {rate:.1f} tok/s at {seen.busy} busy slot(s), under "
                f"{policy.decode_ratio:g}x generation {baseline.generation}'s {base:.1f}"
            )
    preempted = int(seen.counts.get("preemptions", 0))
    if preempted:
        # vLLM puts back what its pool cannot hold (none fails): worse when the previous
        # config never queued at this load. A queue alone is no sign: fewer sequences
        # (--max-num-seqs) queue by design
        before = baseline.waited_at(seen.busy)
        if before is not None:
            measured = True
            if not before:
                bad.append(
                    f"preempting: {preempted} sequence(s) preempted and {seen.waiting or 0} "
                    f"request(s) waiting at {seen.busy} busy; generation "
                    f"{baseline.generation} never queued at that load"
                )
    slope = record.slope(list(window.memory))
    if slope is not None:
        measured = True
        limit = max(
            policy.memory_ratio * max(baseline.memory_slope or 0.0, 0.0), policy.memory_floor
        )
        if slope > limit:
            bad.append(
                f"memory_growth: {slope / MIB:.0f} MiB/h, over {limit / MIB:.0f} MiB/h "
                f"({policy.memory_ratio:g}x generation {baseline.generation}'s slope, at least "
                f"{policy.memory_floor / MIB:.0f})"
            )
    return bad if measured else None
