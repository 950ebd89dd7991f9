"""The alert lifecycle, after PagerDuty: ``OPEN → ACKED → RESOLVED``.

Rules (:mod:`jobs.rules`) say what is wrong on every evaluation; this module turns that
stream of :class:`~jobs.rules.Signal` objects into a few alerts people can act on:

- One unresolved alert per ``(run, rule, key)``. The database enforces it
  (``Alert.dedupe_key`` is UNIQUE while the alert is unresolved and NULL after), so two
  replicas racing to open the same alert end with one row: the loser's insert fails
  inside a savepoint, it re-reads the winner's row and counts a repeat.
- A repeat never posts again: it bumps ``count``/``last_seen`` and updates the existing
  message in place. A severity increase (warning → critical) is shown the same way.
- An acknowledged alert stops notifying: repeats only update its message quietly, and
  it never escalates. A snoozed alert is not shown at all until the snooze expires,
  but its counts keep going.
- An unacknowledged critical alert escalates once to the on-call group after a delay.

Everything works inside the caller's session and never commits; the caller's
``session_scope`` does. Messages are posted from inside the transaction, after the
row is flushed (so a racing duplicate is detected *before* anything is posted) and
before commit (so the returned :class:`~jobs.notify.MessageRef` is stored with the
alert in the same transaction). ``Notifier.post`` only queues, so nothing waits on
the network while rows are locked. The cost: if the transaction rolls back after the
post, the queued message still goes out for an alert that was not stored; the next
evaluation opens the alert again and posts a second message. A duplicate message
beats a lost one, and rollbacks here mean the database failed, which is rare.

Times are arguments (``now``); nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from jobs.errors import ConflictError, NotFound, TrainbotError
from jobs.models import Alert, AlertState, Run, Severity, alert_dedupe_key
from jobs.notify import AlertMessage, Journal, MessageRef, Notifier
from jobs.rules import Signal

__all__ = [
    "AlertTarget",
    "acknowledge",
    "alert_message",
    "escalate_due",
    "open_alerts",
    "process_signals",
    "resolve",
    "snooze",
]

_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}
_UNRESOLVED = (AlertState.OPEN, AlertState.ACKED)
_LIST_HINT = "`/train status <run>` lists a run's open alerts with their ids"


@dataclass(frozen=True)
class AlertTarget:
    """Where a run's alerts go."""

    #: Channel the alert messages are posted in.
    channel: str
    #: The run's root message; alerts go in its thread. ``None`` posts at top level
    #: (team budget alerts have no run thread).
    thread_ts: str | None
    #: User group paged when a critical alert stays unacknowledged, if any.
    oncall_group: str | None


def alert_message(
    alert: Alert, *, channel: str, thread_ts: str | None, escalate_to: str | None = None
) -> AlertMessage:
    """The alert as a message; the same function renders first posts, updates and escalations."""
    return AlertMessage(
        channel=channel,
        thread_ts=thread_ts,
        alert_id=alert.id,
        run_id=alert.run_id,
        rule=alert.rule,
        severity=str(alert.severity),
        state=str(alert.state),
        title=alert.title,
        detail=alert.detail,
        hint=alert.hint,
        count=alert.count,
        acked_by=alert.acked_by,
        acked_at=alert.acked_at,
        snoozed_until=alert.snoozed_until,
        escalate_to=escalate_to,
    )


def process_signals(
    session: Session,
    *,
    run: Run | None,
    signals: Sequence[Signal],
    now: datetime,
    target: AlertTarget,
    notifier: Notifier,
    journal: Journal,
) -> list[Alert]:
    """Open, update or resolve alerts for one evaluation's signals.

    Returns the alerts the signals touched (opened, repeated or resolved), each once,
    in signal order. A resolved signal for an alert that is not open is ignored: rules
    repeat "all clear" on every evaluation.
    """
    run_id = run.id if run is not None else None
    touched: dict[str, Alert] = {}
    for signal in signals:
        alert = _find_unresolved(session, run_id, signal.rule, signal.key)
        if signal.resolved:
            if alert is not None:
                _resolve(session, alert, user=None, now=now, notifier=notifier, journal=journal)
                touched[alert.id] = alert
            continue
        if alert is None:
            alert, created = _insert(session, run_id, signal, now=now)
            if created:
                _show(session, alert, notifier, channel=target.channel, thread_ts=target.thread_ts)
                journal.record(
                    "alert_opened",
                    run_id,
                    alert_id=alert.id,
                    rule=alert.rule,
                    key=alert.key,
                    severity=str(alert.severity),
                    title=alert.title,
                )
                touched[alert.id] = alert
                continue
        _repeat(session, alert, signal, now=now, target=target, notifier=notifier)
        touched[alert.id] = alert
    session.flush()
    return list(touched.values())


