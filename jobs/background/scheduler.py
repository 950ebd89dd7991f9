"""APScheduler wiring: which job runs when, and on which replica.

Every replica runs a :class:`LeaderElector`: a small thread that takes or renews the
lease row ``scheduler_leases`` ("leader") in one atomic UPDATE. The replica holding it
runs a scheduler; the others run none. APScheduler's documentation says a job store must
not be shared by running schedulers, so the leader's jobs live in memory: they are the
same fixed list on every replica, and the leader that wins the lease registers them
anew. When the lease changes holder its fencing token rises by one; the leader's jobs
run under the token of the tenure they started in, and their launches and terminations
check it is still current before the provider call (:func:`jobs.runs.fence.check_fence`),
so a deposed leader's late call is refused.

The leader also runs the deferred work that nobody else ran (:mod:`jobs.background.deferred`: a
resubmit whose replica died during its backoff), and the digest is deferred work too:
the daily trigger records the day's digest and one row per channel, each posted once,
and a leader that takes over within the misfire grace of a digest time that no replica
posted (the old leader died in the digest minute) posts it then. Reconcile and the spend
job catch up on everything else by themselves.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from datetime import date, datetime, timedelta, timezone
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import STATE_STOPPED
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy import case, or_, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import col

from jobs.background import tasks
from jobs.background.deferred import (
    DeferredRunner,
    Later,
    current_fence,
    defer,
    deferrable,
    fenced,
    run_now,
)
from jobs.database.db import session_scope
from jobs.database.replica_tables import LEADER_LEASE, SchedulerLease
from jobs.domain.errors import DatabaseError
from jobs.process.deps import PROCESS_REPLICA, Deps
from jobs.process.settings import SCHEDULER_LEASE_S, Settings

log = logging.getLogger(__name__)

#: Each job, its schedule and what it does (README: "Scheduled jobs").
JOBS: dict[str, Callable[[Deps], Any]] = {
    "reconcile": tasks.reconcile_job,
    "price": tasks.price_job,
    "spend": tasks.spend_job,
    "escalation": tasks.escalation_job,
    "cleanup": tasks.cleanup_job,
    "digest": tasks.digest_job,
    "rollup": tasks.rollup_job,
}
INTERVALS_S = {
    "reconcile": 30,
    "price": 60,
    "spend": 60,
    "escalation": 60,
    "cleanup": 3600,
    "rollup": 3600,
}
LEASE = LEADER_LEASE
#: Seconds a lease lasts unless renewed; the elector renews it every third of that, so
#: a leader that dies is replaced within this time (and one that stalls steps down).
#: The default of ``TRAINBOT_SCHEDULER_LEASE_S``.
LEASE_S = SCHEDULER_LEASE_S
#: Seconds between renewals while the last one failed (see :class:`LeaderElector`).
_RETRY_S = 1.0

#: Seconds late a job may still run (APScheduler's misfire grace); a new leader posts a
#: digest that nobody posted within this time of its due moment.
MISFIRE_GRACE_S = 3600

#: This process's lease holder name (what ``/metrics`` compares the lease with).
_holder = PROCESS_REPLICA
_EXPIRED = datetime(1970, 1, 1, tzinfo=timezone.utc)


def take_lease(deps: Deps, *, ttl_s: float = LEASE_S, holder: str = _holder) -> int | None:
    """Become (or stay) the leader unless another replica holds an unexpired lease.

    Returns the lease's fencing token while ``holder`` holds it, else None. One UPDATE
    decides (holder and expiry in its WHERE), so two replicas racing for an expired
    lease cannot both win; the token rises only when the holder changes.
    """
    now = deps.clock()
    expires = now + timedelta(seconds=ttl_s)
    mine = col(SchedulerLease.holder) == holder
    with session_scope(deps.engine) as session:
        token = session.execute(
            update(SchedulerLease)
            .where(
                col(SchedulerLease.name) == LEASE,
                or_(mine, col(SchedulerLease.expires_at) < now),
            )
            .values(
                holder=holder,
                expires_at=expires,
                acquired_at=case((mine, col(SchedulerLease.acquired_at)), else_=now),
                token=case((mine, col(SchedulerLease.token)), else_=col(SchedulerLease.token) + 1),
            )
            .returning(col(SchedulerLease.token))
        ).scalar_one_or_none()
        if token is not None:
            return int(token)
        if session.get(SchedulerLease, LEASE) is not None:
            return None
        session.add(
            SchedulerLease(name=LEASE, holder=holder, acquired_at=now, expires_at=expires, token=1)
        )
        try:
            session.flush()
        except IntegrityError:  # another replica inserted it first
            # The failed INSERT ended the transaction: roll it back here, or the commit
            # at the end of the block raises (replicas starting together crashed so).
            session.rollback()
            return None
    return 1


def lease_expiry(deps: Deps) -> datetime | None:
    """When the scheduler lease runs out unless its holder renews it (None: no lease)."""
    with session_scope(deps.engine) as session:
        lease = session.get(SchedulerLease, LEASE)
        if lease is None:
            return None
        expires = lease.expires_at
        return expires if expires.tzinfo else expires.replace(tzinfo=timezone.utc)


def release_lease(deps: Deps, *, holder: str = _holder) -> None:
    """Give the lease up at once (a clean shutdown), so another replica need not wait
    for it to expire. Its token stays: the next holder's is one higher."""
    with session_scope(deps.engine) as session:
        session.execute(
            update(SchedulerLease)
            .where(col(SchedulerLease.name) == LEASE, col(SchedulerLease.holder) == holder)
            .values(expires_at=_EXPIRED)
        )


