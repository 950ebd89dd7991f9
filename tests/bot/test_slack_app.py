"""The Slack app over real HTTP: signed requests in, Web API calls out to a fake Slack.

The control plane runs as ``trainbot serve`` runs it (its WSGI server on 127.0.0.1:0,
the Bolt app mounted at /slack by :func:`bot.slack_wsgi.attach`, the Slack notifier
posting through a real ``WebClient``). Requests are signed here with Slack's v0 scheme
from the signing secret. Outbound calls go to :class:`tests.fakes.slack_api.FakeSlack`;
replies to a command's ``response_url`` go to a small recording server of our own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import requests
from sqlmodel import func, select

from bot.auth import Authorizer, Caller, Policy
from bot.listeners.runs import CHANNEL_DENIED
from bot.slack_notifier import SlackNotifier
from bot.slack_wsgi import SlackFrontEnd, attach
from jobs import alerts
from jobs.background import tasks
from jobs.database.db import session_scope
from jobs.database.models import Alert, Attempt, Run
from jobs.database.replica_tables import CommandLog
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CallbackJournal, MessageRef
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import Settings, load_settings
from jobs.rules import Severity, Signal
from jobs.runs import active_attempt, alert_target
from tests.fakes.loopback import LoopbackServer, QuietHandler, read_body, reply
from tests.fakes.slack_api import FakeMessage, FakeSlack
from tests.waiting import wait_until

SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
TOKEN = "xoxb-test"
TEAM = "T0TEST"
CHANNEL = "C0TRAIN"
OTHER_CHANNEL = "C0RANDOM"
ADA, BOB, CAROL = "U0ADA", "U0BOB", "U0CAROL"
#: No dry run (preflight then warns and waits for "Launch anyway"), no resubmit backoff.
FAST = "dry_run.enabled=false resubmit.backoff_s=0"


# ----------------------------------------------------------------------------- the edges


def sign(body: bytes, timestamp: str, secret: str = SECRET) -> str:
    """Slack's v0 signature, computed independently of the code under test."""
    base = b"v0:" + timestamp.encode() + b":" + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


