"""Launching an attempt: record it, then ask the provider for its instance.

Every launch writes the attempt row (with its token's hash) *before* calling the
provider, and the provider's launch is idempotent on the attempt id. So a control plane
killed between the provider call and the database write finds, on restart, an attempt
without an instance: reconcile (:mod:`jobs.runs.reconcile`) adopts the instance tagged
with that attempt by calling :func:`provision` again. There is exactly one instance per
attempt.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from jobs.background.deferred import Later, deferrable
from jobs.database.db import detach, session_scope
from jobs.database.models import Attempt, Run, hash_token
from jobs.domain.errors import ConflictError
from jobs.domain.lifecycle import AttemptState, RunState, transition
from jobs.preflight import resource_request
from jobs.preflight.interval import request_in
from jobs.process.deps import Deps
from jobs.providers.base import CapacityError, LaunchRequest, ProviderError
from jobs.runs import capacity, price
from jobs.runs.cards import refresh_card, say
from jobs.runs.fence import check_fence
from jobs.runs.interval import auto_interval_mtbp, follow_measured_cost
from jobs.runs.kept import instance_keep_s
from jobs.runs.placement import NO_CAPACITY, NoPlacement, choose_placement
from jobs.runs.profile import window
from jobs.runs.rows import (
    active_attempt,
    checkpoint_prefix,
    dry_run_findings,
    get_run,
    latest_attempt,
    move_run,
    spec_of,
)
from jobs.spec import JobSpec, Resources, stored_section
from jobs.spec.env import code_env, secrets_env
from jobs.spend import remove_cloud_budgets
from runner import env as contract

log = logging.getLogger(__name__)

#: Why a run stopped when its requester may no longer start compute (``Deps.may_launch``).
LAUNCHER_REMOVED = (
    "{user} is no longer allowed to launch (TRAINBOT_LAUNCHERS); the run was stopped "
    "before its next attempt"
)

#: The states in which a run's next attempt is launched on its own.
_LAUNCHABLE = (RunState.LAUNCHING, RunState.RECOVERING)


def runner_command(deps: Deps, spec: JobSpec) -> list[str]:
    """What the instance runs: the supervisor around the spec's command."""
    command = list(spec.command)
    local = deps.provider_for(spec).capabilities.runs_on_this_machine
    # With the code's own virtual environment, ``python`` is that one's (first on PATH).
    own_venv = spec.code is not None and spec.setup and spec.setup_cache.venv
    # In the spec's image, ``python`` is the image's.
    shared = local and not own_venv and spec.image is None
    if shared and command and command[0] in ("python", "python3"):
        command[0] = sys.executable  # the local "instance" shares this machine's interpreter
    runner = [sys.executable, "-m", "runner.cli"] if local else ["trainbot-runner"]
    sync = spec.checkpoint.sync_dir
    return [*runner, "exec", *(["--sync-dir", sync] if sync else []), "--", *command]


