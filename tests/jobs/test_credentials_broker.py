"""The checkpoint-credential broker: ``POST /v1/credentials`` over real HTTP, STS and S3 on
moto's server, with moto enforcing IAM for the tests that say so.

moto evaluates identity policies, role trust policies and the caller's identity, but
not STS session policies (an assumed role's permissions are its role's policies alone)
and not ``s3:prefix`` conditions. So what the session policy allows is judged here by a
small matcher over the policy document STS actually received (moto records it), and
moto shows the rest for real: the brokered credentials write the run's prefix, the
instance profile (``deploy/aws/runner-instance-policy.json``) reaches no checkpoint,
the storage role (``runner-storage-policy.json``) reaches nothing outside the checkpoint
prefix, and only the control plane may assume it (``runner-storage-role.json``).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import moto.settings
import pytest
from botocore.exceptions import ClientError
from moto.sts.models import sts_backends
from sqlalchemy import Engine

from jobs.domain.errors import PermissionDenied
from jobs.process.bootstrap import build_credential_broker
from jobs.process.settings import Settings
from jobs.providers.aws import AwsProvider
from jobs.providers.aws.credentials import (
    OBJECT_ACTIONS,
    StorageCredentialBroker,
    session_policy,
)
from jobs.web.server import EVENTS_PATH
from runner.checkpoint import list_committed, read_manifest
from runner.store.s3 import S3Store
from tests.fakes.aws import MOTO_ACCOUNT
from tests.jobs.broker_contract import (
    TOKEN,
    Plane,
    assert_store_credentials,
    assert_tokens_refused,
)
from tests.jobs.rows import add_running_attempt, migrated_sqlite
from tests.paths import ROOT
from tests.runner.tinyproc import exec_synced

DEPLOY = ROOT / "deploy" / "aws"
REGION = "us-east-1"


# -- moto: the account, as deploy/aws/ sets it up ---------------------------------------------


@dataclass(frozen=True)
class Keys:
    access_key_id: str
    secret_access_key: str

    def session(self) -> boto3.session.Session:
        return boto3.session.Session(
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            region_name=REGION,
        )


@dataclass(frozen=True)
class Account:
    url: str
    #: The checkpoint bucket (root prefix ``ckpt``) and the training data's bucket.
    bucket: str
    data_bucket: str
    role_arn: str
    #: The control plane's identity, and the instance profile's (as IAM users: moto
    #: matches a trust policy's principal by exact ARN, so an assumed-role session of a
    #: control-plane role would not match ``role/…`` as it does on AWS).
    control_plane: Keys
    instance: Keys


def _deploy_doc(name: str, **values: str) -> str:
    text = (DEPLOY / name).read_text()
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    return text


def _user(iam: Any, name: str, policy: str) -> Keys:
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="trainbot", PolicyDocument=policy)
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return Keys(key["AccessKeyId"], key["SecretAccessKey"])


@pytest.fixture(scope="module")
def account(moto_server: str) -> Account:
    suffix = uuid.uuid4().hex[:8]
    admin = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION
    )
    iam = admin.client("iam", endpoint_url=moto_server)
    s3 = admin.client("s3", endpoint_url=moto_server)
    bucket, data_bucket = f"ckpt-{suffix}", f"data-{suffix}"
    s3.create_bucket(Bucket=bucket)
    s3.create_bucket(Bucket=data_bucket)
    s3.put_object(Bucket=data_bucket, Key="train/shard-0", Body=b"tokens")
    control_plane_name, role_name = f"trainbot-control-plane-{suffix}", f"storage-{suffix}"
    ids = {"ACCOUNT_ID": MOTO_ACCOUNT, "REGION": REGION}
    # The control plane's policy: its one sts:AssumeRole statement, on this role.
    iam_policy = json.loads(_deploy_doc("iam-policy.json", **ids))
    [assume] = [s for s in iam_policy["Statement"] if s["Action"] == "sts:AssumeRole"]
    assume["Resource"] = assume["Resource"].replace("trainbot-runner-storage", role_name)
    control_plane = _user(
        iam, control_plane_name, json.dumps({"Version": "2012-10-17", "Statement": [assume]})
    )
    instance = _user(
        iam,
        f"trainbot-runner-{suffix}",
        _deploy_doc("runner-instance-policy.json", DATA_BUCKET=data_bucket),
    )
    trust = _deploy_doc("runner-storage-role.json", **ids).replace(
        "role/trainbot-control-plane", f"user/{control_plane_name}"
    )
    role = iam.create_role(RoleName=role_name, AssumeRolePolicyDocument=trust)["Role"]
    iam.put_role_policy(
        RoleName=role_name,
        PolicyName="checkpoints",
        PolicyDocument=_deploy_doc(
            "runner-storage-policy.json", CHECKPOINT_BUCKET=bucket, CHECKPOINT_PREFIX="ckpt"
        ),
    )
    return Account(
        url=moto_server,
        bucket=bucket,
        data_bucket=data_bucket,
        role_arn=role["Arn"],
        control_plane=control_plane,
        instance=instance,
    )


@pytest.fixture
def enforced(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto checks every request's signature and IAM policies (the threaded server is in
    this process; monkeypatch puts the setting back, so other tests see a lenient moto)."""
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)


