"""The bodies of the scheduled jobs: reconcile, prices, spend, escalation, cleanup, digest.

Each is a plain function of ``deps`` (and ``now`` from ``deps.clock``), so tests call
them directly; ``jobs.background.scheduler`` only decides when they run and on which replica.
They drive runs through :mod:`jobs.runs` (reconcile, ending an attempt) as the chat
use-cases in :mod:`jobs.usecases.service` do; the states themselves are
:mod:`jobs.domain.lifecycle`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import date, datetime
from typing import Any
from zoneinfo import ZoneInfo

from sqlmodel import Session, col, select

from jobs import alerts, spend
from jobs.database.db import session_scope
from jobs.database.event_rollup import prune_ended_runs
from jobs.database.models import Alert, Attempt, Checkpoint, OnCall, Run
from jobs.domain.errors import SpecError, TrainbotError
from jobs.domain.format import usd
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.domain.locations import check_prefix, checkpoint_root
from jobs.domain.severity import Severity
from jobs.outbound.notify import DigestMessage
from jobs.preflight.interval import request_in
from jobs.process.deps import Deps
from jobs.providers.base import ProviderError
from jobs.rules import Signal
from jobs.runs import (
    active_attempt,
    alert_target,
    checkpoint_prefix,
    end_attempt,
    flag_unreadable_spec,
    get_run,
    move_run,
    reconcile,
    refresh_card,
    resource_request,
    run_hours,
    say,
    watched_spec,
)
from jobs.runs.relaunch import watch_prices
from jobs.spec import Notify, Retention, stored_section
from jobs.spend.rollup import roll_up_spend
from jobs.staging.retention import expire_staged
from runner.errors import RunnerError
from runner.retention import RetentionPolicy, prune
from runner.store import run_store

log = logging.getLogger(__name__)


def reconcile_job(deps: Deps) -> dict[str, int]:
    return reconcile(deps)


def price_job(deps: Deps) -> list[str]:
    """Launch the runs waiting for ``resubmit.max_price`` whose price is met now."""
    return watch_prices(deps)


# ----------------------------------------------------------------------------- spend


def spend_job(deps: Deps) -> list[str]:
    """Accrue spend, alert on budget thresholds, stop runs at their hard cap or their
    ``max_hours``; returns the runs it stopped."""
    now = deps.clock()
    to_stop: list[tuple[str, str | None]] = []
    with session_scope(deps.engine) as session:
        spend.accrue(session, now=now)
        for status in spend.check_budgets(session, now=now):
            run = session.get(Run, status.name) if status.scope == "run" else None
            signals = [_budget_signal(status, pct) for pct in status.crossed]
            for pct in status.crossed:
                deps.journal.record(
                    "budget_threshold",
                    run.id if run else None,
                    scope=status.scope,
                    name=status.name,
                    threshold=pct,
                    spent_usd=round(status.spent, 2),
                    budget_usd=status.usd,
                )
            if signals:
                target = (
                    alert_target(run)
                    if run is not None
                    else alerts.AlertTarget(channel=status.name, thread_ts=None, oncall_group=None)
                )
                alerts.process_signals(
                    session, run=run, signals=signals, now=now, target=target,
                    notifier=deps.notifier, journal=deps.journal,
                )  # fmt: skip
            if status.hard_cap_hit and run is not None and not run.state.is_terminal():
                attempt = active_attempt(session, run.id)
                reason = f"hard budget cap: {usd(status.spent)} of {usd(status.usd)} spent"
                if move_run(session, run, RunState.BUDGET_EXCEEDED, now=now, reason=reason):
                    say(deps, run, "error", f"{run.id} stopped at its budget cap ({reason}).")
                    deps.journal.record("run_finished", run.id, state="BUDGET_EXCEEDED")
                    refresh_card(deps, session, run)
                    to_stop.append((run.id, attempt.id if attempt else None))
        past_hours = _stop_past_max_hours(deps, session, now=now)
    # TERMINATED: the runner gets the notice and flushes a checkpoint before it goes.
    for _, attempt_id in to_stop:
        if attempt_id is not None:
            end_attempt(deps, attempt_id, state=AttemptState.TERMINATED, reason="budget cap")
    for _, attempt_id in past_hours:
        if attempt_id is not None:
            end_attempt(deps, attempt_id, state=AttemptState.TERMINATED, reason="max_hours")
    refresh_prices(deps)
    return [run_id for run_id, _ in to_stop + past_hours]


def _stop_past_max_hours(
    deps: Deps, session: Session, *, now: datetime
) -> list[tuple[str, str | None]]:
    """Runs whose instances ran their spec's ``max_hours``: stop them as the hard cap
    does (the runner flushes, the instance goes, an alert says why)."""
    live = session.exec(
        select(Run)
        .where(col(Run.state).in_([RunState.LAUNCHING, RunState.RUNNING, RunState.RECOVERING]))
        .order_by(col(Run.id))
    ).all()
    stopped: list[tuple[str, str | None]] = []
    for run in live:
        spec = watched_spec(run)
        if spec is None:
            flag_unreadable_spec(deps, session, run, now=now)
            continue
        limit = spec.max_hours
        if limit is None:
            continue
        hours = run_hours(session, run, now=now)
        if hours < limit:
            continue
        attempt = active_attempt(session, run.id)
        reason = f"max_hours: ran {hours:.2f} h of {limit:g} h"
        if not move_run(session, run, RunState.STOPPED, now=now, reason=reason):
            continue
        say(deps, run, "error", f"{run.id} stopped at its max_hours ({reason}).")
        deps.journal.record("run_finished", run.id, state="STOPPED", reason=reason)
        signal = Signal(
            rule="max_hours",
            key="max-hours",
            severity=Severity.WARNING,
            title=f"run {run.id} stopped after its max_hours of {limit:g} h",
            detail=f"its instances ran {hours:.2f} h; last committed step "
            f"{run.last_committed_step}",
            hint="resubmit to continue from its last checkpoint; raise max_hours in the "
            "spec if the run needs longer",
            data={"stop": True, "hours": round(hours, 3), "max_hours": limit},
        )
        alerts.process_signals(
            session, run=run, signals=[signal], now=now, target=alert_target(run),
            notifier=deps.notifier, journal=deps.journal,
        )  # fmt: skip
        refresh_card(deps, session, run)
        stopped.append((run.id, attempt.id if attempt else None))
    return stopped


def refresh_prices(deps: Deps) -> int:
    """Spot prices move: re-read each live attempt's price for the spend still to accrue
    (spend up to now was accrued at the old price just before)."""
    with session_scope(deps.engine) as session:
        live = session.exec(
            select(Attempt, Run)
            .join(Run, col(Run.id) == col(Attempt.run_id))
            .where(col(Attempt.state).in_([AttemptState.PROVISIONING, AttemptState.RUNNING]))
        ).all()
        wanted = [
            (a.id, a.provider, spec, a.region, a.zone, a.spot)
            for a, r in live
            if (spec := watched_spec(r)) is not None  # unreadable: flagged by the spend job
        ]
    prices: dict[str, tuple[float, float]] = {}
    for attempt_id, on, spec, region, zone, spot in wanted:
        try:  # the attempt's own provider and region
            provider = deps.provider_named(on)
            request = (
                request_in(spec, region, spot=spot, provider=provider)
                if region
                else resource_request(spec, provider, spot=spot)
            )
            quote = provider.price(request, zone=zone)
        except ProviderError as exc:
            log.warning("price refresh for %s failed: %s", attempt_id, exc)
            continue
        paid = quote.spot_usd_per_hour if spot else quote.on_demand_usd_per_hour
        prices[attempt_id] = (paid, quote.spot_usd_per_hour)
    changed = 0
    with session_scope(deps.engine) as session:
        for attempt_id, (price, spot_price) in prices.items():
            attempt = session.get(Attempt, attempt_id)
            if attempt is None:
                continue
            if attempt.spot_price_per_hour != spot_price:
                attempt.spot_price_per_hour = spot_price  # the on-demand premium's base
                session.add(attempt)
            if attempt.price_per_hour != price:
                attempt.price_per_hour = price
                session.add(attempt)
                changed += 1
    return changed


def _budget_signal(status: spend.BudgetStatus, pct: int) -> Signal:
    who = f"run {status.name}" if status.scope == "run" else f"channel {status.name}"
    critical = pct >= 100
    return Signal(
        rule="budget",
        key=f"threshold-{pct}",
        severity=Severity.CRITICAL if critical else Severity.WARNING,
        title=f"{who} has spent {status.pct:.0f}% of its {usd(status.usd)} budget",
        detail=f"{usd(status.spent)} spent; threshold {pct}% crossed",
        hint=(
            "the hard cap stops the run; raise budget.usd and resubmit to continue"
            if status.hard_cap_hit
            else "check the run is converging; raise budget.usd if the spend is expected"
        ),
        data={"stop": status.hard_cap_hit, "pct": pct},
    )


# ----------------------------------------------------------------------------- escalation


def escalation_job(deps: Deps, *, now: datetime | None = None) -> list[str]:
    """Stop the runs whose alerts ask for it (:func:`stop_diverged`), then page, level
    by level, for critical alerts nobody acknowledged in time: the on-call, then
    ``TRAINBOT_ESCALATION_LEVEL2``, then that level again up to a cap."""
    now = now or deps.clock()
    stop_diverged(deps, now=now)
    settings = deps.settings
    with session_scope(deps.engine) as session:

        def group_for(alert: Alert) -> str | None:
            return _oncall_for(session, alert)

        escalated = alerts.escalate_due(
            session,
            now=now,
            delay_s=settings.escalation_delay_s,
            notifier=deps.notifier,
            journal=deps.journal,
            oncall_group=group_for,
            next_level=lambda _alert: settings.escalation_level2,
            repeat_s=settings.escalation_repeat_s,
            max_repeats=settings.escalation_max_repeats,
        )
        return [a.id for a in escalated]


def stop_diverged(deps: Deps, *, now: datetime) -> list[str]:
    """Stop the runs whose alerts say so: a NaN loss (by default), or a divergence nobody
    acknowledged within ``alerts.stop_after``. The runner flushes a checkpoint as for
    ``/train stop``; the message offers to resubmit from the newest checkpoint from
    before the divergence began, which retention keeps while the alert is open.

    Returns the ids of the runs stopped.
    """
    to_end: list[tuple[str, str | None]] = []
    with session_scope(deps.engine) as session:
        for alert in alerts.stops_due(session, now=now):
            run = session.get(Run, alert.run_id) if alert.run_id else None
            if run is None or run.state.is_terminal():
                alert.stop_at = None  # it ended on its own: nothing to stop
                continue
            resume = _resume_step(session, run.id, alert.began_step)
            began = (
                f" (it began at step {alert.began_step})" if alert.began_step is not None else ""
            )
            nan = bool((alert.members or {}).get("nan", {}).get("firing"))
            why = (
                "the loss is not finite"
                if nan
                else "its step stood still and nobody acknowledged the hung alert in time"
                if alert.rule == "hung"
                else "the loss diverged and nobody acknowledged the alert in time"
            )
            reason = f"stopped by trainbot: {why}{began}; alert {alert.id}"
            hung = alert.rule == "hung"
            problem = "the step stopped" if hung else "the divergence"
            offer = (
                f"Resubmit from step {resume}, the newest checkpoint from before "
                f"{problem}; it is kept while this alert is open."
                if resume is not None
                else f"No checkpoint predates {problem}: fix it and launch again."
            )
            attempt = active_attempt(session, run.id)
            if not move_run(session, run, RunState.STOPPED, now=now, reason=reason):
                continue
            alerts.mark_stopped(
                session,
                alert,
                now=now,
                resume_step=resume,
                # A hung process cannot save: what it committed before is what there is.
                hint=(
                    f"trainbot stopped the run (a hung process cannot save). {offer}"
                    if hung
                    else f"trainbot stopped the run after a flush. {offer}"
                ),
                notifier=deps.notifier,
            )
            deps.journal.record(
                "run_finished",
                run.id,
                state="STOPPED",
                by="trainbot",
                reason=reason,
                alert_id=alert.id,
                resume_step=resume,
            )
            say(deps, run, "error", f"trainbot stopped {run.id}: {why}{began}. {offer}")
            refresh_card(deps, session, run)
            to_end.append((run.id, attempt.id if attempt else None))
    for _, attempt_id in to_end:
        if attempt_id is not None:
            end_attempt(deps, attempt_id, state=AttemptState.TERMINATED, reason="stopped")
    return [run_id for run_id, _ in to_end]


def _resume_step(session: Session, run_id: str, began_step: int | None) -> int | None:
    """The newest committed checkpoint at or before ``began_step`` (the newest at all
    when the step is unknown) that has not been deleted."""
    query = select(Checkpoint.step).where(
        Checkpoint.run_id == run_id, col(Checkpoint.deleted_at).is_(None)
    )
    if began_step is not None:
        query = query.where(col(Checkpoint.step) <= began_step)
    return session.exec(query.order_by(col(Checkpoint.step).desc())).first()


def _protected_steps(session: Session, run_id: str) -> frozenset[int]:
    """Checkpoints retention must keep: each unresolved alert's resubmit-from step."""
    steps: set[int] = set()
    for alert in alerts.open_alerts(session, run_id=run_id):
        if alert.resume_step is not None:
            steps.add(alert.resume_step)
        elif alert.began_step is not None:
            step = _resume_step(session, run_id, alert.began_step)
            if step is not None:
                steps.add(step)
    return frozenset(steps)


