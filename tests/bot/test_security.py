"""What a chat message can make trainbot do, tried as an attacker in a shared channel would:
signed HTTP into the real Slack app, the real control plane behind it, a fake Slack Web
API at the network edge. Each test is one reproduction from the security issue that must
now do no harm.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import requests
import torch
from sqlmodel import select

from bot.auth import Authorizer, Caller, Policy, redact_command
from bot.listeners.runs import EXTERNAL_DENIED, LAUNCH_DENIED, ONCALL_DENIED
from jobs.database.db import session_scope
from jobs.database.models import Alert, AlertState, OnCall, Run
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.settings import load_settings
from jobs.rules import Severity, Signal
from runner.checkpoint import CheckpointWriter, list_committed
from runner.store import LocalStore
from tests.bot.test_slack_app import (
    FAST,
    SECRET,
    TEAM,
    TOKEN,
    Slack,
    raise_alert,
    slack_plane,
    slack_settings,
    wait_until,
)
from tests.fakes.slack_api import FakeSlack
from tests.jobs.rows import detached
from tests.paths import ROOT

TRAIN, VISION, RANDOM = "C0TRAIN", "C0VISION", "C0RANDOM"
ADA, BOB, CAROL, EVE, MALLORY = "U0ADA", "U0BOB", "U0CAROL", "U0EVE", "U0MALLORY"
OTHER_TEAM = "T0OTHERORG"


@pytest.fixture
def slack(tmp_path: Path) -> Iterator[Slack]:
    """Two team channels (ids only), launchers named, admins through @ml-leads (Carol).
    Ada and Eve are in #ml-training, Bob in #vision; Mallory is a Slack Connect guest
    from another organisation in #ml-training."""
    fake = FakeSlack(
        tokens=[TOKEN], post_interval_s=0.02, burst=5, whole_second_retry_after=False
    ).start()
    fake.add_usergroup("S0LEADS", "ml-leads", [CAROL])
    fake.add_channel(TRAIN, "ml-training", members=[ADA, CAROL, EVE, MALLORY])
    fake.add_channel(VISION, "vision", members=[BOB])
    fake.add_channel(RANDOM, "random", members=[ADA, BOB])
    settings = slack_settings(
        tmp_path / "state",
        channels=f"{TRAIN},{VISION}",
        launchers=f"{ADA},{BOB},@ml-leads",
        local_cores=None,
    )
    with slack_plane(fake, settings) as slack:
        yield slack


def command(
    slack: Slack, text: str, *, user: str = ADA, channel: str = TRAIN, team: str = TEAM
) -> tuple[requests.Response, str]:
    trigger = f"trg-{uuid.uuid4().hex[:12]}"
    path = f"/commands/{trigger}"
    form = {
        "token": "legacy-verification-token",
        "api_app_id": "A0TRAIN",
        "team_id": team,
        "team_domain": "fake",
        "user_name": user.lower(),
        "channel_id": channel,
        "channel_name": "ml-training",
        "user_id": user,
        "command": "/train",
        "text": text,
        "response_url": slack.hooks.url + path,
        "trigger_id": trigger,
    }
    return slack.send(urlencode(form).encode()), path


def answer(slack: Slack, text: str, **kwargs: Any) -> str:
    """The text the person who typed the command sees (ack or response_url)."""
    response, path = command(slack, text, **kwargs)
    if response.text:
        return str(response.json()["text"])
    return str(slack.hooks.wait(path)["text"])


def press(
    slack: Slack,
    action_id: str,
    value: str,
    *,
    user: str,
    channel: str | None,
    team: str = TEAM,
) -> str:
    """A button press in a message in ``channel``, or in the App Home when None; the
    private reply it gets, or "" when there is none within a second."""
    trigger = f"trg-{uuid.uuid4().hex[:12]}"
    path = f"/actions/{trigger}"
    payload: dict[str, Any] = {
        "type": "block_actions",
        "api_app_id": "A0TRAIN",
        "token": "legacy-verification-token",
        "team": {"id": TEAM},
        "user": {"id": user, "team_id": team},
        "trigger_id": trigger,
        "response_url": slack.hooks.url + path,
        "actions": [{"action_id": action_id, "type": "button", "value": value}],
    }
    if channel is None:
        payload["container"] = {"type": "view", "view_id": "V0HOME"}
    else:
        payload["container"] = {"type": "message", "message_ts": "1.1", "channel_id": channel}
        payload["channel"] = {"id": channel, "name": "x"}
    assert slack.send(urlencode({"payload": json.dumps(payload)}).encode()).status_code == 200
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        got = slack.hooks.to(path)
        if got:
            return str(got[0]["text"])
        time.sleep(0.05)
    return ""


