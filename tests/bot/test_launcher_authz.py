"""Who may start compute, and act in a channel, decided once for every front end.

Signed HTTP into the real Slack app over the real control plane, and the real console.
A launcher's removal is what it is in production: ``TRAINBOT_LAUNCHERS`` is read when
the process starts, so the control plane is restarted on the same state directory with
the new list (as a redeploy does), and every old message's buttons stay pressable.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from bot.auth import (
    LAUNCH_DENIED,
    NOT_A_MEMBER,
    NOT_IN_CHANNEL,
    PRIVATE_CHANNEL_DENIED,
    Ask,
    Authorizer,
    Caller,
    Policy,
)
from bot.console import ConsoleNotifier, Shell
from bot.listeners.runs import MODAL_CALLBACK
from bot.slack_notifier import SlackNotifier
from bot.slack_wsgi import attach
from jobs.database.db import session_scope
from jobs.database.models import AlertState, Run
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.usecases import service
from jobs.usecases.service import Actor
from tests.bot.test_security import (
    alert_row,
    answer,
    open_alert,
    press,
    run_ids,
    waiting_run,
)
from tests.bot.test_slack_app import (
    FAST,
    TEAM,
    TOKEN,
    ResponseUrls,
    Slack,
    slack_settings,
    terminate_instances,
    wait_until,
)
from tests.fakes.slack_api import FakeSlack
from tests.jobs.test_profile import asked_run

TRAIN, PRIVATE = "C0TRAIN", "C0SECRET"
ADA, BOB, CAROL, EVE, DAVE = "U0ADA", "U0BOB", "U0CAROL", "U0EVE", "U0DAVE"
FRANK = "U0FRANK"  # an admin in no channel
EVERYONE = f"{ADA},{BOB},{EVE},{DAVE},@ml-leads"


class Deployment:
    """One state directory and one Slack workspace; the control plane in front of them
    can be restarted with other settings, as a redeploy would."""

    def __init__(self, tmp_path: Path) -> None:
        self.state = tmp_path / "state"
        self.fake = FakeSlack(
            tokens=[TOKEN], post_interval_s=0.02, burst=5, whole_second_retry_after=False
        ).start()
        self.fake.add_usergroup("S0LEADS", "ml-leads", [CAROL, FRANK])
        # Dave is one of the team but not in #ml-training; only Bob is in the private one.
        self.fake.add_channel(TRAIN, "ml-training", members=[ADA, CAROL, EVE])
        self.fake.add_channel(PRIVATE, "secret-project", is_private=True, members=[BOB])
        self.hooks = ResponseUrls()
        self.records: list[dict[str, Any]] = []
        self.slack: Slack | None = None

    def start(self, launchers: str) -> Slack:
        notifier = SlackNotifier(self.fake.client(TOKEN), min_interval_s=0.02, backoff_s=0.05)
        journal = CallbackJournal(
            lambda t, run, data: self.records.append({"type": t, "run": run, **data})
        )
        settings = slack_settings(
            self.state, channels=f"{TRAIN},{PRIVATE}", launchers=launchers, local_cores=None
        )
        cp = ControlPlane(settings, notifier=notifier, journal=journal, scheduler=False)
        front = attach(cp, client=self.fake.client(TOKEN), notifier=notifier)
        cp.start()
        self.slack = Slack(
            cp=cp, fake=self.fake, hooks=self.hooks, notifier=notifier, front=front,
            records=self.records,
        )  # fmt: skip
        return self.slack

    def restart(self, launchers: str) -> Slack:
        self.stop()
        return self.start(launchers)

    def stop(self) -> None:
        if self.slack is None:
            return
        slack, self.slack = self.slack, None
        slack.front.close()
        slack.cp.close()
        terminate_instances(slack.cp)
        slack.notifier.close(timeout=5)

    def close(self) -> None:
        self.stop()
        self.hooks.close()
        self.fake.close()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    found = Deployment(tmp_path)
    try:
        yield found
    finally:
        found.close()


def _stopped_run(slack: Slack, *, user: str) -> str:
    """A run of ``user``'s, launched from chat and stopped before its launch."""
    run_id = waiting_run(slack, user=user, channel=TRAIN)
    service.stop(slack.cp.deps, run_id, Actor(user=user, channel=TRAIN))
    return run_id


def _asked_run(slack: Slack, *, user: str) -> str:
    """A run its projection stopped to ask Continue or Stop (tests/jobs/test_profile.py)."""
    engine = slack.cp.deps.engine
    return asked_run(engine, requester=user, channel=TRAIN, command=["python", "-c", "pass"])


def _submit_modal(slack: Slack, *, user: str, overrides: str) -> None:
    """The launch form, submitted by ``user`` from #ml-training."""
    values = {
        "spec": {"spec": {"type": "static_select", "selected_option": {"value": "tiny"}}},
        "overrides": {"overrides": {"type": "plain_text_input", "value": overrides}},
    }
    view = {
        "id": f"V{uuid.uuid4().hex[:8].upper()}",
        "type": "modal",
        "callback_id": MODAL_CALLBACK,
        "private_metadata": json.dumps({"channel": TRAIN}),
    }
    response = slack.submit_view(view, values, user=user)
    assert response.status_code == 200 and response.text == ""


