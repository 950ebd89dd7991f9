"""What the staging engine asks of a store: list a prefix in key order, copy one object
server-side in resumable steps. One module per store (:mod:`.s3`, :mod:`.gcs`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlparse

from jobs.domain.errors import TrainbotError

__all__ = [
    "Copier",
    "ObjectRef",
    "Progress",
    "StagingError",
    "StoreURI",
    "split_uri",
]


class StagingError(TrainbotError):
    """A copy cannot start or go on; the message says why and what to do."""


@dataclass(frozen=True)
class StoreURI:
    """``s3://bucket/prefix/`` split; ``prefix`` is empty or ends with ``/``."""

    scheme: str
    bucket: str
    prefix: str

    def uri(self, key: str = "") -> str:
        return f"{self.scheme}://{self.bucket}/{key}"


def split_uri(uri: str) -> StoreURI:
    """Parse a dataset or staging-bucket URI (``s3://`` or ``gs://``): the prefix is a
    folder, so ``s3://b/data`` covers ``data/…`` and not ``data2/…``."""
    parsed = urlparse(uri.strip())
    if parsed.scheme not in ("s3", "gs") or not parsed.netloc:
        raise StagingError(
            f"{uri!r} is not a bucket URI: staging copies s3://BUCKET/PREFIX or gs://BUCKET/PREFIX"
        )
    prefix = parsed.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return StoreURI(parsed.scheme, parsed.netloc, prefix)


@dataclass(frozen=True)
class ObjectRef:
    """One source object: its key and size."""

    key: str
    size: int


@dataclass
class Progress:
    """The object in progress, as stored: what a resumed copy goes on from."""

    #: S3's multipart upload id, or GCS's rewrite token; None: not started.
    token: str | None = None
    #: Parts copied so far (S3: ``{"n", "etag", "size"}``; GCS: ``{"bytes"}`` per call).
    parts: list[dict[str, Any]] = field(default_factory=list)
    #: Whether the step being saved copied bytes (False: it only started an upload).
    copied: bool = True

    def bytes_done(self) -> int:
        return sum(int(p.get("size", 0)) for p in self.parts)


#: Called by a copier after each step with the progress to store; it raises to stop
#: the copy (the control plane is shutting down).
SaveProgress = Callable[[Progress], None]


class Copier(Protocol):
    """Server-side copies within one store (S3 to S3, GCS to GCS)."""

    def region(self, bucket: str) -> str | None:
        """The bucket's region (None: the store will not say)."""
        ...

    def list_after(self, src: StoreURI, after: str | None) -> Iterator[ObjectRef]:
        """The objects under ``src`` whose keys sort after ``after``, in key order."""
        ...

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
        """Copy ``obj`` to ``dst_key``, going on from ``progress``, calling ``save``
        after each step."""
        ...

    def delete_prefix(self, dst: StoreURI) -> int:
        """Delete every object under ``dst``; how many."""
        ...
