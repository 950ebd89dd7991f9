"""The alert lifecycle on real databases: dedup, updates in place, ack, snooze, escalation."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlmodel import Session, select

from jobs.alerts import (
    AlertTarget,
    acknowledge,
    escalate_due,
    open_alerts,
    process_signals,
    resolve,
    snooze,
)
from jobs.database.db import session_scope
from jobs.database.models import Alert, AlertState, Run
from jobs.domain.errors import ConflictError, NotFound, TrainbotError
from jobs.domain.severity import Severity
from jobs.outbound.notify import AlertMessage, Message, MessageRef
from jobs.rules import Signal

T0 = datetime(2024, 5, 14, 9, 0, tzinfo=timezone.utc)
TARGET = AlertTarget(channel="C-ml", thread_ts="1715677200.000100", oncall_group="S-oncall")


class RecordingNotifier:
    """An in-memory chat: posts get increasing timestamps, updates are recorded."""

    def __init__(self) -> None:
        self.posts: list[tuple[MessageRef, Message]] = []
        self.updates: list[tuple[MessageRef, Message]] = []
        self._lock = threading.Lock()

    def post(self, msg: Message) -> MessageRef:
        with self._lock:
            ref = MessageRef(channel=msg.channel, ts=f"1715680000.{len(self.posts) + 1:06d}")
            self.posts.append((ref, msg))
            return ref

    def update(self, ref: MessageRef, msg: Message) -> None:
        with self._lock:
            self.updates.append((ref, msg))


class ListJournal:
    def __init__(self) -> None:
        self.records: list[tuple[str, str | None, dict[str, Any]]] = []

    def record(self, type: str, run: str | None, /, **data: Any) -> None:
        self.records.append((type, run, data))

    def types(self) -> list[str]:
        return [kind for kind, _, _ in self.records]


def _alert_msg(msg: Message) -> AlertMessage:
    assert isinstance(msg, AlertMessage)
    return msg


def make_run(engine: Engine, run_id: str = "r-1") -> Run:
    with session_scope(engine) as session:
        run = Run(
            id=run_id,
            spec_name="tiny",
            requester="U-alice",
            channel="C-ml",
            thread_ts="1715677200.000100",
        )
        session.add(run)
    return run


def signal(
    rule: str = "divergent_loss",
    key: str = "nan",
    *,
    severity: Severity = Severity.CRITICAL,
    resolved: bool = False,
    title: str = "Loss of run r-1 is NaN",
) -> Signal:
    return Signal(
        rule=rule,
        key=key,
        severity=severity,
        title=title,
        detail="loss nan at step 120",
        hint="Roll back to the last checkpoint and lower the learning rate.",
        resolved=resolved,
    )


def feed(
    engine: Engine,
    run: Run | None,
    signals: list[Signal],
    *,
    now: datetime,
    notifier: RecordingNotifier,
    journal: ListJournal,
    target: AlertTarget = TARGET,
) -> list[Alert]:
    with session_scope(engine) as session:
        return process_signals(
            session,
            run=run,
            signals=signals,
            now=now,
            target=target,
            notifier=notifier,
            journal=journal,
        )


def stored(engine: Engine, alert_id: str) -> Alert:
    with Session(engine) as session:
        alert = session.get(Alert, alert_id)
        assert alert is not None
        return alert


def test_open_repeat_ack_resolve_and_reopen(db_engine: Engine) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()

    [opened] = feed(db_engine, run, [signal()], now=T0, notifier=chat, journal=journal)
    assert opened.state is AlertState.OPEN and opened.severity is Severity.CRITICAL
    assert len(chat.posts) == 1
    ref, msg = chat.posts[0]
    assert msg.channel == "C-ml" and msg.thread_ts == TARGET.thread_ts
    assert _alert_msg(msg).alert_id == opened.id and _alert_msg(msg).state == "OPEN"
    row = stored(db_engine, opened.id)
    assert (row.message_channel, row.message_ts) == (ref.channel, ref.ts)
    assert row.dedupe_key == "r-1|divergent_loss|nan"
    assert journal.records[-1] == (
        "alert_opened",
        "r-1",
        {
            "alert_id": opened.id,
            "rule": "divergent_loss",
            "key": "nan",
            "severity": "CRITICAL",
            "title": "Loss of run r-1 is NaN",
        },
    )

    later = T0 + timedelta(minutes=1)
    [repeat] = feed(db_engine, run, [signal()], now=later, notifier=chat, journal=journal)
    assert repeat.id == opened.id
    row = stored(db_engine, opened.id)
    assert (row.count, row.last_seen, row.first_seen) == (2, later, T0)
    assert len(chat.posts) == 1 and len(chat.updates) == 1
    assert chat.updates[0][0] == ref and _alert_msg(chat.updates[0][1]).count == 2

    acked_at = T0 + timedelta(minutes=2)
    with session_scope(db_engine) as session:
        acked = acknowledge(
            session, opened.id, user="U-bob", now=acked_at, notifier=chat, journal=journal
        )
    assert (acked.state, acked.acked_by, acked.acked_at) == (AlertState.ACKED, "U-bob", acked_at)
    update = _alert_msg(chat.updates[-1][1])
    assert (update.state, update.acked_by) == ("ACKED", "U-bob")
    assert journal.records[-1] == (
        "alert_acknowledged",
        "r-1",
        {"alert_id": opened.id, "user": "U-bob"},
    )

    # Acknowledged: repeats are counted but never posted, and it never escalates.
    feed(db_engine, run, [signal()], now=T0 + timedelta(hours=1), notifier=chat, journal=journal)
    assert stored(db_engine, opened.id).count == 3
    assert len(chat.posts) == 1
    with session_scope(db_engine) as session:
        escalated = escalate_due(
            session,
            now=T0 + timedelta(hours=2),
            delay_s=600,
            notifier=chat,
            journal=journal,
            oncall_group=lambda _: "S-oncall",
        )
    assert escalated == [] and len(chat.posts) == 1

    # A second acknowledgement changes nothing and names the first person.
    before = len(journal.records)
    with session_scope(db_engine) as session:
        again = acknowledge(
            session, opened.id, user="U-carol", now=acked_at, notifier=chat, journal=journal
        )
    assert again.acked_by == "U-bob" and len(journal.records) == before

    resolved_at = T0 + timedelta(hours=3)
    updates_before = len(chat.updates)
    [closed] = feed(
        db_engine, run, [signal(resolved=True)], now=resolved_at, notifier=chat, journal=journal
    )
    row = stored(db_engine, opened.id)
    assert (row.state, row.resolved_at, row.dedupe_key) == (
        AlertState.RESOLVED,
        resolved_at,
        None,
    )
    assert closed.id == opened.id
    assert len(chat.updates) == updates_before + 1
    assert _alert_msg(chat.updates[-1][1]).state == "RESOLVED"
    assert journal.types()[-1] == "alert_resolved"

    # Rules repeat "all clear" every evaluation: nothing happens.
    assert (
        feed(
            db_engine, run, [signal(resolved=True)], now=resolved_at, notifier=chat, journal=journal
        )
        == []
    )
    assert len(chat.updates) == updates_before + 1 and journal.types()[-1] == "alert_resolved"

    [fresh] = feed(
        db_engine, run, [signal()], now=T0 + timedelta(hours=4), notifier=chat, journal=journal
    )
    assert fresh.id != opened.id and fresh.count == 1 and fresh.state is AlertState.OPEN
    assert len(chat.posts) == 2

    with (
        session_scope(db_engine) as session,
        pytest.raises(ConflictError, match="already resolved"),
    ):
        acknowledge(
            session, opened.id, user="U-bob", now=resolved_at, notifier=chat, journal=journal
        )


def test_severity_increase_updates_in_place_and_never_drops(db_engine: Engine) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    warn = signal("disk", "usage", severity=Severity.WARNING, title="Disk 92% full")
    crit = signal("disk", "usage", severity=Severity.CRITICAL, title="Disk 98% full")
    [alert] = feed(db_engine, run, [warn], now=T0, notifier=chat, journal=journal)
    assert alert.severity is Severity.WARNING
    feed(db_engine, run, [crit], now=T0 + timedelta(minutes=1), notifier=chat, journal=journal)
    row = stored(db_engine, alert.id)
    assert (row.severity, row.title) == (Severity.CRITICAL, "Disk 98% full")
    assert len(chat.posts) == 1
    assert _alert_msg(chat.updates[-1][1]).severity == "CRITICAL"
    feed(db_engine, run, [warn], now=T0 + timedelta(minutes=2), notifier=chat, journal=journal)
    assert stored(db_engine, alert.id).severity is Severity.CRITICAL


def test_repeats_within_one_batch_make_one_alert(db_engine: Engine) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    touched = feed(
        db_engine,
        run,
        [signal(), signal(), signal("disk", "usage")],
        now=T0,
        notifier=chat,
        journal=journal,
    )
    assert len(touched) == 2
    assert stored(db_engine, touched[0].id).count == 2
    assert len(chat.posts) == 2 and len(chat.updates) == 1
    assert journal.types() == ["alert_opened", "alert_opened"]


def test_snooze_suppresses_notifications_until_it_expires(db_engine: Engine) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    [alert] = feed(db_engine, run, [signal()], now=T0, notifier=chat, journal=journal)
    with session_scope(db_engine) as session:
        snoozed = snooze(
            session, alert.id, user="U-bob", seconds=3600, now=T0, notifier=chat, journal=journal
        )
    until = T0 + timedelta(hours=1)
    assert snoozed.snoozed_until == until and snoozed.state is AlertState.OPEN
    assert journal.records[-1] == (
        "alert_snoozed",
        "r-1",
        {"alert_id": alert.id, "user": "U-bob", "until": until.isoformat()},
    )
    assert _alert_msg(chat.updates[-1][1]).snoozed_until == until
    posts, updates = len(chat.posts), len(chat.updates)

    for minutes in (10, 20, 30):
        feed(
            db_engine,
            run,
            [signal()],
            now=T0 + timedelta(minutes=minutes),
            notifier=chat,
            journal=journal,
        )
    assert stored(db_engine, alert.id).count == 4
    with session_scope(db_engine) as session:
        assert (
            escalate_due(
                session,
                now=T0 + timedelta(minutes=59),
                delay_s=600,
                notifier=chat,
                journal=journal,
                oncall_group=lambda _: "S-oncall",
            )
            == []
        )
    assert (len(chat.posts), len(chat.updates)) == (posts, updates)

    feed(db_engine, run, [signal()], now=until, notifier=chat, journal=journal)
    assert len(chat.posts) == posts and len(chat.updates) == updates + 1
    assert _alert_msg(chat.updates[-1][1]).count == 5
    with session_scope(db_engine) as session:
        woke = escalate_due(
            session,
            now=until,
            delay_s=600,
            notifier=chat,
            journal=journal,
            oncall_group=lambda _: "S-oncall",
        )
    assert [a.id for a in woke] == [alert.id]


def test_unacknowledged_critical_escalates_once_after_the_delay(db_engine: Engine) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    [crit, warn, acked] = feed(
        db_engine,
        run,
        [
            signal("lost_heartbeat", "heartbeat"),
            signal("disk", "usage", severity=Severity.WARNING),
            signal("divergent_loss", "nan"),
        ],
        now=T0,
        notifier=chat,
        journal=journal,
    )
    with session_scope(db_engine) as session:
        acknowledge(session, acked.id, user="U-bob", now=T0, notifier=chat, journal=journal)
    asked: list[str] = []

    def group(alert: Alert) -> str | None:
        asked.append(alert.id)
        return "S-oncall"

    def escalate(now: datetime) -> list[Alert]:
        with session_scope(db_engine) as session:
            return escalate_due(
                session, now=now, delay_s=900, notifier=chat, journal=journal, oncall_group=group
            )

    posts = len(chat.posts)
    assert escalate(T0 + timedelta(seconds=899)) == [] and len(chat.posts) == posts
    [escalated] = escalate(T0 + timedelta(seconds=900))
    assert escalated.id == crit.id and asked == [crit.id]
    assert stored(db_engine, crit.id).escalated_at == T0 + timedelta(seconds=900)
    page = _alert_msg(chat.posts[-1][1])
    assert (page.escalate_to, page.alert_id, page.thread_ts, page.channel) == (
        "S-oncall",
        crit.id,
        TARGET.thread_ts,
        "C-ml",
    )
    assert journal.records[-1] == (
        "alert_escalated",
        "r-1",
        {"alert_id": crit.id, "group": "S-oncall"},
    )
    assert escalate(T0 + timedelta(hours=5)) == []
    assert len(chat.posts) == posts + 1 and warn.id not in asked


def test_no_oncall_group_means_no_escalation_yet(db_engine: Engine) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    [alert] = feed(db_engine, run, [signal()], now=T0, notifier=chat, journal=journal)
    with session_scope(db_engine) as session:
        none = escalate_due(
            session,
            now=T0 + timedelta(hours=1),
            delay_s=60,
            notifier=chat,
            journal=journal,
            oncall_group=lambda _: None,
        )
    assert none == [] and stored(db_engine, alert.id).escalated_at is None


def test_team_alert_without_a_run_threads_its_escalation_under_itself(db_engine: Engine) -> None:
    chat, journal = RecordingNotifier(), ListJournal()
    team = AlertTarget(channel="C-ml", thread_ts=None, oncall_group="S-oncall")
    budget = signal("budget", "team-C-ml-100", title="Team C-ml has spent 100% of its budget")
    [alert] = feed(db_engine, None, [budget], now=T0, notifier=chat, journal=journal, target=team)
    assert alert.run_id is None and chat.posts[0][1].thread_ts is None
    assert journal.records[-1][1] is None
    with session_scope(db_engine) as session:
        [escalated] = escalate_due(
            session,
            now=T0 + timedelta(hours=1),
            delay_s=60,
            notifier=chat,
            journal=journal,
            oncall_group=lambda _: "S-oncall",
        )
    assert escalated.id == alert.id
    assert chat.posts[-1][1].thread_ts == chat.posts[0][0].ts
    assert _alert_msg(chat.posts[-1][1]).escalate_to == "S-oncall"


def test_unknown_and_resolved_alerts_give_clear_errors(db_engine: Engine) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    for action in (acknowledge, snooze, resolve):
        kwargs: dict[str, Any] = {"seconds": 60} if action is snooze else {}
        with session_scope(db_engine) as session, pytest.raises(NotFound, match="/train status"):
            action(
                session, "al-nope", user="U-bob", now=T0, notifier=chat, journal=journal, **kwargs
            )
    [alert] = feed(db_engine, run, [signal()], now=T0, notifier=chat, journal=journal)
    with session_scope(db_engine) as session, pytest.raises(TrainbotError, match="positive"):
        snooze(session, alert.id, user="U-bob", seconds=0, now=T0, notifier=chat, journal=journal)
    with session_scope(db_engine) as session:
        done = resolve(session, alert.id, user="U-bob", now=T0, notifier=chat, journal=journal)
    assert done.state is AlertState.RESOLVED
    assert journal.records[-1] == ("alert_resolved", "r-1", {"alert_id": alert.id, "user": "U-bob"})
    with session_scope(db_engine) as session:
        again = resolve(session, alert.id, user="U-carol", now=T0, notifier=chat, journal=journal)
    assert again.resolved_at == T0 and journal.types().count("alert_resolved") == 1
    with (
        session_scope(db_engine) as session,
        pytest.raises(ConflictError, match="nothing to snooze"),
    ):
        snooze(session, alert.id, user="U-bob", seconds=60, now=T0, notifier=chat, journal=journal)


def test_open_alerts_lists_unresolved_alerts_per_run(db_engine: Engine) -> None:
    first, second = make_run(db_engine, "r-1"), make_run(db_engine, "r-2")
    chat, journal = RecordingNotifier(), ListJournal()
    [a] = feed(db_engine, first, [signal()], now=T0, notifier=chat, journal=journal)
    [b] = feed(
        db_engine, second, [signal()], now=T0 + timedelta(seconds=1), notifier=chat, journal=journal
    )
    [c] = feed(
        db_engine,
        second,
        [signal("disk", "usage")],
        now=T0 + timedelta(seconds=2),
        notifier=chat,
        journal=journal,
    )
    with session_scope(db_engine) as session:
        acknowledge(session, b.id, user="U-bob", now=T0, notifier=chat, journal=journal)
        resolve(session, c.id, user=None, now=T0, notifier=chat, journal=journal)
    with Session(db_engine) as session:
        assert [x.id for x in open_alerts(session)] == [a.id, b.id]
        assert [x.id for x in open_alerts(session, run_id="r-2")] == [b.id]


def _wait_for_lock_wait(engine: Engine, thread: threading.Thread) -> None:
    """Wait until the other session is blocked on the first one's uncommitted insert."""
    deadline = time.monotonic() + 10
    if engine.dialect.name != "postgresql":
        # SQLite: the second BEGIN IMMEDIATE waits for the first transaction; give it
        # a moment to get there (nothing to poll).
        time.sleep(0.2)
        return
    with engine.connect() as connection:
        while time.monotonic() < deadline and thread.is_alive():
            waiting = connection.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
            ).scalar_one()
            if waiting:
                return
            connection.rollback()
            time.sleep(0.02)
    raise AssertionError("the second session never blocked on the first one's insert")


