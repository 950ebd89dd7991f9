"""One contract for every checkpoint store, run against a local directory, S3 (moto) and
Cloud Storage (gcp-storage-emulator).

The S3-only and GCS-only tests at the end cover what a local directory cannot get wrong:
buckets that do not exist, endpoints that do not answer, permissions and credentials.
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
import torch

from runner.checkpoint import CheckpointWriter, Prefetch, list_committed, restore_latest, step_dir
from runner.errors import BadURIError, StoreError
from runner.retention import RetentionPolicy, prune
from runner.state import state_digest
from runner.store import DELETE_BATCH, LocalStore, ObjectInfo, Store, open_store
from runner.store.gcs import GCSStore
from runner.store.gcs_batch import batch_answers
from runner.store.s3 import S3Store
from tests.fakes.gcs_emulator import GcsEmulator, gcs_emulator, refusing_gcs
from tests.fakes.gcs_emulator import create_bucket as create_gcs_bucket
from tests.fakes.moto_server import closed_port, create_bucket, refusing_s3

__all__ = ["gcs_emulator"]  # the session's emulator, a fixture

MiB = 1 << 20
PART = 5 * MiB


@pytest.fixture(params=["local", "s3", "gcs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    if request.param == "gcs":
        host = request.getfixturevalue("gcs_emulator")
        return GCSStore(create_gcs_bucket(host), "ckpt/run-1", emulator_host=host, chunk_size=PART)
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


def _calls(store: Store) -> list[tuple[str, str, str]]:
    """Every JSON API request the GCS store makes from now on: (method, URL, Content-Range)."""
    assert isinstance(store, GCSStore)
    calls: list[tuple[str, str, str]] = []

    def record(response: Any, *args: Any, **kwargs: Any) -> None:
        request = response.request
        calls.append((request.method, request.url, request.headers.get("Content-Range", "")))

    store.http.hooks["response"].append(record)
    return calls


def _chunks(calls: list[tuple[str, str, str]]) -> list[str]:
    """The Content-Range of each chunk sent to a resumable session."""
    return [r for m, u, r in calls if m == "PUT" and "upload_id=" in u]


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
    calls = _calls(store) if isinstance(store, GCSStore) else []
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
    if isinstance(store, GCSStore):  # one resumable session, chunks of 5 + 5 + 2 MiB
        assert _chunks(calls) == [
            f"bytes 0-{PART - 1}/*",
            f"bytes {PART}-{2 * PART - 1}/*",
            f"bytes {2 * PART}-{len(data) - 1}/{len(data)}",
        ]


def test_one_huge_write_is_split_into_parts(store: Store) -> None:
    data = _payload(11 * MiB, seed=1)
    calls = _calls(store) if isinstance(store, GCSStore) else []
    stream = store.open_write("one-write.bin")
    assert stream.write(data) == len(data)
    stream.close()
    assert store.get_bytes("one-write.bin") == data
    if isinstance(store, S3Store):
        assert _etag(store, "one-write.bin").endswith("-3")
    if isinstance(store, GCSStore):
        assert len(_chunks(calls)) == 3


def test_object_of_exactly_one_part(store: Store) -> None:
    data = _payload(PART, seed=2)
    calls = _calls(store) if isinstance(store, GCSStore) else []
    stream = store.open_write("exact.bin")
    stream.write(data[: PART // 2])
    stream.write(data[PART // 2 :])
    stream.close()
    assert store.get_bytes("exact.bin") == data
    if isinstance(store, S3Store):
        assert "-" not in _etag(store, "exact.bin")  # a single PutObject
    if isinstance(store, GCSStore):  # a single multipart upload, no session
        uploads = [u for m, u, _ in calls if m == "POST" and "/upload/" in u]
        assert len(uploads) == 1 and "uploadType=multipart" in uploads[0]


def test_writes_and_reads_never_draw_from_the_training_scripts_random(store: Store) -> None:
    """Python's global ``random`` is the training script's: a checkpoint write that drew
    from it (the GCS client library draws every multipart boundary there) would make the
    state a run restores differ from the one it saved (the dry run's bit-identity check
    found exactly that on GCS)."""
    before = random.getstate()
    store.put_bytes("rng/manifest.json", b'{"step": 1}')
    small = store.open_write("rng/small.bin")
    small.write(b"x" * 1000)
    small.close()
    big = store.open_write("rng/big.bin")
    big.write(_payload(PART + 1, seed=4))
    big.close()
    assert store.get_bytes("rng/small.bin") == b"x" * 1000
    assert [o.key for o in store.list("rng/")] == [
        "rng/big.bin",
        "rng/manifest.json",
        "rng/small.bin",
    ]
    store.delete(["rng/big.bin", "rng/small.bin", "rng/manifest.json"])
    assert random.getstate() == before


def test_abort_leaves_nothing_and_keeps_the_previous_object(store: Store) -> None:
    store.put_bytes("step/shard.bin", b"committed")
    calls = _calls(store) if isinstance(store, GCSStore) else []
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
    if isinstance(store, GCSStore):  # the session was cancelled (the emulator answers 501)
        sessions = {u for m, u, _ in calls if m == "PUT" and "upload_id=" in u}
        assert len(sessions) == 1
        assert [m for m, u, _ in calls if u in sessions][-1] == "DELETE"


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
    if isinstance(store, GCSStore):

        def count_calls(response: Any, *args: Any, **kwargs: Any) -> None:
            if response.request.url.endswith("/batch/storage/v1"):
                batches.append(response.request.body.count(b"DELETE /storage/v1/b/"))

        store.http.hooks["response"].append(count_calls)
    if isinstance(store, S3Store):

        def count(params: dict[str, Any], **_: Any) -> None:
            batches.append(len(params["Delete"]["Objects"]))

        store.client.meta.events.register("provide-client-params.s3.DeleteObjects", count)

    assert store.delete(keys) == len(keys)

    assert [o.key for o in store.list()] == [keep]
    if isinstance(store, S3Store):
        assert batches == [DELETE_BATCH, 20]
    if isinstance(store, GCSStore):  # a JSON API batch takes at most 100 calls
        assert batches == [100] * 10 + [20]


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


def test_checkpoints_round_trip_fall_back_and_prune(store: Store) -> None:
    """The checkpoint layer over each store: 12 MiB shards (above the part size, so S3
    takes them as multipart uploads and Cloud Storage as resumable sessions), the newest
    restored and prefetched, a corrupted newest skipped for the one before, pruning."""
    calls = _calls(store) if isinstance(store, GCSStore) else []
    writer = CheckpointWriter(store, shard_bytes=8 * MiB)
    states = {}
    for step in (10, 20, 30):
        g = torch.Generator().manual_seed(step)
        states[step] = {"w": torch.randn(3 * MiB, generator=g), "step": step}  # 12 MiB
        writer.save(step, states[step], metrics={"loss": 1 / step}).result()
    writer.close()
    assert [e.step for e in list_committed(store)] == [10, 20, 30]
    if isinstance(store, S3Store):
        assert "-" in _etag(store, f"{step_dir(30)}/shard-00000.bin"), "a multipart upload"
    if isinstance(store, GCSStore):  # one resumable session for each step's shard
        shard_sessions = {u for m, u, _ in calls if m == "PUT" and "shard-00000.bin" in u}
        assert len(shard_sessions) == 3
    restored = restore_latest(store)
    assert restored.step == 30 and state_digest(restored.state) == state_digest(states[30])
    # The session's background read works over every store as well.
    prefetched = Prefetch(store).take()
    assert prefetched is not None and prefetched.step == 30
    assert state_digest(prefetched.state) == state_digest(states[30])

    # A corrupted newest checkpoint falls back to the previous one.
    store.put_bytes(f"{step_dir(30)}/meta.pt", b"garbage")
    fallback = restore_latest(store)
    assert fallback.step == 20 and fallback.skipped[0][0] == 30
    prefetched = Prefetch(store).take()
    assert prefetched is not None and prefetched.step == 20 and prefetched.skipped[0][0] == 30

    result = prune(store, RetentionPolicy(keep_last=1), now=time.time())
    assert result.deleted == (10, 20) and [e.step for e in list_committed(store)] == [30]
    assert {o.key.split("/")[0] for o in store.list()} == {step_dir(30)}


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


def test_no_credentials_says_how_to_get_some(moto_server: str, no_credentials: None) -> None:
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


# -- Cloud Storage only --------------------------------------------------------------


def test_gcs_missing_bucket_is_named(gcs_emulator: str) -> None:
    gcs = GCSStore(
        "no-such-bucket-4f1c", "p", emulator_host=gcs_emulator, chunk_size=PART, max_attempts=1
    )
    with pytest.raises(StoreError, match="bucket no-such-bucket-4f1c does not exist: create it"):
        gcs.put_bytes("k", b"x")
    with pytest.raises(StoreError, match="no-such-bucket-4f1c does not exist"):
        gcs.list()
    with pytest.raises(StoreError, match="no-such-bucket-4f1c does not exist"):
        gcs.get_bytes("k")
    stream = gcs.open_write("big")
    with pytest.raises(StoreError, match="no-such-bucket-4f1c does not exist"):
        stream.write(_payload(2 * PART + 1))  # starts the resumable session
    stream.abort()


def test_gcs_unreachable_endpoint_is_named_quickly() -> None:
    host = f"http://127.0.0.1:{closed_port()}"
    gcs = GCSStore("bucket", emulator_host=host, max_attempts=1, connect_timeout=1)
    started = time.monotonic()
    with pytest.raises(
        StoreError, match=re.escape(f"cannot reach the Cloud Storage endpoint {host} ")
    ):
        gcs.exists("k")
    with pytest.raises(StoreError, match="cannot reach"):
        gcs.get_bytes("k")
    assert time.monotonic() - started < 5


def test_gcs_transient_errors_are_tried_again(gcs_emulator: str) -> None:
    """A 503 is tried again; after max_attempts the error names the call."""
    gcs = GCSStore(create_gcs_bucket(gcs_emulator), emulator_host=gcs_emulator, max_attempts=3)
    failures = iter([503, 503])

    def flaky(response: Any, *args: Any, **kwargs: Any) -> Any:
        if "/download/" in response.request.url:
            status = next(failures, None)
            if status is not None:
                response.status_code = status
        return response

    gcs.put_bytes("k", b"x")
    gcs.http.hooks["response"].append(flaky)
    assert gcs.get_bytes("k") == b"x"  # two 503s, then the object


def test_gcs_access_denied_names_the_permission_and_resource() -> None:
    with refusing_gcs() as host:
        gcs = GCSStore("ckpts", "team/run", emulator_host=host, max_attempts=1)
        resource = "projects/_/buckets/ckpts"
        with pytest.raises(
            StoreError,
            match=re.escape(
                f"storage.objects.create (and storage.objects.delete, to overwrite) on {resource}/objects/team/run/*"
            ),
        ):
            gcs.put_bytes("k", b"x")
        with pytest.raises(StoreError, match=re.escape(f"storage.objects.list on {resource} ")):
            gcs.list()
        with pytest.raises(StoreError, match=r"storage.objects.get on .*trainbotRunner"):
            gcs.get_bytes("k")
        with pytest.raises(StoreError, match=r"storage.objects.delete"):
            gcs.delete(["k"])


def test_gcs_no_credentials_says_how_to_get_some(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "none.json"))
    with pytest.raises(
        StoreError,
        match=r"no Google credentials for gs://any-bucket/p .*GOOGLE_APPLICATION_CREDENTIALS",
    ):
        GCSStore("any-bucket", "p")


def test_gcs_an_unknown_credentials_mode_is_refused_with_a_reason(
    gcs_emulator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINBOT_STORE_CREDENTIALS", "profile")
    with pytest.raises(StoreError, match="write 'broker'"):
        GCSStore("bucket", emulator_host=gcs_emulator)


def test_gcs_a_lost_upload_session_commits_nothing() -> None:
    """The session vanishes mid-upload (as one a week old does): close fails, naming the
    object, and nothing is committed."""
    emulator = GcsEmulator()
    host = emulator.start()
    try:
        gcs = GCSStore(
            create_gcs_bucket(host), "p", emulator_host=host, chunk_size=PART, max_attempts=1
        )
        stream = gcs.open_write("big.bin")
        stream.write(_payload(2 * PART + 1))  # the session holds one chunk
        emulator.wipe()
        with pytest.raises(StoreError, match=r"gs://test-\w+/p/big\.bin expired or was cancelled"):
            stream.write(_payload(PART))
            stream.close()
        stream.abort()
        assert not gcs.exists("big.bin")
    finally:
        emulator.stop()


def test_gcs_a_damaged_download_is_caught(gcs_emulator: str) -> None:
    """A body that does not match the object's CRC32C is an error, not data."""
    bucket = create_gcs_bucket(gcs_emulator)
    gcs = GCSStore(bucket, "p", emulator_host=gcs_emulator, max_attempts=1)
    gcs.put_bytes("shard.bin", _payload(3 * MiB))
    # The emulator lets a PATCH change the stored checksum: the bytes now disagree with it.
    gcs.http.patch(
        f"{gcs.endpoint}/storage/v1/b/{bucket}/o/p%2Fshard.bin", json={"crc32c": "AAAAAA=="}
    ).raise_for_status()
    with pytest.raises(StoreError, match=r"shard.bin from gs://.* failed its CRC32C check"):
        _read_all(gcs.open_read("shard.bin"))
    with pytest.raises(StoreError, match="CRC32C"):
        gcs.get_bytes("shard.bin")


