"""Alert rules: small objects that look at a window of a run's events and say what is wrong.

Rules are pure: no database, no clock. The caller hands each rule the window of recent
observations, ``now`` and a :class:`RunContext` of facts from the database, and gets back
:class:`Signal` objects. What happens next (dedup by ``(run, rule, key)``, posting,
acknowledging, escalating) belongs to the alert lifecycle, so a rule may say the same
thing on every evaluation; that only updates the open alert. A ``resolved`` signal for an
alert that is not open is expected and means nothing to do.

Runner payloads are not trusted to be well typed: a field of the wrong type is treated
as missing, never as a crash, because one bad event must not silence every alert.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from itertools import chain
from operator import attrgetter
from typing import Any, NamedTuple, Protocol, overload

from runner import EXIT_PREEMPTED

__all__ = [
    "AlertConfig",
    "AutoResubmit",
    "Budget",
    "Disk",
    "DivergentLoss",
    "LostHeartbeat",
    "LowUtilisation",
    "Obs",
    "Preemption",
    "RepeatedPreemptions",
    "Rule",
    "RunContext",
    "Severity",
    "Signal",
    "default_rules",
    "evaluate_all",
]


class Severity(str, Enum):
    """How loudly to say it: critical alerts escalate to on-call when nobody acknowledges."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


@dataclass(frozen=True)
class Signal:
    """What a rule says about a run; the lifecycle dedups by (run, rule, key)."""

    #: The rule's name, e.g. "divergent_loss".
    rule: str
    #: Dedup key within the rule, e.g. "nan", "spike", "threshold-80".
    key: str
    #: How loudly to say it.
    severity: Severity
    #: One line for a tired on-call engineer: what happened, to which run.
    title: str
    #: The figures behind it.
    detail: str
    #: What to do about it.
    hint: str
    #: True when the condition has cleared, so the lifecycle can resolve the alert.
    resolved: bool = False
    #: Machine-readable figures; ``{"stop": True}`` asks the service to stop the run.
    data: Mapping[str, Any] = field(default_factory=dict)


def _cleared(
    rule: str,
    *,
    key: str,
    severity: Severity,
    title: str,
    detail: str,
    data: Mapping[str, Any],
) -> Signal:
    """The signal a rule sends when its condition has cleared (lets the lifecycle resolve)."""
    return Signal(
        rule=rule,
        key=key,
        severity=severity,
        title=title,
        detail=detail,
        hint="Nothing to do.",
        resolved=True,
        data=data,
    )


class Obs(NamedTuple):
    """One observation: a runner event, or a synthetic one from the control plane.

    A named tuple rather than a frozen dataclass: the ingest API makes hundreds per
    batch for the rules' window, and a tuple is built four times faster.
    """

    #: When it happened, unix seconds.
    time: float
    #: Event type: "metrics", "system", "preemption_notice", "exit",
    #: "checkpoint_committed", or the synthetic "resubmitted".
    type: str
    #: The event's payload; may carry "attempt" (the attempt number that sent it).
    data: Mapping[str, Any]


@dataclass(frozen=True)
class RunContext:
    """Facts about the run that the events alone do not carry, read from the database."""

    #: The run the window belongs to; every title names it.
    run_id: str
    #: The run's budget in USD, or None when it has none.
    budget_usd: float | None
    #: Spent so far, all attempts, in USD.
    spent_usd: float
    #: Budget alert thresholds in percent, e.g. (50, 80, 100).
    thresholds_pct: tuple[float, ...]
    #: Stop the run when the budget is used up.
    hard_cap: bool
    #: Last time the runner was heard from, unix seconds; None before it first reports.
    last_heartbeat: float | None
    #: When each preemption of this run happened, unix seconds.
    preemption_times: tuple[float, ...]
    #: The current attempt, counting from 1.
    attempt_number: int
    #: Step of the newest committed checkpoint; None when there is none yet.
    last_committed_step: int | None
    #: Latest step reported; None before the first metrics.
    current_step: int | None


