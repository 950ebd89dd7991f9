"""One contract for every checkpoint store, run against a local directory and S3 (moto).

The S3-only tests at the end cover what a local directory cannot get wrong: buckets that
do not exist, endpoints that do not answer, permissions and credentials.
"""

from __future__ import annotations

import hashlib
import random
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from runner.errors import BadURIError, StoreError
from runner.s3 import S3Store
from runner.store import DELETE_BATCH, LocalStore, Store, open_store
from tests.fakes.moto_server import closed_port, create_bucket, refusing_s3

MiB = 1 << 20
PART = 5 * MiB


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    endpoint = request.getfixturevalue("moto_server")
    return S3Store(create_bucket(endpoint), "ckpt/run-1", endpoint_url=endpoint, part_size=PART)


def _payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def _read_all(stream: Any) -> bytes:
    """Read with readinto, as torch.load and the checkpoint verifier do."""
    out = bytearray()
    buf = bytearray(3 * MiB + 7)  # deliberately not a multiple of anything
    with stream:
        while n := stream.readinto(buf):
            out += buf[:n]
    return bytes(out)


def _etag(store: Store, key: str) -> str:
    assert isinstance(store, S3Store)
    head = store.client.head_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}")
    return str(head["ETag"]).strip('"')


# -- the contract --------------------------------------------------------------------


def test_small_object_round_trip(store: Store) -> None:
    stream = store.open_write("run-1/step-0000000001/shard-0.bin")
    stream.write(b"hello ")
    stream.write(memoryview(b"world"))
    stream.close()
    store.put_bytes("run-1/step-0000000001/manifest.json", b'{"step": 1}')

    assert store.get_bytes("run-1/step-0000000001/shard-0.bin") == b"hello world"
    with store.open_read("run-1/step-0000000001/manifest.json") as f:
        assert f.read() == b'{"step": 1}'


def test_empty_object(store: Store) -> None:
    store.open_write("empty").close()
    assert store.exists("empty")
    assert store.get_bytes("empty") == b""


def test_multipart_object_round_trip_is_invisible_until_close(store: Store) -> None:
    data = _payload(12 * MiB + 123)
    stream = store.open_write("big.bin")
    for start in range(0, len(data), MiB):
        stream.write(data[start : start + MiB])
    assert not store.exists("big.bin")
    assert store.list() == []
    stream.close()

    assert hashlib.sha256(_read_all(store.open_read("big.bin"))).digest() == (
        hashlib.sha256(data).digest()
    )
    assert [(o.key, o.size) for o in store.list()] == [("big.bin", len(data))]
    if isinstance(store, S3Store):
        assert _etag(store, "big.bin").endswith("-3")  # 5 + 5 + 2 MiB


def test_one_huge_write_is_split_into_parts(store: Store) -> None:
    data = _payload(11 * MiB, seed=1)
    stream = store.open_write("one-write.bin")
    assert stream.write(data) == len(data)
    stream.close()
    assert store.get_bytes("one-write.bin") == data
    if isinstance(store, S3Store):
        assert _etag(store, "one-write.bin").endswith("-3")


