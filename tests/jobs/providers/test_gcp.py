"""The GCP provider: the real google-cloud-compute client over REST against a local fake
Compute Engine API (tests/fakes/gce_api.py), then what preflight, the spot lifecycle,
idempotency, permissions and the startup script need from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.auth.credentials import AnonymousCredentials

from jobs.preflight import (
    CapacityCheck,
    DataLocalityCheck,
    PreflightContext,
    QuotaCheck,
    Status,
    resource_request,
    run_preflight,
)
from jobs.process.settings import load_settings
from jobs.providers import make_provider
from jobs.providers.base import (
    TAG_ATTEMPT_ID,
    TAG_MANAGED,
    TAG_OWNER,
    TAG_RUN_ID,
    BucketLocation,
    CapacityError,
    InstanceNotFound,
    InstanceState,
    Provider,
    ProviderError,
    ProviderPermissionError,
    QuotaExceeded,
    ResourceRequest,
)
from jobs.providers.gcp import (
    PRICES_PATH,
    REQUIRED_PERMISSIONS,
    STARTUP_SCRIPT_PATH,
    GcpProvider,
    from_settings,
    instance_name,
    label_value,
    make,
    prices_from_catalog,
)
from jobs.spec import JobSpec, parse_spec
from tests.fakes.gce_api import FakeComputeApi
from tests.jobs.boot import gcp_boot_env, runner_venv
from tests.jobs.providers.contract import ProviderContract, launch_request, wait_for_state
from tests.paths import ROOT

REGION = "us-central1"
ZONE_A, ZONE_B, ZONE_C, ZONE_F = (f"{REGION}-{z}" for z in "abcf")
RUNNER_SA = "trainbot-runner@trainbot-test.iam.gserviceaccount.com"
A100 = ResourceRequest(
    cloud="gcp", region=REGION, accelerator_type="A100", accelerator_count=1, spot=True
)
WORKLOAD = ["trainbot-runner", "exec", "--", "python", "train.py"]
TOKEN = "tbt-attempt-secret-7f3a9c"


@pytest.fixture
def fake() -> Iterator[FakeComputeApi]:
    with FakeComputeApi(buckets={"data-us": "US-CENTRAL1", "data-eu": "EUROPE-WEST4"}) as api:
        yield api


@pytest.fixture
def make_gcp(fake: FakeComputeApi) -> Callable[..., GcpProvider]:
    def build(**options: Any) -> GcpProvider:
        options.setdefault("service_account", RUNNER_SA)
        options.setdefault("policy_retry_s", 0.0)  # a gang's policy: retried at every call
        return GcpProvider(
            project=fake.project,
            region=REGION,
            api_endpoint=fake.url,
            credentials=AnonymousCredentials(),
            **options,
        )

    return build


@pytest.fixture
def gcp(make_gcp: Callable[..., GcpProvider]) -> GcpProvider:
    return make_gcp()


def launch(
    provider: GcpProvider, *, zone: str = ZONE_A, attempt: str = "a-1", nodes: int = 1, **kw: Any
) -> Any:
    req = launch_request(
        kw.pop("request", A100),
        WORKLOAD,
        zone=zone,
        run_id=kw.pop("run_id", "r-1"),
        attempt_id=attempt,
        env={"TRAINBOT_TOKEN": TOKEN, "TRAINBOT_RUN_ID": "r-1"},
        **kw,
    )
    return provider.launch(dataclasses.replace(req, nodes=nodes))


def name_of(instance_id: str) -> str:
    return instance_id.split("/", 1)[1]


def gcp_spec(*, data_uri: str | None = None, **resources: Any) -> JobSpec:
    data: dict[str, Any] = {
        "command": "python train.py",
        "resources": {"cloud": "gcp", "region": REGION, "accelerator": "A100:1", **resources},
    }
    if data_uri:
        data["data_uri"] = data_uri
    return parse_spec(data, name="gcp")


def context(tmp_path: Path, spec: JobSpec, provider: Provider) -> PreflightContext:
    return PreflightContext(
        spec=spec,
        run_id="r-pre",
        provider=provider,
        request=resource_request(spec, provider),
        checkpoint_uri="gs://ck/trainbot",
        mtbp_s=6 * 3600.0,
        env={},
        workdir=tmp_path,
    )


# -- the shared contract -----------------------------------------------------------------


class TestGcpContract(ProviderContract):
    @pytest.fixture
    def provider(self, gcp: GcpProvider) -> GcpProvider:
        return gcp

    @pytest.fixture
    def resource_request(self) -> ResourceRequest:
        return A100

    @pytest.fixture
    def workload(self) -> list[str]:
        return WORKLOAD

    @pytest.fixture
    def unknown_instance_id(self) -> str:
        return f"{ZONE_A}/trainbot-never-launched"


def test_the_registry_builds_the_provider(fake: FakeComputeApi) -> None:
    provider = make_provider(
        "gcp",
        project=fake.project,
        zones=[ZONE_C, ZONE_A],
        api_endpoint=fake.url,
        credentials=AnonymousCredentials(),
    )
    assert isinstance(provider, GcpProvider) and isinstance(provider, Provider)
    assert (provider.name, provider.region) == ("gcp", "us-central1")
    assert [z.zone for z in provider.capacity(A100)] == [ZONE_C, ZONE_A]
    with pytest.raises(ProviderError, match="needs a project"):
        make(region=REGION)


# -- quota -------------------------------------------------------------------------------


def test_quota_of_zero_fails_preflight_with_the_metric_to_raise(
    tmp_path: Path, make_gcp: Callable[..., GcpProvider]
) -> None:
    with FakeComputeApi(
        quotas={REGION: {"NVIDIA_A100_GPUS": 0, "PREEMPTIBLE_NVIDIA_A100_GPUS": 0}}
    ) as api:
        provider = GcpProvider(
            project=api.project,
            region=REGION,
            api_endpoint=api.url,
            credentials=AnonymousCredentials(),
        )
        got = QuotaCheck().run(context(tmp_path, gcp_spec(), provider), prior={})
    assert got.status is Status.FAIL
    assert (
        "no PREEMPTIBLE_NVIDIA_A100_GPUS quota, so spot VMs count against NVIDIA_A100_GPUS"
        in got.detail
    )
    assert "0 used + 1 needed > limit 0 GPUs" in got.detail
    assert "request an increase of PREEMPTIBLE_NVIDIA_A100_GPUS in region us-central1" in got.remedy
    assert "--quota-id=PREEMPTIBLE-NVIDIA-A100-GPUS-per-project-region" in got.remedy
    assert "--dimensions=region=us-central1" in got.remedy
    assert "console.cloud.google.com/iam-admin/quotas?project=trainbot-test" in got.remedy
    assert "or raise NVIDIA_A100_GPUS" in got.remedy


def test_spot_uses_preemptible_quota_and_counts_running_instances(gcp: GcpProvider) -> None:
    before = gcp.quota(A100)
    assert before.ok and (before.limit, before.used) == (8, 0)
    assert before.detail.startswith("PREEMPTIBLE_NVIDIA_A100_GPUS in us-central1")
    launch(gcp)
    after = gcp.quota(A100)
    assert after.used == 1
    eight = gcp.quota(
        ResourceRequest(cloud="gcp", region=REGION, accelerator_type="A100", accelerator_count=8)
    )
    assert (
        not eight.ok
        and "PREEMPTIBLE_NVIDIA_A100_GPUS" in eight.remedy
        and "at least 9" in eight.remedy
    )


def test_on_demand_asks_for_the_standard_metric(gcp: GcpProvider) -> None:
    quota = gcp.quota(
        ResourceRequest(
            cloud="gcp", region=REGION, accelerator_type="A100", accelerator_count=1, spot=False
        )
    )
    assert not quota.ok
    assert quota.detail.startswith("NVIDIA_A100_GPUS in us-central1: 0 of 0")
    assert "request an increase of NVIDIA_A100_GPUS" in quota.remedy
    assert "PREEMPTIBLE" not in quota.remedy


def test_the_project_wide_gpu_quota_can_bind() -> None:
    with FakeComputeApi(project_quotas={"GPUS_ALL_REGIONS": 2}) as api:
        provider = GcpProvider(
            project=api.project,
            region=REGION,
            api_endpoint=api.url,
            credentials=AnonymousCredentials(),
        )
        quota = provider.quota(
            ResourceRequest(cloud="gcp", region=REGION, accelerator_type="L4", accelerator_count=4)
        )
    assert not quota.ok and quota.limit == 2
    assert "GPUS_ALL_REGIONS in project trainbot-test: 0 of 2" in quota.detail
    assert "--quota-id=GPUS-ALL-REGIONS-per-project " in quota.remedy
    assert "PREEMPTIBLE_NVIDIA_L4_GPUS in us-central1: 0 of 8" in quota.detail


def test_an_unknown_accelerator_type_is_a_clear_error(gcp: GcpProvider) -> None:
    with pytest.raises(ProviderError, match=r"unknown GCP accelerator type 'TPU-V5'.*A100"):
        gcp.quota(
            ResourceRequest(
                cloud="gcp", region=REGION, accelerator_type="TPU-V5", accelerator_count=1
            )
        )


# -- capacity ----------------------------------------------------------------------------


def test_capacity_in_no_zone_fails_preflight(tmp_path: Path, gcp: GcpProvider) -> None:
    got = CapacityCheck().run(context(tmp_path, gcp_spec(accelerator="H100:8"), gcp), prior={})
    assert got.status is Status.FAIL
    assert "no zone of us-central1 offers" in got.detail
    for zone in (ZONE_A, ZONE_B, ZONE_C, ZONE_F):
        assert f"{zone}: does not offer nvidia-h100-80gb" in got.detail
    assert got.remedy


def test_capacity_ranks_offering_zones_first_and_respects_the_limit_per_instance(
    gcp: GcpProvider,
) -> None:
    zones = gcp.capacity(A100)
    assert [(z.zone, z.available) for z in zones] == [
        (ZONE_A, True),
        (ZONE_C, True),
        (ZONE_F, True),
        (ZONE_B, False),
    ]
    assert all(z.score is None for z in zones)
    eight_t4 = ResourceRequest(
        cloud="gcp",
        region=REGION,
        accelerator_type="T4",
        accelerator_count=8,
        zones=(ZONE_B, "europe-west4-a"),
    )
    assert [(z.zone, z.available, z.detail) for z in gcp.capacity(eight_t4)] == [
        (ZONE_B, False, "offers at most 4 nvidia-tesla-t4 per instance"),
        ("europe-west4-a", False, "not a zone of us-central1"),
    ]


# -- price -------------------------------------------------------------------------------


def test_price_comes_from_the_dated_table(gcp: GcpProvider) -> None:
    table = json.loads(PRICES_PATH.read_text())
    units = table["regions"][REGION]
    expected = 12 * units["vcpu"]["A2"]["spot"] + 85 * units["ram_gb"]["A2"]["spot"]
    expected += units["gpu"]["nvidia-tesla-a100"]["spot"]
    quote = gcp.price(A100, zone=ZONE_A)
    assert quote.spot_usd_per_hour == pytest.approx(expected)
    assert 3.0 < quote.on_demand_usd_per_hour < 4.5  # a2-highgpu-1g lists near $3.67/h
    assert quote.as_of == datetime.fromisoformat(table["as_of"]).replace(tzinfo=timezone.utc)
    assert "a2-highgpu-1g" in quote.source and "us-central1" in quote.source
    elsewhere = gcp.price(A100, zone="asia-east1-a")
    assert "us-central1 figures; asia-east1 is not in the table" in elsewhere.source
    with pytest.raises(ProviderError, match="no machine type c3-standard-8"):
        gcp.price(ResourceRequest(cloud="gcp", region=REGION, instance_type="c3-standard-8"))


def test_the_price_table_is_complete_for_every_builtin_machine(gcp: GcpProvider) -> None:
    for kind, counts in {
        "A100": (1, 2, 4, 8, 16),
        "A100-80GB": (1, 8),
        "H100": (1, 8),
        "L4": (1, 2, 4, 8),
        "T4": (1, 4),
        "V100": (8,),
    }.items():
        for count in counts:
            req = ResourceRequest(
                cloud="gcp", region=REGION, accelerator_type=kind, accelerator_count=count
            )
            quote = gcp.price(req)
            assert 0 < quote.spot_usd_per_hour < quote.on_demand_usd_per_hour, (kind, count)


def test_prices_refresh_from_billing_catalog_skus() -> None:
    def sku(
        description: str, group: str, usage: str, units: int, nanos: int, regions: list[str]
    ) -> dict[str, Any]:
        return {
            "description": description,
            "category": {"resourceFamily": "Compute", "resourceGroup": group, "usageType": usage},
            "serviceRegions": regions,
            "pricingInfo": [
                {
                    "pricingExpression": {
                        "usageUnit": "h",
                        "tieredRates": [
                            {
                                "startUsageAmount": 0,
                                "unitPrice": {
                                    "currencyCode": "USD",
                                    "units": str(units),
                                    "nanos": nanos,
                                },
                            }
                        ],
                    }
                }
            ],
        }

    skus = [
        sku(
            "Nvidia Tesla A100 GPU running in Americas",
            "GPU",
            "OnDemand",
            2,
            933908000,
            ["us-central1", "us-east1"],
        ),
        sku(
            "Nvidia Tesla A100 GPU attached to Spot Preemptible VMs running in Americas",
            "GPU",
            "Preemptible",
            0,
            880000000,
            ["us-central1"],
        ),
        sku(
            "A2 Instance Core running in Americas", "CPU", "OnDemand", 0, 31611000, ["us-central1"]
        ),
        sku(
            "Spot Preemptible A2 Instance Core running in Americas",
            "CPU",
            "Preemptible",
            0,
            9483000,
            ["us-central1"],
        ),
        sku(
            "N1 Predefined Instance Ram running in Americas",
            "RAM",
            "OnDemand",
            0,
            4237000,
            ["us-central1"],
        ),
        sku(
            "Commitment v1: A2 Cpu in Americas for 1 Year",
            "CPU",
            "Commit1Yr",
            0,
            19000000,
            ["us-central1"],
        ),
    ]
    got = prices_from_catalog(skus, regions=["us-central1", "us-east1"])
    assert got["us-central1"]["gpu"]["nvidia-tesla-a100"] == {"on_demand": 2.933908, "spot": 0.88}
    assert got["us-central1"]["vcpu"]["A2"] == {"on_demand": 0.031611, "spot": 0.009483}
    # Entries without both prices are dropped rather than half-filled.
    assert "N1" not in got["us-central1"]["ram_gb"]
    assert got["us-east1"]["gpu"] == {}


# -- data locality -----------------------------------------------------------------------


def test_bucket_regions_from_cloud_storage(
    tmp_path: Path, gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    assert gcp.bucket_location("gs://data-us/train") == BucketLocation.region("us-central1")
    assert gcp.bucket_location("s3://elsewhere/x") is None
    fake.buckets["multi"] = "US"
    multi = gcp.bucket_location("gs://multi/x")
    assert multi is not None and str(multi) == "US"
    assert multi.covers(REGION) and multi.covers("us-east1")  # a US multi-region covers it
    assert not multi.covers("europe-west4")
    fake.buckets["dual"] = "EUR4"
    dual = gcp.bucket_location("gs://dual/x")
    assert dual is not None and str(dual) == "EUR4"
    assert dual.covers("europe-west4") and dual.covers("europe-north1")
    assert not dual.covers("europe-west1") and not dual.covers(REGION)
    got = DataLocalityCheck().run(
        context(tmp_path, gcp_spec(data_uri="gs://data-eu/imagenet"), gcp), prior={}
    )
    assert got.status is Status.FAIL
    assert "is in europe-west4 but the accelerators run in us-central1" in got.detail
    with pytest.raises(ProviderError, match="gs://nope does not exist"):
        gcp.bucket_location("gs://nope/x")
    fake.deny("storage.buckets.get")
    with pytest.raises(ProviderPermissionError, match=r"storage\.buckets\.get") as denied:
        gcp.bucket_location("gs://data-us/train")
    assert denied.value.permission == "storage.buckets.get"


# -- launch and the spot lifecycle -------------------------------------------------------


def test_launch_inserts_a_spot_vm_with_everything_the_runner_needs(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    info = launch(gcp, run_id="Run_42", attempt="Attempt-7", scratch_bytes=30_000_000_000)
    assert info.zone == ZONE_A and info.state is InstanceState.RUNNING
    assert (info.run_id, info.attempt_id) == ("Run_42", "Attempt-7")  # exact, from metadata
    inst = fake.instance(ZONE_A, name_of(info.instance_id))
    assert inst is not None
    assert inst["scheduling"] == {
        "provisioningModel": "SPOT",
        "instanceTerminationAction": "DELETE",
        "onHostMaintenance": "TERMINATE",
        "automaticRestart": False,
    }
    assert inst["machineType"].endswith(f"/zones/{ZONE_A}/machineTypes/a2-highgpu-1g")
    assert [
        (a["acceleratorType"].rsplit("/", 1)[1], a["acceleratorCount"])
        for a in inst["guestAccelerators"]
    ] == [("nvidia-tesla-a100", 1)]
    assert inst["labels"] == {
        TAG_MANAGED: "true",
        TAG_RUN_ID: "run_42",
        TAG_ATTEMPT_ID: "attempt-7",
        TAG_OWNER: "u0test",
        "trainbot-idempotency-key": "run_42-attempt-7",
    }
    metadata = {i["key"]: i["value"] for i in inst["metadata"]["items"]}
    assert metadata["startup-script"] == STARTUP_SCRIPT_PATH.read_text()
    assert json.loads(metadata["trainbot-env"])["TRAINBOT_TOKEN"] == TOKEN
    assert json.loads(metadata["trainbot-command"]) == WORKLOAD
    assert metadata["enable-guest-attributes"] == "TRUE"
    assert metadata["trainbot-scratch-bytes"] == "30000000000"
    assert inst["disks"][0]["boot"] and inst["disks"][0]["autoDelete"]
    assert inst["serviceAccounts"] == [
        {"email": RUNNER_SA, "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
    ]
    assert TOKEN not in json.dumps(info.tags) and TOKEN not in repr(info)


def test_the_spot_lifecycle_preemption_stockout_next_zone_termination(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    zones = [z.zone for z in gcp.capacity(A100) if z.available]
    first = launch(gcp, zone=zones[0], attempt="a-1")
    assert wait_for_state(gcp, first.instance_id, {InstanceState.RUNNING}).reason == "running"

    op = fake.preempt(zones[0], name_of(first.instance_id))
    assert fake.instance(zones[0], name_of(first.instance_id)) is None  # DELETE action
    status = gcp.status(first.instance_id)
    assert status.state is InstanceState.PREEMPTED
    assert status.preempted_at == datetime.fromisoformat(op["insertTime"]).astimezone(timezone.utc)
    assert "preempted (spot capacity reclaimed)" in status.reason
    gcp.terminate(first.instance_id)  # already gone: nothing to do, no error

    fake.exhaust(zones[1])
    with pytest.raises(CapacityError) as stockout:
        launch(gcp, zone=zones[1], attempt="a-2")
    assert stockout.value.zone == zones[1]
    assert zones[1] in str(stockout.value) and "ZONE_RESOURCE_POOL_EXHAUSTED" in str(stockout.value)
    assert not [i for i in fake.instances() if zones[1] in i["zone"]]
    ranked = gcp.capacity(A100)
    assert [z.zone for z in ranked if z.available] == [zones[0], zones[2]]
    assert "ran out of nvidia-tesla-a100" in next(z for z in ranked if z.zone == zones[1]).detail

    third = launch(gcp, zone=[z.zone for z in ranked if z.available][1], attempt="a-3")
    assert third.zone == zones[2]
    assert [i.instance_id for i in gcp.list_instances()] == [third.instance_id]
    gcp.terminate(third.instance_id)
    assert wait_for_state(gcp, third.instance_id, {InstanceState.TERMINATED}).state.is_terminal()
    assert fake.instances() == []


def test_quota_refused_at_insert_is_quota_exceeded(gcp: GcpProvider) -> None:
    eight = ResourceRequest(
        cloud="gcp", region=REGION, accelerator_type="A100", accelerator_count=8
    )
    launch(gcp, request=eight, attempt="a-1")
    with pytest.raises(QuotaExceeded, match="PREEMPTIBLE_NVIDIA_A100_GPUS' exceeded"):
        launch(gcp, request=eight, attempt="a-2")


def test_status_reads_the_runner_exit_code_and_the_boot(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    expected = {
        0: (InstanceState.SUCCEEDED, "exited 0"),
        3: (InstanceState.FAILED, "exited 3"),
        75: (InstanceState.PREEMPTED, "exited 75"),
    }
    for i, (code, (state, words)) in enumerate(expected.items()):
        info = launch(gcp, attempt=f"a-{i}")
        fake.guest_exit(ZONE_A, name_of(info.instance_id), code)
        status = gcp.status(info.instance_id)
        assert (status.state, status.exit_code) == (state, code)
        assert words in status.reason
    booting = launch(gcp, attempt="a-boot")
    fake.set_status(ZONE_A, name_of(booting.instance_id), "STAGING")
    assert gcp.status(booting.instance_id).state is InstanceState.PENDING
    fake.set_status(ZONE_A, name_of(booting.instance_id), "TERMINATED")
    stopped = gcp.status(booting.instance_id)
    assert stopped.state is InstanceState.TERMINATED and "outside trainbot" in stopped.reason


def test_a_restarted_control_plane_still_knows_what_it_deleted(
    gcp: GcpProvider, make_gcp: Callable[..., GcpProvider]
) -> None:
    info = launch(gcp)
    gcp.terminate(info.instance_id)
    later = make_gcp()  # no memory of the deletion: it reads the zone's operations
    assert wait_for_state(later, info.instance_id, {InstanceState.TERMINATED}).reason.startswith(
        "deleted"
    )
    later.terminate(info.instance_id)


def test_malformed_ids_are_not_found(gcp: GcpProvider) -> None:
    for bad in ("i-0123456789abcdef0", "us-central1-a/", "no-zone"):
        with pytest.raises(InstanceNotFound) as e:
            gcp.status(bad)
        assert e.value.instance_id == bad and "ZONE/NAME" in str(e.value)


def test_list_instances_follows_pages_and_skips_unmanaged(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    fake.page_size = 1
    launched = {launch(gcp, zone=z, attempt=f"a-{z}").instance_id for z in (ZONE_A, ZONE_C, ZONE_F)}
    assert {i.instance_id for i in gcp.list_instances()} == launched
    assert len(fake.calls("GET", r"/aggregated/instances$")) >= 3


# -- other regions (issue 12, item 3: region failover) -------------------------------------

EAST = "us-east1"
EAST_B, EAST_C, EAST_D = (f"{EAST}-{z}" for z in "bcd")


@pytest.fixture
def two_regions() -> Iterator[FakeComputeApi]:
    """A project in us-central1 and us-east1, both in the price table; us-east1-c offers
    no A100 (the fake leaves the second zone of each region without one)."""
    zones = {REGION: [ZONE_A, ZONE_B, ZONE_C, ZONE_F], EAST: [EAST_B, EAST_C, EAST_D]}
    with FakeComputeApi(regions=zones) as api:
        yield api


def regional(api: FakeComputeApi, **options: Any) -> GcpProvider:
    """Home in us-central1, with zones configured there only."""
    return GcpProvider(
        project=api.project,
        region=REGION,
        zones=[ZONE_C, ZONE_A],
        api_endpoint=api.url,
        credentials=AnonymousCredentials(),
        service_account=RUNNER_SA,
        **options,
    )


def test_a_request_in_another_region_is_answered_and_launched_there(
    two_regions: FakeComputeApi,
) -> None:
    gcp = regional(two_regions, regions=[EAST])
    east = dataclasses.replace(A100, region=EAST)
    # Quota: that region's metric, read with regions.get for it.
    quota = gcp.quota(east)
    assert quota.ok and quota.detail.startswith(f"PREEMPTIBLE_NVIDIA_A100_GPUS in {EAST}: 0 of 8")
    assert two_regions.calls("GET", rf"/regions/{EAST}$")
    # Capacity: that region's zones (the configured zones are all in the home region).
    assert [(z.zone, z.available) for z in gcp.capacity(east)] == [
        (EAST_B, True),
        (EAST_D, True),
        (EAST_C, False),
    ]
    assert [z.zone for z in gcp.capacity(A100)] == [ZONE_C, ZONE_A]  # home: as configured
    # Price: that region's row of the table.
    units = json.loads(PRICES_PATH.read_text())["regions"][EAST]
    expected = 12 * units["vcpu"]["A2"]["spot"] + 85 * units["ram_gb"]["A2"]["spot"]
    expected += units["gpu"]["nvidia-tesla-a100"]["spot"]
    for quote in (gcp.price(east), gcp.price(A100, zone=EAST_D)):
        assert quote.spot_usd_per_hour == pytest.approx(expected)
        assert f"a2-highgpu-1g, {EAST})" in quote.source
    # Launch without a zone: the first zone of that region that offers the type.
    info = launch(gcp, request=east, zone=None)  # type: ignore[arg-type]
    assert info.zone == EAST_B and info.instance_id == f"{EAST_B}/{name_of(info.instance_id)}"
    inst = two_regions.instance(EAST_B, name_of(info.instance_id))
    assert inst is not None and inst["machineType"].endswith(
        f"/zones/{EAST_B}/machineTypes/a2-highgpu-1g"
    )
    assert gcp.quota(east).used == 1 and gcp.quota(A100).used == 0  # counted there only
    # Status, listing (also by a restarted control plane), termination: there.
    assert wait_for_state(gcp, info.instance_id, {InstanceState.RUNNING}).reason == "running"
    assert [i.instance_id for i in gcp.list_instances()] == [info.instance_id]
    later = regional(two_regions)
    assert [(i.instance_id, i.zone) for i in later.list_instances()] == [(info.instance_id, EAST_B)]
    later.terminate(info.instance_id)
    assert wait_for_state(gcp, info.instance_id, {InstanceState.TERMINATED}).reason.startswith(
        "deleted"
    )
    assert two_regions.instances() == []


def test_a_stockout_in_another_region_moves_to_its_next_zone(
    two_regions: FakeComputeApi,
) -> None:
    gcp = regional(two_regions)
    east = dataclasses.replace(A100, region=EAST)
    two_regions.exhaust(EAST_B)
    with pytest.raises(CapacityError) as stockout:
        launch(gcp, request=east, zone=EAST_B)
    assert stockout.value.zone == EAST_B
    assert [z.zone for z in gcp.capacity(east) if z.available] == [EAST_D]
    info = launch(gcp, request=east, zone=None, attempt="a-2")  # type: ignore[arg-type]
    assert info.zone == EAST_D
    with pytest.raises(ProviderError, match=f"zone {ZONE_A} is not in region {EAST}"):
        launch(gcp, request=east, zone=ZONE_A, attempt="a-3")
    gcp.terminate(info.instance_id)


def test_failover_regions_come_from_settings_and_place_multi_region_buckets(
    tmp_path: Path, fake: FakeComputeApi
) -> None:
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path),
            "TRAINBOT_PUBLIC_URL": "https://trainbot.example.test",
            "TRAINBOT_CHECKPOINT_URI": "gs://ck/trainbot",
            "TRAINBOT_PROVIDER": "gcp",
            "TRAINBOT_GCP_PROJECT": fake.project,
            "TRAINBOT_GCP_REGION": REGION,
            "TRAINBOT_GCP_REGIONS": f"europe-west4, {REGION}",
        }
    )
    assert settings.gcp_regions == ["europe-west4", REGION]
    assert (from_settings(settings).region, from_settings(settings).regions) == (
        REGION,
        ("europe-west4",),
    )
    gcp = regional(fake, regions=["europe-west4"])
    fake.buckets.update({"multi-us": "US", "multi-eu": "EU", "dual": "EUR4"})
    # Each bucket is answered once, with every region it covers, whatever the provider's.
    where = {b: gcp.bucket_location(f"gs://{b}/x") for b in ("multi-us", "multi-eu", "dual")}
    assert {b: w is not None and w.covers(REGION) for b, w in where.items()} == {
        "multi-us": True,
        "multi-eu": False,
        "dual": False,
    }
    assert all(
        w is not None and w.covers("europe-west4") for b, w in where.items() if b != "multi-us"
    )
    assert gcp.bucket_location("gs://data-eu/x") == BucketLocation.region("europe-west4")


# -- idempotency and crash recovery ------------------------------------------------------


def test_a_repeated_insert_with_the_same_request_id_creates_one_instance(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    first = launch(gcp, key="attempt-key")
    again = launch(gcp, key="attempt-key")
    assert again.instance_id == first.instance_id
    inserts = fake.calls("POST", r"/zones/us-central1-a/instances$")
    assert len(inserts) == 2
    assert inserts[0].query["requestId"] == inserts[1].query["requestId"]
    assert len(fake.instances()) == 1


def test_a_crashed_control_plane_adopts_the_instance_by_name(
    gcp: GcpProvider, make_gcp: Callable[..., GcpProvider], fake: FakeComputeApi
) -> None:
    first = launch(gcp, key="before-the-crash")
    restarted = make_gcp()
    adopted = launch(restarted, key="after-the-crash")  # another request id: 409, then adopt
    assert adopted.instance_id == first.instance_id
    assert [s.status for s in fake.calls("POST", r"/instances$")] == [200, 409]
    assert [i.instance_id for i in restarted.list_instances()] == [first.instance_id]


def test_instance_names_and_labels_follow_gcp_rules() -> None:
    rule = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
    long = "Attempt_" + "X" * 100
    for run, attempt in (("r-1", "a-1"), ("R", long), ("r", "---"), ("r", "ÄÖ")):
        assert rule.fullmatch(instance_name(run, attempt)), (run, attempt)
    assert instance_name("r", "A") != instance_name("r", "a")
    assert instance_name("r-1", "a-1") == instance_name("r-1", "a-1")
    assert label_value("U0TEST/Über#1") == "u0test--ber-1"
    assert len(label_value("x" * 100)) == 63


# -- permissions and credentials ---------------------------------------------------------


def test_a_missing_permission_names_it_and_creates_nothing(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    fake.deny("compute.instances.create")
    with pytest.raises(ProviderPermissionError) as denied:
        launch(gcp)
    assert denied.value.permission == "compute.instances.create"
    assert "compute.instances.create" in str(denied.value)
    assert "trainbotControlPlane" in str(denied.value)
    assert fake.instances() == []


def test_acting_as_the_runner_account_is_a_named_permission_too(
    gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    fake.deny("iam.serviceAccounts.actAs")
    with pytest.raises(ProviderPermissionError) as denied:
        launch(gcp)
    assert denied.value.permission == "iam.serviceAccounts.actAs"
    assert fake.instances() == []


def test_a_quota_check_without_permission_fails_preflight_clearly(
    tmp_path: Path, gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    fake.deny("compute.regions.get")
    report = run_preflight(context(tmp_path, gcp_spec(), gcp), [QuotaCheck(), CapacityCheck()])
    for result in report.results:
        assert result.status is Status.FAIL
        assert "compute.regions.get" in result.detail
        assert "deploy/gcp/roles.yaml" in result.detail


def test_missing_credentials_fail_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    provider = GcpProvider(project="p", region=REGION)  # the clients are built on first use
    with pytest.raises(ProviderError, match="no usable Google Cloud credentials") as e:
        provider.quota(A100)
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(e.value)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def google_debug_log() -> Iterator[_Records]:
    """Google's client loggers at DEBUG, as an operator debugging the API would set them."""
    handler = _Records()
    google = logging.getLogger("google")
    level = google.level
    google.addHandler(handler)
    google.setLevel(logging.DEBUG)
    yield handler
    google.removeHandler(handler)
    google.setLevel(level)


