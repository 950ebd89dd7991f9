"""The S3 checkpoint store (and any S3-compatible service through ``endpoint_url``).

This is the only runner module that imports boto3, and ``runner.store`` imports it only
for an ``s3://`` URI, so an instance that checkpoints to a local directory never pays for
it. Large objects are streamed from memory as multipart uploads: a shard never has to be
staged on the instance's disk, a failed write leaves nothing under its key, and memory
stays bounded by a few parts.

Uploads that die with the process leave invisible parts that S3 still bills; give the
bucket a lifecycle rule with ``AbortIncompleteMultipartUpload`` (a day is plenty).

Credentials: boto3's default chain (the instance profile on EC2), unless
``TRAINBOT_STORE_CREDENTIALS=broker`` (``runner.store.broker``). Then the store's client,
and only it, signs with the broker's short-lived credentials for this run's prefix. They
are held in botocore's ``RefreshableCredentials`` in this process, which fetches new ones
before expiry (15 minutes ahead, and at the latest 10), rather than through a generated
config file with ``credential_process``: no file on disk to name or clean up, no
interpreter started per refresh, no profile lookup in the process-wide
``AWS_CONFIG_FILE``, and a failed refresh is a :class:`StoreError` that says what to do.
``os.environ`` is never changed, so the training code keeps the instance profile for its
data.
"""

from __future__ import annotations

import io
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import boto3
import botocore.session
from botocore.config import Config
from botocore.credentials import CredentialProvider, CredentialResolver, RefreshableCredentials
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
)

from runner.errors import StoreError
from runner.store._common import BucketStore, PartWrite, RawDownload
from runner.store.base import DELETE_BATCH, ObjectInfo, WriteStream
from runner.store.broker import fetch_broker_credentials

log = logging.getLogger(__name__)

MiB = 1 << 20
#: Default part size: large enough that a 10 GiB shard takes 160 requests.
DEFAULT_PART_SIZE = 64 * MiB
#: S3 rejects smaller parts (except the last) and allows at most this many parts.
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * 1024 * MiB
MAX_PARTS = 10_000

# The IAM action each API call needs, for "access denied" messages.
_IAM_ACTION = {
    "PutObject": "s3:PutObject",
    "CreateMultipartUpload": "s3:PutObject",
    "UploadPart": "s3:PutObject",
    "CompleteMultipartUpload": "s3:PutObject",
    "AbortMultipartUpload": "s3:AbortMultipartUpload",
    "GetObject": "s3:GetObject",
    "HeadObject": "s3:GetObject",
    "ListObjectsV2": "s3:ListBucket",
    "DeleteObjects": "s3:DeleteObject",
}


class _BrokerCredentialProvider(CredentialProvider):
    """botocore's hook for a credential source: refreshable credentials from the broker."""

    METHOD = "trainbot-broker"
    CANONICAL_NAME = "trainbot-broker"

    def __init__(self, fetch: Callable[[], dict[str, Any]]) -> None:
        super().__init__()
        self._fetch = fetch

    def _metadata(self) -> dict[str, str]:
        answer = self._fetch()
        return {
            "access_key": answer["AccessKeyId"],
            "secret_key": answer["SecretAccessKey"],
            "token": answer["SessionToken"],
            "expiry_time": answer["Expiration"],
        }

    def load(self) -> RefreshableCredentials:
        return RefreshableCredentials.create_from_metadata(
            metadata=self._metadata(), refresh_using=self._metadata, method=self.METHOD
        )


def broker_session(
    fetch: Callable[[], dict[str, Any]] = fetch_broker_credentials,
) -> boto3.session.Session:
    """A boto3 session of its own whose only credential source is the broker."""
    core = botocore.session.Session()
    core.register_component(
        "credential_provider", CredentialResolver(providers=[_BrokerCredentialProvider(fetch)])
    )
    return boto3.session.Session(botocore_session=core)


