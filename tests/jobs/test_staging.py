"""Staging a dataset into another region's bucket, in process: on moto's S3 across two
regions (CopyObject for small objects, UploadPartCopy for a large one), on the GCS
emulator with the JSON API's rewrite, the offer's size, cost and time, and the errors a
person gets. The copy killed with SIGKILL and resumed is ``test_staging_killed``."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from sqlalchemy import Engine
from sqlmodel import select

from bot.messages import digest_storage_line
from bot.replies import run_list
from bot.views.cards import run_card as card_blocks
from bot.views.digest import digest as digest_blocks
from bot.views.preflight import preflight_report
from jobs.background.deferred import finish, pending
from jobs.background.tasks import cleanup_job
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.actor import Actor
from jobs.domain.errors import PermissionDenied
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CheckLine, DigestMessage, PreflightMessage
from jobs.preflight import (
    DataLocalityCheck,
    PreflightContext,
    Status,
    resource_request,
    run_preflight,
)
from jobs.process.deps import Deps
from jobs.process.settings import Settings, load_settings
from jobs.providers.aws import AwsProvider
from jobs.providers.local import LocalProvider
from jobs.runs.cards import card
from jobs.runs.launch import runner_env
from jobs.spec import parse_spec
from jobs.spend import digest_figures
from jobs.staging import Staging, StagingError, StagingState
from jobs.staging.figures import staged_figures
from jobs.staging.prices import estimate
from jobs.staging.retention import expire_staged
from jobs.staging.runs import for_preflight, staged_from
from jobs.staging.service import stage_run, stage_status
from jobs.staging.work import copy_staging, offer, staged_copy, start
from runner.store import open_store
from tests.bot.test_slack_app import ADA, BOB, CHANNEL, TOKEN, slack_plane, slack_settings
from tests.fakes.gcs_emulator import create_bucket as create_gcs_bucket
from tests.fakes.gcs_emulator import gcs_emulator
from tests.fakes.slack_api import FakeSlack
from tests.jobs.local_plane import closing_each
from tests.jobs.test_alerts import RecordingNotifier

__all__ = ["gcs_emulator"]  # the session's emulator, a fixture

NOW = datetime(2026, 12, 6, 10, 0, tzinfo=timezone.utc)
MiB = 2**20


def s3_bucket(endpoint: str, region: str) -> str:
    """A new bucket in ``region`` on moto."""
    name = f"stage-{os.urandom(6).hex()}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name=region)
    extra: dict[str, Any] = {}
    if region != "us-east-1":
        extra["CreateBucketConfiguration"] = {"LocationConstraint": region}
    client.create_bucket(Bucket=name, **extra)
    return name


def staging_settings(tmp_path: Path, **env: str) -> Settings:
    return load_settings({"TRAINBOT_STATE_DIR": str(tmp_path / "state"), **env})


@pytest.fixture
def make_deps(db_engine: Engine, tmp_path: Path) -> Iterator[Any]:
    def build(settings: Settings) -> Deps:
        return Deps(
            settings=settings,
            engine=db_engine,
            provider=LocalProvider(tmp_path / "local"),
            notifier=RecordingNotifier(),
            replica="test",
        )

    with closing_each(build) as make:
        yield make


def test_s3_copy_across_regions(moto_server: str, make_deps: Any, tmp_path: Path) -> None:
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")
    source = s3_bucket(moto_server, "us-east-1")
    stage = s3_bucket(moto_server, "us-west-2")
    big = os.urandom(12 * MiB + 1234)  # three parts of 5 MiB, the last shorter
    files = {"data/a.bin": b"alpha" * 1000, "data/sub/b.bin": b"", "data/z.bin": big}
    for key, body in files.items():
        s3.put_object(Bucket=source, Key=key, Body=body)
    s3.put_object(Bucket=source, Key="data2/other.bin", Body=b"not under data/")
    settings = staging_settings(
        tmp_path,
        TRAINBOT_AWS_ENDPOINT_URL=moto_server,
        TRAINBOT_STAGING_BUCKETS=f"us-west-2=s3://{stage}/copies, europe-west4=gs://x",
        TRAINBOT_STAGING_PART_BYTES=str(5 * MiB),
    )
    deps = make_deps(settings)

    found = offer(settings, f"s3://{source}/data", "us-west-2")
    assert (found.objects, found.estimate.n_bytes) == (3, sum(map(len, files.values())))
    assert found.source_region == "us-east-1"
    assert found.target == f"s3://{stage}/copies/{source}/data/"
    assert found.estimate.usd_per_gb == 0.02
    assert "AWS S3 pricing page" in found.text() and "3 objects" in found.text()

    row, new = start(
        deps.engine, found, requested_by="U0ADA", channel="C0TRAIN", thread_ts="1.0", now=NOW
    )
    assert new
    again, new = start(deps.engine, found, requested_by="U0BOB", channel="C0TRAIN", now=NOW)
    assert (again.id, new) == (row.id, False)  # the same copy, not a second one
    assert [w.key for w in pending(deps.engine)] == [f"staging:{row.id}"]
    # Its deferred work gave up (a store that kept failing): asking again resumes it.
    finish(deps.engine, f"staging:{row.id}", now=NOW, error="gave up after 8 attempts")
    start(deps.engine, found, requested_by="U0BOB", channel="C0TRAIN", now=NOW)
    assert [w.key for w in pending(deps.engine)] == [f"staging:{row.id}:{NOW.timestamp():.0f}"]

    copy_staging(deps, staging_id=row.id)

    for key, body in files.items():
        copied = s3.get_object(Bucket=stage, Key=f"copies/{source}/{key}")["Body"].read()
        assert hashlib.sha256(copied).digest() == hashlib.sha256(body).digest(), key
    listed = s3.list_objects_v2(Bucket=stage, Prefix="copies/")["Contents"]
    assert len(listed) == 3  # data2/ is another dataset
    with session_scope(deps.engine) as session:
        done = session.get(Staging, row.id)
        assert done is not None and done.state is StagingState.DONE
        assert (done.objects_done, done.bytes_done) == (3, found.estimate.n_bytes)
        assert done.part_copies == 2 + 3  # two CopyObject, three UploadPartCopy
        assert done.upload_id is None and done.parts == []
        assert staged_copy(session, found.source, "us-west-2") is not None
        assert staged_copy(session, found.source, "us-east-2") is None
    notifier: RecordingNotifier = deps.notifier
    assert len(notifier.posts) == 1  # one message, edited in place
    ref, first = notifier.posts[0]
    assert first.thread_ts == "1.0"  # type: ignore[attr-defined]
    assert all(r == ref for r, _ in notifier.updates)
    assert "is copied to" in notifier.updates[-1][1].text  # type: ignore[attr-defined]


def test_offer_errors(moto_server: str, tmp_path: Path) -> None:
    source = s3_bucket(moto_server, "us-east-1")
    settings = staging_settings(
        tmp_path,
        TRAINBOT_AWS_ENDPOINT_URL=moto_server,
        TRAINBOT_STAGING_BUCKETS="us-west-2=s3://stage-usw2,europe-west4=gs://stage-euw4",
    )
    with pytest.raises(StagingError, match="no staging bucket is set for eu-west-1"):
        offer(settings, f"s3://{source}/data", "eu-west-1")
    with pytest.raises(StagingError, match="within one cloud"):
        offer(settings, f"s3://{source}/data", "europe-west4")
    near = s3_bucket(moto_server, "us-west-2")
    boto3.client("s3", endpoint_url=moto_server).put_object(Bucket=near, Key="d/x", Body=b"1")
    with pytest.raises(StagingError, match="is in us-west-2 already"):
        offer(settings, f"s3://{near}/d", "us-west-2")
    with pytest.raises(StagingError, match="holds no objects"):
        offer(settings, f"s3://{source}/empty", "us-west-2")
    with pytest.raises(StagingError, match="not a bucket URI"):
        offer(settings, "/local/data", "us-west-2")
    with pytest.raises(StagingError, match="does not exist"):
        offer(settings, "s3://no-such-bucket-for-staging/data", "us-west-2")


def test_staging_buckets_setting_is_checked(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="REGION=BUCKET_URI"):
        staging_settings(tmp_path, TRAINBOT_STAGING_BUCKETS="us-west-2:s3://b")


def test_estimate_prices_by_continent() -> None:
    near = estimate(
        "gs://b/d", n_bytes=10 * 2**30, source_region="us-central1", target_region="us-east4"
    )
    far = estimate(
        "gs://b/d", n_bytes=10 * 2**30, source_region="us-central1", target_region="europe-west4"
    )
    assert (near.usd, far.usd) == pytest.approx((0.2, 0.8))
    assert "Google Cloud Storage pricing page" in far.source and "another continent" in far.source
    asia = estimate(
        "s3://b/d", n_bytes=2**30, source_region="ap-northeast-1", target_region="us-west-2"
    )
    assert asia.usd == pytest.approx(0.09)
    assert (
        estimate(
            "s3://b/d", n_bytes=2**30, source_region="us-east-1", target_region="us-east-1"
        ).usd
        == 0.0
    )
    assert near.seconds == pytest.approx(10 * 2**30 / (100 * MiB))


def test_gcs_rewrite(
    gcs_emulator: str, monkeypatch: pytest.MonkeyPatch, make_deps: Any, tmp_path: Path
) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(
        project="trainbot-test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": gcs_emulator},
    )
    source = create_gcs_bucket(gcs_emulator)
    stage = create_gcs_bucket(gcs_emulator)
    files = {"ds/x.txt": b"x" * 3000, "ds/y/z.bin": os.urandom(300_000)}
    for key, body in files.items():
        client.bucket(source).blob(key).upload_from_string(body)
    settings = staging_settings(tmp_path, TRAINBOT_STAGING_BUCKETS=f"europe-west4=gs://{stage}")
    deps = make_deps(settings)
    found = offer(settings, f"gs://{source}/ds/", "europe-west4")
    assert (found.objects, found.estimate.n_bytes) == (2, 303_000)
    row, _ = start(deps.engine, found, requested_by="U0ADA", channel="C0TRAIN", now=NOW)

    copy_staging(deps, staging_id=row.id)

    for key, body in files.items():
        assert client.bucket(stage).blob(f"{source}/{key}").download_as_bytes() == body
    with session_scope(deps.engine) as session:
        done = session.get(Staging, row.id)
        assert done is not None and done.state is StagingState.DONE
        assert done.bytes_done == 303_000 and done.part_copies >= 2


def test_a_run_in_another_region_is_offered_a_copy_then_reads_it(
    moto_server: str,
    make_deps: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Preflight's data check offers the copy (size, cost, time, the command); once it
    is done, the run's preflight rewrites its data_uri to the copy, the check passes in
    the run's region, and the runner's store reads the copy."""
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="eu-west-1")
    source = s3_bucket(moto_server, "eu-west-1")
    stage = s3_bucket(moto_server, "us-west-2")
    checkpoints = s3_bucket(moto_server, "us-west-2")
    s3.put_object(Bucket=source, Key="data/shard-0.bin", Body=b"tokens" * 500_000)
    settings = staging_settings(
        tmp_path,
        TRAINBOT_AWS_ENDPOINT_URL=moto_server,
        TRAINBOT_STAGING_BUCKETS=f"us-west-2=s3://{stage}",
    )
    deps = make_deps(settings)
    aws = AwsProvider(
        region="us-west-2",
        endpoint_url=moto_server,
        image_id="ami-12345678",
        instance_profile="trainbot-runner",
        session=boto3.session.Session(),
    )
    spec = parse_spec(
        {"command": "true", "data_uri": f"s3://{source}/data", "resources": {"cloud": "aws"}},
        name="t",
    )
    with session_scope(deps.engine) as session:
        session.add(
            Run(id="r-stage", spec_name="t", spec=spec.model_dump(mode="json"), requester="U0ADA")
        )
    ctx = PreflightContext(
        spec=spec,
        run_id="r-stage",
        provider=aws,
        request=resource_request(spec, aws),
        checkpoint_uri=f"s3://{checkpoints}/runs",
        mtbp_s=6 * 3600.0,
        env={},
        workdir=tmp_path / "work",
    )

    report = run_preflight(for_preflight(deps, ctx), [DataLocalityCheck()])
    (offered,) = report.results
    assert offered.status is Status.FAIL
    # The report's message carries the offer, for its "Stage the data" button.
    shown = report.to_message(channel="C0TRAIN", thread_ts=None, run_id="r-stage")
    assert shown.stage is not None and shown.stage == offered.data["stage"]
    assert f"the dataset s3://{source}/data is in eu-west-1" in offered.detail
    assert f"stage it: `/train stage s3://{source}/data us-west-2` copies 1 objects" in (
        offered.remedy
    )
    assert "3.0 MB" in offered.remedy and "about $0.0001 of transfer" in offered.remedy
    assert "$0.02/GB" in offered.remedy and "AWS S3 pricing page" in offered.remedy

    row, _ = start(
        deps.engine,
        offer(settings, f"s3://{source}/data", "us-west-2"),
        requested_by="U0ADA",
        channel="C0TRAIN",
        now=NOW,
    )
    copy_staging(deps, staging_id=row.id)
    staged = for_preflight(deps, ctx)

    assert staged.spec.data_uri == row.target == f"s3://{stage}/{source}/data/"
    with session_scope(deps.engine) as session:
        stored = session.get(Run, "r-stage")
        assert stored is not None and stored.spec["data_uri"] == row.target
        assert staged_from(session, stored.spec["data_uri"]).source == f"s3://{source}/data/"
        # The card shows the copy beside the dataset it copies.
        listed = run_list([card(session, stored)], "all")
        assert f" · data {row.target} (staged copy of s3://{source}/data/)" in listed
        (root,) = card_blocks(card(session, stored))
        assert (
            f"*Data*\n{row.target} (staged copy of s3://{source}/data/)"
            in root["fields"][-1]["text"]
        )
    said = [m.text for _, m in deps.notifier.posts if getattr(m, "run_id", None) == "r-stage"]
    assert any(f"reads its dataset from the staged copy {row.target}" in t for t in said)
    passed = DataLocalityCheck().run(staged, prior={})
    assert passed.status is Status.PASS, passed.detail
    assert f"dataset {row.target} is in us-west-2" in passed.detail
    # The training command is told where its data is: the copy.
    with session_scope(deps.engine) as session:
        stored = session.get(Run, "r-stage")
        assert stored is not None
        attempt = Attempt(run_id=stored.id, number=1, provider=deps.provider.name)
        assert runner_env(deps, stored, attempt, staged.spec)["TRAINBOT_DATA_URI"] == row.target
    # The runner reads the copy with the store the training script's sample check uses.
    monkeypatch.setenv("TRAINBOT_S3_ENDPOINT_URL", moto_server)
    store = open_store(staged.spec.data_uri, credentials="default")
    (found,) = store.list()
    with store.open_read(found.key) as stream:
        assert stream.read() == b"tokens" * 500_000


