"""Issue 5 at the control plane's level, on AWS: a real control plane (database, service
layer, ingest API, reconcile) wired to an AwsProvider that talks to moto's server.

moto answers EC2, S3, IAM, STS and Budgets over HTTP. Where it has nothing, the edge is
faked as the provider tests do (``tests/fakes/aws.py``): botocore's Stubber for Service
Quotas and for STS's decoding of an authorization failure, and moto's own model for a
spot interruption. EC2's refusals of ``RunInstances`` (no capacity in one zone, a denied
``iam:PassRole``) come from :class:`Ec2Gate`, a pass-through HTTP proxy in front of moto
that answers those calls with EC2's own error XML, so the provider's clients, retries
and parsers see exactly what AWS sends. Stubber cannot do this: it answers every call of
a client in a fixed order, and here background threads make the calls.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlparse

import boto3
import pytest
from botocore.stub import Stubber
from sqlmodel import col, select

from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run, hash_token
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal, Message, MessageRef, PreflightMessage
from jobs.preflight import PreflightContext, PreflightReport, Status, run_preflight
from jobs.preflight import resource_request as preflight_request
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.providers import base
from jobs.providers.aws import AwsProvider, budget_name
from jobs.providers.base import InstanceState, LaunchRequest
from jobs.runs import reconcile, resource_request, runner_command, runner_env, spec_of
from jobs.spec import JobSpec, parse_spec
from jobs.usecases import service
from jobs.usecases.service import Actor
from runner.wire import Event, encode_batch
from tests.fakes import aws as fake
from tests.fakes.aws import stub
from tests.fakes.loopback import LoopbackServer, QuietHandler, read_body, reply
from tests.jobs.rows import all_detached, detached
from tests.waiting import wait_until

REGION = "us-east-1"
#: Zones of moto's us-east-1 that offer g5.xlarge (A10G:1), as the spec lists them...
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c")
#: ...and their spot placement scores, which rank them: the run tries c, then a, then b.
SCORES = {"us-east-1c": 9, "us-east-1a": 6, "us-east-1b": 3}
RANKED = ("us-east-1c", "us-east-1a", "us-east-1b")
G_SPOT, G_ON_DEMAND = "L-3819A6DF", "L-DB2E81BA"
P5_SPOT, P_ON_DEMAND = "L-C4BD4855", "L-417A185B"
ADA = Actor(user="ada", channel="#ml")
#: Where instances would reach the control plane (never dialled in these tests).
PUBLIC_URL = "https://trainbot.example.test"
COMMAND = "python train.py --steps 1000"


# -- the network edge --------------------------------------------------------------------


#: What the gate answers instead of moto: (HTTP status, EC2 error code, message).
Refusal = tuple[int, str, str]


class Ec2Gate:
    """moto behind a proxy that can refuse ``RunInstances`` the way EC2 does.

    ``refuse`` sees each RunInstances request's form parameters and returns a refusal,
    or None to pass it on to moto. Every RunInstances request is kept in ``run_instances``.
    """

    def __init__(self, upstream: str) -> None:
        parsed = urlparse(upstream)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.refuse: Callable[[Mapping[str, str]], Refusal | None] = lambda form: None
        self.run_instances: list[dict[str, str]] = []
        self._lock = threading.Lock()
        gate = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                body = read_body(self)
                if "x-www-form-urlencoded" in (self.headers.get("Content-Type") or ""):
                    form = dict(parse_qsl(body.decode()))
                    if form.get("Action") == "RunInstances":
                        with gate._lock:
                            gate.run_instances.append(form)
                        refusal = gate.refuse(form)
                        if refusal is not None:
                            self._ec2_error(*refusal)
                            return
                self._forward(body)

            def _ec2_error(self, status: int, code: str, message: str) -> None:
                xml = (
                    '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
                    f"<Code>{code}</Code><Message>{message}</Message></Error></Errors>"
                    f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
                ).encode()
                reply(self, status, xml, "text/xml;charset=UTF-8")

            def _forward(self, body: bytes) -> None:
                hop = {"connection", "keep-alive", "transfer-encoding", "content-length"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(*gate._upstream, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in hop:
                        self.send_header(key, value)
                if self.command == "HEAD":
                    self.send_header("Content-Length", answer.getheader("Content-Length") or "0")
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        self._server = LoopbackServer(Handler)
        self.url = self._server.url

    def launches(self) -> list[dict[str, str]]:
        """The RunInstances requests that would start an instance (not dry runs)."""
        with self._lock:
            return [f for f in self.run_instances if f.get("DryRun") != "true"]

    def close(self) -> None:
        self._server.close()


@pytest.fixture
def gate(moto: dict[str, Any]) -> Iterator[Ec2Gate]:
    proxy = Ec2Gate(moto["url"])
    yield proxy
    proxy.close()


def stub_quotas(stubbers: list[Stubber], aws: AwsProvider, *pairs: tuple[str, float]) -> Stubber:
    """Service Quotas answers, in the order the quota check reads them (spot, then on-demand)."""
    stubber = stub(stubbers, aws.client("service-quotas"))
    for code, value in pairs:
        stubber.add_response(
            "get_service_quota", fake.quota(code, value), {"ServiceCode": "ec2", "QuotaCode": code}
        )
    return stubber


def stub_scores(stubbers: list[Stubber], aws: AwsProvider, *, url: str, calls: int) -> Stubber:
    """Spot placement scores (moto has none) for up to ``calls`` capacity questions."""
    ids = fake.zone_ids(url)
    stubber = stub(stubbers, aws.client("ec2", advisory=True))
    answer = fake.placement_scores({ids[zone]: score for zone, score in SCORES.items()})
    params = {
        "InstanceTypes": ["g5.xlarge"],
        "TargetCapacity": 1,
        "TargetCapacityUnitType": "units",
        "SingleAvailabilityZone": True,
        "RegionNames": [REGION],
    }
    for _ in range(calls):
        stubber.add_response("get_spot_placement_scores", answer, params)
    return stubber


def make_aws(
    moto: dict[str, Any], session: boto3.session.Session, *, endpoint_url: str | None = None
) -> AwsProvider:
    return AwsProvider(
        region=REGION,
        endpoint_url=endpoint_url or moto["url"],
        image_id=moto["image"],
        instance_profile="trainbot-runner",
        session=session,
    )


# -- what moto holds ---------------------------------------------------------------------


def all_instances(url: str) -> list[dict[str, Any]]:
    pages = fake.client("ec2", url).get_paginator("describe_instances").paginate()
    return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


def instances_of(url: str, run_id: str) -> list[dict[str, Any]]:
    return [i for i in all_instances(url) if tags(i).get(base.TAG_RUN_ID) == run_id]


def tags(inst: Mapping[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in inst.get("Tags") or ()}


def budget_names(url: str) -> set[str]:
    budgets = fake.client("budgets", url).describe_budgets(AccountId=fake.MOTO_ACCOUNT)
    return {b["BudgetName"] for b in budgets.get("Budgets", [])}


def user_data_env(url: str, instance_id: str) -> dict[str, str]:
    """The ``KEY=value`` lines of the instance's boot script (values are shell-quoted)."""
    answer = fake.client("ec2", url).describe_instance_attribute(
        InstanceId=instance_id, Attribute="userData"
    )
    script = base64.b64decode(answer["UserData"]["Value"]).decode()
    pairs = (line.partition("=") for line in script.splitlines() if line.startswith("TRAINBOT_"))
    return {k: v.strip("'") for k, _, v in pairs}


