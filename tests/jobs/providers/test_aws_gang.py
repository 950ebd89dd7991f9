"""Multi-node attempts on AWS: a gang of instances in one cluster placement group.

Everything goes to moto's server over HTTP; its placement groups are the fake's own
(moto has none: ``tests/fakes/moto_server.py``), and a cluster group without room for
the next node is how a gang's launch is made to fail halfway. Service Quotas and the
denied dry run go through botocore's Stubber, as in ``test_aws.py``.
What every cloud's gang does alike (one instance listed once, lost with a node, ended
whole) is in ``test_gang_contract.py``.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import shlex
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from fnmatch import fnmatchcase
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber

from jobs.providers import base, gang
from jobs.providers.aws import IAM_ACTIONS, AwsProvider
from jobs.providers.aws.placement import TAG_CREATED_AT
from jobs.providers.base import (
    CapacityError,
    InstanceState,
    LaunchRequest,
    ProviderPermissionError,
    ResourceRequest,
)
from tests.fakes import aws as fake
from tests.fakes.aws import stub
from tests.jobs.providers.contract import launch_request, wait_for_state
from tests.paths import ROOT

REGION = "us-east-1"
ZONE = "us-east-1b"
A10G = ResourceRequest(cloud="aws", region=REGION, accelerator_type="A10G", accelerator_count=1)
WORKLOAD = ["trainbot-runner", "exec", "--", "python", "train.py"]
G_SPOT, G_ON_DEMAND = "L-3819A6DF", "L-DB2E81BA"


def gang_request(nodes: int = 2, *, key: str | None = None, zone: str = ZONE) -> LaunchRequest:
    """A launch as the service layer builds one for ``resources.instances=nodes``, with
    an attempt id of its own (the placement group is named after it)."""
    req = launch_request(
        replace(A10G, instances=nodes),
        WORKLOAD,
        zone=zone,
        attempt_id=f"att-{uuid.uuid4().hex[:10]}",
        key=key,
        env={"TRAINBOT_TOKEN": "tok-secret"},
    )
    return replace(req, nodes=nodes)


def described(url: str, ids: list[str]) -> list[dict[str, Any]]:
    """The instances as EC2 describes them, in the order of ``ids``."""
    pages = fake.client("ec2", url).get_paginator("describe_instances").paginate(InstanceIds=ids)
    found = {i["InstanceId"]: i for p in pages for r in p["Reservations"] for i in r["Instances"]}
    return [found[i] for i in ids]


def of_run(url: str, run_id: str) -> list[dict[str, Any]]:
    pages = (
        fake.client("ec2", url)
        .get_paginator("describe_instances")
        .paginate(Filters=[{"Name": f"tag:{base.TAG_RUN_ID}", "Values": [run_id]}])
    )
    return [i for p in pages for r in p["Reservations"] for i in r["Instances"]]


def boot_env(url: str, instance_id: str) -> dict[str, str]:
    """The runner's environment as the instance's user data writes it."""
    answer = fake.client("ec2", url).describe_instance_attribute(
        InstanceId=instance_id, Attribute="userData"
    )
    script = base64.b64decode(answer["UserData"]["Value"]).decode()
    return {
        m[1]: shlex.split(m[2])[0] if m[2] else ""
        for m in re.finditer(r"^(TRAINBOT_[A-Z_]+)=(.*)$", script, re.M)
    }


def group(url: str, name: str) -> dict[str, Any] | None:
    """The placement group of that name, or None when EC2 has none."""
    try:
        found = fake.client("ec2", url).describe_placement_groups(GroupNames=[name])
    except ClientError as exc:
        assert exc.response["Error"]["Code"] == "InvalidPlacementGroup.Unknown"
        return None
    [only] = found["PlacementGroups"]
    return dict(only)


def tags(item: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in item.get("Tags") or ()}


# -- launch ---------------------------------------------------------------------------------


def test_a_gang_launches_in_one_cluster_placement_group(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    aws = make_aws()
    assert aws.capabilities.gang_placement == "cluster placement group"
    req = gang_request()
    info = aws.launch(req)

    first, second = info.instance_id.split("+")
    node0, node1 = described(moto["url"], [first, second])
    assert info.instance_id == f"{first}+{second}" and first != second
    assert (info.zone, info.run_id, info.attempt_id) == (ZONE, req.run_id, req.attempt_id)
    assert info.address == node0["PrivateIpAddress"], "the gang is reached at node 0"
    for node in (node0, node1):
        assert node["Placement"] == {
            "AvailabilityZone": ZONE,
            "GroupName": req.placement_group,
            "Tenancy": "default",
        }
        assert node["InstanceType"] == "g5.xlarge" and node["InstanceLifecycle"] == "spot"
    pg = group(moto["url"], req.placement_group)
    assert pg is not None and pg["Strategy"] == "cluster"
    assert tags(pg)[base.TAG_MANAGED] == "true"
    assert tags(pg)[base.TAG_ATTEMPT_ID] == req.attempt_id

    # How the nodes find each other: node 0's private address, in node 1's environment.
    env0, env1 = boot_env(moto["url"], first), boot_env(moto["url"], second)
    assert env1["TRAINBOT_MASTER_ADDR"] == node0["PrivateIpAddress"]
    assert (env1["TRAINBOT_NODE_RANK"], env1["TRAINBOT_NNODES"]) == ("1", "2")
    assert env1["TRAINBOT_MASTER_PORT"] == "29500"
    assert (env0["TRAINBOT_NODE_RANK"], env0["TRAINBOT_MASTER_ADDR"]) == ("0", "127.0.0.1")
    # Each node its own token: node 0 the attempt's, node 1 one derived from it.
    assert env0["TRAINBOT_TOKEN"] == "tok-secret"
    assert env1["TRAINBOT_TOKEN"] == gang.node_token("tok-secret", req.attempt_id, 1)
    assert "tok-secret" not in str(env1)

    # Each node its own idempotency key and node tags.
    assert node0["ClientToken"] == req.idempotency_key
    assert node1["ClientToken"] == f"{req.idempotency_key}-n1"
    assert (tags(node0)[base.TAG_NODE], tags(node1)[base.TAG_NODE]) == ("0", "1")
    assert tags(node0)[base.TAG_NODES] == tags(node1)[base.TAG_NODES] == "2"
    aws.terminate(info.instance_id)


def test_a_single_node_launch_has_its_address_and_no_placement_group(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    aws = make_aws()
    req = gang_request(nodes=1)
    info = aws.launch(req)
    [inst] = described(moto["url"], [info.instance_id])
    assert "+" not in info.instance_id and info.address == inst["PrivateIpAddress"]
    assert inst["Placement"]["GroupName"] == "" and base.TAG_NODE not in tags(inst)
    assert group(moto["url"], req.placement_group) is None
    aws.terminate(info.instance_id)
    assert group(moto["url"], req.placement_group) is None


def test_a_relaunch_after_a_crash_adopts_the_gang(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    """Killed after RunInstances, before the database write: the retried launch (a new
    process, nothing remembered) finds both nodes and the group, and starts nothing."""
    req = gang_request()
    before = make_aws().launch(req)
    after = make_aws().launch(req)
    assert after.instance_id == before.instance_id
    assert after.address == before.address
    assert len(of_run(moto["url"], req.run_id)) == 2
    assert group(moto["url"], req.placement_group) is not None
    make_aws().terminate(after.instance_id)


def test_long_keys_stay_within_ec2s_client_token(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    """Node 1's key is the attempt's plus "-n1": past 64 characters it is hashed, the
    same way each time, so the relaunch still adopts it."""
    aws = make_aws()
    req = gang_request(key="k" * 62)
    info = aws.launch(req)
    node0, node1 = described(moto["url"], info.instance_id.split("+"))
    assert node0["ClientToken"] == "k" * 62
    assert node1["ClientToken"].startswith("sha256-") and len(node1["ClientToken"]) <= 64
    assert make_aws().launch(req).instance_id == info.instance_id
    aws.terminate(info.instance_id)


def test_a_gang_launches_in_another_region_under_a_qualified_id(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    west = "us-west-2"
    images = fake.client("ec2", moto["url"]).describe_images(Owners=["amazon"])["Images"]
    there = fake.client("ec2", moto["url"], region=west).describe_images(Owners=["amazon"])
    common = sorted({i["ImageId"] for i in images} & {i["ImageId"] for i in there["Images"]})
    aws = make_aws(image_id=common[0], instance_profile=None)
    req = replace(gang_request(zone="us-west-2a"), request=replace(A10G, region=west, instances=2))
    info = aws.launch(req)
    assert re.fullmatch(r"us-west-2/i-[0-9a-f]+\+i-[0-9a-f]+", info.instance_id)
    assert wait_for_state(aws, info.instance_id, {InstanceState.RUNNING}).state is (
        InstanceState.RUNNING
    )
    assert [i.instance_id for i in aws.list_instances() if i.run_id == req.run_id] == [
        info.instance_id
    ]
    aws.terminate(info.instance_id)
    assert aws.status(info.instance_id).state is InstanceState.TERMINATED


# -- all or nothing -------------------------------------------------------------------------


def test_no_room_for_node_1_terminates_node_0_and_tries_the_next_zone(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    aws = make_aws()
    req = gang_request()
    fake.limit_placement_group(req.placement_group, instances=1)
    with caplog.at_level(logging.WARNING), pytest.raises(CapacityError) as refused:
        aws.launch(req)
    assert refused.value.zone == ZONE and "next zone" in str(refused.value)
    [node0] = of_run(moto["url"], req.run_id)
    assert tags(node0)[base.TAG_NODE] == "0", "node 1 never started"
    assert node0["State"]["Name"] == "terminated"
    assert tags(node0)["trainbot-terminated-by"] == "control-plane"
    assert f"terminating {node0['InstanceId']}" in caplog.text
    assert group(moto["url"], req.placement_group) is None, "the failed gang's group is gone"


def test_no_room_for_node_0_launches_nothing(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    req = gang_request()
    fake.limit_placement_group(req.placement_group, instances=0)
    with pytest.raises(CapacityError):
        make_aws().launch(req)
    assert of_run(moto["url"], req.run_id) == []
    assert group(moto["url"], req.placement_group) is None


# -- status, listing, termination -----------------------------------------------------------


def test_a_group_still_in_use_is_deleted_on_a_later_pass(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """EC2 keeps a group while a node in it is shutting down; the terminate logs that and
    returns, and the next listing deletes the group."""
    aws = make_aws()
    req = gang_request()
    info = aws.launch(req)
    first, second = info.instance_id.split("+")
    fake.begin_shutdown(second)
    with caplog.at_level(logging.INFO, "jobs.providers.aws"):
        aws.terminate(info.instance_id)
    assert described(moto["url"], [first])[0]["State"]["Name"] == "terminated"
    assert group(moto["url"], req.placement_group) is not None
    assert "still holds instances that are shutting down" in caplog.text
    aws.list_instances()
    assert group(moto["url"], req.placement_group) is not None, "still shutting down"
    fake.finish_shutdown(second)
    aws.list_instances()
    assert group(moto["url"], req.placement_group) is None


def test_the_sweep_spares_a_young_empty_group_and_others_groups(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    """A trainbot group with no instance is deleted only after the grace (its first node
    may be launching now); a group that is not trainbot's is never touched."""
    ec2 = fake.client("ec2", moto["url"])
    created = datetime(2030, 1, 1, tzinfo=timezone.utc)
    name = f"trainbot-att-{uuid.uuid4().hex[:10]}"
    theirs = f"theirs-{uuid.uuid4().hex[:10]}"
    ec2.create_placement_group(
        GroupName=name,
        Strategy="cluster",
        TagSpecifications=[
            {
                "ResourceType": "placement-group",
                "Tags": [
                    {"Key": base.TAG_MANAGED, "Value": "true"},
                    {"Key": base.TAG_ATTEMPT_ID, "Value": name.removeprefix("trainbot-")},
                    {"Key": TAG_CREATED_AT, "Value": created.isoformat()},
                ],
            }
        ],
    )
    ec2.create_placement_group(GroupName=theirs, Strategy="cluster")
    make_aws(clock=lambda: created + timedelta(minutes=10)).list_instances()
    assert group(moto["url"], name) is not None
    make_aws(clock=lambda: created + timedelta(hours=2)).list_instances()
    assert group(moto["url"], name) is None and group(moto["url"], theirs) is not None