class ResponseUrls:
    """Stands in for Slack's response_url endpoint: records every JSON body posted."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.posts: list[tuple[str, dict[str, Any]]] = []
        outer = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                body = json.loads(read_body(self) or b"{}")
                with outer.cond:
                    outer.posts.append((self.path, body))
                    outer.cond.notify_all()
                reply(self, 200, b"ok", None)

        self.server = LoopbackServer(Handler)
        self.url = self.server.url

    def to(self, path: str) -> list[dict[str, Any]]:
        with self.cond:
            return [body for p, body in self.posts if p == path]

    def wait(self, path: str, timeout: float = 15.0) -> dict[str, Any]:
        with self.cond:
            found = self.cond.wait_for(lambda: any(p == path for p, _ in self.posts), timeout)
            assert found, f"no reply to {path} within {timeout} s; got {self.posts}"
            return next(body for p, body in self.posts if p == path)

    def close(self) -> None:
        self.server.close()


@dataclass
class Slack:
    """The control plane with the Slack app, and the two ends a test talks through."""

    cp: ControlPlane
    fake: FakeSlack
    hooks: ResponseUrls
    notifier: SlackNotifier
    front: SlackFrontEnd
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self.cp.server is not None
        return f"{self.cp.server.url}/slack/events"

    # --- sending --------------------------------------------------------------------

    def send(
        self,
        body: bytes,
        *,
        content_type: str = "application/x-www-form-urlencoded",
        timestamp: str | None = None,
        signature: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> requests.Response:
        ts = timestamp if timestamp is not None else str(int(time.time()))
        sent = {
            "Content-Type": content_type,
            "X-Slack-Request-Timestamp": ts,
            "X-Slack-Signature": signature if signature is not None else sign(body, ts),
            **(headers or {}),
        }
        return requests.post(self.url, data=body, headers=sent, timeout=30)

    def command_body(
        self,
        text: str,
        *,
        user: str = ADA,
        channel: str = CHANNEL,
        channel_name: str = "ml-training",
        trigger: str | None = None,
    ) -> tuple[bytes, str]:
        """A /train form body and the path its response_url replies arrive at."""
        trigger = trigger or f"trg-{uuid.uuid4().hex[:12]}"
        path = f"/commands/{TEAM}/{trigger}"
        form = {
            "token": "legacy-verification-token",
            "team_id": TEAM,
            "team_domain": "fake",
            "channel_id": channel,
            "channel_name": channel_name,
            "user_id": user,
            "user_name": user.lower(),
            "command": "/train",
            "text": text,
            "api_app_id": "A0TRAIN",
            "response_url": self.hooks.url + path,
            "trigger_id": trigger,
        }
        return urlencode(form).encode(), path

    def command(self, text: str, **kwargs: Any) -> tuple[requests.Response, str]:
        body, path = self.command_body(text, **kwargs)
        return self.send(body), path

    def action(
        self,
        action_id: str,
        value: str,
        *,
        user: str = ADA,
        channel: str = CHANNEL,
        message_ts: str = "1700000000.000001",
        select: bool = False,
        trigger: str | None = None,
    ) -> tuple[requests.Response, str]:
        """A button press (or a menu choice, with ``select``) in a message."""
        trigger = trigger or f"trg-{uuid.uuid4().hex[:12]}"
        path = f"/actions/{TEAM}/{trigger}"
        action: dict[str, Any] = {
            "action_id": action_id,
            "block_id": "b1",
            "action_ts": f"{time.time():.6f}",
        }
        if select:
            action |= {"type": "static_select", "selected_option": {"value": value}}
        else:
            action |= {"type": "button", "value": value}
        payload = {
            "type": "block_actions",
            "team": {"id": TEAM, "domain": "fake"},
            "user": {"id": user, "username": user.lower(), "team_id": TEAM},
            "api_app_id": "A0TRAIN",
            "token": "legacy-verification-token",
            "container": {"type": "message", "message_ts": message_ts, "channel_id": channel},
            "trigger_id": trigger,
            "channel": {"id": channel, "name": "ml-training"},
            "message": {"type": "message", "ts": message_ts, "text": ""},
            "response_url": self.hooks.url + path,
            "actions": [action],
        }
        return self.send(urlencode({"payload": json.dumps(payload)}).encode()), path

    def submit_view(
        self, view: dict[str, Any], values: dict[str, Any], *, user: str = ADA
    ) -> requests.Response:
        """``view`` (a modal as views.open got it) submitted by ``user`` with ``values`` as
        its state."""
        payload = {
            "type": "view_submission",
            "team": {"id": TEAM},
            "user": {"id": user, "team_id": TEAM},
            "api_app_id": "A0TRAIN",
            "trigger_id": f"trg-{uuid.uuid4().hex[:8]}",
            "view": {**view, "hash": "1", "state": {"values": values}},
        }
        return self.send(urlencode({"payload": json.dumps(payload)}).encode())

    def event(self, event: dict[str, Any]) -> requests.Response:
        envelope = {
            "token": "legacy-verification-token",
            "team_id": TEAM,
            "api_app_id": "A0TRAIN",
            "event": event,
            "type": "event_callback",
            "event_id": f"Ev{uuid.uuid4().hex[:10]}",
            "event_time": int(time.time()),
        }
        return self.send(json.dumps(envelope).encode(), content_type="application/json")

    # --- reading --------------------------------------------------------------------

    def journal(self, type_: str, **match: Any) -> list[dict[str, Any]]:
        return [
            r
            for r in list(self.records)
            if r["type"] == type_ and all(r.get(k) == v for k, v in match.items())
        ]

    def wait_journal(self, type_: str, timeout: float = 150.0, **match: Any) -> dict[str, Any]:
        wait_until(lambda: bool(self.journal(type_, **match)), timeout, f"a {type_} record")
        return self.journal(type_, **match)[0]

    def root(self, run_id: str) -> FakeMessage:
        """The run's root message as the channel shows it."""
        self.notifier.flush(10)
        with session_scope(self.cp.deps.engine) as session:
            run = session.get(Run, run_id)
            assert run is not None and run.thread_ts is not None
            ref = self.notifier.resolve(
                MessageRef(channel=run.channel or CHANNEL, ts=run.thread_ts), timeout=10
            )
        assert ref is not None
        found = self.fake.message(CHANNEL, ref.ts)
        assert found is not None
        return found

    def thread(self, run_id: str) -> list[FakeMessage]:
        return self.fake.replies(CHANNEL, self.root(run_id).ts)

    def state(self, run_id: str) -> RunState:
        with session_scope(self.cp.deps.engine) as session:
            run = session.get(Run, run_id)
            assert run is not None
            return run.state

    def counts(self) -> dict[str, int]:
        with session_scope(self.cp.deps.engine) as session:
            return {
                table.__name__: session.exec(select(func.count()).select_from(table)).one()
                for table in (Run, Attempt, Alert, CommandLog)
            }

    def only_run(self) -> str:
        with session_scope(self.cp.deps.engine) as session:
            runs = session.exec(select(Run)).all()
            assert len(runs) == 1, [r.id for r in runs]
            return runs[0].id


