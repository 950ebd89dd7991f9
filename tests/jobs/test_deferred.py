"""Deferred work in the database: run on time by the replica that deferred it, taken over
by the leader when that replica is gone, once, under the right fencing token; and the
digest as deferred work, caught up by a leader that took over after its time.

On SQLite and on PostgreSQL (``db_engine``). Two ``Deps`` on one database stand for two
replicas; one whose timers never fire (``close()`` first) stands for one that died.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlmodel import select

from bot.console import ConsoleNotifier
from jobs.background import deferred
from jobs.background import scheduler as scheduler_module
from jobs.background.deferred import DeferredRunner, Later, claim, current_fence, fenced, pending
from jobs.background.scheduler import catch_up_digest, take_lease
from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.database.replica_tables import DeferredWork
from jobs.domain.errors import FencedOut
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import DigestMessage
from jobs.process.deps import Deps
from jobs.process.settings import Settings, load_settings
from jobs.providers.local import LocalProvider
from tests.jobs.local_plane import closing_each
from tests.waiting import wait_until


@pytest.fixture
def replicas(
    db_engine: Engine, settings: Settings, tmp_path: Path
) -> Iterator[Callable[..., Deps]]:
    def replica(name: str, **kwargs: Any) -> Deps:
        return Deps(
            settings=kwargs.pop("settings", settings),
            engine=db_engine,
            provider=LocalProvider(tmp_path / name),
            notifier=ConsoleNotifier(io.StringIO()),
            replica=name,
            hold_s=kwargs.pop("hold_s", 60.0),
            **kwargs,
        )

    with closing_each(replica) as make:
        yield make


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int | None]]:
    """Who ran the RESUBMIT kind, for which attempt, under which fencing token."""
    seen: list[tuple[str, str, int | None]] = []
    lock = threading.Lock()

    def resubmit(deps: Deps, previous_attempt_id: str) -> bool:
        with lock:
            seen.append((deps.replica, previous_attempt_id, current_fence()))
        return True

    monkeypatch.setitem(deferred._REGISTRY, Later.RESUBMIT, resubmit)
    return seen


def rows(engine: Engine) -> dict[str, DeferredWork]:
    with session_scope(engine) as session:
        return {w.key: w for w in session.exec(select(DeferredWork)).all()}


def test_every_kind_is_bound_to_a_function() -> None:
    assert set(deferred.registry()) == set(Later)


def test_later_runs_on_time_from_its_row_once(replicas, calls) -> None:  # type: ignore[no-untyped-def]
    a = replicas("replica-a")
    a.later(0.05, Later.RESUBMIT, key="resubmit:a-1", previous_attempt_id="a-1")
    a.later(0.05, Later.RESUBMIT, key="resubmit:a-1", previous_attempt_id="a-1")  # again
    wait_until(lambda: calls, 5, "the resubmit")
    wait_until(lambda: rows(a.engine)["resubmit:a-1"].done_at, 5, "it marked done")
    time.sleep(0.2)
    assert calls == [("replica-a", "a-1", None)]
    assert pending(a.engine) == []


def test_arguments_must_be_json(replicas) -> None:  # type: ignore[no-untyped-def]
    a = replicas("replica-a")
    with pytest.raises(TypeError, match="arguments must be JSON"):
        a.later(1, Later.LAUNCH, key="launch-after:x", run_id=object())
    assert pending(a.engine) == []


def test_the_leader_runs_what_a_dead_replica_deferred(replicas, calls) -> None:  # type: ignore[no-untyped-def]
    dead, leader = replicas("replica-dead"), replicas("replica-leader")
    dead.close()  # its timers never fire: the row is all that is left
    dead.later(0, Later.RESUBMIT, key="resubmit:a-2", previous_attempt_id="a-2")
    runner = DeferredRunner(leader, token=7)
    assert runner.run_due() == 0, "not overdue yet: its own replica's timer may still fire"
    leader.clock = lambda: datetime.now(timezone.utc) + timedelta(seconds=deferred.GRACE_S + 1)
    assert runner.run_due() == 1
    wait_until(lambda: calls, 5, "the leader to run it")
    wait_until(lambda: rows(leader.engine)["resubmit:a-2"].done_at, 5, "it marked done")
    assert calls == [("replica-leader", "a-2", 7)], "under the leader's own token"
    assert runner.run_due() == 0


def test_a_dead_leaders_claim_is_taken_back_at_once_and_a_live_timers_is_not(
    replicas, calls
) -> None:  # type: ignore[no-untyped-def]
    old, new = replicas("replica-old"), replicas("replica-new")
    old.close()
    later = datetime.now(timezone.utc) + timedelta(seconds=30)
    with fenced(3):  # scheduled work of the leader holding token 3 deferred it
        old.later(0, Later.RESUBMIT, key="resubmit:a-3", previous_attempt_id="a-3")
    old.later(0, Later.RESUBMIT, key="resubmit:a-4", previous_attempt_id="a-4")
    now = datetime.now(timezone.utc)
    # The old replica's timers claimed both, then it died (its claims hold 60 s).
    assert claim(old.engine, "resubmit:a-3", holder="replica-old", now=now, hold_s=60)
    assert claim(old.engine, "resubmit:a-4", holder="replica-old", now=now, hold_s=60)
    new.clock = lambda: later
    assert DeferredRunner(new, token=4).run_due() == 1  # a-3 only: a leader's, older token
    wait_until(lambda: calls, 5, "the new leader to run it")
    assert calls == [("replica-new", "a-3", 4)]
    assert rows(new.engine)["resubmit:a-4"].done_at is None, "its claim still holds"


def test_a_deposed_leaders_deferred_work_is_given_back(replicas, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    a = replicas("replica-a")
    attempts: list[int | None] = []

    def refused(deps: Deps, previous_attempt_id: str) -> None:
        attempts.append(current_fence())
        raise FencedOut("refused: no longer the leader")

    monkeypatch.setitem(deferred._REGISTRY, Later.RESUBMIT, refused)
    with fenced(2):
        a.later(0, Later.RESUBMIT, key="resubmit:a-5", previous_attempt_id="a-5")
    wait_until(lambda: attempts, 5, "the timer to try it")

    def given_back() -> bool:
        row = rows(a.engine)["resubmit:a-5"]
        return row.claimed_by is None and row.done_at is None and "refused" in (row.error or "")

    wait_until(given_back, 5, "the row to be given back")
    assert attempts == [2]


def test_failing_work_is_retried_then_given_up(replicas, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    a = replicas("replica-a")

    def broken(deps: Deps, previous_attempt_id: str) -> None:
        raise RuntimeError("boom")

    monkeypatch.setitem(deferred._REGISTRY, Later.RESUBMIT, broken)
    a.later(3600, Later.RESUBMIT, key="resubmit:a-6", previous_attempt_id="a-6")
    for _ in range(deferred.MAX_ATTEMPTS):
        with session_scope(a.engine) as session:  # due now, whatever the backoff said
            row = session.get(DeferredWork, "resubmit:a-6")
            assert row is not None and row.done_at is None
            row.due_at = datetime.now(timezone.utc)
        assert deferred.run_now(a, "resubmit:a-6")
    row = rows(a.engine)["resubmit:a-6"]
    assert row.done_at is not None and row.error == "boom"
    assert row.attempts == deferred.MAX_ATTEMPTS
    assert "gave up" in caplog.text


def test_a_leader_that_takes_over_after_the_digest_time_posts_it_once(
    replicas, db_engine, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    due = datetime.now(timezone.utc) - timedelta(minutes=5)
    at = due.strftime("%H:%M")
    settings = load_settings(
        {"TRAINBOT_STATE_DIR": str(tmp_path / "s"), "TRAINBOT_DIGEST_TIME": at}
    )
    leader = replicas("replica-new", settings=settings)
    with session_scope(db_engine) as session:
        for n, channel in enumerate(("C0ONE", "C0TWO")):
            session.add(
                Run(id=f"r-{n}", spec_name="tiny", spec={"name": "tiny", "command": ["x"]},
                    requester="U0ADA", channel=channel, state=RunState.SUCCEEDED)
            )  # fmt: skip
    token = take_lease(leader, holder="replica-new", ttl_s=60)
    assert token is not None
    assert catch_up_digest(leader, token=token) is True
    assert catch_up_digest(leader, token=token) is False  # recorded already: not again
    notifier = leader.notifier
    assert isinstance(notifier, ConsoleNotifier)
    posted = [m for kind, _, m in notifier.history if isinstance(m, DigestMessage)]
    assert sorted(m.channel for m in posted) == ["C0ONE", "C0TWO"]
    day = due.date().isoformat()
    assert {m.key for m in posted} == {f"digest:{day}:C0ONE", f"digest:{day}:C0TWO"}
    assert all(w.done_at for w in rows(db_engine).values())


def test_no_catch_up_outside_the_misfire_grace(replicas, tmp_path) -> None:  # type: ignore[no-untyped-def]
    now = datetime.now(timezone.utc)
    at = (now + timedelta(minutes=30)).strftime("%H:%M")
    settings = load_settings(
        {"TRAINBOT_STATE_DIR": str(tmp_path / "s"), "TRAINBOT_DIGEST_TIME": at}
    )
    leader = replicas("replica-new", settings=settings)
    # 30 minutes from now is not due; yesterday's was more than the grace ago.
    assert scheduler_module.MISFIRE_GRACE_S < 23 * 3600
    assert catch_up_digest(leader, token=1) is False
    assert pending(leader.engine) == []