def waiting_run(slack: Slack, extra: str = "", *, user: str = ADA, channel: str = TRAIN) -> str:
    """A run launched from chat that waits for "Launch anyway" (no dry run)."""
    before = set(run_ids(slack))
    text = answer(slack, f"launch tiny {FAST} {extra}".strip(), user=user, channel=channel)
    wait_until(lambda: len(run_ids(slack)) > len(before), 15, f"a run ({text})")
    (run_id,) = set(run_ids(slack)) - before
    wait_until(lambda: slack.state(run_id) == RunState.AWAITING_CONFIRMATION, what="preflight")
    return run_id


def run_ids(slack: Slack) -> list[str]:
    with session_scope(slack.cp.deps.engine) as session:
        return list(session.exec(select(Run.id)).all())


def open_alert(slack: Slack, run_id: str) -> str:
    signal = Signal(
        rule="loss", key="nan", severity=Severity.CRITICAL, title="Loss is NaN",
        detail="step 12", hint="Stop the run",
    )  # fmt: skip
    return raise_alert(slack, run_id, signal)


def alert_row(slack: Slack, alert_id: str) -> Alert:
    return detached(slack.cp.deps.engine, Alert, alert_id)


# ----------------------------------------------------------------------------- who


def test_a_user_from_another_organisation_is_refused_and_audited(slack: Slack) -> None:
    assert answer(slack, f"launch tiny {FAST}", user=MALLORY, team=OTHER_TEAM) == EXTERNAL_DENIED
    assert answer(slack, "list all", user=MALLORY, team=OTHER_TEAM) == EXTERNAL_DENIED
    assert run_ids(slack) == []
    denied = slack.wait_journal("denied", user=MALLORY, timeout=10)
    assert denied["reason"] == "external user" and denied["team"] == OTHER_TEAM
    # Their button presses too: Ada's alert stays open.
    run_id = waiting_run(slack)
    alert_id = open_alert(slack, run_id)
    reply = press(slack, "alert_ack", alert_id, user=MALLORY, channel=TRAIN, team=OTHER_TEAM)
    assert reply == EXTERNAL_DENIED
    assert alert_row(slack, alert_id).state == AlertState.OPEN


def test_launchers_are_the_people_the_setting_names(slack: Slack) -> None:
    assert answer(slack, f"launch tiny {FAST}", user=EVE) == LAUNCH_DENIED
    assert run_ids(slack) == []
    waiting_run(slack, user=CAROL)  # a launcher through the @ml-leads group


def test_a_channel_allowed_by_id_is_not_matched_by_name(tmp_path: Path) -> None:
    """``c0priv`` (a channel's name) is not ``C0PRIV`` (an allowed id), and a ``#name``
    is compared with Slack's name for the channel, not the payload's."""
    with FakeSlack(tokens=[TOKEN]) as fake:
        fake.add_channel("C0XYZ", "c0priv")
        fake.add_channel("C0TRAIN", "ml-training")
        fake.add_channel("C0FAKE", "random")
        settings = load_settings(
            {
                "TRAINBOT_STATE_DIR": str(tmp_path),
                "TRAINBOT_ALLOWED_CHANNELS": "C0PRIV,#ML-Training",
                "TRAINBOT_LAUNCHERS": "U1,U2",
            }
        )
        assert settings.launchers == ["U1", "U2"]
        auth = Authorizer(
            Policy.from_settings(settings),
            client=fake.client(TOKEN),
            journal=CallbackJournal(lambda *_: None),
        )

        def allowed(channel: str, claimed_name: str) -> bool:
            return auth.channel_allowed(Caller(TEAM, ADA, channel, claimed_name))

        assert allowed("C0PRIV", "anything")
        assert not allowed("C0XYZ", "c0priv")
        assert allowed("C0TRAIN", "whatever")
        assert not allowed("C0FAKE", "ml-training")
        assert auth.may_launch(Caller(TEAM, "U2", "C0PRIV"))
        assert not auth.may_launch(Caller(TEAM, "U3", "C0PRIV"))