def slack_settings(
    state: Path,
    *,
    channels: str = f"{CHANNEL},#ml-training",
    launchers: str | None = None,
    local_cores: str | None = "8",
) -> Settings:
    """A local control plane that answers Slack with this app's secret and token; admins
    through @ml-leads; ``launchers`` (None: everyone) may launch."""
    env = {
        "TRAINBOT_STATE_DIR": str(state),
        "TRAINBOT_INGEST_PORT": "0",
        "TRAINBOT_LOCAL_TERMINATION_WINDOW_S": "5",
        "TRAINBOT_NOTIFIER": "slack",
        "TRAINBOT_SLACK_SIGNING_SECRET": SECRET,
        "TRAINBOT_SLACK_BOT_TOKEN": TOKEN,
        "TRAINBOT_ALLOWED_CHANNELS": channels,
        "TRAINBOT_ADMINS": "@ml-leads",
    }
    if launchers is not None:
        env["TRAINBOT_LAUNCHERS"] = launchers
    if local_cores is not None:
        env["TRAINBOT_LOCAL_CORES"] = local_cores
    return load_settings(env)


def terminate_instances(cp: ControlPlane) -> None:
    """The local provider leaves instances running when the control plane stops (as a
    cloud would); a test must not leave training processes behind."""
    provider = cp.deps.provider
    for instance in provider.list_instances():
        if not instance.state.is_terminal():
            provider.terminate(instance.instance_id)


def raise_alert(slack: Slack, run_id: str, signal: Signal) -> str:
    """``signal`` processed for ``run_id`` as the ingest path does; the alert's id."""
    deps = slack.cp.deps
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        (alert,) = alerts.process_signals(
            session, run=run, signals=[signal], now=deps.clock(), target=alert_target(run),
            notifier=deps.notifier, journal=deps.journal,
        )  # fmt: skip
        return alert.id


@contextmanager
def slack_plane(fake: FakeSlack, settings: Settings) -> Iterator[Slack]:
    """The control plane of ``settings`` with the Slack app on ``fake``, started; at the
    end stopped, the instances it left terminated and ``fake`` closed."""
    hooks = ResponseUrls()
    notifier = SlackNotifier(fake.client(TOKEN), min_interval_s=0.02, backoff_s=0.05)
    records: list[dict[str, Any]] = []
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    cp = ControlPlane(settings, notifier=notifier, journal=journal, scheduler=False)
    front = attach(cp, client=fake.client(TOKEN), notifier=notifier)
    cp.start()
    try:
        yield Slack(cp=cp, fake=fake, hooks=hooks, notifier=notifier, front=front, records=records)
    finally:
        front.close()
        cp.close()  # first: a terminated instance looks preempted, and would be resubmitted
        terminate_instances(cp)
        notifier.close(timeout=5)
        hooks.close()
        fake.close()


@pytest.fixture
def slack(tmp_path: Path) -> Iterator[Slack]:
    fake = FakeSlack(
        tokens=[TOKEN], post_interval_s=0.02, burst=5, whole_second_retry_after=False
    ).start()
    fake.add_usergroup("S0LEADS", "ml-leads", [CAROL])
    fake.add_channel(CHANNEL, "ml-training", members=[ADA, BOB, CAROL])
    fake.add_channel(OTHER_CHANNEL, "random", members=[ADA, BOB, CAROL])
    with slack_plane(fake, slack_settings(tmp_path / "state")) as slack:
        yield slack


# ----------------------------------------------------------------------------- tests