@dataclass(frozen=True)
class AlertConfig:
    """Thresholds of the rules; the job spec's ``alerts`` section maps onto these names."""

    #: A loss above this multiple of its baseline (the median of earlier points) is a spike.
    loss_spike_factor: float = 3.0
    #: Consecutive points above the spike line before it alerts (one bad batch is noise).
    loss_spike_points: int = 3
    #: Points in the least-squares fit that detects a rising loss.
    trend_points: int = 20
    #: Mean GPU utilisation below this, in percent, is low.
    low_util_percent: float = 40.0
    #: How long utilisation must stay low, in seconds.
    low_util_window_s: float = 300
    #: Disk use above this, in percent, alerts.
    disk_percent: float = 90.0
    #: Alert when the disk is predicted full within this many seconds.
    disk_horizon_s: float = 1800
    #: This many preemptions within ``repeated_window_s`` is a critical alert.
    repeated_preemptions: int = 3
    #: The window for counting preemptions, in seconds.
    repeated_window_s: float = 3600
    #: No heartbeat for this many seconds is a critical alert.
    heartbeat_deadline_s: float = 120
    #: Mean fraction of step time spent waiting for data above which a run without a GPU
    #: is input-bound (with a GPU, utilisation decides).
    data_wait_fraction: float = 0.5

    def __post_init__(self) -> None:
        positive = {
            "loss_spike_factor": self.loss_spike_factor,
            "loss_spike_points": self.loss_spike_points,
            "low_util_window_s": self.low_util_window_s,
            "disk_horizon_s": self.disk_horizon_s,
            "repeated_preemptions": self.repeated_preemptions,
            "repeated_window_s": self.repeated_window_s,
            "heartbeat_deadline_s": self.heartbeat_deadline_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"alerts.{name} is {value}; set it to a positive number.")
        if self.trend_points < 3:
            raise ValueError(
                f"alerts.trend_points is {self.trend_points}; a trend needs at least 3 points."
            )
        if not 0 <= self.low_util_percent <= 100:
            raise ValueError(
                f"alerts.low_util_percent is {self.low_util_percent}; set it from 0 (off) to 100."
            )
        if not 0 < self.disk_percent <= 100:
            raise ValueError(f"alerts.disk_percent is {self.disk_percent}; set it from 1 to 100.")
        if not 0 < self.data_wait_fraction < 1:
            raise ValueError(
                f"alerts.data_wait_fraction is {self.data_wait_fraction}; set it between 0 and 1."
            )


class Rule(Protocol):
    """One alert rule: a pure function of the window, ``now`` and the run's facts."""

    name: str

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]: ...


# The samples of a time window must span this share of it, so one low reading, or a run
# that only just started reporting, never fires a windowed rule.
_COVERAGE = 0.8
# With a GPU, a data-wait share above this is worth naming as the cause of low utilisation.
_INPUT_BOUND = 0.25
# A trend alerts only when the latest loss is this multiple of the window's minimum.
_TREND_RATIO = 1.5
# Disk use at or above this percentage is critical: the next checkpoint may not fit.
_DISK_CRITICAL = 97.0
_DISK_FIT_MIN_POINTS = 3


def _num(data: Mapping[str, Any], key: str) -> float | None:
    """A numeric payload field as float, or None when it is missing or of the wrong type."""
    value = data.get(key)
    if type(value) is float:  # nearly always: the rules read every observation per batch
        return value
    if type(value) is int:
        return float(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # JSON has no NaN: the wire sends "NaN", "Infinity".
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _int(data: Mapping[str, Any], key: str) -> int | None:
    exact = data.get(key)
    if type(exact) is int:
        return exact
    value = _num(data, key)
    return int(value) if value is not None and math.isfinite(value) else None


_TIME = attrgetter("time")


class TypedWindow(Sequence[Obs]):
    """A window that also holds its observations by type, each type oldest first.

    Most rules read one or two types, and every batch the ingest API evaluates all of
    them over the whole window, so each picking and sorting its types again cost more
    than the rules' own work. :func:`evaluate_all` wraps any window in one; the ingest
    API, whose window is kept by type already, builds it with :meth:`from_groups`.
    Immutable, so the groups never go stale.
    """

    __slots__ = ("_groups", "_items")

    def __init__(self, window: Iterable[Obs] = ()) -> None:
        self._items = tuple(window)
        self._groups: dict[str, list[Obs]] | None = None

    @classmethod
    def from_groups(cls, groups: Mapping[str, Iterable[Obs]]) -> TypedWindow:
        """A window of observations already grouped: each group holds only its key's type."""
        lists = {kind: list(group) for kind, group in groups.items()}
        window = cls(chain.from_iterable(lists.values()))
        for group in lists.values():
            group.sort(key=_TIME)
        window._groups = lists
        return window

    def of_type(self, kind: str) -> list[Obs]:
        """The observations of one type, oldest first. Shared between the rules: read only."""
        groups = self._groups
        if groups is None:
            groups = {}
            for obs in self._items:
                group = groups.get(obs.type)
                if group is None:
                    group = groups[obs.type] = []
                group.append(obs)
            for group in groups.values():
                group.sort(key=_TIME)
            self._groups = groups
        return groups.get(kind, [])

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Obs]:
        return iter(self._items)

    @overload
    def __getitem__(self, index: int) -> Obs: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Obs]: ...

    def __getitem__(self, index: int | slice) -> Obs | Sequence[Obs]:
        return self._items[index]


