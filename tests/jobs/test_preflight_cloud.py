"""Security issue 1: with a cloud provider, a chat message runs nothing on the control plane.

The control plane's machine holds the Slack secrets, the cloud credentials and the
database. Each test gives a run a command that would leave a file behind on this machine
(``touch``, ``sh -c 'touch …'``) and checks, after the preflight report and after the
launch, that the file is not there: the dry run warns with the ``trainbot-runner
dry-run`` command a person can run on their own machine, and the command goes to the
cloud instance only. The providers are the real ones at their network edges: AWS on
moto's server (as ``test_aws_control_plane.py``), GCP on the fake Compute API (as
``providers/test_gcp.py``), and once through signed Slack HTTP, as the issue was reported.

The local provider keeps running its dry run on this machine: see
``test_preflight.py::test_dry_run_of_a_script_without_the_session_api_fails``.
"""

from __future__ import annotations

import base64
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from google.auth.credentials import AnonymousCredentials

from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CallbackJournal, CheckLine
from jobs.preflight import (
    BudgetCheck,
    CapacityCheck,
    DataLocalityCheck,
    DryRunCheck,
    PreflightContext,
    Status,
    run_preflight,
)
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.providers.aws import AwsProvider
from jobs.providers.base import Provider
from jobs.providers.gcp import GcpProvider
from jobs.spec import JobSpec, parse_spec
from jobs.usecases import service
from runner.cli import build_parser
from tests.fakes import aws as fake_aws
from tests.fakes.gce_api import FakeComputeApi
from tests.jobs import test_aws_control_plane as on_aws
from tests.jobs.test_preflight import CHECKS, context

ADA = service.Actor(user="ada", channel="#ml")
PUBLIC_URL = "https://trainbot.example.test"
GCP_REGION = "us-central1"
GCP_ZONES = ("us-central1-a", "us-central1-c", "us-central1-f")
RUNNER_SA = "trainbot-runner@trainbot-test.iam.gserviceaccount.com"


# -- the network edges -------------------------------------------------------------------


@pytest.fixture
def aws(moto: dict[str, Any], stubbers: list[Stubber]) -> AwsProvider:
    """The AWS provider on moto, with the answers moto lacks (quotas, placement scores)."""
    provider = on_aws.make_aws(moto, boto3.session.Session())
    on_aws.stub_quotas(stubbers, provider, (on_aws.G_SPOT, 64), (on_aws.G_ON_DEMAND, 64))
    on_aws.stub_scores(stubbers, provider, url=moto["url"], calls=4)
    return provider


@pytest.fixture
def store_on_moto(monkeypatch: pytest.MonkeyPatch, moto: dict[str, Any]) -> str:
    """The runner's S3 store reaches moto from this machine, as in the reported setup: a
    dry run here would get as far as running the command. Returns the bucket."""
    monkeypatch.setenv("TRAINBOT_S3_ENDPOINT_URL", moto["url"])
    return str(moto["bucket"])


# -- helpers -----------------------------------------------------------------------------


def touching(marker: Path) -> list[str]:
    """A command that leaves ``marker`` behind wherever it runs, through a shell."""
    return ["sh", "-c", f"touch {shlex.quote(str(marker))}"]


def hint(checkpoint_uri: str, run_id: str, command: list[str], *, steps: int) -> str:
    """The command preflight is expected to offer, built here from the runner's own flags."""
    return shlex.join(
        [
            "trainbot-runner",
            "dry-run",
            "--steps",
            str(steps),
            "--mtbp",
            "21600",
            "--checkpoint-uri",
            checkpoint_uri,
            "--run-id",
            f"{run_id}-dry-run",
            "--",
            *command,
        ]
    )


def check_named(checks: tuple[CheckLine, ...], name: str) -> CheckLine:
    return next(c for c in checks if c.name == name)


@contextmanager
def control_plane(
    tmp_path: Path, provider: Provider, spec_yaml: str, **env: str
) -> Iterator[tuple[ControlPlane, on_aws.Recorder]]:
    """A real control plane (database, service layer, background work) on ``provider``,
    with one spec, ``owned``."""
    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    (specs / "owned.yaml").write_text(spec_yaml)
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_SPECS_DIR": str(specs),
            "TRAINBOT_PROVIDER": provider.name,
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_PUBLIC_URL": PUBLIC_URL,
            **env,
        }
    )
    notes = on_aws.Recorder()
    journal = CallbackJournal(lambda t, run, data: None)
    cp = ControlPlane(settings, notifier=notes, journal=journal, provider=provider, scheduler=False)
    with cp:
        yield cp, notes