def runner_env(deps: Deps, run: Run, attempt: Attempt, spec: JobSpec) -> dict[str, str]:
    """The attempt's environment: the spec's own ``env`` untouched, then the runner's
    variables, rendered by their contract (:mod:`runner.env`)."""
    provider = deps.provider_named(attempt.provider)
    local = provider.capabilities.runs_on_this_machine
    interval = run.checkpoint_interval_s or None
    under_torchrun = spec.resources.under_torchrun
    # A run resubmitted from a step (its own directory holds a copy of that step; a step 0
    # needs no maximum, and the runner takes only a positive one).
    resume_max_step = (
        attempt.number == 1 and not run.checkpoint_prefix and attempt.resumed_from_step
    )
    env = dict(spec.env)
    env |= contract.render(
        {
            contract.RUN_ID: run.id,
            contract.ATTEMPT_ID: attempt.id,
            contract.CHECKPOINT_URI: run.checkpoint_uri or deps.settings.checkpoint_uri,
            contract.CHECKPOINT_PREFIX: checkpoint_prefix(run),
            contract.TOKEN: deps.runner_token(attempt.id),
            contract.TERMINATION_WINDOW_S: provider.capabilities.termination_window_s,
            contract.METRICS_EVERY: 1,
            contract.INGEST_URL: deps.ingest_url or None,
            # The default's broker: the store asks /v1/credentials.
            contract.STORE_CREDENTIALS: (
                "broker" if deps.store_credentials and provider is deps.provider else None
            ),
            contract.CHECKPOINT_INTERVAL_S: interval,
            # "auto": the session moves the interval to the save cost it measures.
            contract.CHECKPOINT_AUTO_MTBP_S: auto_interval_mtbp(run, spec) if interval else None,
            # The node's rank and node 0's address come with each node's launch (gang.py).
            contract.TORCHRUN: under_torchrun or None,
            contract.NPROC_PER_NODE: spec.resources.nproc_per_node if under_torchrun else None,
            contract.CHECKPOINT_EVERY_STEPS: spec.checkpoint.every_steps or None,
            contract.TRAIN_THROUGH_NOTICE: spec.checkpoint.train_through_notice or None,
            contract.RESUME_MAX_STEP: resume_max_step or None,
            # When a standing step gets its stacks dumped (runner.stacks; the hung rule).
            contract.HANG_FACTOR: spec.alerts.hung.factor,
            contract.HANG_FLOOR_S: spec.alerts.hung.floor,
            # The run's data: the staged copy in its region once there is one.
            contract.DATA_URI: spec.data_uri or None,
            # The notices of the cloud the instance really is on, not the one a spec names.
            contract.PREEMPTION_SOURCES: None if local else provider.capabilities.preemption_source,
            # debug.keep_failed_instance: the boot script's own bound on a kept instance.
            contract.KEEP_FAILED_S: instance_keep_s(deps.settings, spec),
        }
    )
    env |= code_env(spec, local=local)
    aws_region = provider.capabilities.default_region if provider.name == "aws" else None
    env |= secrets_env(spec, local=local, aws_region=aws_region)
    env.update(measured_write_env(run))
    missing = contract.missing_required(env)
    assert not missing, f"the runner's environment lacks {missing}"
    if local:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


def measured_write_env(run: Run) -> dict[str, str]:
    """The checkpoint write that preflight's dry run measured on the run's store, for the
    runner's emergency-flush margin before it has saved (or restored) anything itself:
    without it a first attempt's notice is judged by the cautious guess
    (:data:`runner.preemption.ASSUMED_BANDWIDTH_BPS`), which leaves most of a short window
    unused. A resumed attempt measures the checkpoint it restores instead."""
    found = dry_run_findings(run)
    bandwidth = found.write_bandwidth_bps
    if bandwidth is None or bandwidth < 1:  # under a byte a second: nothing measured
        return {}
    stall_s = found.stall_s if found.stall_s is not None and found.stall_s >= 1e-6 else None
    return contract.render(
        {contract.MEASURED_WRITE_BPS: bandwidth, contract.MEASURED_STALL_S: stall_s}
    )


def launcher_refused(
    deps: Deps, run_id: str, *, states: Sequence[RunState] = _LAUNCHABLE, unsure: bool = True
) -> bool:
    """Whether ``run_id``'s requester may no longer start compute (``Deps.may_launch``),
    asked at the moment a launch would happen on its own: after preflight, when a price
    is met, a resubmit after a preemption, a retry, a preflight resumed after a restart.

    A refused run (in one of ``states``, with no live attempt) is stopped, and its thread
    says why; nothing is recorded or launched for it, so it leaves no instance. The
    question is asked outside any transaction (the front end may ask Slack for a user
    group's members). False when the run is not waiting to start anything.

    ``unsure`` is the answer when the front end cannot tell now (Slack could not list a
    launcher group): by default the launch waits (reconcile's backstop and the price job
    ask again); a run is never stopped over an outage.
    """
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id)
        if run is None or run.state not in states or active_attempt(session, run_id) is not None:
            return False
        requester = run.requester
    allowed = deps.may_launch(requester)
    if allowed is None:
        log.warning(
            "cannot tell now whether %s may still launch; %s %s",
            requester,
            run_id,
            "waits for the next try" if unsure else "goes on, and is asked again at its launch",
        )
        return unsure
    if allowed:
        return False
    now = deps.clock()
    reason = LAUNCHER_REMOVED.format(user=requester)
    log.warning("refused the launch of %s: %s may no longer launch", run_id, requester)
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id, with_for_update=True)
        if run is None or run.state not in states or active_attempt(session, run_id) is not None:
            return True  # it moved on meanwhile (stopped, or launched before the removal)
        run.price_wait = None
        move_run(session, run, RunState.STOPPED, now=now, reason=reason)
        deps.journal.record("run_finished", run.id, state="STOPPED", reason=reason)
        say(
            deps,
            run,
            "error",
            f"{reason}. An admin can resubmit {run.id}; it resumes from its last checkpoint.",
        )
        refresh_card(deps, session, run)
    # No attempt ends to take its cloud budget along (as a stop before a launch).
    deps.background(remove_cloud_budgets, deps, now=now, run_ids=[run_id])
    return True


