"""Issue 23, item 5: one run's flood of warnings does not bury another run's page.

The real control plane (its ingest API over HTTP, its alert rules, its Slack notifier)
and the local fake Slack Web API at Slack's own pace (one message per second per
channel, whole-second ``Retry-After``). Two runs report into one channel; run A's runner
sends one batch of 300 ``log`` warnings, then run B's runner sends a NaN loss.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bot.slack_notifier import SlackNotifier
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run, hash_token
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import MessageRef, NullJournal
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.runs.cards import card
from jobs.web.server import EVENTS_PATH
from tests.bot.test_slack_app import SECRET, TOKEN, terminate_instances
from tests.fakes.slack_api import FakeSlack
from tests.jobs.test_ingest import body, metrics

TRAIN = "C0TRAIN"
#: What issue 23 asks: the page is in the channel within 5 s of being raised.
PAGE_WITHIN_S = 5.0


@dataclass
class Plane:
    cp: ControlPlane
    fake: FakeSlack
    notifier: SlackNotifier

    @property
    def events_url(self) -> str:
        assert self.cp.server is not None
        return self.cp.server.url + EVENTS_PATH


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    fake = FakeSlack(tokens=[TOKEN], post_interval_s=1.0, burst=1).start()
    fake.add_channel(TRAIN, "ml-training", members=["U0ADA", "U0BOB"])
    # Slack's own pace: one message per second per channel.
    notifier = SlackNotifier(fake.client(TOKEN, retry_handlers=[]), min_interval_s=1.0)
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_NOTIFIER": "slack",
            "TRAINBOT_SLACK_SIGNING_SECRET": SECRET,
            "TRAINBOT_SLACK_BOT_TOKEN": TOKEN,
            "TRAINBOT_ALLOWED_CHANNELS": TRAIN,
        }
    )
    cp = ControlPlane(settings, notifier=notifier, journal=NullJournal(), scheduler=False)
    cp.start()
    try:
        yield Plane(cp=cp, fake=fake, notifier=notifier)
    finally:
        cp.close()
        terminate_instances(cp)
        notifier.close(timeout=5)
        fake.close()


def running(plane: Plane, run_id: str, user: str) -> tuple[str, MessageRef]:
    """A run in #ml-training whose card is in the channel, with an attempt whose runner
    holds a token: the token, and the card."""
    token = f"tok-{run_id}"
    with session_scope(plane.cp.deps.engine) as session:
        run = Run(
            id=run_id,
            spec_name="tiny",
            spec={"name": "tiny", "command": "python train.py"},
            requester=user,
            channel=TRAIN,
            state=RunState.RUNNING,
            budget_usd=5.0,
        )
        session.add(run)
        session.flush()
        posted = plane.notifier.post(card(session, run))
        run.thread_ts = posted.ts
        session.add(run)
        session.add(
            Attempt(
                id=f"a-{run_id}",
                run_id=run_id,
                number=1,
                state=AttemptState.RUNNING,
                provider="local",
                token_hash=hash_token(token),
            )
        )
    return token, posted


def send(plane: Plane, batch: bytes, token: str) -> None:
    request = urllib.request.Request(
        plane.events_url,
        data=batch,
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200, reply.read()
        assert json.loads(reply.read())["accepted"] > 0


def test_300_warnings_are_one_message_and_another_runs_page_goes_out_first(
    plane: Plane,
) -> None:
    fake = plane.fake
    flood, flood_card = running(plane, "r-flood", "U0ADA")
    other, _ = running(plane, "r-other", "U0BOB")
    assert plane.notifier.flush(timeout=10), "both cards are in the channel"
    flood_thread = plane.notifier.resolve(flood_card)
    assert flood_thread is not None

    warnings = [
        ("log", {"level": "warning", "message": f"nothing to sync in ckpt/{n}"}) for n in range(300)
    ]
    started = time.monotonic()
    send(plane, body(warnings, attempt="a-r-flood", run="r-flood"), flood)
    raised = time.monotonic()  # the page is raised while this POST is answered
    ingest_s = raised - started  # seconds (a loaded machine: more) the warnings arrived over
    send(plane, body([metrics(12, float("nan"))], attempt="a-r-other", run="r-other"), other)

    def page_sent() -> float | None:
        for call in fake.calls_to("chat.postMessage"):
            if call.ok and "loss is nan" in json.dumps(call.args).lower() and call.time >= raised:
                return call.time
        return None

    assert fake.wait_for(lambda: page_sent() is not None, timeout=30), "the page went out"
    at = page_sent()
    assert at is not None
    assert at - raised <= PAGE_WITHIN_S, f"the page took {at - raised:.1f} s"

    # The 300 warnings: one message in run A's thread, edited, that counts them all.
    assert plane.notifier.flush(timeout=60)
    lines = [m for m in fake.messages(TRAIN) if "nothing to sync" in m.text]
    assert len(lines) == 1, [m.text for m in lines]
    [line] = lines
    assert line.thread_ts == flood_thread.ts, "in run A's thread"
    assert "nothing to sync in ckpt/299" in line.text, "the newest warning is shown"
    found = re.search(r"\((\d+) warnings from run r-flood", line.text)
    assert found is not None and int(found.group(1)) == 300, line.text
    posts = [c for c in fake.calls_to("chat.postMessage") if "nothing to sync" in str(c.args)]
    assert len([c for c in posts if c.ok]) == 1, "one post; the rest are edits of it"
    edits = fake.calls_to("chat.update")
    assert len(edits) <= ingest_s + 3, "at most an edit a second while they came, not one each"
    assert plane.notifier.metrics["dropped"] == 0