def _of_type(window: Sequence[Obs], kind: str) -> list[Obs]:
    """One type's observations, oldest first; read only (it may be shared)."""
    if isinstance(window, TypedWindow):
        return window.of_type(kind)
    return sorted([o for o in window if o.type == kind], key=_TIME)


def _attempt(obs: Obs, ctx: RunContext) -> int:
    attempt = _int(obs.data, "attempt")
    return attempt if attempt is not None else ctx.attempt_number


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs; 0 when xs do not vary."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M UTC")


def _loss(value: float) -> str:
    return f"{value:.4g}"


class DivergentLoss:
    """The loss went NaN/Inf, spiked for several points, or keeps rising.

    A diverging run burns its budget producing nothing, so NaN alerts at once; a spike
    needs several points in a row because a single bad batch is normal.
    """

    name = "divergent_loss"

    def __init__(self, cfg: AlertConfig = AlertConfig()) -> None:
        self.cfg = cfg

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        points: list[tuple[int | None, float]] = []
        for obs in _of_type(window, "metrics"):
            data = obs.data
            loss = data.get("loss")
            if type(loss) is not float:  # the rest, inlined: this runs for every point
                loss = _num(data, "loss")
                if loss is None:
                    continue
            step = data.get("step")
            points.append((step if type(step) is int else _int(data, "step"), loss))
        signals: list[Signal] = []
        bad = [(step, loss) for step, loss in points if not math.isfinite(loss)]
        if bad:
            signals.append(self._nan(bad, len(points), ctx))
        finite = [(step, loss) for step, loss in points if math.isfinite(loss)]
        spike = self._spike(finite, ctx)
        if spike is not None:
            signals.append(spike)
        trend = self._trend(finite, ctx)
        if trend is not None:
            signals.append(trend)
        return signals

    def _stop_hint(self, ctx: RunContext) -> str:
        where = (
            f"the last checkpoint (step {ctx.last_committed_step})"
            if ctx.last_committed_step is not None
            else "scratch (no checkpoint is committed yet)"
        )
        return (
            f"Stop it (`/train stop {ctx.run_id}`), lower the learning rate or clip gradients, "
            f"and resubmit from {where}."
        )

    def _nan(self, bad: list[tuple[int | None, float]], total: int, ctx: RunContext) -> Signal:
        step, loss = bad[0]
        return Signal(
            rule=self.name,
            key="nan",
            severity=Severity.CRITICAL,
            title=f"Loss is {loss} in run {ctx.run_id} at step {step}",
            detail=(
                f"first non-finite loss {loss} at step {step}; "
                f"{len(bad)} of the last {total} losses are not finite"
            ),
            hint=f"The run is diverging and will not recover. {self._stop_hint(ctx)}",
            data={"step": step, "loss": str(loss), "non_finite": len(bad)},
        )

    def _spike(self, finite: list[tuple[int | None, float]], ctx: RunContext) -> Signal | None:
        m, factor = self.cfg.loss_spike_points, self.cfg.loss_spike_factor
        earlier, recent = finite[:-m], finite[-m:]
        if len(recent) < m or len(earlier) < max(3, m):
            return None  # too few points to tell a spike from the start of training
        baseline = statistics.median(loss for _, loss in earlier)
        if baseline <= 0:
            return None  # a ratio to a non-positive loss means nothing
        line = factor * baseline
        if not all(loss > line for _, loss in recent):
            return _cleared(
                self.name,
                key="spike",
                severity=Severity.CRITICAL,
                title=f"Loss of run {ctx.run_id} is back near its baseline",
                detail=f"latest loss {_loss(finite[-1][1])} vs baseline {_loss(baseline)}",
                data={},
            )
        values = ", ".join(_loss(loss) for _, loss in recent)
        first_step, last_step = recent[0][0], recent[-1][0]
        peak = max(loss for _, loss in recent)
        return Signal(
            rule=self.name,
            key="spike",
            severity=Severity.CRITICAL,
            title=f"Loss spiked to {peak / baseline:.1f}× its baseline in run {ctx.run_id}",
            detail=(
                f"loss {values} at steps {first_step}–{last_step}, above {factor:g}× the "
                f"baseline {_loss(baseline)} (median of {len(earlier)} earlier points) "
                f"for {m} points in a row"
            ),
            hint=f"It may be diverging. {self._stop_hint(ctx)}",
            data={"step": last_step, "baseline": baseline, "losses": [x for _, x in recent]},
        )

    def _trend(self, finite: list[tuple[int | None, float]], ctx: RunContext) -> Signal | None:
        n = self.cfg.trend_points
        if len(finite) < n:
            return None
        last = finite[-n:]
        losses = [loss for _, loss in last]
        slope = _slope([float(i) for i in range(n)], losses)
        low = min(losses)
        rising = slope > 0 and low > 0 and losses[-1] > _TREND_RATIO * low
        if not rising:
            return _cleared(
                self.name,
                key="trend",
                severity=Severity.WARNING,
                title=f"Loss of run {ctx.run_id} is no longer rising",
                detail=f"latest loss {_loss(losses[-1])}, window minimum {_loss(low)}",
                data={},
            )
        return Signal(
            rule=self.name,
            key="trend",
            severity=Severity.WARNING,
            title=f"Loss keeps rising in run {ctx.run_id}",
            detail=(
                f"loss rose to {_loss(losses[-1])} at step {last[-1][0]}, "
                f"{losses[-1] / low:.1f}× the minimum {_loss(low)} of the last {n} points "
                f"(steps {last[0][0]}–{last[-1][0]}); slope +{slope:.3g} per point"
            ),
            hint=(
                "Check the learning-rate schedule and the data order. If it keeps rising: "
                + self._stop_hint(ctx)
            ),
            data={"step": last[-1][0], "loss": losses[-1], "min": low, "slope": slope},
        )