@deferrable(Later.LAUNCH)
def launch_attempt(deps: Deps, run_id: str) -> Attempt | None:
    """Start the next attempt of a run, if it needs one. Safe to call concurrently (and
    again after a crash: the next attempt number is unique per run). Whoever calls it,
    the run's requester must still be allowed to launch (:func:`launcher_refused`)."""
    if launcher_refused(deps, run_id):
        return None
    try:
        made = _new_attempt(deps, run_id, now=deps.clock())
    except ConflictError:
        # Another thread (a resubmit timer, reconcile) created this attempt number first;
        # the unique (run, number) key refused ours when the transaction committed.
        return None
    if made is None:
        return None
    attempt_id, why = made
    return provision(deps, attempt_id, why=why)


def _new_attempt(deps: Deps, run_id: str, *, now: datetime) -> tuple[str, str] | None:
    """Record the run's next attempt, REQUESTED, and why it is placed where it is; or
    say why there is none (None): it failed, it waits for a price, or for capacity (its
    next try deferred here, once the wait is committed)."""
    made = _record_attempt(deps, run_id, now=now)
    if isinstance(made, capacity.Retry):
        capacity.defer_retry(deps, made)
        return None
    return made


def _record_attempt(
    deps: Deps, run_id: str, *, now: datetime
) -> tuple[str, str] | capacity.Retry | None:
    with session_scope(deps.engine) as session:
        check_fence(deps, session, action=f"a new attempt of {run_id}")
        run = session.get(Run, run_id)
        if run is None or run.state not in (RunState.LAUNCHING, RunState.RECOVERING):
            return None
        if active_attempt(session, run_id) is not None:
            return None
        if capacity.not_due(session, run_id, now=now):
            return None  # waiting for capacity: its next try launches it
        spec = spec_of(run)
        placement = choose_placement(deps, session, run, spec)
        if isinstance(placement, NoPlacement):
            retry = capacity.wait(deps, session, run, spec, placement, now=now)
            if retry is not None:
                return retry
            reason = placement.reason + capacity.gave_up(deps, session, run, spec)
            move_run(session, run, RunState.FAILED, now=now, reason=reason)
            deps.journal.record("run_finished", run.id, state="FAILED", reason=run.reason)
            say(deps, run, "error", f"Run {run.id} failed: {run.reason}.")
            refresh_card(deps, session, run)
            return None
        gated = price.gate(deps, spec, placement)
        if isinstance(gated, price.PriceWait):
            price.wait(deps, session, run, gated, now=now)  # the price job launches it
            return None
        price.met(deps, run, gated)
        placement = gated
        prev = latest_attempt(session, run_id)
        number = (prev.number if prev else 0) + 1
        for skipped in placement.skipped:
            say(deps, run, "info", f"Attempt {number} skips region {skipped}.")
        if spec.checkpoint.interval_s is None:
            follow_measured_cost(deps, session, run)
        attempt = Attempt(
            run_id=run_id,
            number=number,
            provider=placement.provider or deps.provider.name,
            region=placement.region,
            zone=placement.zone,
            instance_type=spec.resources.instance_type,
            spot=placement.spot,
            instances=spec.resources.instances,
            resumed_from_step=run.last_committed_step,
        )
        attempt.profile_until_step, attempt.profile_until_s = window(
            spec, run, start_step=run.last_committed_step or 0
        )
        attempt.token_hash = hash_token(deps.runner_token(attempt.id))
        session.add(attempt)
        deps.journal.record(
            "placed",
            run.id,
            attempt=number,
            region=placement.region,
            zone=placement.zone,
            spot=placement.spot,
            why=placement.note,
            skipped=list(placement.skipped),
        )
        return attempt.id, placement.note