# -- quota and permissions ------------------------------------------------------------------


def test_quota_counts_every_node(
    make_aws: Callable[..., AwsProvider], stubbers: list[Stubber]
) -> None:
    aws = make_aws()
    quotas = stub(stubbers, aws.client("service-quotas"))

    def limits(spot: float) -> None:
        for code, value in ((G_SPOT, spot), (G_ON_DEMAND, 0)):
            quotas.add_response(
                "get_service_quota",
                fake.quota(code, value),
                {"ServiceCode": "ec2", "QuotaCode": code},
            )

    limits(10_000)
    one = aws.quota(A10G)
    limits(one.used + 4)  # room for exactly one g5.xlarge
    fits = aws.quota(A10G)
    limits(one.used + 4)
    two = aws.quota(replace(A10G, instances=2))
    quotas.assert_no_pending_responses()
    assert (one.needed, fits.ok) == (4, True)
    assert (two.needed, two.ok) == (8, False)
    assert "2 × g5.xlarge need 8" in two.detail
    assert f"--desired-value {int(one.used) + 8}" in two.remedy


def test_the_permission_probe_asks_for_the_placement_group(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any], stubbers: list[Stubber]
) -> None:
    aws = make_aws()
    aws.check_launch_permissions(replace(A10G, instances=2), zone=ZONE)  # moto allows it
    assert group(moto["url"], "trainbot-permission-check") is None, "a dry run creates nothing"
    ec2 = stub(stubbers, aws.client("ec2"))  # the AMI's root is known by now
    ec2.add_client_error("run_instances", "DryRunOperation", "Request would have succeeded")
    ec2.add_client_error(
        "create_placement_group", "UnauthorizedOperation", "You are not authorized"
    )
    with pytest.raises(ProviderPermissionError) as denied:
        aws.check_launch_permissions(replace(A10G, instances=2), zone=ZONE)
    assert denied.value.permission == "ec2:CreatePlacementGroup"
    assert "deploy/aws/iam-policy.json" in str(denied.value)
    ec2.assert_no_pending_responses()
    ec2.add_client_error("run_instances", "DryRunOperation", "Request would have succeeded")
    aws.check_launch_permissions(A10G, zone=ZONE)  # one node: no group to ask about
    ec2.assert_no_pending_responses()


