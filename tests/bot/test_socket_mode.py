"""The Slack app in Socket Mode, against a local Slack speaking the real protocol.

The control plane runs as ``trainbot serve`` runs it with ``TRAINBOT_SLACK_APP_TOKEN``
set: :meth:`bot.slack_wsgi.SlackFrontEnd.start` asks the fake Web API
(:class:`tests.fakes.slack_api.FakeSlack`) for a connection URL with
``apps.connections.open``, opens a WebSocket to :class:`tests.fakes.slack_socket.FakeSocketMode`
(RFC 6455, Slack's ``hello``, envelopes, acknowledgements), and answers the slash
commands it is sent. Replies to a command's ``response_url`` go to the recording
server of :mod:`tests.bot.test_slack_app`; posts go to the fake Web API.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from bot.app import SlackSetupError
from bot.slack_notifier import SlackNotifier
from bot.slack_wsgi import SlackFrontEnd
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import Settings
from tests.bot.test_slack_app import (
    ADA,
    CHANNEL,
    FAST,
    TEAM,
    TOKEN,
    ResponseUrls,
    slack_plane,
    slack_settings,
    wait_until,
)
from tests.fakes.slack_api import FakeSlack
from tests.fakes.slack_socket import FakeSocketMode

APP_TOKEN = "xapp-1-A0TRAIN-1-socket-mode-test"
#: Slack's deadline for an acknowledgement; after it, the user sees an error.
SLACK_DEADLINE_S = 3.0


@dataclass
class SocketSlack:
    """The control plane with the Slack app, Slack's WebSocket end and its Web API."""

    cp: ControlPlane
    fake: FakeSlack
    socket: FakeSocketMode
    hooks: ResponseUrls
    notifier: SlackNotifier
    front: SlackFrontEnd

    def command(self, text: str, *, user: str = ADA) -> tuple[str, str]:
        """Send ``/train text`` over the socket; (envelope id, response_url path)."""
        trigger = f"trg-{uuid.uuid4().hex[:12]}"
        path = f"/commands/{TEAM}/{trigger}"
        payload = {
            "token": "legacy-verification-token",
            "team_id": TEAM,
            "team_domain": "fake",
            "channel_id": CHANNEL,
            "channel_name": "ml-training",
            "user_id": user,
            "user_name": user.lower(),
            "command": "/train",
            "text": text,
            "api_app_id": "A0TRAIN",
            "is_enterprise_install": "false",
            "response_url": self.hooks.url + path,
            "trigger_id": trigger,
        }
        return self.socket.slash_command(payload), path


def socket_settings(state: Path, app_token: str = APP_TOKEN) -> Settings:
    return slack_settings(state).model_copy(update={"slack_app_token": SecretStr(app_token)})


@pytest.fixture
def socket_slack(tmp_path: Path) -> Iterator[SocketSlack]:
    fake = FakeSlack(
        tokens=[TOKEN],
        app_tokens=[APP_TOKEN],
        post_interval_s=0.02,
        burst=5,
        whole_second_retry_after=False,
    ).start()
    settings = socket_settings(tmp_path / "state")
    # The socket's server listens before the app connects, and stops after it.
    with FakeSocketMode(fake) as server, slack_plane(fake, settings) as slack:
        yield SocketSlack(slack.cp, fake, server, slack.hooks, slack.notifier, slack.front)


def socket_threads() -> set[threading.Thread]:
    """Threads a Socket Mode client may have started (everything but pytest's own)."""
    return {t for t in threading.enumerate() if t is not threading.main_thread()}


# ----------------------------------------------------------------------------- tests


