"""The Cloud Storage checkpoint store (``gs://bucket/prefix``).

This is the only runner module that imports google-cloud-storage (its ``gcs_*`` siblings,
imported from here alone, use google-auth and google-crc32c), and ``runner.store``
imports it only for a ``gs://`` URI, so an instance that checkpoints elsewhere never pays
for it. ``STORAGE_EMULATOR_HOST`` points it at any GCS emulator, with anonymous
credentials, as it does the official client; otherwise credentials come from
application-default credentials (the instance's service account on GCE).

With ``TRAINBOT_STORE_CREDENTIALS=broker`` (``runner.store.broker``) the store's session,
and only it, sends a bearer token the control plane downscoped to this run's prefix
(``jobs/providers/gcp/credentials.py``), held in google-auth's OAuth2 ``Credentials``
whose ``refresh_handler`` asks the control plane again before it expires (google-auth
refreshes 3 min 45 s ahead). ``os.environ`` is never changed, so the training code keeps
the instance's service account for its data.

The official client builds the connection (endpoint, credentials, token refresh) and does
the small calls: listing (paginated), one-shot uploads and existence checks. Three paths
speak the JSON API directly, over the same authorised session, because the client's own
versions are slower or unsafe for checkpoints:

- **Writes** are resumable uploads, streamed from memory: the next chunk fills while the
  previous one is sent (``blob.open("wb")`` sends each chunk inside ``write``), every
  chunk and the whole object are CRC32C-checked, and :meth:`abort` cancels the session.
  A ``BlobWriter`` has no abort: closing it, as ``with`` does on an exception, commits
  the truncated object. An object that fits in one chunk is one multipart upload.
- **Reads** are one streamed GET, checked against the object's CRC32C at the end
  (``blob.open("rb")`` sends one ranged request per chunk and checks nothing).
- **Deletes** go in JSON API batches of 100 (the service's limit; the client's ``Batch``
  allows 1,000 and fails the whole call on one missing key). Batches are sent one after
  another, so keys the caller lists first (a step's manifest) are gone before the rest.

An upload that dies with the process leaves a resumable session, not an object: nothing
shows under the key, and GCS drops the session after a week.

The parts: ``gcs_credentials`` (broker, emulator or application-default credentials),
``gcs_upload`` (the resumable writer), ``gcs_download`` (the verified reader),
``gcs_batch`` (batch deletes), ``gcs_http`` (JSON API errors, retries, CRC32C); this
module holds the store and turns errors into messages that say what to do.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO, TypeVar, cast
from urllib.parse import quote

import requests
from google.api_core import exceptions as api_exceptions
from google.auth.exceptions import DefaultCredentialsError, RefreshError, TransportError
from google.auth.transport.requests import AuthorizedSession
from google.cloud.storage import Client as StorageClient
from requests.adapters import HTTPAdapter

from runner.errors import StoreError
from runner.store._common import BucketStore
from runner.store.base import ObjectInfo, WriteStream
from runner.store.gcs_batch import BATCH_LIMIT, delete_batch
from runner.store.gcs_credentials import EMULATOR_ENV, broker_credentials, store_credentials
from runner.store.gcs_download import MediaReader
from runner.store.gcs_http import (
    CHUNK_ALIGN,
    DEFAULT_CHUNK_SIZE,
    MiB,
    StatusError,
    backoff_s,
    check,
    transient,
)
from runner.store.gcs_upload import ResumableWrite, upload_whole

__all__ = [
    "BATCH_LIMIT",
    "CHUNK_ALIGN",
    "DEFAULT_CHUNK_SIZE",
    "EMULATOR_ENV",
    "GCSStore",
    "MiB",
    "broker_credentials",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# The IAM permission each call needs, for "access denied" messages.
_PERMISSION = {
    "upload": "storage.objects.create",
    "get": "storage.objects.get",
    "list": "storage.objects.list",
    "delete": "storage.objects.delete",
}


@dataclass(eq=False, repr=False, kw_only=True)
class GCSStore(BucketStore):
    """Objects under ``gs://bucket/prefix``; key ``k`` lives at ``prefix/k``.

    ``credentials``: the default is application-default credentials, or anonymous ones
    for an emulator; the broker's token is sent to an emulator too.
    """

    scheme = "gs"
    broker_signs = "a token from the control plane for this run's prefix"
    default_signs = "the instance's service account"

    #: An emulator's address; unset means ``STORAGE_EMULATOR_HOST``, and with neither the
    #: store talks to Cloud Storage with application-default credentials.
    emulator_host: str | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def _check_options(self) -> None:
        if self.chunk_size < CHUNK_ALIGN or self.chunk_size % CHUNK_ALIGN:
            raise ValueError(f"chunk_size must be a multiple of 256 KiB, not {self.chunk_size}")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")

    def _connect(self) -> None:
        self.timeout = (self.connect_timeout, self.read_timeout)
        host = self.emulator_host
        if host is None:
            host = os.environ.get(EMULATOR_ENV)
        options: dict[str, str] | None = None
        if host:
            options = {"api_endpoint": host if "://" in host else f"http://{host}"}
        creds = store_credentials(self.uri, host=host, brokered=self.brokered)
        #: The authorised session every call goes through (one pool, one token).
        self.http = AuthorizedSession(creds)
        adapter = HTTPAdapter(pool_connections=2, pool_maxsize=32)
        self.http.mount("https://", adapter)
        self.http.mount("http://", adapter)
        #: The official client, for callers that need an operation the Store lacks.
        self.client = StorageClient(
            project=None, credentials=creds, _http=self.http, client_options=options
        )
        #: The JSON API's base URL (``https://storage.googleapis.com`` or the emulator).
        self.endpoint = str(self.client.api_endpoint).rstrip("/")
        self._bucket = self.client.bucket(self.bucket)

    # -- keys, retries and errors ----------------------------------------------------

    def _object_url(self, full: str, *, api: str = "storage/v1") -> str:
        return f"{self.endpoint}/{api}/b/{self.bucket}/o/{quote(full, safe='')}"

    def _retrying(self, op: str, key: str | None, call: Callable[[], T]) -> T:
        """``call()``, tried again on what Google documents as transient, with backoff."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return call()
            except StoreError:
                raise
            except Exception as exc:
                if attempt == self.max_attempts or not transient(exc):
                    raise self._error(exc, op=op, key=key) from exc
                delay = backoff_s(attempt)
                log.debug("gcs %s of %s: try %d failed (%s)", op, key, attempt, exc)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _bucket_missing(self) -> bool:
        """Whether the bucket is gone (asked only after a 404, with objects.list)."""
        try:
            self.http.get(
                f"{self.endpoint}/storage/v1/b/{self.bucket}/o",
                params={"maxResults": "1", "fields": "kind"},
                timeout=self.timeout,
            ).raise_for_status()
        except requests.HTTPError as exc:
            return exc.response is not None and exc.response.status_code == 404
        except Exception:
            return False
        return False

    def _error(self, exc: BaseException, *, op: str, key: str | None = None) -> StoreError:
        """Turn a transport or API error into a StoreError that says what to do about it."""
        where = self._where(key)
        if isinstance(exc, RefreshError) and self.brokered:
            return StoreError(
                f"could not renew the control plane's checkpoint token for {self.uri} ({exc}): "
                "check that the control plane is reachable and the attempt still runs"
            )
        if isinstance(exc, (RefreshError, DefaultCredentialsError)):
            return StoreError(
                f"could not get Google credentials for {self.uri} ({exc}): check the "
                "instance's service account, GOOGLE_APPLICATION_CREDENTIALS, or run "
                "`gcloud auth application-default login`"
            )
        if isinstance(exc, (requests.ConnectionError, requests.Timeout, TransportError)):
            return StoreError(
                f"cannot reach the Cloud Storage endpoint {self.endpoint} for {self.uri}: "
                f"check the network (and {EMULATOR_ENV}, if set)"
            )
        status: int | None = None
        message = str(exc)
        if isinstance(exc, StatusError):
            status, message = exc.status, exc.message
        elif isinstance(exc, api_exceptions.GoogleAPICallError) and exc.code is not None:
            status, message = int(exc.code), exc.message
        if status == 404:
            if (
                op in ("list", "upload")
                or "bucket does not exist" in message.lower()
                or (op == "get" and self._bucket_missing())
            ):
                return StoreError(
                    f"bucket {self.bucket} does not exist: create it or fix the checkpoint "
                    f"URI {self.uri}"
                )
            if key is not None:
                return StoreError(f"{key} is missing from checkpoint store {self.uri}")
        if status == 403:
            permission = _PERMISSION.get(op, f"storage.objects.{op}")
            resource = f"projects/_/buckets/{self.bucket}" + (
                "" if op == "list" else f"/objects/{self._prefix_pattern()}"
            )
            also = " (and storage.objects.delete, to overwrite)" if op == "upload" else ""
            grantee = (
                "the runner-storage service account (the trainbotRunnerStorage role, "
                "deploy/gcp/roles.yaml); the broker's token reaches this run's prefix only"
                if self.brokered
                else "this instance's service account (the trainbotRunnerStorage role, "
                "deploy/gcp/roles.yaml)"
            )
            return StoreError(
                f"access denied: {permission}{also} on {resource} ({where}): grant it to {grantee}"
            )
        if status == 401:
            return StoreError(
                f"Cloud Storage rejected the credentials for {self.uri}: refresh them "
                "(`gcloud auth application-default login`) or check the instance's service account"
            )
        if status is not None:
            return StoreError(f"Cloud Storage {op} on {where} failed: {status}: {message}")
        return StoreError(
            f"Cloud Storage {op} on {where} failed: {exc}; check the endpoint {self.endpoint}"
        )

    # -- the Store protocol ----------------------------------------------------------

    def open_write(self, key: str) -> WriteStream:
        return ResumableWrite(self, key)

    def put_bytes(self, key: str, data: bytes) -> None:
        upload_whole(self, key, data)

    def open_read(self, key: str) -> BinaryIO:
        url = self._object_url(self._full(key), api="download/storage/v1")

        def get() -> requests.Response:
            return check(
                self.http.get(
                    url,
                    params={"alt": "media"},
                    # Stored bytes as they are: the CRC32C is of those.
                    headers={"Accept-Encoding": "identity"},
                    stream=True,
                    timeout=self.timeout,
                )
            )

        response = self._retrying("get", key, get)
        return cast(BinaryIO, io.BufferedReader(MediaReader(self, key, response), MiB))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        root = f"{self.prefix}/" if self.prefix else ""

        def run() -> list[ObjectInfo]:
            blobs = self.client.list_blobs(
                self.bucket,
                prefix=root + prefix,
                fields="items(name,size,updated),nextPageToken",
                retry=None,
                timeout=self.timeout,
            )
            return [
                ObjectInfo(
                    key=b.name[len(root) :],
                    size=int(b.size or 0),
                    mtime=b.updated.timestamp() if b.updated else 0.0,
                )
                for b in blobs
            ]

        out = self._retrying("list", None, run)
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, keys: Sequence[str]) -> int:
        fulls = [self._full(k) for k in keys]  # every key checked before anything goes
        deleted = 0
        for start in range(0, len(fulls), BATCH_LIMIT):
            deleted += delete_batch(self, fulls[start : start + BATCH_LIMIT], deleted)
        return deleted

    def exists(self, key: str) -> bool:
        blob = self._bucket.blob(self._full(key))
        return bool(
            self._retrying("get", key, lambda: blob.exists(retry=None, timeout=self.timeout))
        )
