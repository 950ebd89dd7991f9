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

from sqlmodel import select

from jobs import format as fmt
from jobs import preflight, resubmits, spend
from jobs.actor import Actor, may_touch, report_channel
from jobs.code_pin import pin_code
from jobs.db import detach, session_scope
from jobs.deps import Deps
from jobs.errors import ConflictError, SpecError
from jobs.lifecycle import AttemptState, RunState
from jobs.locations import checkpoint_root
from jobs.logs import log_context
from jobs.models import Run, new_id
from jobs.providers.base import Provider, ProviderError
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
    spend_report,
    status,
    wait_for,
)
from jobs.runs import (
    active_attempt,
    budget_then_launch,
    capacity,
    card,
    channel_of,
    checkpoint_prefix,
    end_attempt,
    get_run,
    launch_attempt,
    launcher_refused,
    move_run,
    refresh_card,
    resource_request,
    say,
    spec_of,
)
from jobs.spec import JobSpec, Resources, spec_from_text, stored_section
from jobs.spec.origin import SpecOrigin
from jobs.spec.sources import Catalog, catalog_for, load_spec_for, names_for
from jobs.staging.runs import for_preflight as staging_for_preflight

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


#: The reason a run in PREFLIGHT carries when it was asked for the checks alone
#: (``/train preflight``): after them it waits for "Launch anyway" whatever they say.
PREFLIGHT_ONLY = "preflight only"


def resume_preflights(deps: Deps) -> list[str]:
    """Runs that a crash of the control plane left in PREFLIGHT: end the dry run it left
    behind, if any, and run the checks again. Called once at start; returns the run ids.

    Nothing else would: a run in PREFLIGHT has no attempt for reconcile to find. A run
    whose requester may no longer launch is stopped instead (:func:`launcher_refused`).
    """
    from runner.pidfile import end_stale_dry_run

    with session_scope(deps.engine) as session:
        rows = session.exec(select(Run).where(Run.state == RunState.PREFLIGHT)).all()
        runs = [(r.id, r.reason != PREFLIGHT_ONLY) for r in rows]
        # Each run's dry run was on its spec's provider.
        dry_run_providers = {
            r.id: deps.provider_or_default(stored_section(r.spec, Resources, run_id=r.id))
            for r in rows
        }
    resumed: list[str] = []
    for run_id, launch in runs:
        workdir = deps.settings.state_dir / "preflight" / run_id
        if end_stale_dry_run(workdir / preflight.DRY_RUN_PID_FILE):
            deps.journal.record("dry_run_ended", run_id, reason="control plane restarted")
        for ended in preflight.end_stale_dry_runs(
            deps.engine, dry_run_providers[run_id], run_id, clock=deps.clock
        ):
            deps.journal.record(
                "dry_run_ended",
                run_id,
                reason="control plane restarted",
                instance=ended.instance_id,
                cost_usd=ended.cost_usd,
            )
        if launcher_refused(deps, run_id, states=(RunState.PREFLIGHT,), unsure=False):
            continue  # its checks would start a dry run: stopped instead
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
        resumed.append(run_id)
    return resumed


def preflight_then_launch(
    deps: Deps, run_id: str, *, launch: bool = True, checks: Sequence[str] | None = None
) -> None:
    """Run the checks; launch when they pass, ask when they warn, stop when one fails.

    ``checks``: only the checks of these names (a resubmit's changes need no more), and
    the run keeps its checkpoint interval and budget."""
    with log_context(run_id=run_id):
        _preflight_then_launch(deps, run_id, launch=launch, checks=checks)


def _preflight_then_launch(
    deps: Deps, run_id: str, *, launch: bool, checks: Sequence[str] | None
) -> None:
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        spec = spec_of(run)
        channel, thread_ts = channel_of(run), run.thread_ts
        checkpoint_uri = run.checkpoint_uri or deps.settings.checkpoint_uri
        requester = run.requester
    workdir = deps.settings.state_dir / "preflight" / run_id
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        provider = deps.provider_for(spec)
        request = resource_request(spec, provider)
    except ProviderError as exc:  # its cloud is not configured here, or has no region
        _refuse_provider(deps, run_id, spec, exc)
        return
    ctx = preflight.PreflightContext(
        spec=spec,
        run_id=run_id,
        provider=provider,
        request=request,
        checkpoint_uri=checkpoint_uri,
        mtbp_s=deps.settings.assumed_mtbp_s or preflight.assumed_mtbp_s(provider),
        # Only a provider whose instances are this machine's processes gets a dry run
        # here; with a cloud provider preflight runs nothing (jobs.preflight.DryRunCheck).
        env=({"PYTHONPATH": _code_root()} if provider.capabilities.runs_on_this_machine else {}),
        workdir=workdir,
        cloud=_cloud_dry_run(deps, run_id, provider, owner=requester),
    )
    ctx = staging_for_preflight(deps, ctx)  # a staged copy of its data, or the offer of one

    def on_result(result: preflight.CheckResult) -> None:
        deps.journal.record(
            "preflight_check",
            run_id,
            check=result.name,
            status=result.status.value,
            detail=result.detail,
            remedy=result.remedy,
        )

    chosen = None if checks is None else [c for c in preflight.default_checks() if c.name in checks]
    report = preflight.run_preflight(ctx, chosen, on_result=on_result)
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        if run.state != RunState.PREFLIGHT:
            return  # stopped while the checks ran
        run.preflight = report.as_dict()
        if chosen is None:
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


