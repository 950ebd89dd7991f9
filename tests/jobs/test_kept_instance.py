"""A failed attempt's instance kept for a person to look at (issue 27, point 5).

``debug.keep_failed_instance: 30m`` keeps the instance of a FAILED attempt running
instead of terminating it, says in the thread how to connect, and bills it; the
scheduled reconcile terminates it when its time is up (the deadline is a row, so a
restarted control plane does too), and its cost is a line of the daily digest. On the
local provider (a real process left running, then killed) and on moto's EC2 (an
instance left running, then terminated), with the control plane's clock moved on.
"""

from __future__ import annotations

import io
import os
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from sqlalchemy import Engine
from sqlmodel import Session

from bot.commands import Release, parse
from bot.console import ConsoleNotifier
from bot.dispatch import dispatch
from bot.messages import digest
from jobs import spend
from jobs.database.db import session_scope
from jobs.database.models import Attempt, KeptInstance, Run
from jobs.domain.errors import ConflictError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal, DigestMessage, Message, TextMessage
from jobs.process.deps import Deps
from jobs.process.settings import Settings, load_settings
from jobs.providers.base import InstanceState, ResourceRequest
from jobs.providers.gcp import GcpProvider
from jobs.providers.local import REGION, ZONE, LocalProvider
from jobs.runs import kept, reconcile
from jobs.runs.end import end_attempt
from jobs.spec import JobSpec
from jobs.usecases.service import Actor
from runner import env as contract
from tests.fakes.gce_api import FakeComputeApi
from tests.jobs.local_plane import Clock, local_deps
from tests.jobs.providers import test_boot_scripts as boot_scripts
from tests.jobs.providers.contract import launch_request, wait_for_state
from tests.jobs.providers.test_boot_scripts import (
    AWS_T4,
    GCP_A100,
    GCP_ZONE,
    run_startup_script,
    run_user_data,
)
from tests.jobs.rows import add_run, running_attempt, tiny_run
from tests.jobs.test_aws_control_plane import all_instances, make_aws
from tests.waiting import wait_until

#: The attempt failed at this time, after two hours of training at PRICE an hour.
FAILED_AT = datetime(2026, 12, 5, 10, 0, tzinfo=timezone.utc)
STARTED_AT = FAILED_AT - timedelta(hours=2)
PRICE = 1.2
KEEP = "30m"
ADA = Actor(user="ada", channel="#ml")
#: Sleeps like a failed training process's instance left to look at; writes its pid to
#: the file it is given.
SLEEPER = [
    sys.executable,
    "-c",
    "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)",
]


class Posts:
    """The notifier: what was posted in the runs' threads."""

    def __init__(self) -> None:
        self.posted: list[Message] = []
        self._console = ConsoleNotifier(io.StringIO())

    def post(self, msg: Message) -> Any:
        self.posted.append(msg)
        return self._console.post(msg)

    def update(self, ref: Any, msg: Message) -> None:
        self.posted.append(msg)

    def texts(self) -> list[str]:
        return [m.text for m in self.posted if isinstance(m, TextMessage)]


def add_failing_attempt(
    engine: Engine,
    *,
    run_id: str,
    attempt_id: str,
    provider: str,
    instance_id: str,
    zone: str,
    keep: str | None = KEEP,
    budget_usd: float | None = None,
) -> None:
    """A run RUNNING on attempt 1, two hours in, whose spec keeps a failed instance;
    ``budget_usd``: its hard cap."""
    spec: dict[str, Any] = {"name": "tiny", "command": ["python", "train.py"]}
    if keep is not None:
        spec["debug"] = {"keep_failed_instance": keep}
    if budget_usd is not None:
        spec["budget"] = {"usd": budget_usd}
    with Session(engine) as session:
        add_run(
            session,
            tiny_run(
                run_id,
                spec=spec,
                requester="ada",
                channel="#ml",
                state=RunState.RUNNING,
                budget_usd=budget_usd,
            ),
            running_attempt(
                attempt_id,
                run_id,
                provider=provider,
                instance_id=instance_id,
                zone=zone,
                price_per_hour=PRICE,
                started_at=STARTED_AT,
                created_at=STARTED_AT,
                last_heartbeat=FAILED_AT,
            ),
        )
        session.commit()