def test_the_runner_token_is_never_logged(
    caplog: pytest.LogCaptureFixture,
    google_debug_log: _Records,
    gcp: GcpProvider,
    fake: FakeComputeApi,
) -> None:
    caplog.set_level(logging.DEBUG)
    info = launch(gcp)
    gcp.status(info.instance_id)
    gcp.list_instances()
    gcp.terminate(info.instance_id)
    fake.deny("compute.instances.create")
    with pytest.raises(ProviderPermissionError) as denied:
        launch(gcp, attempt="a-2")
    records = caplog.records + google_debug_log.records
    assert caplog.records and google_debug_log.records
    assert TOKEN not in caplog.text and TOKEN not in str(denied.value)
    # Nor in any record's extra fields, where Google's clients put payloads at DEBUG.
    assert not [r.name for r in records if TOKEN in str(vars(r))]


# -- the roles in deploy/gcp -------------------------------------------------------------


def roles() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "deploy" / "gcp" / "roles.yaml").read_text())["roles"]


def test_roles_grant_the_control_plane_exactly_what_the_provider_uses() -> None:
    defined = roles()
    for role in defined.values():
        assert role["title"] and role["description"] and role["stage"] == "GA" and role["grant"]
        assert len(role["includedPermissions"]) == len(set(role["includedPermissions"]))
    control = set(defined["trainbotControlPlane"]["includedPermissions"])
    act_as = set(defined["trainbotLaunchAsRunner"]["includedPermissions"])
    assert act_as == {"iam.serviceAccounts.actAs"}  # bound on the runner's account only
    assert control | act_as == REQUIRED_PERMISSIONS
    # Checkpoints belong to the runner-storage account, whose tokens the control plane
    # downscopes per run (jobs/providers/gcp/credentials.py); the instances' account has none.
    assert set(defined) == {
        "trainbotControlPlane",
        "trainbotLaunchAsRunner",
        "trainbotMintRunnerStorageTokens",
        "trainbotRunnerStorage",
        "trainbotCleanCheckpoints",
        "trainbotCheckSecrets",
    }
    # Secrets: their metadata and policy, never a payload (versions.access).
    assert defined["trainbotCheckSecrets"]["includedPermissions"] == [
        "secretmanager.secrets.get",
        "secretmanager.secrets.getIamPolicy",
    ]
    # Retention deletes with the control plane's own account: list, read, delete only.
    assert set(defined["trainbotCleanCheckpoints"]["includedPermissions"]) == {
        "storage.objects.list",
        "storage.objects.get",
        "storage.objects.delete",
    }
    assert defined["trainbotMintRunnerStorageTokens"]["includedPermissions"] == [
        "iam.serviceAccounts.getAccessToken"
    ]
    assert all(
        p.startswith("storage.objects.")
        for p in defined["trainbotRunnerStorage"]["includedPermissions"]
    )


