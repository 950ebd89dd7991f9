"""Use-cases behind every chat command: plain functions of (deps, …).

The chat front ends (console, Slack) parse a command, call one of these, and render
what it returns. Slow work (preflight, launch) runs in the background and reports into
the run's thread; the command returns at once. Errors are ``jobs.errors`` exceptions
whose messages are written for the person who typed the command.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from sqlmodel import Session, col, select

from jobs import alerts, preflight, spend
from jobs.db import detach, session_scope
from jobs.deps import Deps
from jobs.errors import ConflictError, NotFound, PermissionDenied, SpecError
from jobs.lifecycle import AttemptState, RunState
from jobs.locations import checkpoint_root
from jobs.models import Alert, Attempt, CommandLog, OnCall, Run, new_id, utcnow
from jobs.notify import RunCard
from jobs.providers.base import InstanceNotFound, ProviderError
from jobs.runs import (
    active_attempt,
    card,
    channel_of,
    checkpoint_prefix,
    end_attempt,
    get_run,
    launch_attempt,
    move_run,
    refresh_card,
    resource_request,
    say,
    spec_of,
)
from jobs.spec import list_specs, load_spec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Actor:
    """Who asked, from where: taken from the signed request, never from the text."""

    user: str
    #: Where the request came from ("" for the App Home).
    channel: str
    is_admin: bool = False
    #: Other channels whose runs and alerts the person may see and act on (the App Home:
    #: the channels they are a member of).
    channels: frozenset[str] = frozenset()

    def sees(self, channel: str | None) -> bool:
        """Whether a run or alert that reports to ``channel`` is this person's business:
        admins see every channel, everyone else the one they are in."""
        if self.is_admin:
            return True
        return channel is not None and (
            (channel == self.channel and channel != "") or channel in self.channels
        )

    @property
    def visible(self) -> frozenset[str]:
        return frozenset(c for c in (self.channel, *self.channels) if c)


def _may_see(actor: Actor, run: Run) -> None:
    """Reads and actions on someone's run go through the channel it reports to; to anyone
    outside it, the run does not exist."""
    if not actor.sees(run.channel):
        raise NotFound(f"no run {run.id} reports to this channel; ask in the channel it reports to")


def _may_touch(actor: Actor, run: Run) -> None:
    if actor.is_admin or actor.user == run.requester:
        return
    raise PermissionDenied(
        f"{run.id} belongs to {run.requester}; only they or an admin can change it"
    )


# ----------------------------------------------------------------------------- launch


def submit(
    deps: Deps,
    *,
    spec_name: str,
    overrides: Sequence[str],
    actor: Actor,
    idempotency_key: str | None = None,
    launch: bool = True,
) -> Run:
    """Create a run and start its preflight in the background; a repeated key returns
    the run the first request created, so a retried command launches once."""
    spec = load_spec(spec_name, specs_dir=deps.settings.specs_dir, overrides=overrides)
    checkpoint_uri = checkpoint_root(
        spec.checkpoint.uri,
        default=deps.settings.checkpoint_uri,
        allowed=deps.settings.checkpoint_locations,
    )
    channel = _report_channel(deps, spec.notify.channel, actor)
    now = deps.clock()
    with session_scope(deps.engine) as session:
        if idempotency_key is not None:
            existing = session.exec(
                select(Run).where(Run.idempotency_key == idempotency_key)
            ).first()
            if existing is not None:
                detach(session, existing)
                return existing
        run = Run(
            id=new_id("r"),
            spec_name=spec.name,
            spec=spec.model_dump(mode="json"),
            requester=actor.user,
            channel=channel,
            checkpoint_uri=checkpoint_uri,
            budget_usd=spec.budget.usd,
            target_steps=preflight.target_steps(spec.command),
            idempotency_key=idempotency_key,
            created_at=now,
            updated_at=now,
        )
        session.add(run)
        try:
            session.flush()
        except ConflictError:
            session.rollback()
            with session_scope(deps.engine) as again:
                existing = again.exec(
                    select(Run).where(Run.idempotency_key == idempotency_key)
                ).first()
                if existing is None:
                    raise
                again.expunge(existing)
                return existing
        move_run(
            session, run, RunState.PREFLIGHT, now=now, reason=None if launch else PREFLIGHT_ONLY
        )
        ref = deps.notifier.post(card(session, run))
        run.thread_ts = ref.ts
        session.add(run)
        detach(session, run)
    deps.journal.record("submitted", run.id, spec=spec.name, requester=actor.user)
    deps.background(preflight_then_launch, deps, run.id, launch=launch)
    return run


def _report_channel(deps: Deps, wanted: str | None, actor: Actor) -> str:
    """Where a run reports: the channel the command came from, or ``notify.channel`` when
    that is one of the allowed channels (by id). The bot may post in any public channel,
    so a spec must not be able to send a run's card and alerts just anywhere."""
    if not wanted or wanted == actor.channel:
        return actor.channel
    allowed = set(deps.settings.allowed_channels)
    if actor.is_admin and not allowed:
        return wanted
    if wanted in allowed:
        return wanted
    listed = ", ".join(sorted(allowed)) or "none: TRAINBOT_ALLOWED_CHANNELS is not set"
    raise PermissionDenied(
        f"notify.channel={wanted[:40]!r} is not one of the channels trainbot may post to "
        f"({listed}); leave it out to report here, or ask an admin to add the channel's "
        "id to TRAINBOT_ALLOWED_CHANNELS"
    )


