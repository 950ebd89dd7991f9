"""Preflight: quota, capacity, data locality, the real dry run, and the cost estimate.

The local provider is real. Where a branch needs answers the laptop cannot give (a
bucket in another region, AWS's quota remedy, placement scores), ``CloudAnswers`` is a
small implementation of the Provider protocol whose questions return fixed answers;
the cloud providers themselves are tested against their real protocols elsewhere.
One real dry run of the tiny example covers the end-to-end path.
"""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from bot.console import ConsoleNotifier
from jobs.domain.errors import SpecError
from jobs.outbound.notify import PreflightMessage
from jobs.preflight import (
    DEFAULT_SPOT_MTBP_S,
    BudgetCheck,
    CapacityCheck,
    Check,
    CheckResult,
    DataLocalityCheck,
    DryRunCheck,
    InstanceShapeCheck,
    PreflightContext,
    PreflightPlan,
    PreflightReport,
    QuotaCheck,
    Status,
    assumed_mtbp_s,
    checkpoint_interval,
    default_checks,
    interval_choice,
    resource_request,
    run_preflight,
    target_steps,
)
from jobs.preflight.secrets import SecretsCheck
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.providers.base import (
    BucketLocation,
    Capabilities,
    InstanceInfo,
    InstanceStatus,
    LaunchRequest,
    PriceQuote,
    Provider,
    ProviderError,
    QuotaInfo,
    ResourceRequest,
    Unsupported,
    ZoneCapacity,
)
from jobs.providers.local import LocalProvider
from jobs.spec import JobSpec, parse_spec
from tests.paths import ROOT

TINY_COMMAND = "python -m runner.examples.tiny --dim 32 --batch 8 --steps 100"

#: The checks a preflight runs, in the order their answers are needed.
CHECKS = ("quota", "capacity", "instances", "data", "secrets", "image", "dry_run", "budget")


# -- helpers -----------------------------------------------------------------------------


@dataclass
class CloudAnswers:
    """A Provider whose questions have fixed answers; it launches nothing."""

    name: str = "aws"
    capabilities: Capabilities = field(
        default_factory=lambda: Capabilities(
            runs_on_this_machine=False,
            termination_window_s=120.0,
            preemption_source="aws",
            default_region="us-east-1",
        )
    )
    quota_info: QuotaInfo = field(
        default_factory=lambda: QuotaInfo(
            limit=8, used=0, needed=1, unit="GPUs", ok=True, detail="8 A100 GPUs in us-east-1"
        )
    )
    #: Zones answered for spot requests, and for on-demand ones.
    spot_zones: list[ZoneCapacity] = field(default_factory=list)
    on_demand_zones: list[ZoneCapacity] = field(default_factory=list)
    spot_usd: float = 2.0
    on_demand_usd: float = 6.0
    buckets: dict[str, str] = field(default_factory=dict)
    priced_zones: list[str | None] = field(default_factory=list)
    #: Accelerators per instance → the instance type that holds exactly that many.
    offers: dict[int, str] = field(default_factory=dict)

    def quota(self, req: ResourceRequest) -> QuotaInfo:
        return self.quota_info

    def capacity(self, req: ResourceRequest) -> list[ZoneCapacity]:
        return list(self.spot_zones if req.spot else self.on_demand_zones)

    def price(self, req: ResourceRequest, *, zone: str | None = None) -> PriceQuote:
        self.priced_zones.append(zone)
        return PriceQuote(
            spot_usd_per_hour=self.spot_usd,
            on_demand_usd_per_hour=self.on_demand_usd,
            source="fixed",
            as_of=datetime(2024, 5, 1, tzinfo=timezone.utc),
        )

    def bucket_location(self, uri: str) -> BucketLocation | None:
        if uri.startswith("s3://forbidden"):
            raise ProviderError("access denied to s3://forbidden: grant s3:GetBucketLocation")
        region = self.buckets.get(uri.split("/")[2])
        return BucketLocation.region(region) if region else None

    def instance_type_for(self, req: ResourceRequest) -> str | None:
        return self.offers.get(req.accelerator_count) if req.accelerator_count else None

    def dry_run_request(
        self, req: ResourceRequest, *, instance_type: str | None = None
    ) -> ResourceRequest:
        return req

    def launch(self, req: LaunchRequest) -> InstanceInfo:
        raise ProviderError("CloudAnswers launches nothing")

    def status(self, instance_id: str) -> InstanceStatus:
        raise ProviderError("CloudAnswers launches nothing")

    def terminate(self, instance_id: str) -> None:
        raise ProviderError("CloudAnswers launches nothing")

    def list_instances(self) -> list[InstanceInfo]:
        return []

    def create_budget(self, *, run_id: str, usd: float, thresholds: Sequence[int]) -> str:
        raise Unsupported("CloudAnswers has no budgets")

    def check_launch_permissions(self, req: ResourceRequest, *, zone: str | None = None) -> None:
        raise Unsupported("CloudAnswers has no permission probe")

    def instance_log(self, instance_id: str, *, lines: int) -> str:
        raise Unsupported("CloudAnswers launches nothing")

    def close(self) -> None:
        return None


def spec(**data: Any) -> JobSpec:
    data.setdefault("command", TINY_COMMAND)
    return parse_spec(data, name="t")


def context(
    tmp_path: Path,
    job: JobSpec,
    provider: Provider,
    *,
    mtbp_s: float = 3600.0,
    request: ResourceRequest | None = None,
    store: str | None = None,
    run_id: str = "r-pre",
    env: dict[str, str] | None = None,
    workdir: Path | None = None,
) -> PreflightContext:
    """What preflight is given for ``job`` on ``provider``: by default a local store and
    this checkout's runner, one torch thread, in ``tmp_path/work``."""
    return PreflightContext(
        spec=job,
        run_id=run_id,
        provider=provider,
        request=request or resource_request(job, provider),
        checkpoint_uri=store or str(tmp_path / "ck"),
        mtbp_s=mtbp_s,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} if env is None else env,
        workdir=workdir or tmp_path / "work",
    )


