"""The runner's side of the credential broker: ``trainbot-runner credentials`` and the S3
store's ``TRAINBOT_STORE_CREDENTIALS=broker``, against a local broker that speaks the
control plane's ``POST /v1/credentials`` (its credentials come from moto's STS).
The control plane's broker itself is tested in ``tests/jobs/test_credentials_broker.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest

from runner.checkpoint import CheckpointWriter, list_committed, restore_latest
from runner.cli import main
from runner.errors import StoreError
from runner.store.broker import credentials_url
from runner.store.s3 import S3Store
from tests.fakes.moto_server import create_bucket

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tok-runner"


class FakeBroker:
    """``POST /v1/credentials`` with a bearer token; each answer is a fresh STS session
    from moto, expiring after the next of ``lifetimes`` (the last one repeats)."""

    def __init__(self, moto_url: str, *, lifetimes: list[timedelta] | None = None) -> None:
        self.sts = boto3.client(
            "sts",
            endpoint_url=moto_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        self.lifetimes = list(lifetimes or [timedelta(hours=1)])
        self.issued: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str | None]] = []
        broker = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                broker.requests.append((self.path, self.headers.get("Authorization")))
                if self.path != "/v1/credentials":
                    return self._answer(404, {"error": f"no such endpoint {self.path!r}"})
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._answer(401, {"error": "unknown or revoked runner token"})
                return self._answer(200, broker.issue())

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def issue(self) -> dict[str, Any]:
        lifetime = self.lifetimes.pop(0) if len(self.lifetimes) > 1 else self.lifetimes[0]
        credentials = self.sts.assume_role(
            RoleArn="arn:aws:iam::123456789012:role/trainbot-runner-storage",
            RoleSessionName="trainbot-r-1-a-1",
        )["Credentials"]
        answer = {
            "Version": 1,
            "AccessKeyId": credentials["AccessKeyId"],
            "SecretAccessKey": credentials["SecretAccessKey"],
            "SessionToken": credentials["SessionToken"],
            "Expiration": (datetime.now(timezone.utc) + lifetime).isoformat(),
        }
        self.issued.append(answer)
        return answer

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


@pytest.fixture
def broker(moto_server: str) -> Iterator[FakeBroker]:
    made = FakeBroker(moto_server)
    yield made
    made.close()


@pytest.fixture
def runner_env(broker: FakeBroker, monkeypatch: pytest.MonkeyPatch) -> FakeBroker:
    """What the control plane puts in an AWS runner's environment with a storage role."""
    monkeypatch.setenv("TRAINBOT_INGEST_URL", broker.url + "/v1/events")
    monkeypatch.setenv("TRAINBOT_TOKEN", TOKEN)
    monkeypatch.setenv("TRAINBOT_STORE_CREDENTIALS", "broker")
    return broker


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
    moto_server: str, runner_env: FakeBroker
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
    moto_server: str, runner_env: FakeBroker
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
    moto_server: str, runner_env: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINBOT_TOKEN", "tok-revoked")
    with pytest.raises(StoreError, match=r"refused checkpoint credentials \(401") as caught:
        S3Store("some-bucket", "ckpt/r-1", endpoint_url=moto_server)
    assert "tok-revoked" not in str(caught.value)
    monkeypatch.setenv("TRAINBOT_STORE_CREDENTIALS", "profile")
    with pytest.raises(StoreError, match="write 'broker'"):
        S3Store("some-bucket", "ckpt/r-1", endpoint_url=moto_server)


def test_the_credentials_command_follows_the_credential_process_contract(
    runner_env: FakeBroker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
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