def run_job(
    deps: Deps,
    name: str,
    *,
    token: int | None = None,
    body: Callable[[Deps], Any] | None = None,
) -> Any:
    """Run one job (``body``, else ``JOBS[name]``) as the leader holding ``token`` (its
    launches and terminations carry it). A busy database, or a lease lost meanwhile,
    skips this run; the next retries."""
    try:
        with fenced(token):
            return (body or JOBS[name])(deps)
    except DatabaseError as exc:  # includes FencedOut: a deposed leader's late call
        log.warning("scheduled job %s skipped: %s", name, exc)
        return None
    except Exception:
        # APScheduler logs it with its traceback and tells its listeners (the failure
        # counter on /metrics); the next run goes ahead as scheduled.
        raise


class DailyTrigger(CronTrigger):
    """A cron trigger that fires once a local day at most.

    APScheduler 3's ``CronTrigger`` fires at both readings of a wall-clock time that the
    fall-back repeats (01:30 on the first Sunday of November in New York, twice): the
    second reading is skipped here. A time the spring-forward skips fires once, after
    the gap, as ``CronTrigger`` does.
    """

    def get_next_fire_time(
        self, previous_fire_time: datetime | None, now: datetime
    ) -> datetime | None:
        fire: datetime | None = super().get_next_fire_time(previous_fire_time, now)
        while fire is not None and _repeated(fire):
            fire = super().get_next_fire_time(fire, fire)
        return fire


def _repeated(moment: datetime) -> bool:
    """Whether ``moment`` is the second reading of a wall-clock time that occurs twice."""
    first = moment.replace(fold=0)
    return first.utcoffset() != moment.replace(fold=1).utcoffset() and moment.astimezone(
        timezone.utc
    ) > first.astimezone(timezone.utc)


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
    deps: Deps,
    *,
    token: int | None = None,
    start: bool = True,
    intervals: Mapping[str, float] | None = None,
) -> BackgroundScheduler:
    """A scheduler with the jobs in memory, each run under the fencing ``token``.

    ``intervals`` overrides the interval jobs' periods (the demo compresses time); a
    ``digest`` entry there replaces the daily digest with an interval (tests).
    """
    scheduler = _Scheduler(
        job_defaults={
            "coalesce": True,
            "max_instances": 1,
            "misfire_grace_time": MISFIRE_GRACE_S,
        },
        timezone=deps.settings.timezone,
    )
    periods = {**INTERVALS_S, **(intervals or {})}
    for name, seconds in periods.items():
        scheduler.add_job(
            functools.partial(run_job, deps, name, token=token),
            trigger=IntervalTrigger(seconds=seconds),
            id=name,
            name=name,
        )
    if "digest" not in periods:
        scheduler.add_job(
            functools.partial(run_job, deps, "digest", token=token, body=schedule_digest),
            trigger=daily_trigger(deps.settings),
            id="digest",
            name="digest",
        )
    if start:
        scheduler.start()
    return scheduler


