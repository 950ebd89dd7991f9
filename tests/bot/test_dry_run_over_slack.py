"""Issue 23.3 and 23.4 through signed HTTP into the real Slack app: four long cloud dry
runs leave another person's launch and a stop unaffected, and ``/train stop`` ends a dry
run's instance and its token within seconds.

The control plane runs on AWS through moto's server as in ``test_dry_run_lanes`` (whose
other tests cover the admin's limits and the dry run's spend); here every command is a
signed ``/train`` request, every button a signed action, and what people see is read from
the fake Slack Web API.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import boto3
from botocore.stub import Stubber

from bot.slack_notifier import SlackNotifier
from bot.slack_wsgi import attach
from bot.views import LAUNCH_ANYWAY
from jobs.database.models import Attempt
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from tests.bot.test_security import answer, press, run_ids
from tests.bot.test_slack_app import SECRET, TOKEN, ResponseUrls, Slack
from tests.fakes import aws as fake
from tests.fakes.slack_api import FakeSlack
from tests.jobs import test_aws_control_plane as on_aws
from tests.jobs.test_cloud_dry_run import (
    aws_env,
    aws_spec,
    dry_rows,
    dry_run_instances,
    moto,
    state_of,
)
from tests.jobs.test_dry_run_lanes import SILENT, STOP_WITHIN_S, credentials_status, gone
from tests.waiting import wait_until

__all__ = ["moto"]  # the module-scoped moto fixture of test_cloud_dry_run

ML, CV, NLP = "C0ML", "C0CV", "C0NLP"
ADA, BOB, CAROL = "U0ADA", "U0BOB", "U0CAROL"


@contextmanager
def slack_on_moto(tmp_path: Path, moto: dict[str, Any]) -> Iterator[Slack]:
    """``trainbot serve`` on moto with the Slack app: specs ``gpu`` (a six-hour cloud dry
    run whose instance never reports) and ``quick`` (no dry run); three channels."""
    url, bucket = moto["url"], moto["bucket"]
    env = aws_env(tmp_path, moto, aws_spec(bucket, url, command=SILENT, timeout="6h"))
    quick = aws_spec(bucket, url, command=SILENT).replace(
        "dry_run:\n", "dry_run:\n  enabled: false\n"
    )
    (tmp_path / "specs" / "quick.yaml").write_text(quick)
    env |= {
        "TRAINBOT_NOTIFIER": "slack",
        "TRAINBOT_SLACK_SIGNING_SECRET": SECRET,
        "TRAINBOT_SLACK_BOT_TOKEN": TOKEN,
        "TRAINBOT_ALLOWED_CHANNELS": f"{ML},{CV},{NLP}",
        "TRAINBOT_LAUNCHERS": f"{ADA},{BOB},{CAROL}",
    }
    slack_api = FakeSlack(
        tokens=[TOKEN], post_interval_s=0.02, burst=5, whole_second_retry_after=False
    ).start()
    slack_api.add_channel(ML, "ml", members=[ADA])
    slack_api.add_channel(CV, "cv", members=[BOB])
    slack_api.add_channel(NLP, "nlp", members=[CAROL])
    hooks = ResponseUrls()
    notifier = SlackNotifier(slack_api.client(TOKEN), min_interval_s=0.02, backoff_s=0.05)
    aws = on_aws.make_aws(moto, boto3.session.Session())
    quotas = Stubber(aws.client("service-quotas"))
    for _ in range(16):  # each preflight asks for both quotas, in either order
        quotas.add_response("get_service_quota", fake.quota(on_aws.G_SPOT, 64), None)
    quotas.activate()
    cp = ControlPlane(
        load_settings(env),
        notifier=notifier,
        journal=CallbackJournal(lambda *_: None),
        provider=aws,
        scheduler=False,
    )
    front = attach(cp, client=slack_api.client(TOKEN), notifier=notifier)
    cp.start()
    try:
        yield Slack(cp=cp, fake=slack_api, hooks=hooks, notifier=notifier, front=front)
    finally:
        front.close()
        cp.close()
        notifier.close(timeout=5)
        hooks.close()
        slack_api.close()
        quotas.deactivate()


def new_run(slack: Slack, text: str, *, user: str, channel: str) -> tuple[str, str]:
    """Types ``/train <text>``: the new run's id and the reply its author saw."""
    before = set(run_ids(slack))
    reply = answer(slack, text, user=user, channel=channel)
    wait_until(lambda: len(run_ids(slack)) > len(before), 15, f"a run from {text!r} ({reply})")
    (run_id,) = set(run_ids(slack)) - before
    return run_id, reply


def channel_text(slack: Slack, channel: str) -> str:
    """Everything posted in ``channel`` and its threads, as one text."""
    slack.notifier.flush(10)
    texts = []
    for message in slack.fake.messages(channel):
        texts.append(message.text)
        texts.extend(m.text for m in slack.fake.replies(channel, message.ts))
    return "\n".join(texts)


