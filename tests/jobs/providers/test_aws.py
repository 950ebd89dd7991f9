"""The AWS provider: the contract on moto's server, then what only AWS has.

boto3 talks real HTTP to moto (EC2, S3, IAM, STS, Budgets). Service Quotas for EC2, spot
placement scores and the EC2 errors moto never returns go through botocore's Stubber on the
provider's own clients, validated against AWS's API models. A spot interruption is made in
moto's model (``tests/fakes/aws.py`` says why and how). Preflight's own checks read the
provider's answers, so the reports below are the ones a person would see.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import date, datetime, timezone
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber

from jobs.preflight import (
    CapacityCheck,
    DataLocalityCheck,
    PreflightContext,
    QuotaCheck,
    Status,
    run_preflight,
)
from jobs.preflight import resource_request as spec_request
from jobs.providers import base
from jobs.providers.aws import (
    IAM_ACTIONS,
    USER_DATA_TEMPLATE,
    AwsCredentialsError,
    AwsProvider,
    make,
    quota_codes,
    refresh_prices,
)
from jobs.providers.base import (
    BucketLocation,
    CapacityError,
    InstanceState,
    LaunchRequest,
    ProviderError,
    ProviderPermissionError,
    ResourceRequest,
)
from jobs.providers.runner_install import RunnerInstall
from jobs.spec import JobSpec, parse_spec
from tests.fakes import aws as fake
from tests.fakes.aws import stub
from tests.fakes.moto_server import refusing_s3
from tests.jobs.boot import aws_boot_env, root_commands, stand_in
from tests.jobs.providers.contract import ProviderContract, launch_request, wait_for_state
from tests.paths import ROOT

REGION = "us-east-1"
T4 = ResourceRequest(cloud="aws", region=REGION, accelerator_type="T4", accelerator_count=1)
A10G = ResourceRequest(cloud="aws", region=REGION, accelerator_type="A10G", accelerator_count=1)
WORKLOAD = ["trainbot-runner", "exec", "--", "python", "train.py", "--steps", "100"]
G_SPOT, G_ON_DEMAND = "L-3819A6DF", "L-DB2E81BA"


def quotas(stubber: Stubber, *pairs: tuple[str, float]) -> None:
    for code, value in pairs:
        stubber.add_response(
            "get_service_quota", fake.quota(code, value), {"ServiceCode": "ec2", "QuotaCode": code}
        )


def images(moto: dict[str, Any]) -> dict[str, Any]:
    """moto's DescribeImages answer for the test AMI, as a Stubber response."""
    answer = fake.client("ec2", moto["url"]).describe_images(ImageIds=[moto["image"]])
    answer.pop("ResponseMetadata", None)
    return dict(answer)


def spec(data_uri: str | None = None, **resources: Any) -> JobSpec:
    data: dict[str, Any] = {
        "command": " ".join(WORKLOAD[3:]),
        "resources": {"cloud": "aws", "region": REGION, **resources},
    }
    if data_uri is not None:
        data["data_uri"] = data_uri
    return parse_spec(data, name="t")


def context(
    tmp_path: Path, job: JobSpec, provider: AwsProvider, *, store: str | None = None
) -> PreflightContext:
    return PreflightContext(
        spec=job,
        run_id="run-pre",
        provider=provider,
        request=spec_request(job, provider),
        checkpoint_uri=store or str(tmp_path / "ckpt"),
        mtbp_s=6 * 3600.0,
        env={},
        workdir=tmp_path,
    )


def instances_of(url: str, run_id: str) -> list[dict[str, Any]]:
    ec2 = fake.client("ec2", url)
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[{"Name": f"tag:{base.TAG_RUN_ID}", "Values": [run_id]}]
    )
    return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


# -- the contract ---------------------------------------------------------------------------


@pytest.fixture
def provider(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any], stubbers: list[Stubber]
) -> Iterator[AwsProvider]:
    aws = make_aws()
    quota_stub = stub(stubbers, aws.client("service-quotas"))
    for _ in range(3):
        quotas(quota_stub, (G_SPOT, 10_000), (G_ON_DEMAND, 10_000))
    scores = stub(stubbers, aws.client("ec2", advisory=True))
    ranked = dict(zip(sorted(moto["zone_ids"].values()), (9, 3, 7, 5, 2, 8), strict=False))
    for _ in range(4):
        scores.add_response("get_spot_placement_scores", fake.placement_scores(ranked))
    yield aws


@pytest.fixture
def resource_request() -> ResourceRequest:
    return T4


@pytest.fixture
def workload() -> list[str]:
    return WORKLOAD


class TestAwsProviderContract(ProviderContract):
    pass


# -- preflight reports --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accelerator", "itype", "spot_code", "od_code", "needed"),
    [
        ("A10G:1", "g5.xlarge", G_SPOT, G_ON_DEMAND, 4),
        ("A100:8", "p4d.24xlarge", "L-7212CCBC", "L-417A185B", 96),
        ("H100:8", "p5.48xlarge", "L-C4BD4855", "L-417A185B", 192),
    ],
)
def test_quota_of_zero_fails_preflight_with_the_increase_command(
    stubbers: list[Stubber],
    make_aws: Callable[..., AwsProvider],
    tmp_path: Path,
    accelerator: str,
    itype: str,
    spot_code: str,
    od_code: str,
    needed: int,
) -> None:
    aws = make_aws()
    stubber = stub(stubbers, aws.client("service-quotas"))
    quotas(stubber, (spot_code, 0), (od_code, 0))
    result = QuotaCheck().run(context(tmp_path, spec(accelerator=accelerator), aws), prior={})
    stubber.assert_no_pending_responses()
    assert result.status is Status.FAIL
    assert (result.data["limit"], result.data["needed"], result.data["unit"]) == (
        0,
        needed,
        "vCPUs",
    )
    assert spot_code in result.detail and itype in result.detail
    assert (
        f"aws service-quotas request-service-quota-increase --service-code ec2 "
        f"--quota-code {spot_code} --desired-value {needed} --region {REGION}"
    ) in result.remedy