def test_slash_commands_over_socket_mode_are_acknowledged_and_done(
    socket_slack: SocketSlack,
) -> None:
    s = socket_slack
    s.front.start()

    connection = s.socket.wait_connected()
    opened = s.fake.calls_to("apps.connections.open")
    assert [(c.token, c.ok) for c in opened] == [(APP_TOKEN, True)]
    assert s.socket.refused == []

    # Help is answered in the acknowledgement itself, to the caller only.
    sent: list[str] = []
    envelope = s.command("help")[0]
    sent.append(envelope)
    ack = s.socket.wait_ack(envelope, timeout=SLACK_DEADLINE_S)
    assert ack["payload"]["response_type"] == "ephemeral"
    assert "/train launch" in ack["payload"]["text"]

    # Status: an empty acknowledgement, then the answer through the response_url.
    envelope, path = s.command("status")
    sent.append(envelope)
    ack = s.socket.wait_ack(envelope, timeout=SLACK_DEADLINE_S)
    assert not ack.get("payload")
    assert "No active runs" in s.hooks.wait(path)["text"]

    # A launch: acknowledged, the run is created, its card is posted to the channel
    # through the Web API, and the caller gets a private confirmation.
    envelope, path = s.command(f"launch tiny {FAST}")
    sent.append(envelope)
    s.socket.wait_ack(envelope, timeout=SLACK_DEADLINE_S)
    reply = s.hooks.wait(path)
    assert "submitted" in reply["text"] and reply["response_type"] == "ephemeral"
    with_state: dict[str, Any] = {}

    def root_posted() -> bool:
        roots = [m for m in s.fake.messages(CHANNEL) if m.thread_ts is None]
        with_state["roots"] = roots
        return bool(roots)

    wait_until(root_posted, 30, "the run's card in the channel")
    posts = [c for c in s.fake.calls_to("chat.postMessage") if c.ok]
    assert posts and all(c.token == TOKEN for c in posts), "posts use the bot token"
    assert "tiny" in json.dumps(with_state["roots"][0].blocks)

    # Each envelope was acknowledged once, on the one connection, which is still up.
    acked = [m["envelope_id"] for m in connection.received if "envelope_id" in m]
    assert sorted(acked) == sorted(sent)
    assert not connection.ended.is_set()
    assert len(s.socket.connections) == 1


def test_a_refresh_request_reconnects_and_commands_keep_working(
    socket_slack: SocketSlack,
) -> None:
    s = socket_slack
    s.front.start()
    first = s.socket.wait_connected()

    s.socket.request_refresh(first)

    second = s.socket.wait_connected(2)
    assert second.ticket != first.ticket, "a fresh URL from apps.connections.open"
    assert len(s.fake.calls_to("apps.connections.open")) == 2
    assert first.ended.wait(10), "the old connection is let go"
    envelope, path = s.command("status")
    ack = s.socket.wait_ack(envelope, timeout=SLACK_DEADLINE_S)
    assert ack in second.received
    assert "No active runs" in s.hooks.wait(path)["text"]


def test_close_shuts_the_connection_down_without_reconnecting(
    socket_slack: SocketSlack,
) -> None:
    s = socket_slack
    before = socket_threads()
    s.front.start()
    connection = s.socket.wait_connected()
    envelope, path = s.command("status")
    s.socket.wait_ack(envelope, timeout=SLACK_DEADLINE_S)

    s.front.close()

    assert connection.ended.wait(10), "the WebSocket is closed"
    assert connection.end_reason in ("eof", "close frame")
    # The command's work finished before close() returned: nothing is dropped.
    assert "No active runs" in s.hooks.to(path)[0]["text"]
    assert s.front.socket is None
    # Every thread the client started has ended, so nothing is left to reconnect...
    leftover = [t.name for t in socket_threads() - before if t.is_alive()]
    wait_until(
        lambda: not [t for t in socket_threads() - before if t.is_alive()],
        10,
        f"the Socket Mode threads to end (alive: {leftover})",
    )
    # ...and nothing did: one URL asked for, one connection made.
    assert len(s.fake.calls_to("apps.connections.open")) == 1
    assert len(s.socket.connections) == 1


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (
            "xapp-1-A0TRAIN-1-revoked",
            "Slack refused to open a Socket Mode connection (invalid_auth)",
        ),
        (TOKEN, "TRAINBOT_SLACK_APP_TOKEN is not an app-level token"),
    ],
)
def test_a_bad_app_token_is_a_clear_setup_error_and_leaves_nothing_running(
    socket_slack: SocketSlack, token: str, message: str
) -> None:
    s = socket_slack
    s.front.app_token = token  # as if TRAINBOT_SLACK_APP_TOKEN were set to it
    before = socket_threads()

    with pytest.raises(SlackSetupError) as refused:
        s.front.start()

    assert message in str(refused.value)
    assert "TRAINBOT_SLACK_APP_TOKEN" in str(refused.value)
    assert s.front.socket is None
    assert s.socket.connections == []
    wait_until(
        lambda: not [t for t in socket_threads() - before if t.is_alive()],
        10,
        "the refused client's threads to end",
    )


def test_slack_with_socket_mode_off_is_a_clear_setup_error(socket_slack: SocketSlack) -> None:
    s = socket_slack
    s.socket.close()  # the app's settings have Socket Mode off: no URL to hand out

    with pytest.raises(SlackSetupError, match="socket_mode_not_enabled"):
        s.front.start()
    assert s.front.socket is None