def test_four_long_dry_runs_leave_another_launch_and_a_stop_unaffected_over_slack(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    url = moto["url"]
    with slack_on_moto(tmp_path, moto) as slack:
        # Four six-hour dry runs, two in each of two channels (the default bound).
        waiting = []
        for user, channel in ((ADA, ML), (ADA, ML), (BOB, CV), (BOB, CV)):
            run_id, _ = new_run(slack, "preflight gpu", user=user, channel=channel)
            [inst] = wait_until(partial(dry_run_instances, url, run_id), 60, f"{run_id}'s dry run")
            waiting.append((run_id, str(inst["InstanceId"])))
        for run_id, instance_id in waiting:
            assert slack.state(run_id) == RunState.PREFLIGHT
            assert state_of(url, instance_id) in ("pending", "running")

        # A fifth in a channel at its bound is refused at once, saying why and what to do.
        fifth, _ = new_run(slack, "preflight gpu", user=ADA, channel=ML)
        wait_until(lambda: slack.state(fifth) != RunState.PREFLIGHT, 30, "the fifth's reply")
        wait_until(
            lambda: "TRAINBOT_DRY_RUNS_PER_CHANNEL=2" in channel_text(slack, ML),
            15,
            "the refusal in #ml",
        )
        assert "2 dry runs under way" in channel_text(slack, ML)
        assert not dry_run_instances(url, fifth), "nothing launched for it"

        # Carol launches in her channel meanwhile: preflight, "Launch anyway", instance.
        other, reply = new_run(slack, "launch quick", user=CAROL, channel=NLP)
        settled = {RunState.PENDING, RunState.PREFLIGHT}
        wait_until(lambda: slack.state(other) not in settled, 30, "carol's preflight")
        assert slack.state(other) == RunState.AWAITING_CONFIRMATION, (
            reply,
            channel_text(slack, NLP),
        )
        press(slack, LAUNCH_ANYWAY, other, user=CAROL, channel=NLP)
        attempt = wait_until(
            lambda: on_aws.attempt_launched(slack.cp, other, 1), 30, "carol's launch"
        )
        assert isinstance(attempt, Attempt) and attempt.instance_id is not None

        # Every general worker busy, and more work queued behind them: stops have a lane
        # of their own.
        busy = threading.Event()
        stuck = [slack.cp.deps.background(busy.wait, 120) for _ in range(6)]

        # Her stop ends her instance within seconds.
        answer(slack, f"stop {other}", user=CAROL, channel=NLP)
        wait_until(
            lambda: gone(url, str(attempt.instance_id)), STOP_WITHIN_S, "carol's instance to end"
        )

        # Ada's stop of a run in its dry run ends the instance and revokes its token.
        run_id, instance_id = waiting[0]
        [row] = dry_rows(slack.cp, run_id)
        token = slack.cp.deps.runner_token(row.id)
        assert credentials_status(slack.cp, token) == 200
        stopped_at = time.monotonic()
        answer(slack, f"stop {run_id}", user=ADA, channel=ML)
        wait_until(lambda: gone(url, instance_id), STOP_WITHIN_S, "the dry run's instance to end")
        assert credentials_status(slack.cp, token) == 401
        assert time.monotonic() - stopped_at < STOP_WITHIN_S
        wait_until(lambda: slack.state(run_id) == RunState.STOPPED, 10, "the run stopped")
        wait_until(lambda: dry_rows(slack.cp, run_id)[0].ended_at is not None, 10, "its row")
        [row] = dry_rows(slack.cp, run_id)
        assert row.token_hash is None and row.end_reason is not None
        assert "stopped by" in row.end_reason

        assert not any(f.done() for f in stuck), "the general workers were busy throughout"
        busy.set()

        # The other three still wait on their instances, which still run.
        for other_run, other_instance in waiting[1:]:
            assert slack.state(other_run) == RunState.PREFLIGHT
            assert state_of(url, other_instance) in ("pending", "running")
    # Closing the control plane ends them.
    for _, other_instance in waiting[1:]:
        assert gone(url, other_instance)


def test_the_spec_cannot_pick_a_costly_dry_run_instance_over_slack(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    """Issue 23.8's reproduction, typed in the channel: the dry run's type comes from the
    admin's list, so a p5.48xlarge on demand is refused at preflight and nothing runs."""
    url = moto["url"]
    with slack_on_moto(tmp_path, moto) as slack:
        text = "preflight gpu dry_run.instance_type=p5.48xlarge resources.spot=false"
        run_id, _ = new_run(slack, text, user=ADA, channel=ML)
        wait_until(lambda: slack.state(run_id) == RunState.PREFLIGHT_FAILED, 30, "preflight")
        said = channel_text(slack, ML)
        assert "dry_run.instance_type=p5.48xlarge is not a dry-run type" in said
        assert "TRAINBOT_DRY_RUN_INSTANCE_TYPES" in said
        assert not dry_run_instances(url, run_id), "nothing was launched"
        assert not dry_rows(slack.cp, run_id)