def _assumed(access_key_id: str) -> Any:
    """moto's record of the AssumeRole call that issued ``access_key_id``."""
    roles = sts_backends[MOTO_ACCOUNT]["aws"].assumed_roles
    [found] = [r for r in roles if r.access_key_id == access_key_id]
    return found


def _s3(url: str, credentials: dict[str, Any] | Keys) -> Any:
    if isinstance(credentials, Keys):
        return credentials.session().client("s3", endpoint_url=url)
    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name=REGION,
        aws_access_key_id=credentials["AccessKeyId"],
        aws_secret_access_key=credentials["SecretAccessKey"],
        aws_session_token=credentials["SessionToken"],
    )


def _denied(call: Any) -> str:
    with pytest.raises(ClientError) as caught:
        call()
    return str(caught.value.response["Error"]["Code"])


# -- the control plane ----------------------------------------------------------------------


#: A run with one running attempt whose token is TOKEN (pass token=None: revoked).
add_attempt = functools.partial(add_running_attempt, provider="aws", token=TOKEN)


engine = pytest.fixture(migrated_sqlite, name="engine")


@pytest.fixture
def broker(account: Account) -> StorageCredentialBroker:
    return StorageCredentialBroker(
        account.role_arn,
        region=REGION,
        endpoint_url=account.url,
        session=account.control_plane.session(),
    )


@pytest.fixture
def plane(engine: Engine, broker: StorageCredentialBroker) -> Iterator[Plane]:
    served = Plane(engine, broker)
    yield served
    served.server.shutdown()


# -- a tiny evaluator of the session policy (moto does not evaluate session policies) -----------


def allows(
    policy: dict[str, Any], action: str, resource: str, *, s3_prefix: str | None = None
) -> bool:
    """Whether an Allow statement covers the request (no Deny statements are used)."""

    def listed(value: str | list[str]) -> list[str]:
        return [value] if isinstance(value, str) else value

    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow"
        if action not in listed(statement["Action"]):
            continue
        if not any(fnmatch.fnmatchcase(resource, r) for r in listed(statement["Resource"])):
            continue
        condition = statement.get("Condition", {})
        assert set(condition) <= {"StringLike"} and set(condition.get("StringLike", {})) <= {
            "s3:prefix"
        }
        patterns = condition.get("StringLike", {}).get("s3:prefix")
        if patterns is not None and (
            s3_prefix is None or not any(fnmatch.fnmatchcase(s3_prefix, p) for p in patterns)
        ):
            continue
        return True
    return False


# -- tests ------------------------------------------------------------------------------------


