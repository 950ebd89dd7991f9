"""Issue 12 (item 3) at the control plane's level, on GCP: when every zone of the first
region is out of spot capacity, the next attempt goes to the next region of
``resources.regions``, with the real google-cloud-compute client against the local fake
Compute Engine API. The control plane is built as in :mod:`tests.jobs.test_preflight_cloud`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from google.auth.credentials import AnonymousCredentials

from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import TextMessage
from jobs.providers.base import InstanceState
from jobs.providers.gcp import GcpProvider
from jobs.runs import reconcile
from jobs.usecases import service
from tests.fakes.gce_api import FakeComputeApi
from tests.jobs.test_aws_control_plane import (
    attempt_launched,
    attempts_of,
    run_row,
    wait_until,
)
from tests.jobs.test_preflight_cloud import ADA, RUNNER_SA, control_plane

CENTRAL, EAST = "us-central1", "us-east1"
# The fake leaves the second zone of each region without A100s.
CENTRAL_A100 = ("us-central1-a", "us-central1-c", "us-central1-f")
EAST_ZONES = ("us-east1-b", "us-east1-c", "us-east1-d")


@pytest.fixture
def gce() -> Iterator[FakeComputeApi]:
    zones = {CENTRAL: ["us-central1-a", "us-central1-b", *CENTRAL_A100[1:]], EAST: EAST_ZONES}
    with FakeComputeApi(regions=zones) as api:
        api.buckets["ckpt-bucket"] = "US"  # a multi-region store: in both regions
        yield api


#: An A100 run allowed both regions, without a dry run.
SPEC = (
    "command: ['python', 'train.py']\n"
    "resources:\n  cloud: gcp\n  accelerator: A100:1\n"
    f"  regions: [{CENTRAL}, {EAST}]\n"
    "budget:\n  usd: 50\n"
    "dry_run:\n  enabled: false\n"
)


def _central_full(gce: FakeComputeApi) -> GcpProvider:
    """The provider in us-central1, allowed us-east1, with every A100 zone of
    us-central1 out of capacity."""
    gcp = GcpProvider(
        project=gce.project,
        region=CENTRAL,
        regions=[EAST],
        api_endpoint=gce.url,
        credentials=AnonymousCredentials(),
        service_account=RUNNER_SA,
    )
    for zone in CENTRAL_A100:
        gce.exhaust(zone)
    return gcp


def test_a_region_out_of_capacity_moves_the_run_to_the_next_region(
    tmp_path: Path, gce: FakeComputeApi
) -> None:
    gcp = _central_full(gce)
    spec_yaml = SPEC + "resubmit:\n  backoff_s: 0\n"
    env = {
        "TRAINBOT_GCP_PROJECT": gce.project,
        "TRAINBOT_CHECKPOINT_URI": "gs://ckpt-bucket/default",
    }
    with control_plane(tmp_path, gcp, spec_yaml, **env) as (cp, notes):
        run = service.submit(cp.deps, spec_name="owned", overrides=[], actor=ADA)
        wait_until(lambda: run_row(cp, run.id).state != RunState.PREFLIGHT, what="preflight")
        assert run_row(cp, run.id).state == RunState.AWAITING_CONFIRMATION, run_row(
            cp, run.id
        ).reason
        service.confirm(cp.deps, run.id, ADA)
        wait_until(lambda: attempt_launched(cp, run.id, 4), what="attempt 4")
        *refused, fourth = attempts_of(cp, run.id)
        # Each A100 zone of the first region refused in turn; then the second region.
        assert [(a.region, a.zone) for a in refused] == [(CENTRAL, z) for z in CENTRAL_A100]
        assert all(a.state == AttemptState.FAILED for a in refused)
        assert (fourth.region, fourth.zone, fourth.spot) == (EAST, EAST_ZONES[0], True)
        # The instance is in that zone, found there by status; its quota was read first.
        assert fourth.instance_id is not None
        assert fourth.instance_id.startswith(f"{EAST_ZONES[0]}/")
        [inst] = gce.instances()
        assert inst["zone"].endswith(f"/zones/{EAST_ZONES[0]}")
        assert inst["scheduling"]["provisioningModel"] == "SPOT"
        assert gce.calls("GET", rf"/regions/{EAST}$"), "the second region's quota was read"
        assert gcp.status(fourth.instance_id).state in (
            InstanceState.PENDING,
            InstanceState.RUNNING,
        )
        said = [
            m.text
            for m in notes.posted
            if isinstance(m, TextMessage)
            and m.run_id == run.id
            and m.text.startswith("Attempt 4 launched")
        ]
        assert len(said) == 1 and f"It runs in {EAST}: no spot capacity in {CENTRAL}: " in said[0]
        # Reconcile knows the instance (no orphan), and stop deletes it there.
        assert reconcile(cp.deps)["orphans"] == 0
        service.stop(cp.deps, run.id, ADA)
        wait_until(
            lambda: attempts_of(cp, run.id)[-1].state == AttemptState.TERMINATED, what="stop"
        )
        assert gcp.status(fourth.instance_id).state is InstanceState.TERMINATED
    assert gce.instances() == []


@pytest.mark.parametrize(
    ("location", "moves"),
    [("NAM4", True), ("us-central1", False)],
    ids=["dual-region-covers-both", "regional-bucket-elsewhere"],
)
def test_the_checkpoint_bucket_decides_whether_the_run_may_move_region(
    tmp_path: Path, gce: FakeComputeApi, location: str, moves: bool
) -> None:
    """With us-central1 full, the run moves to us-east1 only where its checkpoint bucket
    is: a dual-region (NAM4: us-central1 and us-east1) covers it; a us-central1 bucket
    does not, so the region is skipped with a message and the run fails naming it."""
    gce.buckets["ckpt-here"] = location
    gcp = _central_full(gce)
    # One pass over the regions, then FAILED: no waiting for capacity to come back.
    spec_yaml = SPEC + "resubmit:\n  backoff_s: 0\n  wait_for_capacity: 0\n"
    env = {
        "TRAINBOT_GCP_PROJECT": gce.project,
        "TRAINBOT_CHECKPOINT_URI": "gs://ckpt-here/default",
    }
    with control_plane(tmp_path, gcp, spec_yaml, **env) as (cp, notes):
        run = service.submit(cp.deps, spec_name="owned", overrides=[], actor=ADA)
        wait_until(lambda: run_row(cp, run.id).state != RunState.PREFLIGHT, what="preflight")
        service.confirm(cp.deps, run.id, ADA)
        if moves:
            wait_until(lambda: attempt_launched(cp, run.id, 4), what="attempt 4")
            assert attempts_of(cp, run.id)[-1].region == EAST
            service.stop(cp.deps, run.id, ADA)
            wait_until(
                lambda: attempts_of(cp, run.id)[-1].state == AttemptState.TERMINATED,
                what="stop",
            )
            return
        wait_until(lambda: run_row(cp, run.id).state == RunState.FAILED, what="FAILED")
        reason = run_row(cp, run.id).reason or ""
        assert (
            f"{EAST} skipped: the checkpoint store gs://ckpt-here/default is in {CENTRAL} "
            "(set resources.allow_cross_region_data=true to use it from there)"
        ) in reason, reason
        assert all(a.region == CENTRAL for a in attempts_of(cp, run.id))
        assert gce.instances() == []
        said = [m.text for m in notes.posted if isinstance(m, TextMessage) and m.run_id == run.id]
        assert f"Run {run.id} failed: {reason}." in said
