"""Multi-node attempts on GCP (issue 16): a gang's nodes in one zone under one compact
placement policy, launched all or none, seen by the control plane as one instance. The
real google-cloud-compute client against the local fake Compute Engine API, as in
test_gcp.py.
What every cloud's gang does alike (one instance listed once, lost with a node, ended
whole) is in ``test_gang_contract.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from jobs.providers.base import TAG_NODE, TAG_NODES, CapacityError, InstanceState
from jobs.providers.gang import MASTER_PORT, node_token
from jobs.providers.gcp import GcpProvider, instance_name
from tests.fakes.gce_api import FakeComputeApi
from tests.jobs.providers.contract import wait_for_state
from tests.jobs.providers.test_gcp import A100, REGION, RUNNER_SA, TOKEN, ZONE_A, launch

POLICY = "trainbot-a-1"  # LaunchRequest.placement_group of attempt "a-1"
NODE_0, NODE_1 = instance_name("r-1", "a-1"), instance_name("r-1", "a-1", node=1)
GANG = f"{ZONE_A}/{NODE_0}+{ZONE_A}/{NODE_1}"


@pytest.fixture
def fake() -> Iterator[FakeComputeApi]:
    with FakeComputeApi() as api:
        yield api


@pytest.fixture
def make_gcp(fake: FakeComputeApi) -> Callable[..., GcpProvider]:
    def build(**options: Any) -> GcpProvider:
        options.setdefault("policy_retry_s", 0.0)  # a policy in use: retried at every call
        options.setdefault("policy_sweep_s", 0.0)  # left-behind policies: at every listing
        return GcpProvider(
            project=fake.project,
            region=REGION,
            api_endpoint=fake.url,
            credentials=AnonymousCredentials(),
            service_account=RUNNER_SA,
            **options,
        )

    return build


@pytest.fixture
def gcp(make_gcp: Callable[..., GcpProvider]) -> GcpProvider:
    return make_gcp()


def node(fake: FakeComputeApi, name: str) -> dict[str, Any]:
    inst = fake.instance(ZONE_A, name)
    assert inst is not None, f"{name} does not exist"
    return inst


def env_of(inst: dict[str, Any]) -> dict[str, str]:
    """What the startup script hands the runner: the trainbot-env metadata item."""
    items = {i["key"]: i["value"] for i in inst["metadata"]["items"]}
    return dict(json.loads(items["trainbot-env"]))


def until_gone(gcp: GcpProvider, fake: FakeComputeApi, instance_id: str) -> None:
    """Poll as the control plane does until the gang's nodes and policy have gone."""
    for _ in range(10):
        gcp.status(instance_id)
        if not fake.instances() and not fake.resource_policies():
            return
    raise AssertionError(
        f"still there: {[i['name'] for i in fake.instances()]}, "
        f"{[p['name'] for p in fake.resource_policies()]}"
    )


