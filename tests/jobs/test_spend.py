"""Spend on real databases: accrual, totals, budget thresholds, digest figures, the chart."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import Engine
from sqlmodel import Session, select

from jobs.background.tasks import spend_job
from jobs.database.db import session_scope
from jobs.database.models import Alert, Attempt, Budget, Run, SpendRecord
from jobs.domain.errors import TrainbotError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.domain.severity import Severity
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.spec import JobSpec
from jobs.spend import (
    BudgetStatus,
    accrue,
    check_budgets,
    digest_figures,
    run_spent,
    spend_chart_png,
    spend_report,
    team_spent,
)
from tests.jobs.local_plane import local_deps

T0 = datetime(2024, 5, 14, 10, 0, tzinfo=timezone.utc)
NEW_YORK = ZoneInfo("America/New_York")  # UTC-4 in May


def utc(day: int, hour: int, minute: int = 0, month: int = 5) -> datetime:
    return datetime(2024, month, day, hour, minute, tzinfo=timezone.utc)


def add(engine: Engine, *rows: Any) -> None:
    with session_scope(engine) as session:
        for row in rows:
            session.add(row)
            session.flush()


def run_row(
    run_id: str,
    *,
    channel: str = "C-ml",
    requester: str = "U-alice",
    spec: dict[str, Any] | None = None,
    budget_usd: float | None = None,
    state: RunState = RunState.RUNNING,
) -> Run:
    return Run(
        id=run_id,
        spec_name="gpt-small",
        spec=spec or {},
        requester=requester,
        channel=channel,
        budget_usd=budget_usd,
        state=state,
    )


def attempt_row(
    attempt_id: str,
    run_id: str,
    *,
    number: int = 1,
    price: float | None = 2.0,
    instances: int = 1,
    started: datetime | None = T0,
    ended: datetime | None = None,
    state: AttemptState = AttemptState.RUNNING,
    lost_seconds: float = 0.0,
) -> Attempt:
    return Attempt(
        id=attempt_id,
        run_id=run_id,
        number=number,
        provider="local",
        price_per_hour=price,
        instances=instances,
        started_at=started,
        ended_at=ended,
        state=state,
        lost_seconds=lost_seconds,
    )


def do_accrue(engine: Engine, now: datetime) -> list[SpendRecord]:
    with session_scope(engine) as session:
        return accrue(session, now=now)


def spent(engine: Engine, run_id: str) -> float:
    with Session(engine) as session:
        return run_spent(session, run_id)


# --- accrual --------------------------------------------------------------------------


def test_accrual_is_price_times_hours_times_instances(db_engine: Engine) -> None:
    add(db_engine, run_row("r-1"), attempt_row("a-1", "r-1", price=2.0, instances=2))
    [record] = do_accrue(db_engine, T0 + timedelta(minutes=90))
    assert (record.period_start, record.period_end) == (T0, T0 + timedelta(minutes=90))
    assert record.usd == pytest.approx(2.0 * 1.5 * 2)
    assert (record.instances, record.price_per_hour, record.run_id) == (2, 2.0, "r-1")
    # The next interval starts where the last ended, at the price of the moment.
    with session_scope(db_engine) as session:
        attempt = session.get(Attempt, "a-1")
        assert attempt is not None
        attempt.price_per_hour = 4.0
    [second] = do_accrue(db_engine, T0 + timedelta(hours=2))
    assert second.period_start == T0 + timedelta(minutes=90)
    assert second.usd == pytest.approx(4.0 * 0.5 * 2)
    assert spent(db_engine, "r-1") == pytest.approx(10.0)


def test_accrual_is_idempotent_at_the_same_moment(db_engine: Engine) -> None:
    add(db_engine, run_row("r-1"), attempt_row("a-1", "r-1"))
    now = T0 + timedelta(hours=1)
    assert len(do_accrue(db_engine, now)) == 1
    assert do_accrue(db_engine, now) == []
    assert do_accrue(db_engine, now - timedelta(minutes=5)) == []
    with Session(db_engine) as session:
        assert len(session.exec(select(SpendRecord)).all()) == 1
    assert spent(db_engine, "r-1") == pytest.approx(2.0)


def test_ended_attempts_are_closed_out_exactly_at_their_end(db_engine: Engine) -> None:
    ended = T0 + timedelta(minutes=150)
    add(
        db_engine,
        run_row("r-1"),
        attempt_row(
            "a-1", "r-1", price=3.0, ended=ended, state=AttemptState.PREEMPTED, instances=2
        ),
    )
    do_accrue(db_engine, T0 + timedelta(hours=1))
    [last] = do_accrue(db_engine, T0 + timedelta(hours=6))
    assert last.period_end == ended
    assert do_accrue(db_engine, T0 + timedelta(days=2)) == []
    assert spent(db_engine, "r-1") == pytest.approx(3.0 * 2.5 * 2)


def test_unpriced_unstarted_and_future_attempts_accrue_nothing(db_engine: Engine) -> None:
    add(
        db_engine,
        run_row("r-1"),
        attempt_row("a-1", "r-1", number=1, price=None),
        attempt_row("a-2", "r-1", number=2, started=None),
        attempt_row("a-3", "r-1", number=3, started=T0 + timedelta(hours=3)),
    )
    assert do_accrue(db_engine, T0 + timedelta(hours=1)) == []
    assert spent(db_engine, "r-1") == 0.0


def test_team_spend_is_per_channel_and_prorated_to_the_window(db_engine: Engine) -> None:
    add(
        db_engine,
        run_row("r-1", channel="C-ml"),
        run_row("r-2", channel="C-ml"),
        run_row("r-3", channel="C-other"),
        attempt_row("a-1", "r-1", price=10.0),
        attempt_row("a-2", "r-2", price=1.0, instances=4),
        attempt_row("a-3", "r-3", price=7.0),
    )
    do_accrue(db_engine, T0 + timedelta(hours=4))  # one record each, 4 h long
    with Session(db_engine) as session:
        window = {"since": T0, "until": T0 + timedelta(hours=4)}
        assert team_spent(session, channel="C-ml", **window) == pytest.approx(40 + 16)
        assert team_spent(session, channel=None, **window) == pytest.approx(40 + 16 + 28)
        half = {"since": T0 + timedelta(hours=1), "until": T0 + timedelta(hours=3)}
        assert team_spent(session, channel="C-ml", **half) == pytest.approx(28.0)
        assert team_spent(session, channel="C-nobody", **window) == 0.0


# --- budgets --------------------------------------------------------------------------


def spend(engine: Engine, run_id: str, attempt_id: str, usd: float, at: datetime) -> None:
    add(
        engine,
        SpendRecord(
            attempt_id=attempt_id,
            run_id=run_id,
            period_start=at,
            period_end=at + timedelta(minutes=1),
            usd=usd,
            price_per_hour=usd * 60,
        ),
    )


def check(engine: Engine, now: datetime) -> dict[tuple[str, str], BudgetStatus]:
    with session_scope(engine) as session:
        return {(s.scope, s.name): s for s in check_budgets(session, now=now)}


CAPPED = {"budget": {"usd": 10.0, "thresholds": [50, 80, 100], "hard_cap": True}}


def test_run_thresholds_are_reported_once_each_and_the_hard_cap_flags(db_engine: Engine) -> None:
    add(
        db_engine,
        run_row("r-1", spec=CAPPED, budget_usd=10.0),
        attempt_row("a-1", "r-1", price=None),
    )
    key = ("run", "r-1")
    steps = [(4.0, ()), (1.0, (50,)), (0.0, ()), (4.0, (80,)), (1.5, (100,)), (1.0, ())]
    at = T0
    for amount, expected in steps:
        if amount:
            spend(db_engine, "r-1", "a-1", amount, at)
        at += timedelta(minutes=5)
        status = check(db_engine, at)[key]
        assert status.crossed == expected, (amount, status)
    assert status.spent == pytest.approx(11.5) and status.pct == pytest.approx(115.0)
    assert status.hard_cap_hit and status.usd == 10.0
    with Session(db_engine) as session:
        row = session.exec(select(Budget).where(Budget.name == "r-1")).one()
    assert (row.scope, row.period, row.alerted) == ("run", "run", [50, 80, 100])


def test_a_jump_reports_every_threshold_it_crossed(db_engine: Engine) -> None:
    add(db_engine, run_row("r-1", spec=CAPPED, budget_usd=10.0), attempt_row("a-1", "r-1"))
    spend(db_engine, "r-1", "a-1", 8.5, T0)
    status = check(db_engine, T0 + timedelta(minutes=5))[("run", "r-1")]
    assert status.crossed == (50, 80) and not status.hard_cap_hit


def test_an_estimated_budget_alerts_but_has_no_hard_cap(db_engine: Engine) -> None:
    estimate = {"budget": {"usd": None, "thresholds": [50, 80, 100], "hard_cap": True}}
    add(db_engine, run_row("r-1", spec=estimate, budget_usd=10.0), attempt_row("a-1", "r-1"))
    spend(db_engine, "r-1", "a-1", 12.0, T0)
    status = check(db_engine, T0 + timedelta(minutes=5))[("run", "r-1")]
    assert status.crossed == (50, 80, 100) and not status.hard_cap_hit


def test_raising_the_budget_rearms_thresholds(db_engine: Engine) -> None:
    add(db_engine, run_row("r-1", spec=CAPPED, budget_usd=10.0), attempt_row("a-1", "r-1"))
    spend(db_engine, "r-1", "a-1", 8.5, T0)
    assert check(db_engine, T0)[("run", "r-1")].crossed == (50, 80)
    with session_scope(db_engine) as session:
        run = session.get(Run, "r-1")
        assert run is not None
        run.budget_usd = 12.0
    # 8.5 of 12 is 71 %: 50 % stays reported, 80 % is armed again.
    status = check(db_engine, T0 + timedelta(minutes=1))[("run", "r-1")]
    assert status.crossed == () and status.usd == 12.0
    spend(db_engine, "r-1", "a-1", 2.0, T0 + timedelta(minutes=2))
    assert check(db_engine, T0 + timedelta(minutes=3))[("run", "r-1")].crossed == (80,)


def test_finished_runs_are_checked_briefly_and_never_flag_the_cap(db_engine: Engine) -> None:
    done = T0 - timedelta(hours=2)
    old = T0 - timedelta(days=3)
    add(
        db_engine,
        Run(
            id="r-done",
            spec_name="x",
            spec=CAPPED,
            requester="U",
            budget_usd=10.0,
            state=RunState.SUCCEEDED,
            ended_at=done,
        ),
        Run(
            id="r-old",
            spec_name="x",
            spec=CAPPED,
            requester="U",
            budget_usd=10.0,
            state=RunState.SUCCEEDED,
            ended_at=old,
        ),
        attempt_row("a-1", "r-done"),
    )
    spend(db_engine, "r-done", "a-1", 10.0, done - timedelta(minutes=1))
    statuses = check(db_engine, T0)
    assert ("run", "r-old") not in statuses
    finished = statuses[("run", "r-done")]
    assert finished.crossed == (50, 80, 100) and not finished.hard_cap_hit


def test_team_budgets_cover_the_month_and_rearm_in_the_next(db_engine: Engine) -> None:
    add(
        db_engine,
        Budget(scope="team", name="C-ml", usd=100.0, thresholds=[50, 80, 100]),
        run_row("r-1", channel="C-ml"),
        run_row("r-2", channel="C-other"),
        attempt_row("a-1", "r-1"),
        attempt_row("a-2", "r-2"),
    )
    spend(db_engine, "r-1", "a-1", 30.0, utc(30, 12, month=4))  # last month: not counted
    spend(db_engine, "r-1", "a-1", 55.0, utc(3, 12))
    spend(db_engine, "r-2", "a-2", 500.0, utc(3, 12))  # another channel
    team = ("team", "C-ml")
    first = check(db_engine, utc(4, 0))[team]
    assert (first.crossed, first.spent, first.hard_cap_hit) == ((50,), pytest.approx(55.0), False)
    assert check(db_engine, utc(4, 1))[team].crossed == ()
    spend(db_engine, "r-1", "a-1", 30.0, utc(20, 12))
    assert check(db_engine, utc(21, 0))[team].crossed == (80,)
    spend(db_engine, "r-1", "a-1", 60.0, utc(2, 12, month=6))
    assert check(db_engine, utc(3, 0, month=6))[team].crossed == (50,)


# --- digest ---------------------------------------------------------------------------

NOW = utc(15, 13)  # 09:00 in New York on 15 May; "yesterday" there is 14 May


def digest_scenario(engine: Engine) -> None:
    """The scenario the digest figures below are computed from by hand.

    - r-1 (alice, A100:8): attempt 1 at $10/h 10:00-14:00Z on the 14th, preempted,
      1800 s of work lost; attempt 2 at $10/h from 14:30Z, still running.
    - r-2 (bob, CPU, 2 instances at $0.5/h): 03:00-05:00Z on the 14th (23:00-01:00 in
      New York, across local midnight), preempted, 600 s lost.
    - r-3 (carol): one record 03:30-04:00Z on the 15th (ends at local midnight, so it
      belongs to the 14th), one 04:00-04:30Z (the 15th), $3 each.
    - r-9 (dave) in another channel: $100 on the 14th.
    """
    accelerated = {"resources": {"accelerator": {"type": "A100", "count": 8}}}
    add(
        engine,
        run_row("r-1", requester="U-alice", spec=accelerated),
        run_row("r-2", requester="U-bob", state=RunState.RECOVERING),
        run_row("r-3", requester="U-carol"),
        run_row("r-9", requester="U-dave", channel="C-other"),
        attempt_row(
            "a-1",
            "r-1",
            price=10.0,
            started=utc(14, 10),
            ended=utc(14, 14),
            state=AttemptState.PREEMPTED,
            lost_seconds=1800,
        ),
        attempt_row("a-2", "r-1", number=2, price=10.0, started=utc(14, 14, 30)),
        attempt_row(
            "b-1",
            "r-2",
            price=0.5,
            instances=2,
            started=utc(14, 3),
            ended=utc(14, 5),
            state=AttemptState.PREEMPTED,
            lost_seconds=600,
        ),
        attempt_row("c-1", "r-3", price=None, started=utc(15, 3, 30)),
        attempt_row("d-1", "r-9", price=100.0, started=utc(14, 12), ended=utc(14, 13)),
        SpendRecord(
            attempt_id="c-1",
            run_id="r-3",
            period_start=utc(15, 3, 30),
            period_end=utc(15, 4),
            usd=3.0,
            price_per_hour=6.0,
        ),
        SpendRecord(
            attempt_id="c-1",
            run_id="r-3",
            period_start=utc(15, 4),
            period_end=utc(15, 4, 30),
            usd=3.0,
            price_per_hour=6.0,
        ),
    )
    do_accrue(engine, NOW)  # one record per attempt: the digest must prorate them


def figures(engine: Engine, *, channel: str | None = "C-ml", tz: Any = NEW_YORK) -> dict[str, Any]:
    with Session(engine) as session:
        return digest_figures(session, channel=channel, now=NOW, tz=tz)


def test_digest_figures_for_a_hand_computed_day(db_engine: Engine) -> None:
    digest_scenario(db_engine)
    got = figures(db_engine)
    json.dumps(got)  # JSON-able as it is
    assert (got["date"], got["month"], got["channel"]) == ("2024-05-14", "2024-05", "C-ml")
    assert got["since"] == utc(14, 4).isoformat() and got["until"] == utc(15, 4).isoformat()
    # r-1: 4 h + 13.5 h of attempt 2 at $10/h; r-2: 1 h × 2 × $0.5; r-3: $3.
    assert got["day_usd"] == 179.0
    # Month to date adds r-1's 9 h today, r-2's hour on the 13th, r-3's $3 today.
    assert got["month_to_date_usd"] == 273.0
    assert got["per_run"] == [
        {
            "run_id": "r-1",
            "spec": "gpt-small",
            "requester": "U-alice",
            "state": "RUNNING",
            "usd": 175.0,
            "preemptions": 1,
            "goodput": round(1 - 1800 / 63000, 4),
        },
        {
            "run_id": "r-3",
            "spec": "gpt-small",
            "requester": "U-carol",
            "state": "RUNNING",
            "usd": 3.0,
            "preemptions": 0,
            "goodput": 1.0,
        },
        {
            "run_id": "r-2",
            "spec": "gpt-small",
            "requester": "U-bob",
            "state": "RECOVERING",
            "usd": 1.0,
            "preemptions": 1,
            "goodput": round(1 - 1200 / 7200, 4),
        },
    ]
    assert got["per_user"] == [
        {"user": "U-alice", "usd": 175.0},
        {"user": "U-carol", "usd": 3.0},
        {"user": "U-bob", "usd": 1.0},
    ]
    assert got["preemptions"] == 2
    # Paid instance-seconds 63000 + 7200 + 1800; lost 1800 × 1 + 600 × 2.
    assert got["goodput"] == round(1 - 3000 / 72000, 4)
    assert got["gpu_hours_lost"] == 4.0  # 1800 s × 8 GPUs; the CPU run loses no GPU-hours
    assert got["instance_hours_lost"] == round(3000 / 3600, 3)
    days = {row["date"]: row["usd"] for row in got["per_day"]}
    assert len(days) == 15 and days["2024-05-01"] == 0.0
    assert (days["2024-05-13"], days["2024-05-14"], days["2024-05-15"]) == (1.0, 179.0, 93.0)


def test_digest_days_follow_the_channel_time_zone(db_engine: Engine) -> None:
    digest_scenario(db_engine)
    in_utc = figures(db_engine, tz=timezone.utc)
    # In UTC the 14th is 00:00-24:00Z: r-1 4 h + 9.5 h, r-2 2 h × 2 × $0.5, r-3 nothing.
    assert in_utc["day_usd"] == 137.0
    assert [row["run_id"] for row in in_utc["per_run"]] == ["r-1", "r-2"]
    everyone = figures(db_engine, channel=None)
    assert everyone["day_usd"] == 279.0 and everyone["per_run"][0]["run_id"] == "r-1"
    assert {"user": "U-dave", "usd": 100.0} in everyone["per_user"]


def test_the_digest_of_today_so_far_ends_now(db_engine: Engine) -> None:
    digest_scenario(db_engine)
    with Session(db_engine) as session:
        today = digest_figures(session, channel="C-ml", now=NOW, tz=NEW_YORK, day=date(2024, 5, 15))
        with pytest.raises(TrainbotError, match="2024-05-16 cannot be made before"):
            digest_figures(session, channel="C-ml", now=NOW, tz=NEW_YORK, day=date(2024, 5, 16))
    assert (today["date"], today["day_label"]) == ("2024-05-15", "today so far")
    assert today["since"] == utc(15, 4).isoformat() and today["until"] == NOW.isoformat()
    # r-1's 9 h of attempt 2 at $10/h, r-3's $3 after local midnight.
    assert today["day_usd"] == 93.0
    assert figures(db_engine)["day_label"] == "yesterday"


def test_a_quiet_day_has_zeros_and_no_goodput(db_engine: Engine) -> None:
    got = figures(db_engine)
    assert (got["day_usd"], got["month_to_date_usd"], got["preemptions"]) == (0.0, 0.0, 0)
    assert got["per_run"] == [] and got["goodput"] is None and got["gpu_hours_lost"] == 0.0


def test_spend_report_periods(db_engine: Engine) -> None:
    digest_scenario(db_engine)
    with Session(db_engine) as session:
        day = spend_report(session, channel="C-ml", period="day", now=NOW, tz=NEW_YORK)
        week = spend_report(session, channel="C-ml", period="week", now=NOW, tz=NEW_YORK)
        month = spend_report(session, channel="C-ml", period="month", now=NOW, tz=NEW_YORK)
        with pytest.raises(TrainbotError, match="day`, `week` or `month"):
            spend_report(session, channel="C-ml", period="year", now=NOW, tz=NEW_YORK)
    assert (day["usd"], day["first_date"], len(day["per_day"])) == (93.0, "2024-05-15", 1)
    assert week["first_date"] == "2024-05-13"  # the Monday
    assert week["usd"] == 273.0 and month["usd"] == 273.0
    assert week["preemptions"] == 2 and day["preemptions"] == 0
    json.dumps(month)


def test_chart_is_a_png(db_engine: Engine) -> None:
    digest_scenario(db_engine)
    png = spend_chart_png(figures(db_engine))
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    empty = spend_chart_png({"per_run": [], "per_day": []})
    assert empty.startswith(b"\x89PNG")


# --- budget alerts: the spend job, the one path that raises them ----------------------


def spec_with(**budget: Any) -> dict[str, Any]:
    """A stored spec as submit writes it, with this budget section."""
    spec = JobSpec.model_validate(
        {"name": "gpt-small", "command": ["python", "train.py"], "budget": budget}
    )
    return spec.model_dump(mode="json")


@pytest.fixture
def deps(db_engine: Engine, settings: Settings, tmp_path: Path) -> Iterator[Deps]:
    # The attempts start at T0: accrual adds nothing to the spend.
    with local_deps(settings, db_engine, tmp_path, clock=lambda: T0) as made:
        yield made


def budget_alerts(engine: Engine, run_id: str) -> dict[str, Alert]:
    with Session(engine) as session:
        rows = session.exec(select(Alert).where(Alert.run_id == run_id, Alert.rule == "budget"))
        return {row.key: row for row in rows}


def budgeted_run(engine: Engine, *, budget_usd: float | None, **budget: Any) -> None:
    spec = spec_with(usd=budget_usd, **budget) if budget_usd else spec_with(**budget)
    add(
        engine,
        run_row("r-1", spec=spec, budget_usd=budget_usd),
        attempt_row("a-1", "r-1", price=None),
    )


def test_the_spend_job_does_not_alert_without_a_budget(db_engine: Engine, deps: Deps) -> None:
    budgeted_run(db_engine, budget_usd=None)
    spend(db_engine, "r-1", "a-1", 1e6, T0)
    assert spend_job(deps) == []
    assert budget_alerts(db_engine, "r-1") == {}


def test_the_spend_job_is_quiet_below_the_first_threshold(db_engine: Engine, deps: Deps) -> None:
    budgeted_run(db_engine, budget_usd=800.0)
    spend(db_engine, "r-1", "a-1", 399.99, T0)
    spend_job(deps)
    assert budget_alerts(db_engine, "r-1") == {}


def test_a_budget_alert_has_the_figures(db_engine: Engine, deps: Deps) -> None:
    budgeted_run(db_engine, budget_usd=800.0)
    spend(db_engine, "r-1", "a-1", 656.0, T0)
    spend_job(deps)
    alerts = budget_alerts(db_engine, "r-1")
    assert set(alerts) == {"threshold-50", "threshold-80"}  # a jump reports each it crossed
    alert = alerts["threshold-80"]
    assert alert.severity is Severity.WARNING
    assert "r-1" in alert.title and "82%" in alert.title and "$800.00" in alert.title
    assert "$656.00 spent" in alert.detail
    assert "raise budget.usd" in alert.hint and "hard cap" not in alert.hint


def test_each_budget_threshold_alerts_once_as_spend_rises(db_engine: Engine, deps: Deps) -> None:
    budgeted_run(db_engine, budget_usd=800.0, hard_cap=False)
    first_at: dict[str, float] = {}
    total = 0.0
    for _ in range(40):
        spend(db_engine, "r-1", "a-1", 25.0, T0 + timedelta(minutes=int(total)))
        total += 25.0
        spend_job(deps)
        for key in budget_alerts(db_engine, "r-1"):
            first_at.setdefault(key, total)
    assert first_at == {"threshold-50": 400.0, "threshold-80": 650.0, "threshold-100": 800.0}
    assert all(alert.count == 1 for alert in budget_alerts(db_engine, "r-1").values())


def test_at_100_percent_the_alert_is_critical_and_a_hard_cap_stops_the_run(
    db_engine: Engine, deps: Deps
) -> None:
    budgeted_run(db_engine, budget_usd=800.0, hard_cap=False)
    spend(db_engine, "r-1", "a-1", 800.0, T0)
    assert spend_job(deps) == []
    assert budget_alerts(db_engine, "r-1")["threshold-100"].severity is Severity.CRITICAL

    with session_scope(db_engine) as session:
        run = session.get(Run, "r-1")
        assert run is not None
        run.spec = spec_with(usd=800.0, hard_cap=True)
    spend(db_engine, "r-1", "a-1", 12.0, T0 + timedelta(minutes=5))
    assert spend_job(deps) == ["r-1"]
    with Session(db_engine) as session:
        run = session.get(Run, "r-1")
        assert run is not None and run.state is RunState.BUDGET_EXCEEDED
        assert run.reason == "hard budget cap: $812.00 of $800.00 spent"


def test_a_hard_cap_stops_even_without_a_100_threshold(db_engine: Engine, deps: Deps) -> None:
    budgeted_run(db_engine, budget_usd=100.0, hard_cap=True, thresholds=[50, 80])
    spend(db_engine, "r-1", "a-1", 99.0, T0)
    assert spend_job(deps) == []
    assert set(budget_alerts(db_engine, "r-1")) == {"threshold-50", "threshold-80"}
    spend(db_engine, "r-1", "a-1", 1.0, T0 + timedelta(minutes=5))
    assert spend_job(deps) == ["r-1"]
    alert = budget_alerts(db_engine, "r-1")["threshold-100"]
    assert alert.severity is Severity.CRITICAL and "hard cap stops the run" in alert.hint


def test_a_resubmitted_run_counts_the_spend_it_carries(db_engine: Engine) -> None:
    run = run_row("r-2", spec=spec_with(usd=100.0), budget_usd=100.0)
    run.carried_usd = 90.0  # what the run it resubmits had spent
    add(db_engine, run, attempt_row("a-2", "r-2"))
    spend(db_engine, "r-2", "a-2", 10.0, T0)
    assert spent(db_engine, "r-2") == pytest.approx(100.0)
    status = check(db_engine, T0 + timedelta(minutes=5))[("run", "r-2")]
    assert status.crossed == (50, 80, 100) and status.hard_cap_hit


def test_an_unreadable_stored_budget_falls_back_to_the_defaults(db_engine: Engine) -> None:
    broken = {"budget": {"usd": 10.0, "thresholds": ["half"], "hard_cap": True}}
    add(db_engine, run_row("r-1", spec=broken, budget_usd=10.0), attempt_row("a-1", "r-1"))
    spend(db_engine, "r-1", "a-1", 12.0, T0)
    status = check(db_engine, T0 + timedelta(minutes=5))[("run", "r-1")]
    # The run stays watched at 50/80/100 %; a cap it cannot read is not applied.
    assert status.crossed == (50, 80, 100) and not status.hard_cap_hit