#: The reason a run in PREFLIGHT carries when it was asked for the checks alone
#: (``/train preflight``): after them it waits for "Launch anyway" whatever they say.
PREFLIGHT_ONLY = "preflight only"


def resume_preflights(deps: Deps) -> list[str]:
    """Runs that a crash of the control plane left in PREFLIGHT: end the dry run it left
    behind, if any, and run the checks again. Called once at start; returns the run ids.

    Nothing else would: a run in PREFLIGHT has no attempt for reconcile to find.
    """
    from runner.dryrun import end_stale_dry_run

    with session_scope(deps.engine) as session:
        runs = [
            (r.id, r.reason != PREFLIGHT_ONLY)
            for r in session.exec(select(Run).where(Run.state == RunState.PREFLIGHT)).all()
        ]
    for run_id, launch in runs:
        workdir = deps.settings.state_dir / "preflight" / run_id
        if end_stale_dry_run(workdir / preflight.DRY_RUN_PID_FILE):
            deps.journal.record("dry_run_ended", run_id, reason="control plane restarted")
        with session_scope(deps.engine) as session:
            say(
                deps,
                get_run(session, run_id),
                "info",
                "The control plane restarted during this run's preflight checks; "
                "running them again.",
            )
        deps.journal.record("preflight_resumed", run_id)
        deps.background(preflight_then_launch, deps, run_id, launch=launch)
    return [run_id for run_id, _ in runs]


def preflight_then_launch(deps: Deps, run_id: str, *, launch: bool = True) -> None:
    """Run the checks; launch when they pass, ask when they warn, stop when one fails."""
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        spec = spec_of(run)
        channel, thread_ts = channel_of(run), run.thread_ts
        checkpoint_uri = run.checkpoint_uri or deps.settings.checkpoint_uri
    workdir = deps.settings.state_dir / "preflight" / run_id
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = preflight.PreflightContext(
        spec=spec,
        run_id=run_id,
        provider=deps.provider,
        request=resource_request(spec),
        checkpoint_uri=checkpoint_uri,
        mtbp_s=deps.settings.assumed_mtbp_s or preflight.assumed_mtbp_s(deps.provider),
        # Only a provider whose instances are this machine's processes gets a dry run
        # here; with a cloud provider preflight runs nothing (jobs.preflight.DryRunCheck).
        env=(
            {"PYTHONPATH": _code_root()} if deps.provider.capabilities.runs_on_this_machine else {}
        ),
        workdir=workdir,
    )

    def on_result(result: preflight.CheckResult) -> None:
        deps.journal.record(
            "preflight_check",
            run_id,
            check=result.name,
            status=result.status.value,
            detail=result.detail,
            remedy=result.remedy,
        )

    report = preflight.run_preflight(ctx, on_result=on_result)
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        if run.state != RunState.PREFLIGHT:
            return  # stopped while the checks ran
        run.preflight = report.as_dict()
        run.checkpoint_interval_s = report.interval_s
        if run.budget_usd is None and report.estimate_usd:
            run.budget_usd = round(report.estimate_usd, 2)  # the budget alert at the expected cost
            say(
                deps,
                run,
                "info",
                f"No budget.usd given: budget alerts are set at the estimated "
                f"${run.budget_usd:,.2f} (50/80/100 %).",
            )
        deps.notifier.post(report.to_message(channel=channel, thread_ts=thread_ts, run_id=run_id))
        if not report.ok:
            failed = ", ".join(r.name for r in report.results if r.status == preflight.Status.FAIL)
            move_run(session, run, RunState.PREFLIGHT_FAILED, now=now, reason=f"{failed} failed")
            deps.journal.record("run_finished", run_id, state="PREFLIGHT_FAILED", reason=run.reason)
        elif report.needs_confirmation or not launch:
            move_run(session, run, RunState.AWAITING_CONFIRMATION, now=now)
        else:
            move_run(session, run, RunState.LAUNCHING, now=now)
        refresh_card(deps, session, run)
        state, budget = run.state, run.budget_usd
    if state == RunState.LAUNCHING:
        _budget_then_launch(deps, run_id, budget=budget, thresholds=spec.budget.thresholds)


