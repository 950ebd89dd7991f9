"""Attempts end to end in the control plane's own code: lost work, and racing launches."""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlmodel import select

from bot.console import ConsoleNotifier
from jobs.db import session_scope
from jobs.deps import Deps
from jobs.lifecycle import AttemptState, RunState
from jobs.models import Alert, Attempt, Event, Run
from jobs.notify import CallbackJournal
from jobs.providers.local import LocalProvider
from jobs.runs import (
    end_attempt,
    launch_attempt,
    measured_interval,
    on_attempt_event,
    reconcile,
)
from jobs.settings import Settings
from jobs.tasks import run_summary

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


class Clock:
    """The control plane's clock, moved by the test."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def deps(db_engine: Engine, settings: Settings, tmp_path: Path) -> Iterator[Deps]:
    records: list[dict[str, Any]] = []
    provider = LocalProvider(tmp_path / "local")
    d = Deps(
        settings=settings,
        engine=db_engine,
        provider=provider,
        notifier=ConsoleNotifier(io.StringIO()),
        journal=CallbackJournal(lambda t, run, data: records.append({"type": t, **data})),
    )
    d.records = records  # type: ignore[attr-defined]
    yield d
    d.close()
    for inst in provider.list_instances():
        if not inst.state.is_terminal():
            provider.terminate(inst.instance_id)
    provider.close()


def _spec(**extra: Any) -> dict[str, Any]:
    return {
        "name": "tiny",
        "command": [sys.executable, "-c", "import time; time.sleep(60)"],
        "dry_run": {"enabled": False},
        "resubmit": {"backoff_s": 3600},  # no resubmit during the test
        **extra,
    }


def _running(deps: Deps, run_id: str, *, committed: int, **attempt: Any) -> None:
    """A running run whose newest commit (and step) is ``committed``, with one attempt
    running since T0 (``attempt`` gives its id, number and any other fields)."""
    with session_scope(deps.engine) as session:
        run = Run(
            id=run_id, spec_name="tiny", spec=_spec(), requester="ada", state=RunState.RUNNING
        )
        run.last_committed_step = committed
        run.last_step = committed
        session.add(run)
        session.flush()
        session.add(
            Attempt(
                run_id=run_id,
                provider="local",
                state=AttemptState.RUNNING,
                started_at=T0,
                **attempt,
            )
        )


def test_lost_time_counts_both_the_restore_and_the_steps_since_the_last_commit(
    deps: Deps,
) -> None:
    """A resumed attempt loses its start-up and restore, then the steps done after its
    last commit when it is preempted: run_summary's goodput counts both."""
    clock = Clock(T0)
    deps.clock = clock
    _running(deps, "r-lost", committed=100, id="a-lost", number=2, resumed_from_step=100)
    clock.now = T0 + timedelta(seconds=5)
    on_attempt_event(deps, "a-lost", "restored", {"step": 100})
    with session_scope(deps.engine) as session:
        a = session.get(Attempt, "a-lost")
        assert a is not None and a.lost_seconds == pytest.approx(5.0)
        # What the ingest API records from the runner's metrics: step 120 at 1 s a step.
        a.last_step = 120
        a.step_time_s = 1.0
        session.add(a)
    clock.now = T0 + timedelta(seconds=40)
    end_attempt(deps, "a-lost", state=AttemptState.PREEMPTED, exit_code=75, reason="preempted")
    with session_scope(deps.engine) as session:
        a = session.get(Attempt, "a-lost")
        assert a is not None and a.state == AttemptState.PREEMPTED
        assert a.lost_steps == 20
        assert a.lost_seconds == pytest.approx(5.0 + 20.0)
    with session_scope(deps.engine) as session:
        (alert,) = session.exec(select(Alert).where(Alert.rule == "preemption")).all()
        assert "code 75" in alert.detail and "None" not in alert.detail
    summary = run_summary(deps, "r-lost")
    assert summary["paid_s"] == pytest.approx(40.0)
    assert summary["lost_s"] == pytest.approx(25.0)
    assert summary["goodput"] == pytest.approx(1 - 25 / 40, abs=1e-4)


