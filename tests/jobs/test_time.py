"""The scheduled jobs in time: the real APScheduler and the real notifier, freezegun's clock.

The scheduler is the one :func:`jobs.background.scheduler.start_scheduler` builds (its triggers, the
digest's ``CronTrigger`` in ``TRAINBOT_TIMEZONE``, its in-memory job store, its job
defaults). Only its thread is left out: the test plays that thread's loop itself: it
calls ``_process_jobs()`` (what the loop calls on each wakeup), takes the seconds it
returns to the next wakeup, and moves the frozen clock that far. APScheduler reads the
time with ``datetime.now(tz)``, as do the job bodies (``deps.clock``), so freezegun moves
both. The jobs run on APScheduler's own ``DebugExecutor``, in the calling thread, so each
has finished before the clock moves on. Every fire time is the trigger's own answer: a
wrong time zone, a digest twice in the repeated hour or none in the skipped one shows
up as a post at the wrong moment.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from apscheduler.executors.debug import DebugExecutor
from apscheduler.schedulers.base import BaseScheduler
from apscheduler.triggers.cron import CronTrigger
from freezegun import freeze_time
from freezegun.api import FrozenDateTimeFactory
from sqlalchemy import Engine
from sqlmodel import select

from bot.console import ConsoleNotifier
from jobs import alerts
from jobs.background import scheduler as scheduler_module
from jobs.background.scheduler import JOBS, DailyTrigger, start_scheduler
from jobs.database.db import session_scope
from jobs.database.models import Alert, Attempt, Budget, OnCall, Run, SpendRecord
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.domain.severity import Severity
from jobs.outbound.notify import AlertMessage, DigestMessage
from jobs.process.deps import Deps
from jobs.process.settings import load_settings
from jobs.providers.local import LocalProvider
from jobs.rules import Signal
from tests.jobs.test_alerts import ListJournal

NEW_YORK = ZoneInfo("America/New_York")
UTC = timezone.utc


def utc(month: int, day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2024, month, day, hour, minute, tzinfo=UTC)


# --- the harness ----------------------------------------------------------------------


class Clock:
    """A trainbot scheduler, run the way its thread would run it, on freezegun's clock."""

    def __init__(self, deps: Deps, freezer: FrozenDateTimeFactory, *, jobs: set[str]) -> None:
        self.freezer = freezer
        self.scheduler = start_scheduler(deps, token=1, start=False)
        for name in set(JOBS) - jobs:
            self.scheduler.remove_job(name)
        self.scheduler.add_executor(DebugExecutor(), "default")
        # BackgroundScheduler.start() minus its thread: the jobs go to the job store with
        # their first fire times from the real triggers; this test is the loop.
        self.scheduler._event = threading.Event()  # type: ignore[attr-defined]
        BaseScheduler.start(self.scheduler)

    def run_until(self, until: datetime) -> None:
        """Wake up when the scheduler asks to, run what is due, until ``until``."""
        for _ in range(100_000):
            wait = self.scheduler._process_jobs()
            assert wait is not None, "a running scheduler always has a next wakeup"
            wakeup = datetime.now(UTC) + timedelta(seconds=wait)
            if wakeup > until:
                self.freezer.move_to(until)
                return
            self.freezer.move_to(wakeup)
        raise AssertionError(f"the scheduler never got past {datetime.now(UTC)}")

    def close(self) -> None:
        BaseScheduler.shutdown(self.scheduler, wait=False)


@pytest.fixture
def notifier() -> ConsoleNotifier:
    return ConsoleNotifier(io.StringIO())


def make_deps(engine: Engine, tmp_path: Path, notifier: ConsoleNotifier, **env: str) -> Deps:
    settings = load_settings({"TRAINBOT_STATE_DIR": str(tmp_path / "state"), **env})
    return Deps(
        settings=settings,
        engine=engine,
        provider=LocalProvider(tmp_path / "local"),
        notifier=notifier,
        journal=ListJournal(),
    )


@pytest.fixture
def clocked(
    db_engine: Engine, tmp_path: Path, notifier: ConsoleNotifier
) -> Iterator[Callable[..., tuple[Clock, Deps]]]:
    """``clocked(start, jobs, **env)``: freeze time at ``start`` and build the scheduler."""
    made: list[tuple[Any, Clock, Deps]] = []

    def make(start: datetime, jobs: set[str], **env: str) -> tuple[Clock, Deps]:
        frozen = freeze_time(start)
        freezer = frozen.start()
        deps = make_deps(db_engine, tmp_path, notifier, **env)
        clock = Clock(deps, freezer, jobs=jobs)
        made.append((frozen, clock, deps))
        return clock, deps

    yield make
    for frozen, clock, deps in made:
        clock.close()
        deps.close()
        frozen.stop()