def test_quota_counts_running_instances_and_falls_back_to_the_default(
    make_aws: Callable[..., AwsProvider], stubbers: list[Stubber]
) -> None:
    """An account that never changed a quota has no applied value: the default applies."""
    aws = make_aws()
    on_demand = replace(A10G, spot=False)
    stubber = stub(stubbers, aws.client("service-quotas"))
    for _ in range(2):
        for code, value in ((G_ON_DEMAND, 64), (G_SPOT, 32)):
            params = {"ServiceCode": "ec2", "QuotaCode": code}
            stubber.add_client_error(
                "get_service_quota", "NoSuchResourceException", "none", 400, expected_params=params
            )
            stubber.add_response("get_aws_default_service_quota", fake.quota(code, value), params)
    before = aws.quota(on_demand)
    run = aws.launch(launch_request(on_demand, WORKLOAD, zone="us-east-1a", run_id=new_run()))
    try:
        after = aws.quota(on_demand)
    finally:
        aws.terminate(run.instance_id)
    stubber.assert_no_pending_responses()
    assert after.used == before.used + 4, "an on-demand g5.xlarge holds 4 G vCPUs"
    assert (after.limit, after.needed, after.ok) == (64, 4, True)
    assert G_ON_DEMAND in after.detail and f"spot quota {G_SPOT} is 32 vCPUs" in after.detail


def test_capacity_in_no_zone_fails_preflight(
    make_aws: Callable[..., AwsProvider], tmp_path: Path
) -> None:
    aws = make_aws()
    zones = aws.capacity(replace(A10G, zones=("us-east-1e",)))
    assert [(z.zone, z.available) for z in zones] == [("us-east-1e", False)]
    assert zones[0].detail == "g5.xlarge is not offered in us-east-1e"
    job = spec(accelerator="A10G:1", zones=["us-east-1e"])
    result = CapacityCheck().run(context(tmp_path, job, aws), prior={})
    assert result.status is Status.FAIL
    assert "g5.xlarge is not offered in us-east-1e" in result.detail
    assert result.data["zones"] == []


def test_capacity_ranks_by_placement_score_and_degrades_without_permission(
    stubbers: list[Stubber], make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    aws = make_aws()
    scores = stub(stubbers, aws.client("ec2", advisory=True))
    ids = moto["zone_ids"]
    scores.add_response(
        "get_spot_placement_scores",
        fake.placement_scores({ids["us-east-1c"]: 9, ids["us-east-1a"]: 2}),
        {
            "InstanceTypes": ["g5.xlarge"],
            "TargetCapacity": 1,
            "TargetCapacityUnitType": "units",
            "SingleAvailabilityZone": True,
            "RegionNames": [REGION],
        },
    )
    ranked = aws.capacity(replace(A10G, zones=("us-east-1a", "us-east-1c", "us-east-1e")))
    assert [(z.zone, z.available, z.score) for z in ranked] == [
        ("us-east-1c", True, 9),
        ("us-east-1a", True, 2),
        ("us-east-1e", False, None),
    ]
    scores.add_client_error(
        "get_spot_placement_scores", "UnauthorizedOperation", "You are not authorized"
    )
    plain = aws.capacity(replace(A10G, zones=("us-east-1a", "us-east-1c")))
    assert [(z.zone, z.available, z.score) for z in plain] == [
        ("us-east-1a", True, None),
        ("us-east-1c", True, None),
    ]
    assert "ec2:GetSpotPlacementScores" in plain[0].detail
    scores.deactivate()  # moto has no placement scores at all: still degrades
    moto_only = aws.capacity(replace(A10G, zones=("us-east-1a",)))
    assert moto_only[0].available and "spot placement scores unavailable" in moto_only[0].detail
    on_demand = aws.capacity(replace(A10G, spot=False, zones=("us-east-1a",)))
    assert on_demand[0].detail == "g5.xlarge offered (on demand)"


def test_bucket_in_another_region_fails_preflight(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any], tmp_path: Path
) -> None:
    aws = make_aws()
    far = fake.unique_bucket(moto["url"], region="eu-west-1")
    near = fake.unique_bucket(moto["url"], region=REGION)
    assert aws.bucket_location(f"s3://{far}/train") == BucketLocation.region("eu-west-1")
    assert aws.bucket_location(f"s3://{near}/train") == BucketLocation.region(REGION)
    assert aws.bucket_location("gs://elsewhere/train") is None
    # A Multi-Region Access Point has no one region: unknown, not an error.
    assert aws.bucket_location("s3://mfzwi23gnjvgw.mrap/train") is None
    result = DataLocalityCheck().run(
        context(tmp_path, spec(accelerator="A10G:1", data_uri=f"s3://{far}/train"), aws), prior={}
    )
    assert result.status is Status.FAIL
    assert f"s3://{far}/train is in eu-west-1 but the accelerators run in {REGION}" in result.detail
    passed = DataLocalityCheck().run(
        context(
            tmp_path,
            spec(accelerator="A10G:1", data_uri=f"s3://{near}/x"),
            aws,
            store=f"s3://{near}/ckpt",  # the checkpoints in the run's region too
        ),
        prior={},
    )
    assert passed.status is Status.PASS
    with pytest.raises(ProviderError, match="does not exist"):
        aws.bucket_location(f"s3://missing-{uuid.uuid4().hex[:8]}/x")


def test_bucket_region_when_access_is_denied(
    make_aws: Callable[..., AwsProvider], caplog: pytest.LogCaptureFixture
) -> None:
    with fake.region_telling_s3("ap-south-1") as url:
        assert make_aws(endpoint_url=url).bucket_location("s3://theirs/data") == (
            BucketLocation.region("ap-south-1")
        )
    with refusing_s3() as url, caplog.at_level(logging.WARNING, "jobs.providers.aws"):
        assert make_aws(endpoint_url=url).bucket_location("s3://theirs/data") is None
    assert "s3:GetBucketLocation" in caplog.text