def test_serve_refuses_slack_with_the_local_provider_and_no_launchers(tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")},
        "TRAINBOT_STATE_DIR": str(tmp_path),
        "TRAINBOT_NOTIFIER": "slack",
        "TRAINBOT_SLACK_SIGNING_SECRET": SECRET,
        "TRAINBOT_SLACK_BOT_TOKEN": TOKEN,
        "TRAINBOT_INGEST_PORT": "0",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-m", "bot.cli", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "TRAINBOT_LAUNCHERS is not set" in done.stderr
    assert "Traceback" not in done.stderr


# ----------------------------------------------------------------------------- what


def test_other_channels_runs_cannot_be_read_or_silenced(slack: Slack) -> None:
    run_id = waiting_run(slack)
    alert_id = open_alert(slack, run_id)
    # Bob, in #vision, knows both ids.
    for text in (f"status {run_id}", f"logs {run_id}", f"cleanup {run_id} --dry-run"):
        reply = answer(slack, text, user=BOB, channel=VISION)
        assert f"no run {run_id} reports to this channel" in reply, (text, reply)
    assert run_id not in answer(slack, "list all", user=BOB, channel=VISION)
    assert run_id in answer(slack, "list all", user=ADA, channel=TRAIN)
    for text in (f"ack {alert_id}", f"snooze {alert_id} 7d"):
        reply = answer(slack, text, user=BOB, channel=VISION)
        assert f"no alert {alert_id} in this channel" in reply, (text, reply)
    # Buttons: in a message of another channel, and in Bob's App Home.
    assert "not in" in press(slack, "alert_ack", alert_id, user=BOB, channel=VISION)
    assert "not in" in press(slack, "alert_snooze", f"{alert_id}|4h", user=BOB, channel=None)
    row = alert_row(slack, alert_id)
    assert row.state == AlertState.OPEN and row.snoozed_until is None and row.acked_by is None
    # The App Home lists only the channels the person is in.
    slack.event({"type": "app_home_opened", "user": BOB, "channel": "D0BOB", "tab": "home"})
    slack.event({"type": "app_home_opened", "user": ADA, "channel": "D0ADA", "tab": "home"})
    wait_until(lambda: {ADA, BOB} <= set(slack.fake.home_views), 10, "both homes")
    assert run_id not in json.dumps(slack.fake.home_views[BOB])
    assert alert_id not in json.dumps(slack.fake.home_views[BOB])
    assert run_id in json.dumps(slack.fake.home_views[ADA])
    assert alert_id in json.dumps(slack.fake.home_views[ADA])
    # Ada, who is in the channel, acknowledges from her App Home.
    press(slack, "alert_ack", alert_id, user=ADA, channel=None)
    wait_until(lambda: alert_row(slack, alert_id).acked_by == ADA, 10, "Ada's ack")


def test_only_admins_choose_the_on_call(slack: Slack) -> None:
    assert answer(slack, f"oncall <@{EVE}|eve>", user=EVE) == ONCALL_DENIED
    answer(slack, f"oncall <@{EVE}|eve>", user=CAROL)
    with session_scope(slack.cp.deps.engine) as session:
        row = session.get(OnCall, TRAIN)
        assert row is not None and row.user == f"<@{EVE}>" and row.set_by == CAROL
    assert slack.journal("denied", user=EVE, action="oncall")


def test_a_run_reports_only_to_allowed_channels(slack: Slack) -> None:
    reply = answer(slack, f"launch tiny {FAST} notify.channel={RANDOM}")
    assert "not one of the channels trainbot may post to" in reply
    assert run_ids(slack) == []
    run_id = waiting_run(slack, f"notify.channel={VISION}")
    with session_scope(slack.cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None and run.channel == VISION
    slack.notifier.flush(10)
    assert slack.fake.messages(RANDOM) == []


# ----------------------------------------------------------------------------- how much


def test_an_alias_bomb_is_refused_small_and_fast(slack: Slack) -> None:
    levels = ["&l0 [x,x,x,x,x,x,x,x,x]"] + [
        f"&l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)
    ]
    reply = answer(slack, f'launch tiny "notify.oncall_group=[{", ".join(levels)}]"')
    assert len(reply) < 1000 and "aliases" in reply
    assert run_ids(slack) == []


def test_a_denied_command_is_audited_without_its_values(
    slack: Slack, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "hunter2-wandb-key"
    caplog.set_level(logging.WARNING, logger="bot.auth")
    answer(slack, f"launch tiny env.WANDB_API_KEY={secret}", user=ADA, channel=RANDOM)
    answer(slack, f"launch tiny env.WANDB_API_KEY={secret}", user=EVE)
    wait_until(lambda: len(slack.journal("denied")) >= 2, 10, "two denials")
    denials = slack.journal("denied")
    assert any("env.WANDB_API_KEY=…" in d["action"] for d in denials), denials
    assert secret not in json.dumps(denials)
    assert secret not in caplog.text
    assert redact_command(f"/train launch tiny budget.usd=5 env.K='{secret} x'") == (
        "/train launch tiny budget.usd=… env.K=… …"
    )


# ----------------------------------------------------------------------------- where


def _checkpoint(root: Path, run_id: str, steps: list[int]) -> LocalStore:
    store = LocalStore(root / run_id)
    writer = CheckpointWriter(store)
    for step in steps:
        writer.save(step, {"w": torch.full((4,), float(step))}).result()
    writer.close()
    return store


@pytest.mark.parametrize(
    "override",
    [
        "env.TRAINBOT_CHECKPOINT_PREFIX={victim}",
        "checkpoint.uri={root}?",
        "checkpoint.uri={root}/../..",
        "checkpoint.uri=/",
        "checkpoint.uri=file:///etc",
        "checkpoint.uri={root}/%2e%2e",
    ],
)
def test_a_spec_cannot_choose_another_runs_checkpoints(slack: Slack, override: str) -> None:
    root = slack.cp.settings.checkpoint_uri.removeprefix("file://")
    victim = waiting_run(slack, user=CAROL)
    store = _checkpoint(Path(root), victim, [10, 20, 30])
    reply = answer(slack, f"launch tiny {FAST} retention.keep_last=1 " + override.format(
        victim=victim, root=root
    ))  # fmt: skip
    assert run_ids(slack) == [victim], reply
    assert [e.step for e in list_committed(store)] == [10, 20, 30]


def test_cleanup_deletes_only_in_the_runs_own_directory(slack: Slack) -> None:
    root = Path(slack.cp.settings.checkpoint_uri.removeprefix("file://"))
    victim = waiting_run(slack, user=CAROL)
    own = waiting_run(slack, "retention.keep_last=1")
    victims = _checkpoint(root, victim, [10, 20, 30])
    mine = _checkpoint(root, own, [1, 2, 3])
    reply = answer(slack, f"cleanup {own}")
    assert "Traceback" not in reply
    assert [e.step for e in list_committed(mine)] == [3]
    assert [e.step for e in list_committed(victims)] == [10, 20, 30]
    # A row that names another run's directory (written before the column existed, or
    # by hand) cannot be used either: cleanup refuses instead of deleting.
    with session_scope(slack.cp.deps.engine) as session:
        run = session.get(Run, own)
        assert run is not None
        run.checkpoint_prefix = "../" + victim
        run.checkpoint_uri = "file:///"
        session.add(run)
    answer(slack, f"cleanup {own}")
    assert [e.step for e in list_committed(victims)] == [10, 20, 30]


def test_an_error_reply_never_carries_markup_from_the_request(slack: Slack) -> None:
    """A button's value is the request's to choose: quoted back in an error, it is text."""
    reply = press(
        slack, "alert_snooze", "<!channel> <https://evil.example|x>|4h", user=ADA, channel=TRAIN
    )
    assert "names no alert" in reply
    assert "<!channel>" not in reply and "<https://" not in reply
    assert "&lt;!channel&gt;" in reply
