"""The Cloud Storage checkpoint store (``gs://bucket/prefix``).

This is the only runner module that imports google-cloud-storage, and ``runner.store``
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
"""

from __future__ import annotations

import base64
import functools
import io
import json
import logging
import os
import random
import re
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from email.parser import BytesParser
from typing import Any, BinaryIO, TypeVar, cast
from urllib.parse import quote

import google.auth
import google_crc32c
import requests
import urllib3
from google.api_core import exceptions as api_exceptions
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.exceptions import DefaultCredentialsError, RefreshError, TransportError
from google.auth.transport.requests import AuthorizedSession
from google.cloud.storage import Client as StorageClient
from google.oauth2.credentials import Credentials as OAuth2Credentials
from requests.adapters import HTTPAdapter

from runner.errors import BadURIError, StoreError
from runner.store.base import ObjectInfo, WriteStream, check_key
from runner.store.broker import GCP_ACCESS_TOKEN, STORE_CREDENTIALS_ENV, fetch_broker_credentials

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1 << 20
#: Resumable chunks (all but the last) must be multiples of this.
CHUNK_ALIGN = 256 << 10
#: Default chunk: large enough that a 10 GiB shard takes 160 requests.
DEFAULT_CHUNK_SIZE = 64 * MiB
#: The JSON API takes at most this many calls in one batch request.
BATCH_LIMIT = 100
#: The standard variable the official clients read; it may omit the scheme.
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_OCTET = "application/octet-stream"
#: Statuses worth another try (Google's retry strategy for Cloud Storage).
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Lowercase letters, digits, '-', '_', '.'; starts and ends with a letter or digit.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_CRC_PIECE = CHUNK_ALIGN  # google_crc32c takes bytes only: checksum in small copies

# The IAM permission each call needs, for "access denied" messages.
_PERMISSION = {
    "upload": "storage.objects.create",
    "get": "storage.objects.get",
    "list": "storage.objects.list",
    "delete": "storage.objects.delete",
}


def _crc32c_update(crc: int, data: bytes | bytearray | memoryview) -> int:
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _CRC_PIECE):
        crc = google_crc32c.extend(crc, bytes(view[start : start + _CRC_PIECE]))
    return crc


def _crc32c_b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