def test_the_sigterm_of_a_stop_is_not_reported_as_a_preemption(deps: Deps) -> None:
    out = io.StringIO()
    deps.notifier = ConsoleNotifier(out)
    _running(deps, "r-stop", committed=10, id="a-stop", number=1)
    notice = {"source": "signal", "time_left_s": 30.0}
    on_attempt_event(deps, "a-stop", "preemption_notice", notice)
    with session_scope(deps.engine) as session:
        run = session.get(Run, "r-stop")
        assert run is not None
        run.state = RunState.STOPPED  # what /train stop does before it terminates
        session.add(run)
    on_attempt_event(deps, "a-stop", "preemption_notice", notice)
    notices = [r for r in deps.records if r["type"] == "preemption_notice"]  # type: ignore[attr-defined]
    assert len(notices) == 1, "only the running run's notice is a preemption"
    text = out.getvalue()
    assert text.count("Preemption notice") == 1
    assert "Attempt 1 is stopping: its runner flushes a checkpoint first." in text


def _new_run(deps: Deps, run_id: str) -> None:
    with session_scope(deps.engine) as session:
        session.add(
            Run(
                id=run_id, spec_name="tiny", spec=_spec(), requester="ada", state=RunState.LAUNCHING
            )
        )


def test_reconcile_racing_a_launch_records_one_instance_once(deps: Deps) -> None:
    """Reconcile runs while launches are in progress (the instance exists, the database
    does not know it yet): it may adopt the attempt, but the launch and the adoption
    record it once, with no illegal transition and no second instance."""
    run_ids = [f"r-race-{i}" for i in range(8)]
    for run_id in run_ids:
        _new_run(deps, run_id)
    errors: list[BaseException] = []
    done = threading.Event()

    def reconcile_loop() -> None:
        while not done.is_set():
            try:
                reconcile(deps)
            except BaseException as exc:  # the assertion below reports it
                errors.append(exc)
                return

    def launch(run_id: str) -> None:
        try:
            launch_attempt(deps, run_id)
        except BaseException as exc:
            errors.append(exc)

    reconciler = threading.Thread(target=reconcile_loop)
    reconciler.start()
    try:
        launchers = [threading.Thread(target=launch, args=(r,)) for r in run_ids]
        for t in launchers:
            t.start()
        for t in launchers:
            t.join(timeout=60)
    finally:
        done.set()
        reconciler.join(timeout=60)
    assert errors == []
    with session_scope(deps.engine) as session:
        attempts = session.exec(select(Attempt)).all()
    assert sorted(a.run_id for a in attempts) == sorted(run_ids)
    assert all(a.state == AttemptState.PROVISIONING and a.instance_id for a in attempts)
    launched = [r["attempt_id"] for r in deps.records if r["type"] == "launched"]  # type: ignore[attr-defined]
    assert sorted(launched) == sorted(a.id for a in attempts)
    per_attempt: dict[str, int] = {}
    for inst in deps.provider.list_instances():
        per_attempt[inst.attempt_id] = per_attempt.get(inst.attempt_id, 0) + 1
    assert per_attempt == {a.id: 1 for a in attempts}


