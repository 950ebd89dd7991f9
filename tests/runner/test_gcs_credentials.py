"""The runner's side of the GCP credential broker: the Cloud Storage store with
``TRAINBOT_STORE_CREDENTIALS=broker``, against gcp-storage-emulator and a local broker that
speaks the control plane's ``POST /v1/credentials`` (the ``gcp-access-token`` answer).

The emulator ignores authorisation, so what the store sends is read off its own session:
every request's ``Authorization`` header, as sent. That the token reaches only the run's
prefix is Google's to enforce (the boundary is tested in
``tests/jobs/test_gcp_credentials_broker.py``).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from google.auth import _helpers as auth_helpers

from runner.checkpoint import CheckpointWriter, list_committed, read_manifest, restore_latest
from runner.errors import StoreError
from runner.store.gcs import GCSStore
from tests.fakes.broker import TOKEN, FakeBroker, assert_refused_token_said
from tests.fakes.gcs_emulator import create_bucket, gcs_emulator
from tests.paths import ROOT
from tests.runner.tinyproc import exec_synced

__all__ = ["gcs_emulator"]  # the session's emulator, a fixture


class FakeGcpBroker(FakeBroker):
    """Answers ``gcp-access-token`` credentials (or, with ``answer_aws``, an AWS answer
    the GCS store must refuse)."""

    answer_aws = False

    def credentials(self, expires: datetime) -> dict[str, Any]:
        if self.answer_aws:
            return {
                "Version": 1,
                "AccessKeyId": "AKIA",
                "SecretAccessKey": "s",
                "SessionToken": "t",
                "Expiration": expires.isoformat(),
            }
        return {
            "Version": 1,
            "Kind": "gcp-access-token",
            "AccessToken": f"ya29.brokered-{len(self.issued) + 1}",
            "Expiration": expires.isoformat(),
        }

    def tokens(self) -> list[str]:
        return [a["AccessToken"] for a in self.issued]


@pytest.fixture
def broker() -> Iterator[FakeGcpBroker]:
    with FakeGcpBroker() as made:
        yield made


@pytest.fixture
def runner_env(broker: FakeGcpBroker, monkeypatch: pytest.MonkeyPatch) -> FakeGcpBroker:
    """A GCP runner's environment with a storage account."""
    broker.runner_env(monkeypatch)
    return broker


def authorizations(store: GCSStore, *, objects_only: bool = False) -> list[str | None]:
    """The ``Authorization`` header of every request the store's session sends, as sent.

    ``objects_only`` leaves out the bucket-metadata GET google-cloud-storage sends from a
    thread of its own (for its telemetry; a 403 there is cached and ignored), whose place
    in the sequence is a race."""
    seen: list[str | None] = []
    bucket_path = f"/storage/v1/b/{store.bucket}"

    def record(response: Any, *args: Any, **kwargs: Any) -> Any:
        if not (objects_only and urlsplit(response.request.url).path == bucket_path):
            seen.append(response.request.headers.get("Authorization"))
        return response

    store.http.hooks["response"].append(record)
    return seen


def test_the_store_checkpoints_with_the_brokered_token_and_leaves_the_environment_alone(
    gcs_emulator: str, runner_env: FakeGcpBroker
) -> None:
    before = dict(os.environ)
    bucket = create_bucket(gcs_emulator)
    store = GCSStore(bucket, "ckpt/r-1", emulator_host=gcs_emulator, chunk_size=256 << 10)
    sent = authorizations(store)
    writer = CheckpointWriter(store)
    writer.save(5, {"w": [1.0] * 100_000, "step": 5}, metrics={"loss": 0.5}).result()
    writer.close()
    assert [e.step for e in list_committed(store)] == [5]
    assert restore_latest(store).state["step"] == 5
    store.delete(["probe-missing"])

    assert store.brokered
    assert runner_env.requests == [("/v1/credentials", f"Bearer {TOKEN}")]
    [token] = runner_env.tokens()
    assert len(sent) > 5 and set(sent) == {f"Bearer {token}"}
    # Only the store's session has it: the process (and the training code) does not.
    assert dict(os.environ) == before
    assert not {v for answer in runner_env.issued for v in answer.values()} & set(
        os.environ.values()
    )