def test_a_live_attempt_gets_credentials_whose_session_policy_names_only_its_prefix(
    account: Account, engine: Engine, plane: Plane, enforced: None
) -> None:
    uri = f"s3://{account.bucket}/ckpt"
    add_attempt(engine, checkpoint_uri=uri)
    add_attempt(engine, run_id="r-10", attempt_id="a-10", token="tok-10", checkpoint_uri=uri)

    status, body, headers = plane.credentials()

    assert status == 200, body
    assert set(body) == {"Version", "AccessKeyId", "SecretAccessKey", "SessionToken", "Expiration"}
    assert body["Version"] == 1 and headers["Cache-Control"] == "no-store"
    expires = datetime.fromisoformat(body["Expiration"])
    assert timedelta(minutes=55) < expires - datetime.now(timezone.utc) <= timedelta(hours=1)
    # What STS received, as moto recorded it.
    issued = _assumed(body["AccessKeyId"])
    assert issued.role_arn == account.role_arn
    assert issued.session_name == "trainbot-r-1-a-1"
    policy = json.loads(issued.policy)
    assert policy == session_policy(account.bucket, "ckpt/r-1")
    bucket = f"arn:aws:s3:::{account.bucket}"
    for action in OBJECT_ACTIONS:
        assert allows(policy, action, f"{bucket}/ckpt/r-1/step-0000000010/shard-00000.bin")
        for elsewhere in ("ckpt/r-10/step-0000000010/x", "ckpt/r-2/x", "ckpt/x", "r-1/x"):
            assert not allows(policy, action, f"{bucket}/{elsewhere}"), elsewhere
        assert not allows(policy, action, f"arn:aws:s3:::{account.data_bucket}/ckpt/r-1/x")
    assert allows(policy, "s3:ListBucket", bucket, s3_prefix="ckpt/r-1/")
    assert allows(policy, "s3:ListBucket", bucket, s3_prefix="ckpt/r-1/step-0000000010/")
    assert allows(policy, "s3:ListBucket", bucket, s3_prefix="ckpt/r-1")
    for prefix in (None, "", "ckpt/", "ckpt/r-10/", "ckpt/r-1-dry-run/"):
        assert not allows(policy, "s3:ListBucket", bucket, s3_prefix=prefix), prefix
    assert not allows(policy, "s3:PutBucketPolicy", bucket)

    # And moto, enforcing IAM, lets the credentials sign for real (the role's policy).
    brokered = _s3(account.url, body)
    brokered.put_object(Bucket=account.bucket, Key="ckpt/r-1/probe", Body=b"1")
    assert brokered.get_object(Bucket=account.bucket, Key="ckpt/r-1/probe")["Body"].read() == b"1"
    assert _denied(lambda: brokered.put_object(Bucket=account.bucket, Key="x", Body=b"1")) == (
        "AccessDenied"
    )


def test_deploy_policies_under_moto_the_instance_reaches_its_data_and_no_checkpoint(
    account: Account, enforced: None
) -> None:
    instance = _s3(account.url, account.instance)
    assert instance.get_object(Bucket=account.data_bucket, Key="train/shard-0")["Body"].read()
    for call in (
        lambda: instance.put_object(Bucket=account.bucket, Key="ckpt/r-1/x", Body=b"1"),
        lambda: instance.get_object(Bucket=account.bucket, Key="ckpt/r-1/probe"),
        lambda: instance.list_objects_v2(Bucket=account.bucket, Prefix="ckpt/"),
        lambda: instance.delete_object(Bucket=account.bucket, Key="ckpt/r-1/probe"),
    ):
        assert _denied(call) == "AccessDenied"
    # The control plane may assume the storage role but not use S3 with its own identity
    # here; the instance may not assume the storage role at all (the trust policy).
    control_plane = _s3(account.url, account.control_plane)
    assert _denied(lambda: control_plane.list_objects_v2(Bucket=account.bucket)) == "AccessDenied"
    sts = account.instance.session().client("sts", endpoint_url=account.url)
    assert (
        _denied(lambda: sts.assume_role(RoleArn=account.role_arn, RoleSessionName="trainbot-x"))
        == "AccessDenied"
    )


def test_unknown_revoked_and_missing_tokens_get_401(engine: Engine, plane: Plane) -> None:
    add_attempt(engine, checkpoint_uri="s3://bucket-x/ckpt")
    add_attempt(
        engine, run_id="r-2", attempt_id="a-2", token=None, checkpoint_uri="s3://bucket-x/ckpt"
    )
    assert_tokens_refused(engine, plane)