def test_retention_and_the_digest(moto_server: str, make_deps: Any, tmp_path: Path) -> None:
    """A copy is kept while a run reads it and TRAINBOT_STAGING_KEEP_DAYS after the run
    ended, then the cleanup deletes its objects; the digest's storage counts it meanwhile."""
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")
    source = s3_bucket(moto_server, "us-east-1")
    stage = s3_bucket(moto_server, "us-west-2")
    for i in range(3):
        s3.put_object(Bucket=source, Key=f"data/{i}.bin", Body=b"x" * 100_000)
    settings = staging_settings(
        tmp_path,
        TRAINBOT_AWS_ENDPOINT_URL=moto_server,
        TRAINBOT_STAGING_BUCKETS=f"us-west-2=s3://{stage}",
        TRAINBOT_STAGING_KEEP_DAYS="7",
    )
    deps = make_deps(settings)
    deps.clock = lambda: NOW
    found = offer(settings, f"s3://{source}/data", "us-west-2")
    row, _ = start(deps.engine, found, requested_by="U0ADA", channel="C0TRAIN", now=NOW)
    copy_staging(deps, staging_id=row.id)
    with session_scope(deps.engine) as session:
        session.add(
            Run(
                id="r-reads",
                spec_name="t",
                spec={"data_uri": row.target},
                requester="U0ADA",
                channel="C0TRAIN",
                state=RunState.RUNNING,
                created_at=NOW,
            )
        )
    day = timedelta(days=1)

    def copies() -> int:
        listed = s3.list_objects_v2(Bucket=stage, Prefix=f"{source}/data/")
        return len(listed.get("Contents", []))

    assert expire_staged(deps, now=NOW + 30 * day) == []  # its run is not over
    with session_scope(deps.engine) as session:
        run = session.get(Run, "r-reads")
        assert run is not None
        run.state, run.ended_at = RunState.SUCCEEDED, NOW + day
        session.add(run)
        kept = staged_figures(session, channel="C0TRAIN", since=NOW, until=NOW + day)
        assert (kept["bytes_kept"], kept["copies"]) == (300_000, 1)
        assert kept["usd_per_month"] == pytest.approx(300_000 / 2**30 * 0.023, abs=1e-4)
        assert staged_figures(session, channel="C0OTHER", since=NOW, until=NOW + day)["copies"] == 0
        digest = digest_figures(session, channel="C0TRAIN", now=NOW + day, tz=timezone.utc)
        assert digest["storage"]["staged"]["bytes_kept"] == 300_000
        line = digest_storage_line(digest["storage"], "yesterday")
        assert "· staged data 300.0 KB in 1 copy, " in line and line.endswith(" a month")
        (head, *_) = digest_blocks(DigestMessage(channel="C0TRAIN", figures=digest))
        assert any(
            f["text"].startswith("*Staged data*\n300.0 KB in 1 copy, ") for f in head["fields"]
        )
    assert expire_staged(deps, now=NOW + 7 * day) == []  # 6 days after the run ended
    assert copies() == 3
    deps.clock = lambda: NOW + 8 * day
    cleanup_job(deps)  # the scheduled cleanup applies the rule
    assert copies() == 0
    with session_scope(deps.engine) as session:
        gone = session.get(Staging, row.id)
        assert gone is not None and gone.state is StagingState.DELETED
        assert staged_copy(session, found.source, "us-west-2") is None  # runs no longer use it
        later = staged_figures(
            session, channel="C0TRAIN", since=NOW + 9 * day, until=NOW + 10 * day
        )
        assert later["copies"] == 0 and later["bytes_kept"] == 0