def _oncall_for(session: Session, alert: Alert) -> str | None:
    run = session.get(Run, alert.run_id) if alert.run_id else None
    if run is not None:
        group = stored_section(run.spec, Notify, run_id=run.id).oncall_group
        if group:
            return group
    channel = run.channel if run is not None else alert.message_channel
    row = session.get(OnCall, channel) if channel else None
    return row.user if row else None


# ----------------------------------------------------------------------------- cleanup


def retention_policy(r: Retention) -> RetentionPolicy:
    return RetentionPolicy(
        keep_last=r.keep_last,
        keep_every_steps=r.keep_every_steps,
        keep_best_metric=r.keep_best.metric if r.keep_best else None,
        keep_best_mode=r.keep_best.mode if r.keep_best else "min",
        keep_best_count=r.keep_best.count if r.keep_best else 1,
        max_age_s=r.max_age,
    )


def prune_run(deps: Deps, run_id: str, *, dry_run: bool = False) -> dict[str, Any]:
    """Apply one run's retention policy to its checkpoints."""
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        # Checked again here, not only at submit: this deletes with the control plane's
        # own credentials, so a row from before the rules must not escape them either.
        try:
            root = checkpoint_root(
                run.checkpoint_uri,
                default=deps.settings.checkpoint_uri,
                allowed=deps.settings.checkpoint_locations,
            )
            prefix = check_prefix(checkpoint_prefix(run))
        except SpecError as exc:
            log.error("cleanup of %s refused: %s", run_id, exc)
            return {"run_id": run_id, "error": str(exc)}
        spec = watched_spec(run)
        if spec is None:  # its retention is unknown: keep everything
            flag_unreadable_spec(deps, session, run, now=now)
            return {"run_id": run_id, "error": "its stored spec no longer validates"}
        store = run_store(root, prefix)
        policy = dataclasses.replace(
            retention_policy(spec.retention), protect=_protected_steps(session, run_id)
        )
        try:
            price: spend.StoragePrice | None = spend.run_storage_price(session, run, root)
        except TrainbotError as exc:  # the figure is a nicety: cleanup goes on without it
            log.warning("no storage price for %s: %s", run_id, exc)
            price = None
    try:
        result = prune(store, policy, now=now.timestamp(), dry_run=dry_run)
    except RunnerError as exc:
        log.warning("cleanup of %s failed: %s", run_id, exc)
        return {"run_id": run_id, "error": str(exc)}
    summary = {
        "run_id": run_id,
        "deleted": list(result.deleted),
        "kept": list(result.kept),
        "torn": list(result.torn),
        "bytes_freed": result.bytes_freed,
        # What the freed bytes cost a month in this store (0 for a local directory).
        "usd_per_month_freed": (
            spend.monthly_usd(result.bytes_freed, price) if price is not None else None
        ),
        "storage_price": price.source if price is not None else None,
        "dry_run": dry_run,
    }
    if not dry_run and (result.deleted or result.torn):
        with session_scope(deps.engine) as session:
            rows = session.exec(
                select(Checkpoint).where(
                    Checkpoint.run_id == run_id,
                    col(Checkpoint.step).in_(list(result.deleted)),
                    col(Checkpoint.deleted_at).is_(None),
                )
            ).all()
            for row in rows:
                row.deleted_at = now
                session.add(row)
        deps.journal.record(
            "cleanup", run_id, **{k: v for k, v in summary.items() if k != "run_id"}
        )
    return summary