def secrets_check(
    tmp_path: Path,
    provider: Provider,
    secrets: dict[str, str],
    *,
    request: ResourceRequest,
    store: str,
    run_id: str,
) -> CheckResult:
    """Preflight's secrets check of a spec whose ``secrets`` are these, on ``provider``."""
    spec = parse_spec({"command": "python train.py", "secrets": secrets}, name="s")
    ctx = context(
        tmp_path,
        spec,
        provider,
        request=request,
        store=store,
        run_id=run_id,
        env={},
        workdir=tmp_path,
    )
    return SecretsCheck().run(ctx, prior=PreflightPlan())


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalProvider]:
    with LocalProvider(
        tmp_path / "state", gpu_names=[], spot_usd_per_hour=2.0, on_demand_usd_per_hour=6.0
    ) as provider:
        yield provider


def dry_result(**data: Any) -> CheckResult:
    return CheckResult("dry_run", Status.PASS, "measured", data=data)


@dataclass
class Fixed:
    """A check that answers what it is told, or raises it."""

    name: str
    answer: CheckResult | Exception
    seen: list[Mapping[str, CheckResult]] = field(default_factory=list)

    def run(self, ctx: PreflightContext, *, prior: Mapping[str, CheckResult]) -> CheckResult:
        self.seen.append(dict(prior))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def result(name: str, status: Status) -> CheckResult:
    return CheckResult(name, status, f"{name} {status.value}", "" if status is Status.PASS else "x")


# -- quota ---------------------------------------------------------------------------------


def test_quota_of_zero_gpus_fails_with_a_remedy(tmp_path: Path, local: LocalProvider) -> None:
    ctx = context(tmp_path, spec(resources={"accelerator": "A100:1"}), local)
    got = QuotaCheck().run(ctx, prior={})
    assert got.status is Status.FAIL
    assert "0 A100 GPU(s)" in got.detail and "limit 0 GPUs" in got.detail
    assert "cloud provider" in got.remedy
    assert got.data["limit"] == 0 and got.data["needed"] == 1


def test_quota_for_a_cpu_run_passes_on_this_machine(tmp_path: Path, local: LocalProvider) -> None:
    got = QuotaCheck().run(context(tmp_path, spec(), local), prior={})
    assert got.status is Status.PASS
    assert "cores for local instances" in got.detail and got.remedy == ""


def test_quota_failure_carries_the_providers_remedy(tmp_path: Path) -> None:
    cloud = CloudAnswers(
        quota_info=QuotaInfo(
            limit=0,
            used=0,
            needed=8,
            unit="vCPUs",
            ok=False,
            detail="Running On-Demand P instances: 0 vCPUs in us-east-1",
            remedy="request an increase of L-417A185B in Service Quotas",
        )
    )
    job = spec(resources={"cloud": "aws", "region": "us-east-1", "accelerator": "A100:8"})
    got = QuotaCheck().run(context(tmp_path, job, cloud), prior={})
    assert got.status is Status.FAIL
    assert got.remedy == "request an increase of L-417A185B in Service Quotas"
    assert "8 × A100 (spot, us-east-1)" in got.detail


# -- capacity ------------------------------------------------------------------------------


def test_no_capacity_anywhere_fails_and_says_it_is_not_quota(
    tmp_path: Path, local: LocalProvider
) -> None:
    ctx = context(tmp_path, spec(resources={"accelerator": "L4:1"}), local)
    got = CapacityCheck().run(ctx, prior={})
    assert got.status is Status.FAIL
    assert "separate question from quota" in got.detail and "local-a" in got.detail
    assert "on_demand_fallback" in got.remedy
    assert got.data["zones"] == []


def test_capacity_passes_with_the_local_zone(tmp_path: Path, local: LocalProvider) -> None:
    got = CapacityCheck().run(context(tmp_path, spec(), local), prior={})
    assert got.status is Status.PASS
    assert got.data["zones"] == ["local-a"] and "local-a" in got.detail


def test_capacity_in_only_some_requested_zones_warns(tmp_path: Path, local: LocalProvider) -> None:
    job = spec(resources={"region": "local", "zones": ["local-a", "local-b"]})
    got = CapacityCheck().run(context(tmp_path, job, local), prior={})
    assert got.status is Status.WARN
    assert "local-b" in got.detail and "local-b" in got.remedy
    assert got.data["zones"] == ["local-a"]


def test_capacity_ranks_zones_by_score(tmp_path: Path) -> None:
    cloud = CloudAnswers(
        spot_zones=[
            ZoneCapacity("us-east-1a", True, 3),
            ZoneCapacity("us-east-1b", False, None, "no A100 offering"),
            ZoneCapacity("us-east-1c", True, 9),
        ]
    )
    job = spec(resources={"cloud": "aws", "region": "us-east-1", "accelerator": "A100:1"})
    got = CapacityCheck().run(context(tmp_path, job, cloud), prior={})
    assert got.status is Status.PASS
    assert got.data["zones"] == ["us-east-1c", "us-east-1a"]
    assert got.detail.index("us-east-1c (score 9)") < got.detail.index("us-east-1a (score 3)")


def test_on_demand_fallback_warns_and_the_budget_prices_on_demand(tmp_path: Path) -> None:
    cloud = CloudAnswers(
        spot_zones=[ZoneCapacity("us-east-1a", False, None, "no spot capacity")],
        on_demand_zones=[ZoneCapacity("us-east-1a", True, None)],
    )
    job = spec(
        command="python train.py --steps 3600",
        resources={
            "cloud": "aws",
            "region": "us-east-1",
            "accelerator": "A100:1",
            "on_demand_fallback": True,
        },
        checkpoint={"interval": "10m"},
    )
    ctx = context(tmp_path, job, cloud)
    capacity = CapacityCheck().run(ctx, prior={})
    assert capacity.status is Status.WARN and capacity.data["on_demand"] is True
    assert "on-demand prices" in capacity.remedy
    budget = BudgetCheck().run(
        ctx, prior={"capacity": capacity, "dry_run": dry_result(step_time_s=1.0, write_s=0.0)}
    )
    assert budget.data["usd_per_hour"] == 6.0 and budget.data["price_kind"] == "on-demand"
    assert cloud.priced_zones == ["us-east-1a"]
    # 3600 steps of 1 s, no checkpoint cost and no preemptions on demand: one hour.
    assert budget.data["expected_hours"] == pytest.approx(1.0)
    assert budget.data["estimate_usd"] == pytest.approx(6.0)