def test_stage_a_runs_data_into_its_region_with_progress_in_its_thread(
    moto_server: str, make_deps: Any, tmp_path: Path
) -> None:
    """/train stage <run>: the dataset of a run whose preflight found it in another
    region, into the region the check judged, the progress in the run's thread; only its
    requester or an admin may."""
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="eu-west-1")
    source = s3_bucket(moto_server, "eu-west-1")
    stage = s3_bucket(moto_server, "us-west-2")
    s3.put_object(Bucket=source, Key="data/0.bin", Body=b"y" * 1000)
    settings = staging_settings(
        tmp_path,
        TRAINBOT_AWS_ENDPOINT_URL=moto_server,
        TRAINBOT_STAGING_BUCKETS=f"us-west-2=s3://{stage}",
    )
    deps = make_deps(settings)
    found_there = {"name": "data", "status": "fail", "data": {"region": "us-west-2"}}
    with session_scope(deps.engine) as session:
        session.add(
            Run(
                id="r-far",
                spec_name="gpt",
                spec={"data_uri": f"s3://{source}/data"},
                requester="U0ADA",
                channel="C0TRAIN",
                thread_ts="1700.0001",
                state=RunState.PREFLIGHT_FAILED,
                preflight={"results": [found_there]},
            )
        )
    with pytest.raises(PermissionDenied, match="only they or an admin"):
        stage_run(deps, "r-far", Actor(user="U0BOB", channel="C0TRAIN"))
    with pytest.raises(StagingError, match="no run r-none"):
        stage_run(deps, "r-none", Actor(user="U0ADA", channel="C0TRAIN"))

    said = stage_run(deps, "r-far", Actor(user="U0ADA", channel="C0TRAIN"))

    assert "for r-far: copy" in said and "/train launch gpt reads the copy" in said
    with session_scope(deps.engine) as session:
        (row,) = session.exec(select(Staging)).all()
        assert (row.run_id, row.region, row.thread_ts) == ("r-far", "us-west-2", "1700.0001")
    copy_staging(deps, staging_id=row.id)
    notifier: RecordingNotifier = deps.notifier
    ((ref, first),) = notifier.posts
    assert first.thread_ts == "1700.0001"  # type: ignore[attr-defined]
    assert notifier.updates and all(r == ref for r, _ in notifier.updates)
    listed = f"{row.id} s3://{source}/data/ → s3://{stage}/{source}/data/ (us-west-2): done"
    assert listed in stage_status(deps)