class LowUtilisation:
    """The accelerator idles, and the data-wait fraction says whether the input is why.

    Low utilisation almost always means the input pipeline, and the fix (loader workers,
    prefetch, local staging) is cheap next to paying for an idle GPU. A run without a GPU
    (local, CPU) has no utilisation to report, so there the data-wait fraction decides.
    """

    name = "low_utilisation"

    def __init__(self, cfg: AlertConfig = AlertConfig()) -> None:
        self.cfg = cfg

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        span = self.cfg.low_util_window_s
        start = now - span
        gpu = [
            (o.time, u)
            for o in _of_type(window, "system")
            if o.time >= start and (u := _num(o.data, "gpu_util")) is not None
        ]
        waits = [
            (o.time, min(max(w, 0.0), 1.0))
            for o in _of_type(window, "metrics")
            if o.time >= start and (w := _num(o.data, "data_wait_fraction")) is not None
        ]
        wait = statistics.fmean(w for _, w in waits) if waits else None
        if gpu:
            return self._gpu(gpu, wait, ctx)
        return self._cpu(waits, wait, ctx)

    def _covered(self, times: Sequence[float]) -> bool:
        return len(times) >= 2 and times[-1] - times[0] >= _COVERAGE * self.cfg.low_util_window_s

    def _gpu(
        self, gpu: list[tuple[float, float]], wait: float | None, ctx: RunContext
    ) -> list[Signal]:
        if not self._covered([t for t, _ in gpu]):
            return []
        mean = statistics.fmean(u for _, u in gpu)
        threshold = self.cfg.low_util_percent
        span = _duration(self.cfg.low_util_window_s)
        data = {"gpu_util": mean, "data_wait_fraction": wait}
        if mean >= threshold:
            return [
                _cleared(
                    self.name,
                    key="gpu",
                    severity=Severity.WARNING,
                    title=f"GPU utilisation of run {ctx.run_id} recovered to {mean:.0f}%",
                    detail=f"mean GPU utilisation {mean:.0f}% over the last {span}",
                    data=data,
                )
            ]
        if wait is None:
            why = "data-wait not reported"
            hint = (
                "Check the input pipeline first (loader workers, prefetch, local data), "
                "then the batch size and CPU work inside the step."
            )
        elif wait > _INPUT_BOUND:
            why = f"data-wait {wait:.0%} of step time"
            hint = _pipeline_hint(wait)
        else:
            why = f"data-wait only {wait:.0%} of step time"
            hint = (
                f"data-wait is only {wait:.0%}, so the input is not the cause: look at the "
                "batch size, CPU work inside the step, or communication; profile one step."
            )
        return [
            Signal(
                rule=self.name,
                key="gpu",
                severity=Severity.WARNING,
                title=f"GPU utilisation {mean:.0f}% on run {ctx.run_id} for the last {span}",
                detail=(
                    f"mean GPU utilisation {mean:.0f}% over {len(gpu)} samples "
                    f"(alert below {threshold:g}%); {why}"
                ),
                hint=hint,
                data=data,
            )
        ]

    def _cpu(
        self, waits: list[tuple[float, float]], wait: float | None, ctx: RunContext
    ) -> list[Signal]:
        if wait is None or not self._covered([t for t, _ in waits]):
            return []
        threshold = self.cfg.data_wait_fraction
        span = _duration(self.cfg.low_util_window_s)
        data = {"gpu_util": None, "data_wait_fraction": wait}
        if wait <= threshold:
            return [
                _cleared(
                    self.name,
                    key="data-wait",
                    severity=Severity.WARNING,
                    title=f"Run {ctx.run_id} is no longer waiting on its input",
                    detail=f"data-wait {wait:.0%} of step time over the last {span}",
                    data=data,
                )
            ]
        return [
            Signal(
                rule=self.name,
                key="data-wait",
                severity=Severity.WARNING,
                title=f"Run {ctx.run_id} spends {wait:.0%} of each step waiting for data",
                detail=(
                    f"data-wait {wait:.0%} of step time, mean of {len(waits)} samples over the "
                    f"last {span} (alert above {threshold:.0%}); no GPU utilisation reported"
                ),
                hint=_pipeline_hint(wait),
                data=data,
            )
        ]


