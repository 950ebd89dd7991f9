"""What Slack refuses, and what must never reach a channel.

The fake Slack Web API refuses what Slack refuses (its limits are listed in
:mod:`tests.fakes.slack_api`); the real notifier, views, dispatch and App Home talk to it.
Big reports and lists arrive whole or with an honest count of what they leave out; a
report Slack refuses still brings its verdict and its button; user text never pings a
channel or becomes a link; an escalation pages by id.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from slack_sdk.errors import SlackApiError

from bot.mentions import MentionResolver
from bot.slack_notifier import SlackNotifier
from jobs import alerts
from jobs.database.db import session_scope
from jobs.database.models import Alert, AlertState, Run
from jobs.domain.lifecycle import RunState
from jobs.domain.severity import Severity
from jobs.outbound.notify import (
    AlertMessage,
    CallbackJournal,
    CheckLine,
    MessageRef,
    PreflightMessage,
    TextMessage,
)
from tests.bot.test_slack_app import CHANNEL, Slack
from tests.bot.test_slack_app import slack as slack  # the fixture
from tests.fakes.slack_api import FakeSlack

RUNS = "C0RUNS"
EVIL = "<!channel> <https://evil.example|click>"
#: What would ping many people, or be a link trainbot did not make.
PINGS = re.compile(r"<!(channel|here|everyone)\b|<https?://")


@pytest.fixture
def fake() -> Iterator[FakeSlack]:
    with FakeSlack(post_interval_s=0.01, burst=10, whole_second_retry_after=False) as fake:
        yield fake


@pytest.fixture
def notifier(fake: FakeSlack) -> Iterator[SlackNotifier]:
    notifier = SlackNotifier(fake.client(retry_handlers=[]), min_interval_s=0.0, backoff_s=0.01)
    yield notifier
    notifier.close(timeout=5)


def everything(message: Any) -> str:
    """A message's text and blocks as one string, as Slack would render them."""
    return message.text + json.dumps(message.blocks or [], ensure_ascii=False)


# --------------------------------------------------------------------------- the fake


def block(**kw: Any) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": "x"}, **kw}


def button(**kw: Any) -> dict[str, Any]:
    return {
        "type": "button",
        "text": {"type": "plain_text", "text": "Go"},
        "action_id": "go",
        "value": "v",
        **kw,
    }


def mrkdwn(n: int) -> dict[str, Any]:
    return {"type": "mrkdwn", "text": "x" * n}


@pytest.mark.parametrize(
    ("what", "args", "error"),
    [
        ("text 40,001", {"text": "x" * 40_001}, "msg_too_long"),
        ("51 blocks", {"blocks": [block() for _ in range(51)]}, "invalid_blocks"),
        ("section 3,001", {"blocks": [block(text=mrkdwn(3001))]}, "invalid_blocks"),
        (
            "header 151",
            {"blocks": [{"type": "header", "text": {"type": "plain_text", "text": "x" * 151}}]},
            "invalid_blocks",
        ),
        ("11 fields", {"blocks": [block(fields=[mrkdwn(1)] * 11)]}, "invalid_blocks"),
        ("field 2,001", {"blocks": [block(fields=[mrkdwn(2001)])]}, "invalid_blocks"),
        (
            "11 context elements",
            {"blocks": [{"type": "context", "elements": [mrkdwn(1)] * 11}]},
            "invalid_blocks",
        ),
        ("block_id 256", {"blocks": [block(block_id="b" * 256)]}, "invalid_blocks"),
        (
            "button text 76",
            {
                "blocks": [
                    {
                        "type": "actions",
                        "elements": [button(text={"type": "plain_text", "text": "x" * 76})],
                    }
                ]
            },
            "invalid_blocks",
        ),
        (
            "button value 2,001",
            {"blocks": [{"type": "actions", "elements": [button(value="v" * 2001)]}]},
            "invalid_blocks",
        ),
        (
            "action_id 256",
            {"blocks": [{"type": "actions", "elements": [button(action_id="a" * 256)]}]},
            "invalid_blocks",
        ),
        (
            "blocks' text 13,001",
            {"blocks": [block(text=mrkdwn(2600)) for _ in range(6)]},
            "msg_blocks_too_long",
        ),
    ],
)
def test_the_fake_refuses_what_slack_refuses(
    fake: FakeSlack, what: str, args: dict[str, Any], error: str
) -> None:
    client = fake.client()
    with pytest.raises(SlackApiError) as refused:
        client.chat_postMessage(channel=RUNS, **({"text": "t"} | args))
    assert refused.value.response["error"] == error, what
    # At the limit itself it is fine.
    client.chat_postMessage(channel=RUNS, text="x" * 40_000, blocks=[block(text=mrkdwn(3000))])
    with pytest.raises(SlackApiError) as view:
        client.views_publish(user_id="U0ADA", view={"type": "home", "blocks": [block()] * 101})
    assert view.value.response["error"] == "invalid_blocks"


