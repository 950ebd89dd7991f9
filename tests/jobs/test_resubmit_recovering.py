"""A recovering run's next attempt has one way in (``jobs.runs.recovery``), whoever asks.

A person's ``/train resubmit`` of a run that waits out its backoff after a preemption
launches the next attempt now, recorded and reported as the backoff's timer would have
launched it (the ``resubmitted`` record with the work lost); the timer, when it fires,
finds it launched. A late timer of an earlier attempt launches nothing: the next attempt
follows the latest one. A run recovering from a launch the cloud refused lost nothing:
its resubmit is a plain launch. Reconcile's backstop, for a timer that never fired,
launches the same next attempt as the timer, a restart after a listed exit code included.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlmodel import col, select

from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.actor import Actor
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.runs import reconcile, resubmit_if_due
from jobs.spec import JobSpec
from jobs.usecases.service import resubmit
from tests.jobs.local_plane import Clock, local_deps

ADA = Actor(user="ada", channel="C-ml")


@pytest.fixture
def deps(db_engine: Engine, settings: Settings, tmp_path: Path) -> Iterator[Deps]:
    """Background work runs in the caller: a use-case has done all it will on return."""
    with local_deps(settings, db_engine, tmp_path, gpu_names=[], at_once=True) as made:
        yield made


def recovering_run(deps: Deps, *, preempted: int) -> tuple[str, list[str]]:
    """A run in RECOVERING whose ``preempted`` attempts all ended preempted, the last
    one having lost 7 steps (a backoff of an hour still to wait)."""
    spec = JobSpec.model_validate(
        {
            "name": "tiny",
            "command": ["python", "-c", "pass"],
            "dry_run": {"enabled": False},
            "resubmit": {"backoff_s": 3600},
        }
    )
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = Run(
            spec_name="tiny", spec=spec.model_dump(mode="json"), state=RunState.RECOVERING,
            requester=ADA.user, channel=ADA.channel, last_committed_step=40,
            preemptions=preempted, created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(run)
        session.flush()
        ids = []
        for number in range(1, preempted + 1):
            attempt = Attempt(
                run_id=run.id, number=number, provider="local", zone="local-a",
                state=AttemptState.PREEMPTED, started_at=now, ended_at=now,
                last_step=47, lost_steps=7 if number == preempted else 0, lost_seconds=3.5,
            )  # fmt: skip
            session.add(attempt)
            session.flush()
            ids.append(attempt.id)
        return run.id, ids


def attempt_numbers(deps: Deps, run_id: str) -> list[int]:
    with session_scope(deps.engine) as session:
        rows = session.exec(
            select(Attempt.number).where(Attempt.run_id == run_id).order_by(col(Attempt.number))
        )
        return list(rows)


def records(deps: Deps, kind: str, run_id: str) -> list[dict[str, Any]]:
    kept: list[dict[str, Any]] = deps.records  # type: ignore[attr-defined]
    return [r for r in kept if r["type"] == kind and r["run"] == run_id]


def test_a_persons_resubmit_of_a_recovering_run_is_the_timers_next_attempt_now(
    deps: Deps,
) -> None:
    run_id, (prev_id,) = recovering_run(deps, preempted=1)

    run = resubmit(deps, run_id, ADA)

    assert run.id == run_id  # the same run goes on: no successor
    assert attempt_numbers(deps, run_id) == [1, 2]
    (record,) = records(deps, "resubmitted", run_id)
    assert record["lost_steps"] == 7 and record["lost_seconds"] == 3.5
    with session_scope(deps.engine) as session:
        second = session.exec(
            select(Attempt).where(Attempt.run_id == run_id, Attempt.number == 2)
        ).one()
        assert second.resumed_from_step == 40
    # The backoff's timer fires later: the attempt is there, nothing more is launched.
    assert resubmit_if_due(deps, prev_id) is False
    assert attempt_numbers(deps, run_id) == [1, 2]
    assert len(records(deps, "resubmitted", run_id)) == 1


def test_a_late_timer_of_an_earlier_attempt_launches_nothing(deps: Deps) -> None:
    """Attempt 2 was launched early (by a person) and preempted too: attempt 1's timer,
    firing now, must not launch attempt 3 before attempt 2's own backoff is over."""
    run_id, (first_id, second_id) = recovering_run(deps, preempted=2)

    assert resubmit_if_due(deps, first_id) is False
    assert attempt_numbers(deps, run_id) == [1, 2]
    assert records(deps, "resubmitted", run_id) == []

    assert resubmit_if_due(deps, second_id) is True  # attempt 2's own timer
    assert attempt_numbers(deps, run_id) == [1, 2, 3]


def test_a_resubmit_after_a_refused_launch_is_a_plain_launch(deps: Deps) -> None:
    """Attempt 1 never ran (no capacity: FAILED, no exit code): no work was lost, so
    the next attempt is not reported as a resubmit."""
    run_id, (first_id,) = recovering_run(deps, preempted=1)
    with session_scope(deps.engine) as session:
        first = session.get(Attempt, first_id)
        assert first is not None
        first.state, first.lost_steps, first.lost_seconds = AttemptState.FAILED, 0, 0.0
        session.add(first)

    resubmit(deps, run_id, ADA)

    assert attempt_numbers(deps, run_id) == [1, 2]
    assert records(deps, "resubmitted", run_id) == []
    assert records(deps, "placed", run_id)[-1]["attempt"] == 2


def test_reconciles_backstop_restarts_after_an_exit_code_as_the_timer_would(
    deps: Deps,
) -> None:
    """Attempt 1 exited 134 (listed: the run restarts) and its timer never fired (the
    replica died): once the backoff is over, reconcile launches attempt 2 and reports it
    as the timer would have, with the work lost."""
    run_id, (first_id,) = recovering_run(deps, preempted=1)
    with session_scope(deps.engine) as session:
        first = session.get(Attempt, first_id)
        assert first is not None
        first.state, first.exit_code = AttemptState.FAILED, 134
        session.add(first)

    assert reconcile(deps)["launched"] == 0  # the backoff (an hour) is not over
    deps.clock = Clock(deps.clock() + timedelta(hours=2))
    assert reconcile(deps)["launched"] == 1

    assert attempt_numbers(deps, run_id) == [1, 2]
    (record,) = records(deps, "resubmitted", run_id)
    assert record["lost_steps"] == 7
