"""Issue 26, point 1, on moto: an ``aws-sm://`` secret reaches the training process on the
instance (the provider's rendered user data run by bash, with the real runner), is in no
user data, environment file or console; preflight checks it with ``DescribeSecret`` and
``SimulatePrincipalPolicy`` against the instance role (moto lacks the simulation: the
server is taught it, ``tests.fakes.iam_simulation``), never ``GetSecretValue``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from jobs.preflight import Status
from jobs.providers.aws import AwsProvider
from jobs.providers.base import ResourceRequest
from jobs.providers.runner_install import RunnerInstall
from jobs.spec import parse_spec
from jobs.spec.env import secrets_env
from runner import env as contract
from tests.fakes import aws as fake
from tests.fakes.iam_simulation import serve_policy_simulation
from tests.jobs.boot import aws_boot_env, secret_checker, stand_in
from tests.jobs.providers.contract import launch_request
from tests.jobs.test_preflight import secrets_check
from tests.paths import ROOT

REGION = "us-east-1"
T4 = ResourceRequest(cloud="aws", region=REGION, accelerator_type="T4", accelerator_count=1)
VALUE = "wandb-" + uuid.uuid4().hex
TRAIN = secret_checker("WANDB_API_KEY")


@pytest.fixture
def moto(moto_server: str) -> dict[str, Any]:
    serve_policy_simulation()
    tag = uuid.uuid4().hex[:8]
    sm = fake.client("secretsmanager", moto_server)
    name = f"trainbot/wandb-{tag}"
    sm.create_secret(Name=name, SecretString=VALUE)
    # Two runner roles of their own: one with the shipped instance policy, one without.
    granted, bare = f"runner-ok-{tag}", f"runner-bare-{tag}"
    for role in (granted, bare):
        fake.instance_profile(moto_server, name=role)
    policy = (ROOT / "deploy/aws/runner-instance-policy.json").read_text()
    policy = policy.replace("REGION", REGION).replace("ACCOUNT_ID", fake.MOTO_ACCOUNT)
    fake.client("iam", moto_server).put_role_policy(
        RoleName=granted, PolicyName="runner", PolicyDocument=policy
    )
    return {"url": moto_server, "secret": name, "granted": granted, "bare": bare}


def _aws(moto: dict[str, Any], profile: str, **more: Any) -> AwsProvider:
    return AwsProvider(
        region=REGION,
        endpoint_url=moto["url"],
        instance_profile=profile,
        image_id=fake.image_id(moto["url"]),
        session=boto3.session.Session(),
        **more,
    )


def _check(aws: AwsProvider, secrets: dict[str, str], tmp_path: Path) -> Any:
    return secrets_check(
        tmp_path, aws, secrets, request=T4, store="s3://bucket/x", run_id="r-secrets"
    )


def test_preflight_asks_describe_and_the_role_never_the_value(
    moto: dict[str, Any], tmp_path: Path
) -> None:
    ref = f"aws-sm://{moto['secret']}"
    ok = _check(_aws(moto, moto["granted"]), {"WANDB_API_KEY": ref}, tmp_path)
    assert ok.status is Status.PASS, ok.detail
    assert "WANDB_API_KEY" in ok.detail and VALUE not in repr(ok)

    # A role without the instance policy may not read it: FAIL, naming it.
    denied = _check(_aws(moto, moto["bare"]), {"WANDB_API_KEY": ref}, tmp_path)
    assert denied.status is Status.FAIL
    assert f"WANDB_API_KEY ({ref}): the instance role" in denied.detail
    assert "implicitDeny" in denied.detail
    assert "secretsmanager:GetSecretValue" in denied.remedy

    # Missing: FAIL with the command that creates it.
    gone = f"trainbot/missing-{uuid.uuid4().hex[:6]}"
    missing = _check(_aws(moto, moto["granted"]), {"HF_TOKEN": f"aws-sm://{gone}"}, tmp_path)
    assert missing.status is Status.FAIL
    assert f"HF_TOKEN (aws-sm://{gone}): no such secret in {REGION}" in missing.detail
    assert f"aws secretsmanager create-secret --region {REGION} --name {gone}" in missing.remedy

    # Outside the admin's prefix, or another cloud's store: refused before any call.
    outside = _check(_aws(moto, moto["granted"]), {"A": "aws-sm://team/wandb"}, tmp_path)
    assert outside.status is Status.FAIL and "not under trainbot/" in outside.detail
    other = _check(_aws(moto, moto["granted"]), {"A": "local://wandb"}, tmp_path)
    assert other.status is Status.FAIL and "cannot be read on aws instances" in other.detail


def _play(script: str, root: Path) -> subprocess.CompletedProcess[str]:
    """The user data under bash, as cloud-init runs it, with stand-ins for the root-only
    commands and this checkout's real runner as the installed ``trainbot-runner``."""
    bin_dir, home = root / "bin", root / "opt"
    stand_ins = {
        bin_dir / "shutdown": f'echo "shutdown $*" >> {root / "shutdown"}',
        bin_dir / "runuser": 'while [ "$1" != "--" ]; do shift; done; shift; exec "$@"',
        bin_dir / "id": "exit 0",
        bin_dir / "useradd": "exit 0",
        bin_dir / "chgrp": "exit 0",
        bin_dir / "chown": "exit 0",
        home / "bin" / "trainbot-runner": (
            f'exec env PYTHONPATH={ROOT} {sys.executable} -m runner.cli "$@"'
        ),
    }
    for path, body in stand_ins.items():
        stand_in(path, f"#!/bin/sh\n{body}\n")
    env = aws_boot_env(root, home, path=f"{bin_dir}:{os.environ['PATH']}")
    return subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60
    )