# --------------------------------------------------------------------------- preflight


def report(checks: int, *, thread_ts: str | None = None) -> PreflightMessage:
    lines = tuple(
        CheckLine(
            f"check-{i}",
            "warn" if i % 7 == 0 else "pass",
            f"detail {i}: " + "the quota, the image, the bucket and the price all look " * 8,
            "raise the quota" if i % 7 == 0 else "",
        )
        for i in range(checks)
    )
    return PreflightMessage(
        channel=RUNS,
        thread_ts=thread_ts,
        run_id="r-big",
        checks=lines,
        ok=True,
        needs_confirmation=True,
        estimate_usd=12.5,
    )


def shown_and_hidden(text: str, total: int, what: str) -> tuple[int, int]:
    shown = len(set(re.findall(r"check-(\d+)\b", text)))
    more = re.search(rf"…and (\d+) more {what}", text)
    return shown, int(more.group(1)) if more else 0


def test_a_60_check_preflight_report_arrives_whole_or_counted(
    fake: FakeSlack, notifier: SlackNotifier
) -> None:
    notifier.post(report(60))
    assert notifier.flush(timeout=10)
    [message] = fake.messages(RUNS)
    assert message.blocks is not None, "the full blocks were accepted"
    text = json.dumps(message.blocks, ensure_ascii=False)
    shown, hidden = shown_and_hidden(text, 60, "checks")
    assert shown + hidden == 60 and hidden > 0
    for i in range(0, 60, 7):
        assert f"check-{i}" in text, "the warnings are shown before the passes"
    assert "Launch anyway" in text and "/train resubmit r-big" in text
    assert notifier.metrics["dropped"] == 0


def test_a_report_slack_refuses_still_brings_its_verdict_and_button(
    fake: FakeSlack, notifier: SlackNotifier
) -> None:
    root = notifier.post(TextMessage(channel=RUNS, kind="launched", text="r-big submitted"))
    assert notifier.flush(timeout=10)
    fake.fail_next(1, method="chat.postMessage", error="msg_blocks_too_long")
    notifier.post(report(60, thread_ts=root.ts))
    assert notifier.flush(timeout=10)
    posted = [m for m in fake.messages(RUNS) if m.thread_ts is not None]
    assert len(posted) == 1, [m.text[:80] for m in fake.messages(RUNS)]
    [reply] = posted
    buttons = [
        el["action_id"]
        for b in reply.blocks or []
        if b["type"] == "actions"
        for el in b["elements"]
    ]
    assert buttons == ["launch_anyway"]
    assert "/train resubmit r-big" in reply.text and "Preflight for r-big" in reply.text
    assert "/train resubmit r-big" in everything(reply)


def test_refused_twice_the_report_is_still_text_with_the_command(
    fake: FakeSlack, notifier: SlackNotifier
) -> None:
    fake.fail_next(2, method="chat.postMessage", error="invalid_blocks")
    notifier.post(report(60))
    assert notifier.flush(timeout=10)
    [message] = fake.messages(RUNS)
    assert message.blocks is None
    assert message.text.startswith("Preflight for r-big")
    assert message.text.rstrip().endswith("Launch anyway: /train resubmit r-big")


# --------------------------------------------------------------------------- mentions


def escalation(to: str) -> AlertMessage:
    return AlertMessage(
        channel=RUNS,
        alert_id="a-1",
        run_id="r-1",
        rule="loss_spike",
        severity="critical",
        state="OPEN",
        title="Loss spiked",
        detail="12× the baseline",
        hint="check the learning rate",
        escalate_to=to,
    )


