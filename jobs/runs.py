"""The life of a run's attempts: launch, events from the runner, end, resubmit, reconcile.

Every launch writes the attempt row (with its token's hash) *before* calling the
provider, and the provider's launch is idempotent on the attempt id. So a control plane
killed between the provider call and the database write finds, on restart, an attempt
without an instance: reconcile adopts the instance tagged with that attempt (or
launches it, which returns the same instance), and terminates anything tagged by
trainbot that no live attempt owns. There is exactly one instance per attempt.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlmodel import Session, col, select

from jobs import alerts
from jobs.db import detach, session_scope
from jobs.deps import Deps
from jobs.errors import ConflictError, NotFound
from jobs.lifecycle import AttemptState, RunState, transition
from jobs.metrics import run_metrics
from jobs.models import Attempt, Checkpoint, Event, Run, hash_token
from jobs.notify import MessageRef, RunCard, TextMessage
from jobs.preflight import resource_request
from jobs.providers.base import (
    CapacityError,
    InstanceNotFound,
    InstanceState,
    LaunchRequest,
    ProviderError,
)
from jobs.rules import (
    AlertConfig,
    AutoResubmit,
    LostHeartbeat,
    Obs,
    Preemption,
    RepeatedPreemptions,
    RunContext,
)
from jobs.spec import JobSpec
from jobs.spend import run_spent
from runner.preemption import choose_interval

log = logging.getLogger(__name__)

#: How long an attempt may sit REQUESTED without an instance before reconcile relaunches
#: it (the launch is idempotent, so this adopts an instance a crash left unrecorded).
ADOPT_AFTER_S = 20.0


def checkpoint_prefix(run: Run) -> str:
    """A run's checkpoints live in ``{checkpoint_uri}/{prefix}``: its own id, unless it
    resumes another run's checkpoints (a resubmit of a finished run). Only trainbot
    writes ``Run.checkpoint_prefix``; a spec cannot name it."""
    return run.checkpoint_prefix or run.id


def spec_of(run: Run) -> JobSpec:
    return JobSpec.model_validate(run.spec)


def channel_of(run: Run) -> str:
    return run.channel or "trainbot"


def alert_config(spec: JobSpec) -> AlertConfig:
    return AlertConfig(**spec.alerts.model_dump())


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
        reason=run.reason,
    )


def refresh_card(deps: Deps, session: Session, run: Run) -> None:
    """Update the run's root message in place."""
    if run.thread_ts is None:
        return
    deps.notifier.update(MessageRef(channel=channel_of(run), ts=run.thread_ts), card(session, run))


def say(deps: Deps, run: Run, kind: str, text: str) -> None:
    deps.notifier.post(
        TextMessage(
            channel=channel_of(run), thread_ts=run.thread_ts, kind=kind, text=text, run_id=run.id
        )
    )


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


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class Placement:
    """Where the next attempt goes."""

    zone: str | None
    spot: bool


def choose_placement(deps: Deps, session: Session, run: Run, spec: JobSpec) -> Placement:
    """The resubmit policy: same zone first, then the next zone; on-demand after N preemptions."""
    prev = latest_attempt(session, run.id)
    spot = spec.resources.spot
    limit = spec.resubmit.on_demand_after_preemptions
    if (
        spot
        and limit is not None
        and run.preemptions >= limit
        and spec.resources.on_demand_fallback
    ):
        spot = False
    req = resource_request(spec, spot=spot)
    try:
        ranked = [z.zone for z in deps.provider.capacity(req) if z.available]
    except ProviderError as exc:
        log.warning("capacity lookup for %s failed: %s", run.id, exc)
        ranked = []
    zones = ranked or list(spec.resources.zones) or [None]  # type: ignore[list-item]
    if prev is None or prev.zone is None or not spec.resubmit.zone_failover:
        return Placement(zone=zones[0], spot=spot)
    moved_out = prev.state == AttemptState.PREEMPTED or (
        prev.state == AttemptState.FAILED and (prev.end_reason or "").startswith(NO_CAPACITY)
    )
    if moved_out and prev.zone in zones and len(zones) > 1:
        return Placement(zone=zones[(zones.index(prev.zone) + 1) % len(zones)], spot=spot)
    return Placement(zone=prev.zone if prev.zone in zones else zones[0], spot=spot)


