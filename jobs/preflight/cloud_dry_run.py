"""The dry run on a cheap cloud instance: launched, awaited, terminated whatever happens.

With a cloud provider the control plane never runs a spec's command itself. It launches
one cheap instance instead (``dry_run.instance_type``, else the provider's cheapest type
of the run's accelerator, or a CPU type: ``Provider.dry_run_request``) through the same
launch path as an attempt's, with the same boot script, image and instance role, and
``LaunchRequest.dry_run`` set. The instance runs ``trainbot-runner dry-run`` against the
run's real store (through the credential broker where one is configured) and reports
over ``POST /v1/dry-run`` with a token of its own (:mod:`jobs.ingest.dry_run`).

The ``dry_runs`` row, with the token's hash, is committed before the launch, and
:func:`end_dry_run` terminates the instance on every way out: a report, a failure, a
timeout, and (through :func:`end_stale_dry_runs`, called when a restarted control plane
resumes an interrupted preflight) a crash in the middle. Why: docs/architecture.md,
"The dry run on a cloud instance".
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from jobs.background.workers import waiting
from jobs.database.db import detach, session_scope
from jobs.database.models import DryRunInstance, Run, hash_token
from jobs.domain.format import duration, usd
from jobs.preflight.dry_run import dry_run_args
from jobs.preflight.dry_run_limits import DryRunLimits, live_in_channel, slot_lock
from jobs.preflight.report import CheckResult, PreflightContext, Status
from jobs.providers.base import (
    InstanceNotFound,
    LaunchRequest,
    Provider,
    ProviderError,
    ResourceRequest,
)
from jobs.spec.env import code_env, secrets_env
from runner.dryrun_report import DRY_RUN_ID_ENV, DryRunReport
from runner.wire import restore_floats

__all__ = [
    "CloudDryRun",
    "end_dry_run",
    "end_open_dry_runs",
    "end_stale_dry_runs",
    "live_dry_run_ids",
    "stop_dry_runs",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CloudDryRun:
    """What a dry run on a cloud instance needs beyond the check's context."""

    #: The control plane's database: the ``dry_runs`` row is the dry run's only state.
    engine: Engine
    #: The token for an id (``Deps.runner_token``): random per id; only its hash is kept.
    token_for: Callable[[str], str]
    #: Where the instance reports (``{public_url}/v1/events``; the route is beside it).
    ingest_url: str
    #: The instance's store asks ``/v1/credentials`` (a broker is configured).
    store_credentials: bool
    #: Who launched the run (the instance's owner tag).
    owner: str
    #: Posts a line in the run's thread: the dry run's progress.
    say: Callable[[str], None]
    #: Records a journal event for the run: ``record(type, **data)``.
    record: Callable[..., None]
    clock: Callable[[], datetime]
    #: True once the control plane is shutting down: the wait ends, the instance goes.
    stopping: Callable[[], bool] = lambda: False
    #: The admin's limits: allowed types, price ceiling, dry runs per channel.
    limits: DryRunLimits = field(default_factory=DryRunLimits)
    #: Seconds between looks at the row, and between questions to the provider.
    poll_s: float = 1.0
    status_every_s: float = 15.0

    def run(
        self, ctx: PreflightContext, *, judge: Callable[[DryRunReport], CheckResult]
    ) -> CheckResult:
        """Launch, wait for the report or the end, terminate; ``judge`` reads the report."""
        settings = ctx.spec.dry_run
        refused = self.limits.refuse_type(ctx.provider.name, settings.instance_type)
        if refused is not None:
            return refused
        try:
            # One instance, whatever the run's node count: the dry run is one process.
            one = dataclasses.replace(ctx.request, instances=1)
            req = ctx.provider.dry_run_request(one, instance_type=settings.instance_type)
            zone = _first_zone(ctx.provider, req)
            quote = ctx.provider.price(req, zone=zone)
        except ProviderError as exc:
            return CheckResult(
                "dry_run",
                Status.FAIL,
                f"the dry run's instance could not be placed: {exc}",
                "set dry_run.instance_type to a type this account can launch in "
                f"{ctx.request.region}, or dry_run.local=true to run `trainbot-runner "
                "dry-run` yourself",
                data={"instance": {"request": dataclasses.asdict(ctx.request)}},
            )
        price = quote.spot_usd_per_hour if req.spot else quote.on_demand_usd_per_hour
        refused = self.limits.refuse_price(req.instance_type or "?", price=price, spot=req.spot)
        if refused is not None:
            return refused
        recorded = self._record(ctx, req, zone=zone, price=price)
        if isinstance(recorded, CheckResult):
            return recorded  # the channel has its limit of dry runs under way
        dry_run_id = recorded
        launch = LaunchRequest(
            run_id=ctx.run_id,
            attempt_id=dry_run_id,
            owner=self.owner,
            request=req,
            zone=zone,
            command=dry_run_args(ctx, timeout_s=ctx.spec.dry_run.timeout),
            env=self._environment(ctx, dry_run_id),
            scratch_bytes=int(ctx.spec.resources.disk_gb * 1e9),
            idempotency_key=dry_run_id,
            spot=req.spot,
            dry_run=True,
        )
        outcome: tuple[str, Any] = ("refused", "the control plane failed during the launch")
        try:
            outcome = self._launch_and_wait(ctx, launch, price=price)
        except ProviderError as exc:
            outcome = ("refused", str(exc))
        finally:
            ended = end_dry_run(
                self.engine, ctx.provider, dry_run_id, reason=outcome[0], clock=self.clock
            )
        return self._result(ctx, outcome, ended, judge=judge)

    # -- the steps -----------------------------------------------------------------------

    def _record(
        self, ctx: PreflightContext, req: ResourceRequest, *, zone: str, price: float
    ) -> str | CheckResult:
        """Commit the row, with the token's hash, before anything is launched; a FAIL
        instead when the run's channel has its limit of dry runs under way."""
        with slot_lock, session_scope(self.engine) as session:
            run = session.get(Run, ctx.run_id)
            if run is not None and run.state.is_terminal():
                return CheckResult(
                    "dry_run",
                    Status.FAIL,
                    f"{ctx.run_id} is {run.state.value}: no dry run was launched for it",
                    "resubmit the run if it is wanted after all",
                )
            channel, live = live_in_channel(session, ctx.run_id)
            refused = self.limits.refuse_busy(channel, [r for _, r in live if r != ctx.run_id])
            if refused is not None:
                return refused
            row = DryRunInstance(
                run_id=ctx.run_id,
                provider=ctx.provider.name,
                region=req.region,
                zone=zone,
                instance_type=req.instance_type,
                spot=req.spot,
                price_per_hour=price,
                created_at=self.clock(),
            )
            row.token_hash = hash_token(self.token_for(row.id))
            session.add(row)
        dry_run_id = row.id
        with session_scope(self.engine) as session:
            # Another replica may have taken the last place meanwhile: the later goes.
            channel, live = live_in_channel(session, ctx.run_id)
            order = [d for d, _ in live]
            if dry_run_id in order and order.index(dry_run_id) >= self.limits.per_channel:
                mine = session.get(DryRunInstance, dry_run_id)
                if mine is not None:
                    session.delete(mine)
                others = [r for d, r in live if d != dry_run_id and r != ctx.run_id]
                return self.limits.refuse_busy(channel, others) or CheckResult(
                    "dry_run", Status.FAIL, f"{channel} has its limit of dry runs under way"
                )
        return dry_run_id

    def _environment(self, ctx: PreflightContext, dry_run_id: str) -> dict[str, str]:
        """What the instance's runner gets: the spec's env, the store, the report route."""
        env = dict(ctx.spec.env)
        env.update(
            TRAINBOT_RUN_ID=ctx.run_id,
            TRAINBOT_ATTEMPT_ID=dry_run_id,
            TRAINBOT_TOKEN=self.token_for(dry_run_id),
            TRAINBOT_INGEST_URL=self.ingest_url,
            TRAINBOT_CHECKPOINT_URI=ctx.checkpoint_uri,
            TRAINBOT_PREEMPTION_SOURCES=ctx.provider.capabilities.preemption_source,
        )
        env[DRY_RUN_ID_ENV] = dry_run_id
        env.update(code_env(ctx.spec, local=False))  # its code and setup, as the run's
        region = ctx.provider.capabilities.default_region if ctx.provider.name == "aws" else None
        env.update(secrets_env(ctx.spec, local=False, aws_region=region))  # references only
        if self.store_credentials:
            env["TRAINBOT_STORE_CREDENTIALS"] = "broker"
        sample = ctx.spec.dry_run.sample or ctx.spec.data_uri
        if sample:
            env["TRAINBOT_DATA_URI"] = sample
        if ctx.spec.resources.under_torchrun:
            env["TRAINBOT_TORCHRUN"] = "1"  # the dry run: one process under torchrun
        return env

    def _launch_and_wait(
        self, ctx: PreflightContext, launch: LaunchRequest, *, price: float
    ) -> tuple[str, Any]:
        started = self.clock()
        info = ctx.provider.launch(launch)
        with session_scope(self.engine) as session:
            row = session.get(DryRunInstance, launch.attempt_id)
            assert row is not None
            row.instance_id, row.zone, row.launched_at = info.instance_id, info.zone, started
            ended_meanwhile = row.ended_at is not None
            why = row.end_reason or "the run was stopped"
            session.add(row)
        if ended_meanwhile:
            # A stop ended the dry run while its launch was under way: this instance is
            # one that stop could not find yet.
            ctx.provider.terminate(info.instance_id)
            return ("cancelled", why)
        timeout = ctx.spec.dry_run.timeout
        self.record(
            "dry_run_launched",
            instance=info.instance_id,
            instance_type=launch.request.instance_type,
        )
        self.say(
            f"Dry run: launched {launch.request.instance_type} {info.instance_id} in "
            f"{info.zone or launch.zone} at {usd(price)}/h; waiting up to {duration(timeout)} "
            "for it to boot, checkpoint, restart and report."
        )
        # Hours, perhaps: the worker is given back to the pool meanwhile (jobs.background.workers).
        with waiting():
            return self._wait(ctx.provider, launch.attempt_id, info.instance_id, timeout_s=timeout)

    def _wait(
        self, provider: Provider, dry_run_id: str, instance_id: str, *, timeout_s: float
    ) -> tuple[str, Any]:
        """("reported", report dict), ("ended", why), ("timeout", seconds),
        ("stopped", None) or ("cancelled", why: the run was stopped, which ended it)."""
        begun = time.monotonic()
        next_status = begun + self.status_every_s
        phase = None
        while True:
            row = _read(self.engine, dry_run_id)
            if row.phase != phase:
                phase = row.phase
                self._progress(phase, instance_id, waited=time.monotonic() - begun)
            if row.report is not None:
                return ("reported", row.report)
            if row.token_hash is None:  # ended elsewhere: a stop (end_open_dry_runs)
                return ("cancelled", row.end_reason or "the run was stopped")
            now = time.monotonic()
            if now - begun >= timeout_s:
                return ("timeout", timeout_s)
            if self.stopping():
                return ("stopped", None)
            if now >= next_status:
                next_status = now + self.status_every_s
                ended = _ended(provider, instance_id)
                if ended is not None:
                    late = _read(self.engine, dry_run_id).report  # sent just before the end
                    return ("reported", late) if late is not None else ("ended", ended)
            time.sleep(self.poll_s)

    def _progress(self, phase: str | None, instance_id: str, *, waited: float) -> None:
        if phase == "started":
            self.say(f"Dry run: the runner started on {instance_id} after {duration(waited)}.")
        elif phase == "saved":
            self.say(
                "Dry run: a checkpoint is committed to the run's store and the process was "
                "killed; it restarts from it."
            )

    def _result(
        self,
        ctx: PreflightContext,
        outcome: tuple[str, Any],
        ended: DryRunInstance,
        *,
        judge: Callable[[DryRunReport], CheckResult],
    ) -> CheckResult:
        kind, value = outcome
        seconds = _seconds(ended)
        cost = ended.cost_usd or 0.0
        what = " ".join(p for p in (ended.instance_type, ended.instance_id) if p)
        where = f"{what} in {ended.zone}" if ended.zone else what
        instance = {
            "dry_run_id": ended.id,
            "instance_id": ended.instance_id,
            "instance_type": ended.instance_type,
            "zone": ended.zone,
            "spot": ended.spot,
            "price_per_hour": ended.price_per_hour,
            "seconds": seconds,
            "cost_usd": cost,
        }
        self.record("dry_run_ended", dry_run=ended.id, outcome=kind, cost_usd=cost)
        paid = f"on {where}, {duration(seconds)} at {usd(ended.price_per_hour or 0)}/h: {usd(cost)}"
        if kind == "reported":
            report = _report(value)
            if report is None:
                result = CheckResult(
                    "dry_run",
                    Status.FAIL,
                    "the dry run's instance sent a report this control plane cannot read",
                    "run the same trainbot version on the control plane and the instances "
                    "(the runner package), then run preflight again",
                )
            else:
                result = judge(report)
            return dataclasses.replace(
                result,
                detail=f"{result.detail} (ran {paid})",
                data={**result.data, "instance": instance},
            )
        if kind == "timeout":
            detail = (
                f"the dry run's instance sent no report within {duration(value)}; it was "
                f"terminated ({paid})"
            )
            remedy = (
                "raise dry_run.timeout if the image installs slowly, check that instances "
                f"reach {self.ingest_url.rsplit('/v1/', 1)[0]} (TRAINBOT_PUBLIC_URL), and read "
                "the instance's console output for the boot script's lines"
            )
        elif kind == "stopped":
            detail = (
                "the control plane shut down during the dry run; its instance was terminated "
                f"({paid})"
            )
            remedy = "run preflight again (`/train preflight`) once the control plane is back"
        elif kind == "cancelled":
            detail = f"the dry run was ended before it reported ({value}; {paid})"
            remedy = "run preflight again (`/train preflight`) when the run is wanted"
        elif kind == "ended":
            detail = f"the dry run's instance ended before it reported ({value}; {paid})"
            remedy = (
                "read the instance's console output (the boot script says why the runner "
                "stopped: the install, the command, the store), fix it, run preflight again"
            )
        else:
            detail = f"the dry run's instance could not be launched: {value}"
            remedy = (
                "set dry_run.instance_type to a type this account can launch, or "
                "dry_run.local=true to run `trainbot-runner dry-run` yourself"
            )
        return CheckResult("dry_run", Status.FAIL, detail, remedy, data={"instance": instance})