def test_the_policy_grants_every_call_a_gang_makes(
    make_aws: Callable[..., AwsProvider], moto: dict[str, Any]
) -> None:
    session = boto3.session.Session()
    called: set[str] = set()
    session.events.register(
        "before-parameter-build", lambda event_name, **_: called.add(event_name.split(".", 1)[1])
    )
    aws = make_aws(session=session)
    aws.check_launch_permissions(replace(A10G, instances=2), zone=ZONE)
    info = aws.launch(gang_request())
    aws.status(info.instance_id)
    aws.list_instances()
    aws.terminate(info.instance_id)
    assert {
        "ec2.CreatePlacementGroup",
        "ec2.DescribePlacementGroups",
        "ec2.DeletePlacementGroup",
    } <= called
    doc = json.loads((ROOT / "deploy/aws/iam-policy.json").read_text())
    statements = doc["Statement"]

    def listed(value: str | list[str]) -> list[str]:
        return [value] if isinstance(value, str) else list(value)

    for op in sorted(called):
        action = IAM_ACTIONS[op]
        if action:
            assert any(fnmatchcase(action, a) for s in statements for a in listed(s["Action"])), (
                f"{action} is not granted"
            )
    for s in statements:
        if {"ec2:CreatePlacementGroup", "ec2:DeletePlacementGroup"} & set(listed(s["Action"])):
            assert listed(s["Resource"]) == [
                "arn:aws:ec2:REGION:ACCOUNT_ID:placement-group/trainbot-*"
            ]
            tag_conditions = s["Condition"]["StringEquals"]
            assert "true" in (
                tag_conditions.get(f"aws:RequestTag/{base.TAG_MANAGED}"),
                tag_conditions.get(f"aws:ResourceTag/{base.TAG_MANAGED}"),
            )