# -- the control plane -------------------------------------------------------------------


class Recorder:
    """An in-memory Notifier: keeps every message, answers at once, never drops."""

    def __init__(self) -> None:
        self.posted: list[Message] = []
        self.updated: list[tuple[MessageRef, Message]] = []
        self._lock = threading.Lock()

    def post(self, msg: Message) -> MessageRef:
        with self._lock:
            self.posted.append(msg)
            return MessageRef(channel=msg.channel, ts=f"{len(self.posted)}.000100")

    def update(self, ref: MessageRef, msg: Message) -> None:
        with self._lock:
            self.updated.append((ref, msg))

    def preflight(self, run_id: str) -> PreflightMessage:
        with self._lock:
            found = [m for m in self.posted if isinstance(m, PreflightMessage)]
        return next(m for m in found if m.run_id == run_id)


def spec_yaml(bucket: str, *, extra: str = "") -> str:
    """A spot A10G run on AWS, in the run's default region, zones tried in order."""
    return (
        f"command: {COMMAND}\n"
        "resources:\n  cloud: aws\n  accelerator: A10G:1\n  spot: true\n"
        f"  zones: [{', '.join(ZONES)}]\n"
        f"checkpoint:\n  uri: s3://{bucket}/ckpt\n  every_steps: 100\n"
        "budget:\n  usd: 50\n"
        "resubmit:\n  backoff_s: 0\n"
        "dry_run:\n  enabled: false\n" + extra
    )


