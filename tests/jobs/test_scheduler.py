"""The scheduler: persisted jobs survive a restart; one leader runs them."""

from __future__ import annotations

import io
import logging
import threading
import time
from datetime import timedelta
from pathlib import Path

from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore

from bot.console import ConsoleNotifier
from jobs.deps import Deps
from jobs.models import utcnow
from jobs.providers.local import LocalProvider
from jobs.scheduler import INTERVALS_S, run_job, start_scheduler, stop_scheduler, take_lease


def make_deps(db_engine, settings, tmp_path: Path) -> Deps:  # type: ignore[no-untyped-def]
    return Deps(
        settings=settings,
        engine=db_engine,
        provider=LocalProvider(tmp_path / "local"),
        notifier=ConsoleNotifier(io.StringIO()),
    )


def test_jobs_are_stored_in_the_database_and_survive_a_restart(
    db_engine, settings, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    deps = make_deps(db_engine, settings, tmp_path)
    first = start_scheduler(deps, start=True)
    stored = {job.id: job.next_run_time for job in first.get_jobs()}
    assert set(stored) == {*INTERVALS_S, "digest"}
    stop_scheduler(first)
    # A new process finds the same jobs in the database before registering its own.
    store = SQLAlchemyJobStore(engine=db_engine, tablename="apscheduler_jobs")
    store.start(None, "default")  # type: ignore[arg-type]
    assert {job.id for job in store.get_all_jobs()} == set(stored)
    second = start_scheduler(deps, start=True)
    assert {job.id for job in second.get_jobs()} == set(stored)
    stop_scheduler(second)
    deps.close()


def test_one_leader_at_a_time(db_engine, settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    deps = make_deps(db_engine, settings, tmp_path)
    assert take_lease(deps, holder="replica-a", ttl_s=60)
    assert not take_lease(deps, holder="replica-b", ttl_s=60)
    assert take_lease(deps, holder="replica-a", ttl_s=60)  # renewal
    later = utcnow() + timedelta(seconds=120)
    deps.clock = lambda: later  # the lease expired: another replica takes over
    assert take_lease(deps, holder="replica-b", ttl_s=60)
    assert not take_lease(deps, holder="replica-a", ttl_s=60)
    deps.close()


def test_a_job_runs_its_body_through_the_registry(db_engine, settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    deps = make_deps(db_engine, settings, tmp_path)
    scheduler = start_scheduler(deps, start=False)
    try:
        assert run_job("reconcile") == {
            "adopted": 0, "ended": 0, "orphans": 0, "launched": 0, "lost": 0,
        }  # fmt: skip
        assert run_job("escalation") == []
        assert run_job("cleanup") == []
    finally:
        stop_scheduler(scheduler)
        deps.close()
    assert run_job("reconcile") is None  # no control plane registered any more


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
