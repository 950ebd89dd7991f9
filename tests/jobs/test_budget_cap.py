"""The budget's hard cap holds across resubmits, ``max_hours`` stops a run, and a run's
cloud budget notifies someone and goes away when the run ends.

Real databases and the real use-cases (``jobs.usecases.service``, ``jobs.background.tasks``, the chat
dispatcher); launches are recorded instead of run, and time is the ``deps`` clock.
"""

from __future__ import annotations

import dataclasses
import io
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from moto.budgets.models import budgets_backends
from sqlalchemy import Engine, func
from sqlmodel import Session, select

from bot.console import ConsoleNotifier
from bot.dispatch import handle_text
from jobs.background.tasks import cleanup_job, spend_job
from jobs.database.db import session_scope
from jobs.database.models import Alert, Attempt, Run, SpendRecord
from jobs.domain.errors import ConflictError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.process.deps import Deps
from jobs.process.settings import Settings, load_settings
from jobs.providers.aws import from_settings
from jobs.providers.aws.budgets import budget_name
from jobs.providers.base import TAG_RUN_ID
from jobs.providers.local import LocalProvider
from jobs.runs.launch import cloud_budget
from jobs.spec import JobSpec
from jobs.spend import remove_cloud_budgets, run_spent
from jobs.usecases import service
from jobs.usecases.service import Actor
from tests.fakes import aws as fake
from tests.jobs.rows import detached
from tests.waiting import wait_until

T0 = datetime(2024, 5, 14, 10, 0, tzinfo=timezone.utc)
ADA = Actor(user="ada", channel="C-ml", is_admin=False)


def stored_spec(**fields: Any) -> dict[str, Any]:
    spec = JobSpec.model_validate(
        {"name": "gpt-small", "command": ["python", "train.py"], **fields}
    )
    return spec.model_dump(mode="json")


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def journal() -> list[dict[str, Any]]:
    return []


@pytest.fixture
def launched() -> list[str]:
    return []


