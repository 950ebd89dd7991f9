"""The alert rules' window per run: recent observations in memory, thinned over an hour.

The service evaluates a run's rules once per batch over this window; it is rebuilt from
the events table after a restart or after :meth:`Windows.forget`. Why it is shaped as it
is: ``docs/architecture.md``, section "Ingest".
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, select
from sqlmodel import Session

from jobs.database.metrics import run_metrics
from jobs.database.models import Attempt, EventRow, Run, table_of
from jobs.ingest.writers import event_datetime
from jobs.rules import (
    Obs,
    Rule,
    RunContext,
    Signal,
    Trigger,
    TypedWindow,
    evaluate_all,
    rules_on,
)
from jobs.spec import AlertThresholds, stored_section
from runner.wire import restore_floats

if TYPE_CHECKING:
    from jobs.ingest.effects import Applied

#: Event types the alert rules look at.
WINDOW_EVENTS = frozenset(
    {"metrics", "system", "preemption_notice", "exit", "checkpoint_committed"}
)
#: The rules' window per run (see :class:`_Series`): the last hour; per event type, the
#: newest RECENT_OBS observations in full and older ones thinned to one per BUCKET_S,
#: so at most 5 × (200 + 240) = 2,200 observations in all.
WINDOW_SPAN_S = 3600.0
RECENT_OBS = 200
BUCKET_S = 15.0
WINDOW_MAX_OBS = len(WINDOW_EVENTS) * (RECENT_OBS + int(WINDOW_SPAN_S // BUCKET_S))
#: After a restart a window is rebuilt from the newest this-many events of each type
#: (within the hour) in the events table.
REBUILD_OBS = 1000
#: Runs whose window is kept in memory; the least recently reporting one is dropped first
#: (and rebuilt from the events table if it reports again).
MAX_WINDOWS = 256

#: One observation before it becomes an Obs: (unix time, event data).
Point = tuple[float, Mapping[str, Any]]

_ATTEMPTS = table_of(Attempt)
_EVENTS = table_of(EventRow)


class _Series:
    """One event type's observations: every recent one, then a thinned hour behind them.

    Runners report metrics many times a second, and the rules re-read the whole window
    on every batch, so a window of every event would cost the rules time per event that
    grows with the window, and a flood of metrics would push the few system samples
    (the GPU-utilisation rule needs five minutes of them) out of a shared bound. So each
    type keeps its newest ``RECENT_OBS`` observations in full (spikes and trends need
    consecutive points), and older ones thinned to one per ``BUCKET_S`` seconds
    (baselines, means and time coverage survive thinning). A non-finite loss always
    wins its bucket, so a NaN is never thinned away.

    Points arrive as ``(time, data)``; an :class:`Obs` is made only for the points the
    window keeps, since a batch of 500 metrics keeps 200 in full and thins the rest.
    """

    __slots__ = ("history", "kind", "last_bucket", "recent")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.recent: deque[Obs] = deque()
        self.history: deque[Obs] = deque()
        self.last_bucket = -1.0

    def extend(self, points: Sequence[Point]) -> None:
        """Add points, oldest first; those pushed out of the recent part are thinned."""
        recent = self.recent
        overflow = len(recent) + len(points) - RECENT_OBS
        if overflow > 0:
            from_recent = min(overflow, len(recent))
            if from_recent == len(recent):  # a big batch pushes all of them out
                leaving = list(recent)
                recent.clear()
            else:
                leaving = [recent.popleft() for _ in range(from_recent)]
            self._retire(leaving, made=True)
            retired = overflow - from_recent
            if retired > 0:
                self._retire(points[:retired], made=False)
                points = points[retired:]
        kind = self.kind
        recent.extend([Obs(time, kind, data) for time, data in points])

    def _retire(self, items: Sequence[Obs] | Sequence[Point], *, made: bool) -> None:
        """Move observations (``made``) or points, oldest first, into the thinned
        history: one per bucket, the first of each unless a later one has a non-finite
        loss and the first has not. This runs for nearly every event, so it makes an Obs
        only for a point it keeps, and keeps an observation as it is.
        """
        # An Obs is (time, type, data) and a point (time, data): time first, data last.
        history = self.history
        last_bucket = self.last_bucket
        isfinite = math.isfinite
        kind = self.kind
        for item in items:
            time, data = item[0], item[-1]
            bucket = time // BUCKET_S
            if history and bucket == last_bucket:
                loss = data.get("loss")
                if (
                    isinstance(loss, float)
                    and not isfinite(loss)
                    and not _non_finite_loss(history[-1].data)
                ):
                    history[-1] = item if made else Obs(time, kind, data)  # type: ignore[assignment]
                continue
            history.append(item if made else Obs(time, kind, data))  # type: ignore[arg-type]
            last_bucket = bucket
        self.last_bucket = last_bucket

    def trim(self, horizon: float) -> None:
        for part in (self.history, self.recent):
            while part and part[0].time < horizon:
                part.popleft()

    def __len__(self) -> int:
        return len(self.history) + len(self.recent)


def _non_finite_loss(data: Mapping[str, Any]) -> bool:
    loss = data.get("loss")
    return isinstance(loss, float) and not math.isfinite(loss)


class _Window:
    """One run's rules and recent observations, per event type; used under its lock."""

    def __init__(self, rules: Sequence[Rule]):
        self.lock = threading.Lock()
        self.rules = list(rules)
        self.series: dict[str, _Series] = {kind: _Series(kind) for kind in sorted(WINDOW_EVENTS)}
        self.newest = 0.0

    def extend(self, observations: Mapping[str, Sequence[Point]]) -> None:
        """Add each type's new points (oldest first), then drop what is over an hour old."""
        series = self.series
        added = False
        for kind, points in observations.items():
            if points:
                series[kind].extend(points)
                self.newest = max(self.newest, max(map(itemgetter(0), points)))
                added = True
        if added:
            horizon = self.newest - WINDOW_SPAN_S
            for part in series.values():
                part.trim(horizon)

    def observations(self) -> TypedWindow:
        """What the rules see: every series, already grouped by type."""
        return TypedWindow.from_groups(
            {kind: chain(part.history, part.recent) for kind, part in self.series.items()}
        )


