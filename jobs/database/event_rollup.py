"""Bound what an ended run keeps of its event stream, once its retention has passed.

A runner sends metrics several times a second, utilisation and disk every few seconds,
and its log lines; a run of a week leaves millions of points. After a run ends, what is
still read is small: the lifecycle events (the summary's and the digest's badput, the
checkpoint interval, ``/train status``), the metrics that draw its chart, and the
step-time-weighted data-wait fraction the badput figures take from those metrics. So
:data:`KEEP_AFTER_END` after the run ended:

- events of other types (``system``, ``log``, ``heartbeat``, ``stacks``…) are deleted;
- each attempt's metric points are thinned to at most :data:`POINTS_PER_ATTEMPT` (plus
  one per UTC day it ran), in one block: every kept point stands for a run of
  consecutive points within one UTC day, carrying the last
  one's payload (its step and loss draw the chart), the run's mean ``step_time_s``,
  its step-time-weighted ``data_wait_fraction`` and ``rolled_points``, its length, so
  the badput sums (Σ step time, Σ step time × wait) over the run are what they were.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func
from sqlmodel import Session, col, select

from jobs.database.models import EventRow, MetricBlock, Run, table_of
from jobs.ingest.writers import event_datetime

_EVENTS = table_of(EventRow)

#: How long after its end a run keeps its whole event stream.
KEEP_AFTER_END = timedelta(days=30)
#: Event types kept for good: what the summary, the digest and ``/train status`` read.
KEPT_TYPES = frozenset(
    {
        "started",
        "restored",
        "checkpoint_committed",
        "preemption_notice",
        "preempted",
        "exit",
        "dry_run",
    }
)
#: The most metric points an attempt keeps once thinned: enough for its chart.
POINTS_PER_ATTEMPT = 1000
#: The payload field that says how many points a kept one stands for (absent: one).
ROLLED = "rolled_points"


@dataclass(frozen=True)
class PruneResult:
    """What one pass removed."""

    events: int
    points: int


def prune_ended_runs(
    session: Session, *, now: datetime, keep: timedelta = KEEP_AFTER_END
) -> PruneResult:
    """Prune the event streams of the runs that ended ``keep`` ago, in the caller's
    transaction. Running it again changes nothing."""
    ended = select(Run.id).where(col(Run.ended_at).is_not(None), col(Run.ended_at) < now - keep)
    # On the session's connection: a Core result, which has the rowcount.
    gone = (
        session.connection()
        .execute(
            delete(_EVENTS).where(_EVENTS.c.run_id.in_(ended), _EVENTS.c.type.not_in(KEPT_TYPES))
        )
        .rowcount
    )
    dense = session.exec(
        select(MetricBlock.attempt_id)
        .where(col(MetricBlock.run_id).in_(ended))
        .group_by(col(MetricBlock.attempt_id))
        # One block is what a pass leaves (or one batch's worth): nothing to thin.
        .having(func.count() > 1)
    ).all()
    thinned = sum(_thin(session, attempt_id) for attempt_id in dense)
    return PruneResult(events=gone, points=thinned)


def _thin(session: Session, attempt_id: str) -> int:
    """Replace an attempt's blocks with one of at most :data:`POINTS_PER_ATTEMPT`
    points; how many points went."""
    blocks = session.exec(
        select(MetricBlock)
        .where(MetricBlock.attempt_id == attempt_id)
        .order_by(col(MetricBlock.first_seq))
    ).all()
    seqs = [s for b in blocks for s in b.seqs]
    times = [t for b in blocks for t in b.times]
    data = [d for b in blocks for d in b.data]
    size = max(1, math.ceil(len(seqs) / POINTS_PER_ATTEMPT))
    kept: list[int] = []
    payloads: list[dict[str, Any]] = []
    start = 0
    for i in range(1, len(seqs) + 1):
        # A run of points ends at its size or at a UTC midnight, so that a day's
        # figures (the digest's badput) are the same after thinning.
        if i < len(seqs) and i - start < size and _day(times[i]) == _day(times[start]):
            continue
        kept.append(i - 1)
        payloads.append(_rolled(data[start:i]))
        start = i
    first = blocks[0]
    session.execute(delete(MetricBlock).where(col(MetricBlock.id).in_([b.id for b in blocks])))
    session.flush()
    session.add(
        MetricBlock(
            attempt_id=attempt_id,
            run_id=first.run_id,
            first_seq=seqs[kept[0]],
            last_seq=seqs[kept[-1]],
            count=len(kept),
            first_time=event_datetime(times[kept[0]]),
            last_time=event_datetime(times[kept[-1]]),
            seqs=[seqs[i] for i in kept],
            times=[times[i] for i in kept],
            data=payloads,
            received_at=first.received_at,
        )
    )
    return len(seqs) - len(kept)


def _day(seconds: float) -> int:
    return int(seconds // 86400)


def weight(data: dict[str, Any]) -> int:
    """How many of the runner's points a stored one stands for."""
    value = data.get(ROLLED, 1)
    return value if isinstance(value, int) and value > 0 else 1


def _rolled(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One point for consecutive ones: the last's payload, with the step times' mean
    and their weighted data-wait fraction, and how many it stands for."""
    out = dict(points[-1])
    count = sum(weight(p) for p in points)
    timed = [
        (float(p["step_time_s"]) * weight(p), float(p["data_wait_fraction"]))
        for p in points
        if _finite(p.get("step_time_s")) and _finite(p.get("data_wait_fraction"))
    ]
    stepped = math.fsum(t for t, _ in timed)
    if timed and stepped > 0:
        out["step_time_s"] = stepped / count
        out["data_wait_fraction"] = math.fsum(t * w for t, w in timed) / stepped
    out[ROLLED] = count
    return out


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