def runner_command(deps: Deps, spec: JobSpec) -> list[str]:
    """What the instance runs: the supervisor around the spec's command."""
    command = list(spec.command)
    local = deps.provider.capabilities.runs_on_this_machine
    if local and command and command[0] in ("python", "python3"):
        command[0] = sys.executable  # the local "instance" shares this machine's interpreter
    runner = [sys.executable, "-m", "runner.cli"] if local else ["trainbot-runner"]
    return [*runner, "exec", "--", *command]


def runner_env(deps: Deps, run: Run, attempt: Attempt, spec: JobSpec) -> dict[str, str]:
    env = dict(spec.env)
    env.update(
        TRAINBOT_RUN_ID=run.id,
        TRAINBOT_ATTEMPT_ID=attempt.id,
        TRAINBOT_CHECKPOINT_URI=run.checkpoint_uri or deps.settings.checkpoint_uri,
        TRAINBOT_CHECKPOINT_PREFIX=checkpoint_prefix(run),
        TRAINBOT_TOKEN=deps.runner_token(attempt.id),
        TRAINBOT_TERMINATION_WINDOW_S=str(deps.provider.capabilities.termination_window_s),
        TRAINBOT_METRICS_EVERY="1",
    )
    if deps.ingest_url:
        env["TRAINBOT_INGEST_URL"] = deps.ingest_url
    if (deps.settings.provider == "aws" and deps.settings.aws_runner_storage_role_arn) or (
        deps.settings.provider == "gcp" and deps.settings.gcp_runner_storage_service_account
    ):
        env["TRAINBOT_STORE_CREDENTIALS"] = "broker"  # the store asks /v1/credentials
    if run.checkpoint_interval_s:
        env["TRAINBOT_CHECKPOINT_INTERVAL_S"] = f"{run.checkpoint_interval_s:.3f}"
    if spec.checkpoint.every_steps:
        env["TRAINBOT_CHECKPOINT_EVERY_STEPS"] = str(spec.checkpoint.every_steps)
    if spec.checkpoint.train_through_notice:
        env["TRAINBOT_TRAIN_THROUGH_NOTICE"] = "1"
    if deps.provider.capabilities.runs_on_this_machine:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    else:
        # The notices of the cloud the instance really is on, not the one a spec names.
        env["TRAINBOT_PREEMPTION_SOURCES"] = deps.provider.capabilities.preemption_source
    return env


def launch_attempt(deps: Deps, run_id: str) -> Attempt | None:
    """Start the next attempt of a run, if it needs one. Safe to call concurrently."""
    try:
        attempt_id = _new_attempt(deps, run_id, now=deps.clock())
    except ConflictError:
        # Another thread (a resubmit timer, reconcile) created this attempt number first;
        # the unique (run, number) key refused ours when the transaction committed.
        return None
    return _provision(deps, attempt_id) if attempt_id is not None else None


def _new_attempt(deps: Deps, run_id: str, *, now: datetime) -> str | None:
    """Record the run's next attempt, REQUESTED, or say why there is none (None)."""
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id)
        if run is None or run.state not in (RunState.LAUNCHING, RunState.RECOVERING):
            return None
        if active_attempt(session, run_id) is not None:
            return None
        spec = spec_of(run)
        prev = latest_attempt(session, run_id)
        number = (prev.number if prev else 0) + 1
        if number > spec.resubmit.max_attempts:
            move_run(
                session,
                run,
                RunState.FAILED,
                now=now,
                reason=(
                    f"gave up after {spec.resubmit.max_attempts} attempts; raise "
                    "resubmit.max_attempts or move the run to another zone or region"
                ),
            )
            deps.journal.record("run_finished", run.id, state="FAILED", reason=run.reason)
            say(deps, run, "error", f"Run {run.id} failed: {run.reason}.")
            refresh_card(deps, session, run)
            return None
        placement = choose_placement(deps, session, run, spec)
        if spec.checkpoint.interval_s is None:
            _follow_measured_cost(deps, session, run)
        attempt = Attempt(
            run_id=run_id,
            number=number,
            provider=deps.provider.name,
            region=spec.resources.region,
            zone=placement.zone,
            instance_type=spec.resources.instance_type,
            spot=placement.spot,
            instances=spec.resources.instances,
            resumed_from_step=run.last_committed_step,
        )
        attempt.token_hash = hash_token(deps.runner_token(attempt.id))
        session.add(attempt)
        return attempt.id