def acknowledge(
    session: Session,
    alert_id: str,
    *,
    user: str,
    now: datetime,
    notifier: Notifier,
    journal: Journal,
) -> Alert:
    """Someone owns the alert: record who and when, show it to everyone, stop escalation.

    Acknowledging an acknowledged alert changes nothing and returns it: its ``acked_by``
    names whoever acknowledged it first, for the front end to say so.
    """
    alert = _get_for_update(session, alert_id)
    if alert.state is AlertState.RESOLVED:
        raise ConflictError(
            f"alert {alert.id} ({alert.title}) was already resolved"
            f"{_at(alert.resolved_at)}; there is nothing to acknowledge. {_LIST_HINT}"
        )
    if alert.state is AlertState.ACKED:
        return alert
    alert.state = AlertState.ACKED
    alert.acked_by = user
    alert.acked_at = now
    session.flush()
    _show(session, alert, notifier)
    journal.record("alert_acknowledged", alert.run_id, alert_id=alert.id, user=user)
    return alert


def snooze(
    session: Session,
    alert_id: str,
    *,
    user: str,
    seconds: int,
    now: datetime,
    notifier: Notifier,
    journal: Journal,
) -> Alert:
    """Silence the alert for a while: no updates or escalation until ``now + seconds``.

    Repeats are still counted while it sleeps, so the message is accurate once it wakes.
    """
    if seconds <= 0:
        raise TrainbotError(
            f"cannot snooze alert {alert_id} for {seconds} s: give a positive duration, "
            "such as 30m or 2h"
        )
    alert = _get_for_update(session, alert_id)
    if alert.state is AlertState.RESOLVED:
        raise ConflictError(
            f"alert {alert.id} ({alert.title}) was already resolved"
            f"{_at(alert.resolved_at)}; there is nothing to snooze. {_LIST_HINT}"
        )
    alert.snoozed_until = now + timedelta(seconds=seconds)
    session.flush()
    _show(session, alert, notifier)
    journal.record(
        "alert_snoozed",
        alert.run_id,
        alert_id=alert.id,
        user=user,
        until=alert.snoozed_until.isoformat(),
    )
    return alert


def resolve(
    session: Session,
    alert_id: str,
    *,
    user: str | None,
    now: datetime,
    notifier: Notifier,
    journal: Journal,
) -> Alert:
    """Close the alert by hand (``user``) or by the system (``None``).

    Resolving a resolved alert changes nothing and returns it. Once resolved, the same
    ``(run, rule, key)`` may open a new alert.
    """
    alert = _get_for_update(session, alert_id)
    if alert.state is not AlertState.RESOLVED:
        _resolve(session, alert, user=user, now=now, notifier=notifier, journal=journal)
    return alert


def escalate_due(
    session: Session,
    *,
    now: datetime,
    delay_s: float,
    notifier: Notifier,
    journal: Journal,
    oncall_group: Callable[[Alert], str | None],
) -> list[Alert]:
    """Page the on-call group for critical alerts nobody has acknowledged in time.

    Each alert escalates at most once. The delay counts from ``first_seen``, so an alert
    that was a warning for hours and turns critical escalates on the next call: nobody
    picked it up in all that time. An alert whose run has no on-call group is left
    alone (there is nobody to page) and is looked at again next time.
    """
    cutoff = now - timedelta(seconds=delay_s)
    due = session.exec(
        select(Alert)
        .where(
            Alert.state == AlertState.OPEN,
            Alert.severity == Severity.CRITICAL,
            col(Alert.escalated_at).is_(None),
            col(Alert.first_seen) <= cutoff,
            or_(col(Alert.snoozed_until).is_(None), col(Alert.snoozed_until) <= now),
        )
        .order_by(col(Alert.first_seen), col(Alert.id))
        .with_for_update()
    ).all()
    escalated: list[Alert] = []
    for alert in due:
        group = oncall_group(alert)
        if group is None:
            continue
        channel, thread_ts = _where(session, alert)
        if channel is None:
            continue
        if thread_ts is None:
            # No run thread (a team alert): reply under the alert's own message.
            thread_ts = alert.message_ts
        notifier.post(alert_message(alert, channel=channel, thread_ts=thread_ts, escalate_to=group))
        alert.escalated_at = now
        journal.record("alert_escalated", alert.run_id, alert_id=alert.id, group=group)
        escalated.append(alert)
    session.flush()
    return escalated