def test_an_escalation_pages_by_id_resolved_from_handles(
    fake: FakeSlack, notifier: SlackNotifier
) -> None:
    fake.add_usergroup("S0ONCALL", "ml-oncall", ["U0GRACE"])
    fake.add_user("U0GRACE", "grace")
    for to in ("@ml-oncall", "@grace", "@nobody", "S0ONCALL", "<@U0GRACE>"):
        notifier.post(escalation(to))
    assert notifier.flush(timeout=10)
    group, user, nobody, group_id, user_markup = fake.messages(RUNS)
    assert group.text.startswith("<!subteam^S0ONCALL> ")
    assert "Escalated to <!subteam^S0ONCALL>" in everything(group)
    assert user.text.startswith("<@U0GRACE> ") and "Escalated to <@U0GRACE>" in everything(user)
    assert nobody.text.startswith("@nobody ") and "<" not in nobody.text.split(" ")[0]
    assert group_id.text.startswith("<!subteam^S0ONCALL> ")
    assert user_markup.text.startswith("<@U0GRACE> ")
    # One directory read answered all five (cached).
    assert len(fake.calls_to("usergroups.list")) == 1
    assert len(fake.calls_to("users.list")) == 1


def test_handles_are_cached_and_refreshed(fake: FakeSlack) -> None:
    now = [0.0]
    resolver = MentionResolver(fake.client(), ttl_s=600, retry_s=60, clock=lambda: now[0])
    assert resolver.resolve("@ml-oncall") is None
    fake.add_usergroup("S0NEW", "ml-oncall", [])
    now[0] = 30.0
    assert resolver.resolve("@ml-oncall") is None, "a miss is not looked up again at once"
    assert len(fake.calls_to("usergroups.list")) == 1
    now[0] = 61.0
    assert resolver.resolve("@ml-oncall") == "<!subteam^S0NEW>", "a new group is found"
    assert len(fake.calls_to("usergroups.list")) == 2
    now[0] = 120.0
    assert resolver.resolve("@ml-oncall") == "<!subteam^S0NEW>"
    assert len(fake.calls_to("usergroups.list")) == 2, "a hit is served from the cache"
    fake.add_usergroup("S0NEW", "ml-pager", [])  # renamed
    now[0] = 700.0
    assert resolver.resolve("@ml-pager") == "<!subteam^S0NEW>", "refreshed after the TTL"


def test_many_users_are_read_page_by_page(fake: FakeSlack) -> None:
    for i in range(450):
        fake.add_user(f"U{i:05d}", f"person{i}")
    resolver = MentionResolver(fake.client())
    assert resolver.resolve("@person449") == "<@U00449>"
    assert len(fake.calls_to("users.list")) == 3


@pytest.mark.parametrize("group", ["<!channel>", "<!here>", "<!everyone>", EVIL, "@channel"])
def test_an_oncall_group_from_a_spec_pings_nobody(
    fake: FakeSlack, notifier: SlackNotifier, group: str
) -> None:
    notifier.post(escalation(group))
    assert notifier.flush(timeout=10)
    [message] = fake.messages(RUNS)
    assert not PINGS.search(everything(message)), everything(message)
    assert "<@" not in everything(message) and "<!subteam" not in everything(message)


# --------------------------------------------------------------------------- the app


def test_escalation_through_the_control_plane_pings_nobody_for_a_forged_group(
    slack: Slack,
) -> None:
    """``notify.oncall_group=<!channel>`` as the escalation job reads it, posted by the
    real notifier: the channel sees the text, and nobody is pinged."""
    slack.fake.add_usergroup("S0ONCALL", "ml-oncall", ["U0CAROL"])
    deps = slack.cp.deps
    now = datetime.now(timezone.utc)
    with session_scope(deps.engine) as session:
        for rule in ("forged", "real"):
            session.add(
                Alert(
                    run_id=None,
                    rule=rule,
                    severity=Severity.CRITICAL,
                    state=AlertState.OPEN,
                    title=f"{rule} alert",
                    first_seen=now - timedelta(hours=1),
                    last_seen=now,
                    message_channel=CHANNEL,
                )
            )
    records: list[str] = []
    with session_scope(deps.engine) as session:
        done = alerts.escalate_due(
            session,
            now=now,
            delay_s=60,
            notifier=slack.notifier,
            journal=CallbackJournal(lambda t, run, data: records.append(t)),
            oncall_group=lambda a: "<!channel>" if a.rule == "forged" else "@ml-oncall",
        )
    assert len(done) == 2
    assert slack.notifier.flush(10)
    posted = {m.text.split("\n")[0]: m for m in slack.fake.messages(CHANNEL)}
    forged = next(m for k, m in posted.items() if "forged alert" in k)
    real = next(m for k, m in posted.items() if "real alert" in k)
    assert not PINGS.search(everything(forged)) and "&lt;!channel&gt;" in forged.text
    assert real.text.startswith("<!subteam^S0ONCALL> ")


