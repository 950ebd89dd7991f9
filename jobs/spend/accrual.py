"""Spend records and the totals over them.

Each record is one attempt's paid time over one accrual interval; records tile the
attempt's paid time, and sums over a window prorate the records that straddle it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, or_
from sqlmodel import Session, col, select

from jobs.database.models import Attempt, DryRunInstance, KeptInstance, Run, SpendRecord


def accrue(session: Session, *, now: datetime) -> list[SpendRecord]:
    """Add the spend of every priced attempt since its last record, up to ``now``.

    An attempt is paid from ``started_at`` until ``ended_at`` (or ``now`` while it
    runs). Calling again at the same ``now`` adds nothing; an ended attempt is closed
    out exactly at ``ended_at`` and never accrues again.
    """
    last_end = (
        select(SpendRecord.attempt_id, func.max(SpendRecord.period_end).label("last_end"))
        .group_by(col(SpendRecord.attempt_id))
        .subquery()
    )
    rows = session.exec(
        select(Attempt, last_end.c.last_end)
        .outerjoin(last_end, last_end.c.attempt_id == Attempt.id)
        .where(
            col(Attempt.price_per_hour).is_not(None),
            col(Attempt.started_at).is_not(None),
            or_(
                col(Attempt.ended_at).is_(None),
                last_end.c.last_end.is_(None),
                last_end.c.last_end < Attempt.ended_at,
            ),
        )
        .order_by(col(Attempt.id))
    ).all()
    added: list[SpendRecord] = []
    for attempt, accrued_until in rows:
        assert attempt.started_at is not None and attempt.price_per_hour is not None
        start = _utc(accrued_until) if accrued_until is not None else attempt.started_at
        end = min(now, attempt.ended_at) if attempt.ended_at is not None else now
        added += _paid(session, attempt, start, end, price_per_hour=attempt.price_per_hour)
    session.flush()
    added += _accrue_kept(session, last_end, now=now)
    return added


def _accrue_kept(session: Session, last_end: Any, *, now: datetime) -> list[SpendRecord]:
    """The kept instances' time (:mod:`jobs.runs.kept`) as spend records of their failed
    attempt, from ``kept_at`` until they end. After the attempts' own: an attempt is
    closed out at its end first, so its records and the kept ones never overlap.
    ``last_end``: the subquery of each attempt's last record's end."""
    rows = session.exec(
        select(KeptInstance, last_end.c.last_end)
        .outerjoin(last_end, last_end.c.attempt_id == KeptInstance.attempt_id)
        .where(
            col(KeptInstance.price_per_hour).is_not(None),
            or_(
                col(KeptInstance.ended_at).is_(None),
                last_end.c.last_end.is_(None),
                last_end.c.last_end < KeptInstance.ended_at,
            ),
        )
        .order_by(col(KeptInstance.attempt_id))
    ).all()
    added: list[SpendRecord] = []
    for row, accrued_until in rows:
        assert row.price_per_hour is not None
        start = row.kept_at if accrued_until is None else max(row.kept_at, _utc(accrued_until))
        end = min(now, row.ended_at) if row.ended_at is not None else now
        added += _paid(session, row, start, end, price_per_hour=row.price_per_hour)
    session.flush()
    return added


def _paid(
    session: Session,
    paid: Attempt | KeptInstance,
    start: datetime,
    end: datetime,
    *,
    price_per_hour: float,
) -> list[SpendRecord]:
    """The record of what an attempt (or its kept instance) cost from ``start`` to
    ``end``, added to the session; none when that is no time."""
    if end <= start:
        return []
    hours = (end - start).total_seconds() / 3600.0
    attempt_id = paid.id if isinstance(paid, Attempt) else paid.attempt_id
    record = SpendRecord(
        attempt_id=attempt_id,
        run_id=paid.run_id,
        period_start=start,
        period_end=end,
        usd=price_per_hour * hours * paid.instances,
        instances=paid.instances,
        price_per_hour=price_per_hour,
    )
    session.add(record)
    return [record]


def _utc(value: datetime) -> datetime:
    # An aggregate bypasses the column type: SQLite hands back naive UTC (or text).
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


# --- totals ---------------------------------------------------------------------------


def run_spent(session: Session, run_id: str) -> float:
    """What the run's budget counts, in USD: everything it accrued, all attempts, plus
    the spend it carries from the runs it resubmits (``Run.carried_usd``), so a
    resubmit cannot start a capped budget again from zero."""
    total = session.exec(
        select(func.coalesce(func.sum(SpendRecord.usd), 0.0)).where(SpendRecord.run_id == run_id)
    ).one()
    carried = session.exec(select(Run.carried_usd).where(Run.id == run_id)).first()
    return float(total) + float(carried or 0.0) + dry_run_spent(session, run_id)


def dry_run_spent(session: Session, run_id: str) -> float:
    """What the run's ended cloud dry runs cost (each priced when its instance ended:
    ``DryRunInstance.cost_usd``); it counts against the run's budget like an attempt's."""
    total = session.exec(
        select(func.coalesce(func.sum(DryRunInstance.cost_usd), 0.0)).where(
            DryRunInstance.run_id == run_id, col(DryRunInstance.cost_usd).is_not(None)
        )
    ).one()
    return float(total or 0.0)


def team_spent(session: Session, *, channel: str | None, since: datetime, until: datetime) -> float:
    """What the channel's runs (every run when ``channel`` is None) cost in ``[since, until)``."""
    return sum(
        piece.usd for piece in window_pieces(session, channel=channel, since=since, until=until)
    )


