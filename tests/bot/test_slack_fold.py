"""One run cannot bury the others: its lines fold into one message and alerts go first.

The real notifier against the local fake Slack Web API; the fake's pace is slowed where
a backlog must build up, so what is asserted is the order and the count, not a timing.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from bot.slack_notifier import SlackNotifier
from jobs.outbound.notify import AlertMessage, RunCard, TextMessage
from tests.bot.test_slack_notifier import fake as fake  # the fixtures
from tests.bot.test_slack_notifier import make_notifier as make_notifier
from tests.fakes.slack_api import FakeSlack

RUNS = "C0RUNS"


def line(n: int, *, run_id: str = "r-1", fold: str | None = None, **kw: Any) -> TextMessage:
    return TextMessage(
        channel=kw.pop("channel", RUNS),
        kind="warning",
        text=f"warning number {n}",
        run_id=run_id,
        fold=fold,
        **kw,
    )


def page(run_id: str = "r-2", *, severity: str = "CRITICAL", **kw: Any) -> AlertMessage:
    return AlertMessage(
        channel=RUNS,
        alert_id=f"al-{run_id}",
        run_id=run_id,
        rule="loss",
        severity=severity,
        state="OPEN",
        title=f"Loss is NaN in {run_id}",
        detail="step 12",
        hint="stop the run",
        **kw,
    )


def shown_count(text: str) -> int:
    """The count a folded message states (1: it states none)."""
    found = re.search(r"\((\d+) (?:warnings|messages like this|messages) from", text)
    return int(found.group(1)) if found else 1


def test_lines_with_one_fold_key_are_one_message_with_their_count(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    notifier = make_notifier(min_interval_s=0.2)
    refs = [notifier.post(line(n, fold="warnings:r-1")) for n in range(300)]
    assert len({r.ts for r in refs}) == 1, "every line is the one message"
    assert notifier.flush(timeout=10)
    [message] = fake.messages(RUNS)
    assert "warning number 299" in message.text, "the newest line is shown"
    assert shown_count(message.text) == 300, message.text
    assert len(fake.calls_to("chat.postMessage")) == 1
    assert len(fake.calls_to("chat.update")) <= 2, "the edits coalesce too"
    assert notifier.metrics["folded"] == 299

    # Later lines edit the same message, and the count goes on.
    notifier.post(line(300, fold="warnings:r-1"))
    assert notifier.flush(timeout=5)
    [message] = fake.messages(RUNS)
    assert shown_count(message.text) == 301 and "warning number 300" in message.text


def test_fold_keys_are_per_run_thread_and_window(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    ahead = [0.0]  # the notifier's clock runs, and can jump
    notifier = make_notifier(clock=lambda: time.monotonic() + ahead[0], fold_window_s=60.0)
    notifier.post(line(1, fold="warnings:r-1"))
    notifier.post(line(2, run_id="r-2", fold="warnings:r-2"))
    notifier.post(line(3, fold="warnings:r-1"))
    ahead[0] = 61.0  # past the window: the next line is a new message, where people see it
    notifier.post(line(4, fold="warnings:r-1"))
    assert notifier.flush(timeout=5)
    texts = [m.text for m in fake.messages(RUNS)]
    assert len(texts) == 3, texts
    assert shown_count(texts[0]) == 2 and "warning number 3" in texts[0]
    assert "warning number 2" in texts[1] and "warning number 4" in texts[2]


def test_one_runs_backlog_is_bounded_and_its_excess_counted(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    fake.post_interval_s = 0.5  # a slow channel: the backlog builds up
    notifier = make_notifier(min_interval_s=0.5, max_run_backlog=5)
    for n in range(60):
        notifier.post(line(n))
    assert notifier.pending <= 5 + 2, "at most the bound, the fold and the one in flight"
    assert notifier.flush(timeout=20)
    texts = [m.text for m in fake.messages(RUNS)]
    assert len(texts) <= 7, texts
    assert sum(shown_count(t) for t in texts) == 60, "nothing dropped: the rest is counted"
    assert "came faster than Slack takes them" in texts[-1] and "warning number 59" in texts[-1]


def test_a_critical_alert_goes_ahead_of_the_backlog(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    fake.post_interval_s = 0.3
    notifier = make_notifier(min_interval_s=0.3)
    # Ten runs' cards (no fold, no bound reached), then a warning alert and a page.
    for n in range(10):
        notifier.post(RunCard(channel=RUNS, run_id=f"r-{n}", spec_name="t", state="RUNNING",
                              requester="U1"))  # fmt: skip
    # Cards already at Slack, plus the one that may be in flight, go before: no more.
    ahead = len(fake.calls_to("chat.postMessage")) + 1
    notifier.post(page("r-20", severity="WARNING"))
    notifier.post(page("r-21"))
    assert notifier.flush(timeout=30)
    texts = [m.text for m in fake.messages(RUNS)]
    assert len(texts) == 12
    paged = next(i for i, t in enumerate(texts) if "Loss is NaN in r-21" in t)
    warned = next(i for i, t in enumerate(texts) if "Loss is NaN in r-20" in t)
    assert paged <= ahead < 10, "the page goes ahead of the cards still queued"
    assert warned == paged + 1, "then the other alert, still ahead of the cards"


def test_an_alert_never_overtakes_its_own_root(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    fake.post_interval_s = 0.5  # wide: the queue must still hold line 1 when the page comes
    notifier = make_notifier(min_interval_s=0.5)
    notifier.post(line(0, run_id="r-9"))  # in flight first
    root = notifier.post(RunCard(channel=RUNS, run_id="r-2", spec_name="t", state="RUNNING",
                                 requester="U1"))  # fmt: skip
    notifier.post(line(1, run_id="r-9"))
    notifier.post(page("r-2", thread_ts=root.ts))
    assert notifier.flush(timeout=10)
    messages = fake.messages(RUNS)
    card = next(m for m in messages if m.thread_ts is None and "r-2" in m.text)
    alert = next(m for m in messages if "Loss is NaN" in m.text)
    assert alert.thread_ts == card.ts, "the page is in its run's thread"
    order = [m.ts for m in messages]
    later = next(m for m in messages if "warning number 1" in m.text)
    assert order.index(card.ts) < order.index(alert.ts) < order.index(later.ts)


def test_a_root_sent_back_by_a_429_goes_ahead_of_the_page_that_waits_for_it(
    fake: FakeSlack, make_notifier: Callable[..., SlackNotifier]
) -> None:
    fake.fail_next(1, method="chat.postMessage", status=429, retry_after="0.3")
    notifier = make_notifier()
    root = notifier.post(RunCard(channel=RUNS, run_id="r-2", spec_name="t", state="RUNNING",
                                 requester="U1"))  # fmt: skip
    notifier.post(page("r-2", thread_ts=root.ts))  # queued while its root is in flight
    assert notifier.flush(timeout=10), "the channel never stalls behind a page's own root"
    card, alert = fake.messages(RUNS)
    assert alert.thread_ts == card.ts and notifier.metrics["retried_429"] == 1