# -- ending a dry run's instance: after it reports, and after a restart ---------------------


def end_dry_run(
    engine: Engine,
    provider: Provider,
    dry_run_id: str,
    *,
    reason: str,
    clock: Callable[[], datetime],
) -> DryRunInstance:
    """Terminate the dry run's instance, revoke its token and price its time; idempotent.

    An instance whose id was never recorded (the control plane died inside the launch)
    is found by its tags. The row is closed even when the terminate fails: the instance
    is then an orphan to reconcile, whose sweep terminates it (the error is logged and
    kept in ``end_reason``).
    """
    row = _read(engine, dry_run_id)
    if row.ended_at is not None:
        return row
    with session_scope(engine) as session:  # the token goes first: no more credentials
        revoke = session.get(DryRunInstance, dry_run_id)
        assert revoke is not None
        revoke.token_hash = None
        revoke.end_reason = revoke.end_reason or reason
        session.add(revoke)
    ids = [row.instance_id] if row.instance_id else _tagged(provider, row)
    try:
        for instance_id in ids:
            provider.terminate(instance_id)
    except ProviderError as exc:
        log.warning("dry run %s: could not terminate its instance: %s", dry_run_id, exc)
        reason = f"{reason}; terminate failed ({exc}), left to reconcile's orphan sweep"
    now = clock()  # once the terminate has returned: the time paid for ends there
    with session_scope(engine) as session:
        fresh = session.get(DryRunInstance, dry_run_id)
        assert fresh is not None
        if fresh.ended_at is not None:  # another thread ended it meanwhile (a stop)
            detach(session, fresh)
            return fresh
        fresh.instance_id = fresh.instance_id or (ids[0] if ids else None)
        fresh.token_hash = None
        fresh.ended_at = now
        fresh.end_reason = reason
        began = fresh.launched_at or fresh.created_at
        hours = max(0.0, (now - began).total_seconds()) / 3600
        fresh.cost_usd = round((fresh.price_per_hour or 0.0) * hours, 4)
        session.add(fresh)
        detach(session, fresh)
    return fresh