def _budget_then_launch(
    deps: Deps, run_id: str, *, budget: float | None, thresholds: Sequence[int]
) -> None:
    """Every way into LAUNCHING (checks passed, or a person confirmed) gets the cloud budget."""
    if budget:
        _cloud_budget(deps, run_id, budget, thresholds)
    launch_attempt(deps, run_id)


def _cloud_budget(deps: Deps, run_id: str, usd: float, thresholds: Sequence[int]) -> None:
    """Where the provider has budgets (AWS Budgets), the run's budget alert lives there too."""
    if not deps.provider.capabilities.cloud_budgets:
        return
    try:
        name = deps.provider.create_budget(run_id=run_id, usd=usd, thresholds=list(thresholds))
    except ProviderError as exc:
        with session_scope(deps.engine) as session:
            say(deps, get_run(session, run_id), "error", f"Cloud budget not created: {exc}")
        return
    deps.journal.record("cloud_budget", run_id, name=name, usd=usd)


def _code_root() -> str:
    """Where this checkout's packages live, for local processes (dry run, local instances)."""
    root = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def confirm(deps: Deps, run_id: str, actor: Actor) -> Run:
    """ "Launch anyway" after preflight warnings."""
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        _may_touch(actor, run)
        if run.state != RunState.AWAITING_CONFIRMATION:
            raise ConflictError(f"{run.id} is {run.state.value}, not waiting for confirmation")
        move_run(session, run, RunState.LAUNCHING, now=now)
        say(deps, run, "info", f"{actor.user} confirmed the launch despite the warnings.")
        refresh_card(deps, session, run)
        budget, thresholds = run.budget_usd, spec_of(run).budget.thresholds
        detach(session, run)
    deps.background(_budget_then_launch, deps, run_id, budget=budget, thresholds=thresholds)
    return run


def stop(deps: Deps, run_id: str, actor: Actor, *, reason: str | None = None) -> Run:
    """Stop a run deliberately: its runner flushes a checkpoint, the instance goes away."""
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        _may_touch(actor, run)
        if run.state.is_terminal():
            raise ConflictError(f"{run.id} is already {run.state.value}")
        attempt = active_attempt(session, run.id)
        move_run(
            session, run, RunState.STOPPED, now=now, reason=reason or f"stopped by {actor.user}"
        )
        deps.journal.record("run_finished", run.id, state="STOPPED", by=actor.user)
        say(deps, run, "info", f"{actor.user} stopped {run.id}; the instance is shutting down.")
        refresh_card(deps, session, run)
        attempt_id = attempt.id if attempt else None
        detach(session, run)
    if attempt_id is not None:
        deps.background(
            end_attempt, deps, attempt_id, state=AttemptState.TERMINATED, reason="stopped"
        )
    return run


