"""One contract for every Notifier (jobs.outbound.notify.Notifier): the console's and Slack's.

Each front end is read the way a person reads it: the console's printed lines, and the
messages the fake Slack Web API holds for the channel (after the notifier has flushed).
What a front end adds of its own (Slack's blocks, pacing, retries; the console's
markers) is in its own tests.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from bot.console import ConsoleNotifier
from bot.slack_notifier import SlackNotifier
from jobs.outbound.notify import AlertMessage, Message, MessageRef, Notifier, RunCard, TextMessage
from tests.fakes.slack_api import FakeSlack

CHANNEL = "C0RUNS"


@dataclass
class Front:
    """A notifier and what its channel shows."""

    notifier: Notifier
    #: Every message the channel shows now: (its text, whether it is a thread reply).
    shown: Callable[[], list[tuple[str, bool]]]


def _console_shown(out: io.StringIO) -> Callable[[], list[tuple[str, bool]]]:
    def shown() -> list[tuple[str, bool]]:
        # A post is a line of its own; an update ("↻") replaces the message before it.
        found: list[tuple[str, bool]] = []
        for block in out.getvalue().split("\n"):
            if block.startswith("↻ "):
                found[-1] = (block.removeprefix("↻ "), found[-1][1])
            elif block.startswith("  ↳ "):
                found.append((block.removeprefix("  ↳ "), True))
            elif block and not block.startswith(" "):
                found.append((block, False))
        return found

    return shown


@pytest.fixture(params=["console", "slack"])
def front(request: pytest.FixtureRequest) -> Iterator[Front]:
    if request.param == "console":
        out = io.StringIO()
        yield Front(ConsoleNotifier(out, channel=CHANNEL), _console_shown(out))
        return
    with FakeSlack(post_interval_s=0.02, burst=1, whole_second_retry_after=False) as fake:
        notifier = SlackNotifier(fake.client(retry_handlers=[]), min_interval_s=0.02)

        def shown() -> list[tuple[str, bool]]:
            assert notifier.flush(timeout=10)
            return [
                (m.text.split("\n")[0], m.thread_ts is not None) for m in fake.messages(CHANNEL)
            ]

        try:
            yield Front(notifier, shown)
        finally:
            notifier.close(timeout=2)


def card(state: str = "RUNNING", step: int = 5) -> RunCard:
    return RunCard(
        channel=CHANNEL, run_id="r-1", spec_name="tiny", state=state, requester="U0ADA", step=step
    )


def alert(n: int) -> AlertMessage:
    return AlertMessage(
        channel=CHANNEL,
        alert_id=f"a-{n}",
        run_id="r-1",
        rule="disk",
        severity="warning",
        state="OPEN",
        title=f"alert number {n}",
        detail="disk 91% full",
        hint="raise disk_gb",
    )


def line(text: str, *, under: MessageRef | None = None) -> Message:
    return TextMessage(
        channel=CHANNEL,
        thread_ts=under.ts if under else None,
        kind="info",
        text=text,
        run_id="r-1",
    )


def test_a_post_returns_at_once_with_a_ref_of_its_own(front: Front) -> None:
    started = time.monotonic()
    refs = [front.notifier.post(alert(n)) for n in range(5)]
    assert time.monotonic() - started < 0.5, "post() never waits for the front end"
    assert all(r.channel == CHANNEL for r in refs) and len({r.ts for r in refs}) == 5
    shown = front.shown()
    assert [text for text, _ in shown] == [f"⚠ WARNING [a-{n}] alert number {n}" for n in range(5)]
    assert not any(reply for _, reply in shown)


def test_an_update_replaces_the_message_in_place(front: Front) -> None:
    ref = front.notifier.post(card())
    front.notifier.update(ref, card("SUCCEEDED", step=9))
    [(text, reply)] = front.shown()
    assert "finished · step 9" in text and "running" not in text and not reply


def test_a_reply_lands_in_the_thread_of_its_root(front: Front) -> None:
    root = front.notifier.post(card())
    front.notifier.post(line("checkpoint committed at step 5", under=root))
    front.notifier.post(line("a line of its own"))
    shown = front.shown()
    assert ("checkpoint committed at step 5", True) in shown
    assert ("a line of its own", False) in shown
    assert sum(1 for _, reply in shown if not reply) == 2, shown