def test_an_auto_interval_follows_the_stall_the_run_measured(deps: Deps) -> None:
    """Preflight's dry run ran on the control plane's CPU; once the run's own periodic
    saves are known, the next attempt checkpoints at the rule's interval for their cost
    (the final save, which copies nothing, does not count)."""
    from runner.preemption import daly_interval

    preflight = {
        "results": [{"name": "dry_run", "data": {"interval_mtbp_s": 6000.0, "interval_s": 30.0}}]
    }
    with session_scope(deps.engine) as session:
        run = Run(
            id="r-follow",
            spec_name="tiny",
            spec=_spec(),
            requester="ada",
            state=RunState.RECOVERING,
            preflight=preflight,
            checkpoint_interval_s=30.0,
        )
        session.add(run)
        session.flush()
        attempt = Attempt(
            id="a-follow-1",
            run_id=run.id,
            number=1,
            provider="local",
            state=AttemptState.PREEMPTED,
            last_step=100,
        )
        session.add(attempt)
        session.flush()
        saves = [(20, 0.4), (40, 0.5), (60, 0.6), (80, 0.5), (100, 0.001)]
        for seq, (step, stall) in enumerate(saves):
            session.add(
                Event(
                    attempt_id=attempt.id,
                    run_id=run.id,
                    seq=seq,
                    type="checkpoint_committed",
                    time=T0 + timedelta(seconds=seq),
                    data={"step": step, "bytes": 1, "write_s": 2.0, "stall_s": stall, "uri": "x"},
                )
            )
    with session_scope(deps.engine) as session:
        row = session.get(Run, "r-follow")
        assert row is not None
        assert measured_interval(session, row) == pytest.approx(daly_interval(0.5, 6000.0))
    second = launch_attempt(deps, "r-follow")
    assert second is not None and second.number == 2
    with session_scope(deps.engine) as session:
        row = session.get(Run, "r-follow")
        assert row is not None
        assert row.checkpoint_interval_s == pytest.approx(daly_interval(0.5, 6000.0))
    launched = next(r for r in deps.records if r["type"] == "launched")  # type: ignore[attr-defined]
    assert launched["checkpoint_interval_s"] == pytest.approx(daly_interval(0.5, 6000.0))
    assert any(r["type"] == "checkpoint_interval" for r in deps.records)  # type: ignore[attr-defined]


def test_too_few_saves_leave_the_interval_alone(deps: Deps) -> None:
    with session_scope(deps.engine) as session:
        run = Run(
            id="r-few",
            spec_name="tiny",
            spec=_spec(),
            requester="ada",
            state=RunState.RECOVERING,
            preflight={"results": [{"name": "dry_run", "data": {"interval_mtbp_s": 6000.0}}]},
            checkpoint_interval_s=30.0,
        )
        session.add(run)
        session.flush()
        session.add(Attempt(id="a-few", run_id=run.id, number=1, provider="local", last_step=50))
        session.flush()
        session.add(
            Event(
                attempt_id="a-few",
                run_id=run.id,
                seq=0,
                type="checkpoint_committed",
                time=T0,
                data={"step": 20, "bytes": 1, "write_s": 2.0, "stall_s": 0.5, "uri": "x"},
            )
        )
    with session_scope(deps.engine) as session:
        row = session.get(Run, "r-few")
        assert row is not None and measured_interval(session, row) is None


def test_reconcile_relaunching_after_a_preemption_reports_the_resubmit_once(
    deps: Deps,
) -> None:
    """The resubmit timer died with its process (the backoff here outlasts the test), so
    reconcile's backstop launches the next attempt: it is still a resubmit, with its
    record and the work lost, and a second reconcile launches nothing more."""
    clock = Clock(T0)
    deps.clock = clock
    _running(
        deps, "r-backstop", committed=50, id="a-backstop-1", number=1, last_step=58, step_time_s=2.0
    )
    clock.now = T0 + timedelta(seconds=120)
    end_attempt(
        deps, "a-backstop-1", state=AttemptState.PREEMPTED, exit_code=75, reason="preempted"
    )
    with session_scope(deps.engine) as session:
        run_now = session.get(Run, "r-backstop")
        assert run_now is not None and run_now.state == RunState.RECOVERING
    records: list[dict[str, Any]] = deps.records  # type: ignore[attr-defined]
    reconcile(deps)  # the backoff is not over: nothing yet
    assert not [r for r in records if r["type"] == "resubmitted"]
    clock.now = T0 + timedelta(seconds=120 + 3601)
    reconcile(deps)
    reconcile(deps)
    resubmits = [r for r in records if r["type"] == "resubmitted"]
    assert len(resubmits) == 1
    assert resubmits[0]["attempt"] == 2
    assert resubmits[0]["resume_from_step"] == 50
    assert resubmits[0]["lost_steps"] == 8
    assert resubmits[0]["lost_seconds"] == pytest.approx(16.0)
    with session_scope(deps.engine) as session:
        attempts = session.exec(select(Attempt).where(Attempt.run_id == "r-backstop")).all()
    assert sorted(a.number for a in attempts) == [1, 2]
