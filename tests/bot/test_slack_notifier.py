"""The Slack notifier against a local fake Slack Web API, over real HTTP.

Most tests shrink Slack's window of one message per second per channel to 20 ms
(``post_interval_s=0.02`` with an exact, fractional ``Retry-After``) so that a hundred
messages take two seconds instead of a hundred; the mechanism is the same. One test
runs at Slack's real pace, with whole-second ``Retry-After``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from slack_sdk.errors import SlackApiError

from bot import plots, views
from bot.slack_notifier import HANDLE_PREFIX, SlackNotifier
from jobs.outbound.notify import (
    AlertMessage,
    DigestMessage,
    Message,
    MessageRef,
    RunCard,
    TextMessage,
)
from tests.fakes.slack_api import FakeSlack

WINDOW_S = 0.02
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def fake() -> Iterator[FakeSlack]:
    with FakeSlack(post_interval_s=WINDOW_S, burst=1, whole_second_retry_after=False) as server:
        yield server


@pytest.fixture
def make_notifier(fake: FakeSlack) -> Iterator[Callable[..., SlackNotifier]]:
    made: list[SlackNotifier] = []

    def make(**kw: Any) -> SlackNotifier:
        kw.setdefault("min_interval_s", WINDOW_S)
        kw.setdefault("backoff_s", 0.01)
        notifier = SlackNotifier(fake.client(retry_handlers=[]), **kw)
        made.append(notifier)
        return notifier

    yield make
    for notifier in made:
        notifier.close(timeout=2)


def run_card(step: int | None = None, **kw: Any) -> RunCard:
    return RunCard(
        channel=kw.pop("channel", "C0RUNS"),
        run_id="r-1",
        spec_name="tiny",
        state=kw.pop("state", "RUNNING"),
        requester="U0ADA",
        step=step,
        **kw,
    )


def alert(
    n: int, *, channel: str = "C0RUNS", thread_ts: str | None = None, **kw: Any
) -> AlertMessage:
    return AlertMessage(
        channel=channel,
        thread_ts=thread_ts,
        alert_id=f"a-{n}",
        run_id="r-1",
        rule=kw.pop("rule", "disk"),
        severity="warning",
        state="OPEN",
        title=f"alert number {n}",
        detail="disk 91% full",
        hint="raise disk_gb",
        **kw,
    )


def posted(fake: FakeSlack, channel: str) -> list[str]:
    return [m.text for m in fake.messages(channel)]


# --------------------------------------------------------------------------- the fake


def test_fake_speaks_the_web_api() -> None:
    with FakeSlack() as fake:
        client = fake.client()
        assert client.auth_test()["user_id"] == "U0BOT"
        with pytest.raises(SlackApiError) as denied:
            fake.client(token="xoxb-wrong").auth_test()
        assert denied.value.response["error"] == "invalid_auth"
        assert fake.calls[-1].token == "xoxb-wrong"

        fake.add_user("U0ADA", "ada", is_admin=True)
        fake.add_usergroup("S0ONCALL", "oncall", ["U0ADA"])
        fake.add_channel("C0RUNS", "runs")
        assert client.users_info(user="U0ADA")["user"]["is_admin"] is True
        groups = client.usergroups_list(include_users=True)["usergroups"]
        assert groups[0]["handle"] == "oncall" and groups[0]["users"] == ["U0ADA"]
        assert client.conversations_info(channel="C0RUNS")["channel"]["name"] == "runs"
        with pytest.raises(SlackApiError, match="channel_not_found"):
            client.conversations_info(channel="C0NONE")

        assert client.chat_postEphemeral(channel="C0RUNS", user="U0ADA", text="only you")["ok"]
        opened = client.views_open(trigger_id="t-1", view=views.launch_modal(["tiny"]))["view"]
        client.views_update(view_id=opened["id"], view=views.launch_modal(["tiny", "big"]))
        assert len(fake.views[opened["id"]]["blocks"][0]["element"]["options"]) == 2
        fake.expired_triggers.add("t-old")
        with pytest.raises(SlackApiError, match="expired_trigger_id"):
            client.views_open(trigger_id="t-old", view=views.launch_modal(["tiny"]))
        client.views_publish(user_id="U0ADA", view=views.home_tab([], []))
        assert fake.home_views["U0ADA"]["type"] == "home"

        # Slack's pace: three posts of burst, then 429 with whole seconds to wait.
        first = client.chat_postMessage(channel="C0RUNS", text="root")
        assert first["ts"].startswith("1700000000.")
        for _ in range(2):
            client.chat_postMessage(channel="C0RUNS", text="more", thread_ts=first["ts"])
        with pytest.raises(SlackApiError) as limited:
            client.chat_postMessage(channel="C0RUNS", text="too fast")
        assert limited.value.response.status_code == 429
        assert limited.value.response.headers["Retry-After"] == "1"
        with pytest.raises(SlackApiError, match="thread_not_found"):
            client.chat_postMessage(channel="C0OTHER", text="x", thread_ts="1.000001")

        updated = client.chat_update(channel="C0RUNS", ts=first["ts"], text="root v2")
        assert updated["ok"] and fake.message("C0RUNS", first["ts"]).text == "root v2"  # type: ignore[union-attr]

        upload = client.files_upload_v2(
            channel="C0RUNS", thread_ts=first["ts"], file=PNG_MAGIC + b"data", filename="x.png"
        )
        file_id = upload["file"]["id"]
        assert fake.files[file_id].data == PNG_MAGIC + b"data"
        assert fake.files[file_id].thread_ts == first["ts"] and fake.files[file_id].completed
        methods = [c.method for c in fake.calls[-3:]]
        assert methods == ["files.getUploadURLExternal", "upload", "files.completeUploadExternal"]


def test_fake_injects_failures() -> None:
    with FakeSlack() as fake:
        client = fake.client(retry_handlers=[])
        fake.fail_next(1, method="chat.postMessage", status=500)
        fake.fail_next(1, method="chat.postMessage", reset=True)
        fake.fail_next(1, error="not_in_channel")
        with pytest.raises(SlackApiError) as server_error:
            client.chat_postMessage(channel="C1", text="a")
        assert server_error.value.response.status_code == 500
        with pytest.raises(ConnectionError):
            client.chat_postMessage(channel="C1", text="a")
        with pytest.raises(SlackApiError, match="not_in_channel"):
            client.chat_postMessage(channel="C1", text="a")
        assert client.chat_postMessage(channel="C1", text="a")["ok"]
        assert [c.status for c in fake.calls] == [500, 0, 200, 200]
        assert posted(fake, "C1") == ["a"]


# --------------------------------------------------------------------------- delivery


def test_a_burst_of_alerts_loses_nothing(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    # The notifier paces itself ten times faster than the fake allows: the fake says 429.
    notifier = make_notifier(min_interval_s=WINDOW_S / 10)
    started = time.monotonic()
    refs = [notifier.post(alert(n)) for n in range(100)]
    assert time.monotonic() - started < 0.5, "post() never waits for Slack"
    assert all(ref.ts.startswith(HANDLE_PREFIX) for ref in refs)

    assert notifier.flush(timeout=30)
    texts = posted(fake, "C0RUNS")
    assert len(texts) == 100
    assert [t.split("] ", 1)[1].split("\n")[0] for t in texts] == [
        f"alert number {n}" for n in range(100)
    ], "every alert, once, in order"

    calls = fake.calls_to("chat.postMessage")
    limited = [c for c in calls if c.status == 429]
    assert limited, "the fake did rate limit the burst"
    assert all(c.error == "ratelimited" for c in limited)
    assert notifier.metrics["retried_429"] == len(limited), "every 429 was retried"
    assert notifier.metrics["sent"] == 100 and notifier.metrics["dropped"] == 0
    for before, after in itertools.pairwise(calls):
        if before.status == 429:
            assert before.retry_after is not None
            assert after.time >= before.time + before.retry_after, "Retry-After honoured"
    assert [notifier.resolve(r) for r in refs] == [
        MessageRef(channel="C0RUNS", ts=m.ts) for m in fake.messages("C0RUNS")
    ]


def test_slacks_real_pace_and_whole_second_retry_after() -> None:
    with FakeSlack(post_interval_s=1.0, burst=1) as fake:
        notifier = SlackNotifier(fake.client())  # min_interval_s=1.0, Slack's own limit
        try:
            fake.fail_next(1, method="chat.postMessage", status=429, retry_after="1")
            notifier.post(alert(1))
            notifier.post(alert(2))
            assert notifier.flush(timeout=10)
        finally:
            notifier.close()
        calls = fake.calls_to("chat.postMessage")
        assert [c.status for c in calls] == [429, 200, 200]
        assert calls[1].time - calls[0].time >= 1.0, "waited the whole second it was told"
        assert calls[2].time - calls[1].time >= 0.95, "one message per second per channel"
        assert notifier.metrics["retried_429"] == 1 and len(fake.messages("C0RUNS")) == 2


def test_channels_do_not_wait_for_each_other(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    notifier = make_notifier()
    fake.fail_next(1, method="chat.postMessage", status=429, retry_after="0.5")
    notifier.post(alert(1, channel="C0SLOW"))
    time.sleep(0.05)
    notifier.post(alert(2, channel="C0FAST"))
    assert fake.wait_for(lambda: len(fake.messages("C0FAST")) == 1, timeout=0.4)
    assert fake.messages("C0SLOW") == [], "still holding for its Retry-After"
    assert notifier.flush(timeout=5) and len(fake.messages("C0SLOW")) == 1


def test_updates_coalesce_and_the_last_content_wins(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    notifier = make_notifier(min_interval_s=0.2)
    ref = notifier.post(run_card(step=0))
    assert notifier.flush(timeout=5)
    for step in range(1, 11):
        notifier.update(ref, run_card(step=step, target_steps=10))
    assert notifier.flush(timeout=5)
    updates = fake.calls_to("chat.update")
    assert 1 <= len(updates) <= 2
    [message] = fake.messages("C0RUNS")
    assert "step 10/10" in message.text
    assert message.blocks == views.run_card(run_card(step=10, target_steps=10))
    assert notifier.metrics["coalesced"] >= 8


def test_updates_of_a_queued_post_go_out_with_it(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    notifier = make_notifier(min_interval_s=0.3)
    notifier.post(TextMessage(channel="C0RUNS", kind="info", text="first"))
    ref = notifier.post(run_card(step=0))  # waits 0.3 s behind "first"
    for step in range(1, 11):
        notifier.update(ref, run_card(step=step))
    assert notifier.flush(timeout=5)
    assert fake.calls_to("chat.update") == []
    assert "step 10" in posted(fake, "C0RUNS")[1]
    assert notifier.metrics["coalesced"] == 10


def test_a_reply_to_a_pending_root_lands_in_its_thread(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    resolved: list[tuple[str, MessageRef]] = []
    notifier = make_notifier(on_resolved=lambda handle, ref: resolved.append((handle, ref)))
    fake.fail_next(2, method="chat.postMessage", status=503)  # the root needs three tries
    root = notifier.post(run_card(state="PREFLIGHT"))
    reply = notifier.post(TextMessage(channel="C0RUNS", thread_ts=root.ts, kind="info", text="hi"))
    update = run_card(state="LAUNCHING")
    notifier.update(root, update)
    assert notifier.flush(timeout=5)

    real_root = notifier.resolve(root)
    assert real_root is not None and not real_root.ts.startswith(HANDLE_PREFIX)
    [message] = fake.replies("C0RUNS", real_root.ts)
    assert message.text == "hi"
    assert notifier.resolve(reply) == MessageRef(channel="C0RUNS", ts=message.ts)
    assert fake.message("C0RUNS", real_root.ts).text == views.fallback_text(update)  # type: ignore[union-attr]
    assert resolved[0] == (root.ts, real_root)
    assert notifier.metrics["retried"] == 2


def test_transient_errors_are_retried_without_duplicates(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    notifier = make_notifier()
    fake.fail_next(1, method="chat.postMessage", status=500)
    fake.fail_next(1, method="chat.postMessage", error="internal_error")
    fake.fail_next(3, method="chat.postMessage", reset=True)
    for n in range(3):
        notifier.post(alert(n))
    assert notifier.flush(timeout=10)
    assert [t.split("\n")[0][-14:] for t in posted(fake, "C0RUNS")] == [
        "alert number 0",
        "alert number 1",
        "alert number 2",
    ]
    assert fake.failures_left == 0


@pytest.mark.parametrize("error", ["invalid_blocks", "msg_blocks_too_long", "invalid_arguments"])
def test_refused_blocks_are_sent_short_then_as_text(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier], error: str
) -> None:
    notifier = make_notifier()
    fake.fail_next(1, method="chat.postMessage", error=error)
    notifier.post(alert(1))
    assert notifier.flush(timeout=5)
    [message] = fake.messages("C0RUNS")
    assert message.blocks is not None and len(message.blocks) == 2, "compact: text and buttons"
    assert "alert number 1" in message.blocks[0]["text"]["text"]
    assert "/train ack a-1" in message.blocks[0]["text"]["text"], "the end is kept"
    assert message.blocks[1]["type"] == "actions"

    fake.fail_next(2, method="chat.postMessage", error=error)
    notifier.post(alert(2))
    assert notifier.flush(timeout=5)
    last = fake.messages("C0RUNS")[-1]
    assert last.blocks is None and "alert number 2" in last.text and "/train ack a-2" in last.text
    assert notifier.metrics["dropped"] == 0


def test_an_update_of_a_refused_post_is_posted_not_skipped(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    notifier = make_notifier()
    fake.fail_next(1, method="chat.postMessage", error="not_in_channel")
    ref = notifier.post(alert(1))
    assert notifier.flush(timeout=5)
    assert fake.messages("C0RUNS") == []
    notifier.update(ref, alert(2))
    notifier.update(ref, alert(3))
    assert notifier.flush(timeout=5)
    shown = fake.messages("C0RUNS")
    assert shown and "alert number 3" in shown[-1].text


def test_a_permanent_error_drops_only_that_message(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier], caplog: pytest.LogCaptureFixture
) -> None:
    notifier = make_notifier()
    fake.set_channel_error("C0GONE", "channel_not_found")
    fake.fail_next(1, method="chat.postMessage", error="not_in_channel")
    with caplog.at_level(logging.ERROR, logger="bot.slack_notifier"):
        refused = notifier.post(alert(1))  # meets the not_in_channel
        kept = notifier.post(alert(2))
        lost = notifier.post(alert(3, channel="C0GONE"))
        notifier.update(lost, alert(3, channel="C0GONE", count=2))
        other = notifier.post(alert(4, channel="C0OTHER"))
        assert notifier.flush(timeout=5)
    assert [t.split("\n")[0][-14:] for t in posted(fake, "C0RUNS")] == ["alert number 2"]
    assert len(fake.messages("C0OTHER")) == 1
    assert notifier.resolve(refused) is None and notifier.resolve(lost) is None
    assert notifier.resolve(kept) is not None and notifier.resolve(other) is not None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len([e for e in errors if "not_in_channel" in e]) == 1
    assert any("/invite @trainbot" in e for e in errors)
    assert any("channel_not_found" in e and "C0GONE" in e for e in errors)
    assert notifier.metrics["dropped"] == len(errors) == 2, "its update is not tried again"


def test_an_update_of_a_message_from_before_a_restart_is_posted_in_the_thread(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    earlier = make_notifier()
    root = earlier.post(run_card(state="RUNNING"))
    old_alert = earlier.post(alert(1, thread_ts=root.ts))
    assert earlier.flush(timeout=5)
    real_root = earlier.resolve(root)
    assert real_root is not None
    earlier.close()

    notifier = make_notifier()  # a new process: the handles above mean nothing to it
    notifier.update(old_alert, alert(1, thread_ts=real_root.ts, count=2))
    assert notifier.flush(timeout=5)
    notifier.update(old_alert, alert(1, thread_ts=real_root.ts, count=3))
    assert notifier.flush(timeout=5)
    replies = fake.replies("C0RUNS", real_root.ts)
    assert len(replies) == 2, "the old alert and its re-post, in the thread"
    assert "(×3)" in replies[1].text
    assert len(fake.calls_to("chat.update")) == 1, "the second update edits the re-post"


def test_a_message_that_is_gone_is_posted_again_and_then_edited(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    notifier = make_notifier()
    root = notifier.post(run_card(step=1))
    assert notifier.flush(timeout=5)
    first = notifier.resolve(root)
    fake.fail_next(1, method="chat.update", error="message_not_found")
    notifier.update(root, run_card(step=2))
    assert notifier.flush(timeout=5)
    second = notifier.resolve(root)
    assert first is not None and second is not None and second.ts != first.ts
    notifier.update(root, run_card(step=3))
    notifier.post(TextMessage(channel="C0RUNS", thread_ts=first.ts, kind="info", text="reply"))
    assert notifier.flush(timeout=5)
    assert "step 3" in fake.message("C0RUNS", second.ts).text  # type: ignore[union-attr]
    assert [m.text for m in fake.replies("C0RUNS", second.ts)] == ["reply"], "the thread moved"


def test_slack_unreachable_post_returns_at_once_and_gives_up_only_after_retries() -> None:
    with FakeSlack() as gone:
        client = gone.client(retry_handlers=[], timeout=1)
    notifier = SlackNotifier(client, min_interval_s=0.0, backoff_s=0.01, max_retries=2)
    try:
        started = time.monotonic()
        ref = notifier.post(run_card())
        assert time.monotonic() - started < 0.1
        assert notifier.flush(timeout=5)
        assert notifier.metrics["retried"] == 2 and notifier.metrics["dropped"] == 1
        assert notifier.resolve(ref) is None
    finally:
        notifier.close(timeout=1)


def test_attachments_are_uploaded_into_the_thread_with_files_v2(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    curve = plots.loss_curve_png([1, 2, 3], [2.0, 1.5, float("nan")], title="r-1 loss")

    def attachments(msg: Message) -> tuple[str, bytes] | None:
        if isinstance(msg, AlertMessage) and msg.rule == "divergent_loss":
            return plots.LOSS_CURVE_FILENAME, curve
        return None

    notifier = make_notifier(attachments=attachments)
    root = notifier.post(run_card())
    notifier.post(alert(1, thread_ts=root.ts, rule="divergent_loss"))
    notifier.post(alert(2, thread_ts=root.ts))  # no file for this one
    digest = notifier.post(
        DigestMessage(channel="C0RUNS", figures={"date": "2026-03-03"}, chart_png=PNG_MAGIC + b"c")
    )
    assert notifier.flush(timeout=10)

    real_root, real_digest = notifier.resolve(root), notifier.resolve(digest)
    assert real_root is not None and real_digest is not None
    files = sorted(fake.files.values(), key=lambda f: f.id)
    assert [(f.filename, f.thread_ts, f.completed) for f in files] == [
        (plots.LOSS_CURVE_FILENAME, real_root.ts, True),
        (plots.SPEND_CHART_FILENAME, real_digest.ts, True),
    ]
    assert files[0].data == curve and files[1].data == PNG_MAGIC + b"c"
    methods = [c.method for c in fake.calls if c.method != "chat.postMessage"]
    assert methods == ["files.getUploadURLExternal", "upload", "files.completeUploadExternal"] * 2
    assert notifier.metrics["uploaded"] == 2


def test_close_stops_the_worker_and_refuses_new_messages(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier], caplog: pytest.LogCaptureFixture
) -> None:
    notifier = make_notifier()
    notifier.post(alert(1))
    assert notifier.close(timeout=5)
    assert len(fake.messages("C0RUNS")) == 1
    with caplog.at_level(logging.ERROR, logger="bot.slack_notifier"):
        notifier.post(alert(2))
    assert "closed" in caplog.text
    assert notifier.flush(timeout=0.1) and len(fake.messages("C0RUNS")) == 1