def preflight_then_launch(cp: ControlPlane, notes: on_aws.Recorder, marker: Path) -> str:
    """Submit ``owned``; check that the report is complete and nothing ran; launch anyway."""
    run = service.submit(cp.deps, spec_name="owned", overrides=[], actor=ADA)
    on_aws.wait_until(
        lambda: on_aws.run_row(cp, run.id).state != RunState.PREFLIGHT, what="preflight"
    )
    assert not marker.exists(), "preflight ran the spec's command on the control plane"
    assert on_aws.run_row(cp, run.id).state == RunState.AWAITING_CONFIRMATION
    report = notes.preflight(run.id)
    assert [c.name for c in report.checks] == list(CHECKS)
    service.confirm(cp.deps, run.id, ADA)
    on_aws.wait_until(lambda: on_aws.attempt_launched(cp, run.id, 1), what="attempt 1")
    assert not marker.exists(), "the launch ran the spec's command on the control plane"
    return run.id


# -- through the service layer -----------------------------------------------------------


def test_on_aws_preflight_and_launch_run_nothing_here(
    tmp_path: Path, moto: dict[str, Any], aws: AwsProvider, store_on_moto: str
) -> None:
    marker = tmp_path / "owned"
    command = touching(marker)
    bucket = moto["bucket"]
    spec_yaml = (
        f"command: {command!r}\n"
        "resources:\n  cloud: aws\n  accelerator: A10G:1\n"
        f"  zones: [{', '.join(on_aws.ZONES)}]\n"
        "budget:\n  usd: 50\n"
        "dry_run:\n  enabled: true\n  local: true\n  steps: 3\n"
    )
    env = {"TRAINBOT_AWS_REGION": on_aws.REGION, "TRAINBOT_CHECKPOINT_URI": f"s3://{bucket}/ck"}
    with control_plane(tmp_path, aws, spec_yaml, **env) as (cp, notes):
        run_id = preflight_then_launch(cp, notes, marker)
        report = notes.preflight(run_id)
        dry = check_named(report.checks, "dry_run")
        assert dry.status == "warn"
        assert "never runs a spec's command on its own machine" in dry.detail
        store = on_aws.run_row(cp, run_id).checkpoint_uri
        assert store is not None and store.startswith(f"s3://{bucket}/ck")
        assert f"`{hint(store, run_id, command, steps=3)}`" in dry.remedy
        assert f"-- sh -c 'touch {marker}'" in dry.remedy
        # Without the dry run's figures the budget and the interval do as with it disabled.
        budget = check_named(report.checks, "budget")
        assert budget.status == "pass" and "cannot estimate the cost" in budget.detail
        assert report.interval_s is None and report.estimate_usd is None
        # The command went to the instance, and only there.
        [inst] = on_aws.instances_of(moto["url"], run_id)
        user_data = fake_aws.client("ec2", moto["url"]).describe_instance_attribute(
            InstanceId=inst["InstanceId"], Attribute="userData"
        )
        script = base64.b64decode(user_data["UserData"]["Value"]).decode()
        assert shlex.join(command) in script, "the instance's boot script runs the command"
        aws.terminate(inst["InstanceId"])
    assert not marker.exists()