def test_two_sessions_racing_to_open_the_same_alert_end_with_one(db_engine: Engine) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    first = Session(db_engine, expire_on_commit=False)
    [winner] = process_signals(
        first, run=run, signals=[signal()], now=T0, target=TARGET, notifier=chat, journal=journal
    )
    outcome: dict[str, Any] = {}

    def second() -> None:
        try:
            outcome["alerts"] = feed(
                db_engine,
                run,
                [signal()],
                now=T0 + timedelta(seconds=1),
                notifier=chat,
                journal=journal,
            )
        except BaseException as exc:  # asserted on below
            outcome["error"] = exc

    thread = threading.Thread(target=second)
    thread.start()
    try:
        _wait_for_lock_wait(db_engine, thread)
        first.commit()
    finally:
        first.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    [loser] = outcome["alerts"]
    assert loser.id == winner.id and loser.count == 2
    with Session(db_engine) as session:
        rows = session.exec(select(Alert)).all()
    assert [(r.id, r.count) for r in rows] == [(winner.id, 2)]
    assert len(chat.posts) == 1 and len(chat.updates) == 1
    assert journal.types() == ["alert_opened"]


# --- one problem, one alert -----------------------------------------------------------


def divergence(key: str, *, resolved: bool = False, began: int | None = None) -> Signal:
    """A member of the divergent-loss incident, as jobs.rules.loss sends it."""
    return Signal(
        rule="divergent_loss",
        key=key,
        severity=Severity.CRITICAL if key != "trend" else Severity.WARNING,
        title=f"Loss {key} in run r-1",
        detail=f"{key} figures",
        hint="Lower the learning rate.",
        resolved=resolved,
        incident="divergence",
        stop_after_s=None if resolved else (0.0 if key == "nan" else 1800.0),
        began_step=None if resolved else began,
    )


