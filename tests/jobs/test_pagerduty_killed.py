"""A PagerDuty event survives the replica that queued it: killed with SIGKILL before it
could deliver, its event is delivered once by the next replica, or by itself restarted.

Each replica is a process of its own (:mod:`tests.jobs.pagerduty_process`) on the test's
database; PagerDuty is a local Events API v2 (:mod:`tests.fakes.pagerduty`). The first
replica cannot reach PagerDuty (its URL is a port nothing listens on), so it keeps its
event queued and retrying until it is killed. On SQLite (one process, embedded) only the
restart is tried.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, select

from jobs.database.db import session_scope
from jobs.database.models import Alert
from jobs.database.replica_tables import PagerDutyOutbox
from tests.fakes.pagerduty import FakePagerDuty
from tests.jobs.test_alerts import ListJournal, RecordingNotifier
from tests.jobs.test_escalation import open_critical
from tests.paths import ROOT

HOLD_S = 1.0


@pytest.fixture
def start_replica(db_engine: Engine) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    url = db_engine.url.render_as_string(hide_password=False)

    def start(owner: str, *, pagerduty: FakePagerDuty | str, alert: str | None = None) -> Any:
        target = pagerduty if isinstance(pagerduty, str) else pagerduty.url
        env = {
            **os.environ,
            "PD_DATABASE_URL": url,
            "PD_URL": target,
            "PD_ROUTING_KEY": FakePagerDuty.routing_key,
            "PD_OWNER": owner,
            "PD_HOLD_S": str(HOLD_S),
            "PYTHONPATH": str(ROOT),
        }
        if alert is not None:
            env["PD_ALERT"] = alert
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.jobs.pagerduty_process"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert json.loads(line) == {"owner": owner}, f"{owner} did not start"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def outbox(engine: Engine) -> list[Any]:
    o = PagerDutyOutbox.__table__.c  # type: ignore[attr-defined]
    with session_scope(engine) as session:
        return list(session.execute(select(o.owner, o.tries, o.done_at, o.outcome)).all())


def wait_for(check: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("next_replica", ["another", "restarted"])
def test_an_event_queued_by_a_killed_replica_is_delivered_once_by_the_next(
    db_engine: Engine, start_replica: Callable[..., subprocess.Popen[str]], next_replica: str
) -> None:
    if next_replica == "another" and db_engine.dialect.name == "sqlite":
        pytest.skip("replicas share a PostgreSQL; SQLite's one process restarts")
    alert = open_critical(db_engine, RecordingNotifier(), ListJournal())
    with session_scope(db_engine) as session:  # it paged: its escalation is what is queued
        row = session.get(Alert, alert.id)
        assert row is not None
        row.escalation_level = 1
    with FakePagerDuty() as gone:
        unreachable = gone.url
    with FakePagerDuty() as pd:
        first = start_replica("replica-a", pagerduty=unreachable, alert=alert.id)
        # Queued, tried and failed at least once: the event lives in its replica now.
        wait_for(lambda: any(r.tries >= 1 for r in outbox(db_engine)), timeout=20, what="a try")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        [left] = outbox(db_engine)
        assert (left.owner, left.done_at) == ("replica-a", None)

        owner = "replica-b" if next_replica == "another" else "replica-a"
        start_replica(owner, pagerduty=pd)
        wait_for(lambda: len(pd.accepted()) >= 1, timeout=20, what="the delivery")
        time.sleep(2 * HOLD_S)  # long enough for a second delivery, if there were one
        assert [(r.action, r.dedup_key) for r in pd.received] == [("trigger", alert.id)]
        assert pd.incidents == {alert.id: "triggered"}
        [done] = outbox(db_engine)
        assert (done.owner, done.outcome) == (owner, "sent") and done.done_at is not None