@dataclass(eq=False, repr=False, kw_only=True)
class S3Store(BucketStore):
    """Objects under ``s3://bucket/prefix``; key ``k`` lives at ``prefix/k``.

    ``credentials``: the default is boto3's chain.
    """

    scheme = "s3"
    broker_signs = "credentials from the control plane for this run's prefix"
    default_signs = "the instance's own credentials"

    endpoint_url: str | None = None
    part_size: int = DEFAULT_PART_SIZE
    upload_threads: int = 2

    def _check_options(self) -> None:
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise ValueError(f"part_size must be between 5 MiB and 5 GiB, not {self.part_size}")
        if self.upload_threads < 1:
            raise ValueError("upload_threads must be at least 1")

    def _connect(self) -> None:
        session = broker_session() if self.brokered else boto3.session.Session()
        region = os.environ.get("AWS_REGION") or session.region_name or "us-east-1"
        config = Config(
            retries={"mode": "standard", "max_attempts": self.max_attempts},
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            # Most S3-compatible services (MinIO, Ceph) serve buckets by path only.
            s3={"addressing_style": "path"} if self.endpoint_url else None,
            max_pool_connections=max(10, self.upload_threads + 2),
        )
        #: The botocore client, for callers that need an operation the Store lacks.
        self.client: Any = session.client(
            "s3", region_name=region, endpoint_url=self.endpoint_url, config=config
        )

    # -- errors ----------------------------------------------------------------------

    def _error(self, exc: Exception, *, op: str, key: str | None = None) -> StoreError:
        """Turn a botocore error into a StoreError that says what to do about it."""
        where = self._where(key)
        endpoint = self.client.meta.endpoint_url
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return StoreError(
                f"no AWS credentials for {self.uri}: set AWS_PROFILE or run on an instance "
                "with a role"
            )
        if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError)):
            return StoreError(
                f"cannot reach the S3 endpoint {endpoint} for {self.uri}: check the network, "
                "the region and the endpoint URL"
            )
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return StoreError(
                    f"bucket {self.bucket} does not exist: create it or fix the checkpoint "
                    f"URI {self.uri}"
                )
            if key is not None and (code in ("NoSuchKey", "404") or status == 404):
                return StoreError(f"{key} is missing from checkpoint store {self.uri}")
            if code in ("AccessDenied", "AllAccessDisabled", "403") or status == 403:
                action = _IAM_ACTION.get(op, f"s3:{op}")
                resource = (
                    f"arn:aws:s3:::{self.bucket}"
                    if action == "s3:ListBucket"
                    else f"arn:aws:s3:::{self.bucket}/{self._prefix_pattern()}"
                )
                hint = (
                    " (S3 also answers 403 for a missing key when s3:ListBucket is not granted)"
                    if action == "s3:GetObject"
                    else ""
                )
                grantee = (
                    "the runner-storage role (deploy/aws/runner-storage-policy.json); the "
                    "broker's credentials reach this run's prefix only"
                    if self.brokered
                    else "this instance's role or profile"
                )
                return StoreError(
                    f"access denied: {action} on {resource} ({where}): grant it to {grantee}{hint}"
                )
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
                return StoreError(
                    f"AWS rejected the credentials for {self.uri} ({code}): refresh them, "
                    "or set AWS_PROFILE to a valid profile"
                )
            if code == "NoSuchUpload":
                return StoreError(
                    f"the multipart upload of {where} was aborted (by a lifecycle rule or "
                    "another process): write the object again"
                )
            message = err.get("Message") or exc
            return StoreError(f"S3 {op} on {where} failed: {code}: {message}")
        return StoreError(f"S3 {op} on {where} failed: {exc}; check the endpoint {endpoint}")

    # -- the Store protocol ----------------------------------------------------------

    def open_write(self, key: str) -> WriteStream:
        return _MultipartWrite(self, key)

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data)
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, op="PutObject", key=key) from exc

    def open_read(self, key: str) -> BinaryIO:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._full(key))
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, op="GetObject", key=key) from exc
        raw = _BodyReader(self, key, response["Body"])
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=MiB))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        root = f"{self.prefix}/" if self.prefix else ""
        out: list[ObjectInfo] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=root + prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    out.append(
                        ObjectInfo(
                            key=obj["Key"][len(root) :],
                            size=int(obj["Size"]),
                            mtime=obj["LastModified"].timestamp(),
                        )
                    )
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, op="ListObjectsV2") from exc
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, keys: Sequence[str]) -> int:
        deleted = 0
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start : start + DELETE_BATCH]
            objects = [{"Key": self._full(k)} for k in batch]
            try:
                response = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
                )
            except (BotoCoreError, ClientError) as exc:
                raise self._error(exc, op="DeleteObjects") from exc
            errors = response.get("Errors", [])
            if errors:
                first = errors[0]
                raise StoreError(
                    f"could not delete s3://{self.bucket}/{first.get('Key')} "
                    f"({first.get('Code')}: {first.get('Message', '')}) and "
                    f"{len(errors) - 1} more; {deleted + len(batch) - len(errors)} deleted. "
                    "Check the role's s3:DeleteObject permission and any object lock"
                )
            deleted += len(batch)
        return deleted

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._full(key))
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise self._error(exc, op="HeadObject", key=key) from exc
        except BotoCoreError as exc:
            raise self._error(exc, op="HeadObject", key=key) from exc
        return True


class _BodyReader(RawDownload):
    """A raw stream over get_object's body."""

    def __init__(self, store: S3Store, key: str, body: Any) -> None:
        super().__init__(store.uri, key, body)
        self._store = store
        self._body = body

    def _read(self, size: int | None) -> bytes:
        try:
            # botocore's read checks the length and, where S3 sent one, the checksum.
            return bytes(self._body.read(size))
        except (BotoCoreError, ClientError) as exc:
            raise self._store._error(exc, op="GetObject", key=self._key) from exc
        except OSError as exc:
            raise self._cut_off(exc) from exc

    def readall(self) -> bytes:
        # RawIOBase's readall would loop over 8 KiB reads; a manifest or shard is read
        # whole by get_bytes, so take the rest in one call.
        return self._read(None)