#: Periodic saves a run must have reported before its interval follows their stall.
MEASURED_SAVES_MIN = 3
#: Newest commits of the run the measured cost is taken from.
MEASURED_SAVES_MAX = 200


def measured_interval(session: Session, run: Run) -> float | None:
    """The ``"auto"`` interval for the checkpoint cost the run itself has measured.

    Preflight chose the interval from a dry run on the control plane's CPU; the run's own
    saves, on its own hardware, say what a save really costs. The rule is preflight's
    (:func:`runner.preemption.choose_interval`), with the same M, and C and the floor
    from the run: the median stall of its periodic saves (those the loop went on from;
    a final or emergency save copies nothing) and the median write time. None until
    enough periodic saves are known, or without preflight's M.
    """
    dry = next(
        (r for r in (run.preflight or {}).get("results", []) if r.get("name") == "dry_run"), None
    )
    lossy_mtbp = (dry or {}).get("data", {}).get("interval_mtbp_s")
    if not isinstance(lossy_mtbp, int | float) or not lossy_mtbp > 0:
        return None
    last_steps = dict(
        session.exec(select(Attempt.id, Attempt.last_step).where(Attempt.run_id == run.id)).all()
    )
    rows = session.exec(
        select(Event.attempt_id, Event.data)
        .where(Event.run_id == run.id, Event.type == "checkpoint_committed")
        .order_by(col(Event.id).desc())
        .limit(MEASURED_SAVES_MAX)
    ).all()
    writes: list[float] = []
    stalls: list[float] = []
    for attempt_id, data in rows:
        write, stall, step = data.get("write_s"), data.get("stall_s"), data.get("step")
        if isinstance(write, int | float) and write > 0:
            writes.append(float(write))
        last = last_steps.get(attempt_id)
        periodic = isinstance(step, int) and last is not None and step < last
        if periodic and isinstance(stall, int | float) and stall > 0:
            stalls.append(float(stall))
    if len(stalls) < MEASURED_SAVES_MIN or not writes:
        return None
    return choose_interval(
        write_s=statistics.median(writes),
        stall_s=statistics.median(stalls),
        mtbp_s=float(lossy_mtbp),
        flush_fits_window=False,  # M above already counts only the preemptions losing work
    ).interval_s


def _follow_measured_cost(deps: Deps, session: Session, run: Run) -> None:
    """Before a resubmit, move an ``"auto"`` interval to the run's measured cost."""
    interval = measured_interval(session, run)
    current = run.checkpoint_interval_s
    if interval is None or (current and math.isclose(interval, current, rel_tol=0.02)):
        return
    run.checkpoint_interval_s = interval
    session.add(run)
    deps.journal.record(
        "checkpoint_interval", run.id, interval_s=round(interval, 3), previous_s=current
    )


def _provision(deps: Deps, attempt_id: str) -> Attempt | None:
    """Call the provider for a REQUESTED attempt (first launch, or adoption after a crash)."""
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        if attempt is None or attempt.state != AttemptState.REQUESTED:
            return attempt
        run = session.get(Run, attempt.run_id)
        assert run is not None
        spec = spec_of(run)
        req = LaunchRequest(
            run_id=run.id,
            attempt_id=attempt.id,
            owner=run.requester,
            request=resource_request(spec, spot=attempt.spot),
            zone=attempt.zone or "",
            command=runner_command(deps, spec),
            env=runner_env(deps, run, attempt, spec),
            scratch_bytes=int(spec.resources.disk_gb * 1e9),
            idempotency_key=attempt.id,
            spot=attempt.spot,
        )
    now = deps.clock()
    try:
        info = deps.provider.launch(req)
        price = deps.provider.price(req.request, zone=req.zone)
    except ProviderError as exc:
        _launch_failed(deps, attempt_id, exc, now=now)
        return None
    with session_scope(deps.engine) as session:
        # Locked, so that of two racing writers (reconcile adopting an attempt whose launch
        # is in progress, and the launcher) the second sees the first's state. SQLite's
        # BEGIN IMMEDIATE already serialises them; PostgreSQL needs the row lock.
        attempt = session.get(Attempt, attempt_id, with_for_update=True)
        assert attempt is not None
        if attempt.state != AttemptState.REQUESTED:
            # Reconcile and the launcher both provisioned it (the launch is idempotent,
            # so it is the same instance): the first to record it wins.
            detach(session, attempt)
            return attempt
        run = session.get(Run, attempt.run_id)
        assert run is not None
        attempt.instance_id = info.instance_id
        attempt.zone = info.zone or attempt.zone
        attempt.state = transition(attempt.state, AttemptState.PROVISIONING, subject_id=attempt.id)
        attempt.started_at = now
        attempt.price_per_hour = (
            price.spot_usd_per_hour if attempt.spot else price.on_demand_usd_per_hour
        )
        session.add(attempt)
        deps.journal.record(
            "launched",
            run.id,
            attempt=attempt.number,
            attempt_id=attempt.id,
            instance=info.instance_id,
            zone=attempt.zone,
            spot=attempt.spot,
            price_per_hour=attempt.price_per_hour,
            resume_from_step=attempt.resumed_from_step,
            checkpoint_interval_s=run.checkpoint_interval_s,
        )
        market = "spot" if attempt.spot else "on-demand"
        resume = (
            f", resuming from step {attempt.resumed_from_step}" if attempt.resumed_from_step else ""
        )
        say(
            deps,
            run,
            "launched",
            f"Attempt {attempt.number} launched on {market} instance {info.instance_id} "
            f"in {attempt.zone} at ${attempt.price_per_hour:.2f}/h{resume}.",
        )
        refresh_card(deps, session, run)
        detach(session, attempt)
        return attempt