def test_without_a_broker_or_an_s3_store_the_answer_is_404(engine: Engine, broker: Any) -> None:
    add_attempt(engine, checkpoint_uri="s3://bucket-x/ckpt")
    add_attempt(
        engine, run_id="r-2", attempt_id="a-2", token="tok-2", checkpoint_uri="file:///ckpt"
    )
    unconfigured = Plane(engine, None)
    configured = Plane(engine, broker)
    try:
        status, body, _ = unconfigured.credentials()
        assert status == 404 and "not configured" in body["error"]
        assert unconfigured.credentials("tok-wrong")[0] == 401  # strangers learn nothing
        status, body, _ = configured.credentials("tok-2")
        assert status == 404 and "not configured" in body["error"], body
    finally:
        unconfigured.server.shutdown()
        configured.server.shutdown()


class _Refusing:
    """A broker that refuses, as the AWS one does for a prefix IAM cannot scope."""

    def issue(self, **_: str) -> dict[str, Any]:
        raise PermissionDenied("cannot scope credentials to s3://b/ckpt/*")


def test_a_prefix_iam_cannot_scope_is_refused(engine: Engine, broker: Any) -> None:
    for prefix in ("*", "r-1?", "${aws:username}", "", "/"):
        with pytest.raises(PermissionDenied):
            broker.issue(
                checkpoint_uri="s3://bucket-x/ckpt", run_prefix=prefix, run_id="r", attempt_id="a"
            )
    add_attempt(engine, checkpoint_uri="s3://bucket-x/ckpt")
    refusing = Plane(engine, _Refusing())
    try:
        status, body, _ = refusing.credentials()
    finally:
        refusing.server.shutdown()
    assert status == 403 and "cannot scope" in body["error"]


WRITER = textwrap.dedent(
    """
    import json, os, pathlib, sys
    import boto3
    out = pathlib.Path(sys.argv[1])
    out.write_text(json.dumps(dict(os.environ)))
    data = boto3.client("s3", endpoint_url=os.environ["TRAINBOT_S3_ENDPOINT_URL"])
    data.get_object(Bucket=sys.argv[2], Key="train/shard-0")  # the instance profile reads data
    d = pathlib.Path(os.environ["TRAINBOT_CHECKPOINT_DIR"]) / "epoch-3"
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"w" * 1000)
    """
)


def test_the_runner_checkpoints_with_brokered_credentials_and_the_child_keeps_its_own(
    account: Account, engine: Engine, plane: Plane, enforced: None, tmp_path: Path
) -> None:
    add_attempt(engine, checkpoint_uri=f"s3://{account.bucket}/ckpt")
    sync = tmp_path / "sync"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINBOT_", "AWS_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        AWS_ACCESS_KEY_ID=account.instance.access_key_id,
        AWS_SECRET_ACCESS_KEY=account.instance.secret_access_key,
        AWS_DEFAULT_REGION=REGION,
        AWS_EC2_METADATA_DISABLED="true",
        TRAINBOT_STORE_CREDENTIALS="broker",
        TRAINBOT_INGEST_URL=plane.url + EVENTS_PATH,
        TRAINBOT_TOKEN=TOKEN,
        TRAINBOT_RUN_ID="r-1",
        TRAINBOT_ATTEMPT_ID="a-1",
        TRAINBOT_CHECKPOINT_URI=f"s3://{account.bucket}/ckpt",
        TRAINBOT_S3_ENDPOINT_URL=account.url,
        TRAINBOT_CHECKPOINT_DIR=str(sync),
        TRAINBOT_SPOOL_DIR=str(tmp_path / "spool"),
    )
    child_env = tmp_path / "child-env.json"
    exec_synced(env, sync, sys.executable, "-c", WRITER, str(child_env), account.data_bucket)

    issued = [
        r
        for r in sts_backends[MOTO_ACCOUNT]["aws"].assumed_roles
        if r.session_name == "trainbot-r-1-a-1"
    ]
    assert issued, "the runner's store asked the broker"
    # The store wrote under the run's prefix, which the instance profile cannot reach.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINBOT_INGEST_URL", plane.url + EVENTS_PATH)
        patch.setenv("TRAINBOT_TOKEN", TOKEN)
        store = S3Store(account.bucket, "ckpt/r-1", endpoint_url=account.url, credentials="broker")
    assert [e.step for e in list_committed(store)] == [3]
    manifest = read_manifest(store, 3)
    assert manifest.kind == "files" and manifest.label == "epoch-3"
    # The training process kept the instance's own credentials, and never saw the broker's.
    seen = json.loads(child_env.read_text())
    assert seen["AWS_ACCESS_KEY_ID"] == account.instance.access_key_id
    secrets = {v for r in issued for v in (r.access_key_id, r.secret_access_key, r.session_token)}
    assert not secrets & set(seen.values())
    assert "AWS_SESSION_TOKEN" not in seen


