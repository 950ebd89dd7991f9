"""Several replicas on one database: one leader runs the scheduler, a dead leader is
replaced within the lease time, a deposed leader's late provider call is refused, a
scheduled job runs once across the replicas, and concurrent starts migrate once.

Each test runs on SQLite (a file both replicas open) and on PostgreSQL when
``TRAINBOT_TEST_POSTGRES_URL`` is set (``empty_engine`` in conftest.py).
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from bot.console import ConsoleNotifier
from jobs.background import scheduler as scheduler_module
from jobs.background.deferred import fenced
from jobs.database.db import current_revision, head_revision, migrate, session_scope
from jobs.database.models import utcnow
from jobs.database.replica_tables import LEADER_LEASE, SchedulerLease
from jobs.domain.errors import FencedOut
from jobs.process.bootstrap import ControlPlane
from jobs.process.deps import Deps
from jobs.process.settings import load_settings
from jobs.providers.local import LocalProvider
from jobs.runs import launch_attempt, provision, terminate_instance
from tests.waiting import wait_until

#: Short, so that a takeover happens within the test: renewed every third of it.
LEASE_S = 1.0


class RecordingProvider(LocalProvider):
    """The local provider, noting each launch and terminate that reaches it."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []

    def launch(self, req: Any) -> Any:
        self.calls.append(("launch", req.attempt_id))
        return super().launch(req)

    def terminate(self, instance_id: str) -> None:
        self.calls.append(("terminate", instance_id))
        super().terminate(instance_id)


@pytest.fixture
def make_replica(database_url: str, tmp_path: Path) -> Iterator[Callable[..., ControlPlane]]:
    planes: list[ControlPlane] = []

    def make(name: str, **kwargs: Any) -> ControlPlane:
        state = tmp_path / name
        settings = load_settings(
            {
                "TRAINBOT_STATE_DIR": str(state),
                "TRAINBOT_DATABASE_URL": database_url,
                "TRAINBOT_INGEST_PORT": "0",
            }
        )
        cp = ControlPlane(
            settings,
            notifier=ConsoleNotifier(io.StringIO()),
            provider=RecordingProvider(state / "local"),
            lease_s=LEASE_S,
            lease_holder=name,
            **kwargs,
        )
        planes.append(cp)
        return cp.start()

    yield make
    for cp in planes:
        cp.close()


def leads(cp: ControlPlane) -> bool:
    return cp.elector is not None and cp.elector.leading and cp.scheduler is not None


def leader_gauge(cp: ControlPlane) -> float | None:
    return cp.app.metrics.registry.get_sample_value("trainbot_scheduler_leader")


def test_exactly_one_replica_runs_the_scheduler(make_replica) -> None:  # type: ignore[no-untyped-def]
    a, b = make_replica("replica-a"), make_replica("replica-b")
    time.sleep(LEASE_S)  # several renewals: the leader stays the leader
    assert leads(a) and not leads(b)
    assert b.scheduler is None
    assert (leader_gauge(a), leader_gauge(b)) == (1, 0)


def test_a_closed_leader_hands_over_at_once(make_replica) -> None:  # type: ignore[no-untyped-def]
    a, b = make_replica("replica-a"), make_replica("replica-b")
    assert a.elector is not None and b.elector is not None
    first = a.elector.token
    a.close()  # releases the lease: b need not wait for it to expire
    start = time.monotonic()
    wait_until(lambda: leads(b), LEASE_S, "replica-b to lead", every=0.02)
    took = time.monotonic() - start
    assert took < LEASE_S
    assert first is not None and b.elector.token == first + 1
    assert leader_gauge(b) == 1


def test_a_crashed_leader_is_replaced_within_the_lease_time(make_replica) -> None:  # type: ignore[no-untyped-def]
    a, b = make_replica("replica-a"), make_replica("replica-b")
    assert a.elector is not None and b.elector is not None
    a.elector.stop(release=False)  # as kill -9 would: the lease stays until it expires
    start = time.monotonic()
    wait_until(lambda: leads(b), 2 * LEASE_S, "replica-b to take over", every=0.02)
    took = time.monotonic() - start
    assert took <= LEASE_S + LEASE_S / 3 + 0.5  # expiry, plus one renewal period, plus slack


