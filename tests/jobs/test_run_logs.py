"""``/train logs`` reads a run's output from its store, after the instance is gone, and a
failure's message shows the output's last lines (issue 27, point 1).

Through the real command path (``bot.dispatch``, the verb, the service, the store): a
local run whose instance directory was deleted, and an AWS run on moto's server whose
runner shipped its output to S3 and whose instance EC2 then terminated. The failure card
is rendered as Slack gets it.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from bot.commands import CommandError, Logs, parse
from bot.dispatch import dispatch
from bot.messages import FAILURE_TAIL_CHARS, MAX_REPLY_TEXT
from bot.views.cards import text_line
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal, TextMessage
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.providers.base import InstanceState
from jobs.usecases import service
from jobs.usecases.service import Actor
from runner.logship import LogLimits, LogShipper, read_tail
from runner.store import run_store
from runner.supervisor import Supervisor
from runner.wire import Event, encode_batch
from tests.jobs.test_aws_control_plane import (
    G_ON_DEMAND,
    G_SPOT,
    RANKED,
    Ec2Gate,
    Recorder,
    Refusal,
    attempt_launched,
    attempts_of,
    control_plane,
    make_aws,
    run_row,
    stub_quotas,
    stub_scores,
    submit_and_wait_for_preflight,
    user_data_env,
    wait_until,
)
from tests.runner.stand_ins import Recorder as EventSink

ADA = Actor(user="ada", channel="#ml")
#: Prints the configuration, 300 lines of progress, then fails with a message holding
#: Slack's three control characters.
FAILING = """\
import os
print("config: <lr=3e-4> & <batch=32>")
for step in range(300):
    print(f"step {step} loss {1 / (step + 1):.4f}")