def placement_record(attempt: Attempt) -> dict[str, Any]:
    """What the journal says of where an attempt runs, the same in "launched" and
    "resubmitted"."""
    return {
        "attempt": attempt.number,
        "region": attempt.region,
        "zone": attempt.zone,
        "spot": attempt.spot,
        "resume_from_step": attempt.resumed_from_step,
    }


def provision(deps: Deps, attempt_id: str, *, why: str = "") -> Attempt | None:
    """Call the provider for a REQUESTED attempt (first launch, or adoption after a crash).
    ``why``: why the attempt is on-demand or in another region, for the thread."""
    with session_scope(deps.engine) as session:
        check_fence(deps, session, action=f"the launch of attempt {attempt_id}")
        attempt = session.get(Attempt, attempt_id)
        if attempt is None or attempt.state != AttemptState.REQUESTED:
            return attempt
        run = session.get(Run, attempt.run_id)
        assert run is not None
        if attempt.token_hash != hash_token(deps.runner_token(attempt.id)):
            # Recorded by a replica with another secret: its runner's batches will be
            # refused, and it is terminated as silent after the heartbeat deadline.
            log.error(
                "attempt %s was recorded by a replica whose runner-token secret is not this "
                "one's: its runner will be refused; set TRAINBOT_RUNNER_TOKEN_SECRET to one "
                "value on every replica",
                attempt.id,
            )
        spec = spec_of(run)
        provider = deps.provider_named(attempt.provider)
        req = LaunchRequest(
            run_id=run.id,
            attempt_id=attempt.id,
            owner=run.requester,
            request=(
                request_in(spec, attempt.region, spot=attempt.spot, provider=provider)
                if attempt.region
                else resource_request(spec, provider, spot=attempt.spot)
            ),
            zone=attempt.zone or "",
            command=runner_command(deps, spec),
            env=runner_env(deps, run, attempt, spec),
            scratch_bytes=int(spec.resources.disk_gb * 1e9),
            idempotency_key=attempt.id,
            spot=attempt.spot,
            nodes=attempt.instances,
        )
    now = deps.clock()
    try:
        info = provider.launch(req)
        price = provider.price(req.request, zone=req.zone)
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
            # so it is the same instance): the first to record it wins. Or the runner
            # reported that it started before the launch call returned: then nobody has
            # recorded where it runs yet, and an attempt without its instance id leaves
            # that instance to no one.
            if attempt.instance_id is None:
                attempt.instance_id = info.instance_id
                attempt.zone = info.zone or attempt.zone
                attempt.started_at = attempt.started_at or now
                if attempt.price_per_hour is None:
                    attempt.price_per_hour = (
                        price.spot_usd_per_hour if attempt.spot else price.on_demand_usd_per_hour
                    )
                    attempt.spot_price_per_hour = price.spot_usd_per_hour
                session.add(attempt)
                session.flush()
            detach(session, attempt)
            return attempt
        run = session.get(Run, attempt.run_id)
        assert run is not None
        capacity.found_capacity(deps, session, run, attempt, zone=info.zone, now=now)
        attempt.instance_id = info.instance_id
        attempt.zone = info.zone or attempt.zone
        attempt.state = transition(attempt.state, AttemptState.PROVISIONING, subject_id=attempt.id)
        attempt.started_at = now
        attempt.price_per_hour = (
            price.spot_usd_per_hour if attempt.spot else price.on_demand_usd_per_hour
        )
        attempt.spot_price_per_hour = price.spot_usd_per_hour  # an on-demand premium's base
        session.add(attempt)
        deps.journal.record(
            "launched",
            run.id,
            **placement_record(attempt),
            attempt_id=attempt.id,
            instance=info.instance_id,
            price_per_hour=attempt.price_per_hour,
            why=why,
            checkpoint_interval_s=run.checkpoint_interval_s,
        )
        resume = (
            f", resuming from step {attempt.resumed_from_step}" if attempt.resumed_from_step else ""
        )
        where = attempt.zone or attempt.region
        if attempt.spot:
            on = (
                f"{attempt.instances} spot instances {info.instance_id}"
                if attempt.instances > 1
                else f"spot instance {info.instance_id}"
            )
            text = (
                f"Attempt {attempt.number} launched on {on} in {where} at "
                f"${attempt.price_per_hour:.2f}/h{' each' if attempt.instances > 1 else ''}"
                f"{resume}."
            )
            if why:
                text += f" It runs in {attempt.region}: {why}."
        else:
            # On-demand costs several times spot: say so, and why, where people look.
            text = (
                f"Attempt {attempt.number} runs on-demand at ${attempt.price_per_hour:.2f}/h"
                f"{': ' + why if why else ''}. Instance {info.instance_id} in {where}"
                f"{resume}."
            )
            if why.startswith("no spot capacity"):
                text += " The next attempt tries spot first."
        say(deps, run, "launched", text)
        refresh_card(deps, session, run)
        detach(session, attempt)
        return attempt