# -- data locality ---------------------------------------------------------------------------


def test_no_dataset_passes(tmp_path: Path, local: LocalProvider) -> None:
    got = DataLocalityCheck().run(context(tmp_path, spec(), local), prior={})
    assert got.status is Status.PASS and "no dataset" in got.detail


def test_missing_local_data_path_fails_naming_it(tmp_path: Path, local: LocalProvider) -> None:
    missing = tmp_path / "nowhere" / "data.bin"
    got = DataLocalityCheck().run(context(tmp_path, spec(data_uri=str(missing)), local), prior={})
    assert got.status is Status.FAIL
    assert str(missing) in got.detail and str(missing) in got.remedy


def test_existing_local_data_passes_also_as_file_uri(tmp_path: Path, local: LocalProvider) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(b"12+7=19.\n")
    for uri in (str(data), data.as_uri()):
        got = DataLocalityCheck().run(context(tmp_path, spec(data_uri=uri), local), prior={})
        assert got.status is Status.PASS, got.detail


def test_bucket_of_unknown_region_warns(tmp_path: Path, local: LocalProvider) -> None:
    ctx = context(tmp_path, spec(data_uri="s3://corpus/train"), local)
    got = DataLocalityCheck().run(ctx, prior={})
    assert got.status is Status.WARN
    assert "s3://corpus/train" in got.detail and "local" in got.remedy


def test_data_in_another_region_fails(tmp_path: Path) -> None:
    cloud = CloudAnswers(buckets={"corpus": "eu-west-1", "near": "us-east-1"})
    resources = {"cloud": "aws", "region": "us-east-1"}
    far = context(tmp_path, spec(data_uri="s3://corpus/train", resources=resources), cloud)
    got = DataLocalityCheck().run(far, prior={})
    assert got.status is Status.FAIL
    assert "eu-west-1" in got.detail and "us-east-1" in got.detail
    assert "stage the data into a bucket in us-east-1" in got.remedy
    near = context(
        tmp_path,
        spec(data_uri="s3://near/train", resources=resources),
        cloud,
        store="s3://near/ckpt",
    )
    assert DataLocalityCheck().run(near, prior={}).status is Status.PASS


def test_a_local_path_for_a_cloud_run_cannot_be_checked(tmp_path: Path) -> None:
    job = spec(data_uri="/mnt/data", resources={"cloud": "gcp", "region": "us-central1"})
    got = DataLocalityCheck().run(context(tmp_path, job, CloudAnswers(name="gcp")), prior={})
    assert got.status is Status.WARN and "us-central1" in got.remedy


def test_a_checkpoint_store_in_another_region_fails(tmp_path: Path) -> None:
    cloud = CloudAnswers(buckets={"ckpt-eu": "eu-west-1", "ckpt-us": "us-east-1"})
    job = spec(resources={"cloud": "aws", "region": "us-east-1"})
    got = DataLocalityCheck().run(context(tmp_path, job, cloud, store="s3://ckpt-eu/r"), prior={})
    assert got.status is Status.FAIL
    assert "checkpoint store s3://ckpt-eu/r is in eu-west-1 but the run is in us-east-1" in (
        got.detail
    )
    assert "aws s3 mb s3://BUCKET --region us-east-1" in got.remedy
    assert "checkpoint.uri" in got.remedy
    assert got.data["checkpoint"]["bucket_region"] == "eu-west-1"
    near = DataLocalityCheck().run(context(tmp_path, job, cloud, store="s3://ckpt-us/r"), prior={})
    assert near.status is Status.PASS, near.detail
    assert "checkpoint store s3://ckpt-us/r is in us-east-1" in near.detail


def test_a_gcs_checkpoint_bucket_elsewhere_names_the_soft_delete_flag(tmp_path: Path) -> None:
    cloud = CloudAnswers(name="gcp", buckets={"ck": "europe-west4"})
    job = spec(resources={"cloud": "gcp", "region": "us-central1"})
    got = DataLocalityCheck().run(context(tmp_path, job, cloud, store="gs://ck/runs"), prior={})
    assert got.status is Status.FAIL
    assert (
        "gcloud storage buckets create gs://BUCKET --location=us-central1 "
        "--soft-delete-duration=0" in got.remedy
    )


def test_a_local_checkpoint_path_on_a_cloud_dies_with_the_instance(tmp_path: Path) -> None:
    job = spec(resources={"cloud": "aws", "region": "us-east-1"})
    for store in ("/mnt/ckpt", "file:///mnt/ckpt"):
        got = DataLocalityCheck().run(context(tmp_path, job, CloudAnswers(), store=store), prior={})
        assert got.status is Status.WARN, store
        assert "dies with the instance" in got.detail or "die with the instance" in got.detail
        assert "create a checkpoint bucket in us-east-1" in got.remedy


def test_a_local_checkpoint_path_passes_where_instances_run_here(
    tmp_path: Path, local: LocalProvider
) -> None:
    for store in (str(tmp_path / "ck"), (tmp_path / "ck").as_uri()):
        got = DataLocalityCheck().run(context(tmp_path, spec(), local, store=store), prior={})
        assert got.status is Status.PASS, got.detail
        assert "on this machine" in got.detail


@pytest.mark.parametrize(
    ("provider", "region", "store", "other"),
    [
        ("aws", "us-east-1", "gs://ckpt/runs", "gcp"),
        ("gcp", "us-central1", "s3://ckpt/runs", "aws"),
    ],
)
def test_a_checkpoint_store_on_the_other_cloud_fails(
    tmp_path: Path, provider: str, region: str, store: str, other: str
) -> None:
    # The bucket's region would even match: the instance still has no credentials for it.
    cloud = CloudAnswers(name=provider, buckets={"ckpt": region})
    job = spec(resources={"cloud": provider, "region": region})
    got = DataLocalityCheck().run(context(tmp_path, job, cloud, store=store), prior={})
    assert got.status is Status.FAIL
    assert f"is on {other} but the run's instances are on {provider}" in got.detail
    assert "no credentials" in got.detail
    assert f"create a checkpoint bucket in {region}" in got.remedy


