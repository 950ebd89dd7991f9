"""The PagerDuty bridge against a local Events API v2 that answers as PagerDuty does.

An escalated critical alert triggers, an acknowledgement in chat acknowledges and a
resolution resolves, all under the alert id as ``dedup_key``; 429 and 5xx are retried,
400 is not; alerts that never paged send nothing; alert handling never waits on it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine

from jobs.alerts import acknowledge, escalate_due, resolve
from jobs.background import tasks
from jobs.database.db import session_scope
from jobs.database.models import Alert, OnCall
from jobs.outbound.notify import FanoutJournal
from jobs.outbound.pagerduty import EventsClient, PagerDutyBridge, PagerDutyRejected
from jobs.process.bootstrap import ControlPlane, build_pager
from jobs.process.settings import load_settings
from tests.fakes.pagerduty import FakePagerDuty
from tests.jobs.test_alerts import T0, ListJournal, RecordingNotifier
from tests.jobs.test_escalation import RUNS, open_critical


@pytest.fixture
def pd() -> Iterator[FakePagerDuty]:
    with FakePagerDuty() as fake:
        yield fake


@pytest.fixture
def bridge(pd: FakePagerDuty, db_engine: Engine) -> Iterator[PagerDutyBridge]:
    bridge = PagerDutyBridge(
        EventsClient(pd.routing_key, url=pd.url), engine=db_engine, backoff_s=0.01
    )
    yield bridge
    bridge.close(timeout=5)


def escalate(engine: Engine, chat: RecordingNotifier, journal: FanoutJournal) -> list[Alert]:
    with session_scope(engine) as session:
        return escalate_due(
            session,
            now=T0 + timedelta(hours=1),
            delay_s=900,
            notifier=chat,
            journal=journal,
            oncall_group=lambda _: "@ml-oncall",
        )


def test_trigger_acknowledge_resolve_share_one_dedup_key_and_429_is_retried(
    db_engine: Engine, pd: FakePagerDuty, bridge: PagerDutyBridge
) -> None:
    chat, journal = RecordingNotifier(), FanoutJournal(ListJournal(), bridge)
    alert = open_critical(db_engine, chat, journal)
    pd.fail_next(429, times=2)
    assert [a.id for a in escalate(db_engine, chat, journal)] == [alert.id]
    assert bridge.flush(timeout=10)
    with session_scope(db_engine) as session:
        acknowledge(session, alert.id, user="U0GRACE", now=T0 + timedelta(hours=2),
                    notifier=chat, journal=journal)  # fmt: skip
    assert bridge.flush(timeout=10)
    assert pd.incidents == {alert.id: "acknowledged"}
    with session_scope(db_engine) as session:
        resolve(session, alert.id, user="U0GRACE", now=T0 + timedelta(hours=3),
                notifier=chat, journal=journal)  # fmt: skip
    assert bridge.flush(timeout=10)

    assert [(r.status, r.action) for r in pd.received] == [
        (429, "trigger"),
        (429, "trigger"),
        (202, "trigger"),
        (202, "acknowledge"),
        (202, "resolve"),
    ]
    assert {r.dedup_key for r in pd.received} == {alert.id}
    assert pd.incidents == {alert.id: "resolved"}
    trigger = pd.accepted()[0].body
    assert trigger["routing_key"] == pd.routing_key
    payload = trigger["payload"]
    assert payload["severity"] == "critical" and payload["source"] == "trainbot"
    assert "Loss of run r-1 is NaN" in payload["summary"] and "r-1" in payload["summary"]
    assert payload["custom_details"]["acknowledge"] == f"/train ack {alert.id}"
    assert "payload" not in pd.accepted()[1].body, "acknowledge and resolve need no payload"


def test_5xx_is_retried_and_400_is_not(db_engine: Engine, pd: FakePagerDuty) -> None:
    chat = RecordingNotifier()
    bad = PagerDutyBridge(EventsClient("not-the-key", url=pd.url), engine=db_engine, backoff_s=0.01)
    journal = FanoutJournal(ListJournal(), bad)
    alert = open_critical(db_engine, chat, journal)
    pd.fail_next(503)
    escalate(db_engine, chat, journal)
    bad.close(timeout=10)
    assert [(r.status, r.dedup_key) for r in pd.received] == [(503, alert.id), (400, alert.id)]
    with pytest.raises(PagerDutyRejected, match="routing_key"):
        EventsClient("not-the-key", url=pd.url).send("resolve", alert.id)


def test_an_alert_that_never_paged_sends_nothing(
    db_engine: Engine, pd: FakePagerDuty, bridge: PagerDutyBridge
) -> None:
    chat, journal = RecordingNotifier(), FanoutJournal(ListJournal(), bridge)
    alert = open_critical(db_engine, chat, journal)
    with session_scope(db_engine) as session:
        acknowledge(session, alert.id, user="U0GRACE", now=T0, notifier=chat, journal=journal)
        resolve(session, alert.id, user="U0GRACE", now=T0, notifier=chat, journal=journal)
    assert bridge.flush(timeout=10) and pd.received == []


def test_alert_handling_never_waits_for_pagerduty(db_engine: Engine) -> None:
    """PagerDuty unreachable (nothing listens on the port): the escalation still goes out
    at once, and the bridge gives up after its tries without raising."""
    with FakePagerDuty() as gone:
        url = gone.url
    bridge = PagerDutyBridge(
        EventsClient("k", url=url, timeout_s=0.5), engine=db_engine, max_attempts=3,
        backoff_s=0.2,
    )  # fmt: skip
    chat, journal = RecordingNotifier(), FanoutJournal(ListJournal(), bridge)
    alert = open_critical(db_engine, chat, journal)
    started = time.monotonic()
    assert [a.id for a in escalate(db_engine, chat, journal)] == [alert.id]
    assert time.monotonic() - started < 0.2
    assert bridge.flush(timeout=10)
    bridge.close(timeout=1)


def test_the_control_plane_pages_pagerduty_when_the_escalation_job_escalates(
    tmp_path: Path, pd: FakePagerDuty
) -> None:
    env = {"TRAINBOT_STATE_DIR": str(tmp_path / "state"), "TRAINBOT_INGEST_PORT": "0"}
    assert build_pager(load_settings(env), engine=None) is None  # type: ignore[arg-type]
    env |= {"TRAINBOT_PAGERDUTY_ROUTING_KEY": pd.routing_key, "TRAINBOT_PAGERDUTY_URL": pd.url}
    chat = RecordingNotifier()
    cp = ControlPlane(load_settings(env), notifier=chat, scheduler=False)
    try:
        deps = cp.deps
        assert deps.pager is not None
        alert = open_critical(deps.engine, chat, ListJournal())
        with session_scope(deps.engine) as session:
            session.add(OnCall(channel=RUNS, user="@ml-oncall", set_by="U0ADA"))
        assert tasks.escalation_job(deps, now=T0 + timedelta(hours=1)) == [alert.id]
        assert deps.pager.flush(timeout=10)
        assert [(r.action, r.dedup_key) for r in pd.accepted()] == [("trigger", alert.id)]
    finally:
        cp.close()