@contextmanager
def control_plane(
    tmp_path: Path, aws: AwsProvider, bucket: str
) -> Iterator[tuple[ControlPlane, list[dict[str, Any]], Recorder]]:
    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    (specs / "gpu.yaml").write_text(spec_yaml(bucket))
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_SPECS_DIR": str(specs),
            "TRAINBOT_PROVIDER": "aws",
            "TRAINBOT_AWS_REGION": REGION,
            "TRAINBOT_CHECKPOINT_URI": f"s3://{bucket}/default",
            # Specs may put checkpoints anywhere in the bucket (gpu.yaml: s3://bucket/ckpt).
            "TRAINBOT_CHECKPOINT_LOCATIONS": f"s3://{bucket}",
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_PUBLIC_URL": PUBLIC_URL,
        }
    )
    records: list[dict[str, Any]] = []
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    notes = Recorder()
    cp = ControlPlane(settings, notifier=notes, journal=journal, provider=aws, scheduler=False)
    with cp:
        yield cp, records, notes


def run_row(cp: ControlPlane, run_id: str) -> Run:
    return detached(cp.deps.engine, Run, run_id)


def attempts_of(cp: ControlPlane, run_id: str) -> list[Attempt]:
    query = select(Attempt).where(Attempt.run_id == run_id).order_by(col(Attempt.number))
    return all_detached(cp.deps.engine, query)


def attempt_launched(cp: ControlPlane, run_id: str, number: int) -> Attempt | None:
    found = [a for a in attempts_of(cp, run_id) if a.number == number]
    return found[0] if found and found[0].instance_id else None


# -- 1. preflight reports ----------------------------------------------------------------


def preflight(tmp_path: Path, job: JobSpec, aws: AwsProvider) -> PreflightReport:
    """The real checks, in order, with the AWS provider answering."""
    ctx = PreflightContext(
        spec=job,
        run_id=f"r-pre-{uuid.uuid4().hex[:6]}",
        provider=aws,
        request=preflight_request(job, aws),
        checkpoint_uri="s3://unused/ckpt",
        mtbp_s=6 * 3600.0,
        env={},
        workdir=tmp_path,
    )
    return run_preflight(ctx)


def aws_spec(**fields: Any) -> JobSpec:
    resources = {"cloud": "aws", "region": REGION, "accelerator": "A10G:1"}
    resources.update(fields.pop("resources", {}))
    data = {"command": COMMAND, "resources": resources, "dry_run": {"enabled": False}, **fields}
    return parse_spec(data, name="gpu")