def test_without_the_broker_the_emulator_store_sends_no_token(
    gcs_emulator: str, runner_env: FakeGcpBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRAINBOT_STORE_CREDENTIALS")
    store = GCSStore(create_bucket(gcs_emulator), "ckpt/r-1", emulator_host=gcs_emulator)
    sent = authorizations(store, objects_only=True)
    store.put_bytes("a", b"1")
    assert not store.brokered and sent == [None] and runner_env.requests == []


def test_the_token_is_refreshed_before_it_expires(
    gcs_emulator: str, runner_env: FakeGcpBroker
) -> None:
    # google-auth renews a token REFRESH_THRESHOLD (3 min 45 s) before it expires: the
    # first token enters that window a second after it is issued, an hour before expiry.
    runner_env.lifetimes = [
        auth_helpers.REFRESH_THRESHOLD + timedelta(seconds=1.5),
        timedelta(hours=1),
    ]
    store = GCSStore(create_bucket(gcs_emulator), "ckpt/r-1", emulator_host=gcs_emulator)
    sent = authorizations(store, objects_only=True)
    store.put_bytes("a", b"1")
    time.sleep(2.0)
    store.put_bytes("b", b"2")
    assert store.get_bytes("a") == b"1"

    first, second = runner_env.tokens()
    assert sent == [f"Bearer {first}", f"Bearer {second}", f"Bearer {second}"]
    first_expiry = datetime.fromisoformat(runner_env.issued[0]["Expiration"])
    assert first_expiry - datetime.now(timezone.utc) > timedelta(minutes=3)  # still valid
    assert len(runner_env.requests) == 2  # one fetch at start, one refresh


def test_a_refused_token_or_a_wrong_answer_is_a_store_error_that_says_so(
    gcs_emulator: str, runner_env: FakeGcpBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner_env.answer_aws = True
    with pytest.raises(StoreError, match="issued 'aws-credentials' credentials where"):
        GCSStore("some-bucket", "ckpt/r-1", emulator_host=gcs_emulator)
    runner_env.answer_aws = False
    assert_refused_token_said(
        lambda: GCSStore("some-bucket", "ckpt/r-1", emulator_host=gcs_emulator), monkeypatch
    )


WRITER = textwrap.dedent(
    """
    import json, os, pathlib, sys
    pathlib.Path(sys.argv[1]).write_text(json.dumps(dict(os.environ)))
    d = pathlib.Path(os.environ["TRAINBOT_CHECKPOINT_DIR"]) / "epoch-3"
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"w" * 1000)
    """
)


def test_the_runner_checkpoints_with_the_token_and_the_child_never_sees_it(
    gcs_emulator: str, broker: FakeGcpBroker, tmp_path: Path
) -> None:
    bucket = create_bucket(gcs_emulator)
    sync = tmp_path / "sync"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")}
    env.update(
        PYTHONPATH=str(ROOT),
        STORAGE_EMULATOR_HOST=gcs_emulator,
        TRAINBOT_STORE_CREDENTIALS="broker",
        TRAINBOT_INGEST_URL=broker.url + "/v1/events",
        TRAINBOT_TOKEN=TOKEN,
        TRAINBOT_RUN_ID="r-1",
        TRAINBOT_ATTEMPT_ID="a-1",
        TRAINBOT_CHECKPOINT_URI=f"gs://{bucket}/ckpt",
        TRAINBOT_CHECKPOINT_DIR=str(sync),
        TRAINBOT_SPOOL_DIR=str(tmp_path / "spool"),
    )
    child_env = tmp_path / "child-env.json"
    done = exec_synced(env, sync, sys.executable, "-c", WRITER, str(child_env))

    assert broker.issued, "the runner's store asked the broker"
    assert set(broker.requests) == {("/v1/credentials", f"Bearer {TOKEN}")}
    store = GCSStore(bucket, "ckpt/r-1", emulator_host=gcs_emulator, credentials="default")
    assert [e.step for e in list_committed(store)] == [3]
    assert read_manifest(store, 3).label == "epoch-3"
    seen = json.loads(child_env.read_text())
    assert not set(broker.tokens()) & set(seen.values())
    assert all(token not in done.stderr + done.stdout for token in broker.tokens())