def test_a_gang_is_its_nodes_in_one_zone_under_one_compact_policy(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    assert gcp.capabilities.gang_placement == "compact placement policy"
    info = launch(gcp, nodes=2)
    assert info.instance_id == GANG
    assert (info.zone, info.state, info.attempt_id) == (ZONE_A, InstanceState.RUNNING, "a-1")

    [policy] = fake.resource_policies()
    assert policy["name"] == POLICY and policy["region"].endswith(f"/regions/{REGION}")
    assert policy["groupPlacementPolicy"] == {"collocation": "COLLOCATED", "vmCount": 2}
    # The insert's regional operation was waited for, as instances' zonal ones are.
    assert fake.calls("POST", rf"/regions/{REGION}/operations/[^/]+/wait$")

    first, second = node(fake, NODE_0), node(fake, NODE_1)
    assert len(fake.instances()) == 2
    for rank, inst in enumerate((first, second)):
        assert inst["zone"].endswith(f"/zones/{ZONE_A}")
        assert inst["resourcePolicies"] == [policy["selfLink"]]
        assert (inst["labels"][TAG_NODE], inst["labels"][TAG_NODES]) == (str(rank), "2")
    addresses = [i["networkInterfaces"][0]["networkIP"] for i in (first, second)]
    assert len(set(addresses)) == 2 and info.address == addresses[0]

    # Node 1 reaches node 0 at its private address; node 0 listens on its own loopback.
    wanted = {
        "TRAINBOT_MASTER_ADDR": addresses[0],
        "TRAINBOT_MASTER_PORT": str(MASTER_PORT),
        "TRAINBOT_NODE_RANK": "1",
        "TRAINBOT_NNODES": "2",
    }
    assert {k: env_of(second).get(k) for k in wanted} == wanted
    assert env_of(first)["TRAINBOT_NODE_RANK"] == "0"
    assert env_of(first)["TRAINBOT_MASTER_ADDR"] == "127.0.0.1"
    # Each node its own token (node 0 the attempt's), none in the instance's repr.
    assert env_of(first)["TRAINBOT_TOKEN"] == TOKEN and TOKEN not in repr(info)
    assert env_of(second)["TRAINBOT_TOKEN"] == node_token(TOKEN, "a-1", 1)
    assert TOKEN not in str(env_of(second))


def test_a_single_instance_carries_its_private_address_and_no_policy(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    info = launch(gcp)
    [inst] = fake.instances()
    assert info.instance_id == f"{ZONE_A}/{NODE_0}"  # the name a one-node attempt always had
    assert info.address == inst["networkInterfaces"][0]["networkIP"] != ""
    assert "resourcePolicies" not in inst and fake.resource_policies() == []
    assert not fake.calls("POST", r"/resourcePolicies$")


def test_terminating_a_gang_deletes_every_node_and_then_its_policy(
    gcp: GcpProvider, fake: FakeComputeApi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    info = launch(gcp, nodes=2)
    gcp.terminate(info.instance_id)
    deletes = {s.path.rsplit("/", 1)[1] for s in fake.calls("DELETE", r"/instances/")}
    assert deletes == {NODE_0, NODE_1}
    ended = wait_for_state(gcp, info.instance_id, {InstanceState.TERMINATED})
    assert "deleted by trainbot" in ended.reason
    until_gone(gcp, fake, info.instance_id)
    # Refused while the nodes were still going, deleted by a later call once they had.
    tries = [s.status for s in fake.calls("DELETE", rf"/resourcePolicies/{POLICY}$")]
    assert tries[0] == 400 and tries[-1] == 200
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    gcp.terminate(info.instance_id)  # again: nothing left, no error


def test_a_policy_still_in_use_is_not_tried_at_every_status_poll(
    make_gcp: Callable[..., GcpProvider], fake: FakeComputeApi
) -> None:
    gcp = make_gcp(policy_retry_s=3600.0)
    info = launch(gcp, nodes=2)
    gcp.terminate(info.instance_id)
    for _ in range(5):
        gcp.status(info.instance_id)
    assert fake.instances() == [] and len(fake.resource_policies()) == 1
    assert len(fake.calls("DELETE", r"/resourcePolicies/")) == 1  # the try at terminate
    gcp.terminate(info.instance_id)  # any terminate tries every waiting policy at once
    assert fake.resource_policies() == []


def test_a_restarted_control_plane_terminates_a_gang_and_its_policy(
    gcp: GcpProvider, make_gcp: Callable[..., GcpProvider], fake: FakeComputeApi
) -> None:
    info = launch(gcp, nodes=2)
    restarted = make_gcp()  # no memory of the launch: the nodes name their policy
    restarted.terminate(info.instance_id)
    until_gone(restarted, fake, info.instance_id)


def test_a_node_without_capacity_deletes_the_others_and_raises_capacity_error(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    fake.exhaust(ZONE_A, after=1)  # room for node 0, not for node 1
    with pytest.raises(CapacityError) as stockout:
        launch(gcp, nodes=2)
    assert stockout.value.zone == ZONE_A and "ZONE_RESOURCE_POOL_EXHAUSTED" in str(stockout.value)
    assert fake.instance(ZONE_A, NODE_1) is None
    assert [s.path.rsplit("/", 1)[1] for s in fake.calls("DELETE", r"/instances/")] == [NODE_0]
    # The zone is ranked out for the next attempt, and nothing of this one stays behind.
    assert not next(z for z in gcp.capacity(A100) if z.zone == ZONE_A).available
    for _ in range(5):
        if not fake.instances() and not fake.resource_policies():
            break
        gcp.list_instances()  # reconcile's calls finish what the failed launch left
    assert fake.instances() == [] and fake.resource_policies() == []


def test_list_instances_shows_a_gang_once(gcp: GcpProvider, fake: FakeComputeApi) -> None:
    gang = launch(gcp, nodes=2)
    single = launch(gcp, attempt="a-2")
    listed = gcp.list_instances()
    assert [i.instance_id for i in listed] == [gang.instance_id, single.instance_id]
    assert listed[0].state is InstanceState.RUNNING and listed[0].attempt_id == "a-1"
    assert listed[0].tags[TAG_NODES] == "2"


def test_quota_counts_every_instance_of_the_request(gcp: GcpProvider) -> None:
    eight = dataclasses.replace(A100, accelerator_count=8)
    one = gcp.quota(eight)
    two = gcp.quota(dataclasses.replace(eight, instances=2))
    assert (one.needed, one.ok) == (8.0, True)  # PREEMPTIBLE_NVIDIA_A100_GPUS: 8
    assert (two.needed, two.ok) == (16.0, False)
    assert "2 instances of 8 GPUs each" in two.detail
    assert "PREEMPTIBLE_NVIDIA_A100_GPUS" in two.remedy and "16" in two.remedy


def test_launching_a_gang_again_adopts_it_and_creates_nothing(
    gcp: GcpProvider, make_gcp: Callable[..., GcpProvider], fake: FakeComputeApi
) -> None:
    first = launch(gcp, nodes=2)
    again = launch(gcp, nodes=2)
    after_crash = launch(make_gcp(), nodes=2)
    assert first.instance_id == again.instance_id == after_crash.instance_id == GANG
    assert after_crash.address == first.address
    assert len(fake.instances()) == 2 and len(fake.resource_policies()) == 1
    # The nodes' inserts repeat their request ids; the policy's name is its idempotency.
    inserts = fake.calls("POST", rf"/zones/{ZONE_A}/instances$")
    assert len({s.query["requestId"] for s in inserts}) == 2 and len(inserts) == 6
    assert [s.status for s in fake.calls("POST", r"/resourcePolicies$")] == [200, 409, 409]


# -- policies left behind ----------------------------------------------------------------


def operator_client(fake: FakeComputeApi, kind: type[Any]) -> Any:
    """A client of someone else's (the console, gcloud), not the provider's."""
    return kind(
        credentials=AnonymousCredentials(), client_options=ClientOptions(api_endpoint=fake.url)
    )


def policy_deletes(fake: FakeComputeApi, name: str) -> list[int]:
    return [s.status for s in fake.calls("DELETE", rf"/resourcePolicies/{name}$")]


def test_a_policy_left_behind_by_a_restart_is_deleted_by_listing_once_it_is_old(
    gcp: GcpProvider, make_gcp: Callable[..., GcpProvider], fake: FakeComputeApi
) -> None:
    launch(gcp, nodes=2)
    # Both nodes go from outside while no control plane is there to delete the policy.
    operator = operator_client(fake, compute_v1.InstancesClient)
    for name in (NODE_0, NODE_1):
        operator.delete(project=fake.project, zone=ZONE_A, instance=name)
    restarted = make_gcp()  # never saw the launch, and no node names the policy now
    for _ in range(10):
        if restarted.list_instances() == [] and not fake.instances():
            break
    assert fake.instances() == []
    restarted.list_instances()
    # Young: it could be a launch's whose nodes are not inserted yet.
    assert [p["name"] for p in fake.resource_policies()] == [POLICY]
    assert policy_deletes(fake, POLICY) == []
    listed = fake.calls("GET", rf"/regions/{REGION}/resourcePolicies$")
    assert listed and listed[-1].query["filter"] == 'name eq "trainbot-.*"'

    fake.age_policy(REGION, POLICY, timedelta(hours=2))
    assert restarted.list_instances() == []
    assert fake.resource_policies() == [] and policy_deletes(fake, POLICY) == [200]


def test_an_old_policy_that_a_live_gang_lists_is_kept(
    gcp: GcpProvider, make_gcp: Callable[..., GcpProvider], fake: FakeComputeApi
) -> None:
    info = launch(gcp, nodes=2)
    fake.age_policy(REGION, POLICY, timedelta(days=3))
    for provider in (gcp, make_gcp()):
        assert [i.instance_id for i in provider.list_instances()] == [info.instance_id]
    assert len(fake.resource_policies()) == 1 and policy_deletes(fake, POLICY) == []


def test_policies_not_named_trainbot_are_never_touched(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    policies = operator_client(fake, compute_v1.ResourcePoliciesClient)
    for name in ("nightly-batch", "xtrainbot-a-1"):
        policies.insert_unary(
            project=fake.project,
            region=REGION,
            resource_policy_resource=compute_v1.ResourcePolicy(
                name=name,
                group_placement_policy=compute_v1.ResourcePolicyGroupPlacementPolicy(
                    collocation="COLLOCATED", vm_count=2
                ),
            ),
        )
        fake.age_policy(REGION, name, timedelta(days=30))
    gcp.list_instances()
    assert fake.calls("GET", rf"/regions/{REGION}/resourcePolicies$")
    assert len(fake.resource_policies()) == 2 and not fake.calls("DELETE", r"/resourcePolicies/")


def test_the_regions_policies_are_listed_at_most_every_policy_sweep_s(
    make_gcp: Callable[..., GcpProvider], fake: FakeComputeApi
) -> None:
    gcp = make_gcp(policy_sweep_s=600.0, regions=["europe-west4"])
    for _ in range(3):
        gcp.list_instances()
    listed = [s.path for s in fake.calls("GET", r"/resourcePolicies$")]
    assert sorted(listed) == [
        f"/compute/v1/projects/{fake.project}/regions/{r}/resourcePolicies"
        for r in ("europe-west4", REGION)
    ]


def test_a_missing_list_permission_warns_once_and_listing_goes_on(
    gcp: GcpProvider, fake: FakeComputeApi, caplog: pytest.LogCaptureFixture
) -> None:
    info = launch(gcp, nodes=2)
    fake.deny("compute.resourcePolicies.list")
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        assert [i.instance_id for i in gcp.list_instances()] == [info.instance_id]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "compute.resourcePolicies.list" in warning and "trainbotControlPlane" in warning
    assert REGION in warning


def test_node_names_stay_valid_and_distinct() -> None:
    rule = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
    for attempt in ("a-1", "Attempt_" + "X" * 100, "---", "ÄÖ"):
        names = [instance_name("r", attempt, node=rank) for rank in (0, 1, 9, 10, 1023)]
        assert all(rule.fullmatch(n) for n in names), names
        assert len(set(names)) == len(names)
    assert instance_name("r", "a-1", node=1).startswith("trainbot-a-1-n1-")