def script_signals(applied: Applied, *, now: datetime) -> list[Signal]:
    """The batch's new ``alert`` events (``session.alert``), each seen once, through the
    rules of :attr:`Trigger.SCRIPT`: they need no window and no thresholds."""
    window = [Obs(time, "alert", data) for time, data in applied.script_alerts]
    rules = rules_on(Trigger.SCRIPT, AlertThresholds())
    return evaluate_all(rules, window, now=now.timestamp(), ctx=_context(applied, now=now))


def _context(applied: Applied, *, now: datetime) -> RunContext:
    """The run's facts as a committed batch left them; it was heard from just now."""
    return RunContext(
        run_id=applied.run_id,
        last_heartbeat=now.timestamp(),
        preemption_times=applied.preemption_times,
        attempt_number=applied.attempt_number,
        last_committed_step=applied.last_committed_step,
        current_step=applied.last_step,
    )


class Windows:
    """Every reporting run's window and rules, the least recently reporting dropped first.

    Thread-safe. ``rules_for(run)`` picks a run's alert rules (default: the rules on the
    stream, :func:`jobs.rules.rules_on`, with the thresholds of the run's spec); it is
    called when the run's window is built.
    """

    def __init__(
        self, engine: Engine, *, rules_for: Callable[[Run], Sequence[Rule]] | None = None
    ) -> None:
        self._engine = engine
        self._rules_for = rules_for
        self._windows: OrderedDict[str, _Window] = OrderedDict()
        self._lock = threading.Lock()

    def forget(self, run_id: str) -> None:
        """Drop a run's window and rules; rebuilt on demand."""
        with self._lock:
            self._windows.pop(run_id, None)

    def evaluate(self, applied: Applied, *, now: datetime) -> list[Signal]:
        """Add a committed batch's observations to its run's window and run the rules."""
        run_id = applied.run_id
        window, fresh = self._window(run_id, applied)
        if window is None:
            return []
        with window.lock:
            if not fresh:
                window.extend(applied.observations)
            ctx = _context(applied, now=now)
            return evaluate_all(window.rules, window.observations(), now=now.timestamp(), ctx=ctx)

    def _window(self, run_id: str, applied: Applied) -> tuple[_Window | None, bool]:
        """The run's window, building it from the events table when it is not in memory.

        ``fresh`` is True when it was just read from the table, which already holds this
        batch's events (they were committed), so they must not be appended again.
        """
        with self._lock:
            window = self._windows.get(run_id)
            if window is not None:
                self._windows.move_to_end(run_id)
                return window, False
        window = self._load(run_id, since=applied.max_time - WINDOW_SPAN_S)
        if window is None:
            return None, False
        with self._lock:
            existing = self._windows.get(run_id)
            if existing is not None:  # another thread built it meanwhile
                return existing, False
            self._windows[run_id] = window
            while len(self._windows) > MAX_WINDOWS:
                self._windows.popitem(last=False)
        return window, True

    def _load(self, run_id: str, *, since: float) -> _Window | None:
        events = _EVENTS.c
        attempts = _ATTEMPTS.c
        with Session(self._engine) as session:
            run = session.get(Run, run_id)
            if run is None:
                return None
            if self._rules_for is not None:
                rules: Sequence[Rule] = self._rules_for(run)
            else:
                # The rules that watch the runner's stream; the others are evaluated where
                # their trigger happens (an attempt's end, a resubmit, the reconcile job).
                thresholds = stored_section(run.spec, AlertThresholds, run_id=run.id)
                rules = rules_on(Trigger.STREAM, thresholds)
            window = _Window(rules)
            connection = session.connection()
            since = max(since, 0.0)
            metrics = run_metrics(connection, run_id, limit=REBUILD_OBS, since=since)
            window.extend({"metrics": [(p.time, p.data) for p in metrics]})
            for kind in sorted(WINDOW_EVENTS - {"metrics"}):
                rows = connection.execute(
                    select(events.time, events.data, attempts.number)
                    .join_from(_EVENTS, _ATTEMPTS, attempts.id == events.attempt_id)
                    .where(
                        events.run_id == run_id,
                        events.type == kind,
                        events.time >= event_datetime(since),
                    )
                    .order_by(events.time.desc(), events.id.desc())
                    .limit(REBUILD_OBS)
                ).all()
                points: list[Point] = []
                for row in reversed(rows):
                    data = restore_floats(row.data) if isinstance(row.data, Mapping) else {}
                    if kind != "system":
                        data = {**data, "attempt": row.number}
                    points.append((row.time.timestamp(), data))
                window.extend({kind: points})
        return window
