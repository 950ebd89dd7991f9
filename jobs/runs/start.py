"""A run's start: its preflight checks, then its launch, its budget first.

:func:`jobs.usecases.service.submit` records the run and hands it here in the background;
"Launch anyway" after warnings is :func:`confirm`; a
resubmit with changes (:mod:`jobs.usecases.resubmits`) runs the checks its changes need; a
control plane that restarts mid-preflight runs them again (:func:`resume_preflights`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from sqlmodel import select

from jobs import preflight
from jobs.database.db import detach, session_scope
from jobs.database.models import Run
from jobs.domain import format as fmt
from jobs.domain.actor import Actor, may_touch
from jobs.domain.errors import ConflictError
from jobs.domain.lifecycle import RunState
from jobs.preflight import resource_request
from jobs.process.deps import Deps
from jobs.process.logs import log_context
from jobs.providers.base import Provider, ProviderError
from jobs.runs.cards import refresh_card, say
from jobs.runs.launch import budget_then_launch, launcher_refused
from jobs.runs.rows import channel_of, get_run, move_run, spec_of
from jobs.spec import JobSpec, Resources, stored_section
from jobs.staging.runs import for_preflight as staging_for_preflight

__all__ = ["PREFLIGHT_ONLY", "confirm", "preflight_then_launch", "resume_preflights"]

log = logging.getLogger(__name__)


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
        _journal_check(deps, run_id, result)

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
    _journal_check(deps, run_id, result)
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
    root = str(Path(__file__).resolve().parents[2])
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


def _journal_check(deps: Deps, run_id: str, result: preflight.CheckResult) -> None:
    deps.journal.record(
        "preflight_check",
        run_id,
        check=result.name,
        status=result.status.value,
        detail=result.detail,
        remedy=result.remedy,
    )
