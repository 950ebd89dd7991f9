"""AWS at the network edge for the provider tests: moto's server, and botocore's Stubber.

moto's server (``tests/fakes/moto_server.py``, the session fixture ``moto_server``) answers
EC2, S3, IAM, STS and Budgets over real HTTP. Where it has nothing, the tests attach
botocore's Stubber to the provider's own client (``AwsProvider.client``); the Stubber checks
every request and canned response against the service's API model, so a misspelt
parameter or a response field AWS never sends fails the test:

- Service Quotas for EC2 (moto implements VPC quotas only): :func:`quota`.
- Spot placement scores (moto answers 500 "not implemented"): :func:`placement_scores`.
- EC2 errors moto never produces (``InsufficientInstanceCapacity``,
  ``UnauthorizedOperation`` with an encoded message) and console output (moto's is fixed).

A spot interruption cannot be asked of moto through any API: its instances only end by
``TerminateInstances``/``StopInstances``, with the reason ``Client.UserInitiatedShutdown``.
:func:`interrupt` therefore uses moto's own model, in this process (the threaded server
shares it), to do what EC2 does on an interruption: moto's ``Instance.terminate()``, then
the state reason ``Server.SpotInstanceTermination`` and a ``Service initiated (…)``
transition reason. Everything the provider reads still crosses HTTP as EC2's XML.

Placement groups, which moto lacks, the server answers itself
(``tests/fakes/moto_server.py``); :func:`limit_placement_group` leaves a cluster group
room for fewer instances than a gang needs, the way a real cluster launch fails, and
:func:`begin_shutdown`/:func:`finish_shutdown` hold an instance in ``shutting-down``, the
state in which EC2 still refuses to delete its group.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import datetime
from typing import Any

import boto3
from botocore.exceptions import ClientError
from botocore.stub import Stubber

from tests.fakes.moto_server import PLACEMENT_GROUPS, refusing_s3

#: The account moto answers as when given test credentials.
MOTO_ACCOUNT = "123456789012"


@functools.lru_cache(maxsize=32)
def client(service: str, endpoint_url: str, *, region: str = "us-east-1") -> Any:
    """A plain boto3 client on moto, with explicit test credentials (one per service)."""
    return boto3.client(
        service,
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def image_id(endpoint_url: str, *, region: str = "us-east-1") -> str:
    """A registered AMI with a 60 GiB root, like the Deep Learning AMI (made once)."""
    ec2 = client("ec2", endpoint_url, region=region)
    name = "trainbot-test-gpu-image"
    found = ec2.describe_images(Owners=["self"], Filters=[{"Name": "name", "Values": [name]}])
    if found["Images"]:
        return str(found["Images"][0]["ImageId"])
    registered = ec2.register_image(
        Name=name,
        Architecture="x86_64",
        RootDeviceName="/dev/sda1",
        BlockDeviceMappings=[
            {"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 60, "VolumeType": "gp3"}}
        ],
    )
    return str(registered["ImageId"])


def instance_profile(endpoint_url: str, *, name: str = "trainbot-runner") -> str:
    """An IAM role and instance profile of that name (moto validates profiles on launch)."""
    iam = client("iam", endpoint_url)
    with suppress(ClientError):
        iam.create_role(RoleName=name, AssumeRolePolicyDocument="{}")
    try:
        iam.create_instance_profile(InstanceProfileName=name)
        iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "EntityAlreadyExists":
            raise
    profile = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]
    return str(profile["Arn"])


def zone_ids(endpoint_url: str, *, region: str = "us-east-1") -> dict[str, str]:
    """Zone name → zone id, as moto's DescribeAvailabilityZones gives them."""
    zones = client("ec2", endpoint_url, region=region).describe_availability_zones()
    return {z["ZoneName"]: z["ZoneId"] for z in zones["AvailabilityZones"]}