def cleanup_job(deps: Deps) -> list[dict[str, Any]]:
    """Prune every run that has checkpoints; runs that ended long ago included. Remove
    the cloud budgets of runs ended ``cloud_budget_keep_days`` ago (and any whose
    removal when the run ended failed)."""
    spend.remove_cloud_budgets(deps, now=deps.clock())
    expire_staged(deps, now=deps.clock())  # staged datasets past TRAINBOT_STAGING_KEEP_DAYS
    with session_scope(deps.engine) as session:
        run_ids = session.exec(
            select(Run.id).where(col(Run.last_committed_step).is_not(None))
        ).all()
    return [prune_run(deps, run_id) for run_id in run_ids]


def rollup_job(deps: Deps) -> dict[str, int]:
    """Bound the database's growth: roll old spend records up (per hour after a day,
    per day after a month; :mod:`jobs.spend.rollup`) and prune the event streams of runs
    ended past their retention (:mod:`jobs.database.event_rollup`). Figures read afterwards (the
    digest, summaries, ``/metrics``) are the same."""
    now = deps.clock()
    with session_scope(deps.engine) as session:
        spent = roll_up_spend(session, now=now)
    with session_scope(deps.engine) as session:
        pruned = prune_ended_runs(session, now=now)
    return {
        "spend_merged": spent.merged,
        "spend_written": spent.written,
        "events_deleted": pruned.events,
        "points_thinned": pruned.points,
    }


