"""What the S3 and Cloud Storage stores share: a bucket and prefix that name the objects,
the choice of credentials, and the raw reader and part-buffering writer they stream with.

No cloud SDK is imported here; each store module keeps its own.
"""

from __future__ import annotations

import abc
import io
import os
import re
from dataclasses import KW_ONLY, dataclass, field
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


#: Per scheme: the service's name in messages, the bucket names it accepts (checked early,
#: so a typo is a BadURIError) and the characters that pattern allows, in words.
_BUCKET_NAMES: dict[str, tuple[str, re.Pattern[str], str]] = {
    # botocore's own (loose) rule.
    "s3": ("S3", re.compile(r"^[a-zA-Z0-9.\-_]{1,255}$"), "letters, digits, '.', '-' or '_'"),
    # Starts and ends with a letter or digit.
    "gs": (
        "Cloud Storage",
        re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$"),
        "lowercase letters, digits, '-', '_' or '.'",
    ),
}


@dataclass(eq=False, repr=False)
class BucketStore(abc.ABC):
    """A store rooted at ``scheme://bucket/prefix``; key ``k`` lives at ``prefix/k``.

    The constructor's arguments are its fields, a subclass's own ones keyword-only after
    these. Constructing checks the bucket, the subclass's options (``_check_options``) and
    the choice of credentials, then connects (``_connect``).
    """

    #: The URI scheme (``s3``, ``gs``).
    scheme: ClassVar[str]
    #: What the broker's and the default credentials are, in words, for the message when
    #: the choice is neither.
    broker_signs: ClassVar[str]
    default_signs: ClassVar[str]

    bucket: str
    prefix: str = ""
    _: KW_ONLY
    #: Tries of a call before its error is raised.
    max_attempts: int = 5
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    #: ``"default"`` (the instance's own credentials) or ``"broker"`` (the control plane's,
    #: for this run's prefix); unset means ``TRAINBOT_STORE_CREDENTIALS``, else the default.
    credentials: str | None = None
    #: ``scheme://bucket/prefix``.
    uri: str = field(init=False)
    #: Whether the store signs with the broker's credentials for this prefix alone.
    brokered: bool = field(init=False)

    def __post_init__(self) -> None:
        service, pattern, chars = _BUCKET_NAMES[self.scheme]
        if not pattern.match(self.bucket):
            raise BadURIError(
                f"{self.bucket!r} is not a valid {service} bucket name: write "
                f"{self.scheme}://BUCKET/PREFIX with {chars} in the bucket name"
            )
        self.prefix = "/".join(p for p in self.prefix.split("/") if p)
        root = f"{self.scheme}://{self.bucket}"
        self.uri = f"{root}/{self.prefix}" if self.prefix else root
        self._check_options()
        source = credential_source(
            self.credentials, broker=self.broker_signs, default=self.default_signs
        )
        self.brokered = source == "broker"
        self._connect()

    @abc.abstractmethod
    def _check_options(self) -> None:
        """Raise ValueError for an option the store cannot work with."""

    @abc.abstractmethod
    def _connect(self) -> None:
        """Build the client every call goes through."""

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
