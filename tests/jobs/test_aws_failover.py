"""Issue 12 (items 2 and 3) at the control plane's level, on AWS: where an attempt goes
when spot capacity runs out, on moto behind the EC2 gate of the control-plane tests.

The gate answers ``RunInstances`` with EC2's ``InsufficientInstanceCapacity`` where the
test says a market or a region is out of capacity; everything else is moto's. These
reuse the fixtures of :mod:`tests.jobs.test_aws_control_plane`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from jobs.database.models import Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import TextMessage
from jobs.preflight.interval import request_in
from jobs.process.bootstrap import ControlPlane
from jobs.providers.aws import AwsProvider
from jobs.providers.base import InstanceState
from jobs.runs import reconcile, spec_of
from jobs.usecases import service
from tests.fakes import aws as fake
from tests.jobs import test_aws_control_plane as base
from tests.jobs.test_aws_control_plane import (
    ADA,
    G_ON_DEMAND,
    G_SPOT,
    RANKED,
    REGION,
    ZONES,
    Ec2Gate,
    Recorder,
    Refusal,
    attempt_launched,
    attempts_of,
    control_plane,
    instances_of,
    run_row,
    stub_quotas,
    stub_scores,
    wait_until,
)

# The control-plane tests' fixtures, under their own names.
gate = base.gate

WEST = "us-west-2"
NO_ROOM = "We currently do not have sufficient g5.xlarge capacity in the zone you requested"


def _aws(moto: dict[str, Any], session: boto3.session.Session, gate: Ec2Gate) -> AwsProvider:
    """The provider behind the gate, with an AMI that both regions have (moto's own)."""
    east = fake.client("ec2", moto["url"]).describe_images(Owners=["amazon"])["Images"]
    west = fake.client("ec2", moto["url"], region=WEST).describe_images(Owners=["amazon"])
    common = sorted({i["ImageId"] for i in east} & {i["ImageId"] for i in west["Images"]})
    return AwsProvider(
        region=REGION,
        endpoint_url=gate.url,
        image_id=common[0],
        instance_profile="trainbot-runner",
        session=session,
    )


@dataclass
class Gated:
    """moto behind the EC2 gate: the provider (an AMI both regions have, 64 vCPUs of spot
    and of on-demand quota), the test's Stubbers, and moto's URL and checkpoint bucket."""

    aws: AwsProvider
    gate: Ec2Gate
    stubbers: list[Stubber]
    url: str
    bucket: str

    def scores(self, calls: int) -> None:
        """Spot placement scores for up to ``calls`` capacity questions."""
        stub_scores(self.stubbers, self.aws, url=self.url, calls=calls)


@pytest.fixture
def gated(
    moto: dict[str, Any],
    session: boto3.session.Session,
    stubbers: list[Stubber],
    gate: Ec2Gate,
) -> Gated:
    aws = _aws(moto, session, gate)
    stub_quotas(stubbers, aws, (G_SPOT, 64), (G_ON_DEMAND, 64))
    return Gated(aws, gate, stubbers, moto["url"], moto["bucket"])


def _no_spot(form: Mapping[str, str]) -> Refusal | None:
    """EC2 has no spot capacity in any zone (a 400, so botocore does not retry it)."""
    spot = form.get("InstanceMarketOptions.MarketType") == "spot"
    if spot and form.get("DryRun") != "true":
        return (400, "InsufficientInstanceCapacity", NO_ROOM)
    return None


def _confirmed(cp: ControlPlane, *overrides: str) -> Run:
    run = service.submit(cp.deps, spec_name="gpu", overrides=list(overrides), actor=ADA)
    wait_until(lambda: run_row(cp, run.id).state != RunState.PREFLIGHT, what="preflight")
    assert run_row(cp, run.id).state == RunState.AWAITING_CONFIRMATION, run_row(cp, run.id).reason
    service.confirm(cp.deps, run.id, ADA)
    return run


def _thread(notes: Recorder, run_id: str) -> list[str]:
    return [m.text for m in notes.posted if isinstance(m, TextMessage) and m.run_id == run_id]


def _market(form: Mapping[str, str]) -> str:
    return form.get("InstanceMarketOptions.MarketType", "on-demand")


def test_no_spot_capacity_falls_back_to_on_demand_and_the_next_attempt_tries_spot(
    tmp_path: Any, gated: Gated
) -> None:
    aws, gate, url = gated.aws, gated.gate, gated.url
    gated.scores(12)
    gate.refuse = _no_spot
    with control_plane(tmp_path, aws, gated.bucket) as (cp, records, notes):
        run = _confirmed(cp, "resources.on_demand_fallback=true")
        # Spot is refused in each zone in turn; the fourth attempt runs on-demand.
        wait_until(lambda: attempt_launched(cp, run.id, 4), what="attempt 4")
        *refused, fourth = attempts_of(cp, run.id)
        assert [(a.zone, a.spot, a.state) for a in refused] == [
            (zone, True, AttemptState.FAILED) for zone in RANKED
        ]
        assert not fourth.spot and fourth.region == REGION and fourth.zone in ZONES
        assert [_market(f) for f in gate.launches()] == ["spot"] * 3 + ["on-demand"]
        [inst] = instances_of(url, run.id)
        assert inst["InstanceId"] == fourth.instance_id
        assert inst.get("InstanceLifecycle") != "spot" and "SpotInstanceRequestId" not in inst
        # Charged the on-demand price, and the thread says so, and why.
        quote = aws.price(
            request_in(spec_of(run_row(cp, run.id)), REGION, spot=False, provider=aws)
        )
        assert fourth.price_per_hour == quote.on_demand_usd_per_hour
        assert fourth.price_per_hour != quote.spot_usd_per_hour
        said = [t for t in _thread(notes, run.id) if t.startswith("Attempt 4 runs on-demand")]
        assert len(said) == 1, _thread(notes, run.id)
        assert said[0].startswith(
            f"Attempt 4 runs on-demand at ${quote.on_demand_usd_per_hour:.2f}/h: "
            f"no spot capacity in {REGION}: {RANKED[0]}: EC2 has no spot capacity"
        )
        assert "The next attempt tries spot first." in said[0]
        launched = [r for r in records if r["type"] == "launched"]
        assert [(r["attempt"], r["spot"]) for r in launched] == [(4, False)]

        # Spot is back; the on-demand instance ends: the next attempt asks for spot first.
        gate.refuse = lambda form: None
        assert fourth.instance_id is not None
        fake.interrupt(fourth.instance_id, at=fourth.started_at or fourth.created_at)
        assert reconcile(cp.deps)["ended"] == 1
        wait_until(lambda: attempt_launched(cp, run.id, 5), what="attempt 5")
        fifth = attempts_of(cp, run.id)[-1]
        assert fifth.spot and fifth.state == AttemptState.PROVISIONING
        assert _market(gate.launches()[-1]) == "spot"
        service.stop(cp.deps, run.id, ADA)
        wait_until(
            lambda: attempts_of(cp, run.id)[-1].state == AttemptState.TERMINATED, what="stop"
        )


def test_no_spot_capacity_without_the_fallback_fails_naming_the_zones(
    tmp_path: Any, gated: Gated
) -> None:
    aws, gate, url = gated.aws, gated.gate, gated.url
    gated.scores(8)
    gate.refuse = _no_spot
    with control_plane(tmp_path, aws, gated.bucket) as (cp, records, notes):
        run = _confirmed(cp, "resubmit.wait_for_capacity=0")  # one pass, as it was
        wait_until(lambda: run_row(cp, run.id).state == RunState.FAILED, what="FAILED")
        reason = run_row(cp, run.id).reason or ""
        assert reason.startswith(f"no spot capacity in any allowed zone ({REGION}: ")
        for zone in ZONES:
            assert f"{zone}: EC2 has no spot capacity for g5.xlarge in {zone}" in reason
        assert "InsufficientInstanceCapacity" in reason
        assert "resources.on_demand_fallback=true" in reason
        assert [_market(f) for f in gate.launches()] == ["spot"] * 3, "never on-demand"
        assert len(attempts_of(cp, run.id)) == 3
        assert instances_of(url, run.id) == []
        assert f"Run {run.id} failed: {reason}." in _thread(notes, run.id)
        assert [r["reason"] for r in records if r["type"] == "run_finished"] == [reason]


def _east_is_full(form: Mapping[str, str]) -> Refusal | None:
    zone = form.get("Placement.AvailabilityZone", "")
    if zone.startswith(REGION) and form.get("DryRun") != "true":
        return (400, "InsufficientInstanceCapacity", NO_ROOM)
    return None


def test_a_region_out_of_capacity_moves_the_run_to_the_next_region(
    tmp_path: Any, gated: Gated
) -> None:
    aws, gate, stubbers, url = gated.aws, gated.gate, gated.stubbers, gated.url
    gated.scores(8)
    # The second region's quota is read before anything launches there.
    west_quotas = Stubber(aws.client("service-quotas", region=WEST))
    west_quotas.activate()
    stubbers.append(west_quotas)
    for code in (G_SPOT, G_ON_DEMAND):
        west_quotas.add_response(
            "get_service_quota",
            fake.quota(code, 64, region=WEST),
            {"ServiceCode": "ec2", "QuotaCode": code},
        )
    gate.refuse = _east_is_full
    with control_plane(tmp_path, aws, gated.bucket) as (cp, records, notes):
        # The checkpoint bucket is in the first region: the spec accepts saving across.
        run = _confirmed(
            cp,
            f"resources.regions=[{REGION}, {WEST}]",
            "resources.allow_cross_region_data=true",
        )
        wait_until(lambda: attempt_launched(cp, run.id, 4), what="attempt 4")
        *refused, fourth = attempts_of(cp, run.id)
        assert [(a.region, a.zone) for a in refused] == [(REGION, zone) for zone in RANKED]
        assert (fourth.region, fourth.spot) == (WEST, True)
        assert fourth.zone is not None and fourth.zone.startswith(WEST)
        west_quotas.assert_no_pending_responses()
        # The instance is in the second region, found there by status.
        assert fourth.instance_id is not None and fourth.instance_id.startswith(f"{WEST}/")
        pages = fake.client("ec2", url, region=WEST).describe_instances(
            InstanceIds=[fourth.instance_id.removeprefix(f"{WEST}/")]
        )
        [inst] = [i for r in pages["Reservations"] for i in r["Instances"]]
        assert inst["Placement"]["AvailabilityZone"] == fourth.zone
        assert inst["InstanceLifecycle"] == "spot"
        assert instances_of(url, run.id) == [], "nothing in the first region"
        assert cp.deps.provider.status(fourth.instance_id).state in (
            InstanceState.PENDING,
            InstanceState.RUNNING,
        )
        said = [t for t in _thread(notes, run.id) if t.startswith("Attempt 4 launched")]
        assert len(said) == 1 and f"It runs in {WEST}: no spot capacity in {REGION}: " in said[0]
        launched = [(r["attempt"], r["region"]) for r in records if r["type"] == "launched"]
        assert launched == [(4, WEST)]
        # Reconcile knows the instance (no orphan), and stop terminates it there.
        assert reconcile(cp.deps)["orphans"] == 0
        service.stop(cp.deps, run.id, ADA)
        wait_until(
            lambda: attempts_of(cp, run.id)[-1].state == AttemptState.TERMINATED, what="stop"
        )
        assert cp.deps.provider.status(fourth.instance_id).state is InstanceState.TERMINATED


def test_a_region_without_the_checkpoint_bucket_is_skipped_with_a_message(
    tmp_path: Any, gated: Gated
) -> None:
    """The first region is out of capacity; the second does not hold the run's checkpoint
    bucket (S3: one region), so the failover skips it, saying why, as it would for the
    dataset: nothing launches there, and the run fails naming both."""
    aws, gate = gated.aws, gated.gate
    bucket = gated.bucket
    gated.scores(8)
    gate.refuse = _east_is_full
    with control_plane(tmp_path, aws, bucket) as (cp, _, notes):
        run = _confirmed(
            cp, f"resources.regions=[{REGION}, {WEST}]", "resubmit.wait_for_capacity=0"
        )
        # Preflight said so already: the run can go to the first region only.
        data = (run_row(cp, run.id).preflight or {})["results"]
        [check] = [r for r in data if r["name"] == "data"]
        assert check["data"]["usable_regions"] == [REGION], check
        wait_until(lambda: run_row(cp, run.id).state == RunState.FAILED, what="FAILED")
        reason = run_row(cp, run.id).reason or ""
        skipped = (
            f"{WEST} skipped: the checkpoint store s3://{bucket}/ckpt is in {REGION} "
            "(set resources.allow_cross_region_data=true to use it from there)"
        )
        assert skipped in reason, reason
        assert all(a.region == REGION for a in attempts_of(cp, run.id))
        assert not any(
            f.get("Placement.AvailabilityZone", "").startswith(WEST) for f in gate.launches()
        )
        assert f"Run {run.id} failed: {reason}." in _thread(notes, run.id)