class _Status(Exception):
    """An HTTP error answer of the JSON API (raised by the direct calls)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _answer_message(response: requests.Response) -> str:
    try:
        body = response.json()
        error = body.get("error", {}) if isinstance(body, dict) else {}
        return str(error.get("message") or body)[:500]
    except ValueError:
        return (response.text or response.reason or "")[:500]


def _check(response: requests.Response) -> requests.Response:
    if response.status_code >= 400:
        message = _answer_message(response)
        response.close()
        raise _Status(response.status_code, message)
    return response


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, _Status):
        return exc.status in _RETRY_STATUS
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return exc.code in _RETRY_STATUS
    network = (requests.ConnectionError, requests.Timeout, TransportError)
    return isinstance(exc, (*network, urllib3.exceptions.HTTPError))


def _naive_utc(text: str) -> datetime:
    """An ISO 8601 time as google-auth keeps ``expiry``: naive UTC."""
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc).replace(tzinfo=None)
    return moment


def broker_credentials(
    fetch: Callable[..., dict[str, Any]] = fetch_broker_credentials,
) -> OAuth2Credentials:
    """Credentials whose token comes from the control plane's broker, now and at every
    refresh. Raises StoreError when the broker refuses or cannot be reached."""

    def token(request: Any = None, scopes: Any = None) -> tuple[str, datetime]:
        answer = fetch(kind=GCP_ACCESS_TOKEN)
        try:
            return answer["AccessToken"], _naive_utc(answer["Expiration"])
        except ValueError:
            raise StoreError(
                f"the control plane's checkpoint token has an unreadable expiry "
                f"{answer['Expiration']!r}: upgrade the runner and the control plane together"
            ) from None

    value, expiry = token()
    return OAuth2Credentials(token=value, expiry=expiry, refresh_handler=token)


class GCSStore:
    """Objects under ``gs://bucket/prefix``; key ``k`` lives at ``prefix/k``.

    ``emulator_host``: an emulator's address; unset means ``STORAGE_EMULATOR_HOST``, and
    with neither the store talks to Cloud Storage with application-default credentials.
    ``credentials``: ``"default"`` (application-default, or anonymous for an emulator) or
    ``"broker"`` (a token for this run's prefix, also sent to an emulator); unset means
    ``TRAINBOT_STORE_CREDENTIALS``, else the default.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        emulator_host: str | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_attempts: int = 5,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        credentials: str | None = None,
    ) -> None:
        if not _BUCKET_RE.match(bucket):
            raise BadURIError(
                f"{bucket!r} is not a valid Cloud Storage bucket name: write gs://BUCKET/PREFIX "
                "with lowercase letters, digits, '-', '_' or '.' in the bucket name"
            )
        if chunk_size < CHUNK_ALIGN or chunk_size % CHUNK_ALIGN:
            raise ValueError(f"chunk_size must be a multiple of 256 KiB, not {chunk_size}")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        source = credentials or os.environ.get(STORE_CREDENTIALS_ENV) or "default"
        if source not in ("default", "broker"):
            raise StoreError(
                f"{STORE_CREDENTIALS_ENV}={source!r}: write 'broker' (a token from the control "
                "plane for this run's prefix) or leave it unset (the instance's service account)"
            )
        #: Whether the session sends the broker's token for this prefix alone.
        self.brokered = source == "broker"
        self.bucket = bucket
        self.prefix = "/".join(p for p in prefix.split("/") if p)
        self.uri = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        self.chunk_size = chunk_size
        self.max_attempts = max_attempts
        self.timeout = (connect_timeout, read_timeout)
        host = emulator_host if emulator_host is not None else os.environ.get(EMULATOR_ENV)
        creds: Credentials
        options: dict[str, str] | None = None
        if host:
            options = {"api_endpoint": host if "://" in host else f"http://{host}"}
        if self.brokered:
            creds = broker_credentials()
        elif host:
            creds = AnonymousCredentials()  # as the official client does for an emulator
        else:
            try:
                creds, _ = google.auth.default(scopes=[_SCOPE])
            except DefaultCredentialsError as exc:
                raise StoreError(
                    f"no Google credentials for {self.uri} ({exc}): run on an instance with a "
                    "service account, set GOOGLE_APPLICATION_CREDENTIALS, or run "
                    "`gcloud auth application-default login`"
                ) from exc
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
        self._bucket = self.client.bucket(bucket)

    # -- keys, retries and errors ----------------------------------------------------

    def _full(self, key: str) -> str:
        key = check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

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
                if attempt == self.max_attempts or not _transient(exc):
                    raise self._error(exc, op=op, key=key) from exc
                delay = min(10.0, 0.5 * 2 ** (attempt - 1)) * (0.5 + random.random())
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
        where = f"gs://{self.bucket}/{self._full(key)}" if key is not None else self.uri
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
        if isinstance(exc, _Status):
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
                "" if op == "list" else f"/objects/{self.prefix + '/' if self.prefix else ''}*"
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
        return _ResumableWrite(self, key)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._upload_whole(key, data)

    def _upload_whole(self, key: str, data: bytes) -> None:
        """One multipart upload: atomic, and the service checks the CRC32C before it commits."""
        blob = self._bucket.blob(self._full(key))
        self._retrying(
            "upload",
            key,
            lambda: blob.upload_from_string(
                data, content_type=_OCTET, checksum="crc32c", retry=None, timeout=self.timeout
            ),
        )

    def open_read(self, key: str) -> BinaryIO:
        url = self._object_url(self._full(key), api="download/storage/v1")

        def get() -> requests.Response:
            return _check(
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
        return cast(BinaryIO, io.BufferedReader(_MediaReader(self, key, response), MiB))

    def get_bytes(self, key: str) -> bytes:
        with self.open_read(key) as f:
            return f.read()

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
            deleted += _delete_batch(self, fulls[start : start + BATCH_LIMIT], deleted)
        return deleted

    def exists(self, key: str) -> bool:
        blob = self._bucket.blob(self._full(key))
        return bool(
            self._retrying("get", key, lambda: blob.exists(retry=None, timeout=self.timeout))
        )


# -- batch deletes -------------------------------------------------------------------


def _delete_batch(store: GCSStore, fulls: list[str], before: int) -> int:
    """Delete up to BATCH_LIMIT objects in one request; a missing one is not an error.

    Calls that fail transiently are sent again; returns how many objects were deleted.
    """
    deleted = 0
    pending = fulls
    for attempt in range(1, store.max_attempts + 1):
        answers = store._retrying("delete", None, functools.partial(_post_batch, store, pending))
        again: list[str] = []
        failed: list[tuple[str, int, str]] = []
        for full, (status, message) in zip(pending, answers, strict=True):
            if status in (200, 204):
                deleted += 1
            elif status == 404:
                continue  # already gone
            elif status in _RETRY_STATUS and attempt < store.max_attempts:
                again.append(full)
            else:
                failed.append((full, status, message))
        if failed:
            full, status, message = failed[0]
            hint = (
                "Grant storage.objects.delete to "
                + ("the runner-storage" if store.brokered else "this instance's")
                + " service account"
                if status == 403
                else "Check the bucket's retention policy and any object holds"
            )
            raise StoreError(
                f"could not delete gs://{store.bucket}/{full} ({status}: {message}) and "
                f"{len(failed) - 1} more; {before + deleted} deleted. {hint}"
            )
        if not again:
            return deleted
        pending = again
        time.sleep(min(10.0, 0.5 * 2 ** (attempt - 1)) * (0.5 + random.random()))
    return deleted


def _post_batch(store: GCSStore, fulls: list[str]) -> list[tuple[int, str]]:
    """One ``multipart/mixed`` batch of DELETE calls; each call's status and message."""
    boundary = f"trainbot-{uuid.uuid4().hex}"
    parts = [
        f"--{boundary}\r\nContent-Type: application/http\r\n"
        f"Content-Transfer-Encoding: binary\r\nContent-ID: <{i}>\r\n\r\n"
        f"DELETE /storage/v1/b/{store.bucket}/o/{quote(full, safe='')} HTTP/1.1\r\n\r\n"
        for i, full in enumerate(fulls)
    ]
    body = ("".join(parts) + f"--{boundary}--\r\n").encode()
    response = _check(
        store.http.post(
            f"{store.endpoint}/batch/storage/v1",
            data=body,
            headers={"Content-Type": f"multipart/mixed; boundary={boundary}"},
            timeout=store.timeout,
        )
    )
    return _batch_answers(response, len(fulls))


def _batch_answers(response: requests.Response, count: int) -> list[tuple[int, str]]:
    """Each call's (status, message) from a batch answer, in the order of the calls.

    Google names each answer ``Content-ID: <response-N>``; without names (some emulators),
    answers are taken in order.
    """
    head = f"Content-Type: {response.headers.get('Content-Type', '')}\r\n\r\n".encode()
    message = BytesParser().parsebytes(head + response.content)
    parts = message.get_payload()
    if not isinstance(parts, list) or len(parts) != count:
        raise _Status(502, f"a batch of {count} deletes got {len(parts or [])} answers")
    answers: list[tuple[int, str] | None] = [None] * count
    for position, part in enumerate(parts):
        content_id = str(part.get("Content-ID") or "")
        found = re.search(r"response-(\d+)", content_id)
        index = int(found.group(1)) if found else position
        raw = part.get_payload(decode=False)
        text = raw if isinstance(raw, str) else ""
        status_line, _, rest = text.lstrip().partition("\n")
        fields = status_line.split(" ", 2)
        status = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 502
        found_body = re.search(r"\r?\n\r?\n(.*)", rest, re.S)
        body = found_body.group(1).strip() if found_body else ""
        try:
            detail = str(json.loads(body).get("error", {}).get("message", "")) if body else ""
        except (ValueError, AttributeError):
            detail = body[:200]
        if 0 <= index < count:
            answers[index] = (status, detail)
    if any(a is None for a in answers):
        raise _Status(502, "a batch answer did not name every call")
    return [a for a in answers if a is not None]


class _MediaReader(io.RawIOBase):
    """A raw stream over one streamed GET, checked against the object's CRC32C at its end."""

    def __init__(self, store: GCSStore, key: str, response: requests.Response) -> None:
        self._store = store
        self._key = key
        self._response = response
        self._raw = response.raw
        length = response.headers.get("Content-Length")
        self._length = int(length) if length is not None and length.isdigit() else None
        found = re.search(r"crc32c=([A-Za-z0-9+/=]+)", response.headers.get("x-goog-hash", ""))
        self._expected = found.group(1) if found else None
        self._crc = 0
        self._got = 0
        self._checked = False

    def readable(self) -> bool:
        return True

    def _read(self, size: int) -> bytes:
        try:
            data = bytes(self._raw.read(size))
        except (OSError, urllib3.exceptions.HTTPError, requests.RequestException) as exc:
            raise StoreError(
                f"reading {self._key} from {self._store.uri} was cut off ({exc}): read it again"
            ) from exc
        if data:
            self._crc = _crc32c_update(self._crc, data)
            self._got += len(data)
        else:
            self._check()
        return data

    def _check(self) -> None:
        if self._checked:
            return
        self._checked = True
        if self._length is not None and self._got != self._length:
            raise StoreError(
                f"reading {self._key} from {self._store.uri} was cut off at {self._got} of "
                f"{self._length} bytes: read it again"
            )
        if self._expected is not None and _crc32c_b64(self._crc) != self._expected:
            raise StoreError(
                f"{self._key} from {self._store.uri} failed its CRC32C check (damaged in "
                "transit): read it again"
            )

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._read(len(view))
        view[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        chunks = []
        while data := self._read(8 * MiB):
            chunks.append(data)
        return b"".join(chunks)

    def close(self) -> None:
        if not self.closed:
            self._response.close()
        super().close()


class _ResumableWrite:
    """A resumable upload: buffers one chunk while the previous one is sent; commits on close.

    Memory stays under two chunks. An object that fits in one chunk goes as one multipart
    upload on close. The last request carries the object's CRC32C, and the answer's is
    compared with it too: a mismatch deletes what was committed and raises.
    """

    def __init__(self, store: GCSStore, key: str) -> None:
        self._store = store
        self._key = key
        self._full = store._full(key)
        self._buf = bytearray()
        self._session: str | None = None
        self._offset = 0  # bytes the service holds
        self._crc = 0
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: Future[None] | None = None
        self._done = False

    def write(self, data: bytes | memoryview, /) -> int:
        if self._done:
            raise ValueError(f"write to a closed stream for {self._key}")
        view = memoryview(data).cast("B")
        chunk = self._store.chunk_size
        pos = 0
        while pos < len(view):
            # A full chunk is sent only once more data comes, so the last request is never
            # empty and an object of exactly one chunk is one upload.
            if len(self._buf) >= chunk:
                self._send_chunk()
            take = min(chunk - len(self._buf), len(view) - pos)
            self._buf += view[pos : pos + take]
            pos += take
        return len(view)

    def _send_chunk(self) -> None:
        if self._session is None:
            try:
                self._session = self._store._retrying("upload", self._key, self._start)
            except BaseException:
                self._done = True
                self._buf = bytearray()
                raise
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gcs-upload")
        self._collect()
        body, self._buf = self._buf, bytearray()
        assert self._pool is not None
        self._inflight = self._pool.submit(self._put, body, False)

    def _start(self) -> str:
        store = self._store
        response = _check(
            store.http.post(
                f"{store.endpoint}/upload/storage/v1/b/{store.bucket}/o",
                params={"uploadType": "resumable", "name": self._full},
                data=json.dumps({"name": self._full, "contentType": _OCTET}),
                headers={
                    "Content-Type": "application/json; charset=UTF-8",
                    "X-Upload-Content-Type": _OCTET,
                },
                timeout=store.timeout,
            )
        )
        location = response.headers.get("Location")
        if not location:
            raise _Status(502, "the resumable upload was started without a session URI")
        return location

    def _collect(self) -> None:
        future, self._inflight = self._inflight, None
        if future is None:
            return
        try:
            future.result()
        except BaseException:
            self.abort()
            raise

    def _persisted(self) -> int | None:
        """Bytes the service holds for the session (None: the upload is already complete)."""
        store = self._store
        assert self._session is not None
        response = store.http.put(
            self._session,
            data=b"",
            headers={"Content-Range": "bytes */*"},
            timeout=store.timeout,
        )
        if response.status_code in (200, 201):
            return None
        if response.status_code != 308:
            _check(response)
            raise _Status(response.status_code, "unexpected answer to an upload status query")
        found = re.match(r"bytes=0-(\d+)", response.headers.get("Range", ""))
        return int(found.group(1)) + 1 if found else 0

    def _put(self, body: bytearray, final: bool) -> None:
        """Send one chunk from ``self._offset``; on a transient error, ask the service how
        much it holds and send the rest from there."""
        store = self._store
        assert self._session is not None
        start, view = self._offset, memoryview(body)
        end = start + len(view)
        self._crc = _crc32c_update(self._crc, view)
        op = "upload"
        sent = start
        for attempt in range(1, store.max_attempts + 1):
            if sent < end:
                headers = {"Content-Range": f"bytes {sent}-{end - 1}/{end if final else '*'}"}
            else:  # every byte is held; only the commit is missing
                headers = {"Content-Range": f"bytes */{end}"}
            if final:  # the service refuses to commit an object whose checksum differs
                headers["X-Goog-Hash"] = f"crc32c={_crc32c_b64(self._crc)}"
            try:
                response = store.http.put(
                    self._session,
                    # Any bytes-like body goes through urllib3 as it is: no copy.
                    data=cast(bytes, view[sent - start :]),
                    headers=headers,
                    timeout=store.timeout,
                )
                if response.status_code == 308:
                    found = re.match(r"bytes=0-(\d+)", response.headers.get("Range", ""))
                    sent = int(found.group(1)) + 1 if found else start
                    if sent >= end and not final:
                        self._offset = end
                        return
                    continue  # the service kept less than was sent: send the rest
                if response.status_code in (404, 410):
                    response.close()
                    raise StoreError(
                        f"the resumable upload of gs://{store.bucket}/{self._full} expired or "
                        "was cancelled: write the object again"
                    )
                _check(response)
                if not final:
                    raise _Status(502, "the upload was committed before its last chunk")
                self._offset = end
                self._verify(response)
                return
            except StoreError:
                raise
            except Exception as exc:
                if attempt == store.max_attempts or not _transient(exc):
                    raise store._error(exc, op=op, key=self._key) from exc
                time.sleep(min(10.0, 0.5 * 2 ** (attempt - 1)) * (0.5 + random.random()))
                try:
                    held = self._persisted()
                except Exception:
                    held = sent  # ask again after the next try
                if held is None:  # the last request did commit the object
                    self._offset = end
                    return
                sent = max(start, min(held, end))
        raise store._error(
            _Status(503, "the service kept accepting less than was sent"), op=op, key=self._key
        )

    def _verify(self, response: requests.Response) -> None:
        """Compare the committed object's CRC32C with what was sent; delete it if they differ."""
        try:
            resource = response.json()
        except ValueError:
            return
        theirs = resource.get("crc32c")
        ours = _crc32c_b64(self._crc)
        if theirs and theirs != ours:
            store = self._store
            generation = resource.get("generation")
            with_generation = {"ifGenerationMatch": generation} if generation else {}
            try:
                store.http.delete(
                    store._object_url(self._full), params=with_generation, timeout=store.timeout
                )
            except Exception:
                log.warning("could not delete the damaged upload of %s", self._full, exc_info=True)
            raise StoreError(
                f"the upload of gs://{store.bucket}/{self._full} was damaged in transit (CRC32C "
                f"{theirs}, sent {ours}) and has been deleted: write it again"
            )

    def close(self) -> None:
        if self._done:
            return
        if self._session is None:
            try:
                self._store._upload_whole(self._key, bytes(self._buf))
            finally:
                self._done = True
                self._buf = bytearray()
            return
        self._collect()
        body, self._buf = self._buf, bytearray()
        try:
            self._put(body, True)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._shutdown()

    def abort(self) -> None:
        """Drop the buffer and cancel the session; never raises, since it runs while
        handling errors."""
        self._done = True
        self._buf = bytearray()
        self._shutdown()
        session, self._session = self._session, None
        if session is None:
            return
        store = self._store
        try:
            response = store.http.delete(session, timeout=store.timeout)
            response.close()
        except Exception as exc:
            log.debug("cancelling the upload of %s failed (%s)", self._full, exc)
            return
        if response.status_code in (499, 404, 410) or response.status_code < 300:
            return  # 499 is the service's answer to a cancel
        # Some emulators cannot cancel (501); the session then holds no object either.
        log.debug(
            "the upload session of %s was not cancelled (%d); it expires in a week",
            self._full,
            response.status_code,
        )

    def _shutdown(self) -> None:
        # A chunk still being sent could outlive the cancel: wait for it first.
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._inflight = None