def test_a_quota_of_zero_fails_preflight_with_the_increase_to_request(
    tmp_path: Path, moto: dict[str, Any], session: boto3.session.Session, stubbers: list[Stubber]
) -> None:
    aws = make_aws(moto, session)
    quotas = stub_quotas(stubbers, aws, (G_SPOT, 0), (G_ON_DEMAND, 0))
    before = len(all_instances(moto["url"]))
    report = preflight(tmp_path, aws_spec(), aws)
    quotas.assert_no_pending_responses()
    quota = report.result("quota")
    assert quota is not None and quota.status is Status.FAIL
    assert "limit 0 vCPUs" in quota.detail and "g5.xlarge needs 4" in quota.detail
    assert (
        f"request an increase of {G_SPOT} (All G and VT Spot Instance Requests) in {REGION}"
        in quota.remedy
    )
    # The increase covers what the run needs on top of what runs already: moto's server is
    # shared by the module's tests, so spot G instances of others may be in use.
    in_use = re.search(r"limit 0 vCPUs, (\d+) in use", quota.detail)
    assert in_use is not None, quota.detail
    desired = int(in_use.group(1)) + 4
    assert f"--quota-code {G_SPOT} --desired-value {desired} --region {REGION}" in quota.remedy
    assert not report.ok
    capacity = report.result("capacity")
    assert capacity is not None and capacity.status is Status.PASS, "quota, not capacity"
    assert len(all_instances(moto["url"])) == before


def test_capacity_in_no_zone_fails_preflight(
    tmp_path: Path, moto: dict[str, Any], session: boto3.session.Session, stubbers: list[Stubber]
) -> None:
    """moto's us-east-1 knows p5e.48xlarge (8 × H200) but offers it in none of its zones."""
    aws = make_aws(moto, session)
    stub_quotas(stubbers, aws, (P5_SPOT, 1000), (P_ON_DEMAND, 1000))
    report = preflight(tmp_path, aws_spec(resources={"accelerator": "H200:8"}), aws)
    quota, capacity = report.result("quota"), report.result("capacity")
    assert quota is not None and quota.status is Status.PASS
    assert capacity is not None and capacity.status is Status.FAIL
    assert f"no zone of {REGION} offers 8 × H200 (spot, {REGION})" in capacity.detail
    for zone in ("us-east-1a", "us-east-1f"):
        assert f"{zone}: p5e.48xlarge is not offered in {zone}" in capacity.detail
    assert "on_demand_fallback" in capacity.remedy
    assert capacity.data["zones"] == [] and not report.ok


def test_a_dataset_in_another_region_fails_preflight_naming_both(
    tmp_path: Path, moto: dict[str, Any], session: boto3.session.Session, stubbers: list[Stubber]
) -> None:
    aws = make_aws(moto, session)
    stub_quotas(stubbers, aws, (G_SPOT, 1000), (G_ON_DEMAND, 1000))
    far = fake.unique_bucket(moto["url"], region="eu-west-1")
    report = preflight(tmp_path, aws_spec(data_uri=f"s3://{far}/tokens"), aws)
    data = report.result("data")
    assert data is not None and data.status is Status.FAIL
    assert (
        f"the dataset s3://{far}/tokens is in eu-west-1 but the accelerators run in {REGION}"
    ) in data.detail
    assert f"stage the data into a bucket in {REGION}" in data.remedy
    assert "list eu-west-1 in resources.regions" in data.remedy
    assert not report.ok


def submit_and_wait_for_preflight(cp: ControlPlane) -> Run:
    run = service.submit(cp.deps, spec_name="gpu", overrides=[], actor=ADA)
    wait_until(lambda: run_row(cp, run.id).state != RunState.PREFLIGHT, what="preflight")
    return run_row(cp, run.id)


def test_missing_credentials_fail_preflight_and_create_nothing(
    tmp_path: Path, moto: dict[str, Any], no_credentials: None
) -> None:
    aws = make_aws(moto, boto3.session.Session())  # a session that finds no credentials
    before = (len(all_instances(moto["url"])), budget_names(moto["url"]))
    with control_plane(tmp_path, aws, moto["bucket"]) as (cp, _, notes):
        run = submit_and_wait_for_preflight(cp)
        assert run.state == RunState.PREFLIGHT_FAILED
        report = notes.preflight(run.id)
        checks = {c.name: c for c in report.checks}
        for name in ("quota", "capacity", "budget"):
            assert checks[name].status == "fail", name
            assert "no AWS credentials" in checks[name].detail, checks[name].detail
            assert "AWS_ACCESS_KEY_ID" in checks[name].detail
            assert "Traceback" not in checks[name].detail
        assert not report.ok
        assert attempts_of(cp, run.id) == []
    assert (len(all_instances(moto["url"])), budget_names(moto["url"])) == before