def make_deps(
    engine: Engine,
    settings: Settings,
    provider: Any,
    clock: Clock,
    journal: list[dict[str, Any]],
    launched: list[str],
) -> Deps:
    deps = Deps(
        settings=settings,
        engine=engine,
        provider=provider,
        notifier=ConsoleNotifier(io.StringIO()),
        journal=CallbackJournal(
            lambda t, run, data: journal.append({"type": t, "run": run, **data})
        ),
        clock=clock,
    )

    def background(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        # Launches are recorded, not run: no instance is started in these tests; the cloud
        # budget that comes first is created. The rest (ending an attempt, removing a cloud
        # budget) runs at once.
        if fn.__name__ == "budget_then_launch" and kwargs["budget"]:
            cloud_budget(args[0], args[1], kwargs["budget"], kwargs["thresholds"])
        if fn.__name__ in ("launch_attempt", "next_attempt_now", "budget_then_launch"):
            launched.append(args[1])
        else:
            fn(*args, **kwargs)

    deps.background = background  # type: ignore[method-assign,assignment]
    # The stop lane too: a stop ends its attempt there, and that removes the budget.
    deps.urgent = background  # type: ignore[method-assign,assignment]
    return deps


@pytest.fixture
def build_deps(
    db_engine: Engine, clock: Clock, journal: list[dict[str, Any]], launched: list[str]
) -> Iterator[Callable[[Settings, Any], Deps]]:
    """``make_deps`` with this test's clock, journal and launches, for the settings and the
    provider a test gives; each closed at the test's end."""
    made: list[Deps] = []

    def build(settings: Settings, provider: Any) -> Deps:
        made.append(make_deps(db_engine, settings, provider, clock, journal, launched))
        return made[-1]

    yield build
    for deps in made:
        deps.close()


@pytest.fixture
def deps(build_deps: Callable[[Settings, Any], Deps], settings: Settings, tmp_path: Path) -> Deps:
    return build_deps(settings, LocalProvider(tmp_path / "local"))


def add_run(
    engine: Engine,
    run_id: str,
    *,
    state: RunState,
    spent: float,
    budget: float | None = 100.0,
    spec: dict[str, Any] | None = None,
    started: datetime = T0 - timedelta(hours=1),
) -> None:
    """A run with one attempt that has spent ``spent`` dollars."""
    with session_scope(engine) as session:
        session.add(
            Run(
                id=run_id,
                spec_name="gpt-small",
                spec=spec if spec is not None else stored_spec(budget={"usd": budget}),
                requester="ada",
                channel="C-ml",
                budget_usd=budget,
                state=state,
                last_committed_step=40,
                ended_at=T0 if state.is_terminal() else None,
            )
        )
        session.flush()
        attempt = Attempt(
            id=f"a-{run_id}",
            run_id=run_id,
            number=1,
            provider="local",
            price_per_hour=1.0,
            started_at=started,
            ended_at=T0 if state.is_terminal() else None,
            state=AttemptState.TERMINATED if state.is_terminal() else AttemptState.RUNNING,
        )
        session.add(attempt)
        session.flush()
        if spent:
            session.add(
                SpendRecord(
                    attempt_id=attempt.id,
                    run_id=run_id,
                    period_start=started,
                    period_end=T0,
                    usd=spent,
                    instances=1,
                    price_per_hour=1.0,
                )
            )


def get(engine: Engine, run_id: str) -> Run:
    return detached(engine, Run, run_id)


def run_count(engine: Engine) -> int:
    with Session(engine) as session:
        return session.exec(select(func.count()).select_from(Run)).one()


def spent(engine: Engine, run_id: str) -> float:
    with Session(engine) as session:
        return run_spent(session, run_id)


# --- resubmitting a capped run ---------------------------------------------------------


def _running_at_t0(engine: Engine, run_id: str) -> None:
    """The resubmitted run running since T0 on the local provider, at its price (the
    spend job refreshes the price), as attempt a-new."""
    with session_scope(engine) as session:
        session.add(
            Attempt(
                id="a-new",
                run_id=run_id,
                number=1,
                provider="local",
                price_per_hour=1.0,
                started_at=T0,
                state=AttemptState.RUNNING,
            )
        )
        run = session.get(Run, run_id)
        assert run is not None
        run.state = RunState.RUNNING


def test_a_capped_run_resubmitted_without_a_raise_stays_stopped(
    db_engine: Engine, deps: Deps, launched: list[str]
) -> None:
    add_run(db_engine, "r-1", state=RunState.BUDGET_EXCEEDED, spent=101.0)
    with pytest.raises(ConflictError) as refused:
        service.resubmit(deps, "r-1", ADA)
    message = str(refused.value)
    assert "$101.00 of its $100.00 budget" in message
    assert "/train resubmit r-1 budget.usd=" in message
    # Through chat too: the person is told how to raise it, and nothing launches.
    reply = handle_text(deps, "resubmit r-1", ADA)
    assert "budget.usd=" in reply.text and reply.ephemeral
    assert get(db_engine, "r-1").state is RunState.BUDGET_EXCEEDED
    assert run_count(db_engine) == 1 and launched == []


def test_a_raise_not_above_the_spend_is_refused(db_engine: Engine, deps: Deps) -> None:
    add_run(db_engine, "r-1", state=RunState.BUDGET_EXCEEDED, spent=101.0)
    with pytest.raises(ConflictError, match="Raise the budget above what is spent"):
        service.resubmit(deps, "r-1", ADA, budget_usd=101.0)
    assert run_count(db_engine) == 1


def test_with_a_raised_budget_it_launches_and_its_spend_carries_on(
    db_engine: Engine, deps: Deps, clock: Clock, journal: list[dict[str, Any]], launched: list[str]
) -> None:
    add_run(db_engine, "r-1", state=RunState.BUDGET_EXCEEDED, spent=101.0)
    reply = handle_text(deps, "resubmit r-1 budget.usd=150", ADA)
    assert reply.run_id is not None and reply.run_id != "r-1", reply.text
    new = get(db_engine, reply.run_id)
    assert new.state is RunState.LAUNCHING and launched == [new.id]
    assert new.carried_usd == pytest.approx(101.0)
    assert new.budget_usd == 150.0 and new.spec["budget"]["usd"] == 150.0
    assert new.budget_raised_by == "ada"
    [raised] = [r for r in journal if r["type"] == "budget_raised"]
    assert raised == {
        "type": "budget_raised",
        "run": new.id,
        "usd": 150.0,
        "was_usd": 100.0,
        "by": "ada",
        "spent_usd": 101.0,
    }
    assert spent(db_engine, new.id) == pytest.approx(101.0)  # not zero

    # Its own spend adds to what it carries, and the raised cap stops it.
    _running_at_t0(db_engine, new.id)
    clock.now = T0 + timedelta(hours=30)
    assert spend_job(deps) == []
    assert spent(db_engine, new.id) == pytest.approx(131.0)
    clock.now = T0 + timedelta(hours=50)
    assert spend_job(deps) == [new.id]
    stopped = get(db_engine, new.id)
    assert stopped.state is RunState.BUDGET_EXCEEDED
    assert stopped.reason == "hard budget cap: $151.00 of $150.00 spent"

    # And the next resubmit carries all of it: $151 against the raised $150.
    with pytest.raises(ConflictError, match=r"\$151.00 of its \$150.00 budget"):
        service.resubmit(deps, new.id, ADA)
    again = service.resubmit(deps, new.id, ADA, budget_usd=300.0)
    assert spent(db_engine, again.id) == pytest.approx(151.0)


def test_a_stopped_run_resubmitted_under_its_budget_carries_its_spend(
    db_engine: Engine, deps: Deps, journal: list[dict[str, Any]]
) -> None:
    add_run(db_engine, "r-1", state=RunState.STOPPED, spent=40.0)
    new = service.resubmit(deps, "r-1", ADA)
    assert new.carried_usd == pytest.approx(40.0) and new.budget_usd == 100.0
    assert new.budget_raised_by is None
    assert not [r for r in journal if r["type"] == "budget_raised"]
    assert spent(db_engine, new.id) == pytest.approx(40.0)


def test_without_a_hard_cap_a_spent_budget_does_not_block_a_resubmit(
    db_engine: Engine, deps: Deps
) -> None:
    add_run(
        db_engine,
        "r-1",
        state=RunState.STOPPED,
        spent=140.0,
        spec=stored_spec(budget={"usd": 100.0, "hard_cap": False}),
    )
    new = service.resubmit(deps, "r-1", ADA)
    assert new.carried_usd == pytest.approx(140.0)


def test_a_recovering_run_can_have_its_budget_raised_in_place(
    db_engine: Engine, deps: Deps, launched: list[str]
) -> None:
    add_run(db_engine, "r-1", state=RunState.RECOVERING, spent=90.0)
    run = service.resubmit(deps, "r-1", ADA, budget_usd=500.0)
    assert run.id == "r-1" and launched == ["r-1"]
    got = get(db_engine, "r-1")
    assert (got.budget_usd, got.budget_raised_by) == (500.0, "ada")


# --- max_hours -------------------------------------------------------------------------


def test_max_hours_stops_a_run_with_an_alert(
    db_engine: Engine, deps: Deps, clock: Clock, journal: list[dict[str, Any]]
) -> None:
    add_run(
        db_engine,
        "r-1",
        state=RunState.RUNNING,
        spent=0.0,
        budget=None,
        spec=stored_spec(max_hours=2),
        started=T0,
    )
    clock.now = T0 + timedelta(hours=1, minutes=59)
    assert spend_job(deps) == []
    assert get(db_engine, "r-1").state is RunState.RUNNING
    clock.now = T0 + timedelta(hours=2)
    assert spend_job(deps) == ["r-1"]
    run = get(db_engine, "r-1")
    assert run.state is RunState.STOPPED and run.reason == "max_hours: ran 2.00 h of 2 h"
    with Session(db_engine) as session:
        attempt = session.get(Attempt, "a-r-1")
        assert attempt is not None
        # TERMINATED: ended as a stop (the runner flushes), not a preemption to resubmit.
        assert attempt.state is AttemptState.TERMINATED and attempt.end_reason == "max_hours"
        alert = session.exec(select(Alert).where(Alert.rule == "max_hours")).one()
    assert alert.run_id == "r-1" and "max_hours of 2 h" in alert.title
    assert "resubmit" in alert.hint
    assert any(r["type"] == "run_finished" and r["state"] == "STOPPED" for r in journal)
    assert spend_job(deps) == []  # once


def test_a_resubmit_carries_the_hours_its_runs_used_into_max_hours(
    db_engine: Engine, deps: Deps, clock: Clock
) -> None:
    """r-1 ran 1.5 h of its max_hours=2 and was stopped; its resubmit may run 0.5 h more."""
    add_run(
        db_engine,
        "r-1",
        state=RunState.STOPPED,
        spent=0.0,
        spec=stored_spec(max_hours=2),
        started=T0 - timedelta(hours=1, minutes=30),
    )
    new = service.resubmit(deps, "r-1", ADA)
    assert new.carried_hours == pytest.approx(1.5)
    _running_at_t0(db_engine, new.id)
    clock.now = T0 + timedelta(minutes=29)
    assert spend_job(deps) == []
    clock.now = T0 + timedelta(minutes=30)
    assert spend_job(deps) == [new.id]
    stopped = get(db_engine, new.id)
    assert stopped.state is RunState.STOPPED
    assert stopped.reason == "max_hours: ran 2.00 h of 2 h"
    # And the next resubmit carries all 2 hours: it is stopped at its first pass.
    again = service.resubmit(deps, new.id, ADA)
    assert again.carried_hours == pytest.approx(2.0)


# --- the cloud budget ------------------------------------------------------------------


class BudgetsProvider(LocalProvider):
    """The local provider with cloud budgets, recording what is deleted."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.deleted: list[str] = []

    @property
    def capabilities(self) -> Any:
        return dataclasses.replace(super().capabilities, cloud_budgets=True)

    def delete_budget(self, *, run_id: str) -> None:
        self.deleted.append(run_id)


@pytest.mark.parametrize("keep_days", [0.0, 3.0])
def test_a_cloud_budget_is_removed_when_the_run_ends_or_days_later(
    db_engine: Engine,
    settings: Settings,
    tmp_path: Path,
    clock: Clock,
    build_deps: Callable[[Settings, Any], Deps],
    keep_days: float,
) -> None:
    provider = BudgetsProvider(tmp_path / "local")
    deps = build_deps(settings.model_copy(update={"cloud_budget_keep_days": keep_days}), provider)
    add_run(db_engine, "r-1", state=RunState.RUNNING, spent=0.0, started=T0)
    service.stop(deps, "r-1", ADA)  # ends the attempt and the run
    if keep_days:
        assert provider.deleted == []
        clock.now = T0 + timedelta(days=keep_days)
        cleanup_job(deps)
    assert provider.deleted == ["r-1"]
    assert get(db_engine, "r-1").cloud_budget_removed_at == clock.now
    assert remove_cloud_budgets(deps, now=clock.now + timedelta(days=9)) == []  # once
    assert provider.deleted == ["r-1"]


def _on_moto(tmp_path: Path, moto_server: str, **budget: str) -> Settings:
    """A control plane on AWS (moto's server) with the AWS Budget settings ``budget``."""
    return load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_PROVIDER": "aws",
            "TRAINBOT_AWS_REGION": "us-east-1",
            "TRAINBOT_AWS_ENDPOINT_URL": moto_server,
            "TRAINBOT_CHECKPOINT_URI": "s3://checkpoints/runs",
            "TRAINBOT_PUBLIC_URL": "https://trainbot.example.com",
            **budget,
        }
    )