def fail_then_expire(
    deps: Deps, clock: Clock, posts: Posts, *, run_id: str, attempt_id: str
) -> str:
    """End the attempt as a failure at FAILED_AT; check the instance is kept (no orphan
    to reconcile, the run FAILED); move the clock past the deadline and reconcile.
    Returns the kept instance's id."""
    clock.now = FAILED_AT
    end_attempt(deps, attempt_id, state=AttemptState.FAILED, exit_code=1, reason="exit 1")
    with session_scope(deps.engine) as session:
        row = session.get(KeptInstance, attempt_id)
        run = session.get(Run, run_id)
        attempt = session.get(Attempt, attempt_id)
        assert row is not None and run is not None and attempt is not None
        assert run.state == RunState.FAILED, "keeping the instance leaves the run failed"
        assert attempt.state == AttemptState.FAILED and attempt.token_hash is None
        assert row.until == FAILED_AT + timedelta(minutes=30) and row.ended_at is None
        instance_id = row.instance_id
    said = posts.texts()
    assert any(f"/train release {run_id}" in t and "until" in t for t in said), said
    # Ten minutes on: reconcile sees a running instance whose attempt ended, and leaves it.
    clock.now = FAILED_AT + timedelta(minutes=10)
    counts = reconcile(deps)
    assert counts["released"] == 0
    provider = deps.provider_named(attempt.provider)
    assert provider.status(instance_id).state == InstanceState.RUNNING
    # Its time is up: the next reconcile terminates it.
    clock.now = FAILED_AT + timedelta(minutes=31)
    assert reconcile(deps)["released"] == 1
    with session_scope(deps.engine) as session:
        ended = session.get(KeptInstance, attempt_id)
        assert ended is not None and ended.ended_by == "time"
        assert ended.ended_at == FAILED_AT + timedelta(minutes=31)
    assert any("is terminated (its time is up)" in t for t in posts.texts())
    assert reconcile(deps)["released"] == 0, "terminated once"
    return instance_id


def check_digest(deps: Deps, *, run_id: str) -> None:
    """The next day's digest of the day: the attempt's two hours and the kept 31 minutes,
    the latter on a line of its own and in the run's line."""
    with session_scope(deps.engine) as session:
        spend.accrue(session, now=FAILED_AT + timedelta(days=1))
        figures = spend.digest_figures(
            session, channel="#ml", now=FAILED_AT + timedelta(days=1), tz=timezone.utc
        )
    kept_usd = round(PRICE * 31 / 60, 2)
    assert figures["kept_usd"] == kept_usd
    [row] = [r for r in figures["per_run"] if r["run_id"] == run_id]
    assert row["kept_usd"] == kept_usd
    assert row["usd"] == round(PRICE * 2 + PRICE * 31 / 60, 2)
    assert row["state"] == "FAILED"
    text = digest(DigestMessage(channel="#ml", figures=figures, chart_png=None))
    assert f"kept failed instances ${kept_usd:.2f}" in text, text
    assert f"(kept failed instance ${kept_usd:.2f})" in text, text


# -- the local provider --------------------------------------------------------------------


@pytest.fixture
def local(tmp_path: Path, db_engine: Engine) -> Iterator[tuple[Deps, Clock, Posts]]:
    settings = load_settings({"TRAINBOT_STATE_DIR": str(tmp_path / "state")})
    clock, posts = Clock(FAILED_AT), Posts()
    # The provider's instances under the state directory, as the control plane has them.
    with local_deps(settings, db_engine, settings.state_dir, clock=clock, at_once=True) as deps:
        deps.notifier = posts
        yield deps, clock, posts


