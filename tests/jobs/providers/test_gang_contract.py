"""One contract for gangs (multi-node attempts) on every cloud provider that has them:
AWS on moto's server (a cluster placement group), GCP on the fake Compute Engine API
(a compact placement policy).

Each cloud's own tests keep what only it has: how the placement is named, tagged and
swept, its node environment's wire format, its idempotency tokens, how a launch without
room for every node fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from jobs.providers.aws import AwsProvider
from jobs.providers.base import InstanceInfo, InstanceState, Provider
from jobs.providers.gcp import GcpProvider
from runner import EXIT_PREEMPTED
from tests.fakes import aws as fake_aws
from tests.fakes.gce_api import FakeComputeApi
from tests.jobs.providers import test_aws_gang as aws
from tests.jobs.providers import test_gcp_gang as gcp
from tests.jobs.providers.contract import wait_for_state


@dataclass
class Cloud:
    """A provider and the handful of cloud-side moves and reads the contract needs."""

    provider: Provider
    #: Launch a gang of ``nodes``; with ``room`` set, the placement fits only that many.
    launch: Callable[..., InstanceInfo]
    #: Delete node ``rank`` of the gang the way an operator or the cloud would.
    delete_node: Callable[[InstanceInfo, int], None]
    #: The gang's nodes that still exist and are not ending, and its placement's count.
    left: Callable[[], tuple[int, int]]
    #: How a gang that trainbot ended says so in its reason.
    ended_by: str
    #: Whether the listing still shows a lost gang (as LOST) or leaves it out; either
    #: way reconcile ends its attempt from its status.
    lists_a_lost_gang: bool


def _aws(moto_server: str) -> Cloud:
    fake_aws.instance_profile(moto_server)
    provider = AwsProvider(
        session=boto3.session.Session(),
        region=aws.REGION,
        endpoint_url=moto_server,
        image_id=fake_aws.image_id(moto_server),
        instance_profile="trainbot-runner",
    )
    launched: list[Any] = []

    def launch(nodes: int = 2, room: int | None = None) -> InstanceInfo:
        req = aws.gang_request(nodes)
        if room is not None:
            fake_aws.limit_placement_group(req.placement_group, instances=room)
        launched.append(req)
        return provider.launch(req)

    def delete_node(info: InstanceInfo, rank: int) -> None:
        node = info.instance_id.split("+")[rank]
        fake_aws.client("ec2", moto_server).terminate_instances(InstanceIds=[node])

    def left() -> tuple[int, int]:
        nodes = [
            i
            for req in launched
            for i in aws.of_run(moto_server, req.run_id)
            if i["State"]["Name"] not in ("terminated", "shutting-down")
        ]
        groups = [req for req in launched if aws.group(moto_server, req.placement_group)]
        return len(nodes), len(groups)

    return Cloud(
        provider, launch, delete_node, left, ended_by="by the control plane", lists_a_lost_gang=True
    )


def _gcp(api: FakeComputeApi) -> Cloud:
    provider = GcpProvider(
        project=api.project,
        region=gcp.REGION,
        api_endpoint=api.url,
        credentials=AnonymousCredentials(),
        service_account=gcp.RUNNER_SA,
        policy_retry_s=0.0,  # a policy in use: retried at every call
        policy_sweep_s=0.0,  # left-behind policies: at every listing
    )

    def launch(nodes: int = 2, room: int | None = None) -> InstanceInfo:
        if room is not None:
            api.exhaust(gcp.ZONE_A, after=room)
        info: InstanceInfo = gcp.launch(provider, nodes=nodes)
        return info

    def delete_node(info: InstanceInfo, rank: int) -> None:
        operator = compute_v1.InstancesClient(
            credentials=AnonymousCredentials(), client_options=ClientOptions(api_endpoint=api.url)
        )
        name = info.instance_id.split("+")[rank].split("/", 1)[1]
        operator.delete(project=api.project, zone=gcp.ZONE_A, instance=name)

    def left() -> tuple[int, int]:
        return len(api.instances()), len(api.resource_policies())

    return Cloud(
        provider, launch, delete_node, left, ended_by="deleted by trainbot", lists_a_lost_gang=False
    )


@pytest.fixture(params=["aws", "gcp"])
def cloud(request: pytest.FixtureRequest) -> Iterator[Cloud]:
    if request.param == "aws":
        yield _aws(request.getfixturevalue("moto_server"))
        return
    with FakeComputeApi() as api:
        yield _gcp(api)


def _settle(cloud: Cloud, info: InstanceInfo) -> tuple[int, int]:
    """Poll as reconcile does (status, then listing) until nothing of the gang is left."""
    for _ in range(10):
        cloud.provider.status(info.instance_id)
        cloud.provider.list_instances()
        if cloud.left() == (0, 0):
            break
    return cloud.left()


def test_a_gang_is_one_instance_that_lists_once(cloud: Cloud) -> None:
    info = cloud.launch(nodes=3)
    assert len(info.instance_id.split("+")) == 3 and info.address
    running = wait_for_state(cloud.provider, info.instance_id, {InstanceState.RUNNING})
    assert running.instance_id == info.instance_id
    listed = [i for i in cloud.provider.list_instances() if i.run_id == info.run_id]
    assert [(i.instance_id, i.address, i.zone) for i in listed] == [
        (info.instance_id, info.address, info.zone)
    ]
    assert cloud.left() == (3, 1), "a running gang keeps its placement"
    cloud.provider.terminate(info.instance_id)


def test_a_node_deleted_from_outside_loses_the_gang(cloud: Cloud) -> None:
    info = cloud.launch(nodes=2)
    wait_for_state(cloud.provider, info.instance_id, {InstanceState.RUNNING})
    cloud.delete_node(info, 1)
    lost = cloud.provider.status(info.instance_id)
    assert lost.state is InstanceState.LOST and lost.exit_code == EXIT_PREEMPTED
    second = info.instance_id.split("+")[1]
    assert f"node 1 ({second})" in lost.reason and "outside trainbot" in lost.reason
    assert lost.state.is_terminal()
    listed = [i for i in cloud.provider.list_instances() if i.instance_id == info.instance_id]
    assert [i.state for i in listed] == [InstanceState.LOST] * cloud.lists_a_lost_gang
    cloud.provider.terminate(info.instance_id)


def test_terminating_a_gang_ends_every_node_and_its_placement(cloud: Cloud) -> None:
    info = cloud.launch(nodes=2)
    cloud.provider.terminate(info.instance_id)
    ended = wait_for_state(cloud.provider, info.instance_id, {InstanceState.TERMINATED})
    assert ended.state is InstanceState.TERMINATED and cloud.ended_by in ended.reason
    assert _settle(cloud, info) == (0, 0)
    cloud.provider.terminate(info.instance_id)  # again: nothing left to end, not an error
