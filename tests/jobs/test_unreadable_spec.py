"""One run whose stored spec no longer validates (a row from an older trainbot, or edited
by hand) is skipped and flagged by the passes over every run; the others go on."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlmodel import select

from jobs.background.tasks import cleanup_job, spend_job
from jobs.database.db import session_scope
from jobs.database.models import Alert, Attempt, Run, SpendRecord
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.runs import end_attempt, reconcile
from tests.jobs.local_plane import Clock, local_deps
from tests.jobs.rows import add_run, running_attempt, sleeping_spec

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
#: A spec that once validated: its command is empty now, its budget section is a string.
BROKEN: dict[str, Any] = {"name": "old", "command": [], "budget": "lots"}


@pytest.fixture
def deps(db_engine: Engine, settings: Settings, tmp_path: Path) -> Iterator[Deps]:
    with local_deps(settings, db_engine, tmp_path, clock=Clock(T0)) as made:
        yield made


def _good_spec(**extra: Any) -> dict[str, Any]:
    return sleeping_spec(resubmit={"backoff_s": 60}, **extra)


def _run(deps: Deps, run_id: str, spec: dict[str, Any], **fields: Any) -> None:
    with session_scope(deps.engine) as session:
        add_run(
            session,
            Run(
                id=run_id,
                spec_name=str(spec.get("name")),
                spec=spec,
                requester="ada",
                state=RunState.RUNNING,
                **fields,
            ),
            running_attempt(
                f"{run_id}-a1", run_id, provider="local", started_at=T0, last_heartbeat=T0
            ),
        )


def _flags(deps: Deps, run_id: str) -> list[Alert]:
    with session_scope(deps.engine) as session:
        return list(
            session.exec(select(Alert).where(Alert.run_id == run_id, Alert.rule == "spec")).all()
        )


def test_reconcile_relaunches_the_others_and_flags_the_unreadable_run_once(deps: Deps) -> None:
    """Both runs were preempted and are due a relaunch: before, reading the broken spec
    raised at the top of reconcile and no run was relaunched, ever."""
    clock: Clock = deps.clock  # type: ignore[assignment]
    _run(deps, "r-broken", BROKEN)
    _run(deps, "r-good", _good_spec())
    for run_id in ("r-broken", "r-good"):
        end_attempt(
            deps, f"{run_id}-a1", state=AttemptState.PREEMPTED, exit_code=75, reason="preempted"
        )
    clock.now = T0 + timedelta(seconds=3600)
    reconcile(deps)
    reconcile(deps)  # a second pass updates the flag, it does not post it again
    with session_scope(deps.engine) as session:
        good = session.exec(select(Attempt).where(Attempt.run_id == "r-good")).all()
        broken = session.exec(select(Attempt).where(Attempt.run_id == "r-broken")).all()
        state = session.get(Run, "r-broken")
    assert sorted(a.number for a in good) == [1, 2]
    assert [a.number for a in broken] == [1]  # nothing launched from a spec it cannot read
    assert state is not None and state.state == RunState.RECOVERING
    (flag,) = _flags(deps, "r-broken")
    assert "no longer validates" in flag.title and "/train stop r-broken" in flag.hint
    assert _flags(deps, "r-good") == []


def test_the_spend_job_accrues_and_alerts_for_the_others(deps: Deps) -> None:
    """The spend job reads max_hours of every live run in the transaction that accrues
    spend: one broken row rolled back everyone's accrual and budget alerts."""
    clock: Clock = deps.clock  # type: ignore[assignment]
    _run(deps, "r-broken", BROKEN)
    _run(deps, "r-good", _good_spec(budget={"usd": 1.0}), budget_usd=1.0)
    with session_scope(deps.engine) as session:
        for attempt in session.exec(select(Attempt)).all():
            attempt.price_per_hour = 6.0
            session.add(attempt)
    clock.now = T0 + timedelta(hours=1)
    spend_job(deps)
    with session_scope(deps.engine) as session:
        spent = {r.run_id: r.usd for r in session.exec(select(SpendRecord)).all() if r.usd > 0}
        budget = session.exec(
            select(Alert).where(Alert.run_id == "r-good", Alert.rule == "budget")
        ).all()
    assert spent.keys() == {"r-broken", "r-good"}  # the broken run's instance still bills
    assert {a.key for a in budget} >= {"threshold-50", "threshold-80"}
    assert len(_flags(deps, "r-broken")) == 1


def test_cleanup_keeps_everything_of_the_unreadable_run_and_prunes_the_others(
    deps: Deps,
) -> None:
    """Its retention is unknown, so nothing of it is deleted; the defaults are not a
    guess to delete checkpoints by."""
    _run(deps, "r-broken", BROKEN, last_committed_step=10)
    _run(deps, "r-good", _good_spec(), last_committed_step=10)
    results = {r["run_id"]: r for r in cleanup_job(deps)}
    assert results["r-broken"]["error"] == "its stored spec no longer validates"
    assert "error" not in results["r-good"]
    assert len(_flags(deps, "r-broken")) == 1