@dataclass(frozen=True)
class Piece:
    """The part of one spend record inside a window."""

    run_id: str
    usd: float
    #: Paid instance-seconds.
    seconds: float
    start: datetime
    end: datetime
    #: A preflight dry run's instance, not an attempt's.
    dry_run: bool = False
    #: A failed attempt's instance kept for a person to look at (debug.keep_failed_instance).
    kept: bool = False


def window_pieces(
    session: Session, *, channel: str | None, since: datetime, until: datetime
) -> list[Piece]:
    """The records that overlap ``[since, until)``, each cut to its part inside."""
    query = (
        select(SpendRecord)
        .where(col(SpendRecord.period_end) > since, col(SpendRecord.period_start) < until)
        .order_by(col(SpendRecord.period_start), col(SpendRecord.id))
    )
    if channel is not None:
        query = query.join(Run, col(Run.id) == SpendRecord.run_id).where(Run.channel == channel)
    pieces = _dry_run_pieces(session, channel=channel, since=since, until=until)
    records = session.exec(query).all()
    kept_since = _kept_since(session, {r.attempt_id for r in records})
    for record in records:
        start = max(record.period_start, since)
        end = min(record.period_end, until)
        length = (record.period_end - record.period_start).total_seconds()
        inside = (end - start).total_seconds()
        if inside <= 0 or length <= 0:
            continue
        pieces.append(
            Piece(
                run_id=record.run_id,
                usd=record.usd * inside / length,
                seconds=inside * record.instances,
                start=start,
                end=end,
                kept=record.attempt_id in kept_since
                and record.period_start >= kept_since[record.attempt_id],
            )
        )
    return pieces


def _kept_since(session: Session, attempt_ids: set[str]) -> dict[str, datetime]:
    """Of these attempts, those whose instance was kept after they failed, and since when:
    their records from then on are the kept instance's."""
    if not attempt_ids:
        return {}
    rows = session.exec(
        select(KeptInstance.attempt_id, KeptInstance.kept_at).where(
            col(KeptInstance.attempt_id).in_(sorted(attempt_ids))
        )
    ).all()
    return {attempt_id: kept_at for attempt_id, kept_at in rows}


def _dry_run_pieces(
    session: Session, *, channel: str | None, since: datetime, until: datetime
) -> list[Piece]:
    """The ended cloud dry runs that overlap ``[since, until)``, each cut to its part
    inside: paid from launch (or the row, when the launch never answered) to the end of
    the terminate, as :func:`jobs.preflight.end_dry_run` priced it."""
    query = select(DryRunInstance).where(
        col(DryRunInstance.ended_at).is_not(None),
        col(DryRunInstance.cost_usd).is_not(None),
        col(DryRunInstance.ended_at) > since,
        func.coalesce(DryRunInstance.launched_at, DryRunInstance.created_at) < until,
    )
    if channel is not None:
        query = query.join(Run, col(Run.id) == DryRunInstance.run_id).where(Run.channel == channel)
    pieces = []
    for row in session.exec(query.order_by(col(DryRunInstance.created_at))).all():
        assert row.ended_at is not None and row.cost_usd is not None
        began = _utc(row.launched_at or row.created_at)
        ended = _utc(row.ended_at)
        start, end = max(began, since), min(ended, until)
        length = (ended - began).total_seconds()
        inside = (end - start).total_seconds()
        if inside <= 0:
            continue
        share = inside / length if length > 0 else 1.0
        pieces.append(
            Piece(
                run_id=row.run_id,
                usd=row.cost_usd * share,
                seconds=inside,
                start=start,
                end=end,
                dry_run=True,
            )
        )
    return pieces
