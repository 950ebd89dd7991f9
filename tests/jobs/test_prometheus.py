"""``/metrics`` after a small scenario, parsed by prometheus_client's own text parser.

The scenario is real where it can be: batches through the real ingest route over HTTP,
a real APScheduler scheduler running a job that succeeds and one that raises, the real
Slack notifier queueing posts against the fake Slack Web API (which answers 429 past
its rate). The runs, attempts, spend, alerts and the lease are rows in a real database,
as the service layer leaves them.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine
from sqlmodel import Session

from bot.slack_notifier import SlackNotifier
from jobs.database.db import make_engine, migrate
from jobs.database.models import Alert, AlertState, Attempt, Budget, Run, SpendRecord, hash_token
from jobs.database.replica_tables import SchedulerLease
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.domain.severity import Severity
from jobs.ingest import IngestService
from jobs.outbound.notify import TextMessage
from jobs.web.prometheus import ControlPlaneMetrics
from jobs.web.server import EVENTS_PATH, ControlPlaneApp, ServerHandle, serve
from runner.wire import Event as WireEvent
from runner.wire import encode_batch
from tests.fakes.slack_api import FakeSlack
from tests.paths import ROOT

NOW = datetime.now(timezone.utc)
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: ServerHandle) -> tuple[Samples, set[str]]:
    """``/metrics`` of the server's admin port (the public port does not serve it)."""
    with urllib.request.urlopen(f"{server.admin_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    families = list(text_string_to_metric_families(text))
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in families
        for s in family.samples
    }
    return samples, {family.name for family in families}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def add_scenario(engine: Engine) -> None:
    """Two channels' runs: one running on its second attempt after a preemption, one
    succeeded, one failed preflight; spend, a budget, alerts in each state."""
    hour = timedelta(hours=1)
    with Session(engine) as session:
        session.add(Run(id="r-1", spec_name="tiny", requester="U1", channel="C1",
                        state=RunState.RUNNING, budget_usd=10.0))  # fmt: skip
        session.add(Run(id="r-2", spec_name="tiny", requester="U2", channel="C2",
                        state=RunState.SUCCEEDED, ended_at=NOW - hour))  # fmt: skip
        session.add(Run(id="r-3", spec_name="tiny", requester="U2", channel="C2",
                        state=RunState.PREFLIGHT_FAILED, ended_at=NOW - 3 * 24 * hour))  # fmt: skip
        session.flush()
        session.add(Attempt(id="a-1", run_id="r-1", number=1, provider="local",
                            state=AttemptState.PREEMPTED, lost_seconds=360.0, instances=2))  # fmt: skip
        session.add(Attempt(id="a-2", run_id="r-1", number=2, provider="local",
                            state=AttemptState.RUNNING, token_hash=hash_token("tok-2")))  # fmt: skip
        session.add(Attempt(id="a-3", run_id="r-2", number=1, provider="local",
                            state=AttemptState.SUCCEEDED))  # fmt: skip
        session.flush()
        # r-1: 2 instances × 1 h at $1.5/h, then 1 instance × 1 h; r-2: 1 h at $2/h.
        for attempt, run, start, usd, price, instances in (
            ("a-1", "r-1", NOW - 3 * hour, 3.0, 1.5, 2),
            ("a-2", "r-1", NOW - hour, 1.5, 1.5, 1),
            ("a-3", "r-2", NOW - 2 * hour, 2.0, 2.0, 1),
        ):
            session.add(SpendRecord(attempt_id=attempt, run_id=run, period_start=start,
                                    period_end=start + hour, usd=usd, price_per_hour=price,
                                    instances=instances))  # fmt: skip
        session.add(Budget(scope="team", name="C1", usd=100.0))
        for id_, severity, state, escalated in (
            ("al-1", Severity.CRITICAL, AlertState.OPEN, True),
            ("al-2", Severity.WARNING, AlertState.ACKED, False),
            ("al-3", Severity.WARNING, AlertState.OPEN, False),
            ("al-4", Severity.CRITICAL, AlertState.RESOLVED, True),
        ):
            session.add(Alert(id=id_, run_id="r-1", rule="test", title="t", severity=severity,
                              state=state, escalated_at=NOW if escalated else None))  # fmt: skip
        session.add(SchedulerLease(name="leader", holder="replica-a", expires_at=NOW + hour))
        session.commit()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'metrics.db'}")
    migrate(engine)
    add_scenario(engine)
    yield engine
    engine.dispose()


def serve_plane(engine: Engine, holder: str) -> tuple[ControlPlaneApp, ServerHandle]:
    app = ControlPlaneApp(
        engine, IngestService(engine), metrics=ControlPlaneMetrics(engine, holder=holder)
    )
    return app, serve(app, "127.0.0.1", 0)


