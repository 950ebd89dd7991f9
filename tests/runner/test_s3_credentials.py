"""The runner's side of the credential broker: ``trainbot-runner credentials`` and the S3
store's ``TRAINBOT_STORE_CREDENTIALS=broker``, against a local broker that speaks the
control plane's ``POST /v1/credentials`` (its credentials come from moto's STS).
The control plane's broker itself is tested in ``tests/jobs/test_credentials_broker.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import boto3
import pytest

from runner.checkpoint import CheckpointWriter, list_committed, restore_latest
from runner.cli import main
from runner.store.broker import credentials_url
from runner.store.s3 import S3Store
from tests.fakes.broker import TOKEN, FakeBroker, assert_refused_token_said
from tests.fakes.moto_server import create_bucket
from tests.paths import ROOT


class FakeAwsBroker(FakeBroker):
    """Each answer a fresh STS session from moto."""

    def __init__(self, moto_url: str) -> None:
        self.sts = boto3.client(
            "sts",
            endpoint_url=moto_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        super().__init__()

    def credentials(self, expires: datetime) -> dict[str, Any]:
        credentials = self.sts.assume_role(
            RoleArn="arn:aws:iam::123456789012:role/trainbot-runner-storage",
            RoleSessionName="trainbot-r-1-a-1",
        )["Credentials"]
        return {
            "Version": 1,
            "AccessKeyId": credentials["AccessKeyId"],
            "SecretAccessKey": credentials["SecretAccessKey"],
            "SessionToken": credentials["SessionToken"],
            "Expiration": expires.isoformat(),
        }


@pytest.fixture
def runner_env(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAwsBroker]:
    """An AWS runner's environment with a storage role."""
    with FakeAwsBroker(moto_server) as broker:
        broker.runner_env(monkeypatch)
        yield broker


def signing_keys(store: S3Store) -> list[str]:
    """The access key id of every request the store's client sends, as it sends it."""
    keys: list[str] = []

    def record(request: Any, **_: Any) -> None:
        authorization = request.headers["Authorization"]
        authorization = (
            authorization.decode() if isinstance(authorization, bytes) else authorization
        )
        keys.append(authorization.split("Credential=", 1)[1].split("/", 1)[0])

    store.client.meta.events.register("before-send.s3", record)
    return keys


def test_the_url_is_the_control_planes_next_to_the_events_route() -> None:
    assert credentials_url("https://cp.example/v1/events") == "https://cp.example/v1/credentials"
    assert credentials_url("https://cp.example/") == "https://cp.example/v1/credentials"


def test_the_store_checkpoints_with_broker_credentials_and_leaves_the_environment_alone(
    moto_server: str, runner_env: FakeAwsBroker
) -> None:
    before = dict(os.environ)
    bucket = create_bucket(moto_server)
    store = S3Store(bucket, "ckpt/r-1", endpoint_url=moto_server)
    keys = signing_keys(store)
    writer = CheckpointWriter(store)
    writer.save(5, {"w": [1.0, 2.0], "step": 5}, metrics={"loss": 0.5}).result()
    writer.close()

    assert [e.step for e in list_committed(store)] == [5]
    assert restore_latest(store).state["step"] == 5
    assert runner_env.requests == [("/v1/credentials", f"Bearer {TOKEN}")]
    assert keys and set(keys) == {runner_env.issued[0]["AccessKeyId"]}
    assert os.environ["AWS_ACCESS_KEY_ID"] not in keys
    # Only the store's client has them: the process (and the training code) does not.
    assert dict(os.environ) == before
    assert not {v for answer in runner_env.issued for v in answer.values()} & set(
        os.environ.values()
    )


def test_credentials_are_refreshed_before_they_expire(
    moto_server: str, runner_env: FakeAwsBroker
) -> None:
    # Inside botocore's mandatory window (10 minutes): refreshed before the next request.
    runner_env.lifetimes = [timedelta(minutes=5), timedelta(hours=1)]
    bucket = create_bucket(moto_server)
    store = S3Store(bucket, "ckpt/r-1", endpoint_url=moto_server)
    keys = signing_keys(store)
    store.put_bytes("a", b"1")
    store.put_bytes("b", b"2")
    assert len(runner_env.issued) == 2
    assert keys == [runner_env.issued[1]["AccessKeyId"]] * 2


def test_a_refused_token_is_a_store_error_that_says_so(
    moto_server: str, runner_env: FakeAwsBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_refused_token_said(
        lambda: S3Store("some-bucket", "ckpt/r-1", endpoint_url=moto_server), monkeypatch
    )


def test_the_credentials_command_follows_the_credential_process_contract(
    runner_env: FakeAwsBroker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As botocore runs it: a process, JSON on stdout.
    done = subprocess.run(
        [sys.executable, "-m", "runner.cli", "credentials"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer == runner_env.issued[-1] and answer["Version"] == 1
    # Refused: nothing on stdout, the reason on stderr, a non-zero exit.
    monkeypatch.setenv("TRAINBOT_TOKEN", "tok-revoked")
    assert main(["credentials"]) != 0
    out, err = capsys.readouterr()
    assert out == "" and "401" in err and "tok-revoked" not in err
    monkeypatch.delenv("TRAINBOT_TOKEN")
    assert main(["credentials"]) != 0
    assert "TRAINBOT_TOKEN" in capsys.readouterr().err