@pytest.fixture
def on_moto(
    build_deps: Callable[[Settings, Any], Deps], moto_server: str, tmp_path: Path
) -> Callable[..., Deps]:
    """Deps on AWS (moto's server) with the AWS Budget settings a test gives."""

    def make(**budget: str) -> Deps:
        settings = _on_moto(tmp_path, moto_server, **budget)
        return build_deps(settings, from_settings(settings))

    return make


def test_on_moto_the_aws_budget_notifies_the_configured_subscribers_and_goes_with_the_run(
    db_engine: Engine, journal: list[dict[str, Any]], on_moto: Callable[..., Deps]
) -> None:
    topic = f"arn:aws:sns:us-east-1:{fake.MOTO_ACCOUNT}:trainbot-budgets"
    deps = on_moto(
        TRAINBOT_AWS_BUDGET_EMAILS="oncall@x.io,lead@x.io", TRAINBOT_AWS_BUDGET_SNS_TOPIC_ARN=topic
    )
    run_id = f"r-{uuid.uuid4().hex[:8]}"
    add_run(db_engine, run_id, state=RunState.RUNNING, spent=0.0, started=T0)
    name = deps.provider.create_budget(run_id=run_id, usd=100.0, thresholds=[80, 100])
    stored = budgets_backends[fake.MOTO_ACCOUNT]["aws"].budgets[fake.MOTO_ACCOUNT]
    subscribers = {
        float(n.details["Threshold"]): sorted(
            (s["SubscriptionType"], s["Address"]) for s in n.subscribers
        )
        for n in stored[name].notifications
    }
    everyone = [("EMAIL", "lead@x.io"), ("EMAIL", "oncall@x.io"), ("SNS", topic)]
    assert subscribers == {80.0: everyone, 100.0: everyone}

    service.stop(deps, run_id, ADA)
    assert name not in stored
    assert get(db_engine, run_id).cloud_budget_removed_at == T0
    assert {"type": "cloud_budget_removed", "run": run_id} in journal