def test_the_instance_reads_the_secret_into_the_command_only(
    moto: dict[str, Any], tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    digest = hashlib.sha256(VALUE.encode()).hexdigest()
    spec = parse_spec(
        {"command": "python train.py", "secrets": {"WANDB_API_KEY": f"aws-sm://{moto['secret']}"}},
        name="s",
    )
    aws = _aws(moto, moto["granted"], runner=RunnerInstall(mode="index", version="0.1.0"))
    env = {
        "TRAINBOT_TOKEN": "tok-" + uuid.uuid4().hex,
        "TRAINBOT_CHECKPOINT_URI": str(tmp_path / "ckpt"),
        **secrets_env(spec, local=False, aws_region=REGION),
        # Standing in for the instance profile (the sandbox has no metadata service): the
        # runner's boto3 finds these through its default chain, as it finds the role's.
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL_SECRETS_MANAGER": moto["url"],
    }
    assert json.loads(env[contract.SECRETS.name]) == spec.secrets
    command = ["trainbot-runner", "exec", "--", sys.executable, str(tmp_path / "train.py"), digest]
    script = aws.render_user_data(launch_request(T4, command, zone="us-east-1a", env=env))
    assert VALUE not in script  # the user data holds the reference only

    booted = _play(script, tmp_path / "one")
    console = (tmp_path / "one" / "console").read_text()
    assert "trainbot-runner exited with code 0" in console, booted.stdout + booted.stderr
    assert "secret ok" in booted.stdout + booted.stderr + console
    seen = booted.stdout + booted.stderr + console
    seen += (tmp_path / "one" / "etc" / "runner.env").read_text()
    assert VALUE not in seen

    # Deleted before the next attempt: that attempt fails as secret_unavailable, naming it.
    fake.client("secretsmanager", moto["url"]).delete_secret(
        SecretId=moto["secret"], ForceDeleteWithoutRecovery=True
    )
    again = _play(script, tmp_path / "two")
    console = (tmp_path / "two" / "console").read_text()
    assert "trainbot-runner exited with code 1" in console, again.stdout + again.stderr
    said = again.stdout + again.stderr + console
    assert f"secret WANDB_API_KEY (aws-sm://{moto['secret']}) could not be read" in said
    assert "ResourceNotFoundException" in said


def test_the_policies_let_the_instance_read_trainbot_secrets_and_the_control_plane_none() -> None:
    def actions(path: str) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for s in json.loads((ROOT / path).read_text())["Statement"]:
            listed = [s["Action"]] if isinstance(s["Action"], str) else s["Action"]
            resources = [s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"]
            for action in listed:
                found.setdefault(action, []).extend(resources)
        return found

    instance = actions("deploy/aws/runner-instance-policy.json")
    secret_actions = [a for a in instance if a.startswith("secretsmanager:")]
    assert secret_actions == ["secretsmanager:GetSecretValue"]
    assert instance["secretsmanager:GetSecretValue"] == [
        "arn:aws:secretsmanager:REGION:ACCOUNT_ID:secret:trainbot/*"
    ]
    plane = actions("deploy/aws/iam-policy.json")
    assert not any(a.startswith("secretsmanager:Get") for a in plane), "it never reads a value"
    assert plane["secretsmanager:DescribeSecret"] == [
        "arn:aws:secretsmanager:REGION:ACCOUNT_ID:secret:trainbot/*"
    ]
    assert "iam:SimulatePrincipalPolicy" in plane