def post_batch(url: str, first_seq: int) -> None:
    body = encode_batch(
        [WireEvent("a-2", first_seq + i, "heartbeat", time.time(), "r-1", {"step": i})
         for i in range(4)]
    )  # fmt: skip
    request = urllib.request.Request(
        url + EVENTS_PATH, data=body, method="POST", headers={"Authorization": "Bearer tok-2"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200


def test_metrics_hold_every_family_after_a_small_scenario(engine: Engine) -> None:
    app, server = serve_plane(engine, holder="replica-a")
    fake = FakeSlack(tokens=["xoxb-metrics"], post_interval_s=0.2, burst=1).start()
    notifier = SlackNotifier(fake.client("xoxb-metrics"), min_interval_s=0.0)
    scheduler = BackgroundScheduler()
    try:
        post_batch(server.url, 0)
        post_batch(server.url, 0)  # resent: duplicates
        app.metrics.watch_post_queue(notifier)
        for i in range(6):  # one channel, faster than the fake allows: 429s, a queue
            notifier.post(TextMessage(channel="C1", kind="info", text=f"update {i}"))
        app.metrics.watch_scheduler(scheduler)
        app.metrics.watch_scheduler(scheduler)  # idempotent: counted once
        scheduler.add_job(lambda: None, id="reconcile", trigger="date")
        scheduler.add_job(_fail, id="digest", trigger="date")
        scheduler.start()
        queued, _ = scrape(server)
        deadline = time.monotonic() + 15
        while app.metrics.value("trainbot_scheduler_job_runs_total", {"task": "digest"}) != 1:
            assert time.monotonic() < deadline, "the scheduled jobs did not run"
            time.sleep(0.05)
        assert notifier.flush(15)

        samples, families = scrape(server)
    finally:
        if scheduler.running:
            scheduler.shutdown(wait=True)
        notifier.close(timeout=5)
        fake.close()
        server.shutdown()

    assert families >= {
        "trainbot_runs", "trainbot_attempts", "trainbot_attempts_launched",
        "trainbot_preemptions", "trainbot_resubmits", "trainbot_run_spend_usd",
        "trainbot_run_goodput_ratio", "trainbot_run_budget_used_ratio", "trainbot_spend_usd",
        "trainbot_paid_instance_seconds", "trainbot_lost_instance_seconds",
        "trainbot_channel_goodput_ratio", "trainbot_team_budget_used_ratio",
        "trainbot_alerts_open", "trainbot_alerts_unacknowledged", "trainbot_alert_escalations",
        "trainbot_ingest_events", "trainbot_ingest_batches", "trainbot_ingest_latency_seconds",
        "trainbot_slack_queue_depth", "trainbot_slack_rate_limited", "trainbot_slack_calls",
        "trainbot_scheduler_job_runs", "trainbot_scheduler_job_failures",
        "trainbot_scheduler_job_lag_seconds", "trainbot_scheduler_leader",
        "trainbot_database_up",
    }  # fmt: skip
    # Runs, attempts, preemptions, resubmits.
    assert value(samples, "trainbot_runs", state="RUNNING") == 1
    assert value(samples, "trainbot_runs", state="SUCCEEDED") == 1
    assert value(samples, "trainbot_runs", state="STOPPED") == 0
    assert value(samples, "trainbot_attempts", state="PREEMPTED") == 1
    assert value(samples, "trainbot_attempts_launched_total") == 3
    assert value(samples, "trainbot_preemptions_total") == 1
    assert value(samples, "trainbot_resubmits_total") == 1
    # Spend and goodput: per run (the running one and the recent one, not r-3), per channel.
    assert value(samples, "trainbot_run_spend_usd", run="r-1", channel="C1") == 4.5
    assert value(samples, "trainbot_run_spend_usd", run="r-2", channel="C2") == 2.0
    assert ("trainbot_run_spend_usd", frozenset({("run", "r-3"), ("channel", "C2")})) not in samples
    # r-1 paid 2 × 3600 + 3600 instance-seconds and lost 360 × 2.
    assert value(samples, "trainbot_run_goodput_ratio", run="r-1", channel="C1") == pytest.approx(
        1 - 720 / 10800
    )
    assert value(samples, "trainbot_run_budget_used_ratio", run="r-1", channel="C1") == 0.45
    assert value(samples, "trainbot_spend_usd_total", channel="C1") == 4.5
    assert value(samples, "trainbot_paid_instance_seconds_total", channel="C1") == 10800
    assert value(samples, "trainbot_lost_instance_seconds_total", channel="C1") == 720
    assert value(samples, "trainbot_channel_goodput_ratio", channel="C2") == 1.0
    month = NOW.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    month_to_date = sum(
        usd for end, usd in ((NOW - timedelta(hours=2), 3.0), (NOW, 1.5)) if end >= month
    )
    assert value(samples, "trainbot_team_budget_used_ratio", channel="C1") == pytest.approx(
        month_to_date / 100.0
    )
    # Alerts: open (not resolved) and unacknowledged by severity; escalations ever.
    assert value(samples, "trainbot_alerts_open", severity="critical") == 1
    assert value(samples, "trainbot_alerts_open", severity="warning") == 2
    assert value(samples, "trainbot_alerts_unacknowledged", severity="warning") == 1
    assert value(samples, "trainbot_alerts_unacknowledged", severity="info") == 0
    assert value(samples, "trainbot_alert_escalations_total", severity="critical") == 2
    # Ingest: 4 accepted, then 4 duplicates; two 200 batches, each timed.
    assert value(samples, "trainbot_ingest_events_total", result="accepted") == 4
    assert value(samples, "trainbot_ingest_events_total", result="duplicate") == 4
    assert value(samples, "trainbot_ingest_batches_total", status="200") == 2
    assert value(samples, "trainbot_ingest_latency_seconds_count") == 2
    assert value(samples, "trainbot_ingest_latency_seconds_bucket", le="+Inf") == 2
    # The Slack queue: it held the posts, then sent them all past the fake's 429s.
    assert value(queued, "trainbot_slack_queue_depth", channel="C1") >= 1
    assert ("trainbot_slack_queue_depth", frozenset({("channel", "C1")})) not in samples
    assert value(samples, "trainbot_slack_rate_limited_total") >= 1
    assert value(samples, "trainbot_slack_calls_total", outcome="sent") == 6
    assert value(samples, "trainbot_slack_calls_total", outcome="dropped") == 0
    # The scheduler: one run each, the digest's a failure; lag observed per job.
    assert value(samples, "trainbot_scheduler_job_runs_total", task="reconcile") == 1
    assert value(samples, "trainbot_scheduler_job_failures_total", task="digest") == 1
    assert (
        "trainbot_scheduler_job_failures_total",
        frozenset({("task", "reconcile")}),
    ) not in samples
    assert value(samples, "trainbot_scheduler_job_lag_seconds_count", task="reconcile") == 1
    assert 0 <= value(samples, "trainbot_scheduler_job_lag_seconds_sum", task="reconcile") < 10
    assert value(samples, "trainbot_scheduler_leader") == 1
    assert value(samples, "trainbot_database_up") == 1
    # The example alert rules and the dashboard use only names this exposes.
    exposed = {name for name, _ in samples} | families
    for path in ("deploy/prometheus/alerts.yaml", "deploy/grafana/trainbot.json"):
        used = set(re.findall(r"trainbot_[a-z_]+", (ROOT / path).read_text()))
        assert used <= exposed, (path, sorted(used - exposed))


def _fail() -> None:
    raise RuntimeError("the digest failed")


def test_each_control_plane_has_its_own_registry(engine: Engine) -> None:
    """Two control planes in one process: separate series, and only the lease holder leads."""
    _, leader_server = serve_plane(engine, holder="replica-a")
    _, other_server = serve_plane(engine, holder="replica-b")
    try:
        post_batch(leader_server.url, 0)
        led, _ = scrape(leader_server)
        not_led, _ = scrape(other_server)
    finally:
        leader_server.shutdown()
        other_server.shutdown()

    assert value(led, "trainbot_ingest_events_total", result="accepted") == 4
    assert value(not_led, "trainbot_ingest_events_total", result="accepted") == 0
    assert value(led, "trainbot_scheduler_leader") == 1
    assert value(not_led, "trainbot_scheduler_leader") == 0
    assert value(led, "trainbot_runs", state="RUNNING") == value(
        not_led, "trainbot_runs", state="RUNNING"
    )


def test_a_database_that_does_not_answer_is_a_gauge_not_an_error(tmp_path: Path) -> None:
    broken_dir = tmp_path / "not-a-database"
    broken_dir.mkdir()
    broken = make_engine(f"sqlite:///{broken_dir}")
    server = serve(ControlPlaneApp(broken, IngestService(broken)), "127.0.0.1", 0)
    try:
        samples, families = scrape(server)
    finally:
        server.shutdown()
        broken.dispose()

    assert value(samples, "trainbot_database_up") == 0
    assert "trainbot_runs" not in families
    assert "trainbot_ingest_events" in families