def test_on_gcp_preflight_and_launch_run_nothing_here(tmp_path: Path, gce: FakeComputeApi) -> None:
    marker = tmp_path / "owned"
    command = ["touch", str(marker)]
    gcp = GcpProvider(
        project=gce.project,
        region=GCP_REGION,
        zones=list(GCP_ZONES),
        api_endpoint=gce.url,
        credentials=AnonymousCredentials(),
        service_account=RUNNER_SA,
    )
    spec_yaml = (
        f"command: {command!r}\n"
        "resources:\n  cloud: gcp\n  accelerator: A100:1\n"
        "budget:\n  usd: 50\n"
        "dry_run:\n  local: true\n"
    )
    gce.buckets["ckpt-bucket"] = "US-CENTRAL1"  # the checkpoint store, in the run's region
    env = {
        "TRAINBOT_GCP_PROJECT": gce.project,
        "TRAINBOT_CHECKPOINT_URI": "gs://ckpt-bucket/default",
    }
    with control_plane(tmp_path, gcp, spec_yaml, **env) as (cp, notes):
        run_id = preflight_then_launch(cp, notes, marker)
        dry = check_named(notes.preflight(run_id).checks, "dry_run")
        assert dry.status == "warn" and "with the gcp provider" in dry.detail
        store = on_aws.run_row(cp, run_id).checkpoint_uri
        assert store is not None and store.startswith("gs://ckpt-bucket/default")
        expected = hint(store, run_id, command, steps=20)
        assert f"`{expected}`" in dry.remedy
        assert f"-- touch {marker}" in dry.remedy
        assert len(gce.instances()) == 1, "the command went to a Compute Engine instance"
    assert not marker.exists()


# -- the checks themselves ---------------------------------------------------------------


def aws_context(
    tmp_path: Path, job: JobSpec, provider: Provider, *, store: str = "s3://ckpt/runs"
) -> PreflightContext:
    return context(
        tmp_path,
        job,
        provider,
        mtbp_s=6 * 3600.0,
        store=store,
        run_id="r-cloud",
        env={"PYTHONPATH": "/nowhere"},
    )


def test_dry_run_local_and_a_local_cloud_in_the_spec_cannot_force_a_run_here(
    tmp_path: Path, moto: dict[str, Any], store_on_moto: str
) -> None:
    """The spec, which comes from chat, says where it wants to run; the provider decides."""
    aws = on_aws.make_aws(moto, boto3.session.Session())
    marker = tmp_path / "owned"
    job = parse_spec(
        {
            "command": ["touch", str(marker)],
            "env": {"WANDB_API_KEY": "hunter2"},
            "data_uri": "s3://data/sample",
            "resources": {"cloud": "local"},
            "dry_run": {"local": True, "steps": 2},
        },
        name="tiny",
    )
    store = f"s3://{store_on_moto}/runs"
    got = DryRunCheck(timeout_s=30).run(aws_context(tmp_path, job, aws, store=store), prior={})
    assert not marker.exists()
    assert got.status is Status.WARN and got.data["skipped"] is True
    expected = (
        "env TRAINBOT_DATA_URI=s3://data/sample trainbot-runner dry-run "
        f"--steps 2 --mtbp 21600 --checkpoint-uri {store} --run-id r-cloud-dry-run "
        f"-- touch {marker}"
    )
    assert got.data["command"] == expected and f"`{expected}`" in got.remedy
    assert "spec's env (WANDB_API_KEY)" in got.remedy, "named, for the person to set"
    assert "hunter2" not in repr(got), "the thread is no place for the env's values"
    # The runner's own parser reads it as meant.
    args = build_parser().parse_args(shlex.split(expected)[3:])
    assert (args.cmd, args.steps, args.mtbp, args.checkpoint_uri, args.run_id) == (
        "dry-run",
        2,
        21600.0,
        store,
        "r-cloud-dry-run",
    )
    assert args.command == ["--", "touch", str(marker)]
    assert not (tmp_path / "work").exists(), "no scratch for a dry run that does not run"


