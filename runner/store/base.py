"""The Store protocol every checkpoint store implements, and what crosses it.

A store is a flat namespace of keys (``run-1/step-0000000010/shard-00000.bin``) under a
root URI. Objects are written through a stream that commits on ``close()`` and is
discarded on ``abort()``, so a half-written object never shows under its key. Small
objects (the manifest) are written with :meth:`Store.put_bytes`, which is atomic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from runner.errors import StoreError

#: S3's DeleteObjects takes at most this many keys a call; local deletes use it too.
DELETE_BATCH = 1000


@dataclass(frozen=True)
class ObjectInfo:
    """One object in a store."""

    #: Key relative to the store root, "/"-separated.
    key: str
    #: Size in bytes.
    size: int
    #: Last modification, seconds since the epoch.
    mtime: float


class WriteStream(Protocol):
    """A binary stream that creates one object when closed."""

    def write(self, data: bytes | memoryview, /) -> int: ...

    def close(self) -> None:
        """Make the object durable and visible under its key."""

    def abort(self) -> None:
        """Discard everything written; the key keeps whatever it had before."""


class Store(Protocol):
    """Where checkpoints live. Keys are relative to the root URI."""

    #: The root URI, normalised (``file:///abs/path`` or ``s3://bucket/prefix``).
    uri: str

    def open_write(self, key: str) -> WriteStream: ...

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object atomically and durably."""

    def open_read(self, key: str) -> BinaryIO:
        """A readable binary stream (``read``/``readinto``); raises StoreError if absent."""

    def get_bytes(self, key: str) -> bytes: ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""

    def delete(self, keys: Sequence[str]) -> int:
        """Delete keys in batches of at most DELETE_BATCH; returns how many were deleted."""

    def exists(self, key: str) -> bool: ...


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"invalid object key {key!r}: use a relative path without '..'")
    return key