def test_on_moto_a_resubmitted_run_gets_its_own_aws_budget_for_what_is_left(
    db_engine: Engine,
    journal: list[dict[str, Any]],
    launched: list[str],
    on_moto: Callable[..., Deps],
) -> None:
    """The AWS Budget follows the run's tag, so the run a resubmit creates gets one of its
    own, for what is left of the budget after the $40 it carries; the old one's went
    with the old run."""
    deps = on_moto(TRAINBOT_AWS_BUDGET_EMAILS="oncall@x.io")
    old = f"r-{uuid.uuid4().hex[:8]}"
    add_run(db_engine, old, state=RunState.STOPPED, spent=40.0)
    new = service.resubmit(deps, old, ADA)
    assert launched == [new.id]
    stored = budgets_backends[fake.MOTO_ACCOUNT]["aws"].budgets[fake.MOTO_ACCOUNT]
    budget = stored[budget_name(new.id)]
    assert float(budget.budget["BudgetLimit"]["Amount"]) == pytest.approx(60.0)
    assert budget.budget["CostFilters"] == {"TagKeyValue": [f"user:{TAG_RUN_ID}${new.id}"]}
    assert {r["run"]: r["usd"] for r in journal if r["type"] == "cloud_budget"} == {new.id: 60.0}
    service.stop(deps, new.id, ADA)
    assert budget_name(new.id) not in stored


