"""Use-cases behind every chat command: plain functions of (deps, …).

The chat front ends (console, Slack) parse a command, call one of these, and render
what it returns. Slow work (preflight, launch) runs in the background and reports into
the run's thread; the command returns at once. Errors are ``jobs.errors`` exceptions
whose messages are written for the person who typed the command.

The boundary: a run's states are :mod:`jobs.lifecycle`'s; what moves a run through its
attempts (launch, runner events, end, resubmit, reconcile) is :mod:`jobs.runs`; this
module is only what a person asks for; :mod:`jobs.tasks` is what the scheduler runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from sqlmodel import Session, select

from jobs import format as fmt
from jobs import preflight, spend
from jobs.actor import Actor, may_touch, report_channel
from jobs.db import detach, session_scope
from jobs.deps import Deps
from jobs.errors import ConflictError, SpecError
from jobs.lifecycle import AttemptState, RunState
from jobs.locations import check_prefix, checkpoint_root
from jobs.logs import log_context
from jobs.models import Run, new_id
from jobs.queries import (
    LIST_LIMIT,
    acknowledge,
    budgets,
    cleanup,
    list_runs,
    logs,
    oncall,
    remember_command,
    snooze,
    specs,
    spend_report,
    status,
    wait_for,
)
from jobs.runs import (
    active_attempt,
    budget_then_launch,
    card,
    channel_of,
    checkpoint_prefix,
    end_attempt,
    get_run,
    launch_attempt,
    move_run,
    refresh_card,
    resource_request,
    run_hours,
    say,
    spec_of,
)
from jobs.spec import load_spec
from runner.errors import RunnerError
from runner.layout import copy_step, list_committed
from runner.store import run_store

log = logging.getLogger(__name__)


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
    channel = report_channel(deps.settings.allowed_channels, spec.notify.channel, actor)
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


#: The reason a run in PREFLIGHT carries when it was asked for the checks alone
#: (``/train preflight``): after them it waits for "Launch anyway" whatever they say.
PREFLIGHT_ONLY = "preflight only"


def resume_preflights(deps: Deps) -> list[str]:
    """Runs that a crash of the control plane left in PREFLIGHT: end the dry run it left
    behind, if any, and run the checks again. Called once at start; returns the run ids.

    Nothing else would: a run in PREFLIGHT has no attempt for reconcile to find.
    """
    from runner.pidfile import end_stale_dry_run

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
    with log_context(run_id=run_id):
        _preflight_then_launch(deps, run_id, launch=launch)


def _preflight_then_launch(deps: Deps, run_id: str, *, launch: bool) -> None:
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
                f"{fmt.usd(run.budget_usd)} ("
                + "/".join(str(t) for t in spec.budget.thresholds)
                + " %).",
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
        budget_then_launch(deps, run_id, budget=budget, thresholds=spec.budget.thresholds)


def _code_root() -> str:
    """Where this checkout's packages live, for local processes (dry run, local instances)."""
    root = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def confirm(deps: Deps, run_id: str, actor: Actor) -> Run:
    """ "Launch anyway" after preflight warnings."""
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        may_touch(actor, run)
        if run.state != RunState.AWAITING_CONFIRMATION:
            raise ConflictError(f"{run.id} is {run.state.value}, not waiting for confirmation")
        move_run(session, run, RunState.LAUNCHING, now=now)
        say(deps, run, "info", f"{actor.user} confirmed the launch despite the warnings.")
        refresh_card(deps, session, run)
        budget, thresholds = run.budget_usd, spec_of(run).budget.thresholds
        detach(session, run)
    deps.background(budget_then_launch, deps, run_id, budget=budget, thresholds=thresholds)
    return run


def stop(deps: Deps, run_id: str, actor: Actor, *, reason: str | None = None) -> Run:
    """Stop a run deliberately: its runner flushes a checkpoint, the instance goes away."""
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        may_touch(actor, run)
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
    else:
        # No attempt to end (stopped before its launch): its cloud budget goes now, as
        # end_attempt would have it go.
        deps.background(spend.remove_cloud_budgets, deps, now=now, run_ids=[run_id])
    return run