def test_a_rule_firing_again_within_the_quiet_period_reopens_the_same_alert(
    db_engine: Engine,
) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    [first] = feed(db_engine, run, [signal()], now=T0, notifier=chat, journal=journal)
    with session_scope(db_engine) as session:
        acknowledge(session, first.id, user="U-bob", now=T0, notifier=chat, journal=journal)
    feed(db_engine, run, [signal(resolved=True)], now=T0 + timedelta(minutes=1),
         notifier=chat, journal=journal)  # fmt: skip

    # Ten minutes later (the quiet period is 15): the same alert, the same message.
    [again] = feed(
        db_engine, run, [signal()], now=T0 + timedelta(minutes=11), notifier=chat, journal=journal
    )
    assert again.id == first.id
    row = stored(db_engine, first.id)
    assert (row.state, row.count, row.reopened, row.resolved_at) == (AlertState.OPEN, 2, 1, None)
    assert row.acked_by is None  # it came back: somebody has to look again
    assert row.dedupe_key == "r-1|divergent_loss|nan"
    assert len(chat.posts) == 1
    assert _alert_msg(chat.updates[-1][1]).count == 2
    assert _alert_msg(chat.updates[-1][1]).state == "OPEN"
    assert journal.types().count("alert_opened") == 1
    assert journal.records[-1][0] == "alert_reopened"
    assert journal.records[-1][2]["alert_id"] == first.id

    # Resolved for longer than the quiet period: a new problem, a new alert.
    feed(db_engine, run, [signal(resolved=True)], now=T0 + timedelta(minutes=12),
         notifier=chat, journal=journal)  # fmt: skip
    [fresh] = feed(
        db_engine, run, [signal()], now=T0 + timedelta(minutes=40), notifier=chat, journal=journal
    )
    assert fresh.id != first.id and fresh.count == 1 and fresh.reopened == 0
    assert len(chat.posts) == 2 and journal.types().count("alert_opened") == 2


