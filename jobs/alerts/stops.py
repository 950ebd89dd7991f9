"""Alerts that act: the runs trainbot stops when their alert stays open (divergence, NaN)."""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Session, col, select

from jobs.alerts import display, incidents
from jobs.alerts.lifecycle import UNRESOLVED
from jobs.database.models import Alert, AlertState
from jobs.outbound.notify import Notifier


def stops_due(session: Session, *, now: datetime) -> list[Alert]:
    """Run alerts whose run trainbot should stop now: due, unresolved, not yet acted on,
    and unacknowledged unless a firing member stops at once (a NaN loss)."""
    rows = session.exec(
        select(Alert)
        .where(
            col(Alert.state).in_(UNRESOLVED),
            col(Alert.run_id).is_not(None),
            col(Alert.stop_at).is_not(None),
            col(Alert.stop_at) <= now,
            col(Alert.stopped_at).is_(None),
        )
        .order_by(col(Alert.stop_at), col(Alert.id))
        .with_for_update()
    ).all()
    return [a for a in rows if a.state is AlertState.OPEN or incidents.stops_at_once(a)]


def mark_stopped(
    session: Session,
    alert: Alert,
    *,
    now: datetime,
    resume_step: int | None,
    hint: str,
    notifier: Notifier,
) -> None:
    """Record that trainbot stopped the alert's run, and say so in the alert's message."""
    alert.stopped_at = now
    alert.stop_at = None
    alert.resume_step = resume_step
    alert.hint = hint
    session.flush()
    display.show(session, alert, notifier)