def _launch_failed(deps: Deps, attempt_id: str, exc: ProviderError, *, now: datetime) -> None:
    """A refused launch: no capacity retries in the next zone at once (said in
    the thread by the launch that follows, or by the wait for capacity when every zone
    refused); anything else (permissions, quota, a bad request) will not fix itself and
    fails the run."""
    no_room = isinstance(exc, CapacityError)
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        run = session.get(Run, attempt.run_id) if attempt else None
        if attempt is None or run is None:
            return
        attempt.state = transition(attempt.state, AttemptState.FAILED, subject_id=attempt.id)
        attempt.end_reason = f"{NO_CAPACITY}: {exc}" if no_room else str(exc)
        attempt.ended_at = now
        attempt.token_hash = None
        session.add(attempt)
        if not no_room:
            say(deps, run, "error", f"Attempt {attempt.number} of {run.id} could not launch: {exc}")
            move_run(session, run, RunState.FAILED, now=now, reason=str(exc))
            deps.journal.record("run_finished", run.id, state="FAILED", reason=run.reason)
            refresh_card(deps, session, run)
            return
        if run.state == RunState.LAUNCHING:
            move_run(session, run, RunState.RECOVERING, now=now)
        run_id = run.id
    # The next zone at once: one zone's refusal says nothing of the next. Once every zone
    # has refused, the run waits with a backoff (jobs.runs.capacity). A row, not a timer:
    # the retry outlives this replica (jobs.background.deferred).
    deps.later(0.0, Later.LAUNCH, key=f"launch-after:{attempt_id}", run_id=run_id)


def budget_then_launch(
    deps: Deps, run_id: str, *, budget: float | None, thresholds: Sequence[int]
) -> None:
    """Every way into LAUNCHING (checks passed, a person confirmed, a resubmit) gets the
    cloud budget, unless the requester may no longer launch (then neither is made)."""
    if launcher_refused(deps, run_id, unsure=False):  # launch_attempt asks again
        return
    if budget:
        cloud_budget(deps, run_id, budget, thresholds)
    launch_attempt(deps, run_id)


def cloud_budget(deps: Deps, run_id: str, budget: float, thresholds: Sequence[int]) -> None:
    """Where the provider has budgets (AWS Budgets), the run's budget alert lives there too.

    The cloud's budget sees the costs tagged with this run only, so a resubmitted run's
    gets what is left of ``budget`` after the spend it carries from the runs before it
    (none left: no cloud budget; the control plane's own cap and alerts still hold)."""
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        carried = run.carried_usd or 0.0
        resources = stored_section(run.spec, Resources, run_id=run_id)
    try:
        provider = deps.provider_for(resources)
    except ProviderError:  # not configured: the launch says so
        return
    if not provider.capabilities.cloud_budgets:
        return
    usd = round(budget - carried, 2)
    if usd <= 0:
        return
    try:
        name = provider.create_budget(run_id=run_id, usd=usd, thresholds=list(thresholds))
    except ProviderError as exc:
        with session_scope(deps.engine) as session:
            say(deps, get_run(session, run_id), "error", f"Cloud budget not created: {exc}")
        return
    deps.journal.record("cloud_budget", run_id, name=name, usd=usd)