def test_the_quiet_period_comes_from_the_runs_spec(db_engine: Engine) -> None:
    with session_scope(db_engine) as session:
        run = Run(
            id="r-q", spec_name="tiny", spec={"alerts": {"quiet_period": "0s"}},
            requester="U-alice", channel="C-ml", thread_ts="1715677200.000100",
        )  # fmt: skip
        session.add(run)
    chat, journal = RecordingNotifier(), ListJournal()
    [first] = feed(db_engine, run, [signal()], now=T0, notifier=chat, journal=journal)
    feed(db_engine, run, [signal(resolved=True)], now=T0, notifier=chat, journal=journal)
    [second] = feed(
        db_engine, run, [signal()], now=T0 + timedelta(seconds=1), notifier=chat, journal=journal
    )
    assert second.id != first.id


def test_a_spike_and_a_rising_trend_are_one_incident(db_engine: Engine) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    [alert] = feed(
        db_engine, run, [divergence("spike", began=40), divergence("trend", resolved=True)],
        now=T0, notifier=chat, journal=journal,
    )  # fmt: skip
    assert alert.key == "divergence" and alert.began_step == 40
    # The trend joins it; the spike clearing in the same evaluation resolves nothing.
    later = T0 + timedelta(minutes=1)
    [same] = feed(
        db_engine, run, [divergence("spike", resolved=True), divergence("trend", began=30)],
        now=later, notifier=chat, journal=journal,
    )  # fmt: skip
    assert same.id == alert.id
    row = stored(db_engine, alert.id)
    assert row.state is AlertState.OPEN and row.severity is Severity.CRITICAL
    assert row.began_step == 30  # the earlier of the two
    assert "Loss spike in run r-1: spike figures (cleared)" in row.detail
    assert "Loss trend in run r-1: trend figures" in row.detail
    assert row.title == "Loss trend in run r-1"  # what still fires leads
    assert len(chat.posts) == 1 and journal.types().count("alert_opened") == 1
    assert journal.records[0][2]["member"] == "spike"
    # "All clear" from a member that is not firing changes nothing and posts nothing.
    updates = len(chat.updates)
    feed(db_engine, run, [divergence("spike", resolved=True)], now=later,
         notifier=chat, journal=journal)  # fmt: skip
    assert len(chat.updates) == updates
    # All members clear: the incident resolves.
    [done] = feed(db_engine, run, [divergence("trend", resolved=True)],
                  now=T0 + timedelta(minutes=2), notifier=chat, journal=journal)  # fmt: skip
    assert done.id == alert.id and stored(db_engine, alert.id).state is AlertState.RESOLVED