# -- the spot lifecycle -------------------------------------------------------------------


def test_spot_launch_interruption_next_zone_and_termination(
    stubbers: list[Stubber],
    make_aws: Callable[..., AwsProvider],
    moto: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    aws = make_aws()
    run_id, token = new_run(), f"tok-{uuid.uuid4().hex}"
    zones = [z.zone for z in aws.capacity(A10G) if z.available]
    assert len(zones) >= 3

    def attempt(n: int, zone: str) -> LaunchRequest:
        return launch_request(
            A10G,
            WORKLOAD,
            zone=zone,
            run_id=run_id,
            attempt_id=f"attempt-{n}",
            env={"TRAINBOT_TOKEN": token, "TRAINBOT_INGEST_URL": "https://cp.example/ingest"},
            scratch_bytes=50 << 30,
        )

    with caplog.at_level(logging.DEBUG):
        first = aws.launch(attempt(1, zones[0]))
    assert token not in caplog.text, "the runner token is never logged"
    assert (first.zone, first.attempt_id) == (zones[0], "attempt-1")
    assert wait_for_state(aws, first.instance_id, {InstanceState.RUNNING}).reason == "running"

    # What EC2 was asked for, read back from moto.
    ec2 = fake.client("ec2", moto["url"])
    inst = ec2.describe_instances(InstanceIds=[first.instance_id])["Reservations"][0]["Instances"][
        0
    ]
    assert inst["InstanceLifecycle"] == "spot" and inst["InstanceType"] == "g5.xlarge"
    assert inst["ClientToken"] == f"{run_id}/attempt-1"
    assert inst["MetadataOptions"]["HttpTokens"] == "required"
    assert inst["MetadataOptions"]["HttpPutResponseHopLimit"] == 1
    assert inst["IamInstanceProfile"]["Arn"] == moto["profile"]
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags[base.TAG_MANAGED] == "true" and tags[base.TAG_OWNER] == "U0TEST"
    assert tags[base.TAG_IDEMPOTENCY_KEY] == f"{run_id}/attempt-1"
    volume_ids = [m["Ebs"]["VolumeId"] for m in inst["BlockDeviceMappings"]]
    volumes = ec2.describe_volumes(VolumeIds=volume_ids)["Volumes"]
    assert volumes and all(
        {t["Key"]: t["Value"] for t in v["Tags"]}[base.TAG_RUN_ID] == run_id for v in volumes
    )
    [image] = images(moto)["Images"]
    assert volumes[0]["Size"] == image["BlockDeviceMappings"][0]["Ebs"]["VolumeSize"] + 50, (
        "the scratch bytes are added to the AMI's root volume"
    )
    user_data = ec2.describe_instance_attribute(InstanceId=first.instance_id, Attribute="userData")
    script = base64.b64decode(user_data["UserData"]["Value"]).decode()
    assert f"TRAINBOT_TOKEN={token}" in script and "shutdown -h now" in script
    assert "trainbot-boot trainbot-runner exec -- python train.py --steps 100" in script

    # EC2 reclaims the capacity; status and the reconcile listing both see it.
    at = datetime(2030, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
    fake.interrupt(first.instance_id, at=at)
    status = aws.status(first.instance_id)
    assert (status.state, status.preempted_at) == (InstanceState.PREEMPTED, at)
    assert "Server.SpotInstanceTermination" in status.reason
    listed = {i.instance_id: i for i in aws.list_instances()}
    assert listed[first.instance_id].state is InstanceState.PREEMPTED
    aws.terminate(first.instance_id)  # ending it again changes nothing
    assert aws.status(first.instance_id).state is InstanceState.PREEMPTED

    # The resubmit goes to the next zone, which has no capacity right now ...
    ec2_stub = stub(stubbers, aws.client("ec2"))
    ec2_stub.add_response("describe_instances", {"Reservations": []})
    ec2_stub.add_client_error(
        "run_instances",
        "InsufficientInstanceCapacity",
        "We currently do not have sufficient g5.xlarge capacity in the Availability Zone",
        expected_params={
            "ImageId": moto["image"],
            "InstanceType": "g5.xlarge",
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": f"{run_id}/attempt-2",
            "UserData": ANY,
            "InstanceInitiatedShutdownBehavior": "terminate",
            "MetadataOptions": ANY,
            "TagSpecifications": ANY,
            "BlockDeviceMappings": ANY,
            "InstanceMarketOptions": {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            },
            "IamInstanceProfile": {"Name": "trainbot-runner"},
            "Placement": {"AvailabilityZone": zones[1]},
        },
    )
    with pytest.raises(CapacityError) as no_room:
        aws.launch(attempt(2, zones[1]))
    ec2_stub.assert_no_pending_responses()
    ec2_stub.deactivate()
    assert no_room.value.zone == zones[1] and "next zone" in str(no_room.value)

    # ... so it moves on to the one after, and runs there until terminated.
    third = aws.launch(attempt(3, zones[2]))
    assert third.zone == zones[2] and third.instance_id != first.instance_id
    wait_for_state(aws, third.instance_id, {InstanceState.RUNNING})
    aws.terminate(third.instance_id)
    done = aws.status(third.instance_id)
    assert (done.state, done.reason) == (
        InstanceState.TERMINATED,
        "terminated by the control plane",
    )
    attempts = sorted(
        {t["Key"]: t["Value"] for t in i["Tags"]}[base.TAG_ATTEMPT_ID]
        for i in instances_of(moto["url"], run_id)
    )
    assert attempts == ["attempt-1", "attempt-3"], "one instance per attempt that launched"


def test_spot_request_status_gives_notice_and_interruption(
    stubbers: list[Stubber],
    make_aws: Callable[..., AwsProvider],
) -> None:
    aws = make_aws()
    ec2 = stub(stubbers, aws.client("ec2"))
    launched = datetime(2030, 1, 1, tzinfo=timezone.utc)
    reclaimed = datetime(2030, 1, 1, 5, tzinfo=timezone.utc)

    def described(state: str, code: int) -> dict[str, Any]:
        return {
            "Reservations": [
                {
                    "Instances": [
                        {
                            "InstanceId": "i-0aaaaaaaaaaaaaaaa",
                            "State": {"Name": state, "Code": code},
                            "SpotInstanceRequestId": "sir-abcd1234",
                            "InstanceLifecycle": "spot",
                            "LaunchTime": launched,
                            "Placement": {"AvailabilityZone": "us-east-1a"},
                        }
                    ]
                }
            ]
        }

    def request(code: str) -> dict[str, Any]:
        return {
            "SpotInstanceRequests": [
                {
                    "SpotInstanceRequestId": "sir-abcd1234",
                    "Status": {"Code": code, "UpdateTime": reclaimed, "Message": "m"},
                }
            ]
        }

    ids = {"SpotInstanceRequestIds": ["sir-abcd1234"]}
    ec2.add_response("describe_instances", described("running", 16))
    ec2.add_response("describe_spot_instance_requests", request("marked-for-termination"), ids)
    ec2.add_response("describe_instances", described("terminated", 48))
    ec2.add_response(
        "describe_spot_instance_requests", request("instance-terminated-no-capacity"), ids
    )
    notice = aws.status("i-0aaaaaaaaaaaaaaaa")
    assert notice.state is InstanceState.RUNNING and notice.reason.startswith("preemption notice")
    gone = aws.status("i-0aaaaaaaaaaaaaaaa")
    assert (gone.state, gone.preempted_at) == (InstanceState.PREEMPTED, reclaimed)
    assert "instance-terminated-no-capacity" in gone.reason
    ec2.assert_no_pending_responses()


@pytest.mark.parametrize(
    ("console", "state", "exit_code"),
    [
        ("trainbot: trainbot-runner exited with code 0\n", InstanceState.SUCCEEDED, 0),
        ("trainbot: trainbot-runner exited with code 75\n", InstanceState.PREEMPTED, 75),
        ("trainbot: trainbot-runner exited with code 3\n", InstanceState.FAILED, 3),
        ("[    0.000000] Linux version 6.8.0\n", InstanceState.FAILED, None),
    ],
)
def test_an_instance_that_shut_itself_down_reports_the_runner_exit(
    stubbers: list[Stubber],
    make_aws: Callable[..., AwsProvider],
    console: str,
    state: InstanceState,
    exit_code: int | None,
) -> None:
    aws = make_aws()
    info = aws.launch(launch_request(T4, WORKLOAD, zone="us-east-1a"))
    fake.shut_down_from_inside(info.instance_id)
    output = stub(stubbers, aws.client("ec2", advisory=True))
    output.add_response(
        "get_console_output",
        {
            "InstanceId": info.instance_id,
            "Output": base64.b64encode(console.encode()).decode(),
            "Timestamp": datetime(2030, 1, 1, tzinfo=timezone.utc),
        },
        {"InstanceId": info.instance_id},
    )
    status = aws.status(info.instance_id)
    assert (status.state, status.exit_code) == (state, exit_code)
    if exit_code is None:
        assert f"aws ec2 get-console-output --instance-id {info.instance_id}" in status.reason


def test_terminated_outside_trainbot_is_terminated_not_preempted(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    aws = make_aws()
    info = aws.launch(launch_request(T4, WORKLOAD, zone="us-east-1a"))
    fake.client("ec2", moto["url"]).terminate_instances(InstanceIds=[info.instance_id])
    status = aws.status(info.instance_id)
    assert status.state is InstanceState.TERMINATED and "outside trainbot" in status.reason


# -- recovery from a crash ----------------------------------------------------------------


def test_a_restarted_control_plane_adopts_the_instance_it_launched(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    """Killed between RunInstances and its database write, then restarted: one instance."""
    run_id = new_run()
    req = launch_request(T4, WORKLOAD, zone="us-east-1b", run_id=run_id, key="att-0f3a9c")
    before_crash = make_aws().launch(req)
    after_restart = make_aws()  # a new process: nothing of the old provider survives
    adopted = after_restart.launch(req)
    assert adopted.instance_id == before_crash.instance_id
    mine = [i for i in after_restart.list_instances() if i.run_id == run_id]
    assert [i.instance_id for i in mine] == [before_crash.instance_id]
    [inst] = instances_of(moto["url"], run_id)
    assert inst["ClientToken"] == "att-0f3a9c", "EC2's own idempotency token is the key"
    long_key = replace(req, idempotency_key="x" * 80)
    other = after_restart.launch(long_key)
    assert other.instance_id != adopted.instance_id
    assert other.tags[base.TAG_IDEMPOTENCY_KEY].startswith("sha256-"), "long keys are hashed"
    assert len(other.tags[base.TAG_IDEMPOTENCY_KEY]) <= 64
    assert make_aws().launch(long_key).instance_id == other.instance_id
    for instance_id in (adopted.instance_id, other.instance_id):
        after_restart.terminate(instance_id)


# -- credentials and permissions ----------------------------------------------------------


def test_missing_credentials_fail_clearly_before_anything_is_created(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any], no_credentials: None
) -> None:
    aws = make_aws(session=boto3.session.Session())
    run_id = new_run()
    with pytest.raises(AwsCredentialsError) as error:
        aws.launch(launch_request(T4, WORKLOAD, zone="us-east-1a", run_id=run_id))
    message = str(error.value)
    assert "no AWS credentials" in message and "AWS_ACCESS_KEY_ID" in message
    assert "nothing was created" in message
    with pytest.raises(AwsCredentialsError):
        aws.check_launch_permissions(T4, zone="us-east-1a")
    assert instances_of(moto["url"], run_id) == []


def test_denied_launch_names_the_missing_permission(
    stubbers: list[Stubber], make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    aws = make_aws()
    run_id = new_run()
    ec2 = stub(stubbers, aws.client("ec2"))
    sts = stub(stubbers, aws.client("sts", advisory=True))
    role = f"arn:aws:iam::{fake.MOTO_ACCOUNT}:role/trainbot-runner"
    ec2.add_response("describe_instances", {"Reservations": []})
    ec2.add_response("describe_images", images(moto))
    ec2.add_client_error(
        "run_instances",
        "UnauthorizedOperation",
        "You are not authorized to perform this operation. Encoded authorization failure "
        "message: AbCdEf0123",
    )
    decoded = {"allowed": False, "context": {"action": "iam:PassRole", "resource": role}}
    sts.add_response(
        "decode_authorization_message",
        {"DecodedMessage": json.dumps(decoded)},
        {"EncodedMessage": "AbCdEf0123"},
    )
    with pytest.raises(ProviderPermissionError) as denied:
        aws.launch(launch_request(T4, WORKLOAD, zone="us-east-1a", run_id=run_id))
    assert denied.value.permission == "iam:PassRole"
    assert role in str(denied.value) and "AbCdEf0123" not in str(denied.value)
    ec2.deactivate()
    assert instances_of(moto["url"], run_id) == []
    aws.check_launch_permissions(T4, zone="us-east-1a")  # moto allows it: a dry run, no instance
    assert instances_of(moto["url"], "preflight") == []


def test_denied_quota_read_is_a_preflight_failure_naming_the_permission(
    stubbers: list[Stubber], make_aws: Callable[..., AwsProvider], tmp_path: Path
) -> None:
    aws = make_aws()
    stubber = stub(stubbers, aws.client("service-quotas"))
    stubber.add_client_error(
        "get_service_quota", "AccessDeniedException", "no", http_status_code=400
    )
    report = run_preflight(context(tmp_path, spec(accelerator="A10G:1"), aws), [QuotaCheck()])
    [result] = report.results
    assert result.status is Status.FAIL
    assert "servicequotas:GetServiceQuota" in result.detail


# -- budgets ------------------------------------------------------------------------------


def test_budget_is_created_once_with_a_notification_per_threshold(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    aws = make_aws()
    run_id = new_run()
    name = aws.create_budget(run_id=run_id, usd=800, thresholds=[50, 80, 100], email="oncall@x.io")
    again = aws.create_budget(
        run_id=run_id, usd=800, thresholds=[50, 80, 100, 120], email="oncall@x.io"
    )
    assert name == again == f"trainbot-{run_id}"
    budgets = fake.client("budgets", moto["url"])
    budget = budgets.describe_budget(AccountId=fake.MOTO_ACCOUNT, BudgetName=name)["Budget"]
    assert budget["BudgetLimit"] == {"Amount": "800.00", "Unit": "USD"}
    assert budget["CostFilters"] == {"TagKeyValue": [f"user:{base.TAG_RUN_ID}${run_id}"]}
    notes = budgets.describe_notifications_for_budget(AccountId=fake.MOTO_ACCOUNT, BudgetName=name)
    assert sorted(
        (n["Threshold"], n["NotificationType"], n["ThresholdType"]) for n in notes["Notifications"]
    ) == [(t, "ACTUAL", "PERCENTAGE") for t in (50.0, 80.0, 100.0, 120.0)]
    aws.delete_budget(run_id=run_id)
    aws.delete_budget(run_id=run_id)
    assert name not in {
        b["BudgetName"] for b in budgets.describe_budgets(AccountId=fake.MOTO_ACCOUNT)["Budgets"]
    }
    with pytest.raises(ProviderError, match="positive amount"):
        aws.create_budget(run_id=run_id, usd=0, thresholds=[50])


def budget_subscribers(name: str) -> dict[float, list[tuple[str, str]]]:
    """Each notification's subscribers, as moto stored them. moto's server runs in this
    process and does not implement DescribeSubscribersForNotification, so its backend is
    read directly."""
    from moto.budgets.models import budgets_backends

    backend = budgets_backends[fake.MOTO_ACCOUNT]["aws"]
    budget = backend.budgets[fake.MOTO_ACCOUNT][name]
    return {
        float(n.details["Threshold"]): sorted(
            (s["SubscriptionType"], s["Address"]) for s in n.subscribers
        )
        for n in budget.notifications
    }


def test_budget_notifies_the_configured_emails_and_topic_and_is_deleted(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    topic = f"arn:aws:sns:{REGION}:{fake.MOTO_ACCOUNT}:trainbot-budgets"
    aws = make_aws(budget_emails=["oncall@x.io", " lead@x.io "], budget_sns_topic_arn=topic)
    run_id = new_run()
    name = aws.create_budget(run_id=run_id, usd=500, thresholds=[80, 100])
    budgets = fake.client("budgets", moto["url"])
    account = {"AccountId": fake.MOTO_ACCOUNT, "BudgetName": name}
    notes = budgets.describe_notifications_for_budget(**account)["Notifications"]
    assert sorted(n["Threshold"] for n in notes) == [80.0, 100.0]
    assert budget_subscribers(name) == {
        80.0: [("EMAIL", "lead@x.io"), ("EMAIL", "oncall@x.io"), ("SNS", topic)],
        100.0: [("EMAIL", "lead@x.io"), ("EMAIL", "oncall@x.io"), ("SNS", topic)],
    }
    aws.delete_budget(run_id=run_id)
    assert name not in {
        b["BudgetName"] for b in budgets.describe_budgets(AccountId=fake.MOTO_ACCOUNT)["Budgets"]
    }


def test_budget_subscribers_come_from_settings(moto: dict[str, Any]) -> None:
    from jobs.process.settings import load_settings
    from jobs.providers.aws import from_settings

    topic = f"arn:aws:sns:{REGION}:{fake.MOTO_ACCOUNT}:budgets"
    aws = from_settings(
        load_settings(
            {
                "TRAINBOT_AWS_REGION": REGION,
                "TRAINBOT_AWS_BUDGET_EMAILS": "a@x.io, b@x.io",
                "TRAINBOT_AWS_BUDGET_SNS_TOPIC_ARN": topic,
            }
        )
    )
    assert aws.budget_emails == ("a@x.io", "b@x.io") and aws.budget_sns_topic_arn == topic


def test_too_many_budget_subscribers_are_refused(make_aws: Callable[..., AwsProvider]) -> None:
    aws = make_aws(budget_emails=[f"p{n}@x.io" for n in range(10)], budget_sns_topic_arn="arn:x")
    with pytest.raises(ProviderError, match="at most 10 subscribers"):
        aws.create_budget(run_id=new_run(), usd=5, thresholds=[50])


def test_budget_with_a_new_amount_is_updated(
    stubbers: list[Stubber], make_aws: Callable[..., AwsProvider]
) -> None:
    aws = make_aws()
    name = "trainbot-run-b"
    calls = stub(stubbers, aws.client("budgets", region="us-east-1"))
    account = {"AccountId": fake.MOTO_ACCOUNT}
    calls.add_client_error("create_budget", "DuplicateRecordException", "exists", 400)
    old = {
        "BudgetName": name,
        "BudgetLimit": {"Amount": "100.0", "Unit": "USD"},
        "TimeUnit": "ANNUALLY",
        "BudgetType": "COST",
    }
    calls.add_response("describe_budget", {"Budget": old}, {**account, "BudgetName": name})
    calls.add_response("update_budget", {}, None)
    calls.add_response("describe_notifications_for_budget", {"Notifications": []}, None)
    assert aws.create_budget(run_id="run-b", usd=150, thresholds=[]) == name
    calls.assert_no_pending_responses()


# -- launch details -------------------------------------------------------------------------


def test_subnets_limit_the_zones_and_place_the_instance(
    moto: dict[str, Any], session: boto3.session.Session
) -> None:
    subnets = fake.client("ec2", moto["url"]).describe_subnets(
        Filters=[{"Name": "default-for-az", "Values": ["true"]}]
    )["Subnets"]
    by_zone = {s["AvailabilityZone"]: s["SubnetId"] for s in subnets}
    aws = make(
        region=REGION,
        endpoint_url=moto["url"],
        image_id=moto["image"],
        session=session,
        subnet_ids=f"us-east-1b={by_zone['us-east-1b']}",
    )
    zones = {z.zone: z for z in aws.capacity(replace(T4, spot=False))}
    assert [z for z, c in zones.items() if c.available] == ["us-east-1b"]
    assert zones["us-east-1a"].detail == "no subnet is configured for us-east-1a (subnet_ids)"
    info = aws.launch(launch_request(replace(T4, spot=False), WORKLOAD, zone="us-east-1b"))
    [inst] = instances_of(moto["url"], info.run_id)
    assert inst["SubnetId"] == by_zone["us-east-1b"] and "InstanceLifecycle" not in inst
    with pytest.raises(CapacityError) as elsewhere:
        aws.launch(launch_request(T4, WORKLOAD, zone="us-east-1a"))
    assert elsewhere.value.zone == "us-east-1a"
    aws.terminate(info.instance_id)


def test_factory_options_and_requests_it_refuses(moto: dict[str, Any]) -> None:
    aws = make(
        region="eu-west-1", security_group_ids="sg-1, sg-2", subnet_ids="eu-west-1a=subnet-9"
    )
    assert (aws.region, aws.security_group_ids, aws.subnet_ids) == (
        "eu-west-1",
        ("sg-1", "sg-2"),
        {"eu-west-1a": "subnet-9"},
    )
    assert aws.name == "aws" and aws.capabilities.termination_window_s == 120
    with pytest.raises(ProviderError, match="zone=subnet"):
        make(region="eu-west-1", subnet_ids="subnet-9")
    with pytest.raises(ProviderError, match="TRAINBOT_AWS_REGION"):
        AwsProvider(region="")
    # A launch in another region is region failover now (tests/jobs/test_aws_failover.py).
    with pytest.raises(ProviderError, match="command is empty"):
        aws.launch(launch_request(replace(T4, region="eu-west-1"), [], zone="eu-west-1a"))


@pytest.mark.parametrize(
    ("accelerator", "count", "itype"),
    [
        ("A100", 8, "p4d.24xlarge"),
        ("H100", 8, "p5.48xlarge"),
        ("a10g", 1, "g5.xlarge"),
        ("nvidia-tesla-t4", 1, "g4dn.xlarge"),
        ("L4", 1, "g6.xlarge"),
    ],
)
def test_accelerators_map_to_instance_types(accelerator: str, count: int, itype: str) -> None:
    aws = AwsProvider(region=REGION)
    req = ResourceRequest(
        cloud="aws", region=REGION, accelerator_type=accelerator, accelerator_count=count
    )
    assert aws.instance_type(req) == itype


def test_quota_codes_follow_the_family() -> None:
    assert quota_codes("g6e.xlarge")[0][0] == G_SPOT
    assert quota_codes("vt1.3xlarge")[1][0] == G_ON_DEMAND
    assert quota_codes("p3.2xlarge")[0][0] == "L-7212CCBC"
    assert quota_codes("p5e.48xlarge")[0][0] == "L-C4BD4855"
    assert quota_codes("m6i.large")[1][0] == "L-1216C47A"
    with pytest.raises(ProviderError, match="Service Quotas"):
        quota_codes("u-6tb1.metal")
    aws = AwsProvider(region=REGION)
    with pytest.raises(ProviderError, match="instance_type"):
        aws.instance_type(ResourceRequest(cloud="aws", region=REGION))
    a100 = replace(T4, accelerator_type="A100", accelerator_count=3)
    assert aws.instance_type(a100) == "p4d.24xlarge", "the smallest type that holds them"
    assert aws.instance_type(replace(T4, accelerator_count=2)) == "g4dn.12xlarge"
    with pytest.raises(ProviderError, match="B200"):
        aws.instance_type(replace(T4, accelerator_type="B200"))
    too_many = launch_request(replace(a100, accelerator_count=16), WORKLOAD, zone="a")
    with pytest.raises(ProviderError, match="do not fit one instance"):
        aws.launch(too_many)


# -- prices -----------------------------------------------------------------------------------


def test_on_demand_prices_come_from_the_dated_table_and_refresh(
    make_aws: Callable[..., AwsProvider], tmp_path: Path, moto: dict[str, Any]
) -> None:
    shipped = make_aws().price(A10G, zone="us-east-1a")
    assert shipped.on_demand_usd_per_hour == 1.006
    assert "shipped table" in shipped.source and "2024-06-01" in shipped.source
    west = make_aws().price(replace(A10G, region="us-west-2"))
    assert "us-east-1 price used for us-west-2" in west.source

    table = tmp_path / "prices.json"
    table.write_text((ROOT / "jobs/providers/data/aws_prices.json").read_text())
    pricing = boto3.client("pricing", region_name="us-east-1", endpoint_url=moto["url"])
    product = {
        "product": {"attributes": {"instanceType": "g5.xlarge", "regionCode": "us-west-2"}},
        "terms": {
            "OnDemand": {
                "SKU.TERM": {
                    "priceDimensions": {
                        "SKU.TERM.DIM": {"unit": "Hrs", "pricePerUnit": {"USD": "1.1000000000"}}
                    }
                }
            }
        },
    }
    with Stubber(pricing) as stubbed:
        stubbed.add_response(
            "get_products",
            {"PriceList": [json.dumps(product)], "FormatVersion": "aws_v1"},
            {
                "ServiceCode": "AmazonEC2",
                "Filters": [
                    {"Type": "TERM_MATCH", "Field": f, "Value": v}
                    for f, v in (
                        ("instanceType", "g5.xlarge"),
                        ("regionCode", "us-west-2"),
                        ("operatingSystem", "Linux"),
                        ("tenancy", "Shared"),
                        ("preInstalledSw", "NA"),
                        ("capacitystatus", "Used"),
                    )
                ],
            },
        )
        refresh_prices(
            regions=["us-west-2"],
            instance_types=["g5.xlarge"],
            path=table,
            client=pricing,
            today=date(2026, 3, 4),
        )
    written = json.loads(table.read_text())
    assert written["regions"]["us-west-2"]["prices"] == {"g5.xlarge": 1.1}
    assert written["regions"]["us-east-1"]["as_of"] == "2024-06-01", "other regions are kept"
    quote = make_aws(prices_path=table).price(replace(A10G, region="us-west-2"))
    assert quote.on_demand_usd_per_hour == 1.1 and "2026-03-04" in quote.source


# -- the boot script ---------------------------------------------------------------------------


def test_user_data_installs_runs_reports_and_shuts_down(
    make_aws: Callable[..., AwsProvider], tmp_path: Path
) -> None:
    """The rendered script, run by bash with the root-only commands replaced by stand-ins."""
    token = "tok-" + uuid.uuid4().hex
    tricky = 'it\'s $HOME `id` \\ "quoted" ; rm -rf /'
    req = launch_request(
        T4,
        ["trainbot-runner", "exec", "--", "python", "train.py", "--name", "a b"],
        zone="us-east-1a",
        env={"TRAINBOT_TOKEN": token, "TRICKY": tricky},
        scratch_bytes=123,
    )
    script = make_aws(runner=RunnerInstall(mode="index", version="0.1.0")).render_user_data(req)
    assert "@@" not in script
    bin_dir, home = root_commands(tmp_path, apt_get=False), tmp_path / "opt"
    stand_in(
        home / "bin" / "trainbot-runner",
        "#!/usr/bin/env python3\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ), 'cwd': os.getcwd()}},"
        f" open({str(tmp_path / 'ran.json')!r}, 'w'))\nsys.exit(3)\n",
    )
    env = aws_boot_env(tmp_path, home, path=f"{bin_dir}:{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30
    )
    ran = json.loads((tmp_path / "ran.json").read_text())
    assert ran["argv"] == ["exec", "--", "python", "train.py", "--name", "a b"]
    assert ran["env"]["TRAINBOT_TOKEN"] == token and ran["env"]["TRICKY"] == tricky
    assert ran["env"]["TRAINBOT_TERMINATION_WINDOW_S"] == "120"
    assert ran["env"]["TRAINBOT_SCRATCH_BYTES"] == "123"
    assert "AWS_ACCESS_KEY_ID" not in ran["env"], "the environment is rebuilt from the file"
    assert ran["cwd"] == str(tmp_path / "scratch")
    assert (tmp_path / "shutdown").read_text() == "shutdown -h now\n"
    assert "trainbot-runner exited with code 3" in (tmp_path / "console").read_text()
    assert token not in done.stdout + done.stderr + (tmp_path / "console").read_text()
    assert (tmp_path / "etc" / "runner.env").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "etc").stat().st_mode & 0o777 == 0o750, "the runner's group can enter"

    with pytest.raises(ProviderError, match="line break"):
        make_aws().render_user_data(launch_request(T4, WORKLOAD, zone="a", env={"X": "a\nb"}))
    assert token not in repr(req)


def test_user_data_template_ships_and_shuts_down() -> None:
    text = USER_DATA_TEMPLATE.read_text()
    assert subprocess.run(["bash", "-n", str(USER_DATA_TEMPLATE)]).returncode == 0
    assert "shutdown -h now" in text and "trap finish EXIT" in text
    assert re.search(r"^set -x", text, re.M) is None, "tracing would print the token"


# -- IAM documents -----------------------------------------------------------------------------


def _statements(path: Path) -> list[dict[str, Any]]:
    doc = json.loads(path.read_text())
    assert doc["Version"] == "2012-10-17"
    return [dict(s) for s in doc["Statement"]]


def _listed(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def test_control_plane_policy_is_least_privilege() -> None:
    statements = _statements(ROOT / "deploy/aws/iam-policy.json")
    assert all(s["Effect"] == "Allow" for s in statements)
    actions = [a for s in statements for a in _listed(s["Action"])]
    assert not [a for a in actions if a == "*" or a.endswith(":*")], "no service-wide wildcards"

    def granting(action: str) -> list[dict[str, Any]]:
        return [s for s in statements if any(fnmatchcase(action, a) for a in _listed(s["Action"]))]

    [terminate] = granting("ec2:TerminateInstances")
    assert terminate["Condition"]["StringEquals"] == {f"aws:ResourceTag/{base.TAG_MANAGED}": "true"}
    assert _listed(terminate["Resource"]) == ["arn:aws:ec2:REGION:ACCOUNT_ID:instance/*"]
    [pass_role] = granting("iam:PassRole")
    assert pass_role["Resource"] == "arn:aws:iam::ACCOUNT_ID:role/trainbot-runner"
    assert pass_role["Condition"] == {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}
    launches = granting("ec2:RunInstances")
    on_instances = [s for s in launches if any("instance/" in r for r in _listed(s["Resource"]))]
    assert on_instances and all(
        s["Condition"]["StringEquals"][f"aws:RequestTag/{base.TAG_MANAGED}"] == "true"
        for s in on_instances
    )
    for tag in (base.TAG_RUN_ID, base.TAG_ATTEMPT_ID, base.TAG_OWNER, base.TAG_IDEMPOTENCY_KEY):
        assert on_instances[0]["Condition"]["Null"][f"aws:RequestTag/{tag}"] == "false"
    for tagging in granting("ec2:CreateTags"):
        condition = tagging["Condition"]
        assert condition.get("StringEquals", {}).get("ec2:CreateAction") in (
            "RunInstances",
            "CreatePlacementGroup",
        ) or (
            condition["StringEquals"][f"aws:ResourceTag/{base.TAG_MANAGED}"] == "true"
            and condition["ForAllValues:StringEquals"]["aws:TagKeys"] == ["trainbot-terminated-by"]
        )
    wide = [s for s in statements if s["Resource"] == "*"]
    assert all(
        a.startswith(("ec2:Describe", "ec2:GetSpotPlacementScores", "sts:"))
        for s in wide
        for a in _listed(s["Action"])
    ), "only reads (and decoding denials) apply to every resource"


def test_runner_storage_policy_covers_only_the_checkpoint_prefix() -> None:
    """The runner storage role (which each run's session policy narrows further to its own
    run) reaches the checkpoint prefix and nothing else; the instance profile, which the
    training code shares, reaches no checkpoint at all."""
    statements = _statements(ROOT / "deploy/aws/runner-storage-policy.json")
    actions = sorted(a for s in statements for a in _listed(s["Action"]))
    assert actions == sorted(
        [
            "s3:ListBucket",
            "s3:GetObject",
            "s3:PutObject",
            "s3:DeleteObject",
            "s3:AbortMultipartUpload",
            "s3:ListMultipartUploadParts",
        ]
    )
    instance = (ROOT / "deploy/aws/runner-instance-policy.json").read_text()
    assert "CHECKPOINT_BUCKET" not in instance
    for s in statements:
        for resource in _listed(s["Resource"]):
            assert resource.startswith("arn:aws:s3:::CHECKPOINT_BUCKET")
            if resource != "arn:aws:s3:::CHECKPOINT_BUCKET":
                assert resource == "arn:aws:s3:::CHECKPOINT_BUCKET/CHECKPOINT_PREFIX/*"
    [listing] = [s for s in statements if s["Action"] == "s3:ListBucket"]
    assert all(
        p.startswith("CHECKPOINT_PREFIX/") for p in listing["Condition"]["StringLike"]["s3:prefix"]
    )


def test_the_policy_grants_every_call_the_provider_makes(
    stubbers: list[Stubber],
    make_aws: Callable[..., AwsProvider],
    moto: dict[str, Any],
    tmp_path: Path,
) -> None:
    session = boto3.session.Session()
    called: set[str] = set()
    session.events.register(
        "before-parameter-build", lambda event_name, **_: called.add(event_name.split(".", 1)[1])
    )
    aws = make_aws(session=session, image_id=f"resolve:ssm:/trainbot-test/ami-{uuid.uuid4().hex}")
    fake.client("ssm", moto["url"]).put_parameter(
        Name=aws.image_id.removeprefix("resolve:ssm:"), Value=moto["image"], Type="String"
    )
    quotas(stub(stubbers, aws.client("service-quotas")), (G_SPOT, 64), (G_ON_DEMAND, 64))
    aws.quota(T4)
    zones = aws.capacity(T4)
    aws.price(T4, zone=zones[0].zone)
    aws.bucket_location(f"s3://{fake.unique_bucket(moto['url'], region=REGION)}/x")
    aws.create_budget(run_id=new_run(), usd=10, thresholds=[50], email="a@b.c")
    info = aws.launch(launch_request(T4, WORKLOAD, zone=zones[0].zone))
    aws.status(info.instance_id)
    aws.list_instances()
    fake.shut_down_from_inside(info.instance_id)
    aws.status(info.instance_id)  # reads the console for the exit code
    second = aws.launch(launch_request(T4, WORKLOAD, zone=zones[0].zone))
    aws.terminate(second.instance_id)
    statements = _statements(ROOT / "deploy/aws/iam-policy.json")
    granted = [a for s in statements for a in _listed(s["Action"])]
    assert {
        "ec2.RunInstances",
        "ec2.TerminateInstances",
        "service-quotas.GetServiceQuota",
        "ssm.GetParameter",
        "ec2.GetConsoleOutput",
    } <= called
    for op in sorted(called):
        assert op in IAM_ACTIONS, f"{op} has no IAM action in IAM_ACTIONS"
        action = IAM_ACTIONS[op]
        if action:
            assert any(fnmatchcase(action, g) for g in granted), f"{action} is not granted"


# -- helpers --------------------------------------------------------------------------------


def new_run() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"
