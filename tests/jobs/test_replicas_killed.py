"""Three replicas as separate processes on PostgreSQL; the leader is killed with SIGKILL.

Each replica is :mod:`tests.jobs.replica_process` (what ``trainbot serve`` builds with
Slack), sharing one PostgreSQL schema, one state directory (the local provider's
instances, the checkpoints, the runner-token secret) and the fake Slack Web API. A small
load balancer in front of them sends every request (Slack's, the runners') to the first
replica that answers, the leader first, so the leader is the one that launches, hears
the runner and posts; once it is dead the next one answers. The lease is two seconds.

- **During a launch**: a run is launched and preempted; the leader records the resubmit
  (deferred work) and is killed as soon as it claims it, while the next attempt is being
  launched. Another replica leads within the lease time, takes the resubmit over, and
  the run gets exactly one instance per attempt; the preemption alert and every post the
  dead leader had queued reach Slack.
- **During the digest minute**: the digest time is a few seconds after start; the
  leader is killed as soon as the day's digest is recorded. The new leader finishes it:
  each channel gets exactly one digest.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest
import requests
from sqlalchemy import Engine
from sqlmodel import col, select

from jobs.database.db import make_engine, migrate, session_scope
from jobs.database.models import Alert, Attempt, Run
from jobs.database.replica_tables import LEADER_LEASE, DeferredWork, SchedulerLease, SlackOutbox
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.deps import load_secret
from jobs.providers.base import InstanceInfo, InstanceState
from jobs.providers.local import LocalProvider
from tests.bot.test_slack_app import ResponseUrls, sign
from tests.fakes.loopback import LoopbackServer, QuietHandler, read_body, reply
from tests.fakes.slack_api import FakeSlack
from tests.jobs.databases import fresh_schema, postgres_or_skip
from tests.paths import ROOT
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
TOKEN = "xoxb-replicas"
TEAM = "T0TEST"
CHANNEL = "C0TRAIN"
ADA = "U0ADA"
LEASE_S = 2.0
#: The notifier's pace per channel: slow enough that posts queue up behind each other.
POST_INTERVAL_S = 0.5
REPLICAS = ("replica-0", "replica-1", "replica-2")
#: A run whose instances start at once and wait (the runner supervises a sleep): what is
#: under test is who launches it, not what it trains. No dry run, so preflight asks for
#: "Launch anyway"; a short resubmit backoff.
SLEEPER = """\
description: sleeps, for the replica tests
command: python -c "import time; time.sleep(600)"
resources:
  cloud: local
  spot: true
  disk_gb: 1
budget:
  usd: 5
resubmit:
  max_attempts: 5
  backoff_s: 1s
dry_run:
  enabled: false