def _pipeline_hint(wait: float) -> str:
    return (
        f"data-wait {wait:.0%} of step time: the input pipeline is the bottleneck — "
        "add loader workers, prefetch, or stage data locally."
    )


class Disk:
    """The scratch disk is nearly full, or filling fast enough to be full soon.

    A full disk fails the next checkpoint, which is the one thing a spot run cannot lose.
    """

    name = "disk"

    def __init__(self, cfg: AlertConfig = AlertConfig()) -> None:
        self.cfg = cfg

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        samples: list[tuple[float, float, float]] = []
        for obs in _of_type(window, "system"):
            data = obs.data
            used, total = data.get("disk_used"), data.get("disk_total")
            if type(used) is int and type(total) is int:  # nearly always: _num, inlined
                used, total = float(used), float(total)
            else:
                used, total = _num(data, "disk_used"), _num(data, "disk_total")
            if used is not None and total is not None and total > 0 and math.isfinite(used):
                samples.append((obs.time, used, total))
        if not samples:
            return []
        signals = [self._threshold(samples[-1], ctx)]
        full_in = self._full_in(samples, now=now, ctx=ctx)
        if full_in is not None:
            signals.append(full_in)
        return signals

    def _hint(self) -> str:
        return (
            "Free space on the scratch volume (caches, local checkpoint copies) or relaunch "
            "with a bigger disk; a full disk fails the next checkpoint."
        )

    def _threshold(self, latest: tuple[float, float, float], ctx: RunContext) -> Signal:
        _, used, total = latest
        pct = 100.0 * used / total
        figures = f"disk {pct:.1f}% used ({_bytes(used)} of {_bytes(total)})"
        data = {"percent": pct, "used": used, "total": total}
        if pct <= self.cfg.disk_percent:
            return _cleared(
                self.name,
                key="threshold",
                severity=Severity.WARNING,
                title=f"Disk of run {ctx.run_id} is back to {pct:.0f}% used",
                detail=figures,
                data=data,
            )
        critical = pct >= _DISK_CRITICAL
        return Signal(
            rule=self.name,
            key="threshold",
            severity=Severity.CRITICAL if critical else Severity.WARNING,
            title=f"Disk {pct:.0f}% full on run {ctx.run_id}",
            detail=f"{figures}; alert above {self.cfg.disk_percent:g}%",
            hint=self._hint(),
            data=data,
        )

    def _full_in(
        self, samples: list[tuple[float, float, float]], *, now: float, ctx: RunContext
    ) -> Signal | None:
        if len(samples) < _DISK_FIT_MIN_POINTS:
            return None
        times = [t for t, _, _ in samples]
        if times[-1] == times[0]:
            return None
        rate = _slope(times, [u for _, u, _ in samples])  # bytes per second
        _, used, total = samples[-1]
        horizon = self.cfg.disk_horizon_s
        eta = (total - used) / rate if rate > 0 else math.inf
        if eta > horizon:
            return _cleared(
                self.name,
                key="full-in",
                severity=Severity.WARNING,
                title=f"Disk of run {ctx.run_id} is no longer filling fast",
                detail=f"disk {100 * used / total:.1f}% used, growing {_bytes(rate * 60)}/min",
                data={"rate_bytes_per_s": rate},
            )
        eta = max(eta, 0.0)
        return Signal(
            rule=self.name,
            key="full-in",
            severity=Severity.WARNING,
            title=f"Disk of run {ctx.run_id} will be full in ~{_duration(eta)}",
            detail=(
                f"disk {100 * used / total:.1f}% used ({_bytes(used)} of {_bytes(total)}), "
                f"growing {_bytes(rate * 60)}/min over {len(samples)} samples: full in "
                f"~{_duration(eta)} (about {_clock(now + eta)})"
            ),
            hint=self._hint(),
            data={"eta_s": eta, "rate_bytes_per_s": rate, "used": used, "total": total},
        )


