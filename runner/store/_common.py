"""What the S3 and Cloud Storage stores share: a bucket and prefix that name the objects,
the choice of credentials, and the raw reader and part-buffering writer they stream with.

No cloud SDK is imported here; each store module keeps its own.
"""

from __future__ import annotations

import io
import os
import re
from typing import Any, BinaryIO, ClassVar, Protocol

from runner.errors import BadURIError, StoreError
from runner.store.base import check_key
from runner.store.broker import STORE_CREDENTIALS_ENV


def credential_source(credentials: str | None, *, broker: str, default: str) -> str:
    """``"broker"`` or ``"default"``: the argument, else ``TRAINBOT_STORE_CREDENTIALS``.

    ``broker`` and ``default`` say what each choice signs with, for the error message.
    """
    source = credentials or os.environ.get(STORE_CREDENTIALS_ENV) or "default"
    if source not in ("default", "broker"):
        raise StoreError(
            f"{STORE_CREDENTIALS_ENV}={source!r}: write 'broker' ({broker}) "
            f"or leave it unset ({default})"
        )
    return source


class BucketStore:
    """A store rooted at ``scheme://bucket/prefix``; key ``k`` lives at ``prefix/k``."""

    #: The URI scheme (``s3``, ``gs``).
    scheme: ClassVar[str]
    #: The service's name in messages.
    service: ClassVar[str]
    #: The bucket names the service accepts, checked early so a typo is a BadURIError.
    bucket_pattern: ClassVar[re.Pattern[str]]
    #: The characters that pattern allows, in words.
    bucket_chars: ClassVar[str]

    def __init__(self, bucket: str, prefix: str) -> None:
        if not self.bucket_pattern.match(bucket):
            raise BadURIError(
                f"{bucket!r} is not a valid {self.service} bucket name: write "
                f"{self.scheme}://BUCKET/PREFIX with {self.bucket_chars} in the bucket name"
            )
        self.bucket = bucket
        self.prefix = "/".join(p for p in prefix.split("/") if p)
        root = f"{self.scheme}://{bucket}"
        self.uri = f"{root}/{self.prefix}" if self.prefix else root

    def _full(self, key: str) -> str:
        key = check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self, key: str | None) -> str:
        """The URI of ``key``, or the store's when there is none (for messages)."""
        return f"{self.scheme}://{self.bucket}/{self._full(key)}" if key is not None else self.uri

    def _prefix_pattern(self) -> str:
        """Every object under the prefix, as IAM resources name them."""
        return f"{self.prefix + '/' if self.prefix else ''}*"

    def open_read(self, key: str) -> BinaryIO:
        raise NotImplementedError

    def get_bytes(self, key: str) -> bytes:
        with self.open_read(key) as f:
            return f.read()


class _Closable(Protocol):
    def close(self) -> None: ...


class RawDownload(io.RawIOBase):
    """A raw stream over one download, so ``io.BufferedReader`` can sit on top of it.

    Subclasses say how to ``_read``; closing the stream closes ``source``.
    """

    def __init__(self, uri: str, key: str, source: _Closable) -> None:
        self._uri = uri
        self._key = key
        self._source = source

    def readable(self) -> bool:
        return True

    def _read(self, size: int | None) -> bytes:
        raise NotImplementedError

    def _cut_off(self, exc: BaseException) -> StoreError:
        return StoreError(
            f"reading {self._key} from {self._uri} was cut off ({exc}): read it again"
        )

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._read(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._source.close()
        super().close()


class PartWrite:
    """Fills a buffer up to ``part_size`` and hands each full one to ``_send_part``.

    A full part is sent only once more data comes, so the last request is never empty and
    an object of exactly one part goes out in a single request on close.
    """

    def __init__(self, key: str, part_size: int) -> None:
        self._key = key
        self._part_size = part_size
        self._buf = bytearray()
        self._done = False

    def _send_part(self) -> None:
        raise NotImplementedError

    def write(self, data: bytes | memoryview, /) -> int:
        if self._done:
            raise ValueError(f"write to a closed stream for {self._key}")
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            if len(self._buf) >= self._part_size:
                self._send_part()
            take = min(self._part_size - len(self._buf), len(view) - pos)
            self._buf += view[pos : pos + take]
            pos += take
        return len(view)