def _bad_requests(s: Slack) -> dict[str, tuple[bytes, dict[str, str]]]:
    """Each kind of request Slack did not sign, as (body, headers)."""
    body, _ = s.command_body("launch tiny budget.usd=1")
    now = int(time.time())

    def signed(ts: str, data: bytes = body, secret: str = SECRET) -> dict[str, str]:
        return {"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": sign(data, ts, secret)}

    press = urlencode(
        {"payload": json.dumps({"type": "block_actions", "user": {"id": ADA}, "actions": []})}
    ).encode()
    return {
        "forged": (body, signed(str(now), secret="not-the-secret")),
        "stale": (body, signed(str(now - 301))),
        "future": (body, signed(str(now + 301))),
        "non-numeric timestamp": (body, signed("12345abc")),
        "tampered": (body.replace(b"budget.usd%3D1", b"budget.usd%3D9999"), signed(str(now))),
        "tampered button": (press.replace(b"U0ADA", b"U0BOB"), signed(str(now), press)),
        "unsigned": (body, {}),
        "malformed signature": (
            body,
            {"X-Slack-Request-Timestamp": str(now), "X-Slack-Signature": "v0=zz"},
        ),
    }


def test_bad_requests_get_401_and_do_nothing(slack: Slack) -> None:
    before = slack.counts()
    for name, (body, headers) in _bad_requests(slack).items():
        response = requests.post(
            slack.url,
            data=body,
            headers={"Content-Type": "application/x-www-form-urlencoded", **headers},
            timeout=10,
        )
        assert response.status_code == 401, (name, response.status_code, response.text)
        assert "Traceback" not in response.text
    assert slack.counts() == before
    assert slack.fake.calls == [], "no Web API call for a request Slack did not sign"
    assert slack.hooks.posts == []
    # A good request afterwards is served, and the bad ones left nothing behind.
    response, path = slack.command("status")
    assert response.status_code == 200
    slack.hooks.wait(path)
    assert slack.counts()["Run"] == 0
    assert not slack.fake.calls_to("chat.postMessage")
    assert not slack.journal("submitted")
    # Every answer, refused or not, tells the work pool once it is written, so no work
    # is left waiting for an answer that never ends.
    wait_until(lambda: slack.front.work.in_flight == 0, 10, "every answer to be written")


