"""The Slack notifier with the shared outbox: what one replica queued outlives it, two
replicas keep one pace per channel, a keyed message goes out once, and a replica edits
a message another one posted.

Against the fake Slack Web API over real HTTP, on SQLite and PostgreSQL (``db_engine``).
A replica that died is stood for by its rows: an :class:`~bot.slack_outbox.Outbox` that
wrote them and then stopped renewing them, as a killed process does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pytest
from sqlalchemy import Engine, func
from sqlmodel import col, select

from bot import views
from bot.slack_notifier import SlackNotifier
from bot.slack_outbox import Outbox, decode, encode
from jobs.database.db import session_scope
from jobs.database.replica_tables import SlackOutbox
from jobs.outbound.notify import (
    AlertMessage,
    CheckLine,
    DigestMessage,
    PreflightMessage,
    RunCard,
    TextMessage,
)
from tests.fakes.slack_api import FakeSlack
from tests.waiting import wait_until

WINDOW_S = 0.05
CHANNEL = "C0RUNS"


@pytest.fixture
def fake() -> Iterator[FakeSlack]:
    with FakeSlack(post_interval_s=WINDOW_S, burst=1, whole_second_retry_after=False) as server:
        yield server


@pytest.fixture
def replica(fake: FakeSlack, db_engine: Engine) -> Iterator[Callable[..., SlackNotifier]]:
    """``replica(name)``: a notifier writing to the shared outbox as replica ``name``."""
    made: list[SlackNotifier] = []

    def make(name: str, **kw: Any) -> SlackNotifier:
        kw.setdefault("min_interval_s", WINDOW_S * 4)  # wide: a loaded machine jitters
        notifier = SlackNotifier(
            fake.client(retry_handlers=[]),
            backoff_s=0.01,
            outbox=Outbox(db_engine, owner=name, hold_s=kw.pop("hold_s", 0.3)),
            **kw,
        )
        made.append(notifier)
        return notifier

    yield make
    for notifier in made:
        notifier.close(timeout=5)


def card(step: int, **kw: Any) -> RunCard:
    return RunCard(
        channel=CHANNEL, run_id="r-1", spec_name="tiny", state="RUNNING", requester="U0ADA",
        step=step, **kw,
    )  # fmt: skip


def alert(n: int, *, thread_ts: str | None = None) -> AlertMessage:
    return AlertMessage(
        channel=CHANNEL, thread_ts=thread_ts, alert_id=f"al-{n}", run_id="r-1",
        rule="preemption", severity="warning", state="OPEN", title=f"preempted {n}",
        detail="attempt 1", hint="nothing to do",
    )  # fmt: skip


def unsent(engine: Engine) -> int:
    with session_scope(engine) as session:
        query = select(func.count()).select_from(SlackOutbox)
        return session.exec(query.where(col(SlackOutbox.sent_at).is_(None))).one()


def test_every_message_type_survives_the_round_trip() -> None:
    when = datetime(2026, 12, 2, 9, 0, tzinfo=timezone.utc)
    messages = [
        card(3, loss=math.nan, spent_usd=1.5),
        alert(1, thread_ts="pending-abc-1"),
        AlertMessage(**{**alert(2).__dict__, "acked_by": "U0BOB", "acked_at": when}),
        DigestMessage(channel=CHANNEL, figures={"date": "2026-12-01", "runs": [{"usd": 1.0}]},
                      chart_png=b"\x89PNG\r\n", key="digest:2026-12-02:C0RUNS"),
        PreflightMessage(channel=CHANNEL, run_id="r-1", ok=True, needs_confirmation=False,
                         checks=(CheckLine("quota", "pass", "8 cores free"),)),
        TextMessage(channel=CHANNEL, kind="info", text="hello", run_id="r-1"),
    ]  # fmt: skip
    for msg in messages:
        stored = json.loads(json.dumps(encode(msg), allow_nan=False))  # what the column holds
        back = decode(stored)
        assert type(back) is type(msg)
        if isinstance(msg, RunCard):
            assert isinstance(back, RunCard) and back.loss is not None
            assert math.isnan(back.loss) and back == RunCard(**{**msg.__dict__, "loss": back.loss})
        else:
            assert back == msg
    with pytest.raises(TypeError, match="cannot store"):
        encode(NotAMessage())


@dataclass
class NotAMessage:
    """Not a message type: the outbox refuses it rather than pickling it."""

    x: int = 1


def test_what_a_dead_replica_queued_is_sent_by_another(
    fake: FakeSlack, db_engine: Engine, replica: Callable[..., SlackNotifier]
) -> None:
    dead = Outbox(db_engine, owner="replica-dead", hold_s=0.2)
    root = "pending-dead01-1"
    # It had queued a run's root, an update of it, an alert in its thread and a digest,
    # and was killed before sending any of them.
    dead.add(op="post", channel=CHANNEL, target=root, msg=card(1))
    dead.add(op="update", channel=CHANNEL, target=root, msg=card(5))
    dead.add(op="post", channel=CHANNEL, target="pending-dead01-2", msg=alert(1, thread_ts=root))
    digest = DigestMessage(channel=CHANNEL, figures={}, key="digest:2026-12-02:C0RUNS")
    dead.add(op="post", channel=CHANNEL, target="pending-dead01-3", msg=digest)
    alive = replica("replica-alive")
    wait_until(lambda: unsent(db_engine) == 0, 10, "the dead replica's rows to be sent")
    alive.flush(5)
    top = [m for m in fake.messages(CHANNEL) if m.thread_ts is None]
    assert len(top) == 2  # the root and the digest
    posted_root = top[0]
    newest = json.loads(json.dumps(views.render(card(5))))
    assert posted_root.blocks == newest, "the root shows its newest content"
    replies = fake.replies(CHANNEL, posted_root.ts)
    assert [("al-1" in json.dumps(m.blocks)) for m in replies] == [True], (
        "the alert went into the root's thread"
    )
    # The same key again (a new leader making the digest once more): not sent again.
    alive.post(digest)
    alive.flush(5)
    assert sum(1 for m in fake.messages(CHANNEL) if m.thread_ts is None) == 2


def test_two_replicas_keep_one_pace_per_channel(
    fake: FakeSlack, replica: Callable[..., SlackNotifier]
) -> None:
    # Slack allows one post per WINDOW_S here (no burst); each replica alone keeps to
    # its pace, and only the shared slot keeps the two of them, together, within it.
    # Both are alive: holds long enough that a loaded machine's late renewal never hands
    # a row being posted to the other replica (which would post it again, at least once).
    a, b = replica("replica-a", hold_s=3.0), replica("replica-b", hold_s=3.0)
    for n in range(8):
        a.post(alert(n))
        b.post(alert(100 + n))
    assert a.flush(20) and b.flush(20)
    shown = " ".join(json.dumps(m.blocks) for m in fake.messages(CHANNEL))
    assert all(f"al-{n}" in shown for n in [*range(8), *range(100, 108)])
    assert len(fake.messages(CHANNEL)) == 16
    assert a.metrics["retried_429"] + b.metrics["retried_429"] == 0


def test_a_replica_edits_the_message_another_posted(
    fake: FakeSlack, replica: Callable[..., SlackNotifier]
) -> None:
    a, b = replica("replica-a"), replica("replica-b")
    ref = a.post(card(1))
    b.update(ref, card(2))  # B has never seen A's handle: the outbox says where it is
    assert a.flush(10) and b.flush(10)
    messages = fake.messages(CHANNEL)
    assert len(messages) == 1, "edited in place, not posted again"
    assert messages[0].edits and "2" in json.dumps(messages[0].blocks)


def test_folded_warnings_are_one_message_and_leave_no_unsent_rows(
    fake: FakeSlack, replica: Callable[..., SlackNotifier], db_engine: Engine
) -> None:
    a = replica("replica-a")
    for n in range(100):
        a.post(TextMessage(channel=CHANNEL, kind="warning", text=f"warning {n}", run_id="r-1",
                           fold="runner-warnings:r-1"))  # fmt: skip
    assert a.flush(10)
    [message] = fake.messages(CHANNEL)
    assert "warning 99" in message.text and "(100 warnings from run r-1" in message.text
    assert len(fake.calls_to("chat.postMessage")) == 1
    wait_until(lambda: unsent(db_engine) == 0, 10, "every row marked: sent or superseded")
