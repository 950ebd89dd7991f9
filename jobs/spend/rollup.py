"""Roll old spend records up: per attempt per hour after a day, per day after a month.

Accrual writes one record per attempt per minute (:func:`jobs.spend.accrual.accrue`),
and every budget check, digest and ``/metrics`` scrape sums them again, so a team's
history would grow by 1,440 rows a day per instance and each scrape would grow with it.
A roll-up replaces the records of one attempt that lie wholly inside one bucket (an
hour, or a UTC day) with a single record spanning them, with their summed dollars. What
every reader computes stays the same:

- sums (a run's spend, a channel's, the Prometheus counters) add the same dollars;
- a window that starts and ends on bucket boundaries (the digest's days and months,
  :func:`jobs.spend.accrual.window_pieces`) cuts no roll-up, because a record that
  straddles a boundary is left as it is;
- paid instance-seconds (``usd / price × 3600``) stay exact because only records of
  one price and one instance count are merged, and only contiguous ones;
- accrual resumes from an attempt's last ``period_end``, which a roll-up keeps;
- a kept instance's records (:mod:`jobs.runs.kept`) never merge with the attempt's own.

The bound: past a day, an attempt has at most two records per hour (the roll-up and one
straddling the next hour), and past a month two per day (:data:`ROWS_PER_BUCKET`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Row, delete, insert
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from jobs.database.models import KeptInstance, SpendRecord, table_of

#: Records whose period ended this long ago are rolled up per hour.
HOURLY_AFTER = timedelta(days=1)
#: Records whose period ended this long ago are rolled up per UTC day.
DAILY_AFTER = timedelta(days=30)
#: After a roll-up, the most records one attempt keeps per bucket: the roll-up and the
#: one record that straddles the bucket's end.
ROWS_PER_BUCKET = 2


#: Ids per DELETE statement (well under SQLite's and PostgreSQL's parameter limits).
_CHUNK = 5000
_SPEND = table_of(SpendRecord)


@dataclass(frozen=True)
class RollupResult:
    """What one pass did."""

    #: Records read and replaced.
    merged: int
    #: Records written in their place.
    written: int


def roll_up_spend(session: Session, *, now: datetime) -> RollupResult:
    """Roll up the records old enough (:data:`HOURLY_AFTER`, :data:`DAILY_AFTER`), in
    the caller's transaction. Running it again at the same ``now`` changes nothing.

    The daily pass runs first, over everything older than a month; the hourly pass then
    reads only the month after it, so a pass reads what the bound leaves, not history.
    """
    kept_at = {
        attempt_id: _utc(at)
        for attempt_id, at in session.exec(
            select(KeptInstance.attempt_id, KeptInstance.kept_at)
        ).all()
    }
    merged = written = 0
    for since, until, size in (
        (None, now - DAILY_AFTER, timedelta(days=1)),
        (now - DAILY_AFTER, now - HOURLY_AFTER, timedelta(hours=1)),
    ):
        # Plain rows, not ORM objects: a first pass over a long history reads hundreds
        # of thousands, and the session's identity map would make each delete slow.
        c = _SPEND.c
        query = sa_select(_SPEND).where(c.period_end <= until)
        if since is not None:
            query = query.where(c.period_end > since)
        records = session.execute(query.order_by(c.attempt_id, c.period_start)).all()
        gone: list[int] = []
        rolled: list[dict[str, object]] = []
        for group in _groups(records, size=size, kept_at=kept_at):
            if len(group) < 2:
                continue
            first, last = group[0], group[-1]
            gone += [r.id for r in group]
            rolled.append(
                {
                    "attempt_id": first.attempt_id,
                    "run_id": first.run_id,
                    "period_start": first.period_start,
                    "period_end": last.period_end,
                    "usd": math.fsum(r.usd for r in group),
                    "instances": first.instances,
                    "price_per_hour": first.price_per_hour,
                }
            )
        for chunk in range(0, len(gone), _CHUNK):
            ids = gone[chunk : chunk + _CHUNK]
            session.execute(
                delete(SpendRecord).where(col(SpendRecord.id).in_(ids)),
                execution_options={"synchronize_session": False},
            )
        if rolled:
            session.execute(insert(SpendRecord), rolled)
        merged += len(gone)
        written += len(rolled)
    return RollupResult(merged=merged, written=written)


def _floor(at: datetime, size: timedelta) -> datetime:
    """The start of the bucket of ``size`` (an hour, a day) holding ``at``, in UTC."""
    seconds = size.total_seconds()
    return datetime.fromtimestamp(at.timestamp() // seconds * seconds, timezone.utc)


def _groups(
    records: Sequence[Row[Any]], *, size: timedelta, kept_at: dict[str, datetime]
) -> Iterator[list[Row[Any]]]:
    """Runs of contiguous records of one attempt, price and instance count, wholly
    inside one bucket and on one side of the attempt's kept-instance moment."""
    group: list[Row[Any]] = []
    key: tuple[object, ...] | None = None
    for record in records:
        start, end = _utc(record.period_start), _utc(record.period_end)
        home = _floor(start, size)
        inside = end <= home + size
        kept = record.attempt_id in kept_at and start >= kept_at[record.attempt_id]
        this = (record.attempt_id, home, record.price_per_hour, record.instances, kept)
        contiguous = bool(group) and _utc(group[-1].period_end) == start
        if inside and this == key and contiguous:
            group.append(record)
            continue
        if group:
            yield group
        group, key = ([record], this) if inside else ([], None)
    if group:
        yield group


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)