def end_stale_dry_runs(
    engine: Engine, provider: Provider, run_id: str, *, clock: Callable[[], datetime]
) -> list[DryRunInstance]:
    """The dry runs of ``run_id`` a dead control plane left open, ended (instances
    terminated); called before its interrupted preflight runs again."""
    return end_open_dry_runs(
        engine, provider, run_id, reason="control plane restarted", clock=clock
    )


def end_open_dry_runs(
    engine: Engine,
    provider: Provider,
    run_id: str,
    *,
    reason: str,
    clock: Callable[[], datetime],
) -> list[DryRunInstance]:
    """End every dry run of ``run_id`` still under way: its token revoked at once, its
    instance terminated. A stop calls it (on the stop lane); the preflight waiting on one
    sees its token gone within a poll and reports that the dry run was ended."""
    with session_scope(engine) as session:
        open_ids = session.exec(
            select(DryRunInstance.id).where(
                DryRunInstance.run_id == run_id, col(DryRunInstance.ended_at).is_(None)
            )
        ).all()
    return [end_dry_run(engine, provider, i, reason=reason, clock=clock) for i in open_ids]


def stop_dry_runs(
    engine: Engine,
    provider: Provider,
    run_id: str,
    *,
    pid_file: Path,
    reason: str,
    clock: Callable[[], datetime],
) -> list[DryRunInstance]:
    """What a stop does to the run's dry runs: a local one's process group is killed
    (``pid_file``: :data:`jobs.preflight.DRY_RUN_PID_FILE` in the run's preflight
    directory), and the cloud ones end (:func:`end_open_dry_runs`)."""
    from runner.pidfile import end_stale_dry_run

    if end_stale_dry_run(pid_file):
        log.info("run %s: its local dry run was killed (%s)", run_id, reason)
    return end_open_dry_runs(engine, provider, run_id, reason=reason, clock=clock)