def daily_trigger(settings: Settings) -> DailyTrigger:
    """The digest's trigger: ``digest_time`` (its seconds too) in ``timezone``."""
    at = settings.digest_time
    return DailyTrigger(
        hour=at.hour, minute=at.minute, second=at.second, timezone=settings.timezone
    )


def schedule_digest(deps: Deps) -> None:
    """The daily trigger's job: today's digest as deferred work, run at once here."""
    _defer_digest(deps, deps.clock())


def catch_up_digest(deps: Deps, *, token: int) -> bool:
    """A new leader's look back: post the digest whose time passed within the misfire
    grace if no replica did (the previous leader died in the digest minute). True when
    this call recorded it (False: none was due, or it was recorded already, and whoever
    holds it finishes it)."""
    now = deps.clock()
    trigger = daily_trigger(deps.settings)
    fire = trigger.get_next_fire_time(None, now - timedelta(seconds=MISFIRE_GRACE_S))
    if fire is None or fire > now:
        return False
    with fenced(token):
        return _defer_digest(deps, fire)


def _defer_digest(deps: Deps, fire: datetime) -> bool:
    """Record the digest due at ``fire`` (once per local day) and run it now."""
    posted = fire.astimezone(deps.settings.tz).date()
    key = f"digest:{posted.isoformat()}"
    now = deps.clock()
    args = {"posted": posted.isoformat(), "day": (posted - timedelta(days=1)).isoformat()}
    new = defer(
        deps.engine,
        kind=Later.DIGEST,
        key=key,
        args=args,
        due_at=now,
        fence=current_fence(),
        now=now,
    )
    run_now(deps, key)
    return new


@deferrable(Later.DIGEST)
def digest_day(deps: Deps, *, posted: str, day: str) -> None:
    """The digest posted on ``posted``, of ``day``: one deferred row per channel, so a
    channel's digest is made once and a new leader makes only those the old one left."""
    with session_scope(deps.engine) as session:
        channels = tasks.digest_channels(session)
    now = deps.clock()
    keys = [f"digest:{posted}:{channel}" for channel in channels]
    for channel, key in zip(channels, keys, strict=True):
        defer(
            deps.engine,
            kind=Later.DIGEST_CHANNEL,
            key=key,
            args={"channel": channel, "posted": posted, "day": day},
            due_at=now,
            fence=current_fence(),
            now=now,
        )
    for key in keys:
        run_now(deps, key)


@deferrable(Later.DIGEST_CHANNEL)
def digest_channel(deps: Deps, *, channel: str, posted: str, day: str) -> None:
    """One channel's digest; its post carries a key the Slack outbox posts once."""
    tasks.digest_job(
        deps, channels=[channel], day=date.fromisoformat(day), key_prefix=f"digest:{posted}"
    )


def stop_scheduler(scheduler: BackgroundScheduler) -> None:
    """Stop firing jobs, and wait for the ones running: the caller closes the database
    (or removes its directory) next, and a job cut off there would fail half-done."""
    if scheduler.running:
        scheduler.shutdown(wait=True)