def running_sleeper(
    deps: Deps, n: int, *, keep: str | None = KEEP, budget_usd: float | None = None
) -> tuple[str, int]:
    """Run r-N on attempt a-N, whose local instance's process sleeps (``add_failing_attempt``):
    the instance's id and the process's pid."""
    run_id, attempt_id = f"r-{n}", f"a-{n}"
    request = ResourceRequest(cloud="local", region=REGION, cpus=1)
    pid_file = deps.settings.state_dir / f"{attempt_id}.pid"
    info = deps.provider.launch(
        launch_request(
            request, [*SLEEPER, str(pid_file)], zone=ZONE, run_id=run_id, attempt_id=attempt_id
        )
    )
    wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", timeout=20)
    add_failing_attempt(
        deps.engine,
        run_id=run_id,
        attempt_id=attempt_id,
        provider="local",
        instance_id=info.instance_id,
        zone=ZONE,
        keep=keep,
        budget_usd=budget_usd,
    )
    return info.instance_id, int(pid_file.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_kept_local_instance_is_killed_when_its_time_is_up_and_billed_in_the_digest(
    local: tuple[Deps, Clock, Posts],
) -> None:
    deps, clock, posts = local
    instance_id, pid = running_sleeper(deps, 1)
    # A control plane restarted after the failure reads the deadline from its row: the
    # reconciles run on a new one, with a provider of its own on the same directory.
    restarted = Deps(
        settings=deps.settings,
        engine=deps.engine,
        provider=LocalProvider(deps.settings.state_dir / "local"),
        notifier=posts,
        journal=CallbackJournal(lambda *_: None),
        clock=clock,
    )
    try:
        clock.now = FAILED_AT
        end_attempt(deps, "a-1", state=AttemptState.FAILED, exit_code=1, reason="exit 1")
        assert alive(pid), "the failed attempt's process is left running"
        # The instance directory is how a person reaches a local instance; /train status
        # shows it too.
        directory = deps.settings.state_dir / "local" / instance_id
        assert any(f"Connect: `cd {directory}`" in t for t in posts.texts()), posts.texts()
        status = dispatch(deps, "status r-1", ADA, markup="plain").text
        assert f"kept instance {instance_id} until" in status and f"cd {directory}" in status
        fail_then_expire(restarted, clock, posts, run_id="r-1", attempt_id="a-1")
    finally:
        restarted.close()
        restarted.provider.close()
    assert not alive(pid), "the sleeping process was killed"
    assert deps.provider.status(instance_id).state == InstanceState.TERMINATED
    assert "kept instance" not in dispatch(deps, "status r-1", ADA, markup="plain").text
    check_digest(deps, run_id="r-1")


def test_release_ends_a_kept_instance_early_for_its_owner_only(
    local: tuple[Deps, Clock, Posts],
) -> None:
    deps, clock, _ = local
    assert parse("release r-2") == Release(run="r-2")
    instance_id, pid = running_sleeper(deps, 2)
    clock.now = FAILED_AT
    end_attempt(deps, "a-2", state=AttemptState.FAILED, exit_code=1, reason="exit 1")
    refused = dispatch(deps, "release r-2", Actor(user="bob", channel="#ml"), markup="plain")
    assert refused.outcome == "refused" and "only they or an admin" in refused.text
    assert alive(pid)
    clock.now = FAILED_AT + timedelta(minutes=5)
    reply = dispatch(deps, "release r-2", ADA, markup="plain")
    assert reply.text == f"Released r-2's kept instance {instance_id}: terminated, billing stopped."
    assert not alive(pid)
    with session_scope(deps.engine) as session:
        row = session.get(KeptInstance, "a-2")
        assert row is not None and row.ended_by == "ada" and row.ended_at == clock.now
    again = dispatch(deps, "release r-2", ADA, markup="plain")
    assert again.outcome == "failed" and "has no kept instance" in again.text
    with pytest.raises(ConflictError, match="no kept instance"):
        kept.release(deps, "r-2", ADA)
    # Billed for the five minutes it was kept, nothing after.
    with session_scope(deps.engine) as session:
        spend.accrue(session, now=FAILED_AT + timedelta(hours=1))
        assert spend.run_spent(session, "r-2") == pytest.approx(PRICE * (2 + 5 / 60))


def test_a_kept_instance_that_ends_outside_trainbot_bills_no_more(
    local: tuple[Deps, Clock, Posts],
) -> None:
    deps, clock, posts = local
    instance_id, pid = running_sleeper(deps, 5)
    clock.now = FAILED_AT
    end_attempt(deps, "a-5", state=AttemptState.FAILED, exit_code=1, reason="exit 1")
    deps.provider.terminate(instance_id)  # by hand, outside trainbot
    assert not alive(pid)
    clock.now = FAILED_AT + timedelta(minutes=2)
    assert reconcile(deps)["released"] == 1
    with session_scope(deps.engine) as session:
        row = session.get(KeptInstance, "a-5")
        assert row is not None and row.ended_by == "gone" and row.ended_at == clock.now
        spend.accrue(session, now=FAILED_AT + timedelta(hours=1))
        assert spend.run_spent(session, "r-5") == pytest.approx(PRICE * (2 + 2 / 60))
    assert any(f"{instance_id} ended outside trainbot after 2 min" in t for t in posts.texts())


def test_a_kept_instance_stops_at_the_runs_hard_budget_cap(
    local: tuple[Deps, Clock, Posts],
) -> None:
    deps, clock, posts = local
    # Two hours at $1.20 spent $2.40 of $2.50: the kept instance has five minutes.
    _, pid = running_sleeper(deps, 6, budget_usd=2.5)
    clock.now = FAILED_AT
    end_attempt(deps, "a-6", state=AttemptState.FAILED, exit_code=1, reason="exit 1")
    for minutes, released in ((4, 0), (6, 1)):
        clock.now = FAILED_AT + timedelta(minutes=minutes)
        with session_scope(deps.engine) as session:
            spend.accrue(session, now=clock.now)  # the spend job's minute
        assert reconcile(deps)["released"] == released, minutes
    assert not alive(pid)
    with session_scope(deps.engine) as session:
        row = session.get(KeptInstance, "a-6")
        assert row is not None and row.ended_by == "budget"
    assert any("reached its hard budget cap" in t for t in posts.texts()), posts.texts()


def test_a_preempted_or_stopped_attempt_or_a_spec_without_the_option_is_not_kept(
    local: tuple[Deps, Clock, Posts],
) -> None:
    deps, _, _ = local
    first, _ = running_sleeper(deps, 3, keep=None)
    end_attempt(deps, "a-3", state=AttemptState.FAILED, exit_code=1, reason="exit 1")
    wait_for_state(deps.provider, first, {InstanceState.TERMINATED})
    second, _ = running_sleeper(deps, 4)
    end_attempt(deps, "a-4", state=AttemptState.PREEMPTED, exit_code=143, reason="preempted")
    wait_for_state(deps.provider, second, {InstanceState.TERMINATED})
    # A person stopped the run, and its runner's failure came in before the stop's end.
    third, _ = running_sleeper(deps, 7)
    with session_scope(deps.engine) as session:
        run = session.get(Run, "r-7")
        assert run is not None
        run.state = RunState.STOPPED
        session.add(run)
    end_attempt(deps, "a-7", state=AttemptState.FAILED, exit_code=1, reason="exit 1")
    wait_for_state(deps.provider, third, {InstanceState.TERMINATED})
    with session_scope(deps.engine) as session:
        for attempt_id in ("a-3", "a-4", "a-7"):
            assert session.get(KeptInstance, attempt_id) is None, attempt_id


def test_the_connect_command_names_each_node_of_a_gang_where_it_is(settings: Settings) -> None:
    project = settings.model_copy(update={"gcp_project": "ml-prod"})

    def row(provider: str, instance_id: str, zone: str) -> KeptInstance:
        return KeptInstance(
            attempt_id="a-1", run_id="r-1", provider=provider, instance_id=instance_id,
            zone=zone, kept_at=FAILED_AT, until=FAILED_AT,
        )  # fmt: skip

    gang = row("aws", "i-0a+us-west-2/i-0b", "us-east-1c")
    assert kept.connect_hint(settings, gang) == (
        "node 0: aws ssm start-session --target i-0a --region us-east-1; "
        "node 1: aws ssm start-session --target i-0b --region us-west-2"
    )
    gcp_node = row("gcp", "us-central1-b/trainbot-a-1-0123456789", "us-central1-b")
    assert kept.connect_hint(project, gcp_node) == (
        "gcloud compute ssh trainbot-a-1-0123456789 --zone us-central1-b --project ml-prod"
    )


def test_the_admin_maximum_cuts_the_time_asked(settings: Settings) -> None:
    capped = settings.model_copy(update={"keep_failed_instance_max_s": 600.0})
    run = Run(
        id="r-5", spec_name="t", spec={"debug": {"keep_failed_instance": "2h"}}, requester="a"
    )
    assert kept.keep_seconds(capped, run) == (600.0, 7200.0)
    assert kept.keep_seconds(settings, run) == (7200.0, None)
    off = settings.model_copy(update={"keep_failed_instance_max_s": 0.0})
    assert kept.keep_seconds(off, run) == (0.0, 7200.0)
    # What the attempt's boot script is told (TRAINBOT_KEEP_FAILED_S), within the maximum.
    spec = JobSpec(name="t", command=["true"], debug={"keep_failed_instance": "2h"})
    assert kept.instance_keep_s(capped, spec) == 600
    assert kept.instance_keep_s(settings, spec) == 7200
    assert kept.instance_keep_s(off, spec) is None
    assert kept.instance_keep_s(settings, JobSpec(name="t", command=["true"])) is None


# -- AWS on moto's server -------------------------------------------------------------------


def test_a_kept_ec2_instance_is_terminated_when_its_time_is_up_and_billed_in_the_digest(
    moto: dict[str, Any], session: boto3.session.Session, db_engine: Engine, tmp_path: Path
) -> None:
    settings = load_settings({"TRAINBOT_STATE_DIR": str(tmp_path / "state")})
    ec2 = make_aws(moto, session)
    clock, posts = Clock(FAILED_AT), Posts()
    run_id, attempt_id = f"r-{uuid.uuid4().hex[:8]}", f"a-{uuid.uuid4().hex[:8]}"
    request = ResourceRequest(
        cloud="aws", region="us-east-1", accelerator_type="A10G", accelerator_count=1
    )
    info = ec2.launch(
        launch_request(
            request, ["trainbot-runner", "exec", "--", "python", "train.py"],
            zone="us-east-1a", run_id=run_id, attempt_id=attempt_id,
        )
    )  # fmt: skip
    deps = Deps(
        settings=settings,
        engine=db_engine,
        provider=ec2,
        notifier=posts,
        journal=CallbackJournal(lambda *_: None),
        clock=clock,
    )
    deps.background = lambda fn, *a, **k: fn(*a, **k)  # type: ignore[assignment,method-assign,return-value]
    try:
        add_failing_attempt(
            db_engine,
            run_id=run_id,
            attempt_id=attempt_id,
            provider="aws",
            instance_id=info.instance_id,
            zone="us-east-1a",
        )
        instance_id = fail_then_expire(deps, clock, posts, run_id=run_id, attempt_id=attempt_id)
        hint = f"aws ssm start-session --target {instance_id} --region us-east-1"
        assert any(hint in t for t in posts.texts()), posts.texts()
        [described] = [i for i in all_instances(moto["url"]) if i["InstanceId"] == instance_id]
        assert described["State"]["Name"] in ("shutting-down", "terminated")
        check_digest(deps, run_id=run_id)
    finally:
        deps.close()


# -- the instance's own side: the boot scripts --------------------------------------------------

#: A provider on the fake Compute API (tests/jobs/conftest.py's ``gce``), as the boot
#: scripts' tests have it.
gcp = boot_scripts.gcp


@pytest.mark.parametrize(("code", "keeps"), [(3, True), (75, False), (0, False)])
def test_the_aws_boot_script_keeps_a_failed_instance_up_for_its_time_then_halts(
    moto: dict[str, Any], session: boto3.session.Session, tmp_path: Path, code: int, keeps: bool
) -> None:
    # A failure's instance waits TRAINBOT_KEEP_FAILED_S before it halts (the control plane
    # terminates it by then); a preempted (75) or finished (0) runner halts at once.
    env = {contract.KEEP_FAILED_S.name: "1"}
    req = launch_request(AWS_T4, ["sh", "-c", f"exit {code}"], zone="us-east-1a", env=env)
    began = time.monotonic()
    script = make_aws(moto, session).render_user_data(req)
    stderr = run_user_data(script, tmp_path, installed=True)
    took = time.monotonic() - began
    console = (tmp_path / "console").read_text()
    assert f"trainbot-runner exited with code {code}" in console, stderr
    assert ("keeping this instance up to 1 s" in console) is keeps, console
    if keeps:
        assert took >= 1.0, took
    assert (tmp_path / "shutdown").read_text() == "shutdown -h now\n", "it halts all the same"


@pytest.mark.parametrize(("code", "keeps"), [(3, True), (75, False)])
def test_the_gcp_startup_script_keeps_a_failed_instance_up_for_its_time_then_halts(
    gcp: GcpProvider, gce: FakeComputeApi, tmp_path: Path, code: int, keeps: bool
) -> None:
    env = {contract.KEEP_FAILED_S.name: "1"}
    command = ["sh", "-c", f"exit {code}"]
    info = gcp.launch(launch_request(GCP_A100, command, zone=GCP_ZONE, env=env))
    began = time.monotonic()
    done = run_startup_script(gcp, gce, info.instance_id, tmp_path)
    took = time.monotonic() - began
    out = done.stdout.decode(errors="replace")
    assert f"runner exited {code}; halting" in out, (out, done.stderr)
    assert ("keeping this instance up to 1 s" in out) is keeps, out
    if keeps:
        assert took >= 1.0, took
