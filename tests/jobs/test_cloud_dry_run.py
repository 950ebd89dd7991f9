"""Issue 14.1: the preflight dry run on a cheap cloud instance, end to end.

A real control plane (database, service layer, HTTP server with the report route and the
credential broker) launches the dry run's instance on AWS through moto's server, or on
GCP through the fake Compute API. The instance's side is played by a local process that
runs what the instance would: the boot script the provider really sent (the EC2 user
data read back from moto; the GCP startup script with its metadata server), under bash,
with stand-ins for the root-only commands and for the installed runner, which is the real
``trainbot-runner`` (``python -m runner.cli``) in this checkout. Its environment and
token are the ones the launch carried; it checkpoints to the run's real store (moto's S3
with brokered credentials; the GCS emulator) and reports over HTTP.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from moto.sts.models import sts_backends
from sqlalchemy import Engine
from sqlmodel import Session

from jobs.database.db import make_engine, session_scope
from jobs.database.models import DryRunInstance, Run, hash_token
from jobs.domain.lifecycle import RunState
from jobs.ingest import IngestService
from jobs.outbound.notify import CallbackJournal, CheckLine, TextMessage
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.providers.aws import AwsProvider
from jobs.providers.base import TAG_DRY_RUN, TAG_RUN_ID, Provider, ResourceRequest
from jobs.providers.gcp import GcpProvider
from jobs.runs import reconcile
from jobs.usecases import service
from jobs.web.server import CREDENTIALS_PATH, ControlPlaneApp, serve
from runner.store.gcs import GCSStore
from runner.wire import DRY_RUN_ROUTE, encode_dry_run_post
from tests.bot.test_shell_cleanup import start_shell
from tests.fakes import aws as fake
from tests.fakes.gce_api import FakeComputeApi
from tests.fakes.gcs_emulator import create_bucket, gcs_emulator
from tests.jobs import test_aws_control_plane as on_aws
from tests.jobs.boot import aws_boot_env, gcp_boot_env, root_commands, stand_in
from tests.jobs.on_gcp import gcp_on
from tests.paths import ROOT

__all__ = ["gcs_emulator"]  # the session's emulator, a fixture

ADA = service.Actor(user="ada", channel="#ml")
TINY = "python -m runner.examples.tiny --dim 32 --batch 8 --steps 100"
NO_SESSION = "python -c 'print(42)'"
ROLE = f"arn:aws:iam::{fake.MOTO_ACCOUNT}:role/trainbot-runner-storage"
GCP_ZONES = ("us-central1-a", "us-central1-c")


# -- the played instance ---------------------------------------------------------------------


def install_runner(bin_dir: Path) -> None:
    """What ``pip install trainbot`` leaves in the instance's venv: the runner and python
    (this checkout's, with torch)."""
    path = f"PYTHONPATH={ROOT}"
    stand_in(bin_dir / "python", f'#!/bin/sh\nexec env {path} {sys.executable} "$@"\n')
    stand_in(
        bin_dir / "trainbot-runner",
        f'#!/bin/sh\nexec env {path} {sys.executable} -m runner.cli "$@"\n',
    )


def play_aws(url: str, instance_id: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    """Run the instance's user data as cloud-init would, as a process of its own group."""
    answer = fake.client("ec2", url).describe_instance_attribute(
        InstanceId=instance_id, Attribute="userData"
    )
    script = base64.b64decode(answer["UserData"]["Value"]).decode()
    root = tmp_path / instance_id
    bin_dir, home = root_commands(root, apt_get=False), root / "opt"
    install_runner(home / "bin")
    env = aws_boot_env(root, home, path=f"{bin_dir}:/usr/bin:/bin")
    log = open(root / "boot.log", "wb")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        ["bash", "-c", script], env=env, stdout=log, stderr=log, start_new_session=True
    )


def dry_run_instances(url: str, run_id: str | None = None) -> list[dict[str, Any]]:
    found = [i for i in on_aws.all_instances(url) if on_aws.tags(i).get(TAG_DRY_RUN) == "true"]
    return [i for i in found if run_id is None or on_aws.tags(i)[TAG_RUN_ID] == run_id]


def state_of(url: str, instance_id: str) -> str:
    [inst] = [i for i in on_aws.all_instances(url) if i["InstanceId"] == instance_id]
    return str(inst["State"]["Name"])


def wait_for(pred: Any, *, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = pred()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# -- AWS: the control plane on moto -----------------------------------------------------------


def aws_spec(bucket: str, url: str, *, command: str, timeout: str = "5m") -> str:
    """Four T4s a run; the dry run gets the smallest T4 type. The instance reaches moto's
    S3 through the spec's env, as it would reach S3; the keys in it stand for the instance
    profile (the sample is read with the instance's own credentials, the checkpoints are
    written with the broker's)."""
    return (
        f"command: {command}\n"
        "resources:\n  cloud: aws\n  accelerator: T4:4\n"
        f"checkpoint:\n  uri: s3://{bucket}/ckpt\n"
        "budget:\n  usd: 50\n"
        f"env:\n  AWS_ENDPOINT_URL_S3: {url}\n  AWS_DEFAULT_REGION: {on_aws.REGION}\n"
        "  AWS_ACCESS_KEY_ID: testing\n  AWS_SECRET_ACCESS_KEY: testing\n"
        f"dry_run:\n  steps: 3\n  timeout: {timeout}\n  sample: s3://{bucket}/sample/\n"
    )


def aws_env(tmp_path: Path, moto: dict[str, Any], spec_yaml: str) -> dict[str, str]:
    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    (specs / "gpu.yaml").write_text(spec_yaml)
    return {
        "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
        "TRAINBOT_SPECS_DIR": str(specs),
        "TRAINBOT_PROVIDER": "aws",
        "TRAINBOT_AWS_REGION": on_aws.REGION,
        "TRAINBOT_AWS_ENDPOINT_URL": moto["url"],
        "TRAINBOT_AWS_IMAGE_ID": moto["image"],
        "TRAINBOT_AWS_INSTANCE_PROFILE": "trainbot-runner",
        "TRAINBOT_AWS_RUNNER_STORAGE_ROLE_ARN": ROLE,
        "TRAINBOT_CHECKPOINT_URI": f"s3://{moto['bucket']}/default",
        "TRAINBOT_CHECKPOINT_LOCATIONS": f"s3://{moto['bucket']}",
        "TRAINBOT_INGEST_PORT": "0",
    }


@pytest.fixture(scope="module")
def moto(moto_server: str) -> dict[str, Any]:
    bucket = fake.unique_bucket(moto_server, region=on_aws.REGION, prefix="ckpt")
    fake.client("s3", moto_server).put_object(Bucket=bucket, Key="sample/shard-0", Body=b"12+7=19.")
    # Versioned, so a checkpoint deleted after the dry run still shows it was written.
    fake.client("s3", moto_server).put_bucket_versioning(
        Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    return {
        "url": moto_server,
        "image": fake.image_id(moto_server),
        "profile": fake.instance_profile(moto_server),
        "bucket": bucket,
    }


@pytest.fixture
def store_on_moto(monkeypatch: pytest.MonkeyPatch, moto: dict[str, Any]) -> None:
    """The control plane's own store calls (deleting the dry run's checkpoints) reach moto."""
    monkeypatch.setenv("TRAINBOT_S3_ENDPOINT_URL", moto["url"])


@contextmanager
def aws_plane(
    tmp_path: Path, moto: dict[str, Any], spec_yaml: str, *, endpoint_url: str | None = None
) -> Iterator[tuple[ControlPlane, on_aws.Recorder, list[dict[str, Any]]]]:
    """The control plane on moto; ``endpoint_url``: a gate in front of it (Ec2Gate)."""
    aws = on_aws.make_aws(moto, boto3.session.Session(), endpoint_url=endpoint_url)
    quotas = Stubber(aws.client("service-quotas"))
    for code in (on_aws.G_SPOT, on_aws.G_ON_DEMAND):
        quotas.add_response(
            "get_service_quota", fake.quota(code, 64), {"ServiceCode": "ec2", "QuotaCode": code}
        )
    quotas.activate()
    records: list[dict[str, Any]] = []
    notes = on_aws.Recorder()
    settings = load_settings(aws_env(tmp_path, moto, spec_yaml))
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    try:
        with ControlPlane(
            settings, notifier=notes, journal=journal, provider=aws, scheduler=False
        ) as cp:
            yield cp, notes, records
    finally:
        quotas.deactivate()


def preflight_only(cp: ControlPlane) -> str:
    return service.submit(cp.deps, spec_name="gpu", overrides=[], actor=ADA, launch=False).id


def finished(cp: ControlPlane, run_id: str) -> bool:
    return on_aws.run_row(cp, run_id).state != RunState.PREFLIGHT


def dry_check(notes: on_aws.Recorder, run_id: str) -> CheckLine:
    return next(c for c in notes.preflight(run_id).checks if c.name == "dry_run")


def dry_rows(cp: ControlPlane, run_id: str) -> list[DryRunInstance]:
    with session_scope(cp.deps.engine) as session:
        rows = session.query(DryRunInstance).filter_by(run_id=run_id).all()
        for row in rows:
            session.expunge(row)
        return list(rows)


def thread_texts(notes: on_aws.Recorder, run_id: str) -> list[str]:
    return [m.text for m in notes.posted if isinstance(m, TextMessage) and m.run_id == run_id]


@pytest.mark.slow
def test_aws_dry_run_on_the_cheapest_t4_commits_restores_reports_and_is_terminated(
    tmp_path: Path, moto: dict[str, Any], store_on_moto: None
) -> None:
    url, bucket = moto["url"], moto["bucket"]
    gate = on_aws.Ec2Gate(url)  # records what RunInstances was asked for
    spec = aws_spec(bucket, url, command=TINY)
    with aws_plane(tmp_path, moto, spec, endpoint_url=gate.url) as (cp, notes, records):
        run_id = preflight_only(cp)
        [inst] = wait_for(lambda: dry_run_instances(url, run_id), what="the dry run's instance")
        instance_id = inst["InstanceId"]
        # The cheapest type of the run's accelerator, launched as attempts are: the real
        # boot script, the instance profile and the image, tagged as a dry run.
        assert inst["InstanceType"] == "g4dn.xlarge"
        [row] = dry_rows(cp, run_id)
        [asked] = [f for f in gate.launches() if f.get("ClientToken") == row.id]
        assert asked["IamInstanceProfile.Name"] == "trainbot-runner"
        assert asked["ImageId"] == moto["image"]
        assert asked["InstanceType"] == "g4dn.xlarge"
        env = on_aws.user_data_env(url, instance_id)
        assert env["TRAINBOT_DRY_RUN_ID"] == row.id == on_aws.tags(inst)["trainbot-attempt-id"]
        assert env["TRAINBOT_STORE_CREDENTIALS"] == "broker"
        assert env["TRAINBOT_INGEST_URL"] == cp.deps.ingest_url
        assert env["TRAINBOT_TOKEN"] == cp.deps.runner_token(row.id)
        assert "trainbot-runner dry-run --steps 3" in _user_data(url, instance_id)

        played = play_aws(url, instance_id, tmp_path)
        try:
            wait_for(lambda: finished(cp, run_id), what="the preflight report", timeout=180)
        finally:
            played.wait(timeout=60)
        dry = dry_check(notes, run_id)
        boot_log = (tmp_path / instance_id / "boot.log").read_text(errors="replace")
        assert dry.status == "pass", (dry.detail, boot_log[-3000:])
        assert "restored bit-identical" in dry.detail and "ran on g4dn.xlarge" in dry.detail
        assert f"the data sample s3://{bucket}/sample/ is readable" in dry.detail
        assert "(1 objects, 8 B)" in dry.detail
        assert state_of(url, instance_id) in ("shutting-down", "terminated")
        [row] = dry_rows(cp, run_id)
        assert row.token_hash is None and row.ended_at is not None
        assert row.report is not None and row.report["ok"] is True
        assert row.report["saved_sha256"] == row.report["restored_sha256"]
        # Its cost: the launch-time price of the type × the time from launch to terminate.
        assert row.price_per_hour is not None and row.launched_at is not None
        seconds = (row.ended_at - row.launched_at).total_seconds()
        assert row.cost_usd == pytest.approx(row.price_per_hour * seconds / 3600, abs=1e-4)
        texts = thread_texts(notes, run_id)
        assert any(t.startswith(f"Dry run: launched g4dn.xlarge {instance_id}") for t in texts)
        assert any("the runner started on" in t for t in texts)
        assert any("checkpoint is committed" in t for t in texts)
        assert next(r for r in records if r["type"] == "dry_run_ended")["cost_usd"] == row.cost_usd
    # The store was the run's real one, through credentials brokered for its dry run only.
    issued = [
        r
        for r in sts_backends[fake.MOTO_ACCOUNT]["aws"].assumed_roles
        if r.session_name == f"trainbot-{run_id}-{row.id}"
    ]
    assert issued and all(f"ckpt/{run_id}-dry-run/" in r.policy for r in issued)
    versions = fake.client("s3", url).list_object_versions(
        Bucket=bucket, Prefix=f"ckpt/{run_id}-dry-run/"
    )
    manifests = [v for v in versions.get("Versions", []) if v["Key"].endswith("manifest.json")]
    assert manifests, "the dry run committed a checkpoint to the run's bucket"
    assert versions.get("DeleteMarkers"), "and preflight deleted it once it passed"
    gate.close()


def _user_data(url: str, instance_id: str) -> str:
    answer = fake.client("ec2", url).describe_instance_attribute(
        InstanceId=instance_id, Attribute="userData"
    )
    return base64.b64decode(answer["UserData"]["Value"]).decode()


def test_aws_dry_run_that_fails_is_reported_and_its_instance_terminated(
    tmp_path: Path, moto: dict[str, Any], store_on_moto: None
) -> None:
    url = moto["url"]
    spec = aws_spec(moto["bucket"], url, command=NO_SESSION)
    with aws_plane(tmp_path, moto, spec) as (cp, notes, _):
        run_id = preflight_only(cp)
        [inst] = wait_for(lambda: dry_run_instances(url, run_id), what="the dry run's instance")
        played = play_aws(url, inst["InstanceId"], tmp_path)
        try:
            wait_for(lambda: finished(cp, run_id), what="the preflight report", timeout=120)
        finally:
            played.wait(timeout=60)
        assert on_aws.run_row(cp, run_id).state == RunState.PREFLIGHT_FAILED
        dry = dry_check(notes, run_id)
        assert dry.status == "fail"
        assert "without reporting anything" in dry.detail and "ran on g4dn.xlarge" in dry.detail
        assert state_of(url, inst["InstanceId"]) in ("shutting-down", "terminated")
        [row] = dry_rows(cp, run_id)
        assert row.token_hash is None and row.report is not None and row.report["ok"] is False


def test_aws_dry_run_without_a_report_times_out_and_reconcile_spares_it_until_then(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    url = moto["url"]
    spec = aws_spec(moto["bucket"], url, command=TINY, timeout="4s")
    with aws_plane(tmp_path, moto, spec) as (cp, notes, _):
        run_id = preflight_only(cp)
        [inst] = wait_for(lambda: dry_run_instances(url, run_id), what="the dry run's instance")
        # Tagged with an id no attempt has, yet no orphan while its dry run is under way.
        reconcile(cp.deps)
        assert state_of(url, inst["InstanceId"]) in ("pending", "running")
        wait_for(lambda: finished(cp, run_id), what="the timeout", timeout=60)
        dry = dry_check(notes, run_id)
        assert dry.status == "fail" and "sent no report within 4 s" in dry.detail, dry.detail
        assert "TRAINBOT_PUBLIC_URL" in dry.remedy
        assert state_of(url, inst["InstanceId"]) in ("shutting-down", "terminated")


@pytest.mark.slow
def test_aws_kill_9_during_the_dry_run_then_restart_terminates_its_instance(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    url = moto["url"]
    env = aws_env(tmp_path, moto, aws_spec(moto["bucket"], url, command=TINY))
    env.update({k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ})
    env.update(
        PYTHONPATH=str(ROOT),
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_EC2_METADATA_DISABLED="true",
    )
    before = {i["InstanceId"] for i in dry_run_instances(url)}
    proc = start_shell(env, quiet=True)
    assert proc.stdin is not None
    proc.stdin.write("/train preflight gpu\n")
    proc.stdin.flush()

    def launched() -> list[dict[str, Any]]:
        assert proc.poll() is None, "the control plane exited"
        return [i for i in dry_run_instances(url) if i["InstanceId"] not in before]

    [inst] = wait_for(launched, what="the dry run's instance", timeout=120)
    first = inst["InstanceId"]
    run_id = on_aws.tags(inst)[TAG_RUN_ID]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert state_of(url, first) in ("pending", "running"), "nobody terminated it yet"

    records: list[dict[str, Any]] = []
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    aws = on_aws.make_aws(moto, boto3.session.Session())
    settings = load_settings({k: v for k, v in env.items() if k.startswith("TRAINBOT_")})
    with ControlPlane(
        settings, notifier=on_aws.Recorder(), journal=journal, provider=aws, scheduler=False
    ):
        ended = [r for r in records if r["type"] == "dry_run_ended" and r["run"] == run_id]
        assert ended and ended[0]["instance"] == first
        assert state_of(url, first) in ("shutting-down", "terminated")
        # The checks run again, with a dry run of their own...
        [again] = wait_for(
            lambda: [i for i in dry_run_instances(url, run_id) if i["InstanceId"] != first],
            what="the rerun's dry-run instance",
        )
    # ...whose instance goes when this control plane stops in the middle of it.
    assert state_of(url, again["InstanceId"]) in ("shutting-down", "terminated")
    engine = make_engine(settings.database_url)
    try:
        with session_scope(engine) as session:
            run = session.get(Run, run_id)
            assert run is not None and run.state == RunState.PREFLIGHT_FAILED
            assert "the control plane shut down during the dry run" in json.dumps(run.preflight)
    finally:
        engine.dispose()


# -- GCP: the control plane on the fake Compute API, the store on the GCS emulator -------------


def gcp_provider(gce: FakeComputeApi) -> GcpProvider:
    return gcp_on(gce, zones=list(GCP_ZONES))


def play_gcp(gce: FakeComputeApi, inst: dict[str, Any], tmp_path: Path) -> None:
    """Run the startup script against the instance's metadata server, to its end."""
    zone, name = inst["zone"].rsplit("/", 1)[-1], inst["name"]
    root = tmp_path / name
    install_runner(root / "venv" / "bin")
    with gce.metadata_server(zone, name) as md_url:
        done = subprocess.run(
            ["bash", str(ROOT / "deploy" / "gcp" / "startup-script.sh")],
            env=gcp_boot_env(root, md_url),
            capture_output=True,
            timeout=180,
        )
    (root / "boot.log").write_bytes(done.stdout + done.stderr)


def gcp_dry_runs(gce: FakeComputeApi, run_id: str) -> list[dict[str, Any]]:
    return [
        i
        for i in gce.instances()
        if i["labels"].get(TAG_DRY_RUN) == "true" and i["labels"][TAG_RUN_ID] == run_id
    ]


def gcp_env(tmp_path: Path, gce: FakeComputeApi, host: str, command: str) -> dict[str, str]:
    """A bucket with a data sample on the emulator, the ``gpu`` spec, and the settings of a
    control plane on GCP that uses them, as ``TRAINBOT_*`` variables."""
    bucket = create_bucket(host, prefix="ckpt")
    gce.buckets[bucket] = "US-CENTRAL1"
    GCSStore(bucket, "sample", emulator_host=host).put_bytes("shard-0", b"12+7=19.")
    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    (specs / "gpu.yaml").write_text(
        f"command: {command}\n"
        "resources:\n  cloud: gcp\n  accelerator: A100:8\n"
        f"checkpoint:\n  uri: gs://{bucket}/ckpt\n"
        "budget:\n  usd: 500\n"
        f"env:\n  STORAGE_EMULATOR_HOST: {host}\n"
        f"dry_run:\n  steps: 3\n  timeout: 5m\n  sample: gs://{bucket}/sample\n"
    )
    return {
        "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
        "TRAINBOT_SPECS_DIR": str(specs),
        "TRAINBOT_PROVIDER": "gcp",
        "TRAINBOT_GCP_PROJECT": gce.project,
        "TRAINBOT_CHECKPOINT_URI": f"gs://{bucket}/default",
        "TRAINBOT_CHECKPOINT_LOCATIONS": f"gs://{bucket}",
        "TRAINBOT_INGEST_PORT": "0",
    }


@contextmanager
def gcp_plane(
    tmp_path: Path,
    gce: FakeComputeApi,
    host: str,
    command: str,
    *,
    env: dict[str, str] | None = None,
    journal: CallbackJournal | None = None,
) -> Iterator[tuple[ControlPlane, on_aws.Recorder, str]]:
    """A control plane on the fake Compute API (``env``: the settings of an earlier one,
    whose state it takes over)."""
    env = env or gcp_env(tmp_path, gce, host, command)
    bucket = env["TRAINBOT_CHECKPOINT_LOCATIONS"].removeprefix("gs://")
    notes = on_aws.Recorder()
    with ControlPlane(
        load_settings(env),
        notifier=notes,
        journal=journal or CallbackJournal(lambda *_: None),
        provider=gcp_provider(gce),
        scheduler=False,
    ) as cp:
        yield cp, notes, bucket


def deleted(gce: FakeComputeApi, name: str) -> bool:
    return bool(gce.calls("DELETE", f"/instances/{name}$"))


@pytest.mark.slow
def test_gcp_dry_run_on_one_a100_commits_to_gcs_restores_and_is_deleted(
    tmp_path: Path,
    gce: FakeComputeApi,
    gcs_emulator: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    with gcp_plane(tmp_path, gce, gcs_emulator, TINY) as (cp, notes, bucket):
        run_id = preflight_only(cp)
        [inst] = wait_for(lambda: gcp_dry_runs(gce, run_id), what="the dry run's instance")
        # One A100 of the eight the run asks for, with the runner's service account.
        assert inst["machineType"].endswith("/a2-highgpu-1g")
        assert inst["guestAccelerators"][0]["acceleratorCount"] == 1
        assert inst["serviceAccounts"][0]["email"].startswith("trainbot-runner@")
        play_gcp(gce, inst, tmp_path)
        wait_for(lambda: finished(cp, run_id), what="the preflight report", timeout=120)
        dry = dry_check(notes, run_id)
        log = (tmp_path / inst["name"] / "boot.log").read_text(errors="replace")
        assert dry.status == "pass", (dry.detail, log[-3000:])
        assert "restored bit-identical" in dry.detail and "ran on a2-highgpu-1g" in dry.detail
        assert f"the data sample gs://{bucket}/sample is readable" in dry.detail
        assert deleted(gce, inst["name"])
        [row] = dry_rows(cp, run_id)
        assert row.report is not None and row.report["checkpoint_bytes"] > 0
        assert row.cost_usd is not None and row.token_hash is None


#: A control plane on the fake Compute API as a process of its own, to be killed: it
#: submits ``/train preflight gpu`` and waits. The settings come from the environment.
_GCP_PLANE = """
import sys, time
from google.auth.credentials import AnonymousCredentials
from jobs.usecases import service
from jobs.process.bootstrap import ControlPlane
from jobs.outbound.notify import CallbackJournal
from jobs.providers.gcp import GcpProvider
from jobs.process.settings import load_settings
from tests.jobs.test_aws_control_plane import Recorder

url, project, zones, account = sys.argv[1:5]
provider = GcpProvider(
    project=project, region="us-central1", zones=zones.split(","), api_endpoint=url,
    credentials=AnonymousCredentials(), service_account=account,
)
with ControlPlane(
    load_settings(), notifier=Recorder(), journal=CallbackJournal(lambda *_: None),
    provider=provider, scheduler=False,
) as cp:
    ada = service.Actor(user="ada", channel="#ml")
    service.submit(cp.deps, spec_name="gpu", overrides=[], actor=ada, launch=False)
    time.sleep(600)
"""


@pytest.mark.slow
def test_gcp_kill_9_during_the_dry_run_then_restart_deletes_its_instance(
    tmp_path: Path, gce: FakeComputeApi, gcs_emulator: str
) -> None:
    env = gcp_env(tmp_path, gce, gcs_emulator, TINY)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _GCP_PLANE,
            gce.url,
            gce.project,
            ",".join(GCP_ZONES),
            "trainbot-runner@trainbot-test.iam.gserviceaccount.com",
        ],
        env={**env, "PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def launched() -> list[dict[str, Any]]:
            assert proc.poll() is None, "the control plane exited"
            return [i for i in gce.instances() if i["labels"].get(TAG_DRY_RUN) == "true"]

        [inst] = wait_for(launched, what="the dry run's instance", timeout=120)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    first, run_id = inst["name"], inst["labels"][TAG_RUN_ID]
    assert not deleted(gce, first), "nobody deleted it yet"

    records: list[dict[str, Any]] = []
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    with gcp_plane(tmp_path, gce, gcs_emulator, TINY, env=env, journal=journal) as (cp, _, _):
        ended = [r for r in records if r["type"] == "dry_run_ended" and r["run"] == run_id]
        zone = inst["zone"].rsplit("/", 1)[-1]
        assert ended and ended[0]["instance"] == f"{zone}/{first}"  # GCP's ids are zone/name
        assert deleted(gce, first)
        # The checks run again, with a dry run of their own...
        [again] = wait_for(
            lambda: [i for i in gcp_dry_runs(gce, run_id) if i["name"] != first],
            what="the rerun's dry-run instance",
        )
    # ...whose instance goes when this control plane stops in the middle of it.
    assert deleted(gce, again["name"])
    row = on_aws.run_row(cp, run_id)
    assert row.state == RunState.PREFLIGHT_FAILED
    assert "the control plane shut down during the dry run" in json.dumps(row.preflight)


def test_gcp_dry_run_that_fails_is_reported_and_its_instance_deleted(
    tmp_path: Path,
    gce: FakeComputeApi,
    gcs_emulator: str,
) -> None:
    with gcp_plane(tmp_path, gce, gcs_emulator, NO_SESSION) as (cp, notes, _):
        run_id = preflight_only(cp)
        [inst] = wait_for(lambda: gcp_dry_runs(gce, run_id), what="the dry run's instance")
        play_gcp(gce, inst, tmp_path)
        wait_for(lambda: finished(cp, run_id), what="the preflight report", timeout=120)
        dry = dry_check(notes, run_id)
        assert dry.status == "fail" and "without reporting anything" in dry.detail
        assert deleted(gce, inst["name"])


# -- the cheapest type, from each catalog -----------------------------------------------------


@pytest.mark.parametrize(
    "request_, instance_type, expected",
    [
        (
            ResourceRequest("aws", "us-east-1", accelerator_type="T4", accelerator_count=8),
            None,
            "g4dn.xlarge",
        ),
        (
            ResourceRequest("aws", "us-east-1", accelerator_type="A100", accelerator_count=8),
            None,
            "p4d.24xlarge",
        ),
        (ResourceRequest("aws", "us-east-1", instance_type="m6i.xlarge"), None, "t3.medium"),
        (
            ResourceRequest("aws", "us-east-1", accelerator_type="L4", accelerator_count=4),
            "cpu",
            "t3.medium",
        ),
        (
            ResourceRequest("aws", "us-east-1", accelerator_type="L4", accelerator_count=4),
            "g6.xlarge",
            "g6.xlarge",
        ),
        (
            ResourceRequest("gcp", "us-central1", accelerator_type="A100", accelerator_count=8),
            None,
            "a2-highgpu-1g",
        ),
        (
            ResourceRequest("gcp", "us-central1", accelerator_type="L4", accelerator_count=4),
            None,
            "g2-standard-4",
        ),
        (ResourceRequest("gcp", "us-central1"), None, "e2-standard-2"),
        (
            ResourceRequest("gcp", "us-central1", accelerator_type="T4", accelerator_count=2),
            "cpu",
            "e2-standard-2",
        ),
    ],
)
def test_the_dry_run_gets_the_cheapest_type_that_can_run_the_job(
    request_: ResourceRequest, instance_type: str | None, expected: str, gce: FakeComputeApi
) -> None:
    provider: Provider
    if request_.cloud == "aws":
        provider = AwsProvider(region="us-east-1", image_id="ami-00000000")
    else:
        provider = gcp_provider(gce)
    got = provider.dry_run_request(request_, instance_type=instance_type)
    assert got.instance_type == expected
    assert got.accelerator_count <= 1 or expected == "p4d.24xlarge"
    if instance_type == "cpu" or not request_.accelerator_type:
        assert got.accelerator_type is None and got.accelerator_count == 0


# -- the report route and the credentials of a dry run's token --------------------------------


class _Recording:
    """A broker that says what it was asked for (the cloud's side is tested elsewhere)."""

    def __init__(self) -> None:
        self.asked: list[dict[str, str]] = []

    def issue(self, **asked: str) -> dict[str, Any]:
        self.asked.append(asked)
        return {"Version": 1, "AccessKeyId": "k", "SecretAccessKey": "s", "SessionToken": "t"}


def _post(url: str, token: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_report_route_takes_only_its_own_dry_run_s_token_until_it_ends(
    db_engine: Engine,
) -> None:
    with Session(db_engine) as session:
        session.add(
            Run(id="r-1", spec_name="t", spec={}, requester="U1", checkpoint_uri="s3://b/ck")
        )
        session.flush()
        for dry_id, token in (("d-1", "tok-1"), ("d-2", "tok-2")):
            session.add(
                DryRunInstance(
                    id=dry_id, run_id="r-1", provider="aws", token_hash=hash_token(token)
                )
            )
        session.commit()
    broker = _Recording()
    server = serve(
        ControlPlaneApp(db_engine, IngestService(db_engine), credentials=broker), "127.0.0.1", 0
    )
    route = server.url + DRY_RUN_ROUTE
    try:
        saved = encode_dry_run_post("d-1", "saved")
        assert _post(route, "tok-1", saved) == (200, {"stored": "saved"})
        assert _post(route, None, saved)[0] == 401
        assert _post(route, "tok-unknown", saved)[0] == 401
        status, body = _post(route, "tok-2", saved)
        assert status == 403 and "scoped to its dry run" in body["error"]
        status, body = _post(route, "tok-1", b'{"v": 1, "dry_run": "d-1", "phase": "finished"}')
        assert status == 400 and "'finished' phase" in body["error"]
        assert _post(route, "tok-1", b"x" * (70 * 1024))[0] == 413
        # The same token gets store credentials for the run's dry-run directory, no other.
        status, _ = _post(server.url + CREDENTIALS_PATH, "tok-1", b"")
        assert status == 200
        assert broker.asked == [
            {
                "checkpoint_uri": "s3://b/ck",
                "run_prefix": "r-1-dry-run",
                "run_id": "r-1",
                "attempt_id": "d-1",
            }
        ]
        report = encode_dry_run_post("d-1", "finished", {"ok": True, "write_s": float("nan")})
        assert _post(route, "tok-1", report)[0] == 200
        with Session(db_engine) as session:
            row = session.get(DryRunInstance, "d-1")
            assert row is not None and row.phase == "finished"
            assert row.report == {"ok": True, "write_s": "NaN"}, "JSON columns take no NaN"
            row.token_hash = None  # the dry run ended
            session.add(row)
            session.commit()
        assert _post(route, "tok-1", saved)[0] == 401
        assert _post(server.url + CREDENTIALS_PATH, "tok-1", b"")[0] == 401
    finally:
        server.shutdown()
