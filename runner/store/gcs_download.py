"""Verified reads for the Cloud Storage store: one streamed GET, checked at its end."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import requests
import urllib3

from runner.errors import StoreError
from runner.store._common import RawDownload
from runner.store.gcs_http import MiB, crc32c_b64, crc32c_update

if TYPE_CHECKING:
    from runner.store.gcs import GCSStore


class MediaReader(RawDownload):
    """A raw stream over one streamed GET, checked against the object's CRC32C at its end."""

    def __init__(self, store: GCSStore, key: str, response: requests.Response) -> None:
        super().__init__(store.uri, key, response)
        self._raw = response.raw
        length = response.headers.get("Content-Length")
        self._length = int(length) if length is not None and length.isdigit() else None
        found = re.search(r"crc32c=([A-Za-z0-9+/=]+)", response.headers.get("x-goog-hash", ""))
        self._expected = found.group(1) if found else None
        self._crc = 0
        self._got = 0
        self._checked = False

    def _read(self, size: int | None) -> bytes:
        try:
            data = bytes(self._raw.read(size))
        except (OSError, urllib3.exceptions.HTTPError, requests.RequestException) as exc:
            raise self._cut_off(exc) from exc
        if data:
            self._crc = crc32c_update(self._crc, data)
            self._got += len(data)
        else:
            self.check()
        return data

    def check(self) -> None:
        if self._checked:
            return
        self._checked = True
        if self._length is not None and self._got != self._length:
            raise StoreError(
                f"reading {self._key} from {self._uri} was cut off at {self._got} of "
                f"{self._length} bytes: read it again"
            )
        if self._expected is not None and crc32c_b64(self._crc) != self._expected:
            raise StoreError(
                f"{self._key} from {self._uri} failed its CRC32C check (damaged in "
                "transit): read it again"
            )

    def readall(self) -> bytes:
        chunks = []
        while data := self._read(8 * MiB):
            chunks.append(data)
        return b"".join(chunks)
