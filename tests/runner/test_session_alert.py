"""``session.alert`` (issue 27, point 6): from the training code to an alert in Slack that
someone acknowledges.

The real session makes the event, the real wire carries it (encoded and decoded), the
real ingest service (``jobs.process.bootstrap.build_ingest``) stores it and raises the alert
through the same lifecycle as the built-in rules, and the real Slack notifier posts it to
the fake Slack Web API.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from bot.slack_notifier import SlackNotifier
from jobs import alerts
from jobs.database.db import session_scope
from jobs.database.models import Alert
from jobs.ingest import IngestService
from jobs.process.bootstrap import build_ingest
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.providers.local import LocalProvider
from runner.errors import RunnerError
from runner.session import Session, SessionConfig
from runner.wire import Event, encode_batch
from runner.wire.schema import ALERT_TITLE_MAX
from tests.fakes.slack_api import FakeSlack
from tests.jobs import conftest as jobs_fixtures
from tests.jobs import test_escalation
from tests.jobs.local_plane import Clock
from tests.jobs.test_alerts import ListJournal
from tests.jobs.test_rule_triggers import TOKEN, running_attempt
from tests.runner.stand_ins import Recorder

# The escalation tests' fake Slack Web API (with the on-call groups) and real notifier,
# and the control plane's database (SQLite, or PostgreSQL where the tests have one).
fake = test_escalation.fake
notifier = test_escalation.notifier
settings = jobs_fixtures.settings

NOW = datetime(2026, 12, 6, 9, 0, tzinfo=UTC)


@pytest.fixture
def deps(
    settings: Settings, db_engine: Engine, tmp_path: Path, notifier: SlackNotifier
) -> Iterator[Deps]:
    made = Deps(
        settings=settings,
        engine=db_engine,
        provider=LocalProvider(tmp_path / "local"),
        notifier=notifier,
        clock=Clock(NOW),
    )
    yield made
    made.close()


def script_session(tmp_path: Path, run_id: str) -> tuple[Session, Recorder]:
    sink = Recorder()
    config = SessionConfig(checkpoint_uri=str(tmp_path / "ck"), run_id=run_id)
    return Session(config, sink=sink, install_signals=False, prefetch=False), sink


def deliver(ingest: IngestService, run_id: str, attempt_id: str, sink: Recorder) -> Any:
    """The session's events as one batch on the wire, as its runner sends them."""
    t0 = NOW.timestamp()
    batch = [
        Event(attempt_id, seq, kind, t0 + seq, run_id, data)
        for seq, (kind, data) in enumerate(sink.events)
    ]
    result = ingest.handle(f"Bearer {TOKEN}", encode_batch(batch))
    assert result.status == 200, result.body
    return result.body


def script_alerts(deps: Deps, run_id: str) -> list[Alert]:
    with session_scope(deps.engine) as session:
        found = [a for a in alerts.open_alerts(session, run_id=run_id) if a.rule == "script_alert"]
        for alert in found:
            session.expunge(alert)
        return found


def test_a_scripts_alert_reaches_slack_and_is_acknowledged(
    deps: Deps, fake: FakeSlack, notifier: SlackNotifier, tmp_path: Path
) -> None:
    run_id, attempt_id = running_attempt(deps)
    ingest = build_ingest(deps)
    session, sink = script_session(tmp_path, run_id)
    session.step = 120
    assert session.alert(
        "val_loss stopped improving", "no better in 3 evals: <lr> & <wd>", "critical"
    )
    # A loop that alerts every step sends one per minute (wait_s), unless told otherwise.
    assert not session.alert("val_loss stopped improving", "again", "critical")
    assert session.alert("val_loss stopped improving", "still no better after 4 evals: <lr>",
                         "critical", wait_s=0)  # fmt: skip
    assert deliver(ingest, run_id, attempt_id, sink) == {"accepted": 2, "duplicates": 0}

    # One alert per title: the repeat updates it.
    [alert] = script_alerts(deps, run_id)
    assert (alert.severity, alert.state, alert.count) == ("CRITICAL", "OPEN", 2)
    assert alert.title == f"val_loss stopped improving (run {run_id} at step 120)"
    assert alert.detail == "still no better after 4 evals: <lr>"
    assert notifier.flush(timeout=10)
    [posted] = [m for m in fake.messages("C1") if "val_loss stopped improving" in m.text]
    shown = str(posted.blocks)
    assert "still no better after 4 evals: &lt;lr&gt;" in shown and "script_alert" in shown
    # The post and its update are queued by one request: the notifier sends the first
    # content and then the edit, or (its worker not scheduled in between, as on a loaded
    # machine) only the newest content. Whichever reached Slack is escaped.
    for version in [*(str(blocks) for _, blocks in posted.edits), shown]:
        assert "&lt;lr&gt;" in version and "<lr>" not in version
    if posted.edits:
        assert "&lt;lr&gt; &amp; &lt;wd&gt;" in str(posted.edits[0][1])
    assert "alert_ack" in shown  # the button, until someone owns it

    # A batch the runner sends again changes nothing: each alert event is seen once.
    assert deliver(ingest, run_id, attempt_id, sink) == {"accepted": 0, "duplicates": 2}
    assert script_alerts(deps, run_id)[0].count == 2

    with session_scope(deps.engine) as db:
        alerts.acknowledge(
            db, alert.id, user="U0GRACE", now=NOW + timedelta(minutes=1),
            notifier=notifier, journal=ListJournal(),
        )  # fmt: skip
    assert notifier.flush(timeout=10)
    [acked] = script_alerts(deps, run_id)
    assert (acked.state, acked.acked_by) == ("ACKED", "U0GRACE")
    [posted] = [m for m in fake.messages("C1") if "val_loss stopped improving" in m.text]
    assert "alert_ack" not in str(posted.blocks) and "U0GRACE" in str(posted.blocks)
    # An acknowledged critical alert is not escalated.
    escalate = test_escalation.escalator(deps.engine, notifier, ListJournal())
    assert escalate(3600 * 5) == []


def test_a_bad_alert_is_said_to_the_script_and_a_long_one_is_clipped(
    deps: Deps, tmp_path: Path
) -> None:
    run_id, attempt_id = running_attempt(deps)
    session, sink = script_session(tmp_path, run_id)
    with pytest.raises(RunnerError, match="severity must be one of critical, info, warning"):
        session.alert("x", "y", severity="page-everyone")
    with pytest.raises(RunnerError, match="give the alert a title"):
        session.alert("  \n ", "y")
    session.alert("a\nlong " + "title " * 100, "text " * 2000, severity="WARN")  # wandb's name
    [data] = sink.of("alert")
    assert len(data["title"]) == ALERT_TITLE_MAX and "\n" not in data["title"]
    assert data["severity"] == "warning" and data["step"] is None
    assert deliver(build_ingest(deps), run_id, attempt_id, sink)["accepted"] == 1
    [alert] = script_alerts(deps, run_id)
    assert alert.severity == "WARNING" and alert.title.startswith("a long title title")