def test_a_checkpoint_bucket_of_unknown_region_warns(tmp_path: Path) -> None:
    job = spec(resources={"cloud": "aws", "region": "us-east-1"})
    ctx = context(tmp_path, job, CloudAnswers(), store="s3://theirs/ckpt")
    got = DataLocalityCheck().run(ctx, prior={})
    assert got.status is Status.WARN
    assert "cannot tell which region holds the checkpoint store s3://theirs/ckpt" in got.detail
    assert "check that s3://theirs/ckpt is in us-east-1" in got.remedy


def test_an_unreadable_checkpoint_bucket_fails_and_keeps_the_datasets_answer(
    tmp_path: Path,
) -> None:
    cloud = CloudAnswers(buckets={"near": "us-east-1"})
    job = spec(data_uri="s3://near/train", resources={"cloud": "aws", "region": "us-east-1"})
    ctx = context(tmp_path, job, cloud, store="s3://forbidden/ckpt")
    got = DataLocalityCheck().run(ctx, prior={})
    assert got.status is Status.FAIL
    assert "dataset s3://near/train is in us-east-1" in got.detail
    assert "cannot check the checkpoint store s3://forbidden/ckpt" in got.detail
    assert "s3:GetBucketLocation" in got.detail and "fix what the message says" in got.remedy


def test_the_worse_half_decides_and_both_remedies_are_given(tmp_path: Path) -> None:
    cloud = CloudAnswers(buckets={"corpus": "eu-west-1"})
    job = spec(data_uri="s3://corpus/train", resources={"cloud": "aws", "region": "us-east-1"})
    got = DataLocalityCheck().run(context(tmp_path, job, cloud, store="/mnt/ck"), prior={})
    assert got.status is Status.FAIL, "the dataset fails, the store only warns"
    assert "stage the data into a bucket in us-east-1" in got.remedy
    assert "create a checkpoint bucket in us-east-1" in got.remedy
    assert got.data["bucket_region"] == "eu-west-1", "the dataset's figures stay on top"
    assert got.data["checkpoint"]["uri"] == "/mnt/ck"


# -- several regions ---------------------------------------------------------------------


@dataclass
class Regional(CloudAnswers):
    """CloudAnswers with an answer per region: the regions listed are out of quota, or of
    capacity (spot, or every market)."""

    no_quota: set[str] = field(default_factory=set)
    no_spot: set[str] = field(default_factory=set)
    asked: list[tuple[str, bool, tuple[str, ...]]] = field(default_factory=list)

    def quota(self, req: ResourceRequest) -> QuotaInfo:
        ok = req.region not in self.no_quota
        return QuotaInfo(
            limit=8 if ok else 0,
            used=0,
            needed=1,
            unit="GPUs",
            ok=ok,
            detail=f"{8 if ok else 0} A100 GPUs in {req.region}",
            remedy="" if ok else f"request more A100 GPUs in {req.region}",
        )

    def capacity(self, req: ResourceRequest) -> list[ZoneCapacity]:
        self.asked.append((req.region, req.spot, req.zones))
        out = req.spot and req.region in self.no_spot
        return [ZoneCapacity(f"{req.region}a", not out, None, "no spot capacity" if out else "")]


TWO_REGIONS = {"cloud": "aws", "regions": ["us-east-1", "us-west-2"], "accelerator": "A100:1"}


def test_quota_passes_in_the_second_region_and_names_the_first_as_short(tmp_path: Path) -> None:
    cloud = Regional(no_quota={"us-east-1"})
    got = QuotaCheck().run(context(tmp_path, spec(resources=TWO_REGIONS), cloud), prior={})
    assert got.status is Status.PASS
    assert "covers 1 × A100 (spot, us-east-1 or us-west-2) in us-west-2" in got.detail
    assert "not in us-east-1" in got.detail and "limit 0 GPUs" in got.detail
    assert got.data["usable_regions"] == ["us-west-2"]
    assert got.data["regions"]["us-east-1"]["ok"] is False


def test_quota_in_no_region_fails_naming_both_with_their_remedies(tmp_path: Path) -> None:
    cloud = Regional(no_quota={"us-east-1", "us-west-2"})
    got = QuotaCheck().run(context(tmp_path, spec(resources=TWO_REGIONS), cloud), prior={})
    assert got.status is Status.FAIL
    assert "no region of resources.regions" in got.detail
    assert "us-east-1: 0 A100 GPUs" in got.detail and "us-west-2: 0 A100 GPUs" in got.detail
    assert "in us-east-1" in got.remedy and "in us-west-2" in got.remedy


def test_capacity_passes_in_the_second_region_and_the_budget_prices_spot_there(
    tmp_path: Path,
) -> None:
    cloud = Regional(no_spot={"us-east-1"})
    job = spec(
        command="python train.py --steps 3600",
        resources={**TWO_REGIONS, "zones": ["us-west-2a"], "on_demand_fallback": True},
        checkpoint={"interval": "10m"},
    )
    ctx = context(tmp_path, job, cloud)
    got = CapacityCheck().run(ctx, prior={})
    assert got.status is Status.PASS, got.detail
    assert "available now in us-west-2a" in got.detail
    assert "none in us-east-1 (us-east-1a: no spot capacity)" in got.detail
    assert got.data["region"] == "us-west-2" and got.data["on_demand"] is False
    # Each region is asked with its own zones, as the launch asks (request_in).
    assert ("us-east-1", True, ()) in cloud.asked and ("us-west-2", True, ("us-west-2a",)) in (
        cloud.asked
    )
    assert not [a for a in cloud.asked if not a[1]], "spot somewhere: on-demand not asked"
    budget = BudgetCheck().run(ctx, prior={"capacity": got, "dry_run": dry_result(step_time_s=1.0)})
    assert budget.data["price_kind"] == "spot" and cloud.priced_zones == ["us-west-2a"]


