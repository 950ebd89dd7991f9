"""One problem, one alert: incidents of several signals, reopening and flapping.

Signals with the same ``incident`` join one alert whose detail lists each member; a
rule firing again within the quiet period reopens its resolved alert; reopening too
often within the flap window is said once, as flapping. A member's ``stop_after_s``
sets when trainbot stops the run (:mod:`jobs.alerts.stops`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from jobs.database.models import Alert, AlertState, alert_dedupe_key
from jobs.domain.severity import Severity
from jobs.rules import Signal
from jobs.spec import AlertThresholds

#: Severities in order: an alert's severity only ever rises.
RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


def group(signal: Signal) -> str:
    """The alert a signal belongs to within its rule: its incident, or its own key."""
    return signal.incident or signal.key


def join(alert: Alert, signal: Signal, *, now: datetime) -> None:
    """Fold a firing signal into its alert: the incident's members, the step the problem
    began at, and when trainbot stops the run if nobody acknowledges it."""
    if signal.began_step is not None and (
        alert.began_step is None or signal.began_step < alert.began_step
    ):
        alert.began_step = signal.began_step
    if signal.incident is not None:
        members = dict(alert.members or {})
        before = members.get(signal.key) or {}
        members[signal.key] = {
            "severity": str(signal.severity),
            "title": signal.title,
            "detail": signal.detail,
            "firing": True,
            "count": int(before.get("count", 0)) + 1,
            "stop_after_s": signal.stop_after_s,
        }
        alert.members = members  # a new dict: JSON columns do not see in-place changes
        _describe(alert)
    if signal.stop_after_s is None:
        return
    if alert.state is AlertState.ACKED and signal.stop_after_s > 0:
        return  # somebody owns it
    due = now + timedelta(seconds=signal.stop_after_s)
    if alert.stop_at is None or due < alert.stop_at:
        alert.stop_at = due


def _describe(alert: Alert) -> None:
    """An incident's title is its most severe firing member's; its detail lists them all."""
    members = alert.members or {}
    firing = [m for m in members.values() if m.get("firing")]
    if firing:
        lead = max(firing, key=lambda m: RANK.get(Severity(m["severity"]), 0))
        alert.title = str(lead["title"])
    lines = [
        f"• {m['title']}: {m['detail']}" + ("" if m.get("firing") else " (cleared)")
        for m in members.values()
    ]
    if _flapping(alert):
        lines.append(_flapping_line(alert))
    alert.detail = "\n".join(lines)


def _flapping(alert: Alert) -> bool:
    """Said flapping in the current flap window."""
    return (
        alert.flapping_since is not None
        and alert.flap_since is not None
        and alert.flapping_since >= alert.flap_since
    )


def _flapping_line(alert: Alert) -> str:
    since = alert.flap_since or alert.last_seen
    minutes = max(1, round((alert.last_seen - since).total_seconds() / 60))
    return f"flapping: {alert.flaps} times in {minutes} min"


def clear(alert: Alert, signal: Signal) -> bool | None:
    """Mark a member of an incident cleared: True when nothing in the alert still fires
    (resolve it), False when others still do (update it), None when nothing changed."""
    if not alert.members:
        return True  # an alert of one key
    if not alert.members.get(signal.key, {}).get("firing"):
        return None  # rules repeat "all clear" on every evaluation
    members = dict(alert.members)
    members[signal.key] = {**members[signal.key], "firing": False}
    alert.members = members
    _describe(alert)
    return not any(m.get("firing") for m in members.values())


def stops_at_once(alert: Alert) -> bool:
    return any(
        m.get("firing") and m.get("stop_after_s") == 0 for m in (alert.members or {}).values()
    )


def recently_resolved(
    session: Session, run_id: str | None, rule: str, key: str, *, since: datetime
) -> Alert | None:
    """The newest alert of this (run, rule, key) that resolved at or after ``since``."""
    query = (
        select(Alert)
        .where(
            Alert.run_id == run_id if run_id is not None else col(Alert.run_id).is_(None),
            Alert.rule == rule,
            Alert.key == key,
            Alert.state == AlertState.RESOLVED,
            col(Alert.resolved_at) >= since,
        )
        .order_by(col(Alert.resolved_at).desc(), col(Alert.id).desc())
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return session.exec(query).first()


def reopen(
    session: Session, alert: Alert, signal: Signal, *, now: datetime, cfg: AlertThresholds
) -> bool:
    """Reopen a resolved alert for the same problem; False when a racing replica opened
    a new one meanwhile (the caller then repeats that one)."""
    alert.state = AlertState.OPEN
    alert.dedupe_key = alert_dedupe_key(alert.run_id, alert.rule, alert.key)
    alert.resolved_at = None
    alert.acked_by = None  # it came back: somebody has to look again
    alert.acked_at = None
    alert.count += 1
    alert.reopened += 1
    alert.last_seen = now
    window = timedelta(seconds=cfg.flap_window)
    if alert.flap_since is None or now - alert.flap_since > window:
        alert.flap_since, alert.flaps = now, 1
    else:
        alert.flaps += 1
    if alert.flaps > cfg.flap_count and (
        alert.flapping_since is None or alert.flapping_since < alert.flap_since
    ):
        alert.flapping_since = now  # said once per flap window
    if RANK[signal.severity] > RANK[alert.severity]:
        alert.severity = signal.severity
    if signal.incident is None:
        alert.title, alert.detail = signal.title, signal.detail
        if _flapping(alert):
            alert.detail += "\n" + _flapping_line(alert)
    alert.hint = signal.hint
    join(alert, signal, now=now)
    try:
        with session.begin_nested():
            session.flush()
    except IntegrityError:
        session.expire(alert)
        return False
    return True