class _MultipartWrite(PartWrite):
    """Buffers one part at a time; uploads full parts on a small pool; commits on close.

    Memory stays under ``(upload_threads + 1) * part_size``: a write waits for the oldest
    part in flight before handing over another. An object that fits in one part is sent
    with a single PutObject.
    """

    def __init__(self, store: S3Store, key: str) -> None:
        super().__init__(key, store.part_size)
        self._store = store
        self._full = store._full(key)
        self._upload_id: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: deque[Future[dict[str, Any]]] = deque()
        self._parts: list[dict[str, Any]] = []
        calc = store.client.meta.config.request_checksum_calculation
        # As s3transfer does: declare the checksum up front, so each part's checksum is
        # verified by S3 and the object gets one. "when_required" (for services that lack
        # flexible checksums) sends none.
        self._checksum = "CRC32" if calc == "when_supported" else None

    def _send_part(self) -> None:
        store = self._store
        if self._upload_id is None:
            args: dict[str, Any] = {"Bucket": store.bucket, "Key": self._full}
            if self._checksum:
                args["ChecksumAlgorithm"] = self._checksum
            try:
                self._upload_id = store.client.create_multipart_upload(**args)["UploadId"]
            except (BotoCoreError, ClientError) as exc:
                self._done = True
                raise store._error(exc, op="CreateMultipartUpload", key=self._key) from exc
            self._pool = ThreadPoolExecutor(
                max_workers=store.upload_threads, thread_name_prefix="s3-upload"
            )
        number = len(self._parts) + len(self._inflight) + 1
        if number > MAX_PARTS:
            self.abort()
            raise StoreError(
                f"{self._key} is larger than {MAX_PARTS} parts of {store.part_size} bytes: "
                "raise the store's part_size"
            )
        while len(self._inflight) >= store.upload_threads:
            self._collect(self._inflight.popleft())
        # Hand the buffer itself to the upload (botocore takes a bytearray): no copy.
        body, self._buf = self._buf, bytearray()
        assert self._pool is not None
        self._inflight.append(self._pool.submit(self._upload_part, number, body))

    def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        store = self._store
        args: dict[str, Any] = {
            "Bucket": store.bucket,
            "Key": self._full,
            "UploadId": self._upload_id,
            "PartNumber": number,
            "Body": body,
        }
        if self._checksum:
            args["ChecksumAlgorithm"] = self._checksum
        response = store.client.upload_part(**args)
        part: dict[str, Any] = {"PartNumber": number, "ETag": response["ETag"]}
        member = f"Checksum{self._checksum}"
        if self._checksum and member in response:
            part[member] = response[member]
        return part

    def _collect(self, future: Future[dict[str, Any]]) -> None:
        try:
            self._parts.append(future.result())
        except (BotoCoreError, ClientError) as exc:
            self.abort()
            raise self._store._error(exc, op="UploadPart", key=self._key) from exc
        except BaseException:
            self.abort()
            raise

    def close(self) -> None:
        if self._done:
            return
        store = self._store
        if self._upload_id is None:
            try:
                store.client.put_object(Bucket=store.bucket, Key=self._full, Body=self._buf)
            except (BotoCoreError, ClientError) as exc:
                raise store._error(exc, op="PutObject", key=self._key) from exc
            finally:
                self._done = True
                self._buf = bytearray()
            return
        if self._buf:
            self._send_part()
        while self._inflight:
            self._collect(self._inflight.popleft())
        try:
            store.client.complete_multipart_upload(
                Bucket=store.bucket,
                Key=self._full,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": sorted(self._parts, key=lambda p: p["PartNumber"])},
            )
        except (BotoCoreError, ClientError) as exc:
            self.abort()
            raise store._error(exc, op="CompleteMultipartUpload", key=self._key) from exc
        self._done = True
        self._shutdown()

    def abort(self) -> None:
        """Drop the buffer and the upload; never raises, since it runs while handling errors."""
        self._done = True
        self._buf = bytearray()
        self._shutdown()
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        store = self._store
        try:
            store.client.abort_multipart_upload(
                Bucket=store.bucket, Key=self._full, UploadId=upload_id
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "NoSuchUpload":
                return
            log.warning("%s", store._error(exc, op="AbortMultipartUpload", key=self._key))
        except BotoCoreError as exc:
            log.warning(
                "could not abort the multipart upload %s of %s (%s); its parts are billed "
                "until a lifecycle rule with AbortIncompleteMultipartUpload removes them",
                upload_id,
                self._full,
                exc,
            )

    def _shutdown(self) -> None:
        # Parts still uploading when the upload is aborted could outlive the abort, so
        # wait for the running ones and cancel the queued ones first.
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._inflight.clear()