# ----------------------------------------------------------------------------- digest


def digest_channels(session: Session) -> list[str]:
    """The channels that get a digest: every channel a run was launched from."""
    return sorted({c for c in session.exec(select(Run.channel).distinct()).all() if c is not None})


def digest_job(
    deps: Deps,
    *,
    channels: list[str] | None = None,
    day: date | None = None,
    key_prefix: str | None = None,
) -> list[dict[str, Any]]:
    """Post each channel's daily spend digest: of yesterday, or of the local ``day``.

    ``key_prefix``: each post carries the key ``{key_prefix}:{channel}``, which a
    durable notifier posts once (the scheduled digest, which a new leader may redo)."""
    now = deps.clock()
    tz = ZoneInfo(deps.settings.timezone)
    with session_scope(deps.engine) as session:
        spend.accrue(session, now=now)
        if channels is None:
            channels = digest_channels(session)
        all_figures = [
            spend.digest_figures(session, channel=channel, now=now, tz=tz, day=day)
            for channel in channels
        ]
    # Charts render outside the transaction: matplotlib is slow, the database is shared.
    for channel, figures in zip(channels, all_figures, strict=True):
        try:
            chart = spend.spend_chart_png(figures)
        except Exception as exc:  # a chart is a nicety; the figures must still go out
            log.warning("digest chart for %s failed: %s", channel, exc)
            chart = None
        key = f"{key_prefix}:{channel}" if key_prefix else None
        deps.notifier.post(
            DigestMessage(channel=channel, figures=figures, chart_png=chart, key=key)
        )
        deps.journal.record("digest", None, channel=channel, **_digest_summary(figures))
    return all_figures


