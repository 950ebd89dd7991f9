"""Open, repeat, acknowledge, snooze and resolve: the life of one alert.

See :mod:`jobs.alerts` for the rules it keeps and why it posts inside the transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from jobs.alerts import display, incidents
from jobs.alerts.display import AlertTarget
from jobs.database.models import Alert, AlertState, Run, alert_dedupe_key
from jobs.domain.errors import ConflictError, NotFound, TrainbotError
from jobs.outbound.notify import Journal, Notifier
from jobs.rules import Signal
from jobs.spec import AlertThresholds, stored_section

UNRESOLVED = (AlertState.OPEN, AlertState.ACKED)
_LIST_HINT = "`/train status <run>` lists a run's open alerts with their ids"


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
    cfg = (
        stored_section(run.spec, AlertThresholds, run_id=run.id)
        if run is not None
        else AlertThresholds()
    )
    touched: dict[str, Alert] = {}
    # What fires first, what cleared after: a spike clearing while its trend fires in the
    # same evaluation must not resolve (and then reopen) their incident.
    ordered = [s for s in signals if not s.resolved] + [s for s in signals if s.resolved]
    for signal in ordered:
        key = incidents.group(signal)
        alert = _find_unresolved(session, run_id, signal.rule, key)
        if signal.resolved:
            if alert is not None and alert.stopped_at is not None:
                # trainbot stopped the run for this alert: the last points of a stopped
                # run are no recovery, and the checkpoint its resubmit offer names is kept
                # only while it is open. A person acknowledges or resolves it.
                continue
            cleared = incidents.clear(alert, signal) if alert is not None else None
            if alert is not None and cleared is True:
                _resolve(session, alert, user=None, now=now, notifier=notifier, journal=journal)
                touched[alert.id] = alert
            elif alert is not None and cleared is False:
                display.show(
                    session, alert, notifier, channel=target.channel, thread_ts=target.thread_ts
                )
                touched[alert.id] = alert
            continue
        if alert is None and cfg.quiet_period > 0:
            since = now - timedelta(seconds=cfg.quiet_period)
            alert = incidents.recently_resolved(session, run_id, signal.rule, key, since=since)
            if alert is not None and incidents.reopen(session, alert, signal, now=now, cfg=cfg):
                _announce(
                    session,
                    alert,
                    "alert_reopened",
                    target=target,
                    notifier=notifier,
                    journal=journal,
                    member=signal.key,
                    reopened=alert.reopened,
                )
                if alert.flapping_since == now:
                    journal.record("alert_flapping", run_id, alert_id=alert.id, times=alert.flaps)
                touched[alert.id] = alert
                continue
            alert = _find_unresolved(session, run_id, signal.rule, key)
        if alert is None:
            alert, created = _insert(session, run_id, signal, now=now)
            if created:
                _announce(
                    session,
                    alert,
                    "alert_opened",
                    target=target,
                    notifier=notifier,
                    journal=journal,
                    severity=str(alert.severity),
                    **({"member": signal.key} if signal.incident else {}),
                )
                touched[alert.id] = alert
                continue
        _repeat(session, alert, signal, now=now, target=target, notifier=notifier)
        touched[alert.id] = alert
    session.flush()
    return list(touched.values())


def _announce(
    session: Session,
    alert: Alert,
    event: str,
    *,
    target: AlertTarget,
    notifier: Notifier,
    journal: Journal,
    **fields: Any,
) -> None:
    """Show a new or reopened alert in its channel and journal ``event`` with its identity."""
    display.show(session, alert, notifier, channel=target.channel, thread_ts=target.thread_ts)
    journal.record(
        event,
        alert.run_id,
        alert_id=alert.id,
        rule=alert.rule,
        key=alert.key,
        title=alert.title,
        **fields,
    )


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
    if not incidents.stops_at_once(alert):
        alert.stop_at = None  # somebody owns it: trainbot does not stop the run for them
    session.flush()
    display.show(session, alert, notifier)
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
    display.show(session, alert, notifier)
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
    ``(run, rule, key)`` firing again reopens it within the quiet period, and opens a
    new alert after it.
    """
    alert = _get_for_update(session, alert_id)
    if alert.state is not AlertState.RESOLVED:
        _resolve(session, alert, user=user, now=now, notifier=notifier, journal=journal)
    return alert


def open_alerts(session: Session, *, run_id: str | None = None) -> list[Alert]:
    """Unresolved (open or acknowledged) alerts, oldest first; all runs when ``run_id`` is None."""
    query = select(Alert).where(col(Alert.state).in_(UNRESOLVED))
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
    key = incidents.group(signal)
    alert = Alert(
        run_id=run_id,
        rule=signal.rule,
        key=key,
        dedupe_key=alert_dedupe_key(run_id, signal.rule, key),
        severity=signal.severity,
        state=AlertState.OPEN,
        title=signal.title,
        detail=signal.detail,
        hint=signal.hint,
        count=1,
        first_seen=now,
        last_seen=now,
        began_step=signal.began_step,
    )
    incidents.join(alert, signal, now=now)
    try:
        with session.begin_nested():
            session.add(alert)
    except IntegrityError:
        existing = _find_unresolved(session, run_id, signal.rule, key)
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
    if incidents.RANK[signal.severity] > incidents.RANK[alert.severity]:
        alert.severity = signal.severity
    alert.title = signal.title
    alert.detail = signal.detail
    alert.hint = signal.hint
    incidents.join(alert, signal, now=now)
    if _snoozed(alert, now):
        return
    display.show(session, alert, notifier, channel=target.channel, thread_ts=target.thread_ts)


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
    display.show(session, alert, notifier)
    journal.record("alert_resolved", alert.run_id, alert_id=alert.id, user=user)