def open_alerts(session: Session, *, run_id: str | None = None) -> list[Alert]:
    """Unresolved (open or acknowledged) alerts, oldest first; all runs when ``run_id`` is None."""
    query = select(Alert).where(col(Alert.state).in_(_UNRESOLVED))
    if run_id is not None:
        query = query.where(Alert.run_id == run_id)
    return list(session.exec(query.order_by(col(Alert.first_seen), col(Alert.id))).all())


# --- internals ------------------------------------------------------------------------


def _at(when: datetime | None) -> str:
    return f" at {when:%Y-%m-%d %H:%M} UTC" if when is not None else ""


def _snoozed(alert: Alert, now: datetime) -> bool:
    return alert.snoozed_until is not None and alert.snoozed_until > now


def _find_unresolved(session: Session, run_id: str | None, rule: str, key: str) -> Alert | None:
    query = (
        select(Alert)
        .where(Alert.dedupe_key == alert_dedupe_key(run_id, rule, key))
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return session.exec(query).first()


def _get_for_update(session: Session, alert_id: str) -> Alert:
    query = (
        select(Alert)
        .where(Alert.id == alert_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    alert = session.exec(query).first()
    if alert is None:
        raise NotFound(f"there is no alert {alert_id!r}: {_LIST_HINT}")
    return alert


def _insert(
    session: Session, run_id: str | None, signal: Signal, *, now: datetime
) -> tuple[Alert, bool]:
    """Insert a new alert, or return the one a concurrent transaction just opened.

    The insert runs in a savepoint so that losing the race (the UNIQUE ``dedupe_key``
    refuses the row) leaves the caller's transaction usable.
    """
    alert = Alert(
        run_id=run_id,
        rule=signal.rule,
        key=signal.key,
        dedupe_key=alert_dedupe_key(run_id, signal.rule, signal.key),
        severity=signal.severity,
        state=AlertState.OPEN,
        title=signal.title,
        detail=signal.detail,
        hint=signal.hint,
        count=1,
        first_seen=now,
        last_seen=now,
    )
    try:
        with session.begin_nested():
            session.add(alert)
    except IntegrityError:
        existing = _find_unresolved(session, run_id, signal.rule, signal.key)
        if existing is None:
            raise ConflictError(
                f"could not open the {signal.rule} alert for run {run_id or '(team)'}: the "
                "database refused it and no open alert took its place; retry"
            ) from None
        return existing, False
    return alert, True


def _repeat(
    session: Session,
    alert: Alert,
    signal: Signal,
    *,
    now: datetime,
    target: AlertTarget,
    notifier: Notifier,
) -> None:
    alert.count += 1
    alert.last_seen = now
    if _RANK[signal.severity] > _RANK[alert.severity]:
        alert.severity = signal.severity
    alert.title = signal.title
    alert.detail = signal.detail
    alert.hint = signal.hint
    if _snoozed(alert, now):
        return
    _show(session, alert, notifier, channel=target.channel, thread_ts=target.thread_ts)


def _resolve(
    session: Session,
    alert: Alert,
    *,
    user: str | None,
    now: datetime,
    notifier: Notifier,
    journal: Journal,
) -> None:
    alert.state = AlertState.RESOLVED
    alert.resolved_at = now
    alert.dedupe_key = None
    session.flush()
    _show(session, alert, notifier)
    journal.record("alert_resolved", alert.run_id, alert_id=alert.id, user=user)


def _where(session: Session, alert: Alert) -> tuple[str | None, str | None]:
    """The channel and thread an alert belongs in, from its message or its run."""
    run = session.get(Run, alert.run_id) if alert.run_id is not None else None
    channel = alert.message_channel or (run.channel if run is not None else None)
    thread_ts = run.thread_ts if run is not None else None
    return channel, thread_ts


def _show(
    session: Session,
    alert: Alert,
    notifier: Notifier,
    *,
    channel: str | None = None,
    thread_ts: str | None = None,
) -> None:
    """Update the alert's message in place, or post it if it has none yet."""
    if channel is None:
        channel, thread_ts = _where(session, alert)
        if channel is None:
            return  # nowhere to show it; the alert is still in the database
    if alert.message_channel is not None and alert.message_ts is not None:
        ref = MessageRef(channel=alert.message_channel, ts=alert.message_ts)
        notifier.update(ref, alert_message(alert, channel=ref.channel, thread_ts=thread_ts))
        return
    ref = notifier.post(alert_message(alert, channel=channel, thread_ts=thread_ts))
    alert.message_channel = ref.channel
    alert.message_ts = ref.ts