def _states(slack: Slack) -> dict[str, RunState]:
    with session_scope(slack.cp.deps.engine) as session:
        return {r.id: r.state for r in session.exec(select(Run)).all()}


def test_a_removed_launcher_can_start_nothing_through_any_command_or_button(
    deployment: Deployment, tmp_path: Path
) -> None:
    # Eve launches while she is on the list: runs waiting for "Launch anyway", stopped
    # ones to resubmit, and one its projection stopped to ask Continue.
    slack = deployment.start(launchers=EVERYONE)
    waiting = waiting_run(slack, user=EVE, channel=TRAIN)
    stopped = _stopped_run(slack, user=EVE)
    asked = _asked_run(slack, user=EVE)
    ada_stopped = _stopped_run(slack, user=ADA)

    # An admin removes her, and the control plane is redeployed with the new list.
    slack = deployment.restart(launchers=f"{ADA},{BOB},@ml-leads")
    before = _states(slack)
    attempts = slack.counts()["Attempt"]
    marker = tmp_path / "owned"
    commands = [
        f"launch tiny {FAST}",
        f"preflight tiny {FAST}",
        f"resubmit {stopped} \"command=sh -c 'touch {marker}'\"",
        f"resubmit {stopped}",
        f"resubmit {stopped} from=0",
        f"resubmit {stopped} budget.usd=5000",
        f"resubmit {waiting}",  # a run awaiting confirmation: this is "Launch anyway"
        f"resubmit {asked}",
    ]
    for text in commands:
        assert answer(slack, text, user=EVE, channel=TRAIN) == LAUNCH_DENIED, text
    # Every button on her old messages, in the channel and in her App Home.
    buttons = [
        ("launch_anyway", waiting),
        ("run_resubmit", stopped),
        ("run_resubmit_from", f"{stopped}|0"),
        ("profile_continue", asked),
        ("profile_continue", f"{asked}|500"),
    ]
    for action_id, value in buttons:
        for channel in (TRAIN, None):
            reply = press(slack, action_id, value, user=EVE, channel=channel)
            assert reply == LAUNCH_DENIED, (action_id, channel, reply)
    # The launch form: not opened for her, and refused if submitted all the same.
    assert answer(slack, "launch", user=EVE, channel=TRAIN) == LAUNCH_DENIED
    assert slack.fake.calls_to("views.open") == []
    _submit_modal(slack, user=EVE, overrides=FAST)
    wait_until(
        lambda: any(c.args.get("user") == EVE for c in slack.fake.calls_to("chat.postEphemeral")),
        10,
        "the form's refusal",
    )
    ephemeral = [c.args for c in slack.fake.calls_to("chat.postEphemeral")]
    assert any(a.get("user") == EVE and a.get("text") == LAUNCH_DENIED for a in ephemeral)

    # Nothing started: no new run, every old one where it was, the command never ran.
    assert _states(slack) == before
    assert slack.counts()["Attempt"] == attempts
    assert not marker.exists()
    denied = slack.journal("denied", user=EVE)
    assert len(denied) == len(commands) + 2 * len(buttons) + 2
    assert {d["reason"] for d in denied} == {"may not launch"}
    assert str(marker) not in json.dumps(denied)

    # Stopping her own run still works: only starting compute needs the list.
    answer(slack, f"stop {waiting}", user=EVE, channel=TRAIN)
    wait_until(lambda: slack.state(waiting) == RunState.STOPPED, 10, "Eve's stop")
    # And the list is the one it runs with now: Ada, still on it, resubmits.
    assert answer(slack, f"resubmit {ada_stopped}", user=ADA, channel=TRAIN).startswith(
        f"Resubmitted {ada_stopped} as r-"
    )
    wait_until(lambda: len(_states(slack)) == len(before) + 1, 15, "Ada's resubmit")


def test_someone_taken_out_of_a_launcher_group_starts_nothing_seconds_later(
    deployment: Deployment,
) -> None:
    """A launcher group's members are looked up again when compute is about to start
    (after 15 s at most), not after the five minutes other questions trust them."""
    fake = deployment.fake
    fake.add_usergroup("S0TRAIN", "trainers", [EVE])
    now = [0.0]
    auth = Authorizer(
        Policy(launchers=frozenset({"@trainers"})),
        client=fake.client(TOKEN),
        journal=CallbackJournal(lambda *_: None),
        clock=lambda: now[0],
    )
    eve = Caller(team=TEAM, user=EVE, channel=TRAIN)
    launch = Ask(action="launch", starts_compute=True)
    assert auth.decide(eve, launch) is None
    fake.add_usergroup("S0TRAIN", "trainers", [ADA])  # an admin takes Eve out
    now[0] = 16.0
    denial = auth.decide(eve, launch)
    assert denial is not None and denial.text == LAUNCH_DENIED
    assert len(fake.calls_to("usergroups.list")) == 2