def test_flapping_is_said_once_not_repeated(db_engine: Engine) -> None:
    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    now = T0
    [alert] = feed(db_engine, run, [signal()], now=now, notifier=chat, journal=journal)
    for _ in range(6):
        now += timedelta(minutes=1)
        feed(db_engine, run, [signal(resolved=True)], now=now, notifier=chat, journal=journal)
        now += timedelta(minutes=1)
        [again] = feed(db_engine, run, [signal()], now=now, notifier=chat, journal=journal)
        assert again.id == alert.id
    assert len(chat.posts) == 1 and journal.types().count("alert_opened") == 1
    assert journal.types().count("alert_flapping") == 1
    flapping = [data for kind, _, data in journal.records if kind == "alert_flapping"]
    assert flapping == [{"alert_id": alert.id, "times": 4}]
    row = stored(db_engine, alert.id)
    assert row.reopened == 6
    assert "flapping: 6 times in 10 min" in row.detail
    assert "flapping" in _alert_msg(chat.updates[-1][1]).detail


def test_a_divergence_is_due_to_stop_unless_acknowledged_and_nan_stops_at_once(
    db_engine: Engine,
) -> None:
    from jobs.alerts import stops_due

    run = make_run(db_engine)
    chat, journal = RecordingNotifier(), ListJournal()
    [alert] = feed(db_engine, run, [divergence("spike", began=40)], now=T0,
                   notifier=chat, journal=journal)  # fmt: skip
    with session_scope(db_engine) as session:
        assert stops_due(session, now=T0 + timedelta(minutes=29)) == []
        assert [a.id for a in stops_due(session, now=T0 + timedelta(minutes=30))] == [alert.id]
    with session_scope(db_engine) as session:
        acknowledge(session, alert.id, user="U-bob", now=T0 + timedelta(minutes=5),
                    notifier=chat, journal=journal)  # fmt: skip
    with session_scope(db_engine) as session:
        assert stops_due(session, now=T0 + timedelta(hours=2)) == []
    # A NaN joins the acknowledged incident and stops the run at once all the same.
    feed(db_engine, run, [divergence("nan", began=55)], now=T0 + timedelta(hours=1),
         notifier=chat, journal=journal)  # fmt: skip
    with session_scope(db_engine) as session:
        assert [a.id for a in stops_due(session, now=T0 + timedelta(hours=1))] == [alert.id]