# -- deploy/ and wiring -------------------------------------------------------------------------


def _statements(name: str) -> list[dict[str, Any]]:
    doc = json.loads((DEPLOY / name).read_text())
    assert doc["Version"] == "2012-10-17"
    return [dict(s) for s in doc["Statement"]]


def test_deploy_documents_split_the_checkpoint_access_off_the_instance() -> None:
    instance = json.dumps(_statements("runner-instance-policy.json"))
    assert "CHECKPOINT" not in instance and "s3:PutObject" not in instance
    assume = [s for s in _statements("iam-policy.json") if "sts:AssumeRole" in json.dumps(s)]
    assert assume == [
        {
            "Sid": "BrokerRunnerCheckpointCredentials",
            "Effect": "Allow",
            "Action": "sts:AssumeRole",
            "Resource": "arn:aws:iam::ACCOUNT_ID:role/trainbot-runner-storage",
        }
    ]
    [trust] = _statements("runner-storage-role.json")
    assert trust["Principal"] == {"AWS": "arn:aws:iam::ACCOUNT_ID:role/trainbot-control-plane"}
    assert trust["Action"] == "sts:AssumeRole"
    # The role holds at least what a session asks for, inside the checkpoint prefix.
    role = {"Version": "2012-10-17", "Statement": _statements("runner-storage-policy.json")}
    wanted = session_policy("CHECKPOINT_BUCKET", "CHECKPOINT_PREFIX/r-1")
    for action in OBJECT_ACTIONS:
        resource = wanted["Statement"][0]["Resource"].replace("*", "step-1/x")
        assert allows(role, action, resource), action
        assert not allows(role, action, "arn:aws:s3:::CHECKPOINT_BUCKET/elsewhere/x")
    assert allows(
        role, "s3:ListBucket", "arn:aws:s3:::CHECKPOINT_BUCKET", s3_prefix="CHECKPOINT_PREFIX/r-1"
    )


def test_the_broker_is_built_and_announced_to_runners_only_on_aws_with_the_role(
    tmp_path: Path, engine: Engine
) -> None:
    role = "arn:aws:iam::123456789012:role/trainbot-runner-storage"
    base = {"state_dir": tmp_path}
    aws = {"provider": "aws", "checkpoint_uri": "s3://b/ckpt", "public_url": "https://cp.example"}
    assert build_credential_broker(Settings(**base)) is None
    assert build_credential_broker(Settings(**base, **aws, aws_region=REGION)) is None
    built = build_credential_broker(
        Settings(**base, **aws, aws_region=REGION, aws_runner_storage_role_arn=role)
    )
    assert isinstance(built, StorageCredentialBroker) and built.role_arn == role
    add_attempt(engine, checkpoint_uri="s3://b/ckpt")
    # The attempt's own provider (its env is its provider's); built without a call to AWS.
    provider = AwsProvider(region=REGION)
    assert_store_credentials(
        engine,
        provider,
        [
            (Settings(**base, **aws, aws_runner_storage_role_arn=role), "broker"),
            (Settings(**base, **aws), None),
            (Settings(**base, aws_runner_storage_role_arn=role), None),
        ],
    )
