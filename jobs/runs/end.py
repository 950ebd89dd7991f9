"""Ending an attempt: revoke its token, terminate its instance, move the run on.

Whoever sees the end first (the runner's exit event, reconcile, a person's stop)
calls :func:`end_attempt`; later callers find the attempt ended and do nothing. The
instance is terminated by script, never left to memory, one termination at a time.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlmodel import Session

from jobs.background.deferred import Later
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.lifecycle import AttemptState, RunState, transition
from jobs.outbound.notify import ProjectionMessage
from jobs.process.deps import Deps
from jobs.providers.base import InstanceNotFound, InstanceState, ProviderError
from jobs.rules import Obs, Trigger, evaluate_all, rules_on
from jobs.runs.cards import raise_signals, refresh_card, run_context, say
from jobs.runs.fence import check_fence
from jobs.runs.kept import keep_failed
from jobs.runs.profile import project
from jobs.runs.recovery import record_lost_work, restart_on_error
from jobs.runs.rows import move_run
from jobs.spec import AlertThresholds, ResubmitPolicy, stored_section
from jobs.spend import remove_cloud_budgets

log = logging.getLogger(__name__)


def end_attempt(
    deps: Deps,
    attempt_id: str,
    *,
    state: AttemptState,
    exit_code: int | None = None,
    reason: str,
    log_tail: str | None = None,
) -> None:
    """Close an attempt: revoke its token, shut its instance down, move the run on.

    A failure of an attempt that was being preempted is a preemption (it resumes), whatever
    its exit code: a SIGTERM that reached the runner before its handler (143), a script
    that crashed on the notice. "Being preempted": it reported a preemption notice, or the
    provider says its instance was preempted (:func:`_preempted_all_the_same`).
    ``log_tail``: the command's last lines (the runner's exit), shown with a failure.
    """
    if state == AttemptState.FAILED:
        why = _preempted_all_the_same(deps, attempt_id)
        if why is not None:
            state, reason = AttemptState.PREEMPTED, f"{reason}; {why}"
    if state == AttemptState.TERMINATED:
        # We end it: let the runner flush and report before its token is revoked.
        with session_scope(deps.engine) as session:
            attempt = session.get(Attempt, attempt_id)
            instance = attempt.instance_id if attempt and not attempt.state.is_terminal() else None
            on = attempt.provider if attempt else None
        if instance is not None:
            terminate_instance(deps, instance, provider=on)
    now = deps.clock()
    resubmit_after: float | None = None
    instance_id: str | None = None
    provider_name: str | None = None
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        if attempt is None or attempt.state.is_terminal():
            return
        run = session.get(Run, attempt.run_id)
        assert run is not None
        if state == AttemptState.SUCCEEDED and attempt.state != AttemptState.RUNNING:
            # It ran to the end but its "started" event never arrived (events lost, or
            # the provider saw the exit first): it was running all the same.
            attempt.state = transition(attempt.state, AttemptState.RUNNING, subject_id=attempt.id)
        if state in (AttemptState.PREEMPTED, AttemptState.LOST) and run.state.is_terminal():
            # We stopped it (a person, the budget cap): its runner's "preempted" exit is
            # the flush we asked for, not a preemption to resubmit.
            state = AttemptState.TERMINATED
        attempt.state = transition(attempt.state, state, subject_id=attempt.id)
        attempt.exit_code = exit_code
        attempt.end_reason = reason
        attempt.ended_at = now
        attempt.token_hash = None  # revokes the runner's token
        instance_id, provider_name = attempt.instance_id, attempt.provider
        if state in (AttemptState.PREEMPTED, AttemptState.LOST):
            record_lost_work(session, run, attempt, now=now)
        session.add(attempt)
        if state == AttemptState.SUCCEEDED:
            if move_run(session, run, RunState.SUCCEEDED, now=now):
                deps.journal.record("run_finished", run.id, state="SUCCEEDED", step=run.last_step)
                say(deps, run, "finished", f"Run {run.id} finished at step {run.last_step}.")
        elif state in (AttemptState.PREEMPTED, AttemptState.LOST):
            run.preemptions += 1
            session.add(run)
            policy = stored_section(run.spec, ResubmitPolicy, run_id=run.id)
            deps.journal.record(
                "preempted",
                run.id,
                attempt=attempt.number,
                lost=state == AttemptState.LOST,
                committed_step=run.last_committed_step,
                lost_steps=attempt.lost_steps,
                lost_seconds=round(attempt.lost_seconds, 3),
            )
            say(
                deps,
                run,
                "preempted",
                f"Attempt {attempt.number} "
                f"{'was lost' if state == AttemptState.LOST else 'was preempted'}"
                f" ({reason}); last committed step {run.last_committed_step}.",
            )
            ceiling = policy.max_preemptions
            if ceiling is not None and run.preemptions > ceiling and not run.state.is_terminal():
                why = (
                    f"preempted {run.preemptions} times, more than resubmit.max_preemptions="
                    f"{ceiling}; resubmit it to go on from step {run.last_committed_step}, or "
                    "move it to another zone or region"
                )
                move_run(session, run, RunState.FAILED, now=now, reason=why)
                deps.journal.record("run_finished", run.id, state="FAILED", reason=why)
                say(deps, run, "error", f"Run {run.id} failed: {why}.")
            if run.state in (RunState.RUNNING, RunState.LAUNCHING):
                move_run(session, run, RunState.RECOVERING, now=now)
            if run.state == RunState.RECOVERING:
                resubmit_after = policy.backoff_s
            _preemption_alerts(deps, session, run, attempt, now=now)
        elif state == AttemptState.FAILED and not run.state.is_terminal():
            restart = restart_on_error(session, run, attempt, exit_code)
            if restart.allowed:
                record_lost_work(session, run, attempt, now=now)
                if run.state in (RunState.RUNNING, RunState.LAUNCHING):
                    move_run(session, run, RunState.RECOVERING, now=now)
                deps.journal.record(
                    "restart_on_error",
                    run.id,
                    attempt=attempt.number,
                    exit_code=exit_code,
                    restart=restart.number,
                    of=restart.limit,
                    from_step=run.last_committed_step,
                )
                say(deps, run, "error", restart.text, log_tail=log_tail)
                if run.state == RunState.RECOVERING:
                    resubmit_after = restart.backoff_s
            else:
                why = f"{reason}; {restart.text}" if restart.text else reason
                move_run(session, run, RunState.FAILED, now=now, reason=why)
                deps.journal.record("run_finished", run.id, state="FAILED", reason=why)
                say(deps, run, "error", f"Run {run.id} failed: {why}.", log_tail=log_tail)
        # A failure's instance may be kept for a person to look at (debug.keep_failed_instance).
        kept = state == AttemptState.FAILED and keep_failed(deps, session, run, attempt, now=now)
        refresh_card(deps, session, run)
        ended_run = run.id if run.state.is_terminal() else None
    if ended_run is not None:
        # The run is over: its cloud budget goes too (or cloud_budget_keep_days later, by
        # the cleanup job, which also retries a failure). Off the caller's thread, which
        # may be the ingest request carrying the runner's exit.
        deps.background(remove_cloud_budgets, deps, now=now, run_ids=[ended_run])
    if resubmit_after is not None:
        # The backoff runs from the end, not from when the old instance is gone: a runner
        # reports a preempted exit before its processes have torn down, and terminating
        # them can take the provider's grace period. A row, not a timer: the resubmit
        # outlives this replica (jobs.background.deferred).
        deps.later(
            resubmit_after,
            Later.RESUBMIT,
            key=f"resubmit:{attempt_id}",
            previous_attempt_id=attempt_id,
        )
    if instance_id is not None and state != AttemptState.TERMINATED and not kept:
        # Off the caller's thread: the caller may be the ingest request that carried the
        # runner's exit, and the runner waits for that reply before its processes end, so
        # a provider whose terminate waits for them (the local one) would wait on itself
        # until its grace ran out. On the stop lane, never queued behind preflights or
        # launches (the instance bills until it goes). Reconcile retries what is left.
        # Scripted, not remembered. Claimed here, before the lane runs it: a reconcile in
        # between would otherwise take the instance of a just-ended attempt for an
        # orphan and terminate it itself.
        _, mine = deps.claim_termination(instance_id)
        if mine:
            try:
                deps.urgent(_terminate_claimed, deps, instance_id, provider_name)
            except BaseException:
                deps.release_termination(instance_id)
                raise


def _preempted_all_the_same(deps: Deps, attempt_id: str) -> str | None:
    """Why an attempt that ended as a failure was in fact preempted, or None: it had a
    preemption notice, or its provider reports its instance preempted."""
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        if attempt is None or attempt.state.is_terminal():
            return None
        if attempt.preemption_notice_at is not None:
            return "it had a preemption notice, so it resumes"
        instance_id, on = attempt.instance_id, attempt.provider
    if instance_id is None:
        return None
    try:
        status = deps.provider_named(on).status(instance_id)
    except ProviderError as exc:  # InstanceNotFound included: nothing to say otherwise
        log.info("status of %s after its failure: %s", instance_id, exc)
        return None
    if status.state == InstanceState.PREEMPTED:
        return f"its instance was preempted ({status.reason}), so it resumes"
    if status.state == InstanceState.LOST:
        # A rank's failure when another node died under it (a collective's peer is gone).
        return f"a node of its gang was lost ({status.reason}), so it resumes"
    return None


def terminate_instance(
    deps: Deps, instance_id: str, *, wait: bool = True, provider: str | None = None
) -> bool:
    """Terminate an instance, once at a time: when another thread is terminating it,
    wait for that (``wait``) or return at once. True when this call terminated it.
    ``provider``: the name of the provider it is on (an attempt's); None: the default.

    Scheduled work (reconcile, a spend stop) is fenced: a deposed leader's call raises
    :class:`~jobs.domain.errors.FencedOut` before it reaches the provider."""
    done, mine = deps.claim_termination(instance_id)
    if not mine:
        if wait:
            done.wait()
        return False
    _terminate_claimed(deps, instance_id, provider)
    return True


def _terminate_claimed(deps: Deps, instance_id: str, provider: str | None) -> None:
    """The termination this thread claimed (:meth:`Deps.claim_termination`), released
    whatever happens."""
    try:
        check_fence(deps, None, action=f"the termination of {instance_id}")
        deps.provider_named(provider or deps.provider.name).terminate(instance_id)
    except InstanceNotFound:
        pass
    except ProviderError as exc:
        log.warning("terminating %s failed (reconcile will retry): %s", instance_id, exc)
    finally:
        deps.release_termination(instance_id)


def _preemption_alerts(
    deps: Deps, session: Session, run: Run, attempt: Attempt, *, now: datetime
) -> None:
    cfg = stored_section(run.spec, AlertThresholds, run_id=run.id)
    ctx = run_context(session, run, attempt, now=now)
    data: dict[str, Any] = {"reason": "preempted", "attempt": attempt.number}
    if attempt.exit_code is not None:
        data["code"] = attempt.exit_code
    if attempt.end_reason:
        data["cause"] = attempt.end_reason
    obs = [Obs(time=now.timestamp(), type="exit", data=data)]
    signals = evaluate_all(rules_on(Trigger.PREEMPTED, cfg), obs, now=now.timestamp(), ctx=ctx)
    raise_signals(deps, session, run, signals, now=now)


def project_then_stop(deps: Deps, attempt_id: str) -> ProjectionMessage | None:
    """The projection of a profiled attempt (:func:`jobs.runs.profile.project`); when it
    asks whether to go on, the attempt ends as the hard cap ends one: the runner gets
    the notice and flushes a checkpoint."""
    msg = project(deps, attempt_id)
    if msg is not None and msg.stopped:
        end_attempt(deps, attempt_id, state=AttemptState.TERMINATED, reason="profile")
    return msg
