"""A run's recovery: the next attempt of the *same* run after a preemption, or after an
exit code its spec lists (``resubmit.recover_on_exit_codes``), and the work it lost.

:func:`jobs.runs.end.end_attempt` records the lost work, moves the run to RECOVERING and
defers :func:`resubmit_if_due` by the backoff (a row in ``deferred_work``, which the
leader runs if this replica dies first); reconcile's backstop calls it too, and a
person's ``/train resubmit`` of a recovering run calls it at once
(:func:`next_attempt_now`). Whichever comes second finds the next attempt launched and
does nothing. A resubmit that starts a *new* run (of a stopped, failed or capped one) is
the use-case :mod:`jobs.usecases.resubmits`, which calls this module and is never called
by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlmodel import Session, col, select

from jobs.background.deferred import Later, deferrable
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Checkpoint, Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.deps import Deps
from jobs.rules import Obs, Trigger, evaluate_all, rules_on
from jobs.runs.cards import alert_config, raise_signals, run_context
from jobs.runs.launch import launch_attempt, placement_record
from jobs.runs.rows import active_attempt, latest_attempt, spec_of
from jobs.spec import ResubmitPolicy, stored_section


@dataclass(frozen=True)
class Restart:
    """Whether an attempt that exited with an error restarts, and what the thread says."""

    #: True: the run resumes from its newest checkpoint after the backoff.
    allowed: bool
    #: Why, for the thread ("exit 134 is listed in …: restart 1 of 2 from step 40");
    #: "" for an exit code that is not listed (the failure says enough).
    text: str
    #: This restart's number, and how many the spec allows.
    number: int = 0
    limit: int = 0
    backoff_s: float = 0.0


def restart_on_error(
    session: Session, run: Run, attempt: Attempt, exit_code: int | None
) -> Restart:
    """An attempt failed with ``exit_code``: restart the run when the code is listed in
    ``resubmit.recover_on_exit_codes`` and fewer than ``max_restarts_on_errors`` restarts
    were made. Restarts made: the run's other attempts that ran and exited with an error
    (only a restart follows one, so each is one). Preemptions and capacity refusals are
    not counted here."""
    policy = stored_section(run.spec, ResubmitPolicy, run_id=run.id)
    if exit_code is None or exit_code not in policy.recover_on_exit_codes:
        return Restart(allowed=False, text="")
    made = len(
        session.exec(
            select(Attempt.id).where(
                Attempt.run_id == run.id,
                Attempt.id != attempt.id,
                Attempt.state == AttemptState.FAILED,
                col(Attempt.exit_code).is_not(None),
            )
        ).all()
    )
    limit = policy.max_restarts_on_errors
    listed = f"exit {exit_code} is listed in resubmit.recover_on_exit_codes"
    if made >= limit:
        return Restart(
            allowed=False,
            text=f"{listed}, but the {limit} restart(s) resubmit.max_restarts_on_errors "
            "allows are used",
            number=made,
            limit=limit,
        )
    step = run.last_committed_step
    source = f"from step {step}" if step is not None else "from the start (no checkpoint yet)"
    return Restart(
        allowed=True,
        text=f"Attempt {attempt.number} of {run.id} exited {exit_code}: {listed}: restart "
        f"{made + 1} of {limit} {source}.",
        number=made + 1,
        limit=limit,
        backoff_s=policy.backoff_s,
    )


def record_lost_work(session: Session, run: Run, attempt: Attempt, *, now: datetime) -> None:
    """The steps and paid seconds an ending attempt did since its last committed checkpoint."""
    committed = run.last_committed_step or 0
    reached = attempt.last_step or committed
    attempt.lost_steps = max(0, reached - committed)
    if attempt.step_time_s:
        attempt.lost_seconds += attempt.lost_steps * attempt.step_time_s
    else:
        last_commit = session.exec(
            select(Checkpoint)
            .where(Checkpoint.attempt_id == attempt.id)
            .order_by(col(Checkpoint.committed_at).desc())
        ).first()
        since = last_commit.committed_at if last_commit else attempt.started_at
        attempt.lost_seconds += max(0.0, (now - since).total_seconds()) if since else 0.0


@deferrable(Later.RESUBMIT)
def resubmit_if_due(deps: Deps, previous_attempt_id: str) -> bool:
    """Launch the next attempt after a preemption (or a restart after a listed exit code),
    reporting the work lost.

    Called by the backoff timer, by reconcile's backstop and by a person's resubmit of
    the recovering run; whichever comes second finds the attempt launched and does
    nothing. So does a late timer of an earlier attempt (its successor launched, and
    ended, meanwhile): the next attempt follows the latest one, after its own backoff.
    True when this call launched it.
    """
    with session_scope(deps.engine) as session:
        prev = session.get(Attempt, previous_attempt_id)
        run = session.get(Run, prev.run_id) if prev else None
        if prev is None or run is None or run.state != RunState.RECOVERING:
            return False
        if active_attempt(session, run.id) is not None:
            return False
        latest = latest_attempt(session, run.id)
        if latest is not None and latest.id != prev.id:
            return False
        run_id = run.id
    attempt = launch_attempt(deps, run_id)
    if attempt is None:
        return False
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id)
        prev = session.get(Attempt, previous_attempt_id)
        assert run is not None and prev is not None
        deps.journal.record(
            "resubmitted",
            run.id,
            **placement_record(attempt),
            lost_steps=prev.lost_steps,
            lost_seconds=round(prev.lost_seconds, 3),
        )
        spec = spec_of(run)
        obs = [
            Obs(
                time=now.timestamp(),
                type="resubmitted",
                data={
                    "attempt": attempt.number,
                    "lost_steps": prev.lost_steps,
                    "lost_seconds": prev.lost_seconds,
                    "zone": attempt.zone or "",
                },
            )
        ]
        signals = evaluate_all(
            rules_on(Trigger.RESUBMITTED, alert_config(spec)),
            obs,
            now=now.timestamp(),
            ctx=run_context(session, run, attempt, now=now),
        )
        raise_signals(deps, session, run, signals, now=now)
    return True


def next_attempt_now(deps: Deps, run_id: str) -> bool:
    """A recovering run's next attempt now instead of after its backoff (a person's
    ``/train resubmit``), launched and reported as the timer would launch it: the
    record, the lost work and the alert are the same, and the timer, when it fires,
    finds it launched. A run that recovers from a launch the cloud refused (no capacity)
    lost no work: its next try is a plain launch, as the retry's. True when this call
    launched it."""
    with session_scope(deps.engine) as session:
        prev = latest_attempt(session, run_id)
        prev_id = prev.id if prev is not None and recovers_from(prev) else None
    if prev_id is None:
        return launch_attempt(deps, run_id) is not None
    return resubmit_if_due(deps, prev_id)


def recovers_from(attempt: Attempt) -> bool:
    """Whether the run's next attempt is a resubmit after ``attempt``: it was preempted
    or lost, or exited with a code (a listed one: the run would have failed otherwise);
    not a launch the cloud refused, which ran nothing."""
    if attempt.state in (AttemptState.PREEMPTED, AttemptState.LOST):
        return True
    return attempt.state == AttemptState.FAILED and attempt.exit_code is not None