# ----------------------------------------------------------------------------- events


def on_attempt_event(deps: Deps, attempt_id: str, type_: str, data: dict[str, Any]) -> None:
    """React to a runner event that the ingest API has stored."""
    now = deps.clock()
    ended: tuple[AttemptState, int | None, str] | None = None
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        run = session.get(Run, attempt.run_id) if attempt else None
        if attempt is None or run is None:
            return
        if type_ == "started" and run.state in (RunState.LAUNCHING, RunState.RECOVERING):
            move_run(session, run, RunState.RUNNING, now=now)
            refresh_card(deps, session, run)
        elif type_ == "restored":
            step = int(data.get("step") or 0)
            if step > 0 and attempt.started_at is not None:
                # Booting and restoring a resumed attempt is paid time that makes no progress.
                attempt.lost_seconds += max(0.0, (now - attempt.started_at).total_seconds())
                session.add(attempt)
            if step > 0:
                deps.journal.record("resumed", run.id, attempt=attempt.number, step=step)
                say(deps, run, "resumed", f"Attempt {attempt.number} resumed at step {step}.")
        elif type_ == "checkpoint_committed":
            deps.journal.record(
                "checkpoint_committed",
                run.id,
                attempt=attempt.number,
                step=data.get("step"),
                bytes=data.get("bytes"),
                write_s=data.get("write_s"),
            )
            refresh_card(deps, session, run)
        elif type_ == "preemption_notice" and run.state.is_terminal():
            # We stopped it (a person, the budget cap): the SIGTERM its runner saw is ours.
            say(
                deps,
                run,
                "stopping",
                f"Attempt {attempt.number} is stopping: its runner flushes a checkpoint first.",
            )
        elif type_ == "preemption_notice":
            deps.journal.record(
                "preemption_notice",
                run.id,
                attempt=attempt.number,
                source=data.get("source"),
                time_left_s=data.get("time_left_s"),
            )
            left = data.get("time_left_s")
            say(
                deps,
                run,
                "preempted",
                f"Preemption notice for attempt {attempt.number} ({data.get('source')}); "
                + (f"{left:.0f} s to flush a checkpoint." if isinstance(left, int | float) else ""),
            )
        elif type_ == "log" and data.get("level") in ("warning", "error"):
            # The runner's own warnings (a script under exec that wrote nothing it could
            # sync, say) are for the people watching the run, not only its log.
            message = str(data.get("message") or "")
            # Its text names the script's files: never markup (no <!channel> from a name).
            message = message.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            if len(message) > 1500:
                message = message[:1500] + f"… ({len(message)} characters)"
            deps.journal.record("runner_warning", run.id, attempt=attempt.number)
            say(deps, run, "warning", f"Attempt {attempt.number}: {message}")
        elif type_ == "exit":
            code = int(data.get("code", 1))
            reason = str(data.get("reason", "failed"))
            state = {
                "succeeded": AttemptState.SUCCEEDED,
                "preempted": AttemptState.PREEMPTED,
                "stopped": AttemptState.TERMINATED,
            }.get(reason, AttemptState.FAILED)
            ended = (state, code, f"runner exited {code} ({reason})")
    if ended is not None:
        end_attempt(deps, attempt_id, state=ended[0], exit_code=ended[1], reason=ended[2])


