"""Use-cases behind every chat command: plain functions of (deps, …).

The chat front ends (console, Slack) parse a command, call one of these, and render
what it returns. Slow work (preflight, launch) runs in the background and reports into
the run's thread; the command returns at once. Errors are ``jobs.domain.errors`` exceptions
whose messages are written for the person who typed the command.

The boundary: a run's states are :mod:`jobs.domain.lifecycle`'s; what moves a run through its
attempts (launch, runner events, end, resubmit, reconcile) is :mod:`jobs.runs`; this
module is only what a person asks for; :mod:`jobs.background.tasks` is what the scheduler runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlmodel import select

from jobs import preflight, spend
from jobs.database.db import detach, session_scope
from jobs.database.models import Run, new_id
from jobs.domain.actor import Actor, may_touch, report_channel
from jobs.domain.errors import ConflictError, SpecError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.domain.locations import checkpoint_root
from jobs.process.deps import Deps
from jobs.runs import (
    active_attempt,
    capacity,
    card,
    end_attempt,
    get_run,
    move_run,
    refresh_card,
    say,
)
from jobs.runs.start import PREFLIGHT_ONLY, confirm, preflight_then_launch
from jobs.spec import Resources, spec_from_text, stored_section
from jobs.spec.origin import SpecOrigin
from jobs.spec.sources import Catalog, catalog_for, load_spec_for, names_for
from jobs.usecases.channel_ops import (
    LIST_LIMIT,
    acknowledge,
    budgets,
    cleanup,
    list_runs,
    logs,
    oncall,
    remember_command,
    snooze,
    spend_report,
    status,
    wait_for,
)
from jobs.usecases.code_pin import pin_code
from jobs.usecases.resubmits import resubmit

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
    spec_text: str | None = None,
) -> Run:
    """Create a run and start its preflight in the background; a repeated key returns
    the run the first request created, so a retried command launches once. ``spec_text``:
    a spec file's text (the command-line client's, or pasted in the Slack modal), named
    ``spec_name``, instead of the spec of that name in the configured sources."""
    if spec_text is not None:
        spec = spec_from_text(spec_text, name=spec_name, overrides=overrides)
        spec = spec.model_copy(update={"origin": SpecOrigin(kind="text")})
    else:
        # From the configured sources; a repository's branch is fetched now, and the
        # commit read is recorded in the spec's origin.
        spec = load_spec_for(deps.settings, spec_name, overrides=overrides)
    # The code's ref, pinned to its commit now: every attempt and node runs that one.
    spec = pin_code(spec)
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


def specs(deps: Deps) -> list[str]:
    """The names the launch form offers, asking no repository (the form must open at once)."""
    return names_for(deps.settings)


def spec_catalog(deps: Deps) -> Catalog:
    """``/train specs``: what each configured source holds now (repositories fetched)."""
    return catalog_for(deps.settings)


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
        capacity.end_wait(deps, session, run, why=f"stopped by {actor.user}")
        say(deps, run, "info", f"{actor.user} stopped {run.id}; the instance is shutting down.")
        refresh_card(deps, session, run)
        attempt_id = attempt.id if attempt else None
        dry_run_provider = deps.provider_or_default(
            stored_section(run.spec, Resources, run_id=run.id)
        )
        detach(session, run)
    # On the stop lane, never behind other background work: a dry run under way ends
    # (its token revoked, its instance terminated), and so does the attempt's instance.
    deps.urgent(
        preflight.stop_dry_runs,
        deps.engine,
        dry_run_provider,
        run_id,
        pid_file=deps.settings.state_dir / "preflight" / run_id / preflight.DRY_RUN_PID_FILE,
        reason=f"{run_id} was stopped by {actor.user}",
        clock=deps.clock,
    )
    if attempt_id is not None:
        deps.urgent(end_attempt, deps, attempt_id, state=AttemptState.TERMINATED, reason="stopped")
    else:
        # No attempt to end (stopped before its launch): its cloud budget goes now, as
        # end_attempt would have it go.
        deps.background(spend.remove_cloud_budgets, deps, now=now, run_ids=[run_id])
    return run


def continue_profiled(
    deps: Deps, run_id: str, actor: Actor, *, budget_usd: float | None = None
) -> Run:
    """ "Continue" on a run its projection stopped: a resubmit from the checkpoint it
    stopped at (the budget raised when ``budget_usd`` is given), answered once."""
    _answer_projection(deps, run_id, actor, choice="continue")
    try:
        new = resubmit(deps, run_id, actor, budget_usd=budget_usd)
    except Exception:
        _answer_projection(deps, run_id, actor, choice=None)  # nothing continued: ask again
        raise
    deps.journal.record("profile_answered", run_id, choice="continue", by=actor.user, run=new.id)
    return new


def stop_profiled(deps: Deps, run_id: str, actor: Actor) -> Run:
    """ "Stop" on a run its projection stopped: it stays stopped, its checkpoints kept."""
    run = _answer_projection(deps, run_id, actor, choice="stop")
    deps.journal.record("profile_answered", run_id, choice="stop", by=actor.user)
    say(
        deps,
        run,
        "info",
        f"{actor.user} chose Stop: {run.id} stays stopped at step {run.last_committed_step}; "
        f"its checkpoints are kept, and /train resubmit {run.id} continues it later.",
    )
    return run


def _answer_projection(deps: Deps, run_id: str, actor: Actor, *, choice: str | None) -> Run:
    """Record the answer to a projection's question, once (None takes it back)."""
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id, with_for_update=True) or get_run(session, run_id)
        may_touch(actor, run)
        asked = dict(run.projection or {})
        if not asked.get("asked") or run.state != RunState.STOPPED:
            raise ConflictError(f"{run_id} is not waiting for Continue or Stop")
        answer = asked.get("answer")
        if choice is not None and answer:
            raise ConflictError(
                f"{answer.get('by')} already chose {answer.get('choice')} for {run_id}"
            )
        if choice is None:
            asked.pop("answer", None)
        else:
            asked["answer"] = {"choice": choice, "by": actor.user, "at": deps.clock().isoformat()}
        run.projection = asked
        session.add(run)
        detach(session, run)
        return run


__all__ = [
    "LIST_LIMIT",
    "Actor",
    "SpecError",
    "acknowledge",
    "budgets",
    "cleanup",
    "confirm",
    "continue_profiled",
    "list_runs",
    "logs",
    "oncall",
    "remember_command",
    "resubmit",
    "snooze",
    "specs",
    "spend_report",
    "status",
    "stop",
    "stop_profiled",
    "submit",
    "wait_for",
]