def unique_bucket(endpoint_url: str, *, region: str, prefix: str = "data") -> str:
    """A new bucket in ``region`` on moto; returns its name."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    s3 = client("s3", endpoint_url, region=region)
    if region == "us-east-1":
        s3.create_bucket(Bucket=name)
    else:
        s3.create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": region})
    return name


# -- what moto's API cannot do -------------------------------------------------------------


def _moto_instance(instance_id: str, region: str) -> Any:
    from moto.ec2.models import ec2_backends

    return ec2_backends[MOTO_ACCOUNT][region].get_instance(instance_id)


def interrupt(instance_id: str, *, at: datetime, region: str = "us-east-1") -> None:
    """EC2 reclaims a spot instance: terminated, ``Server.SpotInstanceTermination``."""
    from moto.ec2.models.instances import StateReason

    inst = _moto_instance(instance_id, region)
    inst.terminate()
    inst.state_reason = StateReason(
        "Server.SpotInstanceTermination: Spot instance termination",
        "Server.SpotInstanceTermination",
    )
    inst._reason = f"Service initiated ({at:%Y-%m-%d %H:%M:%S} GMT)"


def shut_down_from_inside(instance_id: str, *, region: str = "us-east-1") -> None:
    """The instance ran ``shutdown -h now`` with shutdown behaviour ``terminate``."""
    from moto.ec2.models.instances import StateReason

    inst = _moto_instance(instance_id, region)
    inst.terminate()
    inst.state_reason = StateReason(
        "Client.InstanceInitiatedShutdown: Instance initiated shutdown",
        "Client.InstanceInitiatedShutdown",
    )


def begin_shutdown(instance_id: str, *, region: str = "us-east-1") -> None:
    """The instance is shutting down (its termination has begun but not finished)."""
    from moto.ec2.models.instances import InstanceState

    _moto_instance(instance_id, region)._state = InstanceState("shutting-down", 32)


def finish_shutdown(instance_id: str, *, region: str = "us-east-1") -> None:
    """A shutting-down instance is terminated at last."""
    _moto_instance(instance_id, region).terminate()


def limit_placement_group(name: str, *, instances: int, region: str = "us-east-1") -> None:
    """EC2 has room for only ``instances`` instances in the cluster placement group of that
    name (created now or later): the next launch into it is refused with
    ``InsufficientInstanceCapacity``."""
    PLACEMENT_GROUPS.limit(name, instances=instances, region=region)


# -- Stubber responses, shaped as the real APIs answer ----------------------------------------


def stub(stubbers: list[Stubber], client: Any) -> Stubber:
    """Botocore's Stubber on one of the provider's own clients, active until the test's
    ``stubbers`` fixture deactivates it."""
    stubber = Stubber(client)
    stubber.activate()
    stubbers.append(stubber)
    return stubber


def quota(code: str, value: float, *, region: str = "us-east-1") -> dict[str, Any]:
    """A GetServiceQuota answer for one EC2 vCPU quota."""
    return {
        "Quota": {
            "ServiceCode": "ec2",
            "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)",
            "QuotaArn": f"arn:aws:servicequotas:{region}:{MOTO_ACCOUNT}:ec2/{code}",
            "QuotaCode": code,
            "QuotaName": "vCPU quota",
            "Value": float(value),
            "Unit": "None",
            "Adjustable": True,
            "GlobalQuota": False,
        }
    }


def placement_scores(scores: Mapping[str, int], *, region: str = "us-east-1") -> dict[str, Any]:
    """A GetSpotPlacementScores answer: zone id → score (1-10)."""
    return {
        "SpotPlacementScores": [
            {"Region": region, "AvailabilityZoneId": zid, "Score": score}
            for zid, score in scores.items()
        ]
    }


# -- an S3 that refuses but tells the region -------------------------------------------------


@contextmanager
def region_telling_s3(region: str) -> Iterator[str]:
    """An S3 endpoint that denies GetBucketLocation but names the region on HEAD."""
    with refusing_s3(region=region) as url:
        yield url


def public_parameter(name: str, value: str, *, region: str = "us-east-1") -> None:
    """A parameter under ``/aws/service/…`` as AWS publishes them (the Deep Learning AMI's
    ``…/latest/ami-id``): moto refuses to create such names through the API, so it goes
    into moto's backend, whose GetParameter then serves it over the wire like any other."""
    from moto.ssm.models import Parameter, ssm_backends

    params = ssm_backends[MOTO_ACCOUNT][region]._parameters
    params[name] = [
        Parameter(
            account_id=MOTO_ACCOUNT,
            name=name,
            value=value,
            parameter_type="String",
            description=None,
            allowed_pattern=None,
            keyid=None,
            last_modified_date=datetime.now(),
            version=1,
            data_type="aws:ec2:image",
        )
    ]
