"""Issue 24 (points 1 and 2): where a run goes is the provider's to say, and the spec picks
the provider.

1. A spec that names no region runs in its provider's own region (``TRAINBOT_AWS_REGION``,
   ``TRAINBOT_GCP_REGION``), on moto and on the fake Compute API: no table of clouds'
   default regions decides it.
2. One control plane configures several providers (``TRAINBOT_PROVIDERS``): a spec's
   ``resources.cloud`` picks one, and an unconfigured one is refused at preflight with
   what to set. The cards name where each run is.

The control planes are built as in :mod:`tests.jobs.test_aws_control_plane` and
:mod:`tests.jobs.test_gcp_failover`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from google.auth.credentials import AnonymousCredentials

from bot import messages
from jobs.domain.errors import SettingsError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal, RunCard
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.providers import base
from jobs.providers.aws import AwsProvider
from jobs.providers.base import InstanceState, Provider
from jobs.providers.gcp import GcpProvider
from jobs.runs import reconcile
from jobs.usecases import service
from tests.fakes import aws as fake
from tests.fakes.gce_api import FakeComputeApi
from tests.jobs import test_aws_control_plane as on_aws
from tests.jobs.test_aws_control_plane import (
    ADA,
    G_ON_DEMAND,
    G_SPOT,
    PUBLIC_URL,
    Recorder,
    attempt_launched,
    attempts_of,
    run_row,
    stub,
    stub_quotas,
    stub_scores,
    tags,
    wait_until,
)
from tests.jobs.test_preflight_cloud import RUNNER_SA

#: Not the region any table of defaults would pick.
EU = "eu-west-1"
GCP_EU = "europe-west4"


def settings_for(tmp_path: Path, spec_yaml: str, **env: str) -> Any:
    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    (specs / "job.yaml").write_text(spec_yaml)
    return load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_SPECS_DIR": str(specs),
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_PUBLIC_URL": PUBLIC_URL,
            **env,
        }
    )


@contextmanager
def started(
    settings: Any, *, provider: Provider | None = None, providers: tuple[Provider, ...] = ()
) -> Iterator[tuple[ControlPlane, Recorder]]:
    notes = Recorder()
    journal = CallbackJournal(lambda t, run, data: None)
    cp = ControlPlane(
        settings,
        notifier=notes,
        journal=journal,
        provider=provider,
        providers=providers,
        scheduler=False,
    )
    with cp:
        yield cp, notes


def confirmed(cp: ControlPlane) -> str:
    """Submit ``job``, which warns (no dry run); launch it anyway."""
    run = service.submit(cp.deps, spec_name="job", overrides=[], actor=ADA)
    wait_until(lambda: run_row(cp, run.id).state != RunState.PREFLIGHT, what="preflight")
    assert run_row(cp, run.id).state == RunState.AWAITING_CONFIRMATION, run_row(cp, run.id).reason
    service.confirm(cp.deps, run.id, ADA)
    wait_until(lambda: attempt_launched(cp, run.id, 1), what="attempt 1")
    return run.id


def last_card(notes: Recorder, run_id: str) -> RunCard:
    cards = [m for _, m in notes.updated if isinstance(m, RunCard) and m.run_id == run_id]
    assert cards, f"no card for {run_id}"
    return cards[-1]


def stopped(cp: ControlPlane, run_id: str) -> None:
    service.stop(cp.deps, run_id, ADA)
    wait_until(lambda: attempts_of(cp, run_id)[-1].state == AttemptState.TERMINATED, what="stop")


# -- 1. the provider's own region ----------------------------------------------------------


def test_on_aws_a_spec_without_a_region_launches_in_trainbot_aws_region(
    tmp_path: Path, moto: dict[str, Any], stubbers: list[Stubber]
) -> None:
    url = moto["url"]
    image = fake.client("ec2", url, region=EU).describe_images(Owners=["amazon"])["Images"][0]
    bucket = fake.unique_bucket(url, region=EU, prefix="eu-ckpt")
    spec_yaml = (
        f"command: {on_aws.COMMAND}\n"
        "resources:\n  cloud: aws\n  accelerator: A10G:1\n"  # no region, no zones
        f"checkpoint:\n  uri: s3://{bucket}/ckpt\n"
        "budget:\n  usd: 50\n"
        "dry_run:\n  enabled: false\n"
    )
    settings = settings_for(
        tmp_path,
        spec_yaml,
        TRAINBOT_PROVIDER="aws",
        TRAINBOT_AWS_REGION=EU,
        TRAINBOT_AWS_ENDPOINT_URL=url,
        TRAINBOT_AWS_IMAGE_ID=image["ImageId"],
        TRAINBOT_AWS_INSTANCE_PROFILE="trainbot-runner",
        TRAINBOT_CHECKPOINT_URI=f"s3://{bucket}/default",
        TRAINBOT_CHECKPOINT_LOCATIONS=f"s3://{bucket}",
    )
    # The provider is built from the settings, as `trainbot serve` builds it.
    with started(settings) as (cp, notes):
        aws = cp.deps.provider
        assert isinstance(aws, AwsProvider) and aws.capabilities.default_region == EU
        # Service Quotas in eu-west-1 only (an ask in another region finds no answer).
        sq = stub(stubbers, aws.client("service-quotas", region=EU))
        for code in (G_SPOT, G_ON_DEMAND):
            sq.add_response(
                "get_service_quota",
                fake.quota(code, 64, region=EU),
                {"ServiceCode": "ec2", "QuotaCode": code},
            )
        ids = fake.zone_ids(url, region=EU)
        scores = stub(stubbers, aws.client("ec2", region=EU, advisory=True))
        for _ in range(4):
            scores.add_response(
                "get_spot_placement_scores",
                fake.placement_scores({ids[f"{EU}a"]: 9}, region=EU),
                {
                    "InstanceTypes": ["g5.xlarge"],
                    "TargetCapacity": 1,
                    "TargetCapacityUnitType": "units",
                    "SingleAvailabilityZone": True,
                    "RegionNames": [EU],
                },
            )
        run_id = confirmed(cp)
        sq.assert_no_pending_responses()
        quota = next(c for c in notes.preflight(run_id).checks if c.name == "quota")
        assert EU in quota.detail, quota.detail
        [attempt] = attempts_of(cp, run_id)
        assert (attempt.provider, attempt.region) == ("aws", EU)
        assert attempt.zone is not None and attempt.zone.startswith(EU)
        # The instance is in eu-west-1 on moto, and nowhere else.
        pages = fake.client("ec2", url, region=EU).get_paginator("describe_instances")
        found = [
            i
            for page in pages.paginate()
            for r in page["Reservations"]
            for i in r["Instances"]
            if tags(i).get(base.TAG_RUN_ID) == run_id
        ]
        assert [i["InstanceId"] for i in found] == [attempt.instance_id]
        assert found[0]["Placement"]["AvailabilityZone"] == attempt.zone
        assert on_aws.instances_of(url, run_id) == [], "nothing in us-east-1"
        card = last_card(notes, run_id)
        assert (card.region, card.provider) == (EU, "aws")
        assert f"in {EU} on aws" in messages.run_card(card)
        stopped(cp, run_id)


def test_on_gcp_a_spec_without_a_region_launches_in_trainbot_gcp_region(
    tmp_path: Path,
) -> None:
    with FakeComputeApi() as gce:
        gce.buckets["ckpt-eu"] = GCP_EU.upper()
        # As from_settings builds it with TRAINBOT_GCP_REGION, with the fake's endpoint and
        # anonymous credentials (which settings cannot carry).
        gcp = GcpProvider(
            project=gce.project,
            region=GCP_EU,
            api_endpoint=gce.url,
            credentials=AnonymousCredentials(),
            service_account=RUNNER_SA,
        )
        spec_yaml = (
            "command: ['python', 'train.py']\n"
            "resources:\n  cloud: gcp\n  accelerator: A100:1\n"  # no region
            "budget:\n  usd: 50\n"
            "dry_run:\n  enabled: false\n"
        )
        settings = settings_for(
            tmp_path,
            spec_yaml,
            TRAINBOT_PROVIDER="gcp",
            TRAINBOT_GCP_PROJECT=gce.project,
            TRAINBOT_GCP_REGION=GCP_EU,
            TRAINBOT_CHECKPOINT_URI="gs://ckpt-eu/default",
        )
        with started(settings, provider=gcp) as (cp, notes):
            run_id = confirmed(cp)
            [attempt] = attempts_of(cp, run_id)
            assert (attempt.provider, attempt.region) == ("gcp", GCP_EU)
            assert attempt.instance_id is not None and attempt.instance_id.startswith(GCP_EU)
            [inst] = gce.instances()
            assert f"/zones/{GCP_EU}-" in inst["zone"]
            assert gce.calls("GET", rf"/regions/{GCP_EU}$"), "its quota was read there"
            assert not gce.calls("GET", r"/regions/us-central1$")
            card = last_card(notes, run_id)
            assert f"in {GCP_EU} on gcp" in messages.run_card(card)
            stopped(cp, run_id)
            assert gcp.status(attempt.instance_id).state is InstanceState.TERMINATED
        assert gce.instances() == []


# -- 2. several providers, chosen by the spec ------------------------------------------------


def test_one_control_plane_runs_each_spec_on_the_cloud_it_names(
    tmp_path: Path,
    moto: dict[str, Any],
    session: boto3.session.Session,
    stubbers: list[Stubber],
) -> None:
    url, bucket = moto["url"], moto["bucket"]
    aws = on_aws.make_aws(moto, session)
    stub_quotas(stubbers, aws, (G_SPOT, 64), (G_ON_DEMAND, 64))
    stub_scores(stubbers, aws, url=url, calls=4)
    local_store = (tmp_path / "local-ckpt").as_uri()
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "on-aws.yaml").write_text(on_aws.spec_yaml(bucket))
    (specs / "on-local.yaml").write_text(
        f"command: ['{sys.executable}', '-c', 'import time; time.sleep(120)']\n"
        f"resources:\n  cloud: local\n  disk_gb: 1\n"
        f"checkpoint:\n  uri: {local_store}\n"
        "dry_run:\n  enabled: false\n"
    )
    (specs / "on-gcp.yaml").write_text(
        "command: ['python', 'train.py']\nresources:\n  cloud: gcp\n  accelerator: A100:1\n"
    )
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_SPECS_DIR": str(specs),
            "TRAINBOT_PROVIDER": "local",
            "TRAINBOT_PROVIDERS": "local,aws",
            "TRAINBOT_CHECKPOINT_URI": f"s3://{bucket}/default",
            "TRAINBOT_CHECKPOINT_LOCATIONS": f"s3://{bucket},{local_store}",
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_PUBLIC_URL": PUBLIC_URL,
        }
    )
    with started(settings, providers=(aws,)) as (cp, notes):
        assert list(cp.deps.providers) == ["local", "aws"]
        assert cp.deps.provider.name == "local", "TRAINBOT_PROVIDER is the default"
        local = cp.deps.providers["local"]

        # `cloud: gcp`: refused at preflight, saying what an admin sets; nothing launched.
        refused = service.submit(cp.deps, spec_name="on-gcp", overrides=[], actor=ADA)
        wait_until(lambda: run_row(cp, refused.id).state != RunState.PREFLIGHT, what="refusal")
        assert run_row(cp, refused.id).state == RunState.PREFLIGHT_FAILED
        [check] = notes.preflight(refused.id).checks
        assert (check.name, check.status) == ("provider", "fail")
        assert "the gcp provider is not configured" in check.detail
        assert "TRAINBOT_PROVIDERS=local,aws,gcp" in check.detail
        assert "TRAINBOT_GCP_*" in check.detail
        assert "resources.cloud" in check.remedy
        assert attempts_of(cp, refused.id) == []

        # `cloud: aws`: on moto, in the AWS provider's region.
        on_ec2 = service.submit(cp.deps, spec_name="on-aws", overrides=[], actor=ADA)
        wait_until(lambda: run_row(cp, on_ec2.id).state != RunState.PREFLIGHT, what="preflight")
        service.confirm(cp.deps, on_ec2.id, ADA)
        wait_until(lambda: attempt_launched(cp, on_ec2.id, 1), what="aws attempt")
        [ec2_attempt] = attempts_of(cp, on_ec2.id)
        assert (ec2_attempt.provider, ec2_attempt.region) == ("aws", on_aws.REGION)
        [inst] = on_aws.instances_of(url, on_ec2.id)
        assert inst["InstanceId"] == ec2_attempt.instance_id
        assert local.list_instances() == [], "nothing of it on this machine"
        card = last_card(notes, on_ec2.id)
        assert f"in {on_aws.REGION} on aws" in messages.run_card(card)

        # `cloud: local`: a process on this machine, not an EC2 instance.
        here = service.submit(cp.deps, spec_name="on-local", overrides=[], actor=ADA)
        wait_until(lambda: run_row(cp, here.id).state != RunState.PREFLIGHT, what="preflight")
        assert run_row(cp, here.id).state == RunState.AWAITING_CONFIRMATION
        service.confirm(cp.deps, here.id, ADA)
        wait_until(lambda: attempt_launched(cp, here.id, 1), what="local attempt")
        [local_attempt] = attempts_of(cp, here.id)
        assert local_attempt.provider == "local"
        assert local_attempt.region == local.capabilities.default_region
        assert local_attempt.instance_id is not None
        assert local.status(local_attempt.instance_id).state in (
            InstanceState.PENDING,
            InstanceState.RUNNING,
        )
        assert on_aws.instances_of(url, here.id) == [], "nothing of it on EC2"
        assert last_card(notes, here.id).provider == "local"

        # Reconcile watches both providers: each attempt is found on its own provider
        # (asked of the other, its instance would be "vanished"), and neither is an orphan.
        counts = reconcile(cp.deps)
        assert (counts["lost"], counts["ended"]) == (0, 0), counts
        for run_id, on in ((on_ec2.id, aws), (here.id, local)):
            [attempt] = attempts_of(cp, run_id)
            assert not attempt.state.is_terminal(), (run_id, attempt.end_reason)
            assert not on.status(attempt.instance_id or "").state.is_terminal()

        # Stopping each ends its instance on its own provider.
        stopped(cp, on_ec2.id)
        stopped(cp, here.id)
        assert aws.status(ec2_attempt.instance_id or "").state is InstanceState.TERMINATED
        assert local.status(local_attempt.instance_id).state.is_terminal()


def test_an_unknown_provider_name_in_the_settings_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings({"TRAINBOT_PROVIDERS": "local,azure"})
    assert "TRAINBOT_PROVIDERS" in str(caught.value)
    assert "expected one of 'local', 'aws' or 'gcp' (not 'azure')" in str(caught.value)