# --- trainbot stops a diverging run ---------------------------------------------------


@pytest.fixture
def stop_deps(db_engine: Engine, settings: Any, tmp_path: Any) -> Any:
    from jobs.process.deps import Deps
    from jobs.providers.local import LocalProvider

    provider = LocalProvider(tmp_path / "local")
    deps = Deps(
        settings=settings,
        engine=db_engine,
        provider=provider,
        notifier=RecordingNotifier(),
        journal=ListJournal(),
    )
    yield deps
    deps.close()
    provider.close()


def running_run(engine: Engine, *, spec: dict[str, Any] | None = None) -> Run:
    """A running run with one live attempt and checkpoints at steps 10, 30, 50 and 70."""
    from jobs.database.models import Attempt, Checkpoint
    from jobs.domain.lifecycle import AttemptState, RunState

    with session_scope(engine) as session:
        run = Run(
            id="r-1", spec_name="tiny", spec=spec or {"name": "tiny", "command": ["x"]},
            requester="U-alice", channel="C-ml", thread_ts="1715677200.000100",
            state=RunState.RUNNING, last_committed_step=70,
        )  # fmt: skip
        session.add(run)
        session.flush()
        session.add(
            Attempt(id="a-1", run_id="r-1", number=1, provider="local", state=AttemptState.RUNNING)
        )
        for step in (10, 30, 50, 70):
            session.add(
                Checkpoint(run_id="r-1", step=step, uri=f"file:///ckpt/{step}", committed_at=T0)
            )
    return run