def test_a_denied_permission_fails_preflight_naming_it_and_creates_nothing(
    tmp_path: Path,
    moto: dict[str, Any],
    session: boto3.session.Session,
    stubbers: list[Stubber],
    gate: Ec2Gate,
) -> None:
    """The control plane may describe everything but not pass the runner's role."""
    aws = make_aws(moto, session, endpoint_url=gate.url)
    stub_quotas(stubbers, aws, (G_SPOT, 1000), (G_ON_DEMAND, 1000))
    role = f"arn:aws:iam::{fake.MOTO_ACCOUNT}:role/trainbot-runner"
    sts = stub(stubbers, aws.client("sts", advisory=True))
    decoded = {"allowed": False, "context": {"action": "iam:PassRole", "resource": role}}
    sts.add_response(
        "decode_authorization_message",
        {"DecodedMessage": json.dumps(decoded)},
        {"EncodedMessage": "EnC0dEd"},
    )
    gate.refuse = lambda form: (
        403,
        "UnauthorizedOperation",
        "You are not authorized to perform this operation. Encoded authorization failure "
        "message: EnC0dEd",
    )
    before = (len(all_instances(moto["url"])), budget_names(moto["url"]))
    with control_plane(tmp_path, aws, moto["bucket"]) as (cp, _, notes):
        run = submit_and_wait_for_preflight(cp)
        assert run.state == RunState.PREFLIGHT_FAILED
        checks = {c.name: c for c in notes.preflight(run.id).checks}
        refused = [c for c in checks.values() if c.status == "fail"]
        assert [c.name for c in refused] == ["capacity"], checks
        assert f"needs iam:PassRole on {role}" in refused[0].detail
        assert "EnC0dEd" not in refused[0].detail, "the encoded blob is noise to a person"
        assert refused[0].remedy
        assert attempts_of(cp, run.id) == []
    assert gate.run_instances and all(f["DryRun"] == "true" for f in gate.run_instances)
    assert (len(all_instances(moto["url"])), budget_names(moto["url"])) == before


# -- 2. the spot lifecycle ---------------------------------------------------------------


def started(cp: ControlPlane, attempt: Attempt, token: str) -> int:
    """The runner on the instance reports that it started, with its token from user data."""
    body = encode_batch(
        [
            Event(
                attempt=attempt.id,
                seq=0,
                type="started",
                time=time.time(),
                run=attempt.run_id,
                data={"pid": 4242, "host": "ip-10-0-0-7"},
            )
        ]
    )
    return cp.ingest.handle(f"Bearer {token}", body).status