def resubmit(deps: Deps, run_id: str, actor: Actor) -> Run:
    """Launch a run again from its newest checkpoint (or confirm one awaiting it)."""
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        _may_touch(actor, run)
        state = run.state
    if state == RunState.AWAITING_CONFIRMATION:
        return confirm(deps, run_id, actor)
    if state not in (
        RunState.STOPPED,
        RunState.FAILED,
        RunState.BUDGET_EXCEEDED,
        RunState.RECOVERING,
    ):
        raise ConflictError(
            f"{run_id} is {state.value}; only a stopped, failed or recovering run "
            "can be resubmitted"
        )
    if state != RunState.RECOVERING:
        # A finished run is final: resubmitting starts a new run that resumes its checkpoints.
        with session_scope(deps.engine) as session:
            old = get_run(session, run_id)
            now = deps.clock()
            run = Run(
                id=new_id("r"),
                spec_name=old.spec_name,
                spec=old.spec,
                requester=actor.user,
                channel=old.channel,
                checkpoint_uri=old.checkpoint_uri,
                # The new run resumes the old run's checkpoints: same store directory.
                checkpoint_prefix=checkpoint_prefix(old),
                budget_usd=old.budget_usd,
                target_steps=old.target_steps,
                last_committed_step=old.last_committed_step,
                checkpoint_interval_s=old.checkpoint_interval_s,
                created_at=now,
                updated_at=now,
            )
            session.add(run)
            session.flush()
            move_run(session, run, RunState.PREFLIGHT, now=now)
            move_run(session, run, RunState.LAUNCHING, now=now, reason=f"resubmit of {old.id}")
            ref = deps.notifier.post(card(session, run))
            run.thread_ts = ref.ts
            session.add(run)
            session.flush()
            detach(session, run)
        deps.background(launch_attempt, deps, run.id)
        return run
    deps.background(launch_attempt, deps, run_id)
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        detach(session, run)
        return run


# ----------------------------------------------------------------------------- queries


def status(deps: Deps, run_id: str | None, actor: Actor) -> list[RunCard]:
    with session_scope(deps.engine) as session:
        if run_id is not None:
            run = get_run(session, run_id)
            _may_see(actor, run)
            return [card(session, run)]
        runs = session.exec(
            select(Run)
            .where(Run.channel == actor.channel)
            .order_by(col(Run.created_at).desc())
            .limit(10)
        ).all()
        return [card(session, r) for r in runs if not r.state.is_terminal()] or [
            card(session, r) for r in runs[:3]
        ]


def list_runs(deps: Deps, scope: str, actor: Actor) -> list[RunCard]:
    with session_scope(deps.engine) as session:
        q = select(Run).order_by(col(Run.created_at).desc()).limit(50)
        if not actor.is_admin:
            q = q.where(col(Run.channel).in_(sorted(actor.visible)))
        if scope == "mine":
            q = q.where(Run.requester == actor.user)
        runs = session.exec(q).all()
        if scope == "active":
            runs = [r for r in runs if not r.state.is_terminal()]
        return [card(session, r) for r in runs]


def logs(deps: Deps, run_id: str, actor: Actor, *, lines: int = 30) -> str:
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        _may_see(actor, run)
        attempt = (
            active_attempt(session, run.id)
            or session.exec(
                select(Attempt).where(Attempt.run_id == run.id).order_by(col(Attempt.number).desc())
            ).first()
        )
        if attempt is None or attempt.instance_id is None:
            raise NotFound(f"{run.id} has no instance yet, so no logs")
        instance_id = attempt.instance_id
    if not deps.provider.capabilities.instance_logs:
        raise NotFound(f"the {deps.provider.name} provider keeps logs on the instance")
    try:
        return deps.provider.instance_log(instance_id, lines=lines)
    except InstanceNotFound:
        raise NotFound(f"no log for instance {instance_id} yet") from None


def _may_see_alert(session: Session, actor: Actor, alert_id: str) -> None:
    alert = session.get(Alert, alert_id)
    if alert is None:
        return  # the alerts module says so in its own words
    channel = alert.message_channel
    if channel is None and alert.run_id is not None:
        run = session.get(Run, alert.run_id)
        channel = run.channel if run is not None else None
    if not actor.sees(channel):
        raise NotFound(f"no alert {alert_id} in this channel; acknowledge it where it was posted")