def _run_and_attempt(engine: Engine) -> tuple[Run, Any]:
    from jobs.database.models import Attempt

    with Session(engine) as session:
        run, attempt = session.get(Run, "r-1"), session.get(Attempt, "a-1")
        assert run is not None and attempt is not None
        return run, attempt


def test_a_nan_loss_stops_the_run_and_offers_the_checkpoint_before_it(stop_deps: Any) -> None:
    from jobs.background import tasks
    from jobs.domain.lifecycle import AttemptState, RunState

    deps = stop_deps
    run = running_run(deps.engine)
    [alert] = feed(deps.engine, run, [divergence("nan", began=55)], now=T0,
                   notifier=deps.notifier, journal=deps.journal)  # fmt: skip
    assert tasks.stop_diverged(deps, now=T0) == ["r-1"]

    run, attempt = _run_and_attempt(deps.engine)
    assert run.state is RunState.STOPPED
    assert run.reason is not None and run.reason.startswith("stopped by trainbot")
    assert "not finite" in run.reason
    # The runner is told to stop as for /train stop: it flushes, then the attempt ends.
    assert attempt.state is AttemptState.TERMINATED
    row = stored(deps.engine, alert.id)
    assert (row.resume_step, row.stopped_at, row.stop_at) == (50, T0, None)
    assert "Resubmit from step 50" in row.hint
    shown = [m for _, m in deps.notifier.updates if isinstance(m, AlertMessage)]
    assert "Resubmit from step 50" in shown[-1].hint
    finished = [d for kind, _, d in deps.journal.records if kind == "run_finished"]
    assert finished[0]["by"] == "trainbot" and finished[0]["resume_step"] == 50
    # Retention keeps the checkpoint it offers while the alert is open.
    with Session(deps.engine) as session:
        assert tasks._protected_steps(session, "r-1") == {50}
    # Done once: the next check finds nothing to stop.
    assert tasks.stop_diverged(deps, now=T0 + timedelta(minutes=1)) == []