def test_spot_launch_interruption_next_zones_and_stop(
    tmp_path: Path,
    moto: dict[str, Any],
    session: boto3.session.Session,
    stubbers: list[Stubber],
    gate: Ec2Gate,
) -> None:
    url = moto["url"]
    aws = make_aws(moto, session, endpoint_url=gate.url)
    quotas = stub_quotas(stubbers, aws, (G_SPOT, 64), (G_ON_DEMAND, 64))
    # Preflight asks once, each launch once more (and reconcile may race the resubmit timer).
    stub_scores(stubbers, aws, url=url, calls=8)
    no_room = "We currently do not have sufficient g5.xlarge capacity in the zone you requested"

    def refuse(form: Mapping[str, str]) -> Refusal | None:
        if form.get("Placement.AvailabilityZone") == RANKED[1] and form.get("DryRun") != "true":
            # EC2 sends this as a server error, which botocore retries up to four times;
            # a 400 gives the same error after one round trip and keeps the test short.
            return (400, "InsufficientInstanceCapacity", no_room)
        return None

    gate.refuse = refuse
    with control_plane(tmp_path, aws, moto["bucket"]) as (cp, records, notes):
        deps = cp.deps
        # Without a dry run, preflight warns and waits for a person to launch anyway.
        run = submit_and_wait_for_preflight(cp)
        assert run.state == RunState.AWAITING_CONFIRMATION, run.reason
        quotas.assert_no_pending_responses()
        checks = {c.name: c.status for c in notes.preflight(run.id).checks}
        assert checks == {
            "quota": "pass",
            "capacity": "pass",
            "instances": "pass",
            "data": "pass",
            "secrets": "pass",
            "image": "pass",
            "dry_run": "warn",
            "budget": "pass",
        }
        capacity = next(c for c in notes.preflight(run.id).checks if c.name == "capacity")
        ranking = ", ".join(f"{zone} (score {score})" for zone, score in SCORES.items())
        assert f"available now in {ranking} (best first)" in capacity.detail
        assert gate.launches() == [], "preflight starts nothing"
        service.confirm(deps, run.id, ADA)

        # Attempt 1: a spot g5.xlarge in the first zone, tagged with the run and attempt.
        wait_until(lambda: attempt_launched(cp, run.id, 1), what="attempt 1")
        first = attempt_launched(cp, run.id, 1)
        assert first is not None and first.instance_id is not None
        assert (first.zone, first.spot, first.state) == (RANKED[0], True, AttemptState.PROVISIONING)
        [inst] = instances_of(url, run.id)
        assert inst["InstanceId"] == first.instance_id
        assert (inst["State"]["Name"], inst["InstanceLifecycle"]) == ("running", "spot")
        assert inst["InstanceType"] == "g5.xlarge"
        assert inst["Placement"]["AvailabilityZone"] == RANKED[0]
        assert tags(inst)[base.TAG_ATTEMPT_ID] == first.id
        assert tags(inst)[base.TAG_OWNER] == "ada"
        env = user_data_env(url, first.instance_id)
        assert env["TRAINBOT_INGEST_URL"] == f"{PUBLIC_URL}/v1/events"
        assert env["TRAINBOT_CHECKPOINT_URI"] == f"s3://{moto['bucket']}/ckpt"
        assert env["TRAINBOT_PREEMPTION_SOURCES"] == "aws"
        assert hash_token(env["TRAINBOT_TOKEN"]) == first.token_hash
        # The cloud budget exists too, once a person confirmed the launch.
        assert budget_name(run.id) in budget_names(url)

        # The runner boots and reports with the token from its user data.
        assert started(cp, first, env["TRAINBOT_TOKEN"]) == 200
        wait_until(lambda: run_row(cp, run.id).state == RunState.RUNNING, what="RUNNING")

        # EC2 reclaims the spot capacity; reconcile sees it from the provider's side.
        at = datetime.now(timezone.utc).replace(microsecond=0)
        fake.interrupt(first.instance_id, at=at)
        assert reconcile(deps)["ended"] == 1
        # The resubmit goes to the next zone, which has no room, then to the one after.
        wait_until(lambda: attempt_launched(cp, run.id, 3), what="attempt 3")
        one, two, three = attempts_of(cp, run.id)
        assert one.state == AttemptState.PREEMPTED and one.token_hash is None
        assert "Server.SpotInstanceTermination" in (one.end_reason or "")
        assert (two.zone, two.state, two.instance_id) == (RANKED[1], AttemptState.FAILED, None)
        assert (two.end_reason or "").startswith("no capacity: ")
        assert "InsufficientInstanceCapacity" in (two.end_reason or "")
        assert (three.zone, three.state) == (RANKED[2], AttemptState.PROVISIONING)
        assert three.spot and three.instance_id is not None
        assert [f["Placement.AvailabilityZone"] for f in gate.launches()] == list(RANKED)
        after = run_row(cp, run.id)
        assert (after.state, after.preemptions) == (RunState.RECOVERING, 1)
        preempted = [r for r in records if r["type"] == "preempted"]
        assert [r["attempt"] for r in preempted] == [1]
        launched = [(r["attempt"], r["zone"]) for r in records if r["type"] == "launched"]
        assert launched == [(1, RANKED[0]), (3, RANKED[2])]

        # Stopping the run terminates the instance it has now.
        service.stop(deps, run.id, ADA)
        wait_until(
            lambda: attempts_of(cp, run.id)[-1].state == AttemptState.TERMINATED,
            what="attempt 3 terminated",
        )
        assert run_row(cp, run.id).state == RunState.STOPPED
        assert deps.provider.status(three.instance_id).state is InstanceState.TERMINATED

    on_ec2 = {tags(i)[base.TAG_ATTEMPT_ID]: i for i in instances_of(url, run.id)}
    assert sorted(on_ec2) == sorted([one.id, three.id]), "one instance per launched attempt"
    assert {i["State"]["Name"] for i in on_ec2.values()} == {"terminated"}


