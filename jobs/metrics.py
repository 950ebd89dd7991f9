"""A run's ``metrics`` events, read back from the blocks the ingest API stores them in.

The ingest API stores the new metrics of each batch as one :class:`~jobs.models.MetricBlock`
row (every other event type has a row of its own in ``events``). Readers (the status
card's loss, the loss-curve attachment, the alert window after a restart, the goodput
benchmark's accounting) want points: :func:`run_metrics` unpacks the newest blocks of a run
into :class:`MetricPoint`\\ s, oldest first, reading only as many blocks as the points
asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import Connection, Table, select
from sqlmodel import SQLModel

from jobs.models import Attempt, MetricBlock
from runner.wire import restore_floats

__all__ = ["MetricPoint", "run_metrics"]


@dataclass(frozen=True, slots=True)
class MetricPoint:
    """One ``metrics`` event: its attempt (id and number), seq, unix time and payload."""

    attempt_id: str
    attempt_number: int
    seq: int
    time: float
    data: dict[str, Any]


def _table(model: type[SQLModel]) -> Table:
    return cast(Table, model.__table__)  # type: ignore[attr-defined]


_BLOCKS = _table(MetricBlock)
_ATTEMPTS = _table(Attempt)


def run_metrics(
    connection: Connection,
    run_id: str,
    *,
    limit: int | None = None,
    since: float | None = None,
    attempt_id: str | None = None,
) -> list[MetricPoint]:
    """The run's metrics points, oldest first (by time, then seq).

    ``limit`` keeps the newest that many; ``since`` (unix seconds) drops older points;
    ``attempt_id`` keeps one attempt's. Blocks are read newest first and only until the
    limit is reached, so the cost follows the points asked for, not the run's length.
    """
    blocks = _BLOCKS.c
    attempts = _ATTEMPTS.c
    query = (
        select(blocks.attempt_id, attempts.number, blocks.seqs, blocks.times, blocks.data)
        .join_from(_BLOCKS, _ATTEMPTS, attempts.id == blocks.attempt_id)
        .where(blocks.run_id == run_id)
        .order_by(blocks.last_time.desc(), blocks.id.desc())
    )
    if since is not None:
        query = query.where(blocks.last_time >= datetime.fromtimestamp(since, timezone.utc))
    if attempt_id is not None:
        query = query.where(blocks.attempt_id == attempt_id)
    points: list[MetricPoint] = []
    # A block's points are older than its last_time, not than the next block's first: a
    # resent or late batch can overlap its neighbours. So read on while a block may
    # still hold points newer than the oldest kept, and sort at the end.
    oldest_kept = float("inf")
    result = connection.execute(query)
    try:
        for row in result:
            full = limit is not None and len(points) >= limit
            if full and max(row.times, default=0.0) < oldest_kept:
                break
            for seq, time, data in zip(row.seqs, row.times, row.data, strict=True):
                if since is not None and time < since:
                    continue
                payload = restore_floats(data) if isinstance(data, Mapping) else {}
                points.append(MetricPoint(row.attempt_id, row.number, seq, time, payload))
            if limit is not None and len(points) >= limit:
                points.sort(key=_newest_first)
                del points[limit:]
                oldest_kept = points[-1].time if points else oldest_kept
    finally:
        result.close()
    points.sort(key=_oldest_first)
    return points


def _newest_first(point: MetricPoint) -> tuple[float, int]:
    return (-point.time, -point.seq)


def _oldest_first(point: MetricPoint) -> tuple[float, int]:
    return (point.time, point.seq)