print("logging in with", os.environ.get("WANDB_API_KEY", "no key"))
raise RuntimeError("loss is <nan> & climbing > 1e9")
"""
#: A spec's env value, which the script prints: never shown in chat.
SECRET = "wandb-sekrit-0123456789"
LAST_LINE = "RuntimeError: loss is <nan> & climbing > 1e9"
ESCAPED_LAST = "RuntimeError: loss is &lt;nan&gt; &amp; climbing &gt; 1e9"


def test_the_logs_verb_takes_an_attempt_and_a_node() -> None:
    assert parse("logs r-7f3a2c") == Logs(run="r-7f3a2c")
    assert parse("logs r-7f3a2c 2") == Logs(run="r-7f3a2c", attempt=2)
    assert parse("logs r-7f3a2c 2 1") == Logs(run="r-7f3a2c", attempt=2, node=1)
    assert parse("logs r-7f3a2c attempt=3 node=0") == Logs(run="r-7f3a2c", attempt=3)
    for bad in ("logs r-7f3a2c 0", "logs r-7f3a2c two", "logs r-7f3a2c 2 -1", "logs r-1 2 1 x"):
        with pytest.raises(CommandError, match=r"attempt|node|extra") as info:
            parse(bad)
        assert "/train logs <run> [attempt] [node]" in info.value.plain


def failure_card(notes: Recorder, run_id: str) -> TextMessage:
    found = [
        m
        for m in notes.posted
        if isinstance(m, TextMessage) and m.kind == "error" and m.run_id == run_id
    ]
    assert found, "the failure is said in the run's thread"
    return found[-1]


def slack_text(msg: TextMessage) -> str:
    [block] = text_line(msg)
    return str(block["text"]["text"])


def check_failure_card(msg: TextMessage) -> None:
    assert msg.log_tail is not None and msg.log_tail.endswith(LAST_LINE)
    text = slack_text(msg)
    assert len(text) <= 3000, "a Slack section takes 3,000 characters"
    assert ESCAPED_LAST in text and "<nan>" not in text
    assert "&lt;lr=3e-4&gt;" not in text, "the start of the output is clipped away"
    assert "Its last " in text and "```" in text


# -- the local provider -----------------------------------------------------------------


@pytest.fixture
def local_plane(tmp_path: Path) -> Iterator[tuple[ControlPlane, Recorder]]:
    specs = tmp_path / "specs"
    specs.mkdir()
    script = tmp_path / "fail.py"
    script.write_text(FAILING)
    (specs / "fails.yaml").write_text(
        f"command: {sys.executable} {script}\n"
        "resources:\n  cloud: local\n  spot: true\n"
        "resubmit:\n  backoff_s: 0\n"
        "dry_run:\n  enabled: false\n"
        f"env:\n  WANDB_API_KEY: {SECRET}\n"
    )
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_SPECS_DIR": str(specs),
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_LOCAL_TERMINATION_WINDOW_S": "5",
            "TRAINBOT_LOCAL_CORES": "8",
        }
    )
    notes = Recorder()
    journal = CallbackJournal(lambda t, run, data: None)
    cp = ControlPlane(settings, notifier=notes, journal=journal, scheduler=False)
    with cp:
        yield cp, notes
    for inst in cp.deps.provider.list_instances():
        if not inst.state.is_terminal():
            cp.deps.provider.terminate(inst.instance_id)
    cp.deps.provider.close()  # type: ignore[attr-defined]


def test_logs_of_a_failed_local_run_after_its_instance_directory_is_gone(
    local_plane: tuple[ControlPlane, Recorder],
) -> None:
    cp, notes = local_plane
    run = submit_and_wait_for_preflight_named(cp, "fails")
    service.confirm(cp.deps, run, ADA)
    wait_until(lambda: run_row(cp, run).state == RunState.FAILED, what="FAILED", timeout=60)
    [attempt] = attempts_of(cp, run)
    assert attempt.state == AttemptState.FAILED and attempt.instance_id is not None
    provider = cp.deps.provider
    wait_until(
        lambda: provider.status(attempt.instance_id).state.is_terminal(),  # type: ignore[arg-type]
        what="the instance ended",
    )
    instance_dir = provider.log_path(attempt.instance_id).parent  # type: ignore[attr-defined]
    # The instance is gone, its log file with it (the provider may be clearing its
    # scratch volume at the same moment).
    shutil.rmtree(instance_dir, ignore_errors=True)
    assert not instance_dir.exists()

    reply = dispatch(cp.deps, f"logs {run}", ADA, markup="slack")
    assert reply.ephemeral and reply.run_id == run
    assert f"Attempt 1 of {run} (FAILED: runner exited 1 (failed))" in reply.text
    assert ESCAPED_LAST in reply.text and "<nan>" not in reply.text
    assert "Traceback (most recent call last):" in reply.text
    assert "step 299 loss 0.0033" in reply.text
    assert SECRET not in reply.text and "logging in with [redacted]" in reply.text
    assert len(reply.text) <= MAX_REPLY_TEXT
    # The console gets it plain, and the same store is what it reads.
    plain = dispatch(cp.deps, f"logs {run} 1 0", ADA, markup="plain")
    assert LAST_LINE in plain.text and "config: <lr=3e-4> & <batch=32>" in plain.text
    # An attempt or node that does not exist is said plainly.
    assert "has no attempt 2" in dispatch(cp.deps, f"logs {run} 2", ADA, markup="plain").text
    assert "ran on 1 node(s)" in dispatch(cp.deps, f"logs {run} 1 3", ADA, markup="plain").text

    card = failure_card(notes, run)
    check_failure_card(card)
    assert SECRET not in slack_text(card) and "logging in with [redacted]" in slack_text(card)


def submit_and_wait_for_preflight_named(cp: ControlPlane, spec: str) -> str:
    run = service.submit(cp.deps, spec_name=spec, overrides=[], actor=ADA)
    wait_until(
        lambda: run_row(cp, run.id).state == RunState.AWAITING_CONFIRMATION, what="preflight"
    )
    return run.id


def test_a_failure_cards_tail_is_escaped_and_clipped() -> None:
    tail = "\n".join(f"<{i}> & {'x' * 60} >" for i in range(400)) + f"\n{LAST_LINE}"
    msg = TextMessage(
        channel="#ml", kind="error", text="Run r-1 failed: runner exited 1 (failed).",
        log_tail=tail,
    )  # fmt: skip
    text = slack_text(msg)
    assert len(text) <= 3000
    assert text.rstrip("`\n").endswith(ESCAPED_LAST)
    assert "&lt;399&gt; &amp; " in text and "<399>" not in text
    assert "&lt;0&gt;" not in text, "the oldest lines are clipped"
    assert "(of the 401 it sent)" in text
    # One huge line keeps its end; a fence in the output cannot close the block.
    huge = TextMessage(
        channel="#ml", kind="error", text="failed", log_tail="```" + "<" * 5000 + " the end"
    )
    text = slack_text(huge)
    assert len(text) <= 3000 and text.rstrip("`\n").endswith("&lt; the end")
    assert text.count("```") == 2
    assert FAILURE_TAIL_CHARS < 3000


# -- AWS, on moto's server ---------------------------------------------------------------


@pytest.fixture
def gate(moto: dict[str, Any]) -> Iterator[Ec2Gate]:
    proxy = Ec2Gate(moto["url"])
    yield proxy
    proxy.close()


def test_logs_of_a_failed_aws_run_are_read_from_s3_after_ec2_terminated_it(
    tmp_path: Path,
    moto: dict[str, Any],
    stubbers: list[Stubber],
    gate: Ec2Gate,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = moto["url"]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", url)  # the runner's and the control plane's S3
    aws = make_aws(moto, boto3.session.Session(), endpoint_url=gate.url)
    stub_quotas(stubbers, aws, (G_SPOT, 64), (G_ON_DEMAND, 64))
    stub_scores(stubbers, aws, url=url, calls=8)
    no_room = "We currently do not have sufficient g5.xlarge capacity in the zone you requested"

    def refuse(form: Mapping[str, str]) -> Refusal | None:
        if form.get("Placement.AvailabilityZone") in RANKED[:2] and form.get("DryRun") != "true":
            return (400, "InsufficientInstanceCapacity", no_room)
        return None

    gate.refuse = refuse
    with control_plane(tmp_path, aws, moto["bucket"]) as (cp, _, notes):
        run = submit_and_wait_for_preflight(cp).id
        service.confirm(cp.deps, run, ADA)
        wait_until(lambda: attempt_launched(cp, run, 3), what="attempt 3")
        third = attempt_launched(cp, run, 3)
        assert third is not None and third.instance_id is not None
        env = user_data_env(url, third.instance_id)

        # The instance's runner: the command fails, its output goes to the run's S3 prefix.
        store = run_store(env["TRAINBOT_CHECKPOINT_URI"], env["TRAINBOT_CHECKPOINT_PREFIX"])
        script = tmp_path / "train.py"
        script.write_text(FAILING)
        events = EventSink()
        code = Supervisor(
            [sys.executable, str(script)],
            sink=events,
            install_signals=False,
            scratch_dir=tmp_path,
            sample_s=3600,
            logs=LogShipper(lambda: store, attempt=third.id, limits=LogLimits()),
        ).run()
        assert code == 1
        # Its events reach the control plane with its token, as its Reporter sends them.
        batch = [
            Event(attempt=third.id, seq=i, type=t, time=time.time(), run=run, data=d)
            for i, (t, d) in enumerate(events.events)
        ]
        token = env["TRAINBOT_TOKEN"]
        assert cp.ingest.handle(f"Bearer {token}", encode_batch(batch)).status == 200
        wait_until(lambda: run_row(cp, run).state == RunState.FAILED, what="FAILED")
        # The control plane terminates the instance (its disk, and any log on it, go too).
        wait_until(
            lambda: aws.status(third.instance_id).state is InstanceState.TERMINATED,  # type: ignore[arg-type]
            what="the instance terminated",
        )

        tail = read_tail(store, third.id, 0, max_bytes=1 << 20)
        assert tail is not None and tail.text.endswith(LAST_LINE)
        reply = dispatch(cp.deps, f"logs {run}", ADA, markup="slack")
        assert f"Attempt 3 of {run} (FAILED: runner exited 1 (failed))" in reply.text
        assert ESCAPED_LAST in reply.text and "<nan>" not in reply.text
        assert "keeps logs on the instance" not in reply.text
        # Attempts 1 and 2 never started: the provider's refusal and where it tried.
        never = dispatch(cp.deps, f"logs {run} 2", ADA, markup="plain")
        assert f"attempt 2 of {run} never started: no capacity: " in never.text
        assert "InsufficientInstanceCapacity" in never.text
        tried = f"(tried spot in {RANKED[1]}, us-east-1 on aws; before it, {RANKED[0]} (attempt 1))"
        assert tried in never.text

        check_failure_card(failure_card(notes, run))