def test_gcs_batch_answers_are_matched_by_content_id() -> None:
    """Cloud Storage names each answer (``response-N``) and need not keep the order;
    the emulator names none. Both are read right."""
    import requests

    def answer(parts: list[tuple[str, str]]) -> requests.Response:
        body = (
            "".join(
                f"--b\r\nContent-Type: application/http\r\n{cid}\r\n{status}\r\n"
                "Content-Type: application/json; charset=UTF-8\r\n\r\n"
                + (
                    '{"error": {"code": 404, "message": "No such object: b/k"}}'
                    if "404" in status
                    else ""
                )
                + "\r\n"
                for cid, status in parts
            )
            + "--b--"
        )
        response = requests.Response()
        response.status_code = 200
        response.headers["Content-Type"] = "multipart/mixed; boundary=b"
        response._content = body.encode()
        return response

    named = answer(
        [
            ("Content-ID: <response-1>\r\n", "HTTP/1.1 404 Not Found"),
            ("Content-ID: <response-0>\r\n", "HTTP/1.1 204 No Content"),
        ]
    )
    assert batch_answers(named, 2) == [(204, ""), (404, "No such object: b/k")]
    unnamed = answer([("", "HTTP/1.1 204 No Content"), ("", "HTTP/1.1 503 Unavailable")])
    assert [s for s, _ in batch_answers(unnamed, 2)] == [204, 503]


def test_open_store_builds_a_gcs_store(gcs_emulator: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.removeprefix("http://"))
    bucket = create_gcs_bucket(gcs_emulator)
    store = open_store(f"gs://{bucket}//team/run/")
    assert isinstance(store, GCSStore)
    assert store.uri == f"gs://{bucket}/team/run"
    assert store.endpoint == gcs_emulator  # the standard variable, scheme or not
    store.put_bytes("k", b"v")
    assert open_store(f"gs://{bucket}").list() == [
        ObjectInfo(key="team/run/k", size=1, mtime=store.list()[0].mtime)
    ]


@pytest.mark.parametrize("uri", ["gs://", "gs:///x", "gs://Bad_Bucket/x", "gs://a/x?y=1"])
def test_bad_gcs_uris_are_refused(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9")
    with pytest.raises(BadURIError):
        open_store(uri)


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Upload pools are shut down by close and abort, never left running."""
    yield
    deadline = time.monotonic() + 5
    while any(t.name.startswith(("s3-upload", "gcs-upload")) for t in threading.enumerate()):
        assert time.monotonic() < deadline, "an upload thread outlived its stream"
        time.sleep(0.01)