"""


# ----------------------------------------------------------------------------- the edges


class FirstAlive:
    """A load balancer that sends each request to the first backend that answers."""

    def __init__(self) -> None:
        self.backends: list[str] = []
        outer = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = read_body(self)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
                }
                for backend in list(outer.backends):
                    parts = urlsplit(backend)
                    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
                    try:
                        conn.request(self.command, self.path, body=body or None, headers=headers)
                        answer = conn.getresponse()
                        data = answer.read()
                    except OSError:
                        continue  # dead: the next one
                    finally:
                        conn.close()
                    skip = ("transfer-encoding", "connection", "content-length")
                    headers = [(k, v) for k, v in answer.getheaders() if k.lower() not in skip]
                    return reply(self, answer.status, data, None, headers=headers)
                reply(self, 503, b"", None)

            do_GET = do_POST = _forward

        self.server = LoopbackServer(Handler)
        self.url = self.server.url

    def close(self) -> None:
        self.server.close()


class Cluster:
    """Three replica processes, the database they share, and the ends a test talks to."""

    def __init__(
        self, url: str, tmp_path: Path, *, digest_at: str | None = None, runs: Sequence[Run] = ()
    ) -> None:
        self.engine = make_engine(url)
        migrate(self.engine)
        with session_scope(self.engine) as session:
            session.add_all(runs)
        self.state = tmp_path / "state"
        load_secret(self.state)  # made once here, not raced for by three starting replicas
        self.fake = FakeSlack(
            tokens=[TOKEN], post_interval_s=POST_INTERVAL_S, burst=1, whole_second_retry_after=False
        ).start()
        self.fake.add_channel(CHANNEL, "ml-training", members=[ADA])
        self.hooks = ResponseUrls()
        self.balancer = FirstAlive()
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        specs = tmp_path / "specs"
        specs.mkdir()
        (specs / "sleeper.yaml").write_text(SLEEPER)
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "TRAINBOT_STATE_DIR": str(self.state),
            "TRAINBOT_SPECS_DIR": str(specs),
            "TRAINBOT_DATABASE_URL": url,
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_PUBLIC_URL": self.balancer.url,
            "TRAINBOT_NOTIFIER": "slack",
            "TRAINBOT_SLACK_SIGNING_SECRET": SECRET,
            "TRAINBOT_SLACK_BOT_TOKEN": TOKEN,
            "TRAINBOT_ALLOWED_CHANNELS": CHANNEL,
            "TRAINBOT_LAUNCHERS": ADA,
            "TRAINBOT_LOCAL_TERMINATION_WINDOW_S": "5",
            "TRAINBOT_LOCAL_CORES": "8",
            "TRAINBOT_TIMEZONE": "UTC",
            "TRAINBOT_LOG_FORMAT": "text",
            "REPLICA_SLACK_API": self.fake.api_url,
            "REPLICA_LEASE_S": str(LEASE_S),
            "REPLICA_POST_INTERVAL_S": str(POST_INTERVAL_S),
            "REPLICA_INTERVALS": json.dumps({"reconcile": 1}),
        }
        if digest_at:
            env["REPLICA_DIGEST_AT"] = digest_at
        self.orphaned: list[int] = []
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.urls: dict[str, str] = {}
        for name in REPLICAS:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.jobs.replica_process"],
                cwd=ROOT,
                env={**env, "REPLICA_NAME": name},
                stdout=subprocess.PIPE,
                stderr=(self.logs / f"{name}.log").open("w"),
                text=True,
            )
        try:
            for name, proc in self.procs.items():
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert line, f"{name} exited before serving: {self.log(name)[-3000:]}"
                self.urls[name] = json.loads(line)["url"]
        except BaseException:
            self.close()  # the fixture never saw this cluster: nothing else stops the others
            raise

    def describe(self) -> str:
        """The deferred work and the outbox, for a failing test's message."""
        with session_scope(self.engine) as session:
            work = session.exec(select(DeferredWork)).all()
            outbox = session.exec(select(SlackOutbox)).all()
            lines = [
                f"work {w.key} claimed_by={w.claimed_by} fence={w.fence}/{w.claimed_fence} "
                f"until={w.claimed_until} done={w.done_at} err={w.error}"
                for w in work
            ] + [
                f"outbox {o.id} {o.op} {o.channel} {o.target} key={o.key} owner={o.owner} "
                f"sent={o.sent_at} ts={o.ts}"
                for o in outbox
            ]
        return "\n".join(lines)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    # --- the lease --------------------------------------------------------------------

    def lease(self) -> SchedulerLease | None:
        with session_scope(self.engine) as session:
            return session.get(SchedulerLease, LEADER_LEASE)

    def leader(self) -> str:
        def current() -> str | None:
            lease = self.lease()
            if lease is None or lease.expires_at < datetime.now(timezone.utc):
                return None
            return lease.holder if lease.holder in self.alive() else None

        found: str = wait_until(current, 3 * LEASE_S, "a leader")
        return found

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def route_to(self, first: str) -> None:
        """Requests go to ``first`` while it answers, then to the others."""
        self.balancer.backends = [self.urls[first]] + [self.urls[n] for n in REPLICAS if n != first]

    def kill(self, name: str) -> float:
        """SIGKILL ``name``; the seconds until another replica holds the lease."""
        before = self.lease()
        assert before is not None and before.holder == name
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)
        killed = time.monotonic()
        #: What it had queued and not sent, before any other replica adopts it.
        self.orphaned = self.unsent(owner=name)

        def taken_over() -> bool:
            lease = self.lease()
            return (
                lease is not None
                and lease.holder != name
                and lease.token > before.token
                and lease.expires_at > datetime.now(timezone.utc)
            )

        wait_until(taken_over, 3 * LEASE_S, "a new leader")
        return time.monotonic() - killed

    # --- Slack's side -----------------------------------------------------------------

    def send(self, body: bytes, content_type: str = "application/x-www-form-urlencoded") -> None:
        ts = str(int(time.time()))
        headers = {
            "Content-Type": content_type,
            "X-Slack-Request-Timestamp": ts,
            "X-Slack-Signature": sign(body, ts, SECRET),
        }
        answer = requests.post(
            f"{self.balancer.url}/slack/events", data=body, headers=headers, timeout=30
        )
        assert answer.status_code == 200, answer.text

    def command(self, command_text: str) -> None:
        trigger = f"trg-{uuid.uuid4().hex[:12]}"
        form = {
            "token": "legacy-verification-token",
            "team_id": TEAM,
            "team_domain": "fake",
            "channel_id": CHANNEL,
            "channel_name": "ml-training",
            "user_id": ADA,
            "user_name": "ada",
            "command": "/train",
            "text": command_text,
            "api_app_id": "A0TRAIN",
            "response_url": f"{self.hooks.url}/commands/{trigger}",
            "trigger_id": trigger,
        }
        self.send(urlencode(form).encode())

    def press(self, action_id: str, value: str) -> None:
        trigger = f"trg-{uuid.uuid4().hex[:12]}"
        payload = {
            "type": "block_actions",
            "team": {"id": TEAM, "domain": "fake"},
            "user": {"id": ADA, "username": "ada", "team_id": TEAM},
            "api_app_id": "A0TRAIN",
            "token": "legacy-verification-token",
            "container": {"type": "message", "message_ts": "1.0", "channel_id": CHANNEL},
            "trigger_id": trigger,
            "channel": {"id": CHANNEL, "name": "ml-training"},
            "message": {"type": "message", "ts": "1.0", "text": ""},
            "response_url": f"{self.hooks.url}/actions/{trigger}",
            "actions": [
                {"action_id": action_id, "block_id": "b1", "type": "button", "value": value}
            ],
        }
        self.send(urlencode({"payload": json.dumps(payload)}).encode())

    def slack_text(self, channel: str = CHANNEL) -> list[str]:
        with self.fake.cond:
            return [m.text + json.dumps(m.blocks) for m in self.fake.messages(channel)]

    def unsent(self, *, owner: str | None = None) -> list[int]:
        """The outbox rows not sent yet (of ``owner`` only, when given)."""
        query = select(SlackOutbox.id).where(col(SlackOutbox.sent_at).is_(None))
        if owner is not None:
            query = query.where(SlackOutbox.owner == owner)
        with session_scope(self.engine) as session:
            return [i for i in session.exec(query).all() if i is not None]

    def sent(self, ids: list[int]) -> bool:
        with session_scope(self.engine) as session:
            rows = session.exec(select(SlackOutbox).where(col(SlackOutbox.id).in_(ids))).all()
            return all(r.sent_at is not None for r in rows)

    def close(self) -> None:
        for proc in self.procs.values():  # the test is over: no need to drain
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(10)
        provider = LocalProvider(self.state / "local")
        for instance in provider.list_instances():
            if not instance.state.is_terminal():
                provider.terminate(instance.instance_id)
        provider.close()
        self.balancer.close()
        self.hooks.close()
        self.fake.close()
        self.engine.dispose()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A URL whose connections use a fresh PostgreSQL schema, dropped afterwards."""
    url = postgres_or_skip("(replicas share one PostgreSQL; SQLite is one process's file)")
    with fresh_schema(url, "trainbot_replicas") as schema_url:
        yield schema_url


@pytest.fixture
def make_cluster(postgres_url: str, tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**kwargs: Any) -> Cluster:
        made.append(Cluster(postgres_url, tmp_path, **kwargs))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


def _engine_rows(engine: Engine, model: Any, *where: Any) -> list[Any]:
    with session_scope(engine) as session:
        return list(session.exec(select(model).where(*where)).all())


# ----------------------------------------------------------------------------- the tests


def test_killing_the_leader_during_a_launch(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    engine = cluster.engine
    provider = LocalProvider(cluster.state / "local")
    leader = cluster.leader()
    cluster.route_to(leader)

    cluster.command("launch sleeper")
    run = wait_until(lambda: _engine_rows(engine, Run), 20, "the run")[0]
    wait_until(
        lambda: (
            _engine_rows(engine, Run, Run.id == run.id)[0].state == RunState.AWAITING_CONFIRMATION
        ),
        30,
        "the preflight report",
    )
    cluster.press("launch_anyway", run.id)

    def instances() -> list[InstanceInfo]:
        return [i for i in provider.list_instances() if i.run_id == run.id]

    first = wait_until(
        lambda: next((i for i in instances() if i.state == InstanceState.RUNNING), None),
        30,
        "attempt 1's instance",
    )
    # The spot instance is preempted: the leader sees it end (from the runner or from
    # reconcile), raises the preemption alert and defers the resubmit by its backoff.
    provider.preempt(first.instance_id)
    # Killed while it launches attempt 2: its instance is there, the attempt may not
    # have it recorded yet.
    wait_until(lambda: len(instances()) == 2, 30, "the leader to launch attempt 2")
    took = cluster.kill(leader)
    assert took <= LEASE_S + 1.0, f"a new leader took {took:.1f} s"
    # The posts it had queued behind the channel's pace (usually some: the preemption,
    # its alert, the new attempt; none when a loaded machine let it send them first).
    queued = cluster.orphaned

    def second_recorded() -> Attempt | None:
        attempts = _engine_rows(engine, Attempt, Attempt.run_id == run.id, Attempt.number == 2)
        return next((a for a in attempts if a.instance_id), None)

    second = wait_until(second_recorded, 30, "attempt 2 to have its instance")
    key = f"resubmit:{first.attempt_id}"
    wait_until(
        lambda: _engine_rows(engine, DeferredWork, DeferredWork.key == key)[0].done_at,
        30,
        "the resubmit to be done, by whichever replica",
    )
    wait_until(lambda: cluster.sent(queued), 20, "the dead leader's posts to reach Slack")

    attempts = _engine_rows(engine, Attempt, Attempt.run_id == run.id)
    assert sorted(a.number for a in attempts) == [1, 2], "one attempt per launch"
    assert sorted(i.attempt_id for i in instances()) == sorted([first.attempt_id, second.id]), (
        "exactly one instance per attempt"
    )
    assert second.instance_id != first.instance_id
    assert (
        _engine_rows(engine, Attempt, Attempt.id == first.attempt_id)[0].state
        == AttemptState.PREEMPTED
    )
    # No alert lost: each alert the run raised is in the channel, once.
    alerts = _engine_rows(engine, Alert, Alert.run_id == run.id)
    assert any(a.rule == "preemption" for a in alerts)
    wait_until(lambda: not cluster.unsent(), 20, "the channel's queue to drain")
    shown = cluster.slack_text()
    for alert in alerts:
        assert sum(f"alert:{alert.id}" in m for m in shown) == 1, alert.rule
    provider.close()


def test_killing_the_leader_in_the_digest_minute(make_cluster: Callable[..., Cluster]) -> None:
    channels = ("C0ONE", "C0TWO", "C0THREE")
    # The digest is due a few seconds after the replicas start (about 2 s on a quiet
    # machine; if they take longer to start, it is already due and the first leader
    # catches up on it).
    at = datetime.now(timezone.utc) + timedelta(seconds=4)
    finished = [
        Run(
            id=f"r-digest{n}",
            spec_name="tiny",
            spec={"name": "tiny", "command": ["x"]},
            requester=ADA,
            channel=channel,
            state=RunState.SUCCEEDED,
        )
        for n, channel in enumerate(channels)
    ]
    cluster = make_cluster(digest_at=at.strftime("%H:%M:%S"), runs=finished)
    leader = cluster.leader()
    day = at.date().isoformat()
    recorded = wait_until(
        lambda: _engine_rows(cluster.engine, DeferredWork, DeferredWork.key == f"digest:{day}"),
        30,
        "the day's digest to be recorded",
    )
    assert recorded
    took = cluster.kill(leader)
    assert took <= LEASE_S + 1.0, f"a new leader took {took:.1f} s"

    def digests(channel: str) -> int:
        return sum("Daily spend digest" in m for m in cluster.slack_text(channel))

    try:
        wait_until(lambda: all(digests(c) for c in channels), 30, "a digest in every channel")
    except pytest.fail.Exception:
        print(cluster.describe())
        raise
    wait_until(lambda: not cluster.unsent(), 20, "every queued post to reach Slack")
    time.sleep(2 * LEASE_S)  # a second digest would have come by now
    assert {c: digests(c) for c in channels} == dict.fromkeys(channels, 1)
    rows = _engine_rows(
        cluster.engine, DeferredWork, col(DeferredWork.key).startswith(f"digest:{day}")
    )
    assert len(rows) == 1 + len(channels) and all(r.done_at for r in rows)