def test_capacity_out_in_every_region_fails_naming_both(tmp_path: Path) -> None:
    cloud = Regional(no_spot={"us-east-1", "us-west-2"})
    got = CapacityCheck().run(context(tmp_path, spec(resources=TWO_REGIONS), cloud), prior={})
    assert got.status is Status.FAIL
    assert "no zone of us-east-1 or us-west-2 offers" in got.detail
    assert "us-east-1: us-east-1a: no spot capacity" in got.detail
    assert "us-west-2: us-west-2a: no spot capacity" in got.detail
    assert "resources.regions" in got.remedy


def test_on_demand_is_priced_only_when_no_region_has_spot(tmp_path: Path) -> None:
    cloud = Regional(no_spot={"us-east-1", "us-west-2"})
    job = spec(resources={**TWO_REGIONS, "on_demand_fallback": True})
    got = CapacityCheck().run(context(tmp_path, job, cloud), prior={})
    assert got.status is Status.WARN and got.data["on_demand"] is True
    assert "no zone of us-east-1 or us-west-2 has spot capacity" in got.detail
    assert got.data["region"] == "us-east-1"


def test_data_in_only_one_region_passes_with_that_one(tmp_path: Path) -> None:
    cloud = CloudAnswers(buckets={"corpus": "us-west-2", "ck": "us-west-2"})
    job = spec(data_uri="s3://corpus/train", resources=TWO_REGIONS)
    got = DataLocalityCheck().run(context(tmp_path, job, cloud, store="s3://ck/r"), prior={})
    assert got.status is Status.PASS, got.detail
    assert got.detail.startswith("the run can go to us-west-2: dataset s3://corpus/train is in")
    assert "not us-east-1: the dataset s3://corpus/train is in us-west-2" in got.detail
    assert got.data["usable_regions"] == ["us-west-2"]
    assert got.data["regions"] == {"us-east-1": "fail", "us-west-2": "pass"}
    allowed = spec(
        data_uri="s3://corpus/train", resources={**TWO_REGIONS, "regions": ["us-east-1"]}
    )
    far = DataLocalityCheck().run(context(tmp_path, allowed, cloud, store="s3://ck/r"), prior={})
    assert far.status is Status.FAIL and "list us-west-2 in resources.regions" in far.remedy


def test_data_in_neither_region_fails_naming_both(tmp_path: Path) -> None:
    cloud = CloudAnswers(buckets={"corpus": "eu-west-1", "ck": "eu-west-1"})
    job = spec(data_uri="s3://corpus/train", resources=TWO_REGIONS)
    got = DataLocalityCheck().run(context(tmp_path, job, cloud, store="s3://ck/r"), prior={})
    assert got.status is Status.FAIL
    assert "us-east-1 and us-west-2" in got.detail
    assert "us-east-1: stage the data" in got.remedy and "us-west-2: stage" in got.remedy


def test_cross_region_data_passes_when_the_spec_allows_it(tmp_path: Path) -> None:
    cloud = CloudAnswers(buckets={"corpus": "eu-west-1", "ck": "us-east-1"})
    job = spec(
        data_uri="s3://corpus/train",
        resources={"cloud": "aws", "region": "us-east-1", "allow_cross_region_data": True},
    )
    got = DataLocalityCheck().run(context(tmp_path, job, cloud, store="s3://ck/r"), prior={})
    assert got.status is Status.PASS and "across regions" in got.detail


def test_a_checkpoint_store_in_another_region_warns_when_the_spec_allows_it(
    tmp_path: Path,
) -> None:
    """The allowance covers the checkpoint store too, but saving across regions costs
    every save and restore: a warning, so a person confirms; without it, a failure."""
    cloud = CloudAnswers(buckets={"ck": "eu-west-1"})
    allowed = spec(
        resources={"cloud": "aws", "region": "us-east-1", "allow_cross_region_data": True}
    )
    got = DataLocalityCheck().run(context(tmp_path, allowed, cloud, store="s3://ck/r"), prior={})
    assert got.status is Status.WARN
    assert "s3://ck/r is in eu-west-1 but the run is in us-east-1" in got.detail
    assert "allow_cross_region_data allows it" in got.detail
    strict = spec(resources={"cloud": "aws", "region": "us-east-1"})
    got = DataLocalityCheck().run(context(tmp_path, strict, cloud, store="s3://ck/r"), prior={})
    assert got.status is Status.FAIL


# -- checkpoint interval and budget ----------------------------------------------------------


def test_auto_interval_is_dalys_optimum() -> None:
    from runner.dryrun import daly_interval

    auto = spec()
    assert auto.checkpoint.interval == "auto"
    assert checkpoint_interval(auto, write_s=2.0, mtbp_s=3600) == pytest.approx(
        math.sqrt(2 * 2.0 * 3600) - 2.0
    )
    assert checkpoint_interval(auto, write_s=2.0, mtbp_s=3600) == daly_interval(2.0, 3600)
    assert checkpoint_interval(auto, write_s=None, mtbp_s=3600) is None
    fixed = spec(checkpoint={"interval": "90s"})
    assert checkpoint_interval(fixed, write_s=2.0, mtbp_s=3600) == 90.0


def test_auto_interval_uses_the_stall_and_the_preemptions_that_lose_work() -> None:
    """An asynchronous save costs the loop its stall (C); the write time is the floor;
    when the emergency checkpoint fits, only unannounced preemptions lose work (M)."""
    from runner.preemption import UNANNOUNCED_SHARE, daly_interval

    auto = spec()
    no_notice = checkpoint_interval(auto, write_s=2.0, stall_s=0.05, mtbp_s=3600)
    assert no_notice == pytest.approx(daly_interval(0.05, 3600))
    with_notice = checkpoint_interval(
        auto, write_s=2.0, stall_s=0.05, mtbp_s=3600, flush_fits_window=True
    )
    assert with_notice == pytest.approx(daly_interval(0.05, 3600 / UNANNOUNCED_SHARE))
    assert with_notice > no_notice
    # One save in flight at a time: never shorter than the write.
    assert checkpoint_interval(auto, write_s=30.0, stall_s=0.01, mtbp_s=600) == 30.0
    choice = interval_choice(write_s=2.0, stall_s=None, mtbp_s=3600, flush_fits_window=False)
    assert choice is not None and choice.cost_s == 2.0  # no stall measured: a blocking save
    assert interval_choice(write_s=None, stall_s=0.1, mtbp_s=3600, flush_fits_window=True) is None