def end_attempt(
    deps: Deps,
    attempt_id: str,
    *,
    state: AttemptState,
    exit_code: int | None = None,
    reason: str,
) -> None:
    """Close an attempt: revoke its token, shut its instance down, move the run on."""
    if state == AttemptState.TERMINATED:
        # We end it: let the runner flush and report before its token is revoked.
        with session_scope(deps.engine) as session:
            attempt = session.get(Attempt, attempt_id)
            instance = attempt.instance_id if attempt and not attempt.state.is_terminal() else None
        if instance is not None:
            _terminate(deps, instance)
    now = deps.clock()
    resubmit_after: float | None = None
    instance_id: str | None = None
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        if attempt is None or attempt.state.is_terminal():
            return
        run = session.get(Run, attempt.run_id)
        assert run is not None
        spec = spec_of(run)
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
        instance_id = attempt.instance_id
        if state in (AttemptState.PREEMPTED, AttemptState.LOST):
            _record_lost_work(session, run, attempt, now=now)
        session.add(attempt)
        if state == AttemptState.SUCCEEDED:
            if move_run(session, run, RunState.SUCCEEDED, now=now):
                deps.journal.record("run_finished", run.id, state="SUCCEEDED", step=run.last_step)
                say(deps, run, "finished", f"Run {run.id} finished at step {run.last_step}.")
        elif state in (AttemptState.PREEMPTED, AttemptState.LOST):
            run.preemptions += 1
            session.add(run)
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
            if run.state in (RunState.RUNNING, RunState.LAUNCHING):
                move_run(session, run, RunState.RECOVERING, now=now)
            if run.state == RunState.RECOVERING:
                resubmit_after = spec.resubmit.backoff_s
            _preemption_alerts(deps, session, run, attempt, now=now)
        elif state == AttemptState.FAILED and not run.state.is_terminal():
            move_run(session, run, RunState.FAILED, now=now, reason=reason)
            deps.journal.record("run_finished", run.id, state="FAILED", reason=reason)
            say(deps, run, "error", f"Run {run.id} failed: {reason}.")
        refresh_card(deps, session, run)
    if resubmit_after is not None:
        # The backoff runs from the end, not from when the old instance is gone: a runner
        # reports a preempted exit before its processes have torn down, and terminating
        # them can take the provider's grace period.
        deps.later(resubmit_after, resubmit_if_due, deps, attempt_id)
    if instance_id is not None and state != AttemptState.TERMINATED:
        # Off the caller's thread: the caller may be the ingest request that carried the
        # runner's exit, and the runner waits for that reply before its processes end, so
        # a provider whose terminate waits for them (the local one) would wait on itself
        # until its grace ran out. Reconcile retries whatever this leaves undone.
        deps.background(_terminate, deps, instance_id)  # scripted, not remembered


#: How a launch refused for lack of capacity is recorded: the next attempt moves zone.
NO_CAPACITY = "no capacity"


def _launch_failed(deps: Deps, attempt_id: str, exc: ProviderError, *, now: datetime) -> None:
    """A refused launch: no capacity retries in the next zone after the backoff; anything
    else (permissions, quota, a bad request) will not fix itself and fails the run."""
    capacity = isinstance(exc, CapacityError)
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        run = session.get(Run, attempt.run_id) if attempt else None
        if attempt is None or run is None:
            return
        attempt.state = transition(attempt.state, AttemptState.FAILED, subject_id=attempt.id)
        attempt.end_reason = f"{NO_CAPACITY}: {exc}" if capacity else str(exc)
        attempt.ended_at = now
        attempt.token_hash = None
        session.add(attempt)
        say(deps, run, "error", f"Attempt {attempt.number} of {run.id} could not launch: {exc}")
        if not capacity:
            move_run(session, run, RunState.FAILED, now=now, reason=str(exc))
            deps.journal.record("run_finished", run.id, state="FAILED", reason=run.reason)
            refresh_card(deps, session, run)
            return
        if run.state == RunState.LAUNCHING:
            move_run(session, run, RunState.RECOVERING, now=now)
        backoff = spec_of(run).resubmit.backoff_s
        run_id = run.id
    deps.later(backoff, launch_attempt, deps, run_id)


