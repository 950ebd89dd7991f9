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
from jobs.db import session_scope
from jobs.errors import ConflictError, NotFound, TrainbotError
from jobs.models import Alert, AlertState, Run, Severity
from jobs.notify import AlertMessage, Message, MessageRef
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