def test_target_steps_from_the_command() -> None:
    assert target_steps(["python", "t.py", "--steps", "100"]) == 100
    assert target_steps(["python", "t.py", "--max-steps=7", "--steps", "9"]) == 9
    assert target_steps(["python", "t.py", "--steps"]) is None
    assert target_steps(["python", "t.py", "--stepsize", "3"]) is None


def test_estimate_over_budget_warns_with_the_hard_cap_share(
    tmp_path: Path, local: LocalProvider
) -> None:
    job = spec(
        command="python train.py --steps 7200",
        checkpoint={"interval": "10m"},
        budget={"usd": 3},
    )
    # Two instances are refused at validation until multi-node runs exist; the estimate
    # still charges N of them, which is what this checks.
    job = job.model_copy(update={"resources": job.resources.model_copy(update={"instances": 2})})
    ctx = context(tmp_path, job, local, mtbp_s=7200)
    got = BudgetCheck().run(
        ctx, prior={"dry_run": dry_result(step_time_s=0.5, write_s=2.0, restore_s=1.0)}
    )
    overhead = 2.0 / 600 + (300 + 1.0) / 7200
    hours = 7200 * 0.5 * (1 + overhead) / 3600
    assert got.data["expected_hours"] == pytest.approx(hours)
    assert got.data["estimate_usd"] == pytest.approx(2.0 * 2 * hours)
    assert got.status is Status.WARN
    assert "above budget.usd $3.00" in got.detail
    stop = math.floor(100 * 3 / (4 * hours))
    assert f"stop the run at about {stop}%" in got.remedy and "raise budget.usd" in got.remedy


def test_estimate_within_budget_passes(tmp_path: Path, local: LocalProvider) -> None:
    job = spec(budget={"usd": 50}, checkpoint={"interval": "10m"})
    got = BudgetCheck().run(
        context(tmp_path, job, local), prior={"dry_run": dry_result(step_time_s=0.5)}
    )
    # 100 steps (from TINY_COMMAND) of 0.5 s at $2/h, +τ/2M of work redone after preemptions.
    assert got.status is Status.PASS
    assert got.data["estimate_usd"] == pytest.approx(2.0 * 100 * 0.5 * (1 + 300 / 3600) / 3600)
    assert "within budget.usd $50.00" in got.detail


def test_without_budget_the_estimate_becomes_the_alert_budget(
    tmp_path: Path, local: LocalProvider
) -> None:
    job = spec(command="python train.py --steps=3600")
    got = BudgetCheck().run(
        context(tmp_path, job, local), prior={"dry_run": dry_result(step_time_s=1.0, write_s=1.0)}
    )
    assert got.status is Status.PASS
    assert got.data["estimate_usd"] is not None and got.data["estimate_usd"] > 2.0
    assert got.data["interval_s"] == pytest.approx(math.sqrt(2 * 1.0 * 3600) - 1.0)
    assert "becomes the run's budget alert" in got.detail


def test_max_hours_that_could_outspend_the_budget_warns(
    tmp_path: Path, local: LocalProvider
) -> None:
    job = spec(max_hours=10, budget={"usd": 5}, checkpoint={"interval": "10m"})
    got = BudgetCheck().run(
        context(tmp_path, job, local), prior={"dry_run": dry_result(step_time_s=0.1)}
    )
    assert got.status is Status.WARN
    assert "max_hours 10 h allows $20.00" in got.detail
    assert "lower max_hours to 2.5 h" in got.remedy


def test_without_a_step_count_max_hours_is_the_upper_bound(
    tmp_path: Path, local: LocalProvider
) -> None:
    job = spec(command="python train.py", max_hours=2, budget={"usd": 3})
    got = BudgetCheck().run(context(tmp_path, job, local), prior={})
    assert got.data["expected_hours"] == 2 and got.data["estimate_usd"] == pytest.approx(4.0)
    assert got.status is Status.WARN and "max_hours as the upper bound" in got.detail
    assert got.remedy.count("raise budget.usd") == 1


def test_no_estimate_and_no_budget_warns(tmp_path: Path, local: LocalProvider) -> None:
    got = BudgetCheck().run(context(tmp_path, spec(command="python train.py"), local), prior={})
    assert got.status is Status.WARN and got.data["estimate_usd"] is None
    assert "--steps N" in got.remedy and "budget.usd" in got.remedy
    with_budget = spec(command="python train.py", budget={"usd": 5})
    assert BudgetCheck().run(context(tmp_path, with_budget, local), prior={}).status is Status.PASS


# -- running the checks ----------------------------------------------------------------------


def test_a_check_that_raises_becomes_a_fail_and_the_rest_still_run(
    tmp_path: Path, local: LocalProvider
) -> None:
    after = Fixed("budget", result("budget", Status.PASS))
    checks: list[Check] = [
        Fixed("quota", RuntimeError("connection reset by peer")),
        Fixed("data", SpecError("data_uri is malformed: fix it")),
        after,
    ]
    seen: list[CheckResult] = []
    report = run_preflight(context(tmp_path, spec(), local), checks, on_result=seen.append)
    quota, data, budget = report.results
    assert quota.status is Status.FAIL and "connection reset by peer" in quota.detail
    assert "Traceback" not in quota.detail and "report it" in quota.remedy
    assert data.status is Status.FAIL and "data_uri is malformed" in data.detail
    assert "fix what the message says" in data.remedy
    assert budget.status is Status.PASS
    assert set(after.seen[0]) == {"quota", "data"}
    assert seen == list(report.results)
    assert not report.ok and not report.needs_confirmation


