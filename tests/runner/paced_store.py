"""A store whose uploads move at a set bandwidth, which a test can slow down at any
moment (at a preemption notice, say): an object store seen from a host whose network
is throttled as it is taken away, or from one of many preempted hosts writing to the
same bucket at once. It wraps a real store (a local directory, or moto's S3): only the
pace is made up, the bytes go through the real store's protocol. :class:`SlowReads` is
its counterpart for reads (a slow restore)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import BinaryIO

from runner.store import ObjectInfo, Store, WriteStream


class _PacedWrite:
    def __init__(self, inner: WriteStream, store: PacedStore) -> None:
        self.inner = inner
        self.store = store

    def write(self, data: bytes | memoryview, /) -> int:
        n = self.inner.write(data)
        # Read per chunk: a slowdown set while a write is under way slows its rest.
        time.sleep(len(data) * self.store.slowdown / self.store.bps)
        return n

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


class Forwarding:
    """A store that forwards every call to ``inner``: the paced stores below change one."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.uri = inner.uri

    def open_write(self, key: str) -> WriteStream:
        return self.inner.open_write(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)

    def open_read(self, key: str) -> BinaryIO:
        return self.inner.open_read(key)

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, keys: Sequence[str]) -> int:
        return self.inner.delete(keys)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)


class PacedStore(Forwarding):
    """Uploads at ``bps / slowdown`` bytes a second; small objects, reads, lists and
    deletes at the inner store's own speed."""

    def __init__(self, inner: Store, bps: float) -> None:
        super().__init__(inner)
        self.bps = bps
        #: How many times slower than ``bps`` uploads go from now on.
        self.slowdown = 1.0

    def open_write(self, key: str) -> WriteStream:
        return _PacedWrite(self.inner.open_write(key), self)


#: Bytes a paced read hands over at a time (a reader can cancel between them).
READ_PIECE = 64 << 10


class _PacedRead:
    """A file read at a set pace, a piece at a time."""

    def __init__(self, inner: BinaryIO, bps: float) -> None:
        self.inner = inner
        self.bps = bps

    def readinto(self, view: memoryview) -> int:
        n = self.inner.readinto(view[:READ_PIECE])  # type: ignore[attr-defined]
        time.sleep(n / self.bps)
        return int(n or 0)

    def __enter__(self) -> _PacedRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()


class SlowReads(Forwarding):
    """A store whose file reads move at ``bps`` bytes a second; everything else (the
    manifest, listings, writes) at the inner store's speed."""

    def __init__(self, inner: Store, bps: float) -> None:
        super().__init__(inner)
        self.bps = bps

    def open_read(self, key: str) -> BinaryIO:
        return _PacedRead(self.inner.open_read(key), self.bps)  # type: ignore[return-value]