def add_runs(slack: Slack, n: int, *, spec_name: str = EVIL) -> None:
    with session_scope(slack.cp.deps.engine) as session:
        for i in range(n):
            session.add(
                Run(
                    id=f"r-{i:04d}",
                    spec_name=spec_name + " " + "long name " * 20,
                    state=RunState.RUNNING,
                    reason=EVIL,
                    requester="U0ADA",
                    channel=CHANNEL,
                )
            )


def test_train_list_all_over_200_runs_is_clipped_honestly_and_escaped(slack: Slack) -> None:
    add_runs(slack, 220)
    _, path = slack.command("list all")
    reply = slack.hooks.wait(path)["text"]
    assert len(reply) <= 12_000
    assert not PINGS.search(reply), reply[:300]
    assert "&lt;!channel&gt;" in reply
    shown = len(re.findall(r"^\[r-\d{4}\]", reply, flags=re.M))
    more = re.search(r"…and (\d+) more runs not shown", reply)
    assert more is not None and shown > 0
    from jobs.usecases import service
    from jobs.usecases.service import Actor

    listed = service.list_runs(slack.cp.deps, "all", Actor(user="U0ADA", channel=CHANNEL))
    assert shown + int(more.group(1)) == len(listed)


def test_a_spec_named_channel_pings_nobody_in_replies(slack: Slack) -> None:
    add_runs(slack, 1, spec_name="<!channel>")
    _, path = slack.command("list all")
    reply = slack.hooks.wait(path)["text"]
    assert not PINGS.search(reply) and "&lt;!channel&gt;" in reply
    _, path = slack.command("oncall")
    assert not PINGS.search(slack.hooks.wait(path)["text"])


def test_150_open_alerts_on_app_home_are_counted(slack: Slack) -> None:
    now = datetime.now(timezone.utc)
    with session_scope(slack.cp.deps.engine) as session:
        for i in range(150):
            session.add(
                Alert(
                    run_id=None,
                    rule="budget",
                    key=f"k{i}",
                    severity=Severity.WARNING,
                    state=AlertState.OPEN,
                    title=f"{EVIL} team budget {i}",
                    first_seen=now + timedelta(seconds=i),
                    last_seen=now,
                    message_channel=CHANNEL,
                )
            )
    slack.event({"type": "app_home_opened", "user": "U0ADA", "channel": "D0ADA", "tab": "home"})
    assert slack.fake.wait_for(lambda: "U0ADA" in slack.fake.home_views, 10)
    home = json.dumps(slack.fake.home_views["U0ADA"], ensure_ascii=False)
    acks = len(re.findall(r'"action_id": "alert_ack"', home))
    more = re.search(r"…and (\d+) more alerts not shown", home)
    assert more is not None and acks + int(more.group(1)) == 150, (acks, more)
    assert not PINGS.search(home)


def test_a_refused_post_does_not_swallow_its_updates(
    fake: FakeSlack, notifier: SlackNotifier
) -> None:
    fake.fail_next(1, method="chat.postMessage", error="not_in_channel")
    ref = notifier.post(TextMessage(channel=RUNS, kind="info", text="first"))
    assert notifier.flush(timeout=5)
    notifier.update(ref, TextMessage(channel=RUNS, kind="info", text="second"))
    assert notifier.flush(timeout=5)
    assert [m.text for m in fake.messages(RUNS)] == ["second"]
    assert isinstance(notifier.resolve(MessageRef(channel=RUNS, ts=ref.ts)), MessageRef)