def _terminate(deps: Deps, instance_id: str, *, wait: bool = True) -> bool:
    """Terminate an instance, once at a time: when another thread is terminating it,
    wait for that (``wait``) or return at once. True when this call terminated it."""
    done, mine = deps.claim_termination(instance_id)
    if not mine:
        if wait:
            done.wait()
        return False
    try:
        deps.provider.terminate(instance_id)
    except InstanceNotFound:
        pass
    except ProviderError as exc:
        log.warning("terminating %s failed (reconcile will retry): %s", instance_id, exc)
    finally:
        deps.release_termination(instance_id)
    return True


def _record_lost_work(session: Session, run: Run, attempt: Attempt, *, now: datetime) -> None:
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


def _preemption_alerts(
    deps: Deps, session: Session, run: Run, attempt: Attempt, *, now: datetime
) -> None:
    spec = spec_of(run)
    cfg = alert_config(spec)
    ctx = run_context(session, run, attempt, now=now)
    data: dict[str, Any] = {"reason": "preempted", "attempt": attempt.number}
    if attempt.exit_code is not None:
        data["code"] = attempt.exit_code
    if attempt.end_reason:
        data["cause"] = attempt.end_reason
    obs = [Obs(time=now.timestamp(), type="exit", data=data)]
    signals = [
        *Preemption(cfg).evaluate(obs, now=now.timestamp(), ctx=ctx),
        *RepeatedPreemptions(cfg).evaluate(obs, now=now.timestamp(), ctx=ctx),
    ]
    alerts.process_signals(
        session,
        run=run,
        signals=signals,
        now=now,
        target=alert_target(run),
        notifier=deps.notifier,
        journal=deps.journal,
    )


def alert_target(run: Run) -> alerts.AlertTarget:
    return alerts.AlertTarget(
        channel=channel_of(run),
        thread_ts=run.thread_ts,
        oncall_group=spec_of(run).notify.oncall_group,
    )


def run_context(
    session: Session, run: Run, attempt: Attempt | None, *, now: datetime
) -> RunContext:
    spec = spec_of(run)
    ended = session.exec(
        select(Attempt.ended_at).where(
            Attempt.run_id == run.id,
            Attempt.state.in_([AttemptState.PREEMPTED, AttemptState.LOST]),  # type: ignore[attr-defined]
        )
    ).all()
    return RunContext(
        run_id=run.id,
        budget_usd=run.budget_usd,
        spent_usd=run_spent(session, run.id),
        thresholds_pct=tuple(float(t) for t in spec.budget.thresholds),
        hard_cap=spec.budget.hard_cap,
        last_heartbeat=attempt.last_heartbeat.timestamp()
        if attempt and attempt.last_heartbeat
        else None,
        preemption_times=tuple(t.timestamp() for t in ended if t is not None),
        attempt_number=attempt.number if attempt else 0,
        last_committed_step=run.last_committed_step,
        current_step=run.last_step,
    )


def resubmit_if_due(deps: Deps, previous_attempt_id: str) -> bool:
    """Launch the next attempt after a preemption, reporting the work lost.

    Called by the backoff timer and by reconcile's backstop; whichever comes second
    finds the attempt launched and does nothing. True when this call launched it.
    """
    with session_scope(deps.engine) as session:
        prev = session.get(Attempt, previous_attempt_id)
        run = session.get(Run, prev.run_id) if prev else None
        if prev is None or run is None or run.state != RunState.RECOVERING:
            return False
        if active_attempt(session, run.id) is not None:
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
            attempt=attempt.number,
            zone=attempt.zone,
            spot=attempt.spot,
            resume_from_step=attempt.resumed_from_step,
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
        signals = AutoResubmit(alert_config(spec)).evaluate(
            obs, now=now.timestamp(), ctx=run_context(session, run, attempt, now=now)
        )
        alerts.process_signals(
            session,
            run=run,
            signals=signals,
            now=now,
            target=alert_target(run),
            notifier=deps.notifier,
            journal=deps.journal,
        )
    return True


# ----------------------------------------------------------------------------- reconcile