def test_an_unacknowledged_divergence_stops_after_stop_after(stop_deps: Any) -> None:
    from jobs.background import tasks
    from jobs.domain.lifecycle import RunState

    deps = stop_deps
    run = running_run(deps.engine)
    feed(deps.engine, run, [divergence("spike", began=31)], now=T0,
         notifier=deps.notifier, journal=deps.journal)  # fmt: skip
    assert tasks.stop_diverged(deps, now=T0 + timedelta(minutes=29)) == []
    assert tasks.escalation_job(deps, now=T0 + timedelta(minutes=30)) is not None
    run, _ = _run_and_attempt(deps.engine)
    assert run.state is RunState.STOPPED and "nobody acknowledged" in (run.reason or "")
    with Session(deps.engine) as session:  # closed: PostgreSQL drops the schema after
        [alert] = open_alerts(session, run_id="r-1")
        assert alert.resume_step == 30


def test_an_alert_that_stopped_its_run_stays_open_through_the_runs_last_points(
    stop_deps: Any,
) -> None:
    """The stopped run's flush sends a few more losses; one back near the baseline used to
    resolve the alert, so the person's /train ack found nothing to acknowledge, and its
    resubmit offer's checkpoint lost its protection."""
    from jobs.background import tasks

    deps = stop_deps
    run = running_run(deps.engine)
    [alert] = feed(deps.engine, run, [divergence("spike", began=31)], now=T0,
                   notifier=deps.notifier, journal=deps.journal)  # fmt: skip
    assert tasks.stop_diverged(deps, now=T0 + timedelta(minutes=31)) == ["r-1"]
    later = T0 + timedelta(minutes=32)
    feed(deps.engine, run, [divergence("spike", resolved=True)], now=later,
         notifier=deps.notifier, journal=deps.journal)  # fmt: skip
    with Session(deps.engine) as session:
        assert [a.id for a in open_alerts(session, run_id="r-1")] == [alert.id]
        assert tasks._protected_steps(session, "r-1") == {30}
    with session_scope(deps.engine) as session:
        acked = acknowledge(session, alert.id, user="U-bob", now=later,
                            notifier=deps.notifier, journal=deps.journal)  # fmt: skip
        assert acked.state is AlertState.ACKED


def test_an_acknowledged_divergence_keeps_running(stop_deps: Any) -> None:
    from jobs.background import tasks
    from jobs.domain.lifecycle import RunState

    deps = stop_deps
    run = running_run(deps.engine)
    [alert] = feed(deps.engine, run, [divergence("spike", began=31)], now=T0,
                   notifier=deps.notifier, journal=deps.journal)  # fmt: skip
    with session_scope(deps.engine) as session:
        acknowledge(session, alert.id, user="U-bob", now=T0 + timedelta(minutes=1),
                    notifier=deps.notifier, journal=deps.journal)  # fmt: skip
    assert tasks.stop_diverged(deps, now=T0 + timedelta(hours=3)) == []
    assert _run_and_attempt(deps.engine)[0].state is RunState.RUNNING


def test_on_nan_alert_only_alerts(stop_deps: Any) -> None:
    from jobs.background import tasks
    from jobs.domain.lifecycle import RunState
    from jobs.rules.loss import DivergentLoss
    from jobs.spec import AlertThresholds

    deps = stop_deps
    run = running_run(deps.engine)
    rule = DivergentLoss(AlertThresholds(on_nan="alert"))
    from jobs.rules import Obs, RunContext

    ctx = RunContext(run_id="r-1", last_heartbeat=None, preemption_times=(), attempt_number=1,
                     last_committed_step=70, current_step=80)  # fmt: skip
    window = [Obs(float(i), "metrics", {"step": i, "loss": "NaN"}) for i in range(3)]
    signals = rule.evaluate(window, now=10.0, ctx=ctx)
    feed(deps.engine, run, signals, now=T0, notifier=deps.notifier, journal=deps.journal)
    assert tasks.stop_diverged(deps, now=T0 + timedelta(days=1)) == []
    assert _run_and_attempt(deps.engine)[0].state is RunState.RUNNING