def test_a_button_in_a_channel_message_is_for_that_channels_members(
    deployment: Deployment,
) -> None:
    slack = deployment.start(launchers=EVERYONE)
    run_id = waiting_run(slack, user=ADA, channel=TRAIN)
    alert_id = open_alert(slack, run_id)
    # Dave is one of the team, and a launcher, but not in #ml-training: a public channel
    # he can open, so its messages' buttons reach him.
    assert press(slack, "alert_ack", alert_id, user=DAVE, channel=TRAIN) == NOT_A_MEMBER
    assert press(slack, "alert_snooze", f"{alert_id}|4h", user=DAVE, channel=TRAIN) == NOT_A_MEMBER
    assert press(slack, "alert_ack", alert_id, user=DAVE, channel=None) == (
        NOT_IN_CHANNEL.format(target=alert_id)
    )
    row = alert_row(slack, alert_id)
    assert row.state == AlertState.OPEN and row.acked_by is None and row.snoozed_until is None
    denied = slack.journal("denied", user=DAVE, action="alert_ack")
    assert denied and denied[0]["reason"] == f"not a member of {TRAIN}"
    # Eve, who is in it, acknowledges from the same message.
    press(slack, "alert_ack", alert_id, user=EVE, channel=TRAIN)
    wait_until(lambda: alert_row(slack, alert_id).acked_by == EVE, 10, "Eve's ack")
    # An admin acts in every channel, by command or button, member or not.
    other = open_alert(slack, waiting_run(slack, user=ADA, channel=TRAIN))
    press(slack, "alert_ack", other, user=FRANK, channel=TRAIN)
    wait_until(lambda: alert_row(slack, other).acked_by == FRANK, 10, "the admin's ack")


def test_a_run_reports_to_a_private_channel_only_for_its_members(
    deployment: Deployment,
) -> None:
    slack = deployment.start(launchers=EVERYONE)
    reply = answer(slack, f"launch tiny {FAST} notify.channel={PRIVATE}", user=ADA, channel=TRAIN)
    assert reply == PRIVATE_CHANNEL_DENIED
    assert run_ids(slack) == []
    slack.notifier.flush(10)
    assert slack.fake.messages(PRIVATE) == []
    assert slack.journal("denied", user=ADA, action="launch")
    # Bob, a member, may send his run's card there (he launches from #ml-training too).
    run_id = waiting_run(slack, f"notify.channel={PRIVATE}", user=BOB, channel=TRAIN)
    with session_scope(slack.cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None and run.channel == PRIVATE
    slack.notifier.flush(10)
    assert slack.fake.messages(PRIVATE)


def test_a_non_launcher_in_the_console_is_refused_as_in_slack(tmp_path: Path) -> None:
    def console(launchers: str) -> ControlPlane:
        settings = load_settings(
            {
                "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
                "TRAINBOT_INGEST_PORT": "0",
                "TRAINBOT_LAUNCHERS": launchers,
            }
        )
        journal = CallbackJournal(lambda t, run, data: records.append({"type": t, **data}))
        return ControlPlane(
            settings, notifier=ConsoleNotifier(io.StringIO()), journal=journal, scheduler=False
        )

    records: list[dict[str, Any]] = []

    with console("ada,eve") as cp:
        eve = Shell(cp.deps, user="eve", out=io.StringIO())
        reply = eve.run_line(f"/train launch tiny {FAST}")
        assert reply is not None and "submitted" in reply.text, reply
        wait_until(lambda: len(_console_runs(cp)) == 1, 15, "Eve's run")
        (eves,) = _console_runs(cp)
        wait_until(lambda: _console_state(cp, eves) == RunState.AWAITING_CONFIRMATION, 30)
        service.stop(cp.deps, eves, Actor(user="eve", channel="console"))

    with console("ada") as cp:  # Eve removed
        eve = Shell(cp.deps, user="eve", out=io.StringIO())
        for text in (f"launch tiny {FAST}", f"preflight tiny {FAST}", f"resubmit {eves}"):
            reply = eve.run_line(text)
            assert reply is not None and reply.text == LAUNCH_DENIED, (text, reply)
        assert _console_runs(cp) == [eves]
        assert [r["reason"] for r in records if r["type"] == "denied"] == ["may not launch"] * 3
        # Nobody is an admin at the terminal unless the settings say so.
        ada = Shell(cp.deps, user="ada", out=io.StringIO())
        reply = ada.run_line(f"stop {eves}")
        assert reply is not None and "belongs to" in reply.text
        reply = ada.run_line(f"launch tiny {FAST}")
        assert reply is not None and reply.text != LAUNCH_DENIED
        wait_until(lambda: len(_console_runs(cp)) == 2, 15, "Ada's run")


def _console_runs(cp: ControlPlane) -> list[str]:
    with session_scope(cp.deps.engine) as session:
        return list(session.exec(select(Run.id)).all())


def _console_state(cp: ControlPlane, run_id: str) -> RunState:
    with session_scope(cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        return run.state
