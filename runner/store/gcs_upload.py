"""Resumable uploads for the Cloud Storage store, streamed from memory and CRC32C-checked.

A ``BlobWriter`` has no abort (closing it, as ``with`` does on an exception, commits the
truncated object) and sends each chunk inside ``write``; this writer fills the next chunk
while the previous one is sent, and :meth:`ResumableWrite.abort` cancels the session.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

import requests

from runner.errors import StoreError
from runner.store._common import PartWrite
from runner.store.gcs_http import (
    OCTET,
    StatusError,
    backoff_s,
    check,
    crc32c_b64,
    crc32c_update,
    transient,
)

if TYPE_CHECKING:
    from runner.store.gcs import GCSStore

log = logging.getLogger(__name__)


def upload_whole(store: GCSStore, key: str, data: bytes) -> None:
    """One multipart upload: atomic, and the service checks the CRC32C (sent in the
    metadata) before it commits.

    Sent through the JSON API directly rather than ``blob.upload_from_string``: the
    client library draws each multipart boundary from Python's global ``random``, the
    training script's own generator, which would make a resumed run's random stream
    differ from the one its checkpoint saved. This boundary comes from OS entropy.
    """
    full = store._full(key)
    boundary = f"trainbot-{uuid.uuid4().hex}"
    meta = {"name": full, "contentType": OCTET, "crc32c": crc32c_b64(crc32c_update(0, data))}
    body = b"".join(
        (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
            json.dumps(meta).encode(),
            f"\r\n--{boundary}\r\nContent-Type: {OCTET}\r\n\r\n".encode(),
            data,
            f"\r\n--{boundary}--\r\n".encode(),
        )
    )

    def post() -> None:
        check(
            store.http.post(
                f"{store.endpoint}/upload/storage/v1/b/{store.bucket}/o",
                params={"uploadType": "multipart"},
                data=body,
                headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
                timeout=store.timeout,
            )
        ).close()

    store._retrying("upload", key, post)


class ResumableWrite(PartWrite):
    """A resumable upload: buffers one chunk while the previous one is sent; commits on close.

    Memory stays under two chunks. An object that fits in one chunk goes as one multipart
    upload on close. The last request carries the object's CRC32C, and the answer's is
    compared with it too: a mismatch deletes what was committed and raises.
    """

    def __init__(self, store: GCSStore, key: str) -> None:
        super().__init__(key, store.chunk_size)
        self._store = store
        self._full = store._full(key)
        self._session: str | None = None
        self._offset = 0  # bytes the service holds
        self._crc = 0
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: Future[None] | None = None

    def _send_part(self) -> None:
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
        response = check(
            store.http.post(
                f"{store.endpoint}/upload/storage/v1/b/{store.bucket}/o",
                params={"uploadType": "resumable", "name": self._full},
                data=json.dumps({"name": self._full, "contentType": OCTET}),
                headers={
                    "Content-Type": "application/json; charset=UTF-8",
                    "X-Upload-Content-Type": OCTET,
                },
                timeout=store.timeout,
            )
        )
        location = response.headers.get("Location")
        if not location:
            raise StatusError(502, "the resumable upload was started without a session URI")
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
            check(response)
            raise StatusError(response.status_code, "unexpected answer to an upload status query")
        found = re.match(r"bytes=0-(\d+)", response.headers.get("Range", ""))
        return int(found.group(1)) + 1 if found else 0

    def _put(self, body: bytearray, final: bool) -> None:
        """Send one chunk from ``self._offset``; on a transient error, ask the service how
        much it holds and send the rest from there."""
        store = self._store
        assert self._session is not None
        start, view = self._offset, memoryview(body)
        end = start + len(view)
        self._crc = crc32c_update(self._crc, view)
        op = "upload"
        sent = start
        for attempt in range(1, store.max_attempts + 1):
            if sent < end:
                headers = {"Content-Range": f"bytes {sent}-{end - 1}/{end if final else '*'}"}
            else:  # every byte is held; only the commit is missing
                headers = {"Content-Range": f"bytes */{end}"}
            if final:  # the service refuses to commit an object whose checksum differs
                headers["X-Goog-Hash"] = f"crc32c={crc32c_b64(self._crc)}"
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
                check(response)
                if not final:
                    raise StatusError(502, "the upload was committed before its last chunk")
                self._offset = end
                self._verify(response)
                return
            except StoreError:
                raise
            except Exception as exc:
                if attempt == store.max_attempts or not transient(exc):
                    raise store._error(exc, op=op, key=self._key) from exc
                time.sleep(backoff_s(attempt))
                try:
                    held = self._persisted()
                except Exception:
                    held = sent  # ask again after the next try
                if held is None:  # the last request did commit the object
                    self._offset = end
                    return
                sent = max(start, min(held, end))
        raise store._error(
            StatusError(503, "the service kept accepting less than was sent"), op=op, key=self._key
        )

    def _verify(self, response: requests.Response) -> None:
        """Compare the committed object's CRC32C with what was sent; delete it if they differ."""
        try:
            resource = response.json()
        except ValueError:
            return
        theirs = resource.get("crc32c")
        ours = crc32c_b64(self._crc)
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
                upload_whole(self._store, self._key, bytes(self._buf))
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