def test_a_dry_run_that_cannot_run_here_degrades_like_a_disabled_one(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    aws = on_aws.make_aws(moto, boto3.session.Session())
    base = {
        "command": "python train.py --steps 1000",
        "resources": {"cloud": "aws", "accelerator": "A10G:1"},
        "max_hours": 3,
    }
    reports = {
        enabled: run_preflight(
            aws_context(
                tmp_path, parse_spec({**base, "dry_run": {"enabled": enabled}}, name="t"), aws
            ),
            [DryRunCheck(), BudgetCheck()],
        )
        for enabled in (True, False)
    }
    on, off = reports[True], reports[False]
    assert [r.status for r in on.results] == [Status.WARN, Status.PASS]
    assert on.results[1] == off.results[1], "the budget check sees the same: no figures"
    assert "no dry-run step time: max_hours as the upper bound" in on.results[1].detail
    assert (on.estimate_usd, on.interval_s, on.expected_hours) == (
        off.estimate_usd,
        off.interval_s,
        off.expected_hours,
    )
    assert on.expected_hours == 3 and on.interval_s is None


def test_a_local_data_path_is_not_looked_up_here_for_a_cloud_provider(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    """Even when the spec claims ``resources.cloud: local``: the answer would tell a chat
    user which files exist on the control plane."""
    aws = on_aws.make_aws(moto, boto3.session.Session())
    secret = tmp_path / "secret.txt"
    secret.write_text("x")
    for path in (secret, tmp_path / "missing"):
        job = parse_spec(
            {"command": "true", "data_uri": str(path), "resources": {"cloud": "local"}}, name="t"
        )
        store = str(tmp_path / "ckpt")  # the spec's "local" region matches no bucket
        got = DataLocalityCheck().run(aws_context(tmp_path, job, aws, store=store), prior={})
        assert got.status is Status.WARN, got.detail
        assert "cannot be checked from here" in got.detail and "aws image" in got.remedy


def test_the_providers_declare_where_their_instances_run(
    tmp_path: Path, moto: dict[str, Any], gce: FakeComputeApi
) -> None:
    from jobs.providers.local import LocalProvider

    aws = on_aws.make_aws(moto, boto3.session.Session())
    gcp = GcpProvider(
        project=gce.project,
        region=GCP_REGION,
        api_endpoint=gce.url,
        credentials=AnonymousCredentials(),
    )
    assert not aws.capabilities.runs_on_this_machine
    assert not gcp.capabilities.runs_on_this_machine
    with LocalProvider(
        tmp_path / "local", termination_window_s=7, mean_time_between_preemptions_s=900
    ) as local:
        caps = local.capabilities
        assert caps.runs_on_this_machine
        assert (caps.termination_window_s, caps.mean_time_between_preemptions_s) == (7, 900)
    for provider in (aws, gcp, local):
        assert isinstance(provider, Provider)


# -- through signed Slack HTTP, as reported ----------------------------------------------


def test_slash_train_preflight_with_a_command_override_runs_nothing_here(
    tmp_path: Path, moto: dict[str, Any], aws: AwsProvider, store_on_moto: str
) -> None:
    """``/train preflight tiny "command=touch owned"`` on a control plane with AWS."""
    from bot.slack_notifier import SlackNotifier
    from bot.slack_wsgi import attach
    from tests.bot import test_slack_app as on_slack
    from tests.fakes.slack_api import FakeSlack

    marker = tmp_path / "owned"
    fake = FakeSlack(tokens=[on_slack.TOKEN], post_interval_s=0.02, burst=5).start()
    hooks = on_slack.ResponseUrls()
    notifier = SlackNotifier(fake.client(on_slack.TOKEN), min_interval_s=0.02, backoff_s=0.05)
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_NOTIFIER": "slack",
            "TRAINBOT_SLACK_SIGNING_SECRET": on_slack.SECRET,
            "TRAINBOT_SLACK_BOT_TOKEN": on_slack.TOKEN,
            "TRAINBOT_ALLOWED_CHANNELS": on_slack.CHANNEL,
            "TRAINBOT_PROVIDER": "aws",
            "TRAINBOT_AWS_REGION": on_aws.REGION,
            "TRAINBOT_CHECKPOINT_URI": f"s3://{store_on_moto}/default",
            "TRAINBOT_PUBLIC_URL": PUBLIC_URL,
        }
    )
    cp = ControlPlane(settings, notifier=notifier, provider=aws, scheduler=False)
    front = attach(cp, client=fake.client(on_slack.TOKEN), notifier=notifier)
    cp.start()
    slack = on_slack.Slack(cp=cp, fake=fake, hooks=hooks, notifier=notifier, front=front)
    try:
        # The shipped tiny spec says cloud: local; this control plane has AWS alone.
        answer, path = slack.command(f'preflight tiny "command=touch {marker}" resources.cloud=aws')
        assert answer.status_code == 200
        assert "nothing launches until you confirm" in str(hooks.wait(path))
        run_id = slack.only_run()
        on_slack.wait_until(
            lambda: slack.state(run_id) != RunState.PREFLIGHT, what="the preflight report"
        )
        assert not marker.exists(), "a chat message ran a program on the control plane"
        run = on_aws.run_row(cp, run_id)
        assert run.preflight is not None
        dry = next(r for r in run.preflight["results"] if r["name"] == "dry_run")
        assert dry["status"] == "warn"
        assert dry["remedy"].count("trainbot-runner dry-run") == 1
        assert f"-- touch {marker}`" in dry["remedy"]
    finally:
        front.close()
        cp.close()
        notifier.close(timeout=5)
        hooks.close()
        fake.close()
    assert not marker.exists()


