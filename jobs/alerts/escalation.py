"""Paging people, level by level, for critical alerts nobody has acknowledged in time."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import and_, or_
from sqlmodel import Session, col, select

from jobs.alerts import display
from jobs.database.models import Alert, AlertState
from jobs.domain.severity import Severity
from jobs.outbound.notify import Journal, Notifier


def escalate_due(
    session: Session,
    *,
    now: datetime,
    delay_s: float,
    notifier: Notifier,
    journal: Journal,
    oncall_group: Callable[[Alert], str | None],
    next_level: Callable[[Alert], str | None] | None = None,
    repeat_s: float | None = None,
    max_repeats: int = 0,
) -> list[Alert]:
    """Page people, level by level, for critical alerts nobody has acknowledged in time.

    The first page goes to the on-call group ``delay_s`` after ``first_seen``, so an
    alert that was a warning for hours and turns critical escalates on the next call:
    nobody picked it up in all that time. Each later page comes ``repeat_s`` after the
    one before (none when ``repeat_s`` is None): the next level (``next_level``, the
    admins say) and then the last level again, ``max_repeats`` times at most, because a
    page nobody answers in an hour will not be answered by the tenth. An acknowledgement,
    a snooze or the resolution stops it. A level with nobody to page is skipped; an
    alert with nobody at all is left alone and looked at again next time.
    """
    first_due = and_(
        col(Alert.escalated_at).is_(None),
        col(Alert.first_seen) <= now - timedelta(seconds=delay_s),
    )
    due_clause = first_due
    if repeat_s is not None:
        # Pages at most: two levels, then the repeats (the exact count is per alert).
        due_clause = or_(
            first_due,
            and_(
                col(Alert.escalated_at) <= now - timedelta(seconds=repeat_s),
                col(Alert.escalation_level) < _MAX_LEVELS + max_repeats,
            ),
        )
    due = session.exec(
        select(Alert)
        .where(
            Alert.state == AlertState.OPEN,
            Alert.severity == Severity.CRITICAL,
            due_clause,
            or_(col(Alert.snoozed_until).is_(None), col(Alert.snoozed_until) <= now),
        )
        .order_by(col(Alert.first_seen), col(Alert.id))
        .with_for_update()
    ).all()
    escalated: list[Alert] = []
    for alert in due:
        levels = _levels(alert, oncall_group, next_level)
        page = alert.escalation_level  # pages sent so far: this is page number page + 1
        if not levels or (page > 0 and page >= len(levels) + max_repeats):
            continue
        level = min(page, len(levels) - 1)
        channel, thread_ts = display.where(session, alert)
        if channel is None:
            continue
        if thread_ts is None:
            # No run thread (a team alert): reply under the alert's own message.
            thread_ts = alert.message_ts
        group = levels[level]
        notifier.post(
            display.alert_message(alert, channel=channel, thread_ts=thread_ts, escalate_to=group)
        )
        alert.escalated_at = now
        alert.escalation_level = page + 1
        later = {"level": level + 1, "page": page + 1} if page > 0 else {}
        journal.record("alert_escalated", alert.run_id, alert_id=alert.id, group=group, **later)
        escalated.append(alert)
    session.flush()
    return escalated


#: Escalation levels at most: the on-call, then the next level.
_MAX_LEVELS = 2


def _levels(
    alert: Alert,
    oncall_group: Callable[[Alert], str | None],
    next_level: Callable[[Alert], str | None] | None,
) -> list[str]:
    """Whom the alert's pages go to, level by level: nobody twice, nobody empty."""
    levels: list[str] = []
    for who in (oncall_group(alert), next_level(alert) if next_level is not None else None):
        if who and who.strip() and who.strip() not in levels:
            levels.append(who.strip())
    return levels
