"""Reconcile: compare the provider's instances with the database and repair the difference.

The scheduled backstop for everything the event path can miss: it adopts instances a
crash left unrecorded, ends attempts whose instance ended or went silent, terminates
instances no live attempt owns, moves to RUNNING the runs whose attempt runs, and
launches runs whose backoff is over. It also evaluates the rules that no event triggers
(:mod:`jobs.runs.watch`: a hung run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlmodel import col, select

from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.preflight import live_dry_run_ids
from jobs.process.deps import Deps
from jobs.providers.base import (
    InstanceInfo,
    InstanceNotFound,
    InstanceState,
    Provider,
    ProviderError,
)
from jobs.rules import Trigger, evaluate_all, rules_on
from jobs.runs.cards import flag_unreadable_spec, raise_signals, refresh_card, run_context
from jobs.runs.end import end_attempt, terminate_instance
from jobs.runs.kept import expire_kept, kept_attempt_ids
from jobs.runs.launch import launch_attempt, provision
from jobs.runs.recovery import recovers_from, resubmit_if_due
from jobs.runs.rows import active_attempt, latest_attempt, move_run, watched_spec
from jobs.runs.watch import watch_running
from jobs.spec import AlertThresholds, stored_section

log = logging.getLogger(__name__)

#: How long an attempt may sit REQUESTED without an instance before reconcile relaunches
#: it (the launch is idempotent, so this adopts an instance a crash left unrecorded).
ADOPT_AFTER_S = 20.0


@dataclass(frozen=True)
class _Live:
    """What reconcile needs of a live attempt, read in one transaction."""

    attempt_id: str
    run_id: str
    instance_id: str | None
    created_at: datetime
    #: The name of the provider it was launched on.
    provider: str
    #: Last sign of life: heartbeat, else start, else creation.
    seen: datetime
    heartbeat_deadline_s: float


def reconcile(deps: Deps) -> dict[str, int]:
    """Compare every configured provider's instances with the database and repair the
    difference; a provider that cannot list its instances now is left for the next time
    (its attempts too), the others are reconciled."""
    now = deps.clock()
    counts = {"adopted": 0, "ended": 0, "orphans": 0, "launched": 0, "lost": 0}
    # Kept instances whose time is up (debug.keep_failed_instance): they bill until they
    # go; one the provider refused to terminate now stays kept, for the next pass.
    counts["released"] = expire_kept(deps, now=now)
    with session_scope(deps.engine) as session:
        rows = session.exec(
            select(Attempt, Run)
            .join(Run, col(Run.id) == col(Attempt.run_id))
            .where(
                col(Attempt.state).in_(
                    [AttemptState.REQUESTED, AttemptState.PROVISIONING, AttemptState.RUNNING]
                )
            )
        ).all()
        live = {
            a.id: _Live(
                attempt_id=a.id,
                run_id=a.run_id,
                instance_id=a.instance_id,
                created_at=a.created_at,
                provider=a.provider,
                seen=a.last_heartbeat or a.started_at or a.created_at,
                heartbeat_deadline_s=stored_section(
                    r.spec, AlertThresholds, run_id=r.id
                ).heartbeat_deadline_s,
            )
            for a, r in rows
        }
        # A preflight dry run's instance is tagged with the dry run's id, not an attempt's;
        # a kept instance (debug.keep_failed_instance) with its failed attempt's.
        dry_runs = live_dry_run_ids(session) | kept_attempt_ids(session)
    for provider in deps.providers.values():
        mine = [a for a in live.values() if a.provider == provider.name]
        _reconcile_provider(deps, provider, mine, dry_runs, counts, now=now)
    strays = sorted({a.provider for a in live.values()} - set(deps.providers))
    if strays:
        log.warning(
            "reconcile: live attempts on providers this control plane does not configure "
            "(%s): add them to TRAINBOT_PROVIDERS to watch them",
            ", ".join(strays),
        )
    counts["running"] = _running_runs(deps, now=now)
    counts["watched"] = watch_running(deps, now=now)
    counts["launched"] += _launch_due(deps, now=now)
    return counts


def _reconcile_provider(
    deps: Deps,
    provider: Provider,
    live: list[_Live],
    dry_runs: set[str],
    counts: dict[str, int],
    *,
    now: datetime,
) -> None:
    """Reconcile one provider's instances with its live attempts (``live``)."""
    try:
        instances = provider.list_instances()
    except ProviderError as exc:
        log.warning("reconcile could not list the %s instances: %s", provider.name, exc)
        return
    by_attempt = {i.attempt_id: i for i in instances}
    owners = {a.attempt_id for a in live}
    # Orphans: tagged by us, owned by no live attempt. One whose ended attempt is having
    # it terminated already (end_attempt does that off its caller's thread) is left to it.
    for inst in instances:
        owned = inst.attempt_id in owners or inst.attempt_id in dry_runs
        orphan = not owned and not inst.state.is_terminal()
        if orphan and terminate_instance(
            deps, inst.instance_id, wait=False, provider=provider.name
        ):
            deps.journal.record("orphan_terminated", inst.run_id, instance=inst.instance_id)
            counts["orphans"] += 1
    for a in live:
        if a.instance_id is None:
            if a.attempt_id in by_attempt and _record_instance(deps, by_attempt[a.attempt_id]):
                counts["adopted"] += 1
            elif a.attempt_id in by_attempt or (now - a.created_at).total_seconds() > ADOPT_AFTER_S:
                provision(deps, a.attempt_id)  # idempotent launch: adopts what is there
                counts["adopted"] += 1
            continue
        try:
            status = provider.status(a.instance_id)
        except InstanceNotFound:
            end_attempt(deps, a.attempt_id, state=AttemptState.LOST, reason="instance vanished")
            counts["lost"] += 1
            continue
        ended = _ENDED_BY_PROVIDER.get(status.state)
        if ended is not None:
            end_attempt(
                deps, a.attempt_id, state=ended, exit_code=status.exit_code, reason=status.reason
            )
            counts["ended"] += 1
        elif (now - a.seen).total_seconds() > a.heartbeat_deadline_s:
            _lost_heartbeat(deps, a.attempt_id, now=now, since=a.seen)
            counts["lost"] += 1