def _is_preemption(obs: Obs) -> bool:
    if obs.type == "preemption_notice":
        return True
    if obs.type != "exit":
        return False
    reason = obs.data.get("reason")
    if reason is not None:  # the runner's reason wins: a stop may also exit with 75
        return reason == "preempted"
    return _int(obs.data, "code") == EXIT_PREEMPTED


class Preemption:
    """An attempt is being, or was, preempted; trainbot resubmits it on its own.

    The alert is a warning, not a page: it tells people why the run paused and how much
    work is at stake, and the lifecycle dedups the notice and the exit of one attempt.
    """

    name = "preemption"

    def __init__(self, cfg: AlertConfig = AlertConfig()) -> None:
        self.cfg = cfg

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        by_attempt: dict[int, list[Obs]] = {}
        kinds = ("preemption_notice", "exit")
        for obs in sorted([o for o in window if o.type in kinds], key=_TIME):
            if _is_preemption(obs):
                by_attempt.setdefault(_attempt(obs, ctx), []).append(obs)
        return [self._signal(n, events, ctx) for n, events in sorted(by_attempt.items())]

    def _signal(self, attempt: int, events: list[Obs], ctx: RunContext) -> Signal:
        notice = next((o for o in events if o.type == "preemption_notice"), None)
        exited = next((o for o in events if o.type == "exit"), None)
        parts: list[str] = []
        data: dict[str, Any] = {"attempt": attempt}
        if notice is not None:
            source = notice.data.get("source", "the provider")
            left = _num(notice.data, "time_left_s")
            when = f", {left:.0f} s to termination" if left is not None else ""
            parts.append(f"notice from {source} at {_clock(notice.time)}{when}")
            data.update(source=source, time_left_s=left)
        if exited is not None:
            code = _int(exited.data, "code")
            cause = exited.data.get("cause")
            if code is not None:
                parts.append(f"the runner exited with code {code} (preempted)")
            else:  # the control plane saw the end (the provider, a lost heartbeat)
                parts.append(f"the attempt ended: {cause}" if cause else "the attempt ended")
            data["exited"] = True
        if ctx.last_committed_step is None:
            at_stake = "no checkpoint is committed yet, so the next attempt starts from step 0"
        else:
            at_stake = f"the next attempt resumes from step {ctx.last_committed_step}"
            if ctx.current_step is not None and ctx.current_step > ctx.last_committed_step:
                lost = ctx.current_step - ctx.last_committed_step
                at_stake += f" (up to {lost} steps since then are lost)"
        verb = "was" if exited is not None else "is being"
        return Signal(
            rule=self.name,
            key=f"attempt-{attempt}",
            severity=Severity.WARNING,
            title=f"Run {ctx.run_id} attempt {attempt} {verb} preempted",
            detail="; ".join(parts),
            hint=f"Nothing to do: trainbot resubmits it; {at_stake}.",
            data=data,
        )