def test_a_provider_error_in_a_real_check_is_reported(tmp_path: Path) -> None:
    job = spec(data_uri="s3://forbidden/x", resources={"cloud": "aws", "region": "us-east-1"})
    report = run_preflight(context(tmp_path, job, CloudAnswers()), [DataLocalityCheck()])
    (got,) = report.results
    assert got.status is Status.FAIL and "s3:GetBucketLocation" in got.detail


def test_a_warning_without_a_remedy_is_refused() -> None:
    with pytest.raises(ValueError, match="without a remedy"):
        CheckResult("data", Status.WARN, "odd")


@pytest.mark.parametrize(
    ("statuses", "ok", "confirm"),
    [
        ((Status.PASS, Status.PASS), True, False),
        ((Status.PASS, Status.WARN), True, True),
        ((Status.WARN, Status.FAIL), False, False),
    ],
)
def test_report_ok_and_needs_confirmation(
    statuses: Sequence[Status], ok: bool, confirm: bool
) -> None:
    report = PreflightReport(results=tuple(result(f"c{i}", s) for i, s in enumerate(statuses)))
    assert report.ok is ok and report.needs_confirmation is confirm


def test_report_figures_and_message(tmp_path: Path, local: LocalProvider) -> None:
    budget = CheckResult(
        "budget", Status.PASS, "fine", data={"estimate_usd": 1.5, "expected_hours": 0.75,
                                            "interval_s": 42.0}
    )  # fmt: skip
    checks: list[Check] = [
        Fixed("quota", result("quota", Status.WARN)),
        Fixed("budget", budget),
    ]
    report = run_preflight(context(tmp_path, spec(), local), checks)
    assert (report.estimate_usd, report.expected_hours, report.interval_s) == (1.5, 0.75, 42.0)
    msg = report.to_message(channel="C1", thread_ts="123.4", run_id="r-pre")
    assert isinstance(msg, PreflightMessage)
    assert [(c.name, c.status, c.remedy) for c in msg.checks] == [
        ("quota", "warn", "x"),
        ("budget", "pass", ""),
    ]
    assert msg.ok and msg.needs_confirmation and msg.estimate_usd == 1.5
    assert msg.interval_s == 42.0 and msg.thread_ts == "123.4"
    assert json.loads(json.dumps(report.as_dict()))["results"][1]["data"]["interval_s"] == 42.0


def test_without_figures_the_report_keeps_the_specs_interval(
    tmp_path: Path, local: LocalProvider
) -> None:
    job = spec(checkpoint={"interval": "30s"})
    report = run_preflight(context(tmp_path, job, local), [Fixed("q", result("q", Status.PASS))])
    assert report.interval_s == 30.0 and report.estimate_usd is None


def test_resource_request_and_assumed_mtbp(tmp_path: Path, local: LocalProvider) -> None:
    # The request is in the provider's terms: its name, and its own default region for a
    # spec that names none (no table of clouds' regions decides it).
    job = spec(resources={"accelerator": "A100:8", "spot": False})
    req = resource_request(job, local)
    assert (req.cloud, req.region, req.accelerator_type, req.accelerator_count) == (
        "local",
        local.capabilities.default_region,
        "A100",
        8,
    )
    assert req.spot is False and req.zones == ()
    named = spec(resources={"region": "elsewhere-1", "zones": ["elsewhere-1b"]})
    assert resource_request(named, local).region == "elsewhere-1"
    assert resource_request(named, local).zones == ("elsewhere-1b",)
    assert assumed_mtbp_s(local) == DEFAULT_SPOT_MTBP_S
    with LocalProvider(tmp_path / "s2", mean_time_between_preemptions_s=600) as preempting:
        assert assumed_mtbp_s(preempting) == 600
    assert [c.name for c in default_checks()] == list(CHECKS)


# -- the dry run -----------------------------------------------------------------------------


def test_disabled_dry_run_warns(tmp_path: Path, local: LocalProvider) -> None:
    job = spec(dry_run={"enabled": False})
    got = DryRunCheck().run(context(tmp_path, job, local), prior={})
    assert got.status is Status.WARN and "dry_run.enabled=true" in got.remedy


def test_dry_run_of_a_script_without_the_session_api_fails(
    tmp_path: Path, local: LocalProvider
) -> None:
    """The local provider's instances run on this machine, so its dry run runs here too."""
    ran = tmp_path / "ran"
    script = f"open({str(ran)!r}, 'w').close(); print('no checkpoints here')"
    job = spec(command=[sys.executable, "-c", script], dry_run={"steps": 2})
    assert local.capabilities.runs_on_this_machine
    got = DryRunCheck(timeout_s=60).run(context(tmp_path, job, local), prior={})
    assert ran.exists(), "the local provider's dry run runs the command on this machine"
    assert got.status is Status.FAIL
    assert "session API" in got.detail and "trainbot-runner dry-run" in got.remedy
    assert got.data["ok"] is False


