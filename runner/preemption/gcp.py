"""The GCE notice: a long poll on the metadata server's ``instance/preempted``, which
``stop()`` interrupts by shutting the pending socket down.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import math
import socket
import threading
import time
from urllib.parse import quote

from runner.env import TERMINATION_WINDOWS_S as WINDOWS_S
from runner.preemption.flag import Notice, PreemptionFlag
from runner.preemption.metadata import (
    NETWORK_ERRORS,
    Endpoint,
    MetadataUnavailable,
    PollerThread,
    exchange,
)

log = logging.getLogger(__name__)


class GcpPreemptedPoller(PollerThread):
    """Long-poll GCE's ``instance/preempted``, which turns TRUE about 30 s before the
    instance is stopped. Each long poll is bounded by ``timeout_s`` on the server side,
    and stop() shuts the pending socket down, so stopping never waits for one."""

    name = "trainbot-gcp-preempted-poller"

    def __init__(
        self,
        flag: PreemptionFlag,
        *,
        base_url: str = "http://metadata.google.internal",
        window_s: float = WINDOWS_S["gcp"],
        timeout_s: float = 10.0,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
    ) -> None:
        super().__init__()
        self._flag = flag
        self._endpoint = Endpoint(base_url, what="GCP")
        self._window_s = window_s
        self._timeout_sec = max(1, math.ceil(timeout_s))
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._lock = threading.Lock()  # guards _conn between the poller and stop()
        self._conn: http.client.HTTPConnection | None = None

    def __repr__(self) -> str:
        return f"GcpPreemptedPoller({self._endpoint.host}:{self._endpoint.port})"

    def _run(self) -> None:
        etag: str | None = None
        first = True
        backoff = self._retry_s
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                value, etag = self._ask(etag, wait=not first)
            except NETWORK_ERRORS as exc:
                if self._stopping.is_set():
                    return
                log.debug("GCE metadata not reachable (%s); retrying in %.1f s", exc, backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, self._max_retry_s)
                continue
            backoff = self._retry_s
            if value == "TRUE":
                now = time.monotonic()
                self._flag.set(
                    Notice(
                        source="gcp",
                        reason="GCE instance preempted",
                        received_at=now,
                        deadline=now + self._window_s,
                    )
                )
                log.warning("preemption notice from GCE metadata")
                return
            # A long poll that answers FALSE early means the server is not waiting; do
            # not spin on it.
            if not first and time.monotonic() - started < self._timeout_sec / 2:
                self._stopping.wait(self._retry_s)
            first = False

    def _ask(self, etag: str | None, *, wait: bool) -> tuple[str, str | None]:
        path = self._endpoint.prefix + "/computeMetadata/v1/instance/preempted"
        if wait:
            path += f"?wait_for_change=true&timeout_sec={self._timeout_sec}"
            if etag:
                path += "&last_etag=" + quote(etag, safe="")
        conn = self._endpoint.connect(timeout=self._timeout_sec + 2.0)
        with self._lock:
            if self._stopping.is_set():
                conn.close()
                raise MetadataUnavailable("stopping")
            self._conn = conn
        try:
            reply = exchange(conn, "GET", path, {"Metadata-Flavor": "Google"})
        finally:
            with self._lock:
                self._conn = None
            conn.close()
        if reply.status != 200:
            raise MetadataUnavailable(f"instance/preempted answered HTTP {reply.status}")
        value = reply.body.decode("ascii", "replace").strip().upper()
        return value, reply.etag or etag

    def _interrupt(self) -> None:
        with self._lock:
            conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