class AutoResubmit:
    """trainbot resubmitted a preempted run; says how much work the preemption cost."""

    name = "auto_resubmit"

    def __init__(self, cfg: AlertConfig = AlertConfig()) -> None:
        self.cfg = cfg

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        signals = []
        for obs in _of_type(window, "resubmitted"):
            attempt = _attempt(obs, ctx)
            steps = _int(obs.data, "lost_steps")
            seconds = _num(obs.data, "lost_seconds")
            zone = obs.data.get("zone")
            where = f" in {zone}" if zone else ""
            lost = (
                f"{steps if steps is not None else 'unknown'} steps "
                f"({_duration(seconds) if seconds is not None else 'unknown time'})"
            )
            signals.append(
                Signal(
                    rule=self.name,
                    key=f"attempt-{attempt}",
                    severity=Severity.INFO,
                    title=f"Run {ctx.run_id} resubmitted as attempt {attempt}{where}",
                    detail=f"lost {lost} of work since the last committed checkpoint",
                    hint=(
                        "Nothing to do. If preemptions keep costing this much, checkpoint "
                        "more often."
                    ),
                    data={
                        "attempt": attempt,
                        "lost_steps": steps,
                        "lost_seconds": seconds,
                        "zone": zone,
                    },
                )
            )
        return signals


class RepeatedPreemptions:
    """Preempted again and again: the zone has no spare capacity and the run makes no progress.

    Counts ``ctx.preemption_times`` (one per preempted attempt, from the database), not
    window events, so a notice and an exit of the same attempt count once.
    """

    name = "repeated_preemptions"

    def __init__(self, cfg: AlertConfig = AlertConfig()) -> None:
        self.cfg = cfg

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        span = self.cfg.repeated_window_s
        recent = sorted(t for t in ctx.preemption_times if now - span <= t <= now)
        if len(recent) < self.cfg.repeated_preemptions:
            return []
        return [
            Signal(
                rule=self.name,
                key="repeated",
                severity=Severity.CRITICAL,
                title=(
                    f"Run {ctx.run_id} preempted {len(recent)} times in the last {_duration(span)}"
                ),
                detail=(
                    f"{len(recent)} preemptions since {_clock(recent[0])} "
                    f"(alert at {self.cfg.repeated_preemptions}); now on attempt "
                    f"{ctx.attempt_number}"
                ),
                hint=(
                    "Spot capacity here is scarce: relaunch in another zone or region, or on "
                    "on-demand capacity; every preemption also loses the work since the last "
                    "checkpoint."
                ),
                data={"count": len(recent), "attempt": ctx.attempt_number},
            )
        ]