def test_the_stage_button_on_a_preflight_report(moto_server: str, tmp_path: Path) -> None:
    """A report whose data check offers a copy has a "Stage the data" button; pressed
    over signed HTTP by the run's requester it starts the copy for the run, by anyone
    else it is refused."""
    report = PreflightMessage(
        channel=CHANNEL,
        thread_ts="1.0",
        run_id="r-far",
        checks=(CheckLine("data", "fail", "the dataset … is in eu-west-1", "stage it: …"),),
        ok=False,
        needs_confirmation=False,
        stage="`/train stage s3://d/data us-west-2` copies 1 objects …",
    )
    (buttons,) = [b for b in preflight_report(report) if b["type"] == "actions"]
    assert [(e["action_id"], e["value"]) for e in buttons["elements"]] == [("run_stage", "r-far")]
    assert not [b for b in preflight_report(replace(report, stage=None)) if b["type"] == "actions"]

    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="eu-west-1")
    source = s3_bucket(moto_server, "eu-west-1")
    stage = s3_bucket(moto_server, "us-west-2")
    s3.put_object(Bucket=source, Key="data/0.bin", Body=b"z" * 1000)
    settings = slack_settings(tmp_path / "state").model_copy(
        update={"aws_endpoint_url": moto_server, "staging_buckets": [f"us-west-2=s3://{stage}"]}
    )
    fake = FakeSlack(tokens=[TOKEN], post_interval_s=0.02, burst=5).start()
    fake.add_channel(CHANNEL, "ml-training", members=[ADA, BOB])
    with slack_plane(fake, settings) as slack:
        with session_scope(slack.cp.deps.engine) as session:
            session.add(
                Run(
                    id="r-far",
                    spec_name="gpt",
                    spec={"data_uri": f"s3://{source}/data"},
                    requester=ADA,
                    channel=CHANNEL,
                    thread_ts="1700.0001",
                    state=RunState.PREFLIGHT_FAILED,
                    preflight={"results": [{"name": "data", "data": {"region": "us-west-2"}}]},
                )
            )
        _, path = slack.action("run_stage", "r-far", user=BOB)
        assert "only they or an admin" in slack.hooks.wait(path)["text"]
        _, path = slack.action("run_stage", "r-far", user=ADA)
        assert "Staging st-" in slack.hooks.wait(path)["text"]
        with session_scope(slack.cp.deps.engine) as session:
            (row,) = session.exec(select(Staging)).all()
            assert (row.run_id, row.requested_by, row.thread_ts) == ("r-far", ADA, "1700.0001")