# -- 3. recovery from a crash ------------------------------------------------------------


def test_reconcile_adopts_the_instance_a_crash_left_unrecorded_and_kills_orphans(
    tmp_path: Path, moto: dict[str, Any], session: boto3.session.Session
) -> None:
    """Killed between the launch call and its database write: on restart there is exactly
    one instance for the attempt, and none that no attempt owns."""
    url = moto["url"]
    aws = make_aws(moto, session)
    with control_plane(tmp_path, aws, moto["bucket"]) as (cp, records, _):
        deps = cp.deps
        job = aws_spec(resources={"region": None, "zones": list(ZONES)})
        run_id, stray_run = f"r-crash-{uuid.uuid4().hex[:6]}", f"r-gone-{uuid.uuid4().hex[:6]}"
        with session_scope(deps.engine) as db:
            run = Run(
                id=run_id,
                spec_name="gpu",
                spec=job.model_dump(mode="json"),
                requester="ada",
                state=RunState.LAUNCHING,
            )
            db.add(run)
            db.flush()
            attempt = Attempt(run_id=run.id, number=1, provider="aws", zone=ZONES[0], spot=True)
            attempt.token_hash = hash_token(deps.runner_token(attempt.id))
            db.add(attempt)
            db.flush()
            db.expunge_all()

        def request(run: Run, attempt: Attempt) -> LaunchRequest:
            """What the launch sends for an attempt (``_provision``'s request)."""
            spec = spec_of(run)
            return LaunchRequest(
                run_id=run.id,
                attempt_id=attempt.id,
                owner=run.requester,
                request=resource_request(spec, deps.provider, spot=True),
                zone=ZONES[0],
                command=runner_command(deps, spec),
                env=runner_env(deps, run, attempt, spec),
                idempotency_key=attempt.id,
                spot=True,
            )

        # Whatever trainbot instances earlier tests left running are orphans here too.
        leftovers = [i for i in aws.list_instances() if not i.state.is_terminal()]
        # The provider launched it, but the database never heard.
        launched = aws.launch(request(run, attempt))
        # And an instance tagged by trainbot whose attempt no database row knows.
        gone = Run(id=stray_run, spec_name="gpu", spec=run.spec, requester="bob")
        stray = aws.launch(request(gone, Attempt(run_id=stray_run, number=1, provider="aws")))

        counts = reconcile(deps)
        assert (counts["adopted"], counts["orphans"]) == (1, 1 + len(leftovers))
        mine = instances_of(url, run_id)
        assert [i["InstanceId"] for i in mine] == [launched.instance_id], "adopted, not relaunched"
        assert mine[0]["State"]["Name"] == "running"
        with session_scope(deps.engine) as db:
            adopted = db.get(Attempt, attempt.id)
            assert adopted is not None
            assert adopted.instance_id == launched.instance_id
            assert adopted.state == AttemptState.PROVISIONING
        orphan = aws.status(stray.instance_id)
        assert (orphan.state, orphan.reason) == (
            InstanceState.TERMINATED,
            "terminated by the control plane",
        )
        assert any(
            r["type"] == "orphan_terminated" and r["instance"] == stray.instance_id for r in records
        )

        # A second pass changes nothing: still exactly one instance for the attempt.
        again = reconcile(deps)
        assert (again["adopted"], again["orphans"], again["launched"]) == (0, 0, 0)
        assert [i["InstanceId"] for i in instances_of(url, run_id)] == [launched.instance_id]
        live = [i for i in aws.list_instances() if not i.state.is_terminal()]
        assert run_id in {i.run_id for i in live} and stray_run not in {i.run_id for i in live}
        aws.terminate(launched.instance_id)