class Budget:
    """Spend crossed a budget threshold; at a hard cap, asks the service to stop the run.

    Only the highest threshold crossed is reported, so a jump from 40% to 85% posts one
    alert, not two, and each threshold key fires once as spend rises through it.
    """

    name = "budget"

    def __init__(self, cfg: AlertConfig = AlertConfig()) -> None:
        self.cfg = cfg

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        if ctx.budget_usd is None or ctx.budget_usd <= 0:
            return []
        pct = 100.0 * ctx.spent_usd / ctx.budget_usd
        thresholds = set(ctx.thresholds_pct)
        if ctx.hard_cap:
            thresholds.add(100.0)  # a hard cap stops the run even without a 100% alert
        crossed = [t for t in thresholds if pct >= t]
        if not crossed:
            return []
        top = max(crossed)
        figures = f"${ctx.spent_usd:,.2f} of ${ctx.budget_usd:,.2f} ({pct:.0f}%)"
        stop = ctx.hard_cap and pct >= 100
        if stop:
            hint = "The budget is a hard cap: trainbot is stopping the run after a checkpoint."
        elif top >= 100:
            hint = (
                f"Stop it (`/train stop {ctx.run_id}`) or raise its budget; it keeps "
                "spending until you do."
            )
        else:
            hint = (
                f"If it will need more, raise its budget before it runs out; "
                f"`/train status {ctx.run_id}` shows the projection."
            )
        data: dict[str, Any] = {
            "spent_usd": ctx.spent_usd,
            "budget_usd": ctx.budget_usd,
            "percent": pct,
            "threshold": top,
        }
        if stop:
            data["stop"] = True
        return [
            Signal(
                rule=self.name,
                key=f"threshold-{top:g}",
                severity=Severity.CRITICAL if top >= 100 else Severity.WARNING,
                title=f"Run {ctx.run_id} has spent {pct:.0f}% of its budget",
                detail=f"spent {figures}; threshold {top:g}%",
                hint=hint,
                data=data,
            )
        ]


class LostHeartbeat:
    """The runner has gone quiet: the instance may be gone, hung, or still billing."""

    name = "lost_heartbeat"

    def __init__(self, cfg: AlertConfig = AlertConfig()) -> None:
        self.cfg = cfg

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        if ctx.last_heartbeat is None:
            return []  # not started yet; the reconcile job watches provisioning
        silent = now - ctx.last_heartbeat
        deadline = self.cfg.heartbeat_deadline_s
        data = {"silent_s": silent, "last_heartbeat": ctx.last_heartbeat}
        if silent <= deadline:
            return [
                _cleared(
                    self.name,
                    key="heartbeat",
                    severity=Severity.CRITICAL,
                    title=f"Run {ctx.run_id} is reporting again",
                    detail=f"last heartbeat {_duration(max(silent, 0.0))} ago",
                    data=data,
                )
            ]
        return [
            Signal(
                rule=self.name,
                key="heartbeat",
                severity=Severity.CRITICAL,
                title=f"No heartbeat from run {ctx.run_id} for {_duration(silent)}",
                detail=(
                    f"last heartbeat at {_clock(ctx.last_heartbeat)}, {_duration(silent)} ago "
                    f"(deadline {_duration(deadline)}); attempt {ctx.attempt_number}"
                ),
                hint=(
                    f"The instance may be gone or hung and still billing: check "
                    f"`/train logs {ctx.run_id}`, then `/train resubmit {ctx.run_id}` or "
                    f"`/train stop {ctx.run_id}`."
                ),
                data=data,
            )
        ]


def default_rules(cfg: AlertConfig) -> list[Rule]:
    """Every rule, with the run's thresholds."""
    return [
        DivergentLoss(cfg),
        LowUtilisation(cfg),
        Disk(cfg),
        Preemption(cfg),
        AutoResubmit(cfg),
        RepeatedPreemptions(cfg),
        Budget(cfg),
        LostHeartbeat(cfg),
    ]


def evaluate_all(
    rules: Sequence[Rule], window: Sequence[Obs], *, now: float, ctx: RunContext
) -> list[Signal]:
    """Every rule's signals, in rule order."""
    if not isinstance(window, TypedWindow):
        window = TypedWindow(window)
    signals: list[Signal] = []
    for rule in rules:
        signals.extend(rule.evaluate(window, now=now, ctx=ctx))
    return signals