def lifecycle(provider: GcpProvider, fake: FakeComputeApi) -> None:
    """Everything the control plane does with GCP, once."""
    provider.quota(A100)
    provider.capacity(A100)  # its default boot image: a family's newest (getFromFamily)
    named = "projects/debian-cloud/global/images/debian-12-bookworm-v20240910"
    provider.capacity(dataclasses.replace(A100, image_id=named))  # one image (images.get)
    provider.bucket_location("gs://data-us/x")
    info = launch(provider)
    provider.status(info.instance_id)
    fake.preempt(ZONE_A, name_of(info.instance_id))
    provider.status(info.instance_id)
    second = launch(provider, attempt="a-2")
    fake.guest_exit(ZONE_A, name_of(second.instance_id), 0)
    provider.status(second.instance_id)
    provider.list_instances()
    provider.terminate(second.instance_id)
    # A gang: its compact placement policy, made before the nodes and deleted after them.
    pair = launch(provider, attempt="a-gang", nodes=2)
    provider.status(pair.instance_id)
    provider.terminate(pair.instance_id)
    for _ in range(5):  # the policy goes once its nodes have (a later call retries)
        provider.status(pair.instance_id)
        if not fake.resource_policies():
            break


def test_the_control_plane_role_is_enough(gcp: GcpProvider, fake: FakeComputeApi) -> None:
    defined = roles()
    fake.allow_only(
        set(defined["trainbotControlPlane"]["includedPermissions"])
        | set(defined["trainbotLaunchAsRunner"]["includedPermissions"])
    )
    lifecycle(gcp, fake)
    assert all(s.status != 403 for s in fake.seen)


