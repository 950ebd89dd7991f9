"""Staging on Cloud Storage: the JSON API's ``objects.rewrite``, one call at a time.

A rewrite between locations may take several calls; each answer carries a
``rewriteToken`` that the next call sends to go on. The token is stored after each
call, so a copy resumed after a restart sends it and Cloud Storage continues where it
was (a token it no longer accepts starts that object again). ``STORAGE_EMULATOR_HOST``
points the client at an emulator, with anonymous credentials.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from jobs.staging.copier import ObjectRef, Progress, SaveProgress, StagingError, StoreURI

__all__ = ["GCSCopier"]


class GCSCopier:
    def __init__(self, *, project: str | None = None) -> None:
        host = os.environ.get("STORAGE_EMULATOR_HOST")
        if host:
            self._client: Any = storage.Client(
                project=project or "trainbot",
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": host if "://" in host else f"http://{host}"},
            )
        else:
            self._client = storage.Client(project=project)

    def region(self, bucket: str) -> str | None:
        try:
            found = self._client.get_bucket(bucket).location
        except gexc.NotFound:
            raise StagingError(f"the bucket gs://{bucket} does not exist") from None
        except gexc.GoogleAPIError:
            return None
        return str(found).lower() if found else None

    def list_after(self, src: StoreURI, after: str | None) -> Iterator[ObjectRef]:
        try:
            blobs = self._client.list_blobs(
                src.bucket, prefix=src.prefix or None, start_offset=after or None
            )
            for blob in blobs:
                if after is not None and blob.name <= after:
                    continue
                if not blob.name.endswith("/"):
                    yield ObjectRef(blob.name, int(blob.size or 0))
        except gexc.GoogleAPIError as exc:
            raise StagingError(f"cannot list {src.uri(src.prefix)}: {exc}") from None

    def copy(
        self,
        obj: ObjectRef,
        *,
        src: StoreURI,
        dst: StoreURI,
        dst_key: str,
        progress: Progress,
        save: SaveProgress,
    ) -> None:
        source = self._client.bucket(src.bucket).blob(obj.key)
        target = self._client.bucket(dst.bucket).blob(dst_key)
        done = progress.bytes_done()
        while True:
            try:
                token, rewritten, _total = self._rewrite(target, source, progress.token)
            except gexc.BadRequest:
                if progress.token is None:
                    raise
                progress.token, progress.parts, done = None, [], 0  # a stale token
                continue
            progress.parts = [
                *progress.parts,
                {"n": len(progress.parts) + 1, "size": rewritten - done},
            ]
            done = rewritten
            progress.token = token
            save(progress)
            if token is None:
                return

    def _rewrite(self, target: Any, source: Any, token: str | None) -> tuple[str | None, int, int]:
        token, rewritten, total = target.rewrite(source, token=token)
        return token or None, int(rewritten), int(total)

    def delete_prefix(self, dst: StoreURI) -> int:
        blobs = list(self._client.list_blobs(dst.bucket, prefix=dst.prefix or None))
        for blob in blobs:
            blob.delete()
        return len(blobs)