class LeaderElector:
    """Takes and renews the scheduler lease on a thread; runs the scheduler while it
    holds the lease, and shuts it down as soon as it loses it, or once it has failed to
    renew it for two thirds of the lease.

    A renewal that fails (the database busy or away for a moment) does not depose the
    leader at once: nobody else can take the lease before it expires, so the leader keeps
    its scheduler and tries again every second until its *renew deadline*, two thirds of
    a lease after its last renewal, and only then steps down, a third of a lease before
    another replica may win. A single slow write under load used to stop and restart the
    scheduler (and its jobs) for nothing."""

    def __init__(
        self,
        deps: Deps,
        *,
        holder: str | None = None,
        lease_s: float = LEASE_S,
        intervals: Mapping[str, float] | None = None,
        on_scheduler: Callable[[BackgroundScheduler], None] | None = None,
    ) -> None:
        """``holder``: this replica's name on the lease (default: the process's);
        ``on_scheduler`` is told of each scheduler started (the metrics listen to it)."""
        self.deps = deps
        self.holder = holder or _holder
        self.lease_s = lease_s
        self._intervals = intervals
        self._on_scheduler = on_scheduler
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: int | None = None
        self._scheduler: BackgroundScheduler | None = None
        self._deferred: DeferredRunner | None = None
        # While leading: the clock time until which a failed renewal keeps the lease (two
        # thirds of a lease after the last renewal); and whether the last round failed.
        self._renew_by: datetime | None = None
        self._failing = False
        # Every scheduler this elector started, kept so that none's id() is reused by
        # the next (the metrics watch schedulers by id); one per lease won, so few.
        self._started: list[BackgroundScheduler] = []

    @property
    def token(self) -> int | None:
        """The fencing token while this replica leads, else None."""
        return self._token

    @property
    def leading(self) -> bool:
        return self._token is not None

    @property
    def scheduler(self) -> BackgroundScheduler | None:
        return self._scheduler

    def start(self) -> LeaderElector:
        """Try for the lease once now, then keep at it on a daemon thread."""
        self.elect()
        self._thread = threading.Thread(
            target=self._loop, name=f"trainbot-elector-{self.holder}", daemon=True
        )
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._next_try_s()):
            self.elect()

    def _next_try_s(self) -> float:
        """Seconds to the next round: a third of the lease while leading (the renewal),
        else until the holder's lease runs out, so that a dead leader is replaced within
        one lease of its last renewal rather than a lease and a third."""
        third = self.lease_s / 3
        if self.leading:
            return min(third, _RETRY_S) if self._failing else third
        try:
            expires = lease_expiry(self.deps)
        except DatabaseError:
            return third
        if expires is None:
            return third
        left = (expires - self.deps.clock()).total_seconds()
        return min(third, max(0.05, left + 0.05))

    def elect(self) -> bool:
        """One round: take or renew the lease, and start or stop the scheduler to match."""
        # The lease runs from when the renewal began (take_lease's own clock reading), so
        # the renew deadline counts from then too, however long the statement took.
        renewed_by = self.deps.clock() + timedelta(seconds=self.lease_s * 2 / 3)
        try:
            token = take_lease(self.deps, ttl_s=self.lease_s, holder=self.holder)
        except DatabaseError as exc:
            with self._lock:
                if self._stop.is_set():
                    return False
                now = self.deps.clock()
                if self._renew_by is not None and now < self._renew_by:
                    self._failing = True
                    log.warning(
                        "cannot renew the scheduler lease, still leading until %s: %s",
                        self._renew_by.isoformat(timespec="seconds"),
                        exc,
                    )
                    return True
                if self.leading:
                    log.warning("cannot renew the scheduler lease, stepping down: %s", exc)
                self._step_down()
                return False
        with self._lock:
            if self._stop.is_set():
                return False
            if token is not None and token == self._token:
                self._renew_by, self._failing = renewed_by, False
                return True
            self._step_down()
            if token is None:
                return False
            self._renew_by = renewed_by
            log.info("this replica (%s) leads the scheduler, fencing token %d", self.holder, token)
            self._token = token
            self._scheduler = start_scheduler(self.deps, token=token, intervals=self._intervals)
            self._started.append(self._scheduler)
            if self._on_scheduler is not None:
                self._on_scheduler(self._scheduler)
            self._deferred = DeferredRunner(self.deps, token=token).start()
            if "digest" not in (self._intervals or {}):
                self.deps.background(catch_up_digest, self.deps, token=token)
            return True

    def _step_down(self) -> None:
        if self._deferred is not None:
            self._deferred.stop()
            self._deferred = None
        if self._scheduler is not None:
            log.warning("this replica (%s) no longer leads the scheduler", self.holder)
            stop_scheduler(self._scheduler)
        self._scheduler = None
        self._token = None
        self._renew_by = None
        self._failing = False

    def stop(self, *, release: bool = True) -> None:
        """Stop electing and the scheduler (waiting for the jobs running), then release
        the lease so another replica takes over at once. ``release=False`` leaves the
        lease to expire, as a crashed replica would."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._step_down()
        if release:
            try:
                release_lease(self.deps, holder=self.holder)
            except DatabaseError as exc:
                log.warning("could not release the scheduler lease (it expires): %s", exc)
