"""The Cloud Storage JSON API as the store speaks it directly: error answers, which of
them are worth another try, and CRC32C checksums.

Imported only by the ``runner.store.gcs*`` modules, so only for a ``gs://`` URI.
"""

from __future__ import annotations

import base64
import random

import google_crc32c
import requests
import urllib3
from google.api_core import exceptions as api_exceptions
from google.auth.exceptions import TransportError

MiB = 1 << 20
#: Resumable chunks (all but the last) must be multiples of this.
CHUNK_ALIGN = 256 << 10
#: Default chunk: large enough that a 10 GiB shard takes 160 requests.
DEFAULT_CHUNK_SIZE = 64 * MiB
OCTET = "application/octet-stream"
#: Statuses worth another try (Google's retry strategy for Cloud Storage).
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CRC_PIECE = CHUNK_ALIGN  # google_crc32c takes bytes only: checksum in small copies
#: The jitter's own generator (OS entropy): the global ``random`` is the training script's,
#: and a draw from it by a checkpoint write would change the run's random stream.
_JITTER = random.SystemRandom()


def backoff_s(attempt: int) -> float:
    """Seconds to wait before try ``attempt + 1``: exponential, capped, jittered."""
    return min(10.0, 0.5 * 2 ** (attempt - 1)) * (0.5 + _JITTER.random())


def crc32c_update(crc: int, data: bytes | bytearray | memoryview) -> int:
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _CRC_PIECE):
        crc = google_crc32c.extend(crc, bytes(view[start : start + _CRC_PIECE]))
    return crc


def crc32c_b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


class StatusError(Exception):
    """An HTTP error answer of the JSON API (raised by the direct calls)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def answer_message(response: requests.Response) -> str:
    try:
        body = response.json()
        error = body.get("error", {}) if isinstance(body, dict) else {}
        return str(error.get("message") or body)[:500]
    except ValueError:
        return (response.text or response.reason or "")[:500]


def check(response: requests.Response) -> requests.Response:
    if response.status_code >= 400:
        message = answer_message(response)
        response.close()
        raise StatusError(response.status_code, message)
    return response


def transient(exc: BaseException) -> bool:
    if isinstance(exc, StatusError):
        return exc.status in RETRY_STATUS
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return exc.code in RETRY_STATUS
    network = (requests.ConnectionError, requests.Timeout, TransportError)
    return isinstance(exc, (*network, urllib3.exceptions.HTTPError))