def _running_runs(deps: Deps, *, now: datetime) -> int:
    """Runs still LAUNCHING or RECOVERING whose attempt is RUNNING: the ingest API moves the
    attempt in the transaction that stores its ``started`` event and the run right after
    the commit, so a control plane killed in between leaves the run behind, and the
    runner, whose batch was stored, never sends that event again."""
    moved = 0
    with session_scope(deps.engine) as session:
        rows = session.exec(
            select(Run)
            .join(Attempt, col(Attempt.run_id) == col(Run.id))
            .where(
                col(Run.state).in_([RunState.LAUNCHING, RunState.RECOVERING]),
                Attempt.state == AttemptState.RUNNING,
            )
        ).all()
        for run in {r.id: r for r in rows}.values():
            if move_run(session, run, RunState.RUNNING, now=now):
                deps.journal.record("run_running", run.id, by="reconcile")
                refresh_card(deps, session, run)
                moved += 1
    return moved


def _record_instance(deps: Deps, inst: InstanceInfo) -> bool:
    """Record the instance of an attempt that its runner reported started while its
    launcher died before recording it (REQUESTED attempts go through ``provision``).
    Whether it was recorded here."""
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, inst.attempt_id, with_for_update=True)
        if attempt is None or attempt.state == AttemptState.REQUESTED:
            return False
        if attempt.instance_id is None:
            attempt.instance_id = inst.instance_id
            attempt.zone = inst.zone or attempt.zone
            session.add(attempt)
            deps.journal.record(
                "instance_adopted", attempt.run_id, attempt_id=attempt.id, instance=inst.instance_id
            )
        return True


_ENDED_BY_PROVIDER = {
    InstanceState.PREEMPTED: AttemptState.PREEMPTED,
    InstanceState.SUCCEEDED: AttemptState.SUCCEEDED,
    InstanceState.FAILED: AttemptState.FAILED,
    InstanceState.TERMINATED: AttemptState.TERMINATED,
    # A node of a gang ended without notice: resumed from the last commit, as a preemption.
    InstanceState.LOST: AttemptState.LOST,
}


def _lost_heartbeat(deps: Deps, attempt_id: str, *, now: datetime, since: datetime) -> None:
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        run = session.get(Run, attempt.run_id) if attempt else None
        if attempt is None or run is None:
            return
        thresholds = stored_section(run.spec, AlertThresholds, run_id=run.id)
        signals = evaluate_all(
            rules_on(Trigger.SILENT, thresholds),
            [],
            now=now.timestamp(),
            ctx=run_context(session, run, attempt, now=now),
        )
        raise_signals(deps, session, run, signals, now=now)
    silent = int((now - since).total_seconds())
    end_attempt(deps, attempt_id, state=AttemptState.LOST, reason=f"no heartbeat for {silent} s")


def _launch_due(deps: Deps, *, now: datetime) -> int:
    """Runs waiting for an attempt whose backoff is over (the backstop for lost timers)."""
    due: list[str] = []
    #: Runs whose last attempt was preempted, lost or restarts after its exit code
    #: (:func:`recovers_from`): relaunched as a resubmit, so the record, the lost work
    #: and the alert are the same whichever of the timer and this backstop gets there
    #: first.
    resubmits: dict[str, str] = {}
    with session_scope(deps.engine) as session:
        runs = session.exec(
            select(Run).where(col(Run.state).in_([RunState.LAUNCHING, RunState.RECOVERING]))
        ).all()
        for run in runs:
            if active_attempt(session, run.id) is not None:
                continue
            spec = watched_spec(run)
            if spec is None:  # a launch needs the whole spec
                flag_unreadable_spec(deps, session, run, now=now)
                continue
            prev = latest_attempt(session, run.id)
            backoff = timedelta(seconds=spec.resubmit.backoff_s)
            if prev is None or prev.ended_at is None or now - prev.ended_at >= backoff:
                due.append(run.id)
                if prev is not None and run.state == RunState.RECOVERING and recovers_from(prev):
                    resubmits[run.id] = prev.id
    launched = 0
    for run_id in due:
        if run_id in resubmits:
            if resubmit_if_due(deps, resubmits[run_id]):
                launched += 1
        elif launch_attempt(deps, run_id) is not None:
            launched += 1
    return launched