def test_object_of_exactly_one_part(store: Store) -> None:
    data = _payload(PART, seed=2)
    stream = store.open_write("exact.bin")
    stream.write(data[: PART // 2])
    stream.write(data[PART // 2 :])
    stream.close()
    assert store.get_bytes("exact.bin") == data
    if isinstance(store, S3Store):
        assert "-" not in _etag(store, "exact.bin")  # a single PutObject


def test_abort_leaves_nothing_and_keeps_the_previous_object(store: Store) -> None:
    store.put_bytes("step/shard.bin", b"committed")
    stream = store.open_write("step/shard.bin")
    stream.write(_payload(11 * MiB))  # two parts are already uploaded
    stream.abort()
    stream.abort()  # idempotent

    assert store.get_bytes("step/shard.bin") == b"committed"
    fresh = store.open_write("step/other.bin")
    fresh.write(b"x" * 100)
    fresh.abort()
    assert [(o.key, o.size) for o in store.list()] == [("step/shard.bin", 9)]
    if isinstance(store, S3Store):
        uploads = store.client.list_multipart_uploads(Bucket=store.bucket)
        assert uploads.get("Uploads", []) == []


def test_list_by_prefix_sorted_with_sizes(store: Store) -> None:
    before = time.time()
    for key, size in [
        ("run-1/step-0000000010/manifest.json", 10),
        ("run-1/step-0000000002/manifest.json", 2),
        ("run-1/step-0000000002/shard-0.bin", 20),
        ("run-10/step-0000000001/manifest.json", 1),
        ("run-2/x", 3),
    ]:
        store.put_bytes(key, b"m" * size)

    listed = store.list("run-1/")
    assert [(o.key, o.size) for o in listed] == [
        ("run-1/step-0000000002/manifest.json", 2),
        ("run-1/step-0000000002/shard-0.bin", 20),
        ("run-1/step-0000000010/manifest.json", 10),
    ]
    assert all(before - 5 <= o.mtime <= time.time() + 5 for o in listed)
    assert [o.key for o in store.list("run-1")][-1] == "run-10/step-0000000001/manifest.json"
    assert len(store.list()) == 5
    assert store.list("nothing/") == []


def test_delete_more_than_one_batch(store: Store) -> None:
    keys = [f"run-1/step-{i:010d}/manifest.json" for i in range(DELETE_BATCH + 20)]
    keep = "run-1/keep"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: store.put_bytes(k, b"{}"), [*keys, keep]))
    batches: list[int] = []
    if isinstance(store, S3Store):

        def count(params: dict[str, Any], **_: Any) -> None:
            batches.append(len(params["Delete"]["Objects"]))

        store.client.meta.events.register("provide-client-params.s3.DeleteObjects", count)

    assert store.delete(keys) == len(keys)

    assert [o.key for o in store.list()] == [keep]
    if isinstance(store, S3Store):
        assert batches == [DELETE_BATCH, 20]


def test_delete_of_missing_keys_is_not_an_error(store: Store) -> None:
    store.delete(["never/written"])
    assert store.delete([]) == 0


def test_exists(store: Store) -> None:
    assert not store.exists("a/b")
    store.put_bytes("a/b", b"1")
    assert store.exists("a/b")
    assert not store.exists("a")  # a "directory" is not an object


def test_reading_a_missing_key_says_so(store: Store) -> None:
    with pytest.raises(StoreError, match=r"run-1/manifest.json is missing"):
        store.open_read("run-1/manifest.json")
    with pytest.raises(StoreError, match="is missing"):
        store.get_bytes("run-1/manifest.json")


def test_put_bytes_overwrites_whole(store: Store) -> None:
    store.put_bytes("manifest.json", b"first version, longer")
    store.put_bytes("manifest.json", b"second")
    assert store.get_bytes("manifest.json") == b"second"
    assert [(o.key, o.size) for o in store.list()] == [("manifest.json", 6)]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a"])
def test_bad_keys_are_refused(store: Store, key: str) -> None:
    with pytest.raises(StoreError, match="invalid object key"):
        store.put_bytes(key, b"x")


# -- S3 only -------------------------------------------------------------------------


def test_missing_bucket_is_named(moto_server: str) -> None:
    s3 = S3Store("no-such-bucket-4f1c", "p", endpoint_url=moto_server)
    with pytest.raises(StoreError, match="bucket no-such-bucket-4f1c does not exist: create it"):
        s3.put_bytes("k", b"x")
    with pytest.raises(StoreError, match="no-such-bucket-4f1c does not exist"):
        s3.list()
    with pytest.raises(StoreError, match="no-such-bucket-4f1c does not exist"):
        s3.get_bytes("k")


def test_unreachable_endpoint_is_named_quickly() -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    s3 = S3Store("bucket", endpoint_url=endpoint, max_attempts=1, connect_timeout=1)
    started = time.monotonic()
    with pytest.raises(StoreError, match=re.escape(f"cannot reach the S3 endpoint {endpoint} ")):
        s3.exists("k")
    assert time.monotonic() - started < 5


def test_access_denied_names_the_action_and_resource(moto_server: str) -> None:
    with refusing_s3() as endpoint:
        s3 = S3Store("ckpts", "team/run", endpoint_url=endpoint, max_attempts=1)
        with pytest.raises(StoreError, match=r"s3:PutObject on arn:aws:s3:::ckpts/team/run/\*"):
            s3.put_bytes("k", b"x")
        with pytest.raises(StoreError, match=r"s3:ListBucket on arn:aws:s3:::ckpts "):
            s3.list()
        with pytest.raises(StoreError, match=r"s3:GetObject"):
            s3.exists("k")


def test_no_credentials_says_how_to_get_some(
    moto_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Signing fails before anything is sent, so the bucket need not exist.
    s3 = S3Store("any-bucket", endpoint_url=moto_server)
    with pytest.raises(StoreError, match="no AWS credentials for s3://any-bucket: set AWS_PROFILE"):
        s3.put_bytes("k", b"x")


def test_a_failed_close_commits_nothing(moto_server: str) -> None:
    bucket = create_bucket(moto_server)
    s3 = S3Store(bucket, "p", endpoint_url=moto_server, part_size=PART, max_attempts=1)
    stream = s3.open_write("big.bin")
    stream.write(_payload(6 * MiB))  # starts the multipart upload
    s3.client.abort_multipart_upload(  # as a lifecycle rule would
        Bucket=bucket,
        Key="p/big.bin",
        UploadId=s3.client.list_multipart_uploads(Bucket=bucket)["Uploads"][0]["UploadId"],
    )
    # Real S3 answers NoSuchUpload; moto 5 answers 500. Either way the key is named.
    with pytest.raises(StoreError, match=r"s3://test-\w+/p/big\.bin"):
        stream.write(_payload(6 * MiB))
        stream.close()
    stream.abort()
    assert not s3.exists("big.bin")


def test_open_store_builds_an_s3_store(moto_server: str) -> None:
    store = open_store("s3://ckpts//team/run/", endpoint_url=moto_server)
    assert isinstance(store, S3Store)
    assert store.uri == "s3://ckpts/team/run"
    assert open_store("s3://ckpts", endpoint_url=moto_server).uri == "s3://ckpts"


@pytest.mark.parametrize("uri", ["s3://", "ftp://x", "file://host/x", "", "s3://bad bucket/x"])
def test_bad_uris_are_refused(uri: str) -> None:
    with pytest.raises(BadURIError):
        open_store(uri, endpoint_url="http://127.0.0.1:9")


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Upload pools are shut down by close and abort, never left running."""
    yield
    deadline = time.monotonic() + 5
    while any(t.name.startswith("s3-upload") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "an upload thread outlived its stream"
        time.sleep(0.01)
