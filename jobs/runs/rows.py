"""A run's rows: reading the run and its attempts, and moving the run's state.

What every other module of ``jobs.runs`` (and the service and the scheduled jobs)
reads the same way: the stored spec, the run's channel and checkpoint prefix, its
live and latest attempt.
"""

from __future__ import annotations

import logging
from datetime import datetime

from pydantic import ValidationError
from sqlmodel import Session, col, select

from jobs.database.models import Attempt, Run
from jobs.domain.errors import NotFound
from jobs.domain.lifecycle import RunState, transition
from jobs.preflight.findings import DryRunFindings
from jobs.spec import JobSpec

log = logging.getLogger(__name__)


def checkpoint_prefix(run: Run) -> str:
    """A run's checkpoints live in ``{checkpoint_uri}/{prefix}``: its own id, unless it
    resumes another run's checkpoints (a resubmit of a finished run). Only trainbot
    writes ``Run.checkpoint_prefix``; a spec cannot name it."""
    return run.checkpoint_prefix or run.id


def run_hours(session: Session, run: Run, *, now: datetime) -> float:
    """Hours the run's instances have run so far, every attempt, with the hours it
    carries from the runs it resubmits (what ``max_hours`` caps)."""
    attempts = session.exec(
        select(Attempt).where(Attempt.run_id == run.id, col(Attempt.started_at).is_not(None))
    ).all()
    seconds = sum(
        max(0.0, ((a.ended_at or now) - a.started_at).total_seconds())
        for a in attempts
        if a.started_at is not None
    )
    return (run.carried_hours or 0.0) + seconds / 3600.0


def dry_run_findings(run: Run) -> DryRunFindings:
    """What preflight's dry run measured for ``run``, and the interval it chose (every
    figure None without one), read from the stored report, old rows too."""
    return DryRunFindings.stored(run.preflight)


def spec_of(run: Run) -> JobSpec:
    """The whole stored spec, validated: what a launch needs. To watch a run, read one
    section leniently with :func:`jobs.spec.stored_section` instead."""
    return JobSpec.model_validate(run.spec)


def watched_spec(run: Run) -> JobSpec | None:
    """The whole stored spec for a pass over every run (reconcile, spend, cleanup), or
    ``None`` when it no longer validates: that one run is skipped, with a warning naming
    it (:func:`jobs.runs.cards.flag_unreadable_spec` tells its thread), and the pass goes
    on for the others instead of stopping at the first bad row."""
    try:
        return JobSpec.model_validate(run.spec)
    except ValidationError as exc:
        log.warning(
            "run %s: its stored spec no longer validates (%d problem(s)); the watch paths "
            "skip what needs the whole spec",
            run.id,
            len(exc.errors()),
        )
        return None


def channel_of(run: Run) -> str:
    return run.channel or "trainbot"


def active_attempt(session: Session, run_id: str) -> Attempt | None:
    rows = session.exec(
        select(Attempt).where(Attempt.run_id == run_id).order_by(col(Attempt.number).desc())
    ).all()
    for a in rows:
        if not a.state.is_terminal():
            return a
    return None


def latest_attempt(session: Session, run_id: str) -> Attempt | None:
    return session.exec(
        select(Attempt).where(Attempt.run_id == run_id).order_by(col(Attempt.number).desc())
    ).first()


def move_run(
    session: Session, run: Run, target: RunState, *, now: datetime, reason: str | None = None
) -> bool:
    """Transition a run if it is not already there; returns whether it moved."""
    if run.state == target:
        return False
    run.state = transition(run.state, target, subject_id=run.id)
    run.updated_at = now
    if reason is not None:
        run.reason = reason
    if target.is_terminal():
        run.ended_at = now
    session.add(run)
    return True


def get_run(session: Session, run_id: str) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"no run {run_id}: `/train list all` shows the runs this channel has")
    return run
