"""How an alert is shown: its message, where it goes, posted once and then updated in place."""

from __future__ import annotations

from dataclasses import dataclass

from sqlmodel import Session

from jobs.database.models import Alert, Run
from jobs.outbound.notify import AlertMessage, MessageRef, Notifier


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
        resume_step=alert.resume_step,
    )


def where(session: Session, alert: Alert) -> tuple[str | None, str | None]:
    """The channel and thread an alert belongs in, from its message or its run."""
    run = session.get(Run, alert.run_id) if alert.run_id is not None else None
    channel = alert.message_channel or (run.channel if run is not None else None)
    thread_ts = run.thread_ts if run is not None else None
    return channel, thread_ts


def show(
    session: Session,
    alert: Alert,
    notifier: Notifier,
    *,
    channel: str | None = None,
    thread_ts: str | None = None,
) -> None:
    """Update the alert's message in place, or post it if it has none yet."""
    if channel is None:
        channel, thread_ts = where(session, alert)
        if channel is None:
            return  # nowhere to show it; the alert is still in the database
    if alert.message_channel is not None and alert.message_ts is not None:
        ref = MessageRef(channel=alert.message_channel, ts=alert.message_ts)
        notifier.update(ref, alert_message(alert, channel=ref.channel, thread_ts=thread_ts))
        return
    ref = notifier.post(alert_message(alert, channel=channel, thread_ts=thread_ts))
    alert.message_channel = ref.channel
    alert.message_ts = ref.ts