def resubmit(
    deps: Deps,
    run_id: str,
    actor: Actor,
    *,
    budget_usd: float | None = None,
    from_step: int | None = None,
) -> Run:
    """Launch a run again from its newest checkpoint (or confirm one awaiting it).

    The budget goes on: a finished run's resubmit carries its spend, and one whose hard
    cap is reached stays stopped unless ``budget_usd`` raises the budget, which is
    recorded with who raised it (the cap would otherwise be walked around by resubmitting).

    ``from_step``: resume from the newest committed checkpoint at or before that step
    instead (the offer after a divergence); see :func:`_resubmit_from`.
    """
    if budget_usd is not None and not 0 < budget_usd < float("inf"):
        raise SpecError(f"budget.usd must be a positive number of dollars (got {budget_usd})")
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        may_touch(actor, run)
        state = run.state
    if from_step is not None:
        return _resubmit_from(deps, run_id, actor, from_step=from_step, budget_usd=budget_usd)
    if state in (RunState.AWAITING_CONFIRMATION, RunState.RECOVERING) and budget_usd is not None:
        with session_scope(deps.engine) as session:
            run = get_run(session, run_id)
            spent = spend.run_spent(session, run_id)
            _raise_budget(deps, run, budget_usd, actor=actor, was=run.budget_usd, spent=spent)
            session.add(run)
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
            run, carried = _successor(
                deps,
                session,
                old,
                actor=actor,
                budget_usd=budget_usd,
                # The new run resumes the old run's checkpoints: same store directory.
                prefix=checkpoint_prefix(old),
                step=old.last_committed_step,
                reason=f"resubmit of {old.id}",
            )
            budget = run.budget_usd
            if budget_usd is None and budget is not None and carried > 0:
                say(
                    deps,
                    run,
                    "info",
                    f"{run.id} continues {old.id}: {fmt.usd(carried)} of its "
                    f"{fmt.usd(budget)} budget is already spent.",
                )
            thresholds = spec_of(run).budget.thresholds
            detach(session, run)
        # A new run: its own cloud budget, as every way into LAUNCHING gets.
        deps.background(budget_then_launch, deps, run.id, budget=budget, thresholds=thresholds)
        return run
    deps.background(launch_attempt, deps, run_id)
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        detach(session, run)
        return run


def _resubmit_from(
    deps: Deps, run_id: str, actor: Actor, *, from_step: int, budget_usd: float | None
) -> Run:
    """A new run that resumes a finished run from the newest checkpoint at or before
    ``from_step``.

    The new run gets its own checkpoint directory, and the chosen checkpoint is copied
    into it (in the background, before the launch), so that "newest" there can never be
    a later step of the run it continues: the diverged run's checkpoints stay where they
    were, untouched, for debugging. Its first attempt is also told the step
    (``TRAINBOT_RESUME_MAX_STEP``), so the runner restores it even from a shared store.
    """
    if from_step < 0:
        raise SpecError(f"from= takes a step number, 0 or more (got {from_step})")
    with session_scope(deps.engine) as session:
        old = get_run(session, run_id)
        if old.state not in (RunState.STOPPED, RunState.FAILED, RunState.BUDGET_EXCEEDED):
            raise ConflictError(
                f"{run_id} is {old.state.value}; only a stopped or failed run can be "
                f"resubmitted from a step. Stop it first: /train stop {run_id}"
            )
        last = old.last_committed_step
        if last is None:
            raise ConflictError(
                f"{run_id} has no committed checkpoint to resume from step {from_step}: "
                f"launch it again instead"
            )
        if from_step > last:
            raise ConflictError(
                f"step {from_step} is past {run_id}'s last committed checkpoint (step {last}); "
                f"give from={last} or less, or resubmit without from= to resume from step {last}"
            )
        root = checkpoint_root(
            old.checkpoint_uri,
            default=deps.settings.checkpoint_uri,
            allowed=deps.settings.checkpoint_locations,
        )
        src_prefix = check_prefix(checkpoint_prefix(old))
    src = run_store(root, src_prefix)
    try:
        committed = [e.step for e in list_committed(src)]
    except RunnerError as exc:
        raise ConflictError(
            f"cannot list {run_id}'s checkpoints in {src.uri} to resume from step "
            f"{from_step}: {exc}"
        ) from exc
    chosen = max((step for step in committed if step <= from_step), default=None)
    if chosen is None:
        have = ", ".join(str(step) for step in committed[:10]) or "none"
        raise ConflictError(
            f"{run_id} has no committed checkpoint at or before step {from_step} "
            f"(its checkpoints: {have}); give a later step"
        )
    later = [step for step in committed if step > chosen]
    with session_scope(deps.engine) as session:
        old = get_run(session, run_id)
        run, _ = _successor(
            deps,
            session,
            old,
            actor=actor,
            budget_usd=budget_usd,
            # Its own directory (no prefix): the chosen step is copied there.
            prefix=None,
            step=chosen,
            reason=f"resubmit of {old.id} from step {chosen}",
        )
        deps.journal.record(
            "resubmitted_from",
            run.id,
            from_run=old.id,
            from_step=chosen,
            asked_step=from_step,
            later_steps_kept=later,
            by=actor.user,
        )
        kept = (
            f" {old.id}'s later checkpoints (steps {', '.join(map(str, later))}) stay in "
            f"its own directory, for debugging."
            if later
            else ""
        )
        say(
            deps,
            run,
            "info",
            f"{actor.user} resubmitted {old.id} from step {chosen}"
            + (
                f" (the newest checkpoint at or before step {from_step})"
                if chosen != from_step
                else ""
            )
            + f": {run.id} starts from a copy of that checkpoint.{kept}",
        )
        say(deps, old, "info", f"{actor.user} resubmitted {old.id} from step {chosen} as {run.id}.")
        detach(session, run)
    deps.background(_copy_then_launch, deps, run.id, src_prefix=src_prefix, step=chosen)
    return run


