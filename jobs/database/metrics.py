"""A run's ``metrics`` events, read back from the blocks the ingest API stores them in.

The ingest API stores the new metrics of each batch as one
:class:`~jobs.database.models.MetricBlock` row (every other event type has a row of its own
in ``events``). Readers (the status
card's loss, the loss-curve attachment, the alert window after a restart, the goodput
benchmark's accounting) want points: :func:`run_metrics` unpacks the newest blocks of a run
into :class:`MetricPoint`\\ s, oldest first, reading only as many blocks as the points
asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, select

from jobs.database.models import Attempt, MetricBlock, table_of
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


_BLOCKS = table_of(MetricBlock)
_ATTEMPTS = table_of(Attempt)


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
    # (time, seq, attempt id, attempt number, stored payload): ordered by time, then seq.
    found: list[tuple[float, int, str, int, Any]] = []
    # A block's points are older than its last_time, not than the next block's first: a
    # resent or late batch can overlap its neighbours. So read on while a block may
    # still hold points newer than the oldest kept, and sort at the end.
    oldest_kept = float("inf")
    result = connection.execute(query)
    try:
        for row in result:
            full = limit is not None and len(found) >= limit
            if full and max(row.times, default=0.0) < oldest_kept:
                break
            found += [
                (time, seq, row.attempt_id, row.number, data)
                for seq, time, data in zip(row.seqs, row.times, row.data, strict=True)
                if since is None or time >= since
            ]
            if limit is not None and len(found) >= limit:
                found.sort(reverse=True)
                del found[limit:]
                oldest_kept = found[-1][0] if found else oldest_kept
    finally:
        result.close()
    found.sort()
    # Payloads are restored only for the points kept.
    return [
        MetricPoint(
            attempt, number, seq, time, restore_floats(data) if isinstance(data, Mapping) else {}
        )
        for time, seq, attempt, number, data in found
    ]
