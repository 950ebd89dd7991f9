"""What a run tells people: its card, messages in its thread, and where its alerts go.

The card is the run's root message, updated in place; ``say`` posts into its thread.
Alerts raised by the attempt machinery (preemptions, resubmits, lost heartbeats) go
through :func:`raise_signals`, with the facts the rules read from :func:`run_context`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pydantic import ValidationError
from sqlmodel import Session, col, select

from jobs import alerts
from jobs.database.metrics import run_metrics
from jobs.database.models import Attempt, KeptInstance, Run
from jobs.domain.format import clock
from jobs.domain.lifecycle import AttemptState
from jobs.outbound.notify import MessageRef, RunCard, TextMessage
from jobs.process.deps import Deps
from jobs.rules import RunContext, Severity, Signal
from jobs.runs.rows import channel_of, latest_attempt
from jobs.spec import AlertThresholds, JobSpec, Notify, stored_section
from jobs.spec.origin import SpecOrigin
from jobs.spend import run_spent
from jobs.staging.models import Staging, StagingState


def card(session: Session, run: Run) -> RunCard:
    att = latest_attempt(session, run.id)
    newest = run_metrics(session.connection(), run.id, limit=1)
    loss = newest[-1].data.get("loss") if newest else None
    return RunCard(
        channel=channel_of(run),
        run_id=run.id,
        spec_name=run.spec_name,
        state=run.state.value,
        requester=run.requester,
        attempt=att.number if att else 0,
        step=run.last_step,
        target_steps=run.target_steps,
        loss=float(loss) if isinstance(loss, int | float) else None,
        spent_usd=round(run_spent(session, run.id), 4),
        budget_usd=run.budget_usd,
        instance_id=att.instance_id if att else None,
        zone=att.zone if att else None,
        market=None if att is None else "spot" if att.spot else "on-demand",
        region=att.region if att else None,
        provider=att.provider if att else None,
        reason=run.reason,
        spec_from=_spec_from(run),
        data_from=_data_from(session, run),
        kept=_kept(session, run),
    )


def _kept(session: Session, run: Run) -> str | None:
    """The run's kept failed instance, if any (:mod:`jobs.runs.kept`): which, until
    when, how to connect."""
    row = session.exec(
        select(KeptInstance)
        .where(KeptInstance.run_id == run.id, col(KeptInstance.ended_at).is_(None))
        .order_by(col(KeptInstance.kept_at).desc())
    ).first()
    if row is None:
        return None
    return f"{row.instance_id} until {clock(row.until)}; connect: {row.connect}"


def _data_from(session: Session, run: Run) -> str | None:
    """The staged copy the run reads, beside the dataset it copies (jobs.staging)."""
    uri = run.spec.get("data_uri") if isinstance(run.spec, dict) else None
    if not uri:
        return None
    copy = session.exec(
        select(Staging.source).where(Staging.target == uri, Staging.state == StagingState.DONE)
    ).first()
    return f"{uri} (staged copy of {copy})" if copy else None


def _spec_from(run: Run) -> str | None:
    """Where the run's spec was read, from the copy stored on it (None before trainbot
    recorded it, or if the record does not validate: the card shows the rest)."""
    stored = run.spec.get("origin") if isinstance(run.spec, dict) else None
    if not isinstance(stored, dict):
        return None
    try:
        return SpecOrigin.model_validate(stored).shown()
    except ValidationError:
        return None


def refresh_card(deps: Deps, session: Session, run: Run) -> None:
    """Update the run's root message in place."""
    if run.thread_ts is None:
        return
    deps.notifier.update(MessageRef(channel=channel_of(run), ts=run.thread_ts), card(session, run))


def say(deps: Deps, run: Run, kind: str, text: str, *, log_tail: str | None = None) -> None:
    """Post ``text`` in the run's thread; ``log_tail``: the command's last lines, shown
    under it (a failure's)."""
    deps.notifier.post(
        TextMessage(
            channel=channel_of(run),
            thread_ts=run.thread_ts,
            kind=kind,
            text=text,
            run_id=run.id,
            log_tail=log_tail or None,
        )
    )


def alert_config(spec: JobSpec) -> AlertThresholds:
    """The thresholds of the run's alert rules."""
    return spec.alerts


def alert_target(run: Run) -> alerts.AlertTarget:
    return alerts.AlertTarget(
        channel=channel_of(run),
        thread_ts=run.thread_ts,
        oncall_group=stored_section(run.spec, Notify, run_id=run.id).oncall_group,
    )


def run_context(
    session: Session, run: Run, attempt: Attempt | None, *, now: datetime
) -> RunContext:
    """What the rules need to know about the run beyond the events they are given."""
    ended = session.exec(
        select(Attempt.ended_at).where(
            Attempt.run_id == run.id,
            Attempt.state.in_([AttemptState.PREEMPTED, AttemptState.LOST]),  # type: ignore[attr-defined]
        )
    ).all()
    return RunContext(
        run_id=run.id,
        last_heartbeat=attempt.last_heartbeat.timestamp()
        if attempt and attempt.last_heartbeat
        else None,
        preemption_times=tuple(t.timestamp() for t in ended if t is not None),
        attempt_number=attempt.number if attempt else 0,
        last_committed_step=run.last_committed_step,
        current_step=run.last_step,
    )


def raise_signals(
    deps: Deps, session: Session, run: Run, signals: Sequence[Signal], *, now: datetime
) -> None:
    """Open, update or resolve the run's alerts for what the rules said."""
    alerts.process_signals(
        session,
        run=run,
        signals=signals,
        now=now,
        target=alert_target(run),
        notifier=deps.notifier,
        journal=deps.journal,
    )


def flag_unreadable_spec(deps: Deps, session: Session, run: Run, *, now: datetime) -> None:
    """Say once, in the run's thread, that its stored spec no longer validates, so the
    scheduled passes skip what needs it: an alert deduplicated by (run, rule, key), so a
    pass every few seconds updates one message instead of posting again."""
    signal = Signal(
        rule="spec",
        key="unreadable",
        severity=Severity.WARNING,
        title=f"run {run.id}'s stored spec no longer validates",
        detail="trainbot cannot relaunch it, stop it at its max_hours, price it or prune "
        "its checkpoints; its alerts use the default thresholds",
        hint=f"stop it (`/train stop {run.id}`) and resubmit from a valid spec",
    )
    raise_signals(deps, session, run, [signal], now=now)