def test_a_retried_launch_runs_once(slack: Slack) -> None:
    body, path = slack.command_body(f"launch tiny {FAST}", trigger="trg-retried-launch")

    def deliver(retry: int | None) -> int:
        headers = {}
        if retry is not None:
            headers = {"X-Slack-Retry-Num": str(retry), "X-Slack-Retry-Reason": "http_timeout"}
        return slack.send(body, headers=headers).status_code

    statuses: list[int] = []
    for batch in ([None, 1], [2, 3]):  # two pairs of concurrent deliveries
        threads = [threading.Thread(target=lambda r=r: statuses.append(deliver(r))) for r in batch]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert statuses == [200, 200, 200, 200]
    slack.hooks.wait(path)
    run_id = slack.only_run()
    wait_until(lambda: slack.state(run_id) == RunState.AWAITING_CONFIRMATION, what="the preflight")
    assert slack.notifier.flush(10)
    roots = [m for m in slack.fake.messages(CHANNEL) if m.thread_ts is None]
    assert len(roots) == 1 and run_id in json.dumps(roots[0].blocks)
    assert len(slack.hooks.to(path)) == 1, "one confirmation, not one per delivery"
    assert "submitted" in slack.hooks.to(path)[0]["text"]
    assert slack.hooks.to(path)[0]["response_type"] == "ephemeral"
    assert len(slack.journal("submitted")) == 1
    with session_scope(slack.cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None and run.idempotency_key == f"slack:{TEAM}:trg-retried-launch"


def test_help_and_errors_come_back_at_once_and_only_to_the_caller(slack: Slack) -> None:
    response, _ = slack.command("help")
    assert response.status_code == 200
    assert response.json()["response_type"] == "ephemeral"
    assert "/train launch" in response.json()["text"]
    response, _ = slack.command("lanch tiny")
    assert response.json()["response_type"] == "ephemeral"
    assert "Did you mean `launch`" in response.json()["text"]
    # A spec that does not exist is found by the service, after the ack: a private reply.
    response, path = slack.command("launch tinyy")
    assert response.status_code == 200 and response.text == ""
    reply = slack.hooks.wait(path)
    assert reply["response_type"] == "ephemeral"
    assert "did you mean 'tiny'" in reply["text"].lower()
    assert "Traceback" not in reply["text"]
    assert slack.counts()["Run"] == 0


def test_authorization_denials_are_private_audited_and_change_nothing(slack: Slack) -> None:
    # A channel that is not allowed. Channels are allowed by id and by #name here, so
    # Slack's name for the channel is asked after the acknowledgement, and the refusal
    # reaches the person privately.
    response, path = slack.command(
        f"launch tiny {FAST}", channel=OTHER_CHANNEL, channel_name="random"
    )
    assert response.status_code == 200 and response.text == ""
    assert slack.hooks.wait(path) == {
        "text": CHANNEL_DENIED,
        "response_type": "ephemeral",
        "replace_original": False,
    }
    assert slack.counts()["Run"] == 0
    denied = slack.wait_journal("denied", channel=OTHER_CHANNEL)
    assert denied["user"] == ADA and denied["reason"] == "channel not allowed"

    # Ada's run waits for "Launch anyway"; Bob may not press it for her, nor stop it.
    response, path = slack.command(f"launch tiny {FAST}")
    slack.hooks.wait(path)
    run_id = slack.only_run()
    wait_until(lambda: slack.state(run_id) == RunState.AWAITING_CONFIRMATION, what="preflight")
    before = slack.counts()
    _, path = slack.action("launch_anyway", run_id, user=BOB)
    assert "belongs to <@U0ADA>" in slack.hooks.wait(path)["text"]
    assert slack.hooks.wait(path)["response_type"] == "ephemeral"
    response, path = slack.command(f"stop {run_id}", user=BOB)
    assert "only they or an admin" in slack.hooks.wait(path)["text"]
    assert slack.state(run_id) == RunState.AWAITING_CONFIRMATION
    assert slack.counts()["Attempt"] == before["Attempt"]
    assert {(d["user"], d["action"]) for d in slack.journal("denied", run=run_id)} == {
        (BOB, "launch_anyway"),
        (BOB, "stop"),
    }
    # Carol is an admin through the @ml-leads user group: she may stop it.
    response, path = slack.command(f"stop {run_id}", user=CAROL)
    slack.hooks.wait(path)
    assert slack.state(run_id) == RunState.STOPPED
    assert slack.fake.calls_to("usergroups.list")


def test_the_ack_is_quick_even_when_the_work_is_slow(slack: Slack) -> None:
    slack.command("status")  # the first request pays for auth.test; this one is about work
    database = slack.cp.settings.database_url.removeprefix("sqlite:///")
    blocker = sqlite3.connect(database, isolation_level=None, timeout=5)
    blocker.execute("BEGIN IMMEDIATE")  # every write waits for this lock: the work stalls
    try:
        started = time.monotonic()
        response, path = slack.command("status")
        took = time.monotonic() - started
        assert response.status_code == 200 and response.text == ""
        assert took < 1.0, f"the ack took {took:.2f} s; Slack gives up at 3 s"
        time.sleep(0.3)
        assert slack.hooks.to(path) == [], "the work cannot have finished: the database is held"
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert "No active runs" in slack.hooks.wait(path)["text"]


def test_the_launch_modal_and_the_app_home(slack: Slack) -> None:
    response, _ = slack.command("launch")
    assert response.status_code == 200
    assert slack.fake.wait_for(lambda: bool(slack.fake.views), 10)
    view = next(iter(slack.fake.views.values()))
    assert view["callback_id"] == "launch_modal"
    assert json.loads(view["private_metadata"]) == {"channel": CHANNEL}

    def submit(spec: str, overrides: str) -> requests.Response:
        values = {
            "spec": {"spec": {"type": "static_select", "selected_option": {"value": spec}}},
            "overrides": {"overrides": {"type": "plain_text_input", "value": overrides}},
        }
        return slack.submit_view(view, values)

    bad = submit("tiny", "budget.usd")
    assert bad.json()["response_action"] == "errors"
    assert "overrides" in bad.json()["errors"]
    good = submit("tiny", FAST)
    assert good.status_code == 200 and good.text == ""
    wait_until(lambda: slack.counts()["Run"] == 1, what="the run from the modal")
    run_id = slack.only_run()
    with session_scope(slack.cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None and (run.requester, run.channel) == (ADA, CHANNEL)

    assert (
        slack.event(
            {"type": "app_home_opened", "user": ADA, "channel": "D0ADA", "tab": "home"}
        ).status_code
        == 200
    )
    assert slack.fake.wait_for(lambda: ADA in slack.fake.home_views, 10)
    home = json.dumps(slack.fake.home_views[ADA])
    assert "Active runs" in home and run_id in home


def test_the_alert_buttons_snooze_stop_and_resubmit(slack: Slack) -> None:
    deps = slack.cp.deps
    _, path = slack.command(f"launch tiny {FAST}")
    slack.hooks.wait(path)
    run_id = slack.only_run()
    wait_until(lambda: slack.state(run_id) == RunState.AWAITING_CONFIRMATION, what="preflight")
    signal = Signal(
        rule="disk", key="full", severity=Severity.WARNING, title="Scratch disk 93% full",
        detail="93% of 1 GB", hint="Free space or resubmit with a bigger disk",
    )  # fmt: skip
    alert_id = raise_alert(slack, run_id, signal)
    slack.notifier.flush(10)
    message = next(m for m in slack.thread(run_id) if alert_id in json.dumps(m.blocks))

    # Snooze from the menu: four hours, shown on the message.
    before = datetime.now(timezone.utc)
    slack.action("alert_snooze", f"{alert_id}|4h", select=True, message_ts=message.ts)
    slack.wait_journal("alert_snoozed", alert_id=alert_id, timeout=15)
    with session_scope(deps.engine) as session:
        snoozed = session.get(Alert, alert_id)
        assert snoozed is not None and snoozed.snoozed_until is not None
        assert abs((snoozed.snoozed_until - before).total_seconds() - 4 * 3600) < 60
    # Stop run (the owner may), then Resubmit, which Slack delivers twice: a new run
    # resumes the stopped one's work, once.
    slack.action("run_stop", run_id)
    wait_until(lambda: slack.state(run_id) == RunState.STOPPED, what="the stop")
    _, path = slack.action("run_resubmit", run_id, trigger="trg-resubmit")
    slack.action("run_resubmit", run_id, trigger="trg-resubmit")
    assert "Resubmitted" in slack.hooks.wait(path)["text"]
    # A bad press afterwards: once its answer is back, the duplicate has been handled.
    _, path = slack.action("alert_snooze", "al-nope|1h", select=True)
    assert "al-nope" in slack.hooks.wait(path)["text"]
    assert slack.counts()["Run"] == 2
    assert len(slack.hooks.to(f"/actions/{TEAM}/trg-resubmit")) == 1


def test_launch_permission_and_admin_groups_come_from_slack_user_groups(slack: Slack) -> None:
    records: list[tuple[str, dict[str, Any]]] = []
    auth = Authorizer(
        Policy(launchers=frozenset({"@ml-leads", ADA}), admins=frozenset({"S0LEADS"})),
        client=slack.fake.client(TOKEN),
        journal=CallbackJournal(lambda t, run, data: records.append((t, data))),
    )
    who = {u: Caller(team=TEAM, user=u, channel=CHANNEL) for u in (ADA, BOB, CAROL)}
    assert auth.may_launch(who[ADA]) and auth.may_launch(who[CAROL])
    assert not auth.may_launch(who[BOB])
    assert auth.is_admin(who[CAROL]) and not auth.is_admin(who[ADA])
    assert auth.may_change(who[BOB], owner=BOB) and not auth.may_change(who[BOB], owner=ADA)
    assert len(slack.fake.calls_to("usergroups.list")) == 1, "one lookup, cached"
    auth.deny(who[BOB], action="launch", reason="may not launch")
    assert records == [
        ("denied", {"user": BOB, "team": TEAM, "channel": CHANNEL, "action": "launch",
                    "reason": "may not launch"}),
    ]  # fmt: skip
    # When Slack cannot say who is in a group, nobody is: the check fails closed.
    slack.fake.fail_next(method="usergroups.list", error="missing_scope")
    cold = Authorizer(
        Policy(admins=frozenset({"@ml-leads"})),
        client=slack.fake.client(TOKEN),
        journal=CallbackJournal(lambda *_: None),
    )
    assert not cold.is_admin(who[CAROL])


@pytest.mark.slow
def test_the_whole_story_as_slack_messages(slack: Slack) -> None:
    fake, deps = slack.fake, slack.cp.deps

    def launch(spec: str, user: str, extra: str = "") -> str:
        """/train launch → root message → preflight report in its thread → Launch anyway."""
        _, path = slack.command(f"launch {spec} {FAST} {extra}".strip(), user=user)
        assert "submitted" in slack.hooks.wait(path)["text"]
        with session_scope(deps.engine) as session:
            run = session.exec(select(Run.id).where(Run.spec_name == spec)).one()
        wait_until(lambda: slack.state(run) == RunState.AWAITING_CONFIRMATION, what="preflight")
        slack.notifier.flush(10)
        report = next(m for m in slack.thread(run) if "launch_anyway" in json.dumps(m.blocks))
        assert "Preflight for" in json.dumps(report.blocks)
        slack.action("launch_anyway", run, user=user, message_ts=report.ts)
        return run

    def press_ack_once_opened(run: str, found: dict[str, Any]) -> None:
        # A loss spike can settle within seconds, so the on-call engineer is quick.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            opened = slack.journal("alert_opened", run=run, rule="divergent_loss")
            if opened:
                found["alert_id"] = opened[0]["alert_id"]
                found["response"] = slack.action("alert_ack", found["alert_id"], user=CAROL)[0]
                return
            time.sleep(0.05)

    # A steady run: launched, a checkpoint, a preemption → resubmitted and resumed.
    run1 = launch("tiny", ADA, "checkpoint.every_steps=10")
    slack.wait_journal("checkpoint_committed", run=run1)
    with session_scope(deps.engine) as session:
        attempt = active_attempt(session, run1)
        assert attempt is not None and attempt.instance_id is not None
        instance = attempt.instance_id
    deps.provider.preempt(instance)  # type: ignore[attr-defined]

    # Meanwhile a run whose loss diverges; on-call acknowledges its alert from the button.
    run2 = launch("diverge", BOB)
    acked: dict[str, Any] = {}
    watcher = threading.Thread(target=press_ack_once_opened, args=(run2, acked), daemon=True)
    watcher.start()

    slack.wait_journal("resubmitted", run=run1)
    resumed = slack.wait_journal("resumed", run=run1)
    assert resumed["step"] > 0
    slack.notifier.flush(10)
    thread = " ".join(m.text + json.dumps(m.blocks) for m in slack.thread(run1))
    assert f"{ADA} confirmed the launch" in thread
    assert f"resumed at step {resumed['step']}" in thread
    assert "preemption" in thread
    root = slack.root(run1)
    assert root.edits, "the root message is updated in place, never posted again"
    assert "*Attempt*\\n2" in json.dumps(root.blocks)
    assert sum(1 for m in fake.messages(CHANNEL) if m.thread_ts is None) == 2

    watcher.join(130)
    assert acked.get("response") is not None and acked["response"].status_code == 200
    alert_id = acked["alert_id"]
    slack.wait_journal("alert_acknowledged", alert_id=alert_id)
    with session_scope(deps.engine) as session:
        alert = session.get(Alert, alert_id)
        assert alert is not None and alert.acked_by == CAROL and alert.acked_at is not None
    slack.notifier.flush(20)
    alert_msg = next(m for m in slack.thread(run2) if alert_id in json.dumps(m.blocks))
    shown = json.dumps(alert_msg.blocks)
    assert f"Acknowledged by <@{CAROL}>" in shown, "the message says who, for everyone"
    assert "alert_ack" not in shown, "no buttons once acknowledged"
    assert any("alert_ack" in json.dumps(b) for _, b in alert_msg.edits), "updated in place"
    curve = [f for f in fake.files.values() if f.filename == "loss-curve.png"]
    assert curve and curve[0].completed and curve[0].thread_ts == slack.root(run2).ts

    # The digest, at the top of the channel, with its spend chart.
    tasks.digest_job(deps)
    slack.notifier.flush(20)
    digest = [m for m in fake.messages(CHANNEL) if "Daily spend digest" in json.dumps(m.blocks)]
    assert len(digest) == 1 and digest[0].thread_ts is None
    assert any(f.filename == "spend-chart.png" and f.completed for f in fake.files.values())
    assert slack.notifier.metrics["dropped"] == 0