# --- end to end: a real control plane, local instances ---------------------------------


@pytest.mark.slow
def test_a_resubmitted_capped_run_stays_stopped_until_its_budget_is_raised(
    tmp_path: Path,
) -> None:
    """The tiny example at $36,000 an hour ($10 a second) against a $5 budget: the spend
    job stops it at the cap; resubmitting does nothing until the budget is raised; the
    raised run goes on from the old one's checkpoints and spend."""
    records: list[dict[str, Any]] = []
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_LOCAL_TERMINATION_WINDOW_S": "5",
            "TRAINBOT_LOCAL_PRICE_PER_HOUR_USD": "36000",
        }
    )
    cp = ControlPlane(
        settings,
        notifier=ConsoleNotifier(io.StringIO()),
        journal=CallbackJournal(
            lambda t, run, data: records.append({"type": t, "run": run, **data})
        ),
        scheduler=False,
    )

    def state(run_id: str) -> RunState:
        return get(cp.deps.engine, run_id).state

    overrides = ["dry_run.enabled=false", "budget.usd=5"]
    try:
        with cp:
            run = service.submit(cp.deps, spec_name="tiny", overrides=overrides, actor=ADA)
            wait_until(lambda: state(run.id) == RunState.AWAITING_CONFIRMATION, what="preflight")
            service.confirm(cp.deps, run.id, ADA)
            wait_until(lambda: state(run.id) == RunState.RUNNING, what="the run to start")
            time.sleep(0.6)  # $6 at $10 a second
            assert spend_job(cp.deps) == [run.id]
            assert state(run.id) is RunState.BUDGET_EXCEEDED
            with Session(cp.deps.engine) as session:
                old_spent = run_spent(session, run.id)
            assert old_spent >= 5.0

            reply = handle_text(cp.deps, f"resubmit {run.id}", ADA)
            assert "budget.usd=" in reply.text and reply.run_id is None, reply.text
            assert state(run.id) is RunState.BUDGET_EXCEEDED
            assert run_count(cp.deps.engine) == 1

            reply = handle_text(cp.deps, f"resubmit {run.id} budget.usd=1000", ADA)
            assert reply.run_id is not None and reply.run_id != run.id, reply.text
            new = reply.run_id
            wait_until(lambda: state(new) == RunState.RUNNING, what="the resubmitted run to start")
            raised = get(cp.deps.engine, new)
            assert raised.budget_raised_by == "ada" and raised.budget_usd == 1000.0
            assert raised.checkpoint_prefix == run.id  # it resumes the old checkpoints
            time.sleep(0.3)
            spend_job(cp.deps)
            with Session(cp.deps.engine) as session:
                assert run_spent(session, new) > old_spent  # it carries on, not from zero
            service.stop(cp.deps, new, ADA)
            wait_until(
                lambda: all(i.state.is_terminal() for i in cp.deps.provider.list_instances()),
                what="every instance to end",
            )
    finally:
        for inst in cp.deps.provider.list_instances():
            if not inst.state.is_terminal():
                cp.deps.provider.terminate(inst.instance_id)
        cp.deps.provider.close()  # type: ignore[attr-defined]
