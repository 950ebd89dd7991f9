"""What the metadata pollers share: the ``Poller`` interface, a daemon thread that stops
promptly, and plain-HTTP requests to a link-local metadata server (standard library only).
"""

from __future__ import annotations

import http.client
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from runner.preemption.flag import PreemptionConfigError

log = logging.getLogger(__name__)


class Poller(Protocol):
    """A background watcher that sets the flag when its metadata server says so."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    @property
    def running(self) -> bool: ...


class MetadataUnavailable(Exception):
    """The metadata server answered, but not usefully; retried like a network error."""


#: What a network problem with the metadata server looks like; the pollers retry these.
NETWORK_ERRORS = (OSError, http.client.HTTPException, MetadataUnavailable)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    etag: str | None


class Endpoint:
    """A metadata server's base URL, checked once. Plain http.client, no urllib: proxy
    variables must never route a link-local metadata request elsewhere."""

    def __init__(self, base_url: str, *, what: str) -> None:
        parts = urlsplit(base_url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme != "http" or not parts.hostname or port == -1:
            raise PreemptionConfigError(
                f"{what} metadata URL {base_url!r} is not usable; give an http:// URL such "
                "as http://169.254.169.254 (AWS) or http://metadata.google.internal (GCP)"
            )
        self.host = parts.hostname
        self.port = port or 80
        self.prefix = parts.path.rstrip("/")

    def connect(self, *, timeout: float) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.connect()
        return conn


def exchange(
    conn: http.client.HTTPConnection, method: str, path: str, headers: Mapping[str, str]
) -> Reply:
    conn.request(method, path, headers=dict(headers))
    resp = conn.getresponse()
    body = resp.read()
    return Reply(status=resp.status, body=body, etag=resp.getheader("ETag"))


class PollerThread:
    """The start/stop life of a daemon thread that sleeps on an Event, so stop() is prompt."""

    name = "trainbot-poller"

    def __init__(self) -> None:
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._guarded, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._interrupt()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _guarded(self) -> None:
        try:
            self._run()
        except Exception:  # a watcher that dies silently is worse than a noisy one
            log.exception("%s stopped unexpectedly; preemption notices from it are lost", self)

    def _run(self) -> None:
        raise NotImplementedError

    def _interrupt(self) -> None:
        """Abort a request in flight, for pollers that block on one."""