def _refuse_provider(deps: Deps, run_id: str, spec: JobSpec, exc: ProviderError) -> None:
    """Fail the run's preflight at once: its spec's cloud is not one this control plane
    configures (or gives no region); the report says what to set."""
    result = preflight.CheckResult(
        "provider",
        preflight.Status.FAIL,
        f"the spec asks for resources.cloud={spec.resources.cloud or deps.provider.name}: {exc}",
        "an admin configures that provider (TRAINBOT_PROVIDERS and its settings), or "
        "change resources.cloud in the spec to a configured one",
        data={"cloud": spec.resources.cloud, "configured": list(deps.providers)},
    )
    deps.journal.record(
        "preflight_check",
        run_id,
        check=result.name,
        status=result.status.value,
        detail=result.detail,
        remedy=result.remedy,
    )
    report = preflight.PreflightReport(results=(result,))
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        if run.state != RunState.PREFLIGHT:
            return
        run.preflight = report.as_dict()
        deps.notifier.post(
            report.to_message(channel=channel_of(run), thread_ts=run.thread_ts, run_id=run_id)
        )
        move_run(
            session, run, RunState.PREFLIGHT_FAILED, now=deps.clock(), reason="provider failed"
        )
        deps.journal.record("run_finished", run_id, state="PREFLIGHT_FAILED", reason=run.reason)
        refresh_card(deps, session, run)


def _cloud_dry_run(
    deps: Deps, run_id: str, provider: Provider, *, owner: str
) -> preflight.CloudDryRun | None:
    """What a dry run on a cloud instance needs; None with the local provider (a local
    process) or without a URL instances can report to."""
    if provider.capabilities.runs_on_this_machine or not deps.ingest_url:
        return None

    def say_in_thread(text: str) -> None:
        with session_scope(deps.engine) as session:
            say(deps, get_run(session, run_id), "info", text)

    return preflight.CloudDryRun(
        engine=deps.engine,
        token_for=deps.runner_token,
        ingest_url=deps.ingest_url,
        store_credentials=deps.store_credentials,
        owner=owner,
        say=say_in_thread,
        record=lambda type_, **data: deps.journal.record(type_, run_id, **data),
        clock=deps.clock,
        stopping=lambda: deps.closing,
        limits=preflight.DryRunLimits.from_settings(deps.settings),
    )


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


def resubmit(
    deps: Deps,
    run_id: str,
    actor: Actor,
    *,
    budget_usd: float | None = None,
    from_step: int | None = None,
    overrides: Sequence[str] = (),
    max_price: float | None = None,
) -> Run:
    """Launch a run again from its newest checkpoint (or confirm one awaiting it).

    The budget goes on: a finished run's resubmit carries its spend, and one whose hard
    cap is reached stays stopped unless ``budget_usd`` raises the budget, which is
    recorded with who raised it (the cap would otherwise be walked around by resubmitting).

    ``from_step``: resume from the newest committed checkpoint at or before that step
    instead (the offer after a divergence); see :func:`jobs.resubmits.resubmit_from`.

    ``overrides`` (``key.path=value``) and ``max_price`` (``resubmit.max_price``) change
    the spec of the new run; see :func:`jobs.resubmits.resubmit_changed`.
    """
    if budget_usd is not None and not 0 < budget_usd < float("inf"):
        raise SpecError(f"budget.usd must be a positive number of dollars (got {budget_usd})")
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        may_touch(actor, run)
        state = run.state
    changes = [*overrides, *([f"resubmit.max_price={max_price}"] if max_price else [])]
    if from_step is not None and changes:
        raise SpecError(
            "from= and changes go one at a time: resubmit from the step first, then stop "
            "that run and resubmit it with the changes"
        )
    if from_step is not None:
        return resubmits.resubmit_from(
            deps, run_id, actor, from_step=from_step, budget_usd=budget_usd
        )
    if changes:
        return resubmits.resubmit_changed(
            deps, run_id, actor, overrides=changes, budget_usd=budget_usd
        )
    if state in (RunState.AWAITING_CONFIRMATION, RunState.RECOVERING) and budget_usd is not None:
        with session_scope(deps.engine) as session:
            run = get_run(session, run_id)
            spent = spend.run_spent(session, run_id)
            resubmits.raise_budget(
                deps, run, budget_usd, actor=actor, was=run.budget_usd, spent=spent
            )
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
            run, carried = resubmits.successor(
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
    "PREFLIGHT_ONLY",
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
    "resume_preflights",
    "snooze",
    "specs",
    "spend_report",
    "status",
    "stop",
    "stop_profiled",
    "submit",
    "wait_for",
]