def test_the_lease_time_is_a_setting(database_url: str, tmp_path: Path) -> None:
    """``trainbot serve`` builds its replica from the settings alone."""
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path),
            "TRAINBOT_DATABASE_URL": database_url,
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_SCHEDULER_LEASE_S": "2.5",
        }
    )
    notifier = ConsoleNotifier(io.StringIO())
    with ControlPlane(settings, notifier=notifier, provider=RecordingProvider(tmp_path)) as cp:
        assert cp.elector is not None and cp.elector.lease_s == 2.5
        with session_scope(cp.deps.engine) as session:
            lease = session.get(SchedulerLease, LEADER_LEASE)
            assert lease is not None
            assert timedelta(0) < lease.expires_at - utcnow() <= timedelta(seconds=2.5)


def test_a_deposed_leaders_late_calls_are_refused(make_replica, caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    a, b = make_replica("replica-a"), make_replica("replica-b")
    assert a.elector is not None and b.elector is not None
    stale = a.elector.token
    assert stale is not None
    a.elector.stop(release=False)  # stalled: it still thinks it may act under ``stale``
    wait_until(lambda: leads(b), 2 * LEASE_S, "replica-b to take over")
    provider = a.deps.provider
    assert isinstance(provider, RecordingProvider)
    with fenced(stale):
        with pytest.raises(FencedOut, match="no longer the scheduler's leader"):
            terminate_instance(a.deps, "i-somebodys")
        with pytest.raises(FencedOut):
            provision(a.deps, "a-late")
        with pytest.raises(FencedOut):
            launch_attempt(a.deps, "r-late")
    assert provider.calls == []
    assert any("refused the termination of i-somebodys" in r.getMessage() for r in caplog.records)
    # A scheduled job of the deposed leader ends there, with a warning, not a traceback.
    monkeypatch.setitem(
        scheduler_module.JOBS, "cleanup", lambda deps: terminate_instance(deps, "i-orphan")
    )
    assert scheduler_module.run_job(a.deps, "cleanup", token=stale) is None
    # The leader's own calls, and a person's (no token), go through.
    with fenced(b.elector.token):
        assert terminate_instance(b.deps, "i-gone") is True
    assert terminate_instance(a.deps, "i-gone-too") is True
    assert provider.calls == [("terminate", "i-gone-too")]


def test_a_scheduled_job_runs_once_across_replicas(make_replica, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ran: list[Deps] = []
    lock = threading.Lock()

    def digest(deps: Deps) -> None:
        with lock:
            ran.append(deps)

    monkeypatch.setitem(scheduler_module.JOBS, "digest", digest)
    intervals = {"digest": 0.1}
    a = make_replica("replica-a", scheduler_intervals=intervals)
    b = make_replica("replica-b", scheduler_intervals=intervals)
    wait_until(lambda: len(ran) >= 5, 10, "five digests")
    a.close()  # the leader goes; the other posts from now on, and only it
    with lock:
        before = len(ran)
    wait_until(lambda: len(ran) >= before + 5, 10, "five digests from replica-b")
    b.close()
    assert {id(d) for d in ran[:before]} == {id(a.deps)}
    assert {id(d) for d in ran[before:]} == {id(b.deps)}


@pytest.mark.postgres
def test_concurrent_starts_migrate_once(empty_engine: Engine) -> None:
    if empty_engine.dialect.name != "postgresql":
        pytest.skip("SQLite is one process's file: replicas run on PostgreSQL")
    barrier = threading.Barrier(4)

    def start() -> None:
        barrier.wait()
        migrate(empty_engine)

    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(start) for _ in range(4)]:
            future.result()
    assert current_revision(empty_engine) == head_revision()


def test_a_leader_that_loses_the_lease_shuts_its_scheduler_down(make_replica) -> None:  # type: ignore[no-untyped-def]
    a = make_replica("replica-a")
    assert a.elector is not None and leads(a)
    with session_scope(a.deps.engine) as session:  # another replica's takeover
        lease = session.get(SchedulerLease, LEADER_LEASE)
        assert lease is not None
        lease.holder, lease.token = "replica-z", lease.token + 1
        lease.expires_at = utcnow() + timedelta(hours=1)
    wait_until(lambda: not leads(a), LEASE_S, "replica-a to step down")
    assert a.scheduler is None and leader_gauge(a) == 0
