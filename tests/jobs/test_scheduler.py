"""The scheduler: its jobs, in memory; one leader runs them (tests/jobs/test_replicas.py
covers the election between replicas)."""

from __future__ import annotations

import io
import logging
import threading
import time
from datetime import timedelta
from pathlib import Path

from apscheduler.jobstores.memory import MemoryJobStore
from sqlalchemy import delete, inspect

from bot.console import ConsoleNotifier
from jobs.background.scheduler import (
    INTERVALS_S,
    release_lease,
    run_job,
    start_scheduler,
    stop_scheduler,
    take_lease,
)
from jobs.database.models import utcnow
from jobs.database.replica_tables import SchedulerLease
from jobs.process.deps import Deps
from jobs.providers.local import LocalProvider


def make_deps(db_engine, settings, tmp_path: Path) -> Deps:  # type: ignore[no-untyped-def]
    return Deps(
        settings=settings,
        engine=db_engine,
        provider=LocalProvider(tmp_path / "local"),
        notifier=ConsoleNotifier(io.StringIO()),
    )


def test_the_jobs_live_in_memory_not_in_the_shared_database(db_engine, settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """APScheduler's job stores must not be shared by running schedulers."""
    deps = make_deps(db_engine, settings, tmp_path)
    scheduler = start_scheduler(deps, token=1, start=True)
    try:
        assert {job.id for job in scheduler.get_jobs()} == {*INTERVALS_S, "digest"}
        assert {type(store) for store in scheduler._jobstores.values()} == {MemoryJobStore}
        assert not inspect(db_engine).has_table("apscheduler_jobs")
    finally:
        stop_scheduler(scheduler)
        deps.close()


def test_one_leader_at_a_time(db_engine, settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    deps = make_deps(db_engine, settings, tmp_path)
    assert take_lease(deps, holder="replica-a", ttl_s=60) == 1
    assert take_lease(deps, holder="replica-b", ttl_s=60) is None
    assert take_lease(deps, holder="replica-a", ttl_s=60) == 1  # renewal keeps the token
    later = utcnow() + timedelta(seconds=120)
    deps.clock = lambda: later  # the lease expired: another replica takes over
    assert take_lease(deps, holder="replica-b", ttl_s=60) == 2  # a new holder, a new token
    assert take_lease(deps, holder="replica-a", ttl_s=60) is None
    release_lease(deps, holder="replica-b")
    assert take_lease(deps, holder="replica-a", ttl_s=60) == 3  # released: no wait
    deps.close()


def test_replicas_starting_together_elect_one_leader_and_none_fails(
    db_engine, settings, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """With no lease row yet, replicas that start at the same moment all try to insert it:
    the losers' failed INSERT must not fail their start (it did: the transaction it ended
    was committed). Several rounds, each on a table without the row."""
    deps = make_deps(db_engine, settings, tmp_path)
    try:
        for _ in range(5):
            with db_engine.begin() as connection:
                connection.execute(delete(SchedulerLease))
            start = threading.Barrier(6)
            tokens: list[int | None] = []
            errors: list[BaseException] = []

            def elect(name: str, start: threading.Barrier, tokens: list, errors: list) -> None:  # type: ignore[type-arg]
                start.wait()
                try:
                    tokens.append(take_lease(deps, holder=name, ttl_s=60))
                except BaseException as exc:
                    errors.append(exc)

            threads = [
                threading.Thread(target=elect, args=(f"r-{i}", start, tokens, errors))
                for i in range(6)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            assert errors == []
            assert sorted(tokens, key=lambda t: t or 0) == [None] * 5 + [1]
    finally:
        deps.close()


def test_a_job_runs_its_body(db_engine, settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    deps = make_deps(db_engine, settings, tmp_path)
    try:
        assert run_job(deps, "reconcile") == {
            "adopted": 0, "ended": 0, "orphans": 0, "running": 0, "launched": 0, "lost": 0,
            "watched": 0, "released": 0,
        }  # fmt: skip
        assert run_job(deps, "escalation") == []
        assert run_job(deps, "cleanup") == []
    finally:
        deps.close()


def test_stopping_with_jobs_due_submits_nothing_after_shutdown(
    db_engine, settings, tmp_path, caplog
) -> None:  # type: ignore[no-untyped-def]
    """Jobs are due when the scheduler stops: none may reach the shut-down executor."""
    deps = make_deps(db_engine, settings, tmp_path)
    scheduler = start_scheduler(deps, start=False, intervals={"reconcile": 0.01, "spend": 0.01})
    # Paused, the loop leaves the due jobs alone until shutdown wakes it for one more round.
    scheduler.start(paused=True)
    time.sleep(0.1)
    assert any(
        job.next_run_time is not None and job.next_run_time <= utcnow()
        for job in scheduler.get_jobs()
    )
    with caplog.at_level(logging.ERROR, logger="apscheduler"):
        stop_scheduler(scheduler)
    deps.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_stopping_waits_for_the_job_that_is_running(db_engine, settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The control plane closes the database right after: a job cut off there fails."""
    deps = make_deps(db_engine, settings, tmp_path)
    scheduler = start_scheduler(deps)
    started, finished = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        time.sleep(0.5)
        finished.set()

    scheduler.add_jobstore("memory", alias="memory")
    scheduler.add_job(
        slow, "interval", hours=1, next_run_time=utcnow(), id="slow", jobstore="memory"
    )
    assert started.wait(10)
    stop_scheduler(scheduler)
    assert finished.is_set()
    deps.close()


def test_a_failed_renewal_keeps_the_lease_until_its_renew_deadline(
    db_engine, settings, tmp_path, caplog
) -> None:  # type: ignore[no-untyped-def]
    """The database failing a renewal for a moment leaves the leader and its scheduler
    in place; failing for two thirds of a lease (a third before another replica could
    take it over) steps it down; once the database answers again it leads again."""
    from jobs.background.scheduler import LeaderElector
    from jobs.database.db import make_engine

    deps = make_deps(db_engine, settings, tmp_path)
    now = [utcnow()]
    deps.clock = lambda: now[0]
    elector = LeaderElector(deps, holder="replica-a", lease_s=30, intervals={"reconcile": 3600})
    try:
        assert elector.elect() and elector.leading
        first = elector.scheduler
        # The database goes away: its engine now reaches a database that cannot be opened.
        deps.engine = make_engine(f"sqlite:///{tmp_path / 'away' / 'trainbot.db'}")
        caplog.set_level(logging.WARNING, logger="jobs.background.scheduler")
        now[0] += timedelta(seconds=15)
        assert elector.elect() and elector.leading
        assert elector.scheduler is first, "a failed renewal restarted the scheduler"
        assert "still leading until" in caplog.text
        assert elector._next_try_s() <= 1.0  # retried soon, not a third of a lease later
        now[0] += timedelta(seconds=6)  # 21 s since the renewal: past 2/3 of 30 s
        assert not elector.elect() and not elector.leading
        assert elector.scheduler is None and "stepping down" in caplog.text
        deps.engine.dispose()
        deps.engine = db_engine  # back
        assert elector.elect() and elector.leading
    finally:
        elector.stop()
        deps.close()