def live_dry_run_ids(session: Session) -> set[str]:
    """Ids of the dry runs under way: their instances are no orphans (reconcile)."""
    return set(
        session.exec(select(DryRunInstance.id).where(col(DryRunInstance.ended_at).is_(None))).all()
    )


# -- helpers --------------------------------------------------------------------------------


def _first_zone(provider: Provider, req: ResourceRequest) -> str:
    zones = [z for z in provider.capacity(req) if z.available]
    if not zones:
        raise ProviderError(
            f"no zone of {req.region} offers {req.instance_type} now"
            + (f" (tried {', '.join(req.zones)})" if req.zones else "")
        )
    return zones[0].zone


def _read(engine: Engine, dry_run_id: str) -> DryRunInstance:
    with session_scope(engine) as session:
        row = session.get(DryRunInstance, dry_run_id)
        assert row is not None, dry_run_id
        detach(session, row)
    return row


def _tagged(provider: Provider, row: DryRunInstance) -> list[str]:
    try:
        found = provider.list_instances()
    except ProviderError as exc:
        log.warning("dry run %s: could not list instances: %s", row.id, exc)
        return []
    return [
        i.instance_id
        for i in found
        if i.attempt_id == row.id and i.run_id == row.run_id and not i.state.is_terminal()
    ]


def _ended(provider: Provider, instance_id: str) -> str | None:
    """Why the instance is over, or None while it runs (or cannot be asked)."""
    try:
        status = provider.status(instance_id)
    except InstanceNotFound:
        return "the instance is gone"
    except ProviderError as exc:
        log.warning("dry-run instance %s: status failed: %s", instance_id, exc)
        return None
    if status.state.is_terminal():
        code = f", exit code {status.exit_code}" if status.exit_code is not None else ""
        return f"{status.reason or status.state.value}{code}"
    return None


def _report(value: Mapping[str, Any] | None) -> DryRunReport | None:
    """The instance's report, its types checked (it comes from an instance that runs the
    spec's code); None when it is not one."""
    if not isinstance(value, Mapping):
        return None
    try:
        return msgspec.convert(restore_floats(dict(value)), type=DryRunReport)
    except msgspec.ValidationError:
        return None


def _seconds(row: DryRunInstance) -> float:
    began = row.launched_at or row.created_at
    return max(0.0, ((row.ended_at or began) - began).total_seconds())