@pytest.mark.slow
def test_full_preflight_with_the_real_dry_run(tmp_path: Path) -> None:
    from runner.dryrun import DryRunReport
    from runner.preemption import UNANNOUNCED_SHARE, daly_interval

    job = spec(command=TINY_COMMAND, budget={"usd": 5}, dry_run={"steps": 4})
    with LocalProvider(
        tmp_path / "state", gpu_names=[], spot_usd_per_hour=1.0, mean_time_between_preemptions_s=600
    ) as provider:
        ctx = context(tmp_path, job, provider, mtbp_s=assumed_mtbp_s(provider))
        names: list[str] = []
        report = run_preflight(ctx, on_result=lambda r: names.append(r.name))

        assert names == [
            "quota", "capacity", "instances", "data", "secrets", "image", "dry_run", "budget",
        ]  # fmt: skip
        statuses = {r.name: r.status for r in report.results}
        assert statuses == dict.fromkeys(names, Status.PASS), [r.detail for r in report.results]
        assert report.ok and not report.needs_confirmation

        dry = report.result("dry_run")
        assert dry is not None
        d = dry.data
        assert d["ok"] and d["steps_before_kill"] == 4 and d["steps_after_restore"] >= 2
        assert d["saved_sha256"] == d["restored_sha256"]
        assert d["checkpoint_bytes"] > 0 and d["write_s"] > 0 and d["restore_s"] > 0
        assert d["step_time_s"] > 0 and d["termination_window_s"] == 30.0
        assert d["emergency_fits_window"] is True and "30 s termination window" in dry.detail
        # checkpoint.interval is "auto": Daly's optimum for C = the measured stall and, as
        # the emergency checkpoint fits, M = 600 s ÷ the unannounced share; floored at W.
        assert 0 < d["stall_s"] < d["write_s"]
        assert d["interval_cost_s"] == d["stall_s"]
        assert d["interval_mtbp_s"] == pytest.approx(600.0 / UNANNOUNCED_SHARE)
        assert report.interval_s == pytest.approx(
            max(d["write_s"], daly_interval(d["stall_s"], 600.0 / UNANNOUNCED_SHARE))
        )
        assert d["interval_s"] == pytest.approx(report.interval_s)
        # The checkpoint went to the real store, in the dry run's own namespace, and is gone.
        namespace = tmp_path / "ck" / "r-pre-dry-run"
        assert d["store"].endswith("r-pre-dry-run") and namespace.is_dir()
        assert not list(namespace.rglob("manifest.json"))
        assert not (tmp_path / "ck" / "r-pre").exists()

        budget = report.result("budget")
        assert budget is not None and budget.data["interval_s"] == report.interval_s
        write, restore, tau = d["write_s"], d["restore_s"], d["interval_s"]
        # A save costs its stall; every preemption a flush and a restore; the unannounced
        # ones also half an interval of work.
        overhead = d["stall_s"] / tau + (write + restore) / 600.0 + tau / 2 / d["interval_mtbp_s"]
        hours = 100 * d["step_time_s"] * (1 + overhead) / 3600
        assert report.expected_hours == pytest.approx(hours)
        assert report.estimate_usd == pytest.approx(1.0 * hours)
        assert json.loads(json.dumps(report.as_dict()))["ok"] is True

        # The same measurements under a window too short for any flush: a warning.
        measured = DryRunReport(**{k: d[k] for k in asdict(DryRunReport())})
        with LocalProvider(tmp_path / "s2", termination_window_s=0.001) as tight:
            warned = DryRunCheck().evaluate(measured, context(tmp_path, job, tight))
        assert warned.status is Status.WARN
        assert "1 ms termination window" in warned.detail
        assert "smaller" in warned.remedy


# -- one larger instance ------------------------------------------------------------------


def multi_node(job: JobSpec, instances: int) -> JobSpec:
    """``job`` with N instances."""
    resources = job.resources.model_copy(update={"instances": instances})
    return job.model_copy(update={"resources": resources})


def gangs(**kw: Any) -> CloudAnswers:
    """A cloud that launches multi-node gangs in a placement group."""
    caps = Capabilities(
        runs_on_this_machine=False,
        termination_window_s=120.0,
        preemption_source="aws",
        default_region="us-east-1",
        gang_placement="cluster placement group",
    )
    return CloudAnswers(capabilities=caps, **kw)


def test_n_small_instances_that_one_type_holds_warn_with_both_prices(tmp_path: Path) -> None:
    provider = gangs(offers={2: "a2-highgpu-2g", 8: "a2-highgpu-8g"}, spot_usd=3.5)
    job = multi_node(spec(resources={"accelerator": "A100:2"}), 4)
    got = InstanceShapeCheck().run(context(tmp_path, job, provider), prior={})
    assert got.status is Status.WARN
    assert got.detail == (
        "4 instances of 2 × A100 (a2-highgpu-2g) cost $14.00/h spot; one a2-highgpu-8g "
        "holds all 8 for $3.50/h"
    )
    assert got.remedy.startswith(
        "prefer one a2-highgpu-8g: set resources.accelerator=A100:8 and resources.instances=1"
    )
    three = InstanceShapeCheck().run(context(tmp_path, multi_node(job, 3), provider), prior={})
    assert three.status is Status.PASS and "no single instance type" in three.detail
    assert "3 instances launched together (cluster placement group)" in three.detail
    one = InstanceShapeCheck().run(context(tmp_path, spec(), provider), prior={})
    assert one.status is Status.PASS and one.detail == "one instance"


def test_several_instances_fail_on_a_provider_that_launches_one(tmp_path: Path) -> None:
    job = multi_node(spec(resources={"accelerator": "A100:2"}), 2)
    got = InstanceShapeCheck().run(context(tmp_path, job, CloudAnswers()), prior={})
    assert got.status is Status.FAIL
    assert "launches one instance per attempt" in got.detail
    assert "resources.instances=1" in got.remedy


def test_several_instances_are_submitted_and_checked_with_the_larger_instance(
    tmp_path: Path, settings: Settings, db_engine: Engine
) -> None:
    """Through submit, as a chat command reaches it: N instances validate, and preflight
    says that one larger instance of this machine's catalogue (8 A100s, $1/h) holds it."""
    from jobs.domain.actor import Actor
    from jobs.usecases.service import submit

    with LocalProvider(
        tmp_path / "state", gpu_names=["NVIDIA A100-SXM4-40GB"] * 8, spot_usd_per_hour=1.0
    ) as provider:
        deps = Deps(
            settings=settings,
            engine=db_engine,
            provider=provider,
            notifier=ConsoleNotifier(io.StringIO()),
        )
        ada = Actor(user="ada", channel="#ml")
        run = submit(deps, spec_name="tiny", actor=ada, launch=False,
                     overrides=["resources.instances=4", "resources.accelerator=A100:2",
                                "dry_run.enabled=false"])  # fmt: skip
        job = JobSpec.model_validate(run.spec)
        assert job.resources.instances == 4
        got = InstanceShapeCheck().run(context(tmp_path, job, provider), prior={})
        assert got.status is Status.WARN
        assert got.detail == (
            "4 instances of 2 × A100 (local) cost $4.00/h spot; one local holds all 8 for $1.00/h"
        )
        deps.close()