@pytest.mark.parametrize("permission", sorted(REQUIRED_PERMISSIONS))
def test_every_permission_in_the_role_is_needed(
    permission: str, gcp: GcpProvider, fake: FakeComputeApi, caplog: pytest.LogCaptureFixture
) -> None:
    fake.allow_only(REQUIRED_PERMISSIONS - {permission})
    caplog.set_level(logging.WARNING)
    try:
        lifecycle(gcp, fake)
    except ProviderPermissionError as denied:
        assert denied.permission == permission
    else:
        # Only the best-effort cleanups of gangs' placement policies go on without their
        # permissions, and log what to grant. Without delete, the nodes are gone and the
        # policy stays; without list, policies left behind are not looked for.
        assert permission in ("compute.resourcePolicies.delete", "compute.resourcePolicies.list")
        assert permission in caplog.text
        if permission == "compute.resourcePolicies.delete":
            assert "gcloud compute resource-policies delete" in caplog.text
            assert len(fake.resource_policies()) == 1 and fake.instances() == []


# -- the startup script ------------------------------------------------------------------


def test_startup_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(STARTUP_SCRIPT_PATH)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-S", "warning", str(STARTUP_SCRIPT_PATH)], check=True)


def test_startup_script_runs_the_command_reports_its_exit_and_halts(
    tmp_path: Path, gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    """The real script, against the instance's metadata server: the command gets the
    attempt's environment, its exit code reaches status(), and the guest halts."""
    seen = tmp_path / "seen.json"
    command = [
        sys.executable,
        "-c",
        "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w')); sys.exit(0)",
        str(seen),
    ]
    req = launch_request(A100, command, zone=ZONE_A, run_id="r-1", env={"TRAINBOT_TOKEN": TOKEN})
    info = gcp.launch(req)
    runner_venv(tmp_path)
    halted = tmp_path / "halted"
    with fake.metadata_server(ZONE_A, name_of(info.instance_id)) as md_url:
        env = gcp_boot_env(tmp_path, md_url, halt=f"touch {halted}")
        done = subprocess.run(
            ["bash", str(STARTUP_SCRIPT_PATH)], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert halted.exists()
        assert TOKEN not in done.stdout + done.stderr
        got = json.loads(seen.read_text())
        assert got["TRAINBOT_TOKEN"] == TOKEN
        assert got["TRAINBOT_INSTANCE_ID"] == info.instance_id
        assert got["TRAINBOT_SCRATCH_DIR"] == str(tmp_path / "state" / "scratch")
        assert got["TRAINBOT_PREEMPTION_SOURCES"] == "gcp"
        # A second boot after the attempt only halts again.
        halted.unlink()
        again = subprocess.run(
            ["bash", str(STARTUP_SCRIPT_PATH)], env=env, capture_output=True, text=True, timeout=60
        )
        assert again.returncode == 0 and halted.exists() and "already ran" in again.stdout
    fake.set_status(ZONE_A, name_of(info.instance_id), "TERMINATED")  # the guest halted
    status = gcp.status(info.instance_id)
    assert (status.state, status.exit_code) == (InstanceState.SUCCEEDED, 0)


def test_a_command_that_cannot_start_is_reported_as_failed(
    tmp_path: Path, gcp: GcpProvider, fake: FakeComputeApi
) -> None:
    req = launch_request(A100, [str(tmp_path / "no-such-runner")], zone=ZONE_A, run_id="r-1")
    info = gcp.launch(req)
    runner_venv(tmp_path)
    with fake.metadata_server(ZONE_A, name_of(info.instance_id)) as md_url:
        env = gcp_boot_env(tmp_path, md_url)
        subprocess.run(
            ["bash", str(STARTUP_SCRIPT_PATH)], env=env, capture_output=True, timeout=60, check=True
        )
    fake.set_status(ZONE_A, name_of(info.instance_id), "TERMINATED")
    status = gcp.status(info.instance_id)
    assert (status.state, status.exit_code) == (InstanceState.FAILED, 127)