@dataclass(frozen=True)
class _Live:
    """What reconcile needs of a live attempt, read in one transaction."""

    attempt_id: str
    run_id: str
    instance_id: str | None
    created_at: datetime
    #: Last sign of life: heartbeat, else start, else creation.
    seen: datetime
    heartbeat_deadline_s: float


def reconcile(deps: Deps) -> dict[str, int]:
    """Compare the provider's instances with the database and repair the difference."""
    now = deps.clock()
    counts = {"adopted": 0, "ended": 0, "orphans": 0, "launched": 0, "lost": 0}
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
                seen=a.last_heartbeat or a.started_at or a.created_at,
                heartbeat_deadline_s=spec_of(r).alerts.heartbeat_deadline_s,
            )
            for a, r in rows
        }
    try:
        instances = deps.provider.list_instances()
    except ProviderError as exc:
        log.warning("reconcile could not list instances: %s", exc)
        return counts
    by_attempt = {i.attempt_id: i for i in instances}
    # Orphans: tagged by us, owned by no live attempt. One whose ended attempt is having
    # it terminated already (end_attempt does that off its caller's thread) is left to it.
    for inst in instances:
        orphan = inst.attempt_id not in live and not inst.state.is_terminal()
        if orphan and _terminate(deps, inst.instance_id, wait=False):
            deps.journal.record("orphan_terminated", inst.run_id, instance=inst.instance_id)
            counts["orphans"] += 1
    for a in live.values():
        if a.instance_id is None:
            if a.attempt_id in by_attempt or (now - a.created_at).total_seconds() > ADOPT_AFTER_S:
                _provision(deps, a.attempt_id)  # idempotent launch: adopts what is there
                counts["adopted"] += 1
            continue
        try:
            status = deps.provider.status(a.instance_id)
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
    counts["launched"] += _launch_due(deps, now=now)
    return counts


_ENDED_BY_PROVIDER = {
    InstanceState.PREEMPTED: AttemptState.PREEMPTED,
    InstanceState.SUCCEEDED: AttemptState.SUCCEEDED,
    InstanceState.FAILED: AttemptState.FAILED,
    InstanceState.TERMINATED: AttemptState.TERMINATED,
}


def _lost_heartbeat(deps: Deps, attempt_id: str, *, now: datetime, since: datetime) -> None:
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        run = session.get(Run, attempt.run_id) if attempt else None
        if attempt is None or run is None:
            return
        spec = spec_of(run)
        signals = LostHeartbeat(alert_config(spec)).evaluate(
            [], now=now.timestamp(), ctx=run_context(session, run, attempt, now=now)
        )
        alerts.process_signals(
            session, run=run, signals=signals, now=now, target=alert_target(run),
            notifier=deps.notifier, journal=deps.journal,
        )  # fmt: skip
    silent = int((now - since).total_seconds())
    end_attempt(deps, attempt_id, state=AttemptState.LOST, reason=f"no heartbeat for {silent} s")


def _launch_due(deps: Deps, *, now: datetime) -> int:
    """Runs waiting for an attempt whose backoff is over (the backstop for lost timers)."""
    due: list[str] = []
    #: Runs whose last attempt was preempted or lost: relaunched as a resubmit, so the
    #: record, the lost work and the alert are the same whichever of the timer and this
    #: backstop gets there first.
    resubmits: dict[str, str] = {}
    with session_scope(deps.engine) as session:
        runs = session.exec(
            select(Run).where(col(Run.state).in_([RunState.LAUNCHING, RunState.RECOVERING]))
        ).all()
        for run in runs:
            if active_attempt(session, run.id) is not None:
                continue
            prev = latest_attempt(session, run.id)
            backoff = timedelta(seconds=spec_of(run).resubmit.backoff_s)
            if prev is None or prev.ended_at is None or now - prev.ended_at >= backoff:
                due.append(run.id)
                if (
                    prev is not None
                    and run.state == RunState.RECOVERING
                    and prev.state in (AttemptState.PREEMPTED, AttemptState.LOST)
                ):
                    resubmits[run.id] = prev.id
    launched = 0
    for run_id in due:
        if run_id in resubmits:
            if resubmit_if_due(deps, resubmits[run_id]):
                launched += 1
        elif launch_attempt(deps, run_id) is not None:
            launched += 1
    return launched


def get_run(session: Session, run_id: str) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"no run {run_id}: `/train list all` shows the runs this channel has")
    return run
