"""Escalation by levels, as the fake Slack Web API receives it from the real notifier.

An unacknowledged critical alert pages the on-call after the delay, the second level
after a further delay, then that level again up to a cap; each page is a real mention
(``<!subteam^S…>`` resolved from a handle), and nothing pages after the acknowledgement.
Time is an argument: each call says what ``now`` is.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Engine, text

from bot.slack_notifier import SlackNotifier
from jobs.alerts import AlertTarget, acknowledge, escalate_due, process_signals, resolve, snooze
from jobs.background import tasks
from jobs.database.db import alembic_config, migrate, session_scope
from jobs.database.models import Alert, OnCall, Run
from jobs.outbound.notify import AlertMessage
from jobs.process.deps import Deps
from jobs.process.settings import load_settings
from jobs.providers.local import LocalProvider
from tests.bot.test_slack_limits import notifier as notifier  # the fixture, on this fake
from tests.fakes.slack_api import FakeSlack
from tests.jobs.test_alerts import T0, ListJournal, RecordingNotifier, signal, stored

RUNS = "C0RUNS"
ONCALL, LEADS = "<!subteam^S0ONCALL>", "<!subteam^S0LEADS>"


@pytest.fixture
def fake() -> Iterator[FakeSlack]:
    with FakeSlack(post_interval_s=0.01, burst=10, whole_second_retry_after=False) as fake:
        fake.add_usergroup("S0ONCALL", "ml-oncall", ["U0GRACE"])
        fake.add_usergroup("S0LEADS", "ml-leads", ["U0ADA"])
        yield fake


def open_critical(engine: Engine, notifier: Any, journal: ListJournal) -> Alert:
    with session_scope(engine) as session:
        run = Run(
            id="r-1",
            spec_name="tiny",
            spec={"name": "tiny", "command": ["x"]},
            requester="U0ALICE",
            channel=RUNS,
        )
        session.add(run)
    with session_scope(engine) as session:
        [alert] = process_signals(
            session,
            run=run,
            signals=[signal()],
            now=T0,
            target=AlertTarget(channel=RUNS, thread_ts=None, oncall_group=None),
            notifier=notifier,
            journal=journal,
        )
    return alert


def pages(fake: FakeSlack, notifier: SlackNotifier) -> list[str]:
    """The mention each escalation page starts with, in posting order."""
    assert notifier.flush(timeout=10)
    return [m.text.split(" ", 1)[0] for m in fake.messages(RUNS) if "Escalated to" in m.text]


def escalator(
    engine: Engine, notifier: Any, journal: ListJournal, *, level2: str | None = "@ml-leads"
) -> Any:
    def escalate(after_s: float) -> list[str]:
        with session_scope(engine) as session:
            done = escalate_due(
                session,
                now=T0 + timedelta(seconds=after_s),
                delay_s=900,
                notifier=notifier,
                journal=journal,
                oncall_group=lambda _: "@ml-oncall",
                next_level=lambda _: level2,
                repeat_s=600,
                max_repeats=2,
            )
            return [a.id for a in done]

    return escalate


def test_each_level_pages_by_mention_and_the_acknowledgement_stops_it(
    db_engine: Engine, fake: FakeSlack, notifier: SlackNotifier
) -> None:
    journal = ListJournal()
    alert = open_critical(db_engine, notifier, journal)
    escalate = escalator(db_engine, notifier, journal)

    assert escalate(899) == [] and pages(fake, notifier) == []
    assert escalate(900) == [alert.id]
    assert pages(fake, notifier) == [ONCALL], "level 1: the on-call, as a real mention"
    assert escalate(900 + 599) == [] and pages(fake, notifier) == [ONCALL]
    assert escalate(1500) == [alert.id]
    assert pages(fake, notifier) == [ONCALL, LEADS], "level 2 after the further delay"
    assert escalate(2100) == [alert.id]
    assert pages(fake, notifier) == [ONCALL, LEADS, LEADS], "repeated at the last level"
    row = stored(db_engine, alert.id)
    assert (row.escalation_level, row.escalated_at) == (3, T0 + timedelta(seconds=2100))

    with session_scope(db_engine) as session:
        acknowledge(session, alert.id, user="U0GRACE", now=T0 + timedelta(seconds=2200),
                    notifier=notifier, journal=journal)  # fmt: skip
    for after in (2700, 3300, 36_000):
        assert escalate(after) == []
    assert pages(fake, notifier) == [ONCALL, LEADS, LEADS], "nothing after the acknowledgement"
    # The pages are replies under the alert's own message, with the blocks' mention too.
    root, *replies = fake.messages(RUNS)
    assert all(m.thread_ts == root.ts for m in replies if "Escalated to" in m.text)
    escalated = [r for r in journal.records if r[0] == "alert_escalated"]
    assert [(r[2]["group"], r[2].get("level"), r[2].get("page")) for r in escalated] == [
        ("@ml-oncall", None, None),
        ("@ml-leads", 2, 2),
        ("@ml-leads", 2, 3),
    ]


def test_repeats_stop_at_the_cap(
    db_engine: Engine, fake: FakeSlack, notifier: SlackNotifier
) -> None:
    journal = ListJournal()
    alert = open_critical(db_engine, notifier, journal)
    escalate = escalator(db_engine, notifier, journal)
    fired = [after for after in range(900, 10_000, 300) if escalate(after)]
    assert fired == [900, 1500, 2100, 2700], "two levels, then two repeats, then quiet"
    assert pages(fake, notifier) == [ONCALL, LEADS, LEADS, LEADS]
    assert stored(db_engine, alert.id).escalation_level == 4


def test_without_a_second_level_the_oncall_is_paged_again(
    db_engine: Engine, fake: FakeSlack, notifier: SlackNotifier
) -> None:
    journal = ListJournal()
    open_critical(db_engine, notifier, journal)
    escalate = escalator(db_engine, notifier, journal, level2=None)
    fired = [after for after in range(900, 10_000, 300) if escalate(after)]
    assert fired == [900, 1500, 2100]
    assert pages(fake, notifier) == [ONCALL] * 3


def test_snooze_pauses_and_resolution_ends_the_escalation(db_engine: Engine) -> None:
    chat, journal = RecordingNotifier(), ListJournal()
    alert = open_critical(db_engine, chat, journal)
    escalate = escalator(db_engine, chat, journal)
    assert escalate(900) == [alert.id]
    with session_scope(db_engine) as session:
        snooze(session, alert.id, user="U0GRACE", seconds=3600, now=T0 + timedelta(seconds=1000),
               notifier=chat, journal=journal)  # fmt: skip
    assert escalate(1500) == [] and escalate(4599) == []
    assert escalate(4600) == [alert.id], "the snooze expired: the next level is paged"
    with session_scope(db_engine) as session:
        resolve(session, alert.id, user=None, now=T0 + timedelta(seconds=4700),
                notifier=chat, journal=journal)  # fmt: skip
    assert escalate(5200) == [] and escalate(36_000) == []


def test_the_escalation_job_reads_the_levels_from_the_settings(
    db_engine: Engine, tmp_path: Path
) -> None:
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_ESCALATION_DELAY_S": "900",
            "TRAINBOT_ESCALATION_LEVEL2": "@ml-leads",
            "TRAINBOT_ESCALATION_REPEAT_S": "300",
            "TRAINBOT_ESCALATION_MAX_REPEATS": "1",
        }
    )
    provider = LocalProvider(tmp_path / "local")
    chat = RecordingNotifier()
    deps = Deps(
        settings=settings, engine=db_engine, provider=provider, notifier=chat, journal=ListJournal()
    )
    try:
        alert = open_critical(db_engine, chat, ListJournal())
        with session_scope(db_engine) as session:
            session.add(OnCall(channel=RUNS, user="@ml-oncall", set_by="U0ADA"))
        fired = [
            after
            for after in range(0, 3600, 60)
            if tasks.escalation_job(deps, now=T0 + timedelta(seconds=after))
        ]
        assert fired == [900, 1200, 1500]
        sent = [m for _, m in chat.posts if isinstance(m, AlertMessage) and m.escalate_to]
        assert [m.escalate_to for m in sent] == ["@ml-oncall", "@ml-leads", "@ml-leads"]
        assert {m.alert_id for m in sent} == {alert.id}
    finally:
        deps.close()
        provider.close()


def test_migration_0009_counts_an_earlier_escalation_as_one_page(empty_engine: Engine) -> None:
    with empty_engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0008")
        for id_, escalated in (("al-old", "2024-05-14 09:15:00"), ("al-new", None)):
            connection.execute(
                text(
                    "INSERT INTO alerts (id, rule, key, severity, state, title, detail, hint,"
                    " count, first_seen, last_seen, escalated_at, reopened, flaps)"
                    " VALUES (:id, 'r', '', 'CRITICAL', 'OPEN', 't', '', '', 1,"
                    " '2024-05-14 09:00:00', '2024-05-14 09:00:00', :esc, 0, 0)"
                ),
                {"id": id_, "esc": escalated},
            )
    migrate(empty_engine)
    assert stored(empty_engine, "al-old").escalation_level == 1
    assert stored(empty_engine, "al-new").escalation_level == 0
    with empty_engine.begin() as connection:
        command.downgrade(alembic_config(connection), "0008")