def acknowledge(deps: Deps, alert_id: str, actor: Actor) -> Alert:
    with session_scope(deps.engine) as session:
        _may_see_alert(session, actor, alert_id)
        alert = alerts.acknowledge(
            session, alert_id, user=actor.user, now=deps.clock(), notifier=deps.notifier,
            journal=deps.journal,
        )  # fmt: skip
        detach(session, alert)
        return alert


def snooze(deps: Deps, alert_id: str, seconds: int, actor: Actor) -> Alert:
    with session_scope(deps.engine) as session:
        _may_see_alert(session, actor, alert_id)
        alert = alerts.snooze(
            session, alert_id, user=actor.user, seconds=seconds, now=deps.clock(),
            notifier=deps.notifier, journal=deps.journal,
        )  # fmt: skip
        detach(session, alert)
        return alert


def spend_report(deps: Deps, period: str, actor: Actor) -> dict[str, Any]:
    with session_scope(deps.engine) as session:
        spend.accrue(session, now=deps.clock())
        return spend.spend_report(
            session,
            channel=actor.channel,
            period=period,
            now=deps.clock(),
            tz=ZoneInfo(deps.settings.timezone),
        )


def budgets(deps: Deps, actor: Actor) -> list[dict[str, Any]]:
    """Each active run's budget and spend, for `/train budget`."""
    out = []
    with session_scope(deps.engine) as session:
        spend.accrue(session, now=deps.clock())
        runs = session.exec(select(Run).where(Run.channel == actor.channel)).all()
        for run in runs:
            if run.state.is_terminal() and run.state != RunState.BUDGET_EXCEEDED:
                continue
            spent = spend.run_spent(session, run.id)
            out.append(
                {
                    "run_id": run.id,
                    "budget_usd": run.budget_usd,
                    "spent_usd": round(spent, 2),
                    "pct": round(100 * spent / run.budget_usd, 1) if run.budget_usd else None,
                    "state": run.state.value,
                }
            )
    return out


def oncall(deps: Deps, user: str | None, actor: Actor) -> str | None:
    """Show (or set) who is on call for this channel."""
    with session_scope(deps.engine) as session:
        row = session.get(OnCall, actor.channel)
        if user is None:
            return row.user if row else None
        if row is None:
            row = OnCall(channel=actor.channel, user=user, set_by=actor.user, set_at=deps.clock())
        else:
            row.user, row.set_by, row.set_at = user, actor.user, deps.clock()
        session.add(row)
        return user


def cleanup(deps: Deps, run_id: str, actor: Actor, *, dry_run: bool = False) -> dict[str, Any]:
    """Prune one run's checkpoints by its retention policy now."""
    from jobs.tasks import prune_run

    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        _may_see(actor, run)
        if not dry_run:
            _may_touch(actor, run)
    return prune_run(deps, run_id, dry_run=dry_run)


def specs(deps: Deps) -> list[str]:
    return list_specs(deps.settings.specs_dir)


def remember_command(deps: Deps, key: str, kind: str) -> bool:
    """Record a command key; False when it was seen before (a replayed request)."""
    with session_scope(deps.engine) as session:
        if session.get(CommandLog, key) is not None:
            return False
        session.add(CommandLog(key=key, kind=kind, created_at=utcnow()))
        try:
            session.flush()
        except ConflictError:
            return False
    return True


def wait_for(deps: Deps, run_id: str, states: set[RunState], *, timeout_s: float) -> RunState:
    """Block until a run reaches one of ``states`` (the demo and tests)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with session_scope(deps.engine) as session:
            state = get_run(session, run_id).state
        if state in states or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


__all__ = [
    "PREFLIGHT_ONLY",
    "Actor",
    "SpecError",
    "acknowledge",
    "budgets",
    "cleanup",
    "confirm",
    "list_runs",
    "logs",
    "oncall",
    "resubmit",
    "resume_preflights",
    "snooze",
    "spend_report",
    "status",
    "stop",
    "submit",
]