def add(engine: Engine, *rows: Any) -> None:
    with session_scope(engine) as session:
        for row in rows:
            session.add(row)
            session.flush()


def run_row(run_id: str, channel: str, *, state: RunState = RunState.SUCCEEDED) -> Run:
    return Run(
        id=run_id,
        spec_name="tiny",
        spec={"name": "tiny", "command": ["x"]},
        requester="U0ALICE",
        channel=channel,
        state=state,
    )


# --- the daily digest -----------------------------------------------------------------


def digest_posts(notifier: ConsoleNotifier) -> list[tuple[str, str]]:
    return [
        (msg.channel, str(msg.figures["date"]))
        for kind, _, msg in notifier.history
        if kind == "post" and isinstance(msg, DigestMessage)
    ]


def watch_digests(notifier: ConsoleNotifier) -> list[tuple[datetime, str]]:
    """(the frozen UTC time, the channel) of each digest as it is posted."""
    seen: list[tuple[datetime, str]] = []

    def listen(kind: str, _ref: Any, msg: Any) -> None:
        if kind == "post" and isinstance(msg, DigestMessage):
            seen.append((datetime.now(UTC), msg.channel))

    notifier.listeners.append(listen)
    return seen


CHANNELS = ("C0ML", "C0VISION")

# 09:00 in New York: EST (UTC-5) before 10 March and after 3 November, EDT (UTC-4) between.
DST_CASES = {
    "spring forward": (
        "09:00", utc(3, 8, 15), utc(3, 12, 0),
        [utc(3, 9, 14), utc(3, 10, 13), utc(3, 11, 13)],
    ),
    "fall back": (
        "09:00", utc(11, 1, 15), utc(11, 5, 0),
        [utc(11, 2, 13), utc(11, 3, 14), utc(11, 4, 14)],
    ),
    # 02:30 does not exist on 10 March: the digest comes at the first moment after the
    # gap that reads past 02:30 (03:30 EDT), once, and at 02:30 EDT the day after.
    "in the skipped hour": (
        "02:30", utc(3, 8, 15), utc(3, 12, 0),
        [utc(3, 9, 7, 30), utc(3, 10, 7, 30), utc(3, 11, 6, 30)],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", DST_CASES)
def test_the_digest_fires_once_a_day_at_its_local_time_across_daylight_saving(
    case: str, db_engine: Engine, clocked: Any, notifier: ConsoleNotifier
) -> None:
    at, start, until, expected = DST_CASES[case]
    add(db_engine, *(run_row(f"r-{c}", c) for c in CHANNELS))
    clock, _ = clocked(
        start, {"digest"}, TRAINBOT_TIMEZONE="America/New_York", TRAINBOT_DIGEST_TIME=at
    )
    seen = watch_digests(notifier)
    clock.run_until(until)

    fired = sorted({when for when, _ in seen})
    assert fired == expected, [f"{t.astimezone(NEW_YORK):%a %d %b %H:%M %Z}" for t in fired]
    assert all(when.astimezone(NEW_YORK).strftime("%H:%M") >= at for when in fired)
    # Once per channel each time: each channel gets one digest per local day, of the day before.
    assert sorted(seen) == sorted((when, c) for when in expected for c in CHANNELS)
    days = [f"{(when.astimezone(NEW_YORK) - timedelta(days=1)):%Y-%m-%d}" for when in expected]
    assert sorted(digest_posts(notifier)) == sorted((c, d) for c in CHANNELS for d in days)


def test_the_digest_fires_once_at_a_time_the_fall_back_repeats(
    db_engine: Engine, tmp_path: Path, notifier: ConsoleNotifier
) -> None:
    """01:30 happens twice on 3 November in New York: the digest comes at the first only.

    Asked of the scheduler's own trigger with real datetimes: freezegun's datetimes drop
    ``fold`` in arithmetic, so under it APScheduler cannot tell the two 01:30s apart (its
    job loop then spins on the first one for ever).
    """
    deps = make_deps(
        db_engine, tmp_path, notifier,
        TRAINBOT_TIMEZONE="America/New_York", TRAINBOT_DIGEST_TIME="01:30",
    )  # fmt: skip
    trigger = start_scheduler(deps, start=False).get_job("digest").trigger
    fires, previous, now = [], None, utc(11, 1, 15)
    while (fire := trigger.get_next_fire_time(previous, now)) < utc(11, 5, 0):
        fires.append(fire.astimezone(UTC))
        previous = now = fire
    deps.close()
    assert fires == [utc(11, 2, 5, 30), utc(11, 3, 5, 30), utc(11, 4, 6, 30)]


def test_the_digest_test_catches_a_scheduler_that_ignores_the_time_zone(
    db_engine: Engine, clocked: Any, notifier: ConsoleNotifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The time-zone handling broken on purpose (the digest's trigger in UTC): the fire
    times the test above expects are not met, so it would fail."""

    def utc_cron(**fields: Any) -> CronTrigger:
        return DailyTrigger(**{**fields, "timezone": "UTC"})

    monkeypatch.setattr(scheduler_module, "DailyTrigger", utc_cron)
    at, start, until, expected = DST_CASES["spring forward"]
    add(db_engine, run_row("r-1", CHANNELS[0]))
    clock, _ = clocked(
        start, {"digest"}, TRAINBOT_TIMEZONE="America/New_York", TRAINBOT_DIGEST_TIME=at
    )
    seen = watch_digests(notifier)
    clock.run_until(until)
    fired = sorted({when for when, _ in seen})
    assert fired == [utc(3, 9, 9), utc(3, 10, 9), utc(3, 11, 9)]  # 09:00 UTC, not New York
    assert fired != expected


# --- escalation and snooze ------------------------------------------------------------

T0 = utc(5, 14, 9)
ESCALATION = {
    "TRAINBOT_ESCALATION_DELAY_S": "900",
    "TRAINBOT_ESCALATION_LEVEL2": "@ml-leads",
    "TRAINBOT_ESCALATION_REPEAT_S": "600",
    "TRAINBOT_ESCALATION_MAX_REPEATS": "2",
}


def open_critical(engine: Engine, deps: Deps) -> str:
    run = run_row("r-1", "C0ML", state=RunState.RUNNING)
    add(engine, run, OnCall(channel="C0ML", user="@ml-oncall", set_by="U0ADMIN"))
    signal = Signal(
        rule="stalled",
        key="heartbeat",
        severity=Severity.CRITICAL,
        title="run r-1 has sent no heartbeat for 10 minutes",
        detail="last heartbeat at step 120",
        hint="check the instance",
    )
    with session_scope(engine) as session:
        [alert] = alerts.process_signals(
            session, run=run, signals=[signal], now=datetime.now(UTC),
            target=alerts.AlertTarget(channel="C0ML", thread_ts=None, oncall_group=None),
            notifier=deps.notifier, journal=deps.journal,
        )  # fmt: skip
        return alert.id


def watch_pages(notifier: ConsoleNotifier) -> list[tuple[float, str]]:
    """(seconds after T0, whom) of each escalation page as it is posted."""
    seen: list[tuple[float, str]] = []

    def listen(kind: str, _ref: Any, msg: Any) -> None:
        if kind == "post" and isinstance(msg, AlertMessage) and msg.escalate_to:
            seen.append(((datetime.now(UTC) - T0).total_seconds(), msg.escalate_to))

    notifier.listeners.append(listen)
    return seen


def test_escalation_pages_level_by_level_and_stops_at_the_acknowledgement(
    db_engine: Engine, clocked: Any, notifier: ConsoleNotifier
) -> None:
    clock, deps = clocked(T0, {"escalation"}, **ESCALATION)
    alert_id = open_critical(db_engine, deps)
    pages = watch_pages(notifier)

    clock.run_until(T0 + timedelta(seconds=899))
    assert pages == [], "nothing before the delay"
    clock.run_until(T0 + timedelta(seconds=1700))
    # The escalation job runs every 60 s from T0: the on-call at the delay, the next
    # level 600 s after.
    assert pages == [(900, "@ml-oncall"), (1500, "@ml-leads")]
    with session_scope(db_engine) as session:
        alerts.acknowledge(
            session, alert_id, user="U0GRACE", now=datetime.now(UTC),
            notifier=deps.notifier, journal=deps.journal,
        )  # fmt: skip
    clock.run_until(T0 + timedelta(hours=3))
    assert pages == [(900, "@ml-oncall"), (1500, "@ml-leads")], "acknowledged: no more pages"


def test_unacknowledged_escalation_repeats_at_the_last_level_up_to_its_cap(
    db_engine: Engine, clocked: Any, notifier: ConsoleNotifier
) -> None:
    clock, deps = clocked(T0, {"escalation"}, **ESCALATION)
    open_critical(db_engine, deps)
    pages = watch_pages(notifier)
    clock.run_until(T0 + timedelta(hours=3))
    assert pages == [
        (900, "@ml-oncall"),
        (1500, "@ml-leads"),
        (2100, "@ml-leads"),
        (2700, "@ml-leads"),
    ]


def test_a_snooze_holds_escalation_and_it_pages_once_the_snooze_expires(
    db_engine: Engine, clocked: Any, notifier: ConsoleNotifier
) -> None:
    clock, deps = clocked(T0, {"escalation"}, **ESCALATION)
    alert_id = open_critical(db_engine, deps)
    pages = watch_pages(notifier)
    clock.run_until(T0 + timedelta(seconds=120))
    with session_scope(db_engine) as session:
        alerts.snooze(
            session, alert_id, user="U0GRACE", seconds=1800, now=datetime.now(UTC),
            notifier=deps.notifier, journal=deps.journal,
        )  # fmt: skip
    clock.run_until(T0 + timedelta(seconds=1919))
    assert pages == [], "snoozed until T0 + 1920 s: the page due at 900 s waits"
    clock.run_until(T0 + timedelta(seconds=1920))
    assert pages == [(1920, "@ml-oncall")], "the snooze expired: the on-call is paged"
    with session_scope(db_engine) as session:
        row = session.get(Alert, alert_id)
        assert row is not None and row.snoozed_until == T0 + timedelta(seconds=1920)


# --- team budgets ---------------------------------------------------------------------


def test_team_budget_thresholds_rearm_at_the_month_boundary(
    db_engine: Engine, clocked: Any, notifier: ConsoleNotifier
) -> None:
    """The spend job every 60 s over the end of January: each threshold alerts once a
    (UTC) month, and again in the next month when spend crosses it again."""
    run = run_row("r-1", "C0ML")
    attempt = Attempt(
        id="a-1", run_id="r-1", number=1, provider="local", price_per_hour=None,
        instances=1, started_at=None, ended_at=None,
        state=AttemptState.TERMINATED,
    )  # fmt: skip
    budget = Budget(scope="team", name="C0ML", usd=100.0, thresholds=[50, 80])
    add(db_engine, run, attempt, budget)
    clock, deps = clocked(utc(1, 31, 22), {"spend"})
    stamps: list[datetime] = []  # when each journal record was made
    journal = deps.journal
    assert isinstance(journal, ListJournal)
    record = journal.record

    def stamped(type: str, run: str | None, /, **data: Any) -> None:
        stamps.append(datetime.now(UTC))
        record(type, run, **data)

    journal.record = stamped  # type: ignore[method-assign]

    def spend(usd: float) -> None:
        now = datetime.now(UTC)
        add(
            db_engine,
            SpendRecord(
                attempt_id="a-1", run_id="r-1", period_start=now - timedelta(minutes=1),
                period_end=now, usd=usd, price_per_hour=usd * 60,
            ),
        )  # fmt: skip

    def thresholds() -> list[tuple[str, int]]:
        """(UTC month, threshold) of each threshold the spend job reported, in order."""
        journal = deps.journal
        assert isinstance(journal, ListJournal)
        return [
            (f"{when:%m}", data["threshold"])
            for (kind, _, data), when in zip(journal.records, stamps, strict=True)
            if kind == "budget_threshold"
        ]

    def budget_messages() -> list[tuple[str, str, int]]:
        """(post or update, message ts, count) of each budget alert the notifier sent."""
        return [
            (kind, ref.ts, msg.count)
            for kind, ref, msg in notifier.history
            if isinstance(msg, AlertMessage) and msg.rule == "budget"
        ]

    spend(55.0)
    clock.run_until(utc(1, 31, 23))
    assert thresholds() == [("01", 50)]
    clock.run_until(utc(2, 1, 1))  # the month turns: re-armed, nothing spent in February yet
    assert thresholds() == [("01", 50)]
    spend(85.0)
    clock.run_until(utc(2, 1, 2))
    assert thresholds() == [("01", 50), ("02", 50), ("02", 80)]
    with session_scope(db_engine) as session:
        [row] = session.exec(select(Budget)).all()
        assert row.alerted == [50, 80]
    # February's 50 % is a repeat of January's alert, still open: its message is updated
    # (count 2), not posted anew; 80 % is a new alert.
    assert budget_messages() == [
        ("post", "000001", 1),
        ("update", "000001", 2),
        ("post", "000002", 1),
    ]