def _copy_then_launch(deps: Deps, run_id: str, *, src_prefix: str, step: int) -> None:
    """Copy the chosen checkpoint into the new run's own directory, then launch it; a
    failed copy fails the run, saying why, rather than launching it from nothing."""
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        root = checkpoint_root(
            run.checkpoint_uri,
            default=deps.settings.checkpoint_uri,
            allowed=deps.settings.checkpoint_locations,
        )
        dst_prefix = check_prefix(checkpoint_prefix(run))
        budget, thresholds = run.budget_usd, spec_of(run).budget.thresholds
    try:
        copy_step(run_store(root, src_prefix), run_store(root, dst_prefix), step)
    except RunnerError as exc:
        with session_scope(deps.engine) as session:
            run = get_run(session, run_id)
            reason = f"could not copy checkpoint step {step} from {src_prefix}: {exc}"
            move_run(session, run, RunState.FAILED, now=deps.clock(), reason=reason)
            deps.journal.record("run_finished", run.id, state="FAILED", reason=reason)
            say(deps, run, "error", f"Run {run.id} failed: {reason}.")
            refresh_card(deps, session, run)
        return
    budget_then_launch(deps, run_id, budget=budget, thresholds=thresholds)


def _successor(
    deps: Deps,
    session: Session,
    old: Run,
    *,
    actor: Actor,
    budget_usd: float | None,
    prefix: str | None,
    step: int | None,
    reason: str,
) -> tuple[Run, float]:
    """Create the run that continues ``old``, move it to launching and post its card.

    Its budget counts what the runs before it spent; returns the run and that spend.
    """
    now = deps.clock()
    spend.accrue(session, now=now)  # the old run's last attempt, to its end
    carried, budget = spend.resubmit_budget(session, old, raised_usd=budget_usd)
    hours = run_hours(session, old, now=now)  # max_hours counts them, as the cap the spend
    run = Run(
        id=new_id("r"),
        spec_name=old.spec_name,
        spec=old.spec,
        requester=actor.user,
        channel=old.channel,
        checkpoint_uri=old.checkpoint_uri,
        checkpoint_prefix=prefix,
        budget_usd=budget,
        carried_usd=round(carried, 6) or None,
        carried_hours=round(hours, 6) or None,
        budget_raised_by=old.budget_raised_by,
        target_steps=old.target_steps,
        last_committed_step=step,
        checkpoint_interval_s=old.checkpoint_interval_s,
        created_at=now,
        updated_at=now,
    )
    session.add(run)
    session.flush()
    move_run(session, run, RunState.PREFLIGHT, now=now)
    move_run(session, run, RunState.LAUNCHING, now=now, reason=reason)
    ref = deps.notifier.post(card(session, run))
    run.thread_ts = ref.ts
    session.add(run)
    session.flush()
    if budget_usd is not None:
        _raise_budget(deps, run, budget_usd, actor=actor, was=old.budget_usd, spent=carried)
        session.add(run)
    return run, carried


def _raise_budget(
    deps: Deps, run: Run, usd: float, *, actor: Actor, was: float | None, spent: float
) -> None:
    """Set a run's budget from ``budget.usd=`` on a resubmit, as if the spec had said it
    (so a hard cap applies to it), and record who raised it: on the run, in the journal
    and in the run's thread."""
    run.budget_usd = usd
    run.budget_raised_by = actor.user
    run.spec = {**run.spec, "budget": {**(run.spec.get("budget") or {}), "usd": usd}}
    deps.journal.record(
        "budget_raised", run.id, usd=usd, was_usd=was, by=actor.user, spent_usd=round(spent, 2)
    )
    say(
        deps,
        run,
        "info",
        f"{actor.user} set the budget of {run.id} to {fmt.usd(usd)} (was {fmt.usd(was)}); "
        f"{fmt.usd(spent)} is already spent.",
    )


__all__ = [
    "LIST_LIMIT",
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
    "remember_command",
    "resubmit",
    "resume_preflights",
    "snooze",
    "specs",
    "spend_report",
    "status",
    "stop",
    "submit",
    "wait_for",
]
