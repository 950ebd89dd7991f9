"""APScheduler wiring: which job runs when, and on which replica.

Jobs live in APScheduler's SQLAlchemy job store in the control plane's own database, so
their schedule survives a restart (a digest missed while the process was down runs
once when it comes back, coalesced). Several replicas may run a scheduler; each job
body first takes a lease row (``scheduler_leases``) so only one replica, the leader,
does the work and a digest is posted once.

The job store keeps textual references to :func:`run_job`, which finds the process's
``Deps`` in a registry set by :func:`start_scheduler`: APScheduler persists callables by
name, so the dependencies cannot travel with the job.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import STATE_STOPPED
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy import or_, update
from sqlalchemy.exc import IntegrityError

from jobs import tasks
from jobs.db import session_scope
from jobs.deps import Deps
from jobs.errors import DatabaseError
from jobs.models import SchedulerLease

log = logging.getLogger(__name__)

#: Each job, its schedule and what it does (README: "Scheduled jobs").
JOBS: dict[str, Callable[[Deps], Any]] = {
    "reconcile": tasks.reconcile_job,
    "spend": tasks.spend_job,
    "escalation": tasks.escalation_job,
    "cleanup": tasks.cleanup_job,
    "digest": tasks.digest_job,
}
INTERVALS_S = {"reconcile": 30, "spend": 60, "escalation": 60, "cleanup": 3600}
LEASE = "leader"

_registry: dict[str, Deps] = {}
_holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def take_lease(deps: Deps, *, ttl_s: float = 90.0, holder: str = _holder) -> bool:
    """Become (or stay) the leader unless another replica holds an unexpired lease."""
    now = deps.clock()
    expires = now + timedelta(seconds=ttl_s)
    with session_scope(deps.engine) as session:
        result = session.execute(
            update(SchedulerLease)
            .where(
                SchedulerLease.name == LEASE,  # type: ignore[arg-type]
                or_(
                    SchedulerLease.holder == holder,  # type: ignore[arg-type]
                    SchedulerLease.expires_at < now,  # type: ignore[arg-type]
                ),
            )
            .values(holder=holder, acquired_at=now, expires_at=expires)
        )
        if result.rowcount:  # type: ignore[attr-defined]
            return True
        if session.get(SchedulerLease, LEASE) is not None:
            return False
        session.add(SchedulerLease(name=LEASE, holder=holder, acquired_at=now, expires_at=expires))
        try:
            session.flush()
        except IntegrityError:
            return False
    return True


def run_job(name: str) -> Any:
    """The entry point the job store names: run one job if this replica leads."""
    deps = _registry.get("deps")
    if deps is None:
        log.warning("job %s fired with no control plane registered", name)
        return None
    try:
        if not take_lease(deps):
            return None
    except DatabaseError as exc:
        log.warning("scheduled job %s skipped: %s", name, exc)
        return None
    try:
        return JOBS[name](deps)
    except DatabaseError as exc:  # busy or unreachable: the next run retries
        log.warning("scheduled job %s skipped: %s", name, exc)
        return None
    except Exception:
        log.exception("scheduled job %s failed", name)
        return None


class _Scheduler(BackgroundScheduler):
    """A background scheduler that submits nothing once it is shut down.

    APScheduler 3's loop wakes once more after ``shutdown()`` (which sets its event) and
    processes the jobs then due with executors already shut down, logging "cannot schedule
    new futures after shutdown" for each. The check sits under the job-store lock, which
    ``shutdown()`` takes before it shuts the executors: a round already past the check
    finishes its submissions first.
    """

    def _process_jobs(self) -> float | None:
        with self._jobstores_lock:
            if self.state == STATE_STOPPED:
                return None
            wait: float | None = super()._process_jobs()
            return wait


def start_scheduler(
    deps: Deps, *, start: bool = True, intervals: Mapping[str, float] | None = None
) -> BackgroundScheduler:
    """Register this process's jobs (replacing the stored definitions) and start them.

    ``intervals`` overrides the interval jobs' periods (the demo compresses time).
    """
    _registry["deps"] = deps
    store = SQLAlchemyJobStore(engine=deps.engine, tablename="apscheduler_jobs")
    scheduler = _Scheduler(
        jobstores={"default": store},
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 3600},
        timezone=deps.settings.timezone,
    )
    for name, seconds in {**INTERVALS_S, **(intervals or {})}.items():
        scheduler.add_job(
            "jobs.scheduler:run_job",
            trigger=IntervalTrigger(seconds=seconds),
            args=[name],
            id=name,
            name=name,
            replace_existing=True,
        )
    at = deps.settings.digest_time
    scheduler.add_job(
        "jobs.scheduler:run_job",
        trigger=CronTrigger(hour=at.hour, minute=at.minute, timezone=deps.settings.timezone),
        args=["digest"],
        id="digest",
        name="digest",
        replace_existing=True,
    )
    if start:
        scheduler.start()
    return scheduler


def stop_scheduler(scheduler: BackgroundScheduler) -> None:
    """Stop firing jobs, and wait for the ones running: the caller closes the database
    (or removes its directory) next, and a job cut off there would fail half-done."""
    if scheduler.running:
        scheduler.shutdown(wait=True)
    _registry.pop("deps", None)