# -- the checkpoint store's region -------------------------------------------------------


def test_on_aws_a_checkpoint_bucket_in_another_region_fails_preflight(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    aws = on_aws.make_aws(moto, boto3.session.Session())
    far = fake_aws.unique_bucket(moto["url"], region="eu-west-1", prefix="ckpt")
    job = parse_spec({"command": "true", "resources": {"cloud": "aws"}}, name="t")
    report = run_preflight(
        aws_context(tmp_path, job, aws, store=f"s3://{far}/runs"), [DataLocalityCheck()]
    )
    (got,) = report.results
    assert got.status is Status.FAIL and not report.ok
    assert (
        f"the checkpoint store s3://{far}/runs is in eu-west-1 but the run is in {on_aws.REGION}"
    ) in got.detail
    assert f"aws s3 mb s3://BUCKET --region {on_aws.REGION}" in got.remedy
    assert "checkpoint.uri" in got.remedy
    near = f"s3://{moto['bucket']}/runs"
    passed = DataLocalityCheck().run(aws_context(tmp_path, job, aws, store=near), prior={})
    assert passed.status is Status.PASS, passed.detail
    assert f"checkpoint store {near} is in {on_aws.REGION}" in passed.detail
    # A Cloud Storage bucket is out of reach of the instance's credentials.
    other = DataLocalityCheck().run(aws_context(tmp_path, job, aws, store="gs://ck/x"), prior={})
    assert other.status is Status.FAIL
    assert "is on gcp but the run's instances are on aws" in other.detail
    # A bucket that does not exist cannot take a checkpoint.
    missing = f"s3://missing-{far}/runs"
    gone = DataLocalityCheck().run(aws_context(tmp_path, job, aws, store=missing), prior={})
    assert gone.status is Status.FAIL and "does not exist" in gone.detail


def test_on_gcp_a_checkpoint_bucket_in_another_region_fails_preflight(
    tmp_path: Path, gce: FakeComputeApi
) -> None:
    gcp = GcpProvider(
        project=gce.project,
        region=GCP_REGION,
        api_endpoint=gce.url,
        credentials=AnonymousCredentials(),
    )
    gce.buckets.update({"ck-eu": "EUROPE-WEST4", "ck-us": "US-CENTRAL1", "ck-dual": "EUR4"})
    job = parse_spec(
        {"command": "true", "resources": {"cloud": "gcp", "region": GCP_REGION}}, name="t"
    )

    def check(store: str) -> Any:
        return DataLocalityCheck().run(aws_context(tmp_path, job, gcp, store=store), prior={})

    far = check("gs://ck-eu/runs")
    assert far.status is Status.FAIL
    assert f"is in europe-west4 but the run is in {GCP_REGION}" in far.detail
    assert (
        f"gcloud storage buckets create gs://BUCKET --location={GCP_REGION} "
        "--soft-delete-duration=0"
    ) in far.remedy
    dual = check("gs://ck-dual/runs")
    assert dual.status is Status.FAIL and "is in EUR4" in dual.detail
    near = check("gs://ck-us/runs")
    assert near.status is Status.PASS, near.detail
    other = check("s3://ck-us/runs")
    assert other.status is Status.FAIL and "is on aws but the run's instances are on gcp" in (
        other.detail
    )
    local = check("/var/trainbot/ckpt")
    assert local.status is Status.WARN and "die with the instance" in local.detail


def test_on_aws_with_the_first_region_full_capacity_passes_in_the_second(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    """Two regions on moto; no zone of the first can be used (no subnet the runner may
    take), so the run can only fail over: the check passes, naming the second."""
    west = "us-west-2"
    images = [
        {
            i["ImageId"]
            for i in fake_aws.client("ec2", moto["url"], region=r).describe_images(
                Owners=["amazon"]
            )["Images"]
        }
        for r in (on_aws.REGION, west)
    ]
    aws = AwsProvider(
        region=on_aws.REGION,
        endpoint_url=moto["url"],
        image_id=min(images[0] & images[1]),  # one both regions have, for the launch probe
        instance_profile="trainbot-runner",
        session=boto3.session.Session(),
        subnet_ids={f"{west}a": "subnet-west-a", f"{west}b": "subnet-west-b"},
    )
    job = parse_spec(
        {
            "command": ["python", "train.py"],
            "resources": {
                "cloud": "aws",
                "regions": [on_aws.REGION, west],
                "accelerator": "A10G:1",
            },
        },
        name="two-regions",
    )
    got = CapacityCheck().run(aws_context(tmp_path, job, aws), prior={})
    assert got.status is Status.PASS, got.detail
    assert got.data["region"] == west and got.data["usable_regions"] == [west]
    assert got.data["zones"] and all(z.startswith(west) for z in got.data["zones"])
    assert f"none in {on_aws.REGION} (" in got.detail and "no subnet is configured" in got.detail


# -- one larger instance, from each cloud's catalogue -------------------------------------


def advice(provider: Any, *overrides: str) -> str | None:
    """What preflight's instance-shape check says of a spec asking for several instances:
    the one larger instance that holds them all, with both prices; None when there is none."""
    from jobs.preflight import one_larger_instance
    from jobs.preflight.interval import resource_request

    job = parse_spec({"command": "python train.py"}, name="big", overrides=list(overrides))
    found = one_larger_instance(provider, resource_request(job, provider), job.resources.instances)
    return None if found is None else f"{found.detail()}; {found.remedy()}"


def test_on_gcp_four_a100_pairs_are_one_a2_highgpu_8g(gce: FakeComputeApi) -> None:
    from jobs.domain.format import usd
    from jobs.providers.base import ResourceRequest

    gcp = GcpProvider(
        project=gce.project,
        region=GCP_REGION,
        api_endpoint=gce.url,
        credentials=AnonymousCredentials(),
    )
    text = advice(gcp, "resources.cloud=gcp", "resources.accelerator=A100:2",
                  "resources.instances=4")  # fmt: skip
    assert text is not None

    def spot(count: int) -> float:
        req = ResourceRequest(cloud="gcp", region=GCP_REGION, accelerator_type="A100",
                              accelerator_count=count)  # fmt: skip
        return gcp.price(req).spot_usd_per_hour

    # Both priced from the shipped table's A2 units (vCPUs, memory and GPUs of each type).
    assert (
        f"4 instances of 2 × A100 (a2-highgpu-2g) cost {usd(4 * spot(2))}/h spot; one "
        f"a2-highgpu-8g holds all 8 for {usd(spot(8))}/h" in text
    )
    assert "resources.accelerator=A100:8 and resources.instances=1" in text
    # No machine type holds 3 × 4 A100s.
    assert advice(gcp, "resources.cloud=gcp", "resources.accelerator=A100:4",
                  "resources.instances=3") is None  # fmt: skip


def test_on_aws_four_t4_instances_are_one_g4dn_12xlarge_on_demand(aws: AwsProvider) -> None:
    from jobs.preflight.interval import resource_request

    text = advice(
        aws, "resources.cloud=aws", "resources.accelerator=T4:1", "resources.instances=4",
        "resources.spot=false",
    )  # fmt: skip
    assert text is not None
    # The shipped on-demand table: g4dn.xlarge $0.526/h, g4dn.12xlarge $3.912/h.
    assert (
        "4 instances of 1 × T4 (g4dn.xlarge) cost $2.10/h on-demand; one g4dn.12xlarge "
        "holds all 4 for $3.91/h" in text
    )
    # EC2 has no instance of two A100s: each of the four would be a p4d.24xlarge, eight
    # A100s paid for two used; the one p4d.24xlarge holds all eight.
    pairs = ("resources.cloud=aws", "resources.accelerator=A100:2", "resources.instances=4",
             "resources.spot=false")  # fmt: skip
    pair = parse_spec({"command": "python train.py"}, name="big", overrides=list(pairs))
    assert aws.instance_type_for(resource_request(pair, aws)) is None
    assert (
        "4 instances of 2 × A100 cost $131.09/h on-demand; one p4d.24xlarge holds all 8 for "
        "$32.77/h" in (advice(aws, *pairs) or "")
    )
    # No EC2 type holds 16 A100s.
    assert advice(aws, "resources.cloud=aws", "resources.accelerator=A100:8",
                  "resources.instances=2") is None  # fmt: skip
