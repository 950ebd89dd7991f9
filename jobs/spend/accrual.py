"""Spend records and the totals over them.

Each record is one attempt's paid time over one accrual interval; records tile the
attempt's paid time, and sums over a window prorate the records that straddle it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import func, or_
from sqlmodel import Session, col, select

from jobs.models import Attempt, DryRunInstance, Run, SpendRecord


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
        if end <= start:
            continue
        hours = (end - start).total_seconds() / 3600.0
        record = SpendRecord(
            attempt_id=attempt.id,
            run_id=attempt.run_id,
            period_start=start,
            period_end=end,
            usd=attempt.price_per_hour * hours * attempt.instances,
            instances=attempt.instances,
            price_per_hour=attempt.price_per_hour,
        )
        session.add(record)
        added.append(record)
    session.flush()
    return added


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
    for record in session.exec(query).all():
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
            )
        )
    return pieces


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