def _digest_summary(figures: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "date",
        "day_usd",
        "month_to_date_usd",
        "preemptions",
        "goodput",
        "gpu_hours_lost",
        "instance_hours_lost",
    )
    summary = {k: figures.get(k) for k in keys if k in figures}
    storage = figures.get("storage") or {}
    summary["storage_usd"] = storage.get("usd")
    summary["storage_bytes_kept"] = storage.get("bytes_kept")
    badput = figures.get("badput") or {}
    summary["badput_usd"] = badput.get("usd")
    summary["badput"] = {row["name"]: row["usd"] for row in badput.get("categories", [])}
    return summary


def run_summary(deps: Deps, run_id: str) -> dict[str, Any]:
    """The final summary: spend, goodput, lost work, checkpoints kept, what they cost a
    month to keep, and the badput split by cause over the run's life."""
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        attempts = session.exec(select(Attempt).where(Attempt.run_id == run_id)).all()
        paid = sum(
            ((a.ended_at or now) - a.started_at).total_seconds()
            for a in attempts
            if a.started_at is not None
        )
        lost = sum(a.lost_seconds for a in attempts)
        kept = session.exec(
            select(Checkpoint.step).where(
                Checkpoint.run_id == run_id, col(Checkpoint.deleted_at).is_(None)
            )
        ).all()
        return {
            "run_id": run_id,
            "state": run.state.value,
            "spent_usd": round(spend.run_spent(session, run_id), 4),
            "budget_usd": run.budget_usd,
            "attempts": len(attempts),
            "preemptions": run.preemptions,
            "paid_s": round(paid, 1),
            "lost_s": round(lost, 1),
            "lost_steps": sum(a.lost_steps for a in attempts),
            "goodput": round(1 - lost / paid, 4) if paid > 0 else None,
            "last_step": run.last_step,
            "checkpoints_kept": sorted(set(kept)),
            "storage": spend.storage_figures(
                session, channel=None, run_ids=[run_id], since=run.created_at, until=now
            ),
            "badput": spend.badput_figures(
                session, run_ids=[run_id], since=run.created_at, until=now
            ),
        }
